#include "cuda/upload_pipeline.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <limits>
#include <mutex>
#include <thread>

#include "common/logging.h"
#include "common/unique_fd.h"
#include "cuda/checksum.h"

namespace weightcache::cuda {
namespace {

// O_DIRECT needs offset, length and address aligned to the logical block size; 4096 covers
// every block size in use (512 and 4096).
constexpr uint64_t kDirectAlign = 4096;

uint64_t AlignDown(uint64_t v, uint64_t a) { return v / a * a; }
uint64_t AlignUp(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

// One contiguous file region read into a staging buffer. Its buffer position is congruent to
// its file offset modulo kDirectAlign, so the O_DIRECT variant (the aligned superset of the
// region) lands on an aligned buffer address without moving the data.
struct ReadOp {
  size_t source;
  uint64_t file_offset;
  uint64_t length;
  uint64_t buf_offset;
  size_t first_item;  // for error messages
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
      const bool contiguous = !cur.reads.empty() && cur.reads.back().source == item.source &&
                              cur.reads.back().file_offset + cur.reads.back().length == file_pos;
      const uint64_t start =
          contiguous ? used : AlignUp(used, kDirectAlign) + file_pos % kDirectAlign;
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
  // More readers than buffers would only wait for each other.
  p.options_.reader_threads = std::min(o.reader_threads, o.staging_buffers);
  for (int i = 0; i < o.staging_buffers; ++i) {
    WEIGHTCACHE_ASSIGN_OR_RETURN(PinnedHostBuffer b,
                                 PinnedHostBuffer::Create(api, o.staging_buffer_bytes));
    p.buffers_.push_back(std::move(b));
  }
  for (int i = 0; i < o.copy_streams; ++i) {
    WEIGHTCACHE_ASSIGN_OR_RETURN(CudaStream s, CudaStream::Create(api));
    p.streams_.push_back(std::move(s));
  }
  for (int i = 0; i < o.staging_buffers; ++i) {
    WEIGHTCACHE_ASSIGN_OR_RETURN(CudaEvent e, CudaEvent::Create(api));
    p.events_.push_back(std::move(e));
  }
  return p;
}

Result<UploadReport> UploadPipeline::Run(std::span<const UploadSource> sources,
                                         std::span<const UploadItem> items,
                                         const UploadControl& control) {
  const auto t0 = std::chrono::steady_clock::now();
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
    total += it.length;
  }

  // O_DIRECT descriptors: a separate open file description per source, so the caller's fd
  // keeps its flags. /proc/self/fd reopens the same file without knowing its path.
  std::vector<UniqueFd> direct_fds(sources.size());
  size_t direct_sources = 0;
  if (options_.read_mode == ReadMode::kDirect) {
    for (size_t s = 0; s < sources.size(); ++s) {
      const std::string proc = "/proc/self/fd/" + std::to_string(sources[s].fd);
      direct_fds[s].Reset(::open(proc.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC));
      if (direct_fds[s].valid()) {
        ++direct_sources;
      } else {
        LOG_DEBUG << "O_DIRECT refused for " << sources[s].path << " (" << std::strerror(errno)
                  << "); reading it through the page cache";
      }
    }
  }

  const std::vector<Batch> batches = PlanBatches(items, options_.staging_buffer_bytes);
  const bool checksums = options_.checksums == ChecksumMode::kCompute;
  // Every item's chunk hashes in one flat array, item i's at [chunk_begin[i], chunk_begin[i +
  // 1]): two allocations however many items (10,000 tensors made 10,000 small vectors), all
  // freed when Run() returns. Segments write disjoint slices, so the hashers need no lock.
  std::vector<uint64_t> chunk_begin(checksums ? items.size() + 1 : 0, 0);
  for (size_t i = 0; checksums && i < items.size(); ++i) {
    chunk_begin[i + 1] = chunk_begin[i] + ChecksumChunkCount(items[i].length);
  }
  std::vector<uint64_t> chunk_hashes(checksums ? chunk_begin.back() : 0);

  const size_t num_buffers = buffers_.size();
  std::mutex mu;
  std::condition_variable cv;
  std::vector<size_t> slot_fills(num_buffers, 0);  // batches finished on the host, per slot
  std::atomic<size_t> next_batch{0};
  std::atomic<bool> stop{false};
  std::deque<size_t> hash_queue;  // filled batches waiting for their checksums (under mu)
  bool readers_done = false;      // (under mu)
  Status first_error;
  std::mutex progress_mu;
  uint64_t bytes_done = 0;

  auto fail = [&](Status s) {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (first_error.ok()) first_error = std::move(s);
      stop = true;
    }
    cv.notify_all();
  };
  // A staging buffer's batch is done on the host (read, copies issued, hashed): the next
  // batch of that slot may wait on its event and refill it.
  auto release_slot = [&](size_t slot) {
    {
      std::lock_guard<std::mutex> lock(mu);
      ++slot_fills[slot];
    }
    cv.notify_all();
  };
  auto report_progress = [&](uint64_t bytes) {
    std::lock_guard<std::mutex> lock(progress_mu);
    bytes_done += bytes;
    if (control.progress) control.progress(bytes_done, total);
  };

  auto do_read = [&](const ReadOp& r, std::byte* buf) -> Status {
    const UploadSource& src = sources[r.source];
    const int dfd = direct_fds[r.source].get();
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
    Result<uint64_t> n = PreadFull(src.fd, buf + r.buf_offset, r.length, r.file_offset);
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
  };

  auto reader = [&]() {
    CUresult rc = api_->cuCtxSetCurrent(context_);
    if (rc != CUDA_SUCCESS) return fail(DriverError(api_, rc, "cuCtxSetCurrent on upload thread"));
    while (!stop.load()) {
      const size_t b = next_batch.fetch_add(1);
      if (b >= batches.size()) return;
      if (control.cancel != nullptr && control.cancel->load()) {
        return fail(Status(StatusCode::kUnavailable, "upload cancelled"));
      }
      const size_t slot = b % num_buffers;
      {
        // The slot's previous batch (b - num_buffers) must have issued its copies and
        // recorded its event before this thread may wait on that event.
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [&] { return stop.load() || slot_fills[slot] == b / num_buffers; });
        if (stop.load()) return;
      }
      if (b >= num_buffers) {
        rc = api_->cuEventSynchronize(events_[slot].get());
        if (rc != CUDA_SUCCESS) {
          return fail(DriverError(api_, rc,
                                  "cuEventSynchronize on staging buffer " + std::to_string(slot)));
        }
        report_progress(batches[b - num_buffers].bytes);
      }
      const Batch& batch = batches[b];
      std::byte* buf = buffers_[slot].data();
      for (const ReadOp& r : batch.reads) {
        if (Status s = do_read(r, buf); !s.ok()) return fail(std::move(s));
      }
      CUstream stream = streams_[b % streams_.size()].get();
      for (const Segment& seg : batch.segments) {
        const UploadItem& it = items[seg.item];
        rc = api_->cuMemcpyHtoDAsync(it.dst + seg.item_offset, buf + seg.buf_offset, seg.length,
                                     stream);
        if (rc != CUDA_SUCCESS) {
          return fail(DriverError(api_, rc,
                                  "cuMemcpyHtoDAsync of item " + std::to_string(seg.item) + " (" +
                                      sources[it.source].path + " offset " +
                                      std::to_string(it.file_offset + seg.item_offset) + ", " +
                                      std::to_string(seg.length) + " bytes) to device address " +
                                      std::to_string(it.dst + seg.item_offset)));
        }
      }
      rc = api_->cuEventRecord(events_[slot].get(), stream);
      if (rc != CUDA_SUCCESS) {
        return fail(
            DriverError(api_, rc, "cuEventRecord on staging buffer " + std::to_string(slot)));
      }
      if (checksums) {
        // The copy engine reads the buffer now; hashing it at the same time is safe. The
        // hashers, not this thread, do it, so the reads keep the disk busy meanwhile.
        {
          std::lock_guard<std::mutex> lock(mu);
          hash_queue.push_back(b);
        }
        cv.notify_all();
      } else {
        release_slot(slot);
      }
    }
  };

  // Hasher threads: chunk hashes of each filled staging buffer, then the buffer's release.
  auto hasher = [&]() {
    for (;;) {
      size_t b = 0;
      {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [&] { return stop.load() || !hash_queue.empty() || readers_done; });
        if (stop.load() || hash_queue.empty()) return;
        b = hash_queue.front();
        hash_queue.pop_front();
      }
      const std::byte* buf = buffers_[b % num_buffers].data();
      for (const Segment& seg : batches[b].segments) {
        HashChunks(buf + seg.buf_offset, seg.length,
                   std::span<uint64_t>(chunk_hashes)
                       .subspan(chunk_begin[seg.item] + seg.item_offset / kChecksumChunkBytes,
                                ChecksumChunkCount(seg.length)));
      }
      release_slot(b % num_buffers);
    }
  };

  std::vector<std::thread> hashers;
  if (checksums) {
    const size_t num_hashers =
        std::min<size_t>(static_cast<size_t>(options_.checksum_threads), batches.size());
    for (size_t t = 0; t < num_hashers; ++t) hashers.emplace_back(hasher);
  }
  std::vector<std::thread> threads;
  const size_t num_threads =
      std::min<size_t>(static_cast<size_t>(options_.reader_threads), batches.size());
  threads.reserve(num_threads);
  for (size_t t = 0; t < num_threads; ++t) threads.emplace_back(reader);
  for (std::thread& t : threads) t.join();
  {
    std::lock_guard<std::mutex> lock(mu);
    readers_done = true;
  }
  cv.notify_all();
  for (std::thread& t : hashers) t.join();

  // Drain every stream, on success and on error alike: the staging buffers must not be
  // refilled or freed under a copy that is still reading them.
  for (const CudaStream& s : streams_) {
    CUresult rc = api_->cuStreamSynchronize(s.get());
    if (rc != CUDA_SUCCESS && first_error.ok()) {
      first_error = DriverError(api_, rc, "cuStreamSynchronize after the upload copies");
    }
  }
  if (!first_error.ok()) return first_error;
  // The batches whose completion no later batch observed.
  const size_t tail_start = batches.size() > num_buffers ? batches.size() - num_buffers : 0;
  for (size_t b = tail_start; b < batches.size(); ++b) report_progress(batches[b].bytes);
  if (batches.empty() && control.progress) control.progress(0, 0);

  UploadReport report;
  report.bytes = total;
  report.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  report.gb_per_s = report.seconds > 0 ? static_cast<double>(total) / report.seconds / 1e9 : 0;
  report.staging_fills = batches.size();
  report.direct_sources = direct_sources;
  if (checksums) {
    report.checksums.reserve(items.size());
    for (size_t i = 0; i < items.size(); ++i) {
      report.checksums.push_back(
          CombineChunkHashes(std::span<const uint64_t>(chunk_hashes)
                                 .subspan(chunk_begin[i], chunk_begin[i + 1] - chunk_begin[i])));
    }
  }
  LOG_DEBUG << "upload: " << total << " bytes in " << report.seconds << " s (" << report.gb_per_s
            << " GB/s), " << batches.size() << " staging fills";
  return report;
}

}  // namespace weightcache::cuda
