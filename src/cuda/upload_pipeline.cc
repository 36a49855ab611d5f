#include "cuda/upload_pipeline.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <deque>
#include <limits>
#include <memory>
#include <optional>
#include <thread>

#include "common/align.h"
#include "common/checksum.h"
#include "common/logging.h"
#include "common/mutex.h"
#include "common/unique_fd.h"
#include "cuda/checksum_gpu.h"
#include "cuda/mapped_upload.h"
#include "cuda/staging_ring.h"
#include "os/strided_read.h"

namespace weightcache::cuda {
namespace {

// O_DIRECT needs offset, length and address aligned to the logical block size; 4096 covers
// every block size in use (512 and 4096).
constexpr uint64_t kDirectAlign = 4096;

// One contiguous file region read into a staging buffer. Its buffer position is congruent to
// its file offset modulo kDirectAlign, so the O_DIRECT variant (the aligned superset of the
// region) lands on an aligned buffer address without moving the data.
struct ReadOp {
  size_t source;
  uint64_t file_offset;
  uint64_t length;
  uint64_t buf_offset;
  size_t first_item;  // for error messages; the item of a strided read
  // A strided item's held bytes [item_offset, item_offset + length), gathered with
  // os::ReadStrided instead of one pread of [file_offset, file_offset + length).
  bool strided = false;
  uint64_t item_offset = 0;
};

// A piece of one item: where it sits in the staging buffer and where it goes in the item.
struct Segment {
  size_t item;
  uint64_t item_offset;  // a multiple of kChecksumChunkBytes
  uint64_t length;
  uint64_t buf_offset;
};

// The work of one staging-buffer fill.
struct Batch {
  std::vector<ReadOp> reads;
  std::vector<Segment> segments;
  uint64_t bytes = 0;
};

// Packs the items, in order, into buffer-sized batches. Consecutive items that are contiguous
// in the same file share one read (a safetensors shard is one long run of tensors). An item
// larger than the space left is split at a chunk boundary, so every piece starts on a chunk
// boundary of its item and its chunk hashes can be computed on its own.
std::vector<Batch> PlanBatches(std::span<const UploadItem> items, uint64_t buffer_bytes) {
  std::vector<Batch> batches;
  Batch cur;
  uint64_t used = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    const UploadItem& item = items[i];
    uint64_t off = 0;
    while (off < item.length) {
      const uint64_t file_pos = item.file_offset + off;
      const bool strided = item.stride.has_value();
      const bool contiguous = !strided && !cur.reads.empty() && !cur.reads.back().strided &&
                              cur.reads.back().source == item.source &&
                              cur.reads.back().file_offset + cur.reads.back().length == file_pos;
      // A strided read is gathered buffered: no O_DIRECT alignment to keep, only a tidy start.
      const uint64_t start = contiguous ? used
                             : strided  ? AlignUp(used, kDirectAlign)
                                        : AlignUp(used, kDirectAlign) + file_pos % kDirectAlign;
      const uint64_t room = buffer_bytes > start ? buffer_bytes - start : 0;
      const uint64_t remaining = item.length - off;
      const uint64_t take = remaining <= room ? remaining : AlignDown(room, kChecksumChunkBytes);
      if (take == 0) {
        batches.push_back(std::move(cur));
        cur = Batch();
        used = 0;
        continue;
      }
      cur.segments.push_back({i, off, take, start});
      if (contiguous) {
        cur.reads.back().length += take;
      } else if (strided) {
        cur.reads.push_back({item.source, item.file_offset, take, start, i, true, off});
      } else {
        cur.reads.push_back({item.source, file_pos, take, start, i});
      }
      cur.bytes += take;
      used = start + take;
      off += take;
    }
  }
  if (!cur.segments.empty()) batches.push_back(std::move(cur));
  return batches;
}

// pread until `length` bytes are in, retrying EINTR and partial reads. Returns the bytes read
// (fewer than asked only at end of file) or the errno.
Result<uint64_t> PreadFull(int fd, std::byte* dst, uint64_t length, uint64_t offset) {
  uint64_t done = 0;
  while (done < length) {
    // Linux caps one read at 0x7ffff000 bytes; ask for at most 1 GiB per call.
    const size_t ask = static_cast<size_t>(std::min<uint64_t>(length - done, uint64_t{1} << 30));
    const ssize_t n = ::pread(fd, dst + done, ask, static_cast<off_t>(offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      Status s(StatusCode::kIo, "");
      s.WithErrno(errno);
      return s;
    }
    if (n == 0) break;
    done += static_cast<uint64_t>(n);
  }
  return done;
}

std::string DescribeRead(const UploadSource& src, uint64_t offset, uint64_t length, size_t item) {
  return "reading " + src.path + " at offset " + std::to_string(offset) + " (" +
         std::to_string(length) + " bytes, item " + std::to_string(item) + ")";
}

// ---- Run, step by step
// ---------------------------------------------------------------------------
//
//   1. ValidateItems   every item names a source, fits off_t and has a destination;
//   2. OpenDirect      O_DIRECT descriptors (ReadMode::kDirect);
//   3. PlanBatches     items packed into staging-buffer fills (above), ChunkLayout for hashes;
//   4. UploadRun::Stage   reader threads: wait for the slot, read, copy, record the event;
//                         hasher threads: chunk hashes of each filled buffer, then its release;
//   5. UploadRun::Drain   synchronize every stream, on success and on error alike;
//   6. UploadRun::ReportTail and the report: progress of the last batches, the checksums.

// Step 1. Returns the total bytes of the items.
Result<uint64_t> ValidateItems(std::span<const UploadSource> sources,
                               std::span<const UploadItem> items) {
  uint64_t total = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    const UploadItem& it = items[i];
    if (it.source >= sources.size()) {
      return InvalidArgument("upload item " + std::to_string(i) + " names source " +
                             std::to_string(it.source) + " of " + std::to_string(sources.size()));
    }
    if (it.length > std::numeric_limits<uint64_t>::max() - it.file_offset ||
        it.file_offset + it.length > uint64_t{std::numeric_limits<off_t>::max()}) {
      return InvalidArgument("upload item " + std::to_string(i) + " of " + sources[it.source].path +
                             ": offset + length overflows");
    }
    if (it.length > 0 && it.dst == 0) {
      return InvalidArgument("upload item " + std::to_string(i) + " of " + sources[it.source].path +
                             " has a null device destination");
    }
    if (it.stride) {
      const UploadStride& g = *it.stride;
      uint64_t held = 0, extent = 0;
      const bool valid = g.rows > 0 && g.row_bytes > 0 &&
                         (g.rows == 1 || g.source_pitch >= g.row_bytes) &&
                         !__builtin_mul_overflow(g.rows, g.row_bytes, &held) && held == it.length &&
                         !__builtin_mul_overflow(g.rows - 1, g.source_pitch, &extent) &&
                         !__builtin_add_overflow(extent, g.row_bytes, &extent) &&
                         !__builtin_add_overflow(extent, it.file_offset, &extent) &&
                         extent <= uint64_t{std::numeric_limits<off_t>::max()};
      if (!valid) {
        return InvalidArgument("upload item " + std::to_string(i) + " of " +
                               sources[it.source].path + ": a stride of " + std::to_string(g.rows) +
                               " row(s) of " + std::to_string(g.row_bytes) + " bytes, " +
                               std::to_string(g.source_pitch) + " apart, for " +
                               std::to_string(it.length) + " bytes at offset " +
                               std::to_string(it.file_offset) + " is not a valid run");
      }
    }
    total += it.length;
  }
  return total;
}

// Step 2. A separate open file description per source, so the caller's fd keeps its flags;
// /proc/self/fd reopens the same file without knowing its path. An invalid entry means "read
// this source buffered".
std::vector<UniqueFd> OpenDirect(std::span<const UploadSource> sources, ReadMode mode) {
  std::vector<UniqueFd> direct_fds(sources.size());
  if (mode != ReadMode::kDirect) return direct_fds;
  for (size_t s = 0; s < sources.size(); ++s) {
    const std::string proc = "/proc/self/fd/" + std::to_string(sources[s].fd);
    direct_fds[s].Reset(::open(proc.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC));
    if (!direct_fds[s].valid()) {
      LOG_DEBUG << "O_DIRECT refused for " << sources[s].path << " (" << std::strerror(errno)
                << "); reading it through the page cache";
    }
  }
  return direct_fds;
}

// Step 3, for checksums: every item's chunk hashes in one flat array, item i's at [begin[i],
// begin[i + 1]): two allocations however many items (10,000 tensors made 10,000 small vectors),
// freed when Run() returns. Segments write disjoint slices, so the hashers need no lock.
class ChunkLayout {
 public:
  ChunkLayout(std::span<const UploadItem> items, bool checksums)
      : begin_(checksums ? items.size() + 1 : 0, 0) {
    for (size_t i = 0; checksums && i < items.size(); ++i) {
      begin_[i + 1] = begin_[i] + ChecksumChunkCount(items[i].length);
    }
    hashes_.resize(checksums ? begin_.back() : 0);
  }
  std::span<uint64_t> SegmentHashes(const Segment& seg) {
    return std::span<uint64_t>(hashes_).subspan(
        begin_[seg.item] + seg.item_offset / kChecksumChunkBytes, ChecksumChunkCount(seg.length));
  }
  std::vector<uint64_t> Checksums() const {
    std::vector<uint64_t> out;
    out.reserve(begin_.empty() ? 0 : begin_.size() - 1);
    for (size_t i = 0; i + 1 < begin_.size(); ++i) {
      out.push_back(CombineChunkHashes(
          std::span<const uint64_t>(hashes_).subspan(begin_[i], begin_[i + 1] - begin_[i])));
    }
    return out;
  }

 private:
  std::vector<uint64_t> begin_;
  std::vector<uint64_t> hashes_;
};

// Step 3b: the staging ring (cuda/staging_ring.h), made while the readers run.

// Steps 4 to 6: the threads and shared state of one Run(). Staging buffer slot b % N carries
// batch b; a batch may refill its slot once the slot's previous batch is done on the host (read,
// copies issued, hashed) and its copies have completed on the device (its event).
class UploadRun {
 public:
  struct Resources {
    const DriverApi* api;
    CUcontext context;
    StagingRing* ring;
    std::span<const CudaStream> streams;
    std::span<const CudaEvent> events;  // one per buffer
  };

  UploadRun(const Resources& r, std::span<const UploadSource> sources,
            std::span<const UploadItem> items, std::span<const Batch> batches,
            std::span<const UniqueFd> direct_fds, const RunReaderFactory* run_reader,
            ChunkLayout* chunks, const UploadControl& control, uint64_t total)
      : r_(r),
        sources_(sources),
        items_(items),
        batches_(batches),
        direct_fds_(direct_fds),
        run_reader_(run_reader),
        chunks_(chunks),
        control_(control),
        total_(total),
        slot_fills_(r.ring->size(), 0) {}

  // Step 4: runs `readers` reader threads and, when `chunks` was given, `hashers` hasher
  // threads, until every batch is done or one of them fails. The first error is kept for Drain.
  void Stage(size_t readers, size_t hashers) {
    std::vector<std::thread> hasher_threads;
    if (chunks_ != nullptr) {
      for (size_t t = 0; t < std::min(hashers, batches_.size()); ++t) {
        hasher_threads.emplace_back([this] { Hasher(); });
      }
    }
    std::vector<std::thread> reader_threads;
    const size_t num_readers = std::min(readers, batches_.size());
    reader_threads.reserve(num_readers);
    for (size_t t = 0; t < num_readers; ++t) reader_threads.emplace_back([this] { Reader(); });
    for (std::thread& t : reader_threads) t.join();
    {
      MutexLock lock(mu_);
      readers_done_ = true;
    }
    cv_.NotifyAll();
    for (std::thread& t : hasher_threads) t.join();
  }

  // Step 5: drains every stream, on success and on error alike: the staging buffers must not
  // be refilled or freed under a copy that is still reading them. Returns the first error.
  Status Drain() {
    for (const CudaStream& s : r_.streams) {
      CUresult rc = r_.api->cuStreamSynchronize(s.get());
      if (rc != CUDA_SUCCESS)
        Fail(DriverError(r_.api, rc, "cuStreamSynchronize after the upload copies"));
    }
    MutexLock lock(mu_);
    return first_error_;
  }

  // Step 6: progress for the batches whose completion no later batch observed.
  void ReportTail() {
    const size_t n = r_.ring->size();
    const size_t tail_start = batches_.size() > n ? batches_.size() - n : 0;
    for (size_t b = tail_start; b < batches_.size(); ++b) ReportProgress(batches_[b].bytes);
    if (batches_.empty() && control_.progress) control_.progress(0, 0);
  }

 private:
  void Reader() {
    CUresult rc = r_.api->cuCtxSetCurrent(r_.context);
    if (rc != CUDA_SUCCESS) {
      return Fail(DriverError(r_.api, rc, "cuCtxSetCurrent on upload thread"));
    }
    std::unique_ptr<uint8_t[]> stage;  // this reader's gather stage, on its first strided item
    std::unique_ptr<os::RunReader> run_reader;  // null: pread
    if (run_reader_ != nullptr) {
      Result<std::unique_ptr<os::RunReader>> made = (*run_reader_)();
      if (!made.ok()) return Fail(made.status().Context("making an upload reader's run reader"));
      run_reader = std::move(made).value();
    }
    while (!stop_.load()) {
      const size_t b = next_batch_.fetch_add(1);
      if (b >= batches_.size()) return;
      if (control_.cancel != nullptr && control_.cancel->load()) {
        return Fail(Status(StatusCode::kUnavailable, "upload cancelled"));
      }
      const size_t slot = b % r_.ring->size();
      if (!WaitForSlot(b, slot)) return;
      Result<std::byte*> made = r_.ring->Wait(slot);  // at once, unless the ring is being made
      if (!made.ok()) return Fail(made.status());
      std::byte* buf = *made;
      if (Status s = ReadBatch(batches_[b], buf, stage, run_reader.get()); !s.ok()) {
        return Fail(std::move(s));
      }
      if (Status s = IssueCopies(b, slot, buf); !s.ok()) return Fail(std::move(s));
      HandOff(b, slot);
    }
  }

  // The slot's previous batch (b - N) must be done on the host before this thread may wait on
  // its event, and its copies done on the device before the buffer is refilled. False when the
  // run stopped meanwhile (an error is recorded through Fail).
  bool WaitForSlot(size_t b, size_t slot) {
    const size_t n = r_.ring->size();
    {
      MutexLock lock(mu_);
      while (!stop_.load() && slot_fills_[slot] != b / n) cv_.Wait(mu_);
      if (stop_.load()) return false;
    }
    if (b < n) return true;
    CUresult rc = r_.api->cuEventSynchronize(r_.events[slot].get());
    if (rc != CUDA_SUCCESS) {
      Fail(DriverError(r_.api, rc, "cuEventSynchronize on staging buffer " + std::to_string(slot)));
      return false;
    }
    ReportProgress(batches_[b - n].bytes);
    return true;
  }

  Status ReadBatch(const Batch& batch, std::byte* buf, std::unique_ptr<uint8_t[]>& stage,
                   os::RunReader* run_reader) {
    for (const ReadOp& r : batch.reads) {
      WEIGHTCACHE_RETURN_IF_ERROR(r.strided ? ReadStrided(r, buf, stage)
                                            : ReadOne(r, buf, run_reader));
    }
    return Status::Ok();
  }

  // The held bytes of a strided item, through the source fd as it is (buffered): its pieces
  // are gathered out of whole-row reads, which O_DIRECT's alignment would only complicate.
  Status ReadStrided(const ReadOp& r, std::byte* buf, std::unique_ptr<uint8_t[]>& stage) {
    const UploadSource& src = sources_[r.source];
    const UploadStride& g = *items_[r.first_item].stride;
    const os::StridedRun run{.file_offset = r.file_offset,
                             .rows = g.rows,
                             .row_bytes = g.row_bytes,
                             .pitch = g.source_pitch};
    Status s = os::ReadStrided(src.fd, src.path, run, r.item_offset, r.length,
                               reinterpret_cast<uint8_t*>(buf + r.buf_offset), stage);
    if (!s.ok()) {
      return s.Context("upload item " + std::to_string(r.first_item) + " (held bytes " +
                       std::to_string(r.item_offset) + " to " +
                       std::to_string(r.item_offset + r.length) + ")");
    }
    return s;
  }

  Status ReadOne(const ReadOp& r, std::byte* buf, os::RunReader* run_reader) {
    const UploadSource& src = sources_[r.source];
    const int dfd = direct_fds_[r.source].get();
    if (dfd >= 0) {
      const uint64_t lead = r.file_offset % kDirectAlign;
      const uint64_t aligned_len = AlignUp(lead + r.length, kDirectAlign);
      Result<uint64_t> n =
          PreadFull(dfd, buf + (r.buf_offset - lead), aligned_len, r.file_offset - lead);
      if (n.ok() && *n >= lead + r.length) return Status::Ok();
      // EINVAL: this filesystem or region does not take O_DIRECT after all; a short direct
      // read is re-read buffered so the error below reports what the file really holds.
      if (!n.ok() && n.status().sys_errno() != EINVAL) {
        return IoError(DescribeRead(src, r.file_offset, r.length, r.first_item),
                       n.status().sys_errno());
      }
    }
    Result<uint64_t> n = run_reader != nullptr
                             ? run_reader->Read(src.fd, buf + r.buf_offset, r.length, r.file_offset)
                             : PreadFull(src.fd, buf + r.buf_offset, r.length, r.file_offset);
    if (!n.ok() && run_reader != nullptr) {  // its message says what failed
      return n.status().Context(DescribeRead(src, r.file_offset, r.length, r.first_item));
    }
    if (!n.ok()) {
      return IoError(DescribeRead(src, r.file_offset, r.length, r.first_item),
                     n.status().sys_errno());
    }
    if (*n < r.length) {
      return Status(StatusCode::kIo, DescribeRead(src, r.file_offset, r.length, r.first_item) +
                                         ": short read, the file ends at offset " +
                                         std::to_string(r.file_offset + *n));
    }
    return Status::Ok();
  }

  // The batch's copies on one of the streams, then the slot's event after them.
  Status IssueCopies(size_t b, size_t slot, const std::byte* buf) {
    CUstream stream = r_.streams[b % r_.streams.size()].get();
    for (const Segment& seg : batches_[b].segments) {
      const UploadItem& it = items_[seg.item];
      CUresult rc = r_.api->cuMemcpyHtoDAsync(it.dst + seg.item_offset, buf + seg.buf_offset,
                                              seg.length, stream);
      if (rc != CUDA_SUCCESS) {
        // A strided item's bytes are its held bytes, not a run of the file.
        const std::string from =
            it.stride ? " held bytes from " + std::to_string(seg.item_offset)
                      : " offset " + std::to_string(it.file_offset + seg.item_offset);
        return DriverError(r_.api, rc,
                           "cuMemcpyHtoDAsync of item " + std::to_string(seg.item) + " (" +
                               sources_[it.source].path + from + ", " + std::to_string(seg.length) +
                               " bytes) to device address " +
                               std::to_string(it.dst + seg.item_offset));
      }
    }
    CUresult rc = r_.api->cuEventRecord(r_.events[slot].get(), stream);
    if (rc != CUDA_SUCCESS) {
      return DriverError(r_.api, rc, "cuEventRecord on staging buffer " + std::to_string(slot));
    }
    return Status::Ok();
  }

  // The copy engine reads the buffer now; hashing it at the same time is safe. The hashers,
  // not this thread, do it, so the reads keep the disk busy meanwhile.
  void HandOff(size_t b, size_t slot) {
    if (chunks_ == nullptr) return ReleaseSlot(slot);
    {
      MutexLock lock(mu_);
      hash_queue_.push_back(b);
    }
    cv_.NotifyAll();
  }

  // Chunk hashes of each filled staging buffer, then the buffer's release.
  void Hasher() {
    for (;;) {
      size_t b = 0;
      {
        MutexLock lock(mu_);
        while (!stop_.load() && hash_queue_.empty() && !readers_done_) cv_.Wait(mu_);
        if (stop_.load() || hash_queue_.empty()) return;
        b = hash_queue_.front();
        hash_queue_.pop_front();
      }
      const size_t slot = b % r_.ring->size();
      Result<std::byte*> made = r_.ring->Wait(slot);  // made: a reader filled it
      if (!made.ok()) return Fail(made.status());
      const std::byte* buf = *made;
      for (const Segment& seg : batches_[b].segments) {
        HashChunks(buf + seg.buf_offset, seg.length, chunks_->SegmentHashes(seg));
      }
      ReleaseSlot(slot);
    }
  }

  void Fail(Status s) {
    {
      MutexLock lock(mu_);
      if (first_error_.ok()) first_error_ = std::move(s);
      stop_ = true;
    }
    cv_.NotifyAll();
  }

  // A staging buffer's batch is done on the host: the next batch of that slot may wait on its
  // event and refill it.
  void ReleaseSlot(size_t slot) {
    {
      MutexLock lock(mu_);
      ++slot_fills_[slot];
    }
    cv_.NotifyAll();
  }

  void ReportProgress(uint64_t bytes) {
    MutexLock lock(progress_mu_);
    bytes_done_ += bytes;
    if (control_.progress) control_.progress(bytes_done_, total_);
  }

  const Resources r_;
  const std::span<const UploadSource> sources_;
  const std::span<const UploadItem> items_;
  const std::span<const Batch> batches_;
  const std::span<const UniqueFd> direct_fds_;
  const RunReaderFactory* run_reader_;  // null: pread
  ChunkLayout* const chunks_;           // null without checksums
  const UploadControl& control_;
  const uint64_t total_;

  Mutex mu_;
  CondVar cv_;
  // Batches finished on the host, per slot.
  std::vector<size_t> slot_fills_ WEIGHTCACHE_GUARDED_BY(mu_);
  // Filled batches waiting for their checksums.
  std::deque<size_t> hash_queue_ WEIGHTCACHE_GUARDED_BY(mu_);
  bool readers_done_ WEIGHTCACHE_GUARDED_BY(mu_) = false;
  Status first_error_ WEIGHTCACHE_GUARDED_BY(mu_);
  std::atomic<size_t> next_batch_{0};
  std::atomic<bool> stop_{false};
  Mutex progress_mu_;
  uint64_t bytes_done_ WEIGHTCACHE_GUARDED_BY(progress_mu_) = 0;
};

}  // namespace

Result<UploadPipeline> UploadPipeline::Create(const DriverApi* api, const UploadOptions& o) {
  if (o.staging_buffer_bytes < 2 * kChecksumChunkBytes ||
      o.staging_buffer_bytes % kChecksumChunkBytes != 0 ||
      o.staging_buffer_bytes % kDirectAlign != 0) {
    return InvalidArgument("upload staging buffer size " + std::to_string(o.staging_buffer_bytes) +
                           " must be a multiple of " + std::to_string(kChecksumChunkBytes) +
                           " bytes and at least twice that");
  }
  if (o.staging_buffers < 1 || o.reader_threads < 1 || o.copy_streams < 1 ||
      o.checksum_threads < 1) {
    return InvalidArgument(
        "upload pipeline needs at least one staging buffer, reader thread, checksum thread "
        "and copy stream");
  }
  CUcontext context = nullptr;
  WEIGHTCACHE_CU_RETURN_IF_ERROR(api, cuCtxGetCurrent(&context), "cuCtxGetCurrent");
  if (context == nullptr) {
    return InvalidArgument("upload pipeline created with no current CUDA context");
  }
  UploadPipeline p(api, context, o);
  // More readers than buffers would only wait for each other (the staged path).
  if (o.read_mode != ReadMode::kMapped) {
    p.options_.reader_threads = std::min(o.reader_threads, o.staging_buffers);
  }
  for (int i = 0; i < o.copy_streams; ++i) {
    WEIGHTCACHE_ASSIGN_OR_RETURN(CudaStream s, CudaStream::Create(api));
    p.streams_.push_back(std::move(s));
  }
  return p;
}

const char* ReadModeName(ReadMode mode) {
  switch (mode) {
    case ReadMode::kBuffered:
      return "buffered";
    case ReadMode::kDirect:
      return "direct";
    case ReadMode::kMapped:
      return "mapped";
    case ReadMode::kAuto:
      return "auto";
  }
  return "?";
}

Result<UploadReport> UploadPipeline::Run(std::span<const UploadSource> sources,
                                         std::span<const UploadItem> items,
                                         const UploadControl& control) {
  WEIGHTCACHE_ASSIGN_OR_RETURN(uint64_t total, ValidateItems(sources, items));
  const bool checksums = options_.checksums != ChecksumMode::kNone;
  if (options_.checksums == ChecksumMode::kDevice && !GpuChecksumKernelBuilt()) {
    return Status(StatusCode::kUnavailable,
                  "device checksums need the GPU checksum kernel, and this build has none");
  }
  bool mapped = options_.read_mode == ReadMode::kMapped;
  if (options_.read_mode == ReadMode::kMapped || options_.read_mode == ReadMode::kAuto) {
    WEIGHTCACHE_CU_RETURN_IF_ERROR(api_, cuCtxSetCurrent(context_), "cuCtxSetCurrent");
    Status can =
        CheckMappedUpload(api_, sources, checksums,
                          options_.read_mode == ReadMode::kAuto ? options_.min_residency : 0.0);
    if (!can.ok() && mapped) return can.Context("the mapped upload path");
    if (!can.ok()) {
      LOG_DEBUG << "upload: reading through staging buffers: " << can.message();
    }
    mapped = can.ok();
  }
  if (mapped) {
    WEIGHTCACHE_ASSIGN_OR_RETURN(
        UploadReport report,
        RunMappedUpload(api_, context_, streams_, sources, items, options_, control, total));
    report.path = ReadMode::kMapped;
    return report;
  }
  WEIGHTCACHE_ASSIGN_OR_RETURN(UploadReport report, RunStaged(sources, items, control, total));
  if (options_.checksums == ChecksumMode::kDevice) {
    const auto t0 = std::chrono::steady_clock::now();
    WEIGHTCACHE_ASSIGN_OR_RETURN(report.checksums,
                                 DeviceItemChecksums(api_, context_, streams_[0].get(), items));
    report.checksum_seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    report.seconds += report.checksum_seconds;
    report.gb_per_s =
        report.seconds > 0 ? static_cast<double>(report.bytes) / report.seconds / 1e9 : 0;
  }
  return report;
}

Result<UploadReport> UploadPipeline::RunStaged(std::span<const UploadSource> sources,
                                               std::span<const UploadItem> items,
                                               const UploadControl& control, uint64_t total) {
  const auto t0 = std::chrono::steady_clock::now();
  const std::vector<UniqueFd> direct_fds = OpenDirect(sources, options_.read_mode);
  const std::vector<Batch> batches = PlanBatches(items, options_.staging_buffer_bytes);
  const bool checksums = options_.checksums == ChecksumMode::kCompute;  // host hashers
  ChunkLayout chunks(items, checksums);

  // The ring's events first (cheap), then its slots, made while the readers run (StagingRing):
  // as many as the batches use, up to staging_buffers (each slot is then filled at least once,
  // so a successful run has made them all; none without batches); an earlier run's ring is
  // reused when it has enough.
  const size_t wanted = std::min(batches.size(), static_cast<size_t>(options_.staging_buffers));
  const size_t n = ring_slots_ >= wanted ? ring_slots_ : wanted;
  // Slots per pin: staging_pin_bytes' worth (at least one slot; 0 means one slot per pin).
  const size_t group =
      std::max<uint64_t>(options_.staging_pin_bytes / options_.staging_buffer_bytes, uint64_t{1});
  for (size_t i = events_.size(); i < n; ++i) {
    auto e = CudaEvent::Create(api_);
    if (!e.ok()) {
      events_.clear();  // nothing of the ring is kept after a failed Run
      return e.status();
    }
    events_.push_back(std::move(e).value());
  }
  StagingRing ring(api_, context_, n, options_.staging_buffer_bytes, group, std::move(buffers_));
  buffers_.clear();
  ring_slots_ = 0;
  ring.StartMaking();

  UploadRun run({api_, context_, &ring, streams_, std::span(events_).first(n)}, sources, items,
                batches, direct_fds, options_.run_reader ? &options_.run_reader : nullptr,
                checksums ? &chunks : nullptr, control, total);
  run.Stage(static_cast<size_t>(options_.reader_threads),
            static_cast<size_t>(options_.checksum_threads));
  Status drained = run.Drain();
  // No copy reads the ring any more: the ring is kept whole for the next Run, or not at all.
  Result<std::vector<PinnedHostBuffer>> made = ring.Finish();
  const Status ring_status = made.status();
  if (made.ok()) {
    buffers_ = std::move(made).value();
    ring_slots_ = n;
  } else {
    events_.clear();
  }
  WEIGHTCACHE_RETURN_IF_ERROR(drained);
  WEIGHTCACHE_RETURN_IF_ERROR(ring_status);
  run.ReportTail();

  UploadReport report;
  report.bytes = total;
  report.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  report.gb_per_s = report.seconds > 0 ? static_cast<double>(total) / report.seconds / 1e9 : 0;
  report.staging_fills = batches.size();
  report.staging_seconds = ring.seconds();
  report.direct_sources = static_cast<size_t>(std::count_if(
      direct_fds.begin(), direct_fds.end(), [](const UniqueFd& fd) { return fd.valid(); }));
  report.path = report.direct_sources > 0 ? ReadMode::kDirect : ReadMode::kBuffered;
  if (checksums) report.checksums = chunks.Checksums();
  LOG_DEBUG << "upload: " << total << " bytes in " << report.seconds << " s (" << report.gb_per_s
            << " GB/s), " << batches.size() << " staging fills";
  return report;
}

}  // namespace weightcache::cuda
