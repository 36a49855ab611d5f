// UploadPipeline — the cold-load path: file bytes → pinned staging buffers → device memory.
//
// Reader threads pread large runs of each shard file into a ring of pinned staging buffers;
// each filled buffer is copied to the device with cuMemcpyHtoDAsync on one of a few streams,
// and an event recorded after its copies gates the buffer's reuse, so reads of the next
// buffers overlap the copies of the previous ones. While a copy is in flight, checksum threads
// compute the content checksums (common/checksum.h) of what was just read from the same
// staging buffer, so verification data costs no extra pass over the bytes and no read time.
//
// Contract:
//  * Create() needs the CUDA context that will own the copies to be current on the calling
//    thread; the pipeline remembers it and makes it current on its own threads.
//  * The pipeline owns its staging buffers, streams and events (freed on destruction, and
//    only then: staging_buffers x staging_buffer_bytes of pinned host memory, 512 MiB by
//    default, allocated by the first Run() that reads through them, stay resident while the
//    object lives, so a caller that loads once destroys it
//    right after Run(), as the daemon's gpu store does). Run()'s own bookkeeping (the batch
//    plan, the chunk hashes) is freed when it returns. It borrows the source fds and the
//    destination device memory: both must stay valid until Run() returns. Run() never changes a
//    source fd's file offset or flags (O_DIRECT reads go through a separate descriptor opened by
//    the pipeline). Strided items are gathered (os/strided_read.h) through the source fd as it
//    is, buffered, into the staging buffer, each reader with its own gather stage.
//  * Run() is synchronous and not reentrant: one Run() at a time per pipeline. When it
//    returns — success, error or cancellation — no copy it issued is still in flight and no
//    thread it started is still running; the pipeline can be reused.
//  * Errors (short read, EIO, a driver failure) stop every thread at its next step and
//    name the file, the offset and the item. Destination bytes are unspecified after an error.
//  * The progress callback runs on the pipeline's threads or the caller's, serialized, with
//    bytes whose copies have completed; it must be quick and must not call into the pipeline.
#pragma once

#include <cuda.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "cuda/driver_api.h"
#include "cuda/upload_resources.h"
#include "os/run_reader.h"
#include "weightcache/status.h"

namespace weightcache::cuda {

// A source file, already open for reading.
struct UploadSource {
  int fd = -1;       // borrowed
  std::string path;  // for error messages and logs only
};

// The held bytes of a strided item: `rows` pieces of `row_bytes`, piece r at
// `file_offset + r * source_pitch` of the file (a tensor slice along a dim > 0).
struct UploadStride {
  uint64_t rows = 1;
  uint64_t row_bytes = 0;
  uint64_t source_pitch = 0;
};

// Copy `length` bytes at `file_offset` of sources[source] to device address `dst`. With
// `stride`, the bytes are the stride's pieces (file_offset: piece 0's start; length: rows *
// row_bytes), landing one after the other at `dst`; the item's checksum is over those bytes.
struct UploadItem {
  size_t source = 0;
  uint64_t file_offset = 0;
  uint64_t length = 0;
  CUdeviceptr dst = 0;
  std::optional<UploadStride> stride;
};

enum class ReadMode {
  kBuffered,  // plain pread through the page cache
  kDirect,    // O_DIRECT on a second descriptor per file, falling back to buffered reads for a
              // file whose filesystem refuses it (tmpfs) or for a read it rejects
  kMapped,    // no CPU copy: the copy engine reads the files' page cache through read-only
              // registered mappings (cuda/mapped_upload.h); checksums by the GPU kernel
  kAuto,      // kMapped when CheckMappedUpload passes (every source in the page cache, the
              // device and build able), else kBuffered
};

const char* ReadModeName(ReadMode mode);

enum class ChecksumMode {
  kNone,
  kCompute,  // on the host, by hasher threads over each filled staging buffer (the mapped path:
             // by the GPU kernel, as kDevice)
  kDevice,   // by the GPU checksum kernel over the device bytes once the copies are done (one
             // launch, ~8 ms for 16 GB on an H200): no host memory bandwidth spent on hashing;
             // needs the kernel (GpuChecksumKernelBuilt)
};

// Makes a reader thread's RunReader (UploadOptions::run_reader).
using RunReaderFactory = std::function<Result<std::unique_ptr<os::RunReader>>()>;

struct UploadOptions {
  // A multiple of kChecksumChunkBytes (so pieces of an item stay chunk-aligned) and of 4096
  // (O_DIRECT), at least two chunks.
  uint64_t staging_buffer_bytes = uint64_t{32} << 20;
  int staging_buffers = 16;  // more than the readers: a filled buffer waits for its hash too
  // Bytes of consecutive buffers pinned by one registration (rounded down to whole buffers;
  // 0 or less than one buffer: one registration per buffer). Pinning costs the driver a fixed
  // time per call, so a ring of many small buffers is pinned in fewer, larger pieces.
  uint64_t staging_pin_bytes = 0;
  int reader_threads = 8;
  // Threads hashing filled staging buffers (ChecksumMode::kCompute) while the readers move on;
  // XXH64 runs at ~10 GB/s a core, so a few keep up with page-cache-speed reads.
  int checksum_threads = 8;
  int copy_streams = 2;
  ReadMode read_mode = ReadMode::kBuffered;
  ChecksumMode checksums = ChecksumMode::kNone;
  // The mapped path (kMapped, kAuto): bytes per registered chunk (rounded up to a page), and
  // chunks each reader thread keeps in flight (registered, copies queued) before it waits for
  // its oldest; a source must be at least `min_residency` in the page cache for kAuto.
  uint64_t mapped_chunk_bytes = uint64_t{64} << 20;
  int mapped_depth = 2;
  double min_residency = 0.99;
  // The staged path's buffered reads of whole runs (not O_DIRECT's, not strided gathers): each
  // reader thread makes one RunReader when it starts and reads through it; a failure to make
  // one fails the Run. Empty (the daemon's): pread. load_bench measures io_uring through it
  // (os/uring_read.h).
  RunReaderFactory run_reader;
};

struct UploadControl {
  // (bytes whose copies completed, total bytes); monotone, last call has done == total.
  std::function<void(uint64_t, uint64_t)> progress;
  // Polled before each staging buffer is filled; when it reads true, Run() stops and returns
  // kUnavailable "upload cancelled".
  const std::atomic<bool>* cancel = nullptr;
};

struct UploadReport {
  uint64_t bytes = 0;
  double seconds = 0;
  double gb_per_s = 0;  // 1e9 bytes per second, wall clock of Run()
  // Per item, TensorChecksum of its bytes; empty with ChecksumMode::kNone.
  std::vector<uint64_t> checksums;
  size_t staging_fills = 0;  // buffers filled (batches)
  // Making the staging ring inside Run() (0 once it exists: a pipeline run again), from its
  // start to its last buffer: it overlaps the first reads, and is part of `seconds`.
  double staging_seconds = 0;
  double checksum_seconds = 0;          // of `seconds`: the device checksum kernel (kDevice)
  size_t direct_sources = 0;            // sources read with O_DIRECT
  size_t mapped_chunks = 0;             // registered chunks copied (the mapped path)
  ReadMode path = ReadMode::kBuffered;  // the path taken: kBuffered, kDirect or kMapped
};

class UploadPipeline {
 public:
  static Result<UploadPipeline> Create(const DriverApi* api, const UploadOptions& options);

  UploadPipeline(UploadPipeline&&) noexcept = default;
  UploadPipeline& operator=(UploadPipeline&&) = delete;
  UploadPipeline(const UploadPipeline&) = delete;
  ~UploadPipeline() = default;

  Result<UploadReport> Run(std::span<const UploadSource> sources, std::span<const UploadItem> items,
                           const UploadControl& control = {});

  const UploadOptions& options() const { return options_; }

 private:
  UploadPipeline(const DriverApi* api, CUcontext context, const UploadOptions& options)
      : api_(api), context_(context), options_(options) {}

  Result<UploadReport> RunStaged(std::span<const UploadSource> sources,
                                 std::span<const UploadItem> items, const UploadControl& control,
                                 uint64_t total);

  const DriverApi* api_;
  CUcontext context_;
  UploadOptions options_;
  // Acquisition order; destroyed in reverse, after Run() has drained every stream. The staging
  // ring and its events are made by the first Run() that reads through them (a pipeline that
  // only takes the mapped path never pins them), and kept only when that Run made it whole.
  std::vector<PinnedHostBuffer> buffers_;  // the ring's pins (staging_pin_bytes each)
  size_t ring_slots_ = 0;                  // the slots they hold
  std::vector<CudaStream> streams_;
  std::vector<CudaEvent> events_;  // one per staging buffer
};

}  // namespace weightcache::cuda
