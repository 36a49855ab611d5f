// os::ReadStrided and os::PreadExact on real files: the pieces of several geometries read
// whole and from inside rows, a pitch over the gather stage, the stage reused, a file shorter
// than the run (the error names the file and the offset) and runs that are not runs.
#include "os/strided_read.h"

#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <memory>
#include <random>
#include <string>

#include "common/unique_fd.h"
#include "support/test_env.h"

namespace weightcache::os {
namespace {

using ::testing::HasSubstr;
using weightcache::testing::TempDir;

class StridedReadTest : public ::testing::Test {
 protected:
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
  // The run's bytes [at, at + length), cut from the contents.
  std::string Expected(const StridedRun& run, uint64_t at, uint64_t length) const {
    std::string held;
    for (uint64_t r = 0; r < run.rows; ++r) {
      held += contents_.substr(run.file_offset + r * run.pitch, run.row_bytes);
    }
    return held.substr(at, length);
  }
  Result<std::string> Read(const StridedRun& run, uint64_t at, uint64_t length) {
    std::string out(length, '\0');
    Status s = ReadStrided(fd_.get(), path_, run, at, length,
                           reinterpret_cast<uint8_t*>(out.data()), stage_);
    if (!s.ok()) return s;
    return out;
  }

  TempDir dir_;
  std::string contents_, path_;
  UniqueFd fd_;
  std::unique_ptr<uint8_t[]> stage_;
};

TEST_F(StridedReadTest, ReadsThePiecesOfEveryGeometryFromAnyOffset) {
  const uint64_t far = kStridedStageBytes + 5;  // rows too far apart to stage
  MakeFile(3 * far + 100);
  const StridedRun runs[] = {
      {.file_offset = 7, .rows = 1, .row_bytes = 100000, .pitch = 0},     // one pread
      {.file_offset = 3, .rows = 900, .row_bytes = 1000, .pitch = 3001},  // staged blocks
      {.file_offset = 0, .rows = 64, .row_bytes = 4096, .pitch = 4096},   // pitch == row
      {.file_offset = 11, .rows = 3, .row_bytes = 70, .pitch = far},      // row by row
      // Gaps of kStridedOwnReadGap and more: a pread per piece (a TP=4 row-parallel slice).
      {.file_offset = 5, .rows = 300, .row_bytes = 2048, .pitch = 2048 + kStridedOwnReadGap},
      {.file_offset = 9, .rows = 200, .row_bytes = 7168, .pitch = 28672},
      // A gap one byte short of it: still staged.
      {.file_offset = 2, .rows = 300, .row_bytes = 100, .pitch = 100 + kStridedOwnReadGap - 1},
      // Rows of 3 MiB: a stage holds two of them, so a long read takes several blocks.
      {.file_offset = 1, .rows = 7, .row_bytes = 3 << 20, .pitch = (3 << 20) + 9},
  };
  for (const StridedRun& run : runs) {
    SCOPED_TRACE("rows " + std::to_string(run.rows) + " of " + std::to_string(run.row_bytes));
    const uint64_t held = run.rows * run.row_bytes;
    auto whole = Read(run, 0, held);
    ASSERT_TRUE(whole.ok()) << whole.status().ToString();
    EXPECT_TRUE(*whole == Expected(run, 0, held));
    // From inside a row to inside a later one, as a loader's step boundaries fall.
    const uint64_t at = held / 3 + 1, length = held / 2;
    auto part = Read(run, at, length);
    ASSERT_TRUE(part.ok()) << part.status().ToString();
    EXPECT_TRUE(*part == Expected(run, at, length));
  }
}

TEST_F(StridedReadTest, AFileShorterThanTheRunNamesTheFileAndTheOffset) {
  MakeFile(10000);
  // Rows at 40, 1540, ..., 10540: the last lies past the end of the file.
  const StridedRun run{.file_offset = 40, .rows = 8, .row_bytes = 500, .pitch = 1500};
  auto got = Read(run, 0, 4000);
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().code(), StatusCode::kIo);
  EXPECT_THAT(got.status().message(),
              HasSubstr("unexpected end of file in " + path_ + " at offset 10000"));
  // The rows inside the file read fine on their own.
  ASSERT_TRUE(Read(run, 0, 3500).ok());

  std::string buf(100, '\0');
  Status s = PreadExact(fd_.get(), path_, 9950, 100, buf.data());
  EXPECT_EQ(s.code(), StatusCode::kIo);
  EXPECT_THAT(s.message(), HasSubstr("unexpected end of file in " + path_ +
                                     " at offset 10000 (50 more bytes expected)"));
}

TEST_F(StridedReadTest, AReadErrorCarriesTheErrnoAndTheFile) {
  UniqueFd dir(::open(dir_.path().c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  ASSERT_TRUE(dir.valid());
  uint8_t out[16];
  Status s =
      ReadStrided(dir.get(), dir_.path(), {.file_offset = 4, .rows = 2, .row_bytes = 8, .pitch = 8},
                  0, 16, out, stage_);
  EXPECT_EQ(s.code(), StatusCode::kIo);
  EXPECT_EQ(s.sys_errno(), EISDIR);
  EXPECT_THAT(s.message(), HasSubstr("pread " + dir_.path() + " at offset 4"));
}

TEST_F(StridedReadTest, ARangeOrRunThatIsNotARunIsRefused) {
  MakeFile(1000);
  const StridedRun ok{.file_offset = 0, .rows = 4, .row_bytes = 10, .pitch = 20};
  for (const auto& [run, at, length] :
       {std::tuple{ok, uint64_t{30}, uint64_t{11}},                      // past 40 bytes
        std::tuple{StridedRun{0, 4, 10, 5}, uint64_t{0}, uint64_t{40}},  // overlapping rows
        std::tuple{StridedRun{0, 4, 0, 5}, uint64_t{0}, uint64_t{0}},    // empty rows
        std::tuple{StridedRun{~uint64_t{0} - 5, 2, 10, 10}, uint64_t{0}, uint64_t{20}}}) {
    auto got = Read(run, at, length);
    ASSERT_FALSE(got.ok());
    EXPECT_EQ(got.status().code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(got.status().message(),
                HasSubstr("strided read of " + path_ + ": bytes [" + std::to_string(at)));
    EXPECT_THAT(got.status().message(), HasSubstr("not a valid run"));
  }
}

}  // namespace
}  // namespace weightcache::os
