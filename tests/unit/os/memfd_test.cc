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

TEST(MemfdTest, CopyOnWriteMappingOfASealedMemfdKeepsItsWritesPrivate) {
  auto fd = CreateMemfd("weights", 8192);
  ASSERT_TRUE(fd.ok()) << fd.status().ToString();
  {
    auto rw = MapReadWrite(fd->get(), 8192);
    ASSERT_TRUE(rw.ok()) << rw.status().ToString();
    std::memcpy(rw->data(), "cache bytes", 11);
  }
  ASSERT_TRUE(SealReadOnly(fd->get()).ok());
  // F_SEAL_WRITE refuses writable shared mappings, not private ones.
  auto cow = MapCopyOnWrite(fd->get(), 8192);
  ASSERT_TRUE(cow.ok()) << cow.status().ToString();
  auto* bytes = static_cast<char*>(cow->data());
  EXPECT_EQ(std::memcmp(bytes, "cache bytes", 11), 0);
  std::memcpy(bytes, "engine", 6);  // would be SIGSEGV on a MapReadOnly region
  EXPECT_EQ(std::memcmp(bytes, "engine", 6), 0);
  // The file, and every other mapping of it, still hold the cache's bytes.
  auto ro = MapReadOnly(fd->get(), 8192);
  ASSERT_TRUE(ro.ok()) << ro.status().ToString();
  EXPECT_EQ(std::memcmp(ro->data(), "cache bytes", 11), 0);
  char first[11] = {};
  ASSERT_EQ(::pread(fd->get(), first, sizeof(first), 0), 11);
  EXPECT_EQ(std::memcmp(first, "cache bytes", 11), 0);
  // The same size rule as the other mappings.
  auto past = MapCopyOnWrite(fd->get(), 8193);
  ASSERT_FALSE(past.ok());
  EXPECT_EQ(past.status().code(), StatusCode::kInvalidArgument);
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

// PwriteAll writes every byte at its offset (the memfd's pages allocated by the write); a sealed
// memfd refuses with kPermissionDenied (EPERM), an fd opened read-only with kIo (EBADF), both
// naming the offset.
TEST(MemfdTest, PwriteAllFillsTheRangeAndNamesTheOffsetOfARefusal) {
  constexpr size_t kSize = size_t{3} << 20;
  auto fd = CreateMemfd("pwrite-test", kSize);
  ASSERT_TRUE(fd.ok());
  std::string bytes(kSize - 4096, '\0');
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<char>(i % 251);
  ASSERT_TRUE(PwriteAll(fd->get(), bytes.data(), bytes.size(), 4096).ok());
  std::string back(kSize, '\1');
  ASSERT_EQ(::pread(fd->get(), back.data(), kSize, 0), static_cast<ssize_t>(kSize));
  EXPECT_EQ(back.substr(0, 4096), std::string(4096, '\0'));
  EXPECT_EQ(back.substr(4096), bytes);

  const std::string path = "/proc/self/fd/" + std::to_string(fd->get());
  UniqueFd read_only(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  ASSERT_TRUE(read_only);
  Status refused = PwriteAll(read_only.get(), bytes.data(), 10, 8192);
  EXPECT_EQ(refused.code(), StatusCode::kIo);
  EXPECT_NE(refused.message().find("pwrite into the memfd at offset 8192"), std::string::npos)
      << refused.ToString();
  EXPECT_NE(refused.ToString().find(std::strerror(EBADF)), std::string::npos) << refused.ToString();

  ASSERT_TRUE(SealReadOnly(fd->get()).ok());
  Status sealed = PwriteAll(fd->get(), bytes.data(), 10, 0);
  EXPECT_EQ(sealed.code(), StatusCode::kPermissionDenied);
  EXPECT_NE(sealed.message().find("pwrite into the memfd at offset 0: " +
                                  std::string(std::strerror(EPERM))),
            std::string::npos)
      << sealed.ToString();
}

}  // namespace

}  // namespace weightcache::os
