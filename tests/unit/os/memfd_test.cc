#include "os/memfd.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace weightcache::os {
namespace {

TEST(MemfdTest, FillUnmapSealThenWritesFailWithEperm) {
  auto fd = CreateMemfd("weights", 4096);
  ASSERT_TRUE(fd.ok()) << fd.status().ToString();
  EXPECT_TRUE(::fcntl(fd->get(), F_GETFD) & FD_CLOEXEC);
  {
    auto rw = MapReadWrite(fd->get(), 4096);
    ASSERT_TRUE(rw.ok()) << rw.status().ToString();
    std::memcpy(rw->data(), "tensor bytes", 12);
    // While the writable mapping exists, F_SEAL_WRITE is refused with EBUSY.
    Status busy = SealReadOnly(fd->get());
    ASSERT_FALSE(busy.ok());
    EXPECT_EQ(busy.sys_errno(), EBUSY);
    EXPECT_NE(busy.message().find("munmap it first"), std::string::npos);
  }
  ASSERT_TRUE(SealReadOnly(fd->get()).ok());
  EXPECT_TRUE(CheckSealedReadOnly(fd->get()).ok());

  errno = 0;
  EXPECT_EQ(::pwrite(fd->get(), "x", 1, 0), -1);
  EXPECT_EQ(errno, EPERM);
  EXPECT_EQ(::ftruncate(fd->get(), 8192), -1);
  EXPECT_EQ(errno, EPERM);
  auto rw_again = MapReadWrite(fd->get(), 4096);
  ASSERT_FALSE(rw_again.ok());
  EXPECT_EQ(rw_again.status().sys_errno(), EPERM);

  auto ro = MapReadOnly(fd->get(), 4096);
  ASSERT_TRUE(ro.ok()) << ro.status().ToString();
  EXPECT_EQ(std::memcmp(ro->data(), "tensor bytes", 12), 0);
}

TEST(MemfdTest, UnsealedMemfdFailsTheCheckNamingMissingSeals) {
  auto fd = CreateMemfd("open", 16);
  ASSERT_TRUE(fd.ok());
  Status s = CheckSealedReadOnly(fd->get());
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kPermissionDenied);
  EXPECT_NE(s.message().find("missing F_SEAL_WRITE F_SEAL_SHRINK F_SEAL_GROW"), std::string::npos)
      << s.message();
}

TEST(MemfdTest, MappingBeyondTheFileIsRefused) {
  auto fd = CreateMemfd("small", 100);
  ASSERT_TRUE(fd.ok());
  auto r = MapReadOnly(fd->get(), 4096);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("which holds only 100"), std::string::npos);
}

TEST(MemfdTest, RegionMovesAndZeroSizeIsEmpty) {
  auto fd = CreateMemfd("m", 8192);
  ASSERT_TRUE(fd.ok());
  auto r = MapReadOnly(fd->get(), 8192);
  ASSERT_TRUE(r.ok());
  MappedRegion moved = std::move(r).value();
  EXPECT_NE(moved.data(), nullptr);
  EXPECT_EQ(moved.size(), 8192u);
  auto empty = MapReadOnly(fd->get(), 0);
  ASSERT_TRUE(empty.ok());
  EXPECT_EQ(empty->data(), nullptr);
  EXPECT_EQ(empty->size(), 0u);
}

// A region unmaps exactly once: when its last owner goes, not when a moved-from one does.
TEST(MemfdTest, RegionIsUnmappedWhenItsOwnerIsDestroyed) {
  auto fd = CreateMemfd("m", 8192);
  ASSERT_TRUE(fd.ok());
  void* data = nullptr;
  {
    auto r = MapReadOnly(fd->get(), 8192);
    ASSERT_TRUE(r.ok());
    data = r->data();
    {
      MappedRegion moved = std::move(r).value();
      MappedRegion target;
      target = std::move(moved);
      EXPECT_EQ(moved.data(), nullptr);  // NOLINT(bugprone-use-after-move): empty, by contract
      EXPECT_EQ(moved.size(), 0u);
      EXPECT_EQ(::msync(data, 8192, MS_ASYNC), 0);  // still mapped
    }
  }
  EXPECT_EQ(::msync(data, 8192, MS_ASYNC), -1);
  EXPECT_EQ(errno, ENOMEM);  // nothing mapped there any more
}

// Populating allocates the memfd's pages (its st_blocks grow to cover the range) from several
// threads over disjoint ranges, aligned or not; a range outside the region is refused; the
// bytes written after read back.
TEST(MemfdTest, PopulateRangeAllocatesThePagesAndRefusesARangeOutsideTheRegion) {
  constexpr size_t kSize = size_t{8} << 20;
  auto fd = CreateMemfd("populate-test", kSize);
  ASSERT_TRUE(fd.ok());
  auto region = MapReadWrite(fd->get(), kSize);
  ASSERT_TRUE(region.ok());
  AdviseHugePages(*region);
  struct stat before {};
  ASSERT_EQ(::fstat(fd->get(), &before), 0);
  EXPECT_EQ(before.st_blocks, 0);
  std::vector<std::thread> threads;
  std::vector<Status> statuses(4);
  for (size_t t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      // Quarter t, its start moved off the page boundary for t = 3 (the fallocate path).
      const uint64_t start = t * (kSize / 4) + (t == 3 ? 100 : 0);
      statuses[t] = PopulateRange(fd->get(), *region, start, (t + 1) * (kSize / 4) - start);
    });
  }
  for (auto& th : threads) th.join();
  for (const Status& s : statuses) EXPECT_TRUE(s.ok()) << s.ToString();
  struct stat after {};
  ASSERT_EQ(::fstat(fd->get(), &after), 0);
  EXPECT_GE(static_cast<uint64_t>(after.st_blocks) * 512, kSize);
  std::memset(region->data(), 0x3c, kSize);
  char last = 0;
  ASSERT_EQ(::pread(fd->get(), &last, 1, kSize - 1), 1);
  EXPECT_EQ(last, 0x3c);

  Status outside = PopulateRange(fd->get(), *region, kSize - 4096, 8192);
  EXPECT_EQ(outside.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(outside.message().find("of a 8388608-byte mapping"), std::string::npos)
      << outside.ToString();
  EXPECT_TRUE(PopulateRange(fd->get(), *region, kSize, 0).ok());
}

}  // namespace

}  // namespace weightcache::os
