// The cold-load pipeline (cuda/upload_pipeline.h) on real files in a temp dir, against the
// fake driver whose copies run only when waited for: a staging buffer reused too early
// uploads wrong bytes and fails the content checks below. Errors are injected at the Nth
// driver call and through real failing reads (a truncated file, a directory fd).
#include "cuda/upload_pipeline.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <random>
#include <vector>

#include "common/checksum.h"
#include "common/unique_fd.h"
#include "cuda/checksum_gpu.h"
#include "os/strided_read.h"
#include "os/uring_read.h"
#include "support/test_env.h"
#include "unit/cuda/fake_driver.h"

namespace weightcache::cuda {
namespace {

using testing::FakeDriver;
using weightcache::testing::TempDir;

constexpr uint64_t kChunk = kChecksumChunkBytes;

std::string RandomString(size_t n, uint32_t seed) {
  std::mt19937_64 rng(seed);
  std::string s(n, '\0');
  for (auto& c : s) c = static_cast<char>(rng());
  return s;
}

class UploadPipelineTest : public ::testing::Test {
 protected:
  // The pipeline records the caller's current context at Create.
  UploadPipelineTest() { fake_.set_current_context(FakeDriver::ContextOf(0)); }
  // A real file of random bytes, opened read-only; returns its source index.
  size_t AddFile(const std::string& name, size_t size, uint32_t seed) {
    const std::string path = dir_.Join(name);
    contents_.push_back(RandomString(size, seed));
    weightcache::testing::WriteFile(path, contents_.back());
    fds_.emplace_back(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    EXPECT_TRUE(fds_.back().valid());
    sources_.push_back({fds_.back().get(), path});
    return sources_.size() - 1;
  }
  // An item and its fake-device destination, pre-filled with a marker byte.
  void AddItem(size_t source, uint64_t offset, uint64_t length) {
    device_.emplace_back(length, '\xEE');
    items_.push_back({source, offset, length,
                      length == 0 ? 0 : reinterpret_cast<CUdeviceptr>(device_.back().data()),
                      std::nullopt});
  }
  // A strided item: `rows` pieces of `row_bytes`, `pitch` apart from `offset`.
  void AddStridedItem(size_t source, uint64_t offset, uint64_t rows, uint64_t row_bytes,
                      uint64_t pitch) {
    AddItem(source, offset, rows * row_bytes);
    items_.back().stride = UploadStride{rows, row_bytes, pitch};
  }
  // The bytes an item holds, cut from the file's contents as the test wrote them.
  std::string Held(const UploadItem& it) const {
    const std::string& file = contents_[it.source];
    if (!it.stride) return file.substr(it.file_offset, it.length);
    std::string out;
    for (uint64_t r = 0; r < it.stride->rows; ++r) {
      out += file.substr(it.file_offset + r * it.stride->source_pitch, it.stride->row_bytes);
    }
    return out;
  }
  void ExpectDeviceMatchesFiles() {
    for (size_t i = 0; i < items_.size(); ++i) {
      const UploadItem& it = items_[i];
      ASSERT_EQ(device_[i], Held(it))
          << "item " << i << " (offset " << it.file_offset << ", " << it.length << " bytes)";
    }
  }
  Result<UploadReport> Run(UploadOptions options, const UploadControl& control = {}) {
    auto pipeline = UploadPipeline::Create(fake_.api(), options);
    if (!pipeline.ok()) return pipeline.status();
    return pipeline->Run(sources_, items_, control);
  }
  void ExpectAllReleased() {
    EXPECT_EQ(fake_.live_host_buffers(), 0);
    EXPECT_EQ(fake_.live_host_registrations(), 0);
    EXPECT_EQ(fake_.live_streams(), 0);
    EXPECT_EQ(fake_.live_events(), 0);
    EXPECT_EQ(fake_.pending_copies(), 0u);
  }
  static UploadOptions SmallRing() {
    UploadOptions o;
    o.staging_buffer_bytes = 2 * kChunk;  // the minimum: forces many fills and reuse
    o.staging_buffers = 3;
    o.reader_threads = 3;
    o.copy_streams = 2;
    o.checksums = ChecksumMode::kCompute;
    return o;
  }

  FakeDriver fake_;
  TempDir dir_;
  std::vector<std::string> contents_;
  std::vector<UniqueFd> fds_;
  std::vector<UploadSource> sources_;
  std::vector<UploadItem> items_;
  std::deque<std::string> device_;  // stable addresses
};

// Many shapes in one load: tiny items, an empty one, an item exactly a buffer, an item larger
// than a buffer (split at chunk boundaries), a partial last chunk, a contiguous run (one
// shared read), items out of file order and two files.
TEST_F(UploadPipelineTest, MixedItemsArriveIntactWithChecksums) {
  const size_t a = AddFile("a.bin", 9 * kChunk + 123, 1);
  const size_t b = AddFile("b.bin", 3 * kChunk + 5, 2);
  AddItem(a, 0, 1);
  AddItem(a, 1, 7);
  AddItem(a, 8, 0);
  AddItem(a, 8, 2 * kChunk);  // exactly one staging buffer, misaligned in the file
  AddItem(b, 5, 3 * kChunk);  // other file, ends at its EOF
  AddItem(a, 2 * kChunk + 8, 5 * kChunk + 17);  // larger than a buffer: split
  AddItem(a, 4096, 4096);                       // going backwards
  for (int i = 0; i < 40; ++i) AddItem(a, 7 * kChunk + 25 + i * 100, 100);  // contiguous run
  AddItem(a, 9 * kChunk + 100, 23);                                         // to EOF

  std::vector<std::pair<uint64_t, uint64_t>> progress;
  UploadControl control;
  control.progress = [&](uint64_t done, uint64_t total) { progress.emplace_back(done, total); };
  {
    auto report = Run(SmallRing(), control);
    ASSERT_TRUE(report.ok()) << report.status().ToString();
    ExpectDeviceMatchesFiles();
    uint64_t total = 0;
    for (const auto& it : items_) total += it.length;
    EXPECT_EQ(report->bytes, total);
    EXPECT_GT(report->staging_fills, 5u);
    ASSERT_EQ(report->checksums.size(), items_.size());
    for (size_t i = 0; i < items_.size(); ++i) {
      const std::string& bytes = device_[i];
      EXPECT_EQ(report->checksums[i], TensorChecksum(bytes.data(), bytes.size())) << "item " << i;
    }
    ASSERT_FALSE(progress.empty());
    EXPECT_EQ(progress.back(), std::make_pair(total, total));
    for (size_t i = 1; i < progress.size(); ++i) {
      EXPECT_GT(progress[i].first, progress[i - 1].first) << "progress must grow";
    }
  }
  ExpectAllReleased();
}

// Strided items (a tensor slice along a dim > 0) of several geometries, between contiguous
// items of the same file: rows that are not a multiple of 4096 bytes, a pitch larger than the
// gather stage (os::kStridedStageBytes: read row by row), an item larger than a staging buffer
// (split across fills, each piece gathered from the middle of a row), a single-row stride.
// Each lands byte-exact and its checksum is that of its held bytes.
TEST_F(UploadPipelineTest, StridedItemsArriveIntactWithChecksumsOfTheirHeldBytes) {
  const uint64_t far = os::kStridedStageBytes + 4096 + 3;  // a pitch over the gather stage
  const size_t a = AddFile("a.bin", 3 * far + 1000, 21);
  const size_t b = AddFile("b.bin", 8 * kChunk, 22);
  AddItem(a, 0, 100);
  AddStridedItem(a, 100, 50, 1000, 3000);  // right after a contiguous item: not merged
  AddItem(a, 100, 4000);                   // overlapping the stride's first rows
  AddStridedItem(a, 17, 3, 5000, far);
  AddStridedItem(b, 33, 700, 1234, 2 * 1234 + 1);  // 863,800 bytes: over 3 staging buffers
  AddStridedItem(b, 5, 1, 777, 0);
  AddStridedItem(b, 4096, 2, 4096, 4096);  // pitch == row: the contiguous run, strided
  AddItem(b, 6 * kChunk - 10, 10);

  auto report = Run(SmallRing());
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  ExpectDeviceMatchesFiles();
  ASSERT_EQ(report->checksums.size(), items_.size());
  for (size_t i = 0; i < items_.size(); ++i) {
    const std::string held = Held(items_[i]);
    EXPECT_EQ(report->checksums[i], TensorChecksum(held.data(), held.size())) << "item " << i;
  }
  uint64_t total = 0;
  for (const auto& it : items_) total += it.length;
  EXPECT_EQ(report->bytes, total);
  ExpectAllReleased();
}

TEST_F(UploadPipelineTest, StridedItemsReadBufferedUnderDirectMode) {
  const size_t a = AddFile("a.bin", 8 * kChunk + 77, 23);
  AddItem(a, 0, 3 * kChunk);
  AddStridedItem(a, 3, 300, 999, 4000);
  AddItem(a, 5 * kChunk + 1, 2 * kChunk);
  UploadOptions o = SmallRing();
  o.read_mode = ReadMode::kDirect;
  auto report = Run(o);
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  ExpectDeviceMatchesFiles();
}

TEST_F(UploadPipelineTest, AShortReadInsideAStridedItemNamesTheFileAndOffset) {
  const size_t a = AddFile("short.bin", 10000, 24);
  AddItem(a, 0, 100);
  AddStridedItem(a, 40, 8, 500, 1500);  // the last row starts at 10540: past EOF
  auto report = Run(SmallRing());
  ASSERT_FALSE(report.ok());
  EXPECT_EQ(report.status().code(), StatusCode::kIo);
  const std::string m = report.status().message();
  EXPECT_NE(m.find("upload item 1 (held bytes 0 to 4000)"), std::string::npos) << m;
  EXPECT_NE(m.find("unexpected end of file in " + sources_[a].path + " at offset 10000"),
            std::string::npos)
      << m;
  ExpectAllReleased();
}

TEST_F(UploadPipelineTest, BufferReuseWaitsForTheCopy) {
  // The fake never runs a copy until waited for: every fill after the first round must wait
  // on the slot's event, or the earlier batch uploads bytes of the later one.
  const size_t a = AddFile("a.bin", 40 * kChunk, 3);
  for (int i = 0; i < 20; ++i) AddItem(a, i * 2 * kChunk, 2 * kChunk);
  auto report = Run(SmallRing());
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  ExpectDeviceMatchesFiles();
  EXPECT_GE(fake_.CallCount("cuEventSynchronize"), 20 - 3);
}

TEST_F(UploadPipelineTest, ManySmallItemsShareFewReads) {
  const size_t a = AddFile("a.bin", 1000 * 64, 4);
  for (int i = 0; i < 1000; ++i) AddItem(a, i * 64, 64);
  UploadOptions o = SmallRing();
  o.reader_threads = 1;
  auto report = Run(o);
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  ExpectDeviceMatchesFiles();
  EXPECT_EQ(report->staging_fills, 1u) << "64,000 contiguous bytes fit one buffer";
}

TEST_F(UploadPipelineTest, ReusedPipelineLoadsAgain) {
  const size_t a = AddFile("a.bin", 5 * kChunk, 5);
  AddItem(a, 0, 5 * kChunk);
  auto pipeline = UploadPipeline::Create(fake_.api(), SmallRing());
  ASSERT_TRUE(pipeline.ok());
  for (int round = 0; round < 2; ++round) {
    device_[0].assign(device_[0].size(), '\0');
    auto report = pipeline->Run(sources_, items_);
    ASSERT_TRUE(report.ok()) << report.status().ToString();
    ExpectDeviceMatchesFiles();
  }
}

TEST_F(UploadPipelineTest, DirectReadsMatchBufferedReads) {
  const size_t a = AddFile("a.bin", 6 * kChunk + 77, 6);
  AddItem(a, 3, 6 * kChunk + 70);
  AddItem(a, 1, 1);
  UploadOptions o = SmallRing();
  o.read_mode = ReadMode::kDirect;
  auto report = Run(o);
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  ExpectDeviceMatchesFiles();
  // O_DIRECT is refused by tmpfs; either way the bytes are right and the fd was not touched.
  EXPECT_LE(report->direct_sources, 1u);
  EXPECT_EQ(::fcntl(sources_[a].fd, F_GETFL) & O_DIRECT, 0);
}

// UploadOptions::run_reader: each reader thread reads its runs through its own RunReader.
// Through io_uring (os/uring_read.h, the variant load_bench measures) the bytes and checksums
// are those of the files; a failing read names the file and the item around the reader's own
// message, with the errno; nothing is left behind.
TEST_F(UploadPipelineTest, RunsReadThroughIoUringArriveIntactAndAFailedReadIsNamed) {
  if (!os::UringReader::Built()) GTEST_SKIP() << "built without liburing";
  if (auto r = os::UringReader::Create({}); !r.ok()) {
    GTEST_SKIP() << "this kernel refuses io_uring: " << r.status().ToString();
  }
  const size_t a = AddFile("a.bin", 6 * kChunk + 77, 61);
  const size_t b = AddFile("b.bin", 3 * kChunk, 62);
  AddItem(a, 3, 6 * kChunk + 70);
  AddItem(b, 5, 2 * kChunk);
  AddStridedItem(a, 10, 4, 1000, 5000);  // gathered by os::ReadStrided, as in every mode
  UploadOptions o = SmallRing();
  std::atomic<int> made{0};
  for (os::UringDispatch dispatch : {os::UringDispatch::kWorkers, os::UringDispatch::kInline}) {
    // Pieces that divide nothing: odd last pieces; fewer in flight than a fill has.
    o.run_reader = [&made, dispatch]() -> Result<std::unique_ptr<os::RunReader>> {
      ++made;
      WEIGHTCACHE_ASSIGN_OR_RETURN(
          std::unique_ptr<os::UringReader> r,
          os::UringReader::Create({.depth = 3, .piece_bytes = 100000, .dispatch = dispatch}));
      return std::unique_ptr<os::RunReader>(std::move(r));
    };
    for (std::string& d : device_) d.assign(d.size(), '\xEE');
    auto report = Run(o);
    ASSERT_TRUE(report.ok()) << report.status().ToString();
    ExpectDeviceMatchesFiles();
    ASSERT_EQ(report->checksums.size(), items_.size());
    for (size_t i = 0; i < items_.size(); ++i) {
      EXPECT_EQ(report->checksums[i], TensorChecksum(Held(items_[i]).data(), items_[i].length))
          << "item " << i;
    }
  }
  EXPECT_EQ(made.load(), 2 * o.reader_threads);  // one per reader thread per run
  ExpectAllReleased();

  fds_.emplace_back(::open(dir_.path().c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  sources_.push_back({fds_.back().get(), dir_.path() + " (a directory)"});
  AddItem(sources_.size() - 1, 0, 10);
  auto failed = Run(o);
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(failed.status().code(), StatusCode::kIo);
  EXPECT_EQ(failed.status().sys_errno(), EISDIR);
  EXPECT_NE(failed.status().message().find("(a directory) at offset 0 (10 bytes, item 3): "
                                           "io_uring read at file offset 0"),
            std::string::npos)
      << failed.status().message();
  ExpectAllReleased();
}

// A reader thread that cannot make its RunReader fails the run with that error, and the run
// releases everything like any other failure.
TEST_F(UploadPipelineTest, AReaderThatCannotMakeItsRunReaderFailsTheRun) {
  const size_t a = AddFile("a.bin", 6 * kChunk, 63);
  AddItem(a, 0, 6 * kChunk);
  UploadOptions o = SmallRing();
  o.run_reader = []() -> Result<std::unique_ptr<os::RunReader>> {
    return Status(StatusCode::kUnavailable, "no ring for you");
  };
  auto report = Run(o);
  ASSERT_FALSE(report.ok());
  EXPECT_EQ(report.status().code(), StatusCode::kUnavailable);
  EXPECT_EQ(report.status().message(), "making an upload reader's run reader: no ring for you");
  ExpectAllReleased();
}

TEST_F(UploadPipelineTest, ShortReadNamesFileAndOffset) {
  const size_t a = AddFile("short.bin", 3 * kChunk, 7);
  AddItem(a, 0, kChunk);
  AddItem(a, 2 * kChunk, 2 * kChunk);  // runs past EOF
  {
    auto report = Run(SmallRing());
    ASSERT_FALSE(report.ok());
    EXPECT_EQ(report.status().code(), StatusCode::kIo);
    const std::string m = report.status().message();
    EXPECT_NE(m.find(sources_[a].path), std::string::npos) << m;
    // The item's second staging piece is the read that comes back empty.
    EXPECT_NE(m.find("at offset " + std::to_string(3 * kChunk) + " (" + std::to_string(kChunk) +
                     " bytes, item 1)"),
              std::string::npos)
        << m;
    EXPECT_NE(m.find("short read, the file ends at offset " + std::to_string(3 * kChunk)),
              std::string::npos)
        << m;
  }
  ExpectAllReleased();
}

TEST_F(UploadPipelineTest, ReadErrorCarriesErrno) {
  const size_t a = AddFile("a.bin", kChunk, 8);
  fds_.emplace_back(::open(dir_.path().c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  sources_.push_back({fds_.back().get(), dir_.path() + " (a directory)"});
  AddItem(a, 0, kChunk);
  AddItem(sources_.size() - 1, 0, 10);
  auto report = Run(SmallRing());
  ASSERT_FALSE(report.ok());
  EXPECT_EQ(report.status().code(), StatusCode::kIo);
  EXPECT_EQ(report.status().sys_errno(), EISDIR);
  EXPECT_NE(report.status().message().find("(a directory) at offset 0 (10 bytes, item 1)"),
            std::string::npos)
      << report.status().message();
}

TEST_F(UploadPipelineTest, CopyFailureMidwayStopsAndCleansUp) {
  const size_t a = AddFile("a.bin", 20 * kChunk, 9);
  for (int i = 0; i < 10; ++i) AddItem(a, i * 2 * kChunk, 2 * kChunk);
  fake_.FailCall("cuMemcpyHtoDAsync", 6, CUDA_ERROR_UNKNOWN);
  {
    auto report = Run(SmallRing());
    ASSERT_FALSE(report.ok());
    EXPECT_EQ(report.status().code(), StatusCode::kCuda);
    EXPECT_EQ(report.status().driver_error(), CUDA_ERROR_UNKNOWN);
    const std::string m = report.status().message();
    EXPECT_NE(m.find("cuMemcpyHtoDAsync of item"), std::string::npos) << m;
    EXPECT_NE(m.find(sources_[a].path + " offset "), std::string::npos) << m;
    EXPECT_NE(m.find("CUDA_ERROR_UNKNOWN"), std::string::npos) << m;
    // Stopped early: not every item was even attempted.
    EXPECT_LT(fake_.CallCount("cuMemcpyHtoDAsync"), 10);
  }
  ExpectAllReleased();
}

TEST_F(UploadPipelineTest, EventSynchronizeFailureStops) {
  const size_t a = AddFile("a.bin", 20 * kChunk, 10);
  for (int i = 0; i < 10; ++i) AddItem(a, i * 2 * kChunk, 2 * kChunk);
  fake_.FailCall("cuEventSynchronize", 2, CUDA_ERROR_LAUNCH_FAILED);
  {
    auto report = Run(SmallRing());
    ASSERT_FALSE(report.ok());
    EXPECT_EQ(report.status().driver_error(), CUDA_ERROR_LAUNCH_FAILED);
    EXPECT_NE(report.status().message().find("cuEventSynchronize on staging buffer"),
              std::string::npos)
        << report.status().message();
  }
  ExpectAllReleased();
}

// One test per step boundary of Run() that the tests above do not reach: the reader thread's
// context (start of step 4), the event after a batch's copies (end of step 4) and the drain
// (step 5). Each stops the run with the driver's error and leaves nothing in flight.
TEST_F(UploadPipelineTest, ContextFailureOnAReaderThreadStops) {
  const size_t a = AddFile("a.bin", 8 * kChunk, 13);
  for (int i = 0; i < 4; ++i) AddItem(a, i * 2 * kChunk, 2 * kChunk);
  UploadOptions o = SmallRing();
  o.reader_threads = 1;
  // The 3 staging-allocation threads make the context current first (calls 1 to 3).
  fake_.FailCall("cuCtxSetCurrent", o.staging_buffers + 1, CUDA_ERROR_INVALID_CONTEXT);
  {
    auto report = Run(o);
    ASSERT_FALSE(report.ok());
    EXPECT_EQ(report.status().code(), StatusCode::kCuda);
    EXPECT_EQ(report.status().driver_error(), CUDA_ERROR_INVALID_CONTEXT);
    EXPECT_NE(report.status().message().find("cuCtxSetCurrent on upload thread"), std::string::npos)
        << report.status().message();
    EXPECT_EQ(fake_.CallCount("cuMemcpyHtoDAsync"), 0);
  }
  ExpectAllReleased();
}

// cuMemHostRegister needs a current context on the thread that pins a staging buffer.
TEST_F(UploadPipelineTest, ContextFailureOnAStagingThreadFailsTheRunAndReleasesEverything) {
  const size_t a = AddFile("a.bin", 4 * kChunk, 14);
  AddItem(a, 0, 4 * kChunk);
  fake_.FailCall("cuCtxSetCurrent", 1, CUDA_ERROR_INVALID_CONTEXT);
  {
    auto report = Run(SmallRing());
    ASSERT_FALSE(report.ok());
    EXPECT_EQ(report.status().driver_error(), CUDA_ERROR_INVALID_CONTEXT);
    EXPECT_NE(report.status().message().find("cuCtxSetCurrent on a staging-allocation thread"),
              std::string::npos)
        << report.status().message();
    EXPECT_EQ(fake_.CallCount("cuMemcpyHtoDAsync"), 0);
  }
  ExpectAllReleased();
}

TEST_F(UploadPipelineTest, EventRecordFailureNamesTheBufferAndStops) {
  const size_t a = AddFile("a.bin", 20 * kChunk, 14);
  for (int i = 0; i < 10; ++i) AddItem(a, i * 2 * kChunk, 2 * kChunk);
  fake_.FailCall("cuEventRecord", 2, CUDA_ERROR_UNKNOWN);
  {
    auto report = Run(SmallRing());
    ASSERT_FALSE(report.ok());
    EXPECT_EQ(report.status().driver_error(), CUDA_ERROR_UNKNOWN);
    EXPECT_NE(report.status().message().find("cuEventRecord on staging buffer "), std::string::npos)
        << report.status().message();
    EXPECT_LT(fake_.CallCount("cuEventRecord"), 10);
  }
  ExpectAllReleased();
}

TEST_F(UploadPipelineTest, DrainFailureIsReportedAfterEveryStreamIsSynchronized) {
  const size_t a = AddFile("a.bin", 8 * kChunk, 15);
  for (int i = 0; i < 4; ++i) AddItem(a, i * 2 * kChunk, 2 * kChunk);
  fake_.FailCall("cuStreamSynchronize", 1, CUDA_ERROR_LAUNCH_FAILED);
  {
    auto report = Run(SmallRing());
    ASSERT_FALSE(report.ok());
    EXPECT_EQ(report.status().driver_error(), CUDA_ERROR_LAUNCH_FAILED);
    EXPECT_NE(report.status().message().find("cuStreamSynchronize after the upload copies"),
              std::string::npos)
        << report.status().message();
    // Every item was copied; the second stream was still drained after the first one failed.
    EXPECT_EQ(fake_.CallCount("cuMemcpyHtoDAsync"), 4);
    EXPECT_EQ(fake_.CallCount("cuStreamSynchronize"), 2);
  }
  ExpectAllReleased();
}

// The staging ring is allocated by the first Run() that reads through it; a failure there
// releases what was allocated and leaves the pipeline usable.
TEST_F(UploadPipelineTest, StagingAllocationFailureReleasesWhatWasAllocated) {
  const size_t a = AddFile("a.bin", 8 * kChunk, 31);
  AddItem(a, 0, 8 * kChunk);  // 4 fills: the ring's 3 slots are all made
  {
    auto p = UploadPipeline::Create(fake_.api(), SmallRing());
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    EXPECT_EQ(fake_.CallCount("cuMemHostRegister"), 0) << "Create pins nothing";
    fake_.FailCall("cuMemHostRegister", 3, CUDA_ERROR_OUT_OF_MEMORY);
    auto r = p->Run(sources_, items_);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kCuda);
    EXPECT_NE(r.status().message().find("cuMemHostRegister of a 524288-byte pinned staging buffer"),
              std::string::npos)
        << r.status().message();
    // The buffers are created in parallel: every one that was pinned is unpinned again.
    EXPECT_EQ(fake_.CallCount("cuMemHostUnregister"), fake_.CallCount("cuMemHostRegister") - 1);
    EXPECT_EQ(fake_.live_host_registrations(), 0);

    fake_.FailCall("cuEventCreate", fake_.CallCount("cuEventCreate") + 2, CUDA_ERROR_OUT_OF_MEMORY);
    r = p->Run(sources_, items_);
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.status().message().find("cuEventCreate"), std::string::npos);
    EXPECT_EQ(fake_.live_host_registrations(), 0);
    EXPECT_EQ(fake_.live_events(), 0);

    r = p->Run(sources_, items_);  // the next attempt allocates and loads
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    ExpectDeviceMatchesFiles();
  }
  ExpectAllReleased();
}

TEST_F(UploadPipelineTest, CancelStopsBeforeTheNextFill) {
  const size_t a = AddFile("a.bin", 40 * kChunk, 11);
  for (int i = 0; i < 20; ++i) AddItem(a, i * 2 * kChunk, 2 * kChunk);
  std::atomic<bool> cancel{false};
  UploadControl control;
  control.cancel = &cancel;
  control.progress = [&](uint64_t, uint64_t) { cancel = true; };
  {
    auto report = Run(SmallRing(), control);
    ASSERT_FALSE(report.ok());
    EXPECT_EQ(report.status().code(), StatusCode::kUnavailable);
    EXPECT_EQ(report.status().message(), "upload cancelled");
    EXPECT_LT(fake_.CallCount("cuMemcpyHtoDAsync"), 20);
  }
  ExpectAllReleased();
}

TEST_F(UploadPipelineTest, RejectsBadOptionsAndItems) {
  UploadOptions o = SmallRing();
  o.staging_buffer_bytes = 3 * kChunk + 1;
  auto p = UploadPipeline::Create(fake_.api(), o);
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(p.status().message().find("must be a multiple of"), std::string::npos);

  fake_.set_current_context(nullptr);
  auto p2 = UploadPipeline::Create(fake_.api(), SmallRing());
  ASSERT_FALSE(p2.ok());
  EXPECT_NE(p2.status().message().find("no current CUDA context"), std::string::npos);
  fake_.set_current_context(FakeDriver::ContextOf(0));

  const size_t a = AddFile("a.bin", 10, 12);
  AddItem(a, 0, 10);
  items_.push_back({7, 0, 1, items_[0].dst, std::nullopt});
  auto r = Run(SmallRing());
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("upload item 1 names source 7 of 1"), std::string::npos);

  items_.back() = {a, ~uint64_t{0} - 2, 5, items_[0].dst, std::nullopt};
  r = Run(SmallRing());
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("offset + length overflows"), std::string::npos);

  items_.back() = {a, 0, 5, 0, std::nullopt};
  r = Run(SmallRing());
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("null device destination"), std::string::npos);

  // A stride whose rows do not make up the item's length, or whose rows overlap.
  for (const UploadStride& bad : {UploadStride{2, 4, 4}, UploadStride{3, 2, 1}}) {
    items_.back() = {a, 0, 6, items_[0].dst, bad};
    r = Run(SmallRing());
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find("upload item 1 of " + sources_[a].path + ": a stride of " +
                                        std::to_string(bad.rows) + " row(s)"),
              std::string::npos)
        << r.status().message();
  }
}

// The staging ring is made while the readers run: the first copy is issued while the ring's
// other buffers are still being pinned (their cuMemHostRegister is held back until a copy was
// seen, at most 10 s: a ring made up front would sit out that wait with no copy).
TEST_F(UploadPipelineTest, TheFirstCopiesRunWhileTheRestOfTheStagingRingIsBeingMade) {
  const size_t a = AddFile("a.bin", 12 * kChunk, 19);
  AddItem(a, 0, 12 * kChunk);  // 6 fills of a 3-slot ring
  std::mutex mu;
  std::condition_variable cv;
  bool copied = false;
  int registered = 0;
  int waited_out = 0;  // registrations released by the timeout, not by a copy
  fake_.BeforeCall("cuMemcpyHtoDAsync", [&] {
    std::lock_guard lock(mu);
    copied = true;
    cv.notify_all();
  });
  fake_.BeforeCall("cuMemHostRegister", [&] {
    std::unique_lock lock(mu);
    if (++registered == 1) return;  // the first slot is made at once
    if (!cv.wait_for(lock, std::chrono::seconds(10), [&] { return copied; })) ++waited_out;
  });
  {
    auto report = Run(SmallRing());
    ASSERT_TRUE(report.ok()) << report.status().ToString();
    ExpectDeviceMatchesFiles();
    EXPECT_EQ(report->staging_fills, 6u);
  }
  std::lock_guard lock(mu);
  EXPECT_EQ(registered, 3);
  EXPECT_EQ(waited_out, 0) << "no copy was issued before the whole ring was pinned";
  ExpectAllReleased();
}

// staging_pin_bytes: consecutive slots share one registration (5 slots, 2 per pin: pins of
// 2, 2 and 1 slot), the bytes arrive intact, a reused pipeline adopts the pins whole, and a
// pin that cannot be made releases the others.
TEST_F(UploadPipelineTest, SlotsPinnedInGroupsLoadIntactAndFailClean) {
  const size_t a = AddFile("a.bin", 24 * kChunk, 23);
  AddItem(a, 0, 24 * kChunk);  // 12 fills of a 5-slot ring
  UploadOptions o = SmallRing();
  o.staging_buffers = 5;
  o.staging_pin_bytes = 2 * o.staging_buffer_bytes + 1;  // rounded down: 2 slots a pin
  {
    auto p = UploadPipeline::Create(fake_.api(), o);
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    auto r = p->Run(sources_, items_);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    ExpectDeviceMatchesFiles();
    EXPECT_EQ(r->staging_fills, 12u);
    EXPECT_EQ(fake_.CallCount("cuMemHostRegister"), 3);
    EXPECT_EQ(fake_.live_host_registrations(), 3);
    r = p->Run(sources_, items_);  // the ring is adopted: nothing pinned again
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    ExpectDeviceMatchesFiles();
    EXPECT_EQ(fake_.CallCount("cuMemHostRegister"), 3);
  }
  EXPECT_EQ(fake_.live_host_registrations(), 0);
  {
    auto p = UploadPipeline::Create(fake_.api(), o);
    ASSERT_TRUE(p.ok());
    fake_.FailCall("cuMemHostRegister", fake_.CallCount("cuMemHostRegister") + 2,
                   CUDA_ERROR_OUT_OF_MEMORY);
    auto r = p->Run(sources_, items_);
    ASSERT_FALSE(r.ok());
    // The second pin made: of two slots or of the last one, whichever the pinning thread
    // reached second (the groups are pinned behind the first reads, in no fixed order).
    const std::string message = r.status().message();
    const bool two_slots =
        message.find("cuMemHostRegister of a 1048576-byte pinned staging buffer") !=
        std::string::npos;
    const bool one_slot = message.find(
                              "cuMemHostRegister of a 524288-byte pinned staging "
                              "buffer") != std::string::npos;
    EXPECT_TRUE(two_slots || one_slot) << message;
    EXPECT_NE(message.find("CUDA_ERROR_OUT_OF_MEMORY"), std::string::npos) << message;
    EXPECT_EQ(fake_.live_host_registrations(), 0);
  }
  ExpectAllReleased();
}

TEST_F(UploadPipelineTest, NothingToDoReportsZero) {
  std::vector<std::pair<uint64_t, uint64_t>> progress;
  UploadControl control;
  control.progress = [&](uint64_t d, uint64_t t) { progress.emplace_back(d, t); };
  auto report = Run(SmallRing(), control);
  ASSERT_TRUE(report.ok());
  EXPECT_EQ(report->bytes, 0u);
  EXPECT_EQ(progress, (std::vector<std::pair<uint64_t, uint64_t>>{{0, 0}}));
}

// ChecksumMode::kDevice: the staged path without host hashers, then one kernel launch over the
// device bytes (the fake runs the kernel's algorithm): the same values as the host's.
TEST_F(UploadPipelineTest, DeviceChecksumsOnTheStagedPathEqualTheHeldBytesChecksums) {
  if (!GpuChecksumKernelBuilt()) GTEST_SKIP() << "built without the GPU checksum kernel";
  const size_t a = AddFile("a.bin", 7 * kChunk + 5, 51);
  AddItem(a, 1, 3 * kChunk);
  AddStridedItem(a, 3 * kChunk + 9, 30, 2000, 5000);
  AddItem(a, 0, 0);
  AddItem(a, 7 * kChunk, 5);
  UploadOptions o = SmallRing();
  o.checksums = ChecksumMode::kDevice;
  {
    auto report = Run(o);
    ASSERT_TRUE(report.ok()) << report.status().ToString();
    ExpectDeviceMatchesFiles();
    EXPECT_EQ(report->path, ReadMode::kBuffered);
    ASSERT_EQ(report->checksums.size(), items_.size());
    for (size_t i = 0; i < items_.size(); ++i) {
      const std::string held = Held(items_[i]);
      EXPECT_EQ(report->checksums[i], TensorChecksum(held.data(), held.size())) << "item " << i;
    }
    EXPECT_EQ(fake_.CallCount("cuLaunchKernel"), 1);
  }
  ExpectAllReleased();
}

TEST_F(UploadPipelineTest, DeviceChecksumsWithoutTheKernelAreRefused) {
  if (GpuChecksumKernelBuilt()) GTEST_SKIP() << "built with the GPU checksum kernel";
  const size_t a = AddFile("a.bin", 100, 52);
  AddItem(a, 0, 100);
  UploadOptions o = SmallRing();
  o.checksums = ChecksumMode::kDevice;
  auto report = Run(o);
  ASSERT_FALSE(report.ok());
  EXPECT_EQ(report.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(report.status().message().find("device checksums need the GPU checksum kernel"),
            std::string::npos)
      << report.status().message();
}

// ---- the mapped path (cuda/mapped_upload.h): the copy engine reads the page cache ----------

// Small registered chunks, so that items straddle chunk ends and strided items widen chunks.
UploadOptions MappedOptions(ChecksumMode checksums) {
  UploadOptions o;
  o.read_mode = ReadMode::kMapped;
  o.mapped_chunk_bytes = 3 * 4096;
  o.mapped_depth = 2;
  o.reader_threads = 3;
  o.copy_streams = 2;
  o.checksums = checksums;
  return o;
}

// The same shapes as the staged tests: tiny, empty, misaligned, larger than a chunk, out of
// file order, overlapping, two files, strided items of several geometries. Every chunk is
// registered once (the fake refuses a page registered twice, as the driver does), unregistered
// only after its copies ran (the fake aborts otherwise), and nothing is pinned afterwards.
TEST_F(UploadPipelineTest, MappedPathMovesTheHeldBytesOfEveryItem) {
  const size_t a = AddFile("a.bin", 9 * kChunk + 123, 41);
  const size_t b = AddFile("b.bin", 3 * kChunk + 5, 42);
  AddItem(a, 0, 1);
  AddItem(a, 1, 7);
  AddItem(a, 8, 0);
  AddItem(a, 8, 2 * kChunk);
  AddItem(b, 5, 3 * kChunk);  // to EOF
  AddItem(a, 4096, 4096);     // going backwards, overlapping the item at 8
  AddStridedItem(a, 2 * kChunk + 100, 50, 1000, 3000);
  AddItem(a, 2 * kChunk + 100, 4000);  // overlapping the stride's first rows
  AddStridedItem(a, 5 * kChunk + 17, 3, 5000, 20000);
  AddStridedItem(b, 33, 1, 777, 0);
  for (int i = 0; i < 40; ++i) AddItem(a, 7 * kChunk + 25 + i * 100, 100);
  AddItem(a, 9 * kChunk + 100, 23);  // to EOF
  std::vector<std::pair<uint64_t, uint64_t>> progress;
  UploadControl control;
  control.progress = [&](uint64_t done, uint64_t total) { progress.emplace_back(done, total); };
  {
    auto report = Run(MappedOptions(ChecksumMode::kNone), control);
    ASSERT_TRUE(report.ok()) << report.status().ToString();
    ExpectDeviceMatchesFiles();
    EXPECT_EQ(report->path, ReadMode::kMapped);
    EXPECT_GT(report->mapped_chunks, 10u);
    EXPECT_EQ(fake_.CallCount("cuMemHostRegister"), static_cast<int>(report->mapped_chunks));
    EXPECT_EQ(fake_.CallCount("cuMemHostUnregister"), static_cast<int>(report->mapped_chunks));
    EXPECT_EQ(fake_.CallCount("cuMemcpy2DAsync"), 2) << "one 2D copy per strided item";
    uint64_t total = 0;
    for (const auto& it : items_) total += it.length;
    EXPECT_EQ(report->bytes, total);
    ASSERT_FALSE(progress.empty());
    EXPECT_EQ(progress.back(), std::make_pair(total, total));
    EXPECT_EQ(fake_.live_host_registrations(), 0);
  }
  ExpectAllReleased();
}

// Checksums on the mapped path come from the GPU kernel (the fake runs its algorithm) over the
// device bytes, and equal the host's TensorChecksum of the held bytes.
TEST_F(UploadPipelineTest, MappedPathChecksumsAreThoseOfTheHeldBytes) {
  if (!GpuChecksumKernelBuilt()) GTEST_SKIP() << "built without the GPU checksum kernel";
  const size_t a = AddFile("a.bin", 6 * kChunk + 9, 43);
  AddItem(a, 3, 2 * kChunk + 1);
  AddStridedItem(a, 2 * kChunk + 50, 20, 3000, 7000);
  AddItem(a, 6 * kChunk, 9);
  AddItem(a, 0, 0);
  auto report = Run(MappedOptions(ChecksumMode::kCompute));
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  ExpectDeviceMatchesFiles();
  ASSERT_EQ(report->checksums.size(), items_.size());
  for (size_t i = 0; i < items_.size(); ++i) {
    const std::string held = Held(items_[i]);
    EXPECT_EQ(report->checksums[i], TensorChecksum(held.data(), held.size())) << "item " << i;
  }
  EXPECT_EQ(fake_.CallCount("cuLaunchKernel"), 1) << "one launch for every item";
  ExpectAllReleased();
}

TEST_F(UploadPipelineTest, MappedPathWithoutTheKernelRefusesChecksums) {
  if (GpuChecksumKernelBuilt()) GTEST_SKIP() << "built with the GPU checksum kernel";
  const size_t a = AddFile("a.bin", 100, 44);
  AddItem(a, 0, 100);
  auto report = Run(MappedOptions(ChecksumMode::kCompute));
  ASSERT_FALSE(report.ok());
  EXPECT_EQ(report.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(report.status().message().find("checksums need the GPU checksum kernel"),
            std::string::npos)
      << report.status().message();
}

// A failure at each driver step of the mapped path names what failed, and leaves nothing
// registered, queued or allocated.
TEST_F(UploadPipelineTest, MappedPathFailuresNameTheStepAndReleaseEverything) {
  const size_t a = AddFile("a.bin", 12 * kChunk, 45);
  for (int i = 0; i < 6; ++i) AddItem(a, i * 2 * kChunk + 11, 2 * kChunk - 11);
  AddStridedItem(a, 40, 30, 100, 5000);
  struct Case {
    const char* call;
    int nth;
    const char* expect;
  };
  for (const Case& c :
       {Case{"cuMemHostRegister", 4, "cuMemHostRegister (read-only) of "},
        Case{"cuMemcpyHtoDAsync", 5, "copying item "}, Case{"cuMemcpy2DAsync", 1, "copying item 6"},
        Case{"cuEventRecord", 3, "cuEventRecord after a mapped chunk"},
        Case{"cuEventSynchronize", 2, "cuEventSynchronize after a mapped chunk"},
        Case{"cuMemHostUnregister", 3, "cuMemHostUnregister of "},
        Case{"cuCtxSetCurrent", 3, "cuCtxSetCurrent on a mapped-upload thread"}}) {
    SCOPED_TRACE(c.call);
    // Call counts add up over the loop: the nth call of this run.
    fake_.FailCall(c.call, fake_.CallCount(c.call) + c.nth, CUDA_ERROR_UNKNOWN);
    auto report = Run(MappedOptions(ChecksumMode::kNone));
    ASSERT_FALSE(report.ok());
    EXPECT_EQ(report.status().code(), StatusCode::kCuda);
    EXPECT_NE(report.status().message().find(c.expect), std::string::npos)
        << report.status().message();
    if (std::string(c.call) == "cuMemHostRegister") {
      EXPECT_NE(report.status().message().find(sources_[a].path + " bytes ["), std::string::npos)
          << report.status().message();
    }
    // A failed unregister leaves that one registration behind in the fake (the driver's state
    // is unknown then); every other path unpins everything.
    if (std::string(c.call) != "cuMemHostUnregister") {
      EXPECT_EQ(fake_.live_host_registrations(), 0);
    }
    fake_.ClearHostRegistrations();
    ExpectAllReleased();
  }
}

TEST_F(UploadPipelineTest, MappedPathRefusesAnItemPastTheEndOfItsFile) {
  const size_t a = AddFile("short.bin", 10000, 46);
  AddItem(a, 0, 100);
  AddStridedItem(a, 40, 8, 500, 1500);  // the last row ends at 11040
  auto report = Run(MappedOptions(ChecksumMode::kNone));
  ASSERT_FALSE(report.ok());
  EXPECT_EQ(report.status().code(), StatusCode::kIo);
  EXPECT_NE(report.status().message().find("upload item 1: " + sources_[a].path +
                                           " bytes [40, 11040) run past the end of the file "
                                           "(10000 bytes)"),
            std::string::npos)
      << report.status().message();
  ExpectAllReleased();
}

TEST_F(UploadPipelineTest, MappedPathCancelStopsBeforeTheNextChunk) {
  const size_t a = AddFile("a.bin", 40 * kChunk, 47);
  for (int i = 0; i < 20; ++i) AddItem(a, i * 2 * kChunk, 2 * kChunk);
  std::atomic<bool> cancel{false};
  UploadControl control;
  control.cancel = &cancel;
  control.progress = [&](uint64_t done, uint64_t) {
    if (done > 0) cancel = true;
  };
  UploadOptions o = MappedOptions(ChecksumMode::kNone);
  o.reader_threads = 1;
  {
    auto report = Run(o, control);
    ASSERT_FALSE(report.ok());
    EXPECT_EQ(report.status().message(), "upload cancelled");
    EXPECT_LT(fake_.CallCount("cuMemHostRegister"), 20);
    EXPECT_EQ(fake_.live_host_registrations(), 0);
  }
  ExpectAllReleased();
}

// kAuto takes the mapped path only when it can: files in the page cache (these were just
// written), a device that registers read-only memory; otherwise the staging ring, same bytes.
TEST_F(UploadPipelineTest, AutoModeChoosesThePathAndMovesTheSameBytes) {
  const size_t a = AddFile("a.bin", 5 * kChunk + 3, 48);
  AddItem(a, 0, 5 * kChunk + 3);
  AddStridedItem(a, 10, 40, 2000, 6000);
  UploadOptions o = SmallRing();
  o.read_mode = ReadMode::kAuto;
  o.checksums = ChecksumMode::kNone;
  auto report = Run(o);
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  EXPECT_EQ(report->path, ReadMode::kMapped);
  ExpectDeviceMatchesFiles();

  for (auto& d : device_) std::fill(d.begin(), d.end(), '\xEE');
  fake_.SetAttribute(CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED, 0);
  report = Run(o);
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  EXPECT_EQ(report->path, ReadMode::kBuffered);
  ExpectDeviceMatchesFiles();

  fake_.SetAttribute(CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED, 1);
  o.min_residency = 1.5;  // more than any file can be: as if it were not in the page cache
  for (auto& d : device_) std::fill(d.begin(), d.end(), '\xEE');
  report = Run(o);
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  EXPECT_EQ(report->path, ReadMode::kBuffered);
  ExpectDeviceMatchesFiles();
  ExpectAllReleased();
}

}  // namespace
}  // namespace weightcache::cuda
