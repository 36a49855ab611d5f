// os::UringReader on real files: a run read as many pieces in flight, through the kernel's
// workers and inline, equals the file; a run past the end stops at the end with every byte
// before it in; a failed read names the offset and carries the errno; bad arguments and a build
// without liburing are refused. Skipped (with the kernel's reason) where io_uring is disabled.
#include "os/uring_read.h"

#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/unique_fd.h"
#include "support/test_env.h"

namespace weightcache::os {
namespace {

using ::testing::HasSubstr;
using weightcache::testing::TempDir;

class UringReadTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!UringReader::Built()) GTEST_SKIP() << "built without liburing";
    Result<std::unique_ptr<UringReader>> made = UringReader::Create({});
    if (!made.ok() && made.status().code() == StatusCode::kUnavailable) {
      GTEST_SKIP() << "this kernel refuses io_uring: " << made.status().ToString();
    }
    ASSERT_TRUE(made.ok()) << made.status().ToString();
  }

  static std::unique_ptr<UringReader> Make(uint64_t piece, UringDispatch dispatch,
                                           unsigned depth = 8) {
    Result<std::unique_ptr<UringReader>> made =
        UringReader::Create({.depth = depth, .piece_bytes = piece, .dispatch = dispatch});
    EXPECT_TRUE(made.ok()) << made.status().ToString();
    return made.ok() ? std::move(made).value() : nullptr;
  }

  // A file of `size` random bytes, opened read-only.
  void MakeFile(size_t size) {
    std::mt19937_64 rng(size);
    contents_.resize(size);
    for (char& c : contents_) c = static_cast<char>(rng());
    path_ = dir_.Join("data.bin");
    weightcache::testing::WriteFile(path_, contents_);
    fd_.Reset(::open(path_.c_str(), O_RDONLY | O_CLOEXEC));
    ASSERT_TRUE(fd_.valid());
  }

  std::string Read(RunReader& reader, uint64_t offset, uint64_t length, uint64_t* got) {
    std::vector<std::byte> out(length, std::byte{0xEE});
    Result<uint64_t> n = reader.Read(fd_.get(), out.data(), length, offset);
    EXPECT_TRUE(n.ok()) << n.status().ToString();
    *got = n.ok() ? *n : 0;
    return {reinterpret_cast<const char*>(out.data()), static_cast<size_t>(*got)};
  }

  TempDir dir_;
  std::string contents_;
  std::string path_;
  UniqueFd fd_;
};

// More pieces than the ring's depth, an odd last piece, an odd start: every byte in its place.
TEST_F(UringReadTest, ARunReadAsManyPiecesInFlightEqualsTheFile) {
  MakeFile((size_t{5} << 20) + 12345);
  for (UringDispatch dispatch : {UringDispatch::kWorkers, UringDispatch::kInline}) {
    std::unique_ptr<UringReader> reader = Make(64 << 10, dispatch);
    ASSERT_NE(reader, nullptr);
    uint64_t got = 0;
    const uint64_t offset = 777;
    const uint64_t length = contents_.size() - offset - 10;
    const std::string bytes = Read(*reader, offset, length, &got);
    EXPECT_EQ(got, length);
    EXPECT_TRUE(bytes == contents_.substr(offset, length))
        << "dispatch " << static_cast<int>(dispatch);
    // The reader used again, for a run shorter than one piece.
    EXPECT_TRUE(Read(*reader, 5, 4096, &got) == contents_.substr(5, 4096));
  }
  // One piece larger than the run.
  std::unique_ptr<UringReader> whole = Make(uint64_t{1} << 30, UringDispatch::kWorkers, 1);
  uint64_t got = 0;
  EXPECT_TRUE(Read(*whole, 0, contents_.size(), &got) == contents_);
}

TEST_F(UringReadTest, ARunPastTheEndStopsAtTheEndWithEveryByteBeforeIt) {
  MakeFile(300000);
  std::unique_ptr<UringReader> reader = Make(16 << 10, UringDispatch::kWorkers);
  ASSERT_NE(reader, nullptr);
  uint64_t got = 0;
  const std::string bytes = Read(*reader, 100000, 1 << 20, &got);
  EXPECT_EQ(got, 200000u);
  EXPECT_TRUE(bytes == contents_.substr(100000));
  EXPECT_EQ(Read(*reader, 400000, 4096, &got), "");
  EXPECT_EQ(got, 0u);
}

TEST_F(UringReadTest, AFailedReadNamesTheOffsetAndCarriesTheErrno) {
  TempDir other;
  UniqueFd dir(::open(other.path().c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  ASSERT_TRUE(dir.valid());
  std::unique_ptr<UringReader> reader = Make(64 << 10, UringDispatch::kWorkers);
  ASSERT_NE(reader, nullptr);
  std::vector<std::byte> out(1 << 20);
  Result<uint64_t> n = reader->Read(dir.get(), out.data(), out.size(), 4096);
  ASSERT_FALSE(n.ok());
  EXPECT_EQ(n.status().code(), StatusCode::kIo);
  EXPECT_EQ(n.status().sys_errno(), EISDIR);
  EXPECT_THAT(n.status().message(), HasSubstr("io_uring read at file offset "));
  // Every piece was reaped before the error came back: the reader reads again.
  MakeFile(8192);
  uint64_t got = 0;
  EXPECT_TRUE(Read(*reader, 0, 8192, &got) == contents_);
}

TEST_F(UringReadTest, ZeroDepthOrPieceIsRefused) {
  Result<std::unique_ptr<UringReader>> none = UringReader::Create({.depth = 0});
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), StatusCode::kInvalidArgument);
  none = UringReader::Create({.piece_bytes = 0});
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), StatusCode::kInvalidArgument);
}

TEST(UringReadBuildTest, ABuildWithoutLiburingSaysSo) {
  if (UringReader::Built()) GTEST_SKIP() << "built with liburing";
  Result<std::unique_ptr<UringReader>> r = UringReader::Create({});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kUnavailable);
  EXPECT_THAT(r.status().message(), HasSubstr("liburing-dev"));
}

}  // namespace
}  // namespace weightcache::os
