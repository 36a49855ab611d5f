// Demotion and promotion copies (see tier_copy.h).
#include "cuda/tier_copy.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <deque>
#include <optional>
#include <thread>
#include <utility>

#include "common/logging.h"
#include "cuda/exported_arena.h"
#include "cuda/imported_arena.h"
#include "cuda/pinned_host_buffer.h"
#include "cuda/upload_resources.h"
#include "cuda/vmm.h"
#include "os/memfd.h"

namespace weightcache::cuda {
namespace {

// Waits for every copy issued on `stream`. A failed wait is tried once more (the first
// failure, if any, becomes *status unless it holds an error already). False when the stream
// cannot be waited for at all (a broken context): copies may still be touching its host
// memory, which the caller must then leave pinned; *status then names the failure.
bool DrainStream(const DriverApi* api, CUstream stream, Status* status) {
  const CUresult first = api->cuStreamSynchronize(stream);
  if (first == CUDA_SUCCESS) return true;
  if (status->ok()) *status = DriverError(api, first, "cuStreamSynchronize after the tier copy");
  const CUresult again = api->cuStreamSynchronize(stream);
  if (again == CUDA_SUCCESS) return true;
  if (status->ok()) *status = DriverError(api, again, "cuStreamSynchronize after the tier copy");
  return false;
}

// The unit of registration and copy: large enough that a copy runs at the link's rate, small
// enough that pinning the next chunk overlaps the copies in flight.
constexpr uint64_t kChunkBytes = uint64_t{128} << 20;
// Chunks registered and in flight at once, per worker.
constexpr size_t kInFlight = 2;

enum class Direction { kDeviceToHost, kHostToDevice };

struct Chunk {
  std::byte* host = nullptr;
  CUdeviceptr device = 0;
  size_t bytes = 0;
};

// Copies every chunk on one stream, registering each chunk's host range (with
// `register_flags`) before its copy and unregistering it once its copy is done; at most
// kInFlight chunks are registered at a time. Every registration is undone on every path.
class ChunkCopier {
 public:
  ChunkCopier(const DriverApi* api, Direction direction, unsigned register_flags)
      : api_(api), direction_(direction), register_flags_(register_flags) {}

  Status Run(const std::vector<Chunk>& chunks, TierCopyReport& report) {
    WEIGHTCACHE_ASSIGN_OR_RETURN(CudaStream stream, CudaStream::Create(api_));
    std::vector<CudaEvent> events;
    for (size_t i = 0; i < kInFlight; ++i) {
      WEIGHTCACHE_ASSIGN_OR_RETURN(CudaEvent event, CudaEvent::Create(api_));
      events.push_back(std::move(event));
    }
    Status status = Issue(chunks, stream.get(), events, report);
    // Copies already issued may still touch registered memory: wait before unpinning it; a
    // stream that cannot be waited for keeps its chunks registered rather than unpin memory a
    // copy may still use.
    if (!DrainStream(api_, stream.get(), &status)) {
      LOG_ERROR << status.ToString() << ": leaving " << in_flight_.size() << " chunk(s) registered";
      in_flight_.clear();
      return status;
    }
    while (!in_flight_.empty()) Retire();
    return status;
  }

 private:
  struct InFlight {
    void* registered = nullptr;  // null: copied pageable
    size_t event = 0;
  };

  Status Issue(const std::vector<Chunk>& chunks, CUstream stream,
               const std::vector<CudaEvent>& events, TierCopyReport& report) {
    for (size_t c = 0; c < chunks.size(); ++c) {
      const Chunk& chunk = chunks[c];
      if (in_flight_.size() == kInFlight) {
        if (CUresult rc = api_->cuEventSynchronize(events[in_flight_.front().event].get());
            rc != CUDA_SUCCESS) {
          return DriverError(api_, rc, "cuEventSynchronize of a tier copy chunk");
        }
        Retire();
      }
      void* registered = nullptr;
      if (CUresult rc = api_->cuMemHostRegister(chunk.host, chunk.bytes, register_flags_);
          rc == CUDA_SUCCESS) {
        registered = chunk.host;
        ++report.chunks;
      } else {
        if (report.unregistered == 0) {
          LOG_WARN << DriverError(api_, rc, "cuMemHostRegister of a tier copy chunk").ToString()
                   << ": copying such chunks from pageable memory (slower)";
        }
        ++report.unregistered;
      }
      const size_t event = c % kInFlight;
      in_flight_.push_back({registered, event});
      const CUresult rc =
          direction_ == Direction::kDeviceToHost
              ? api_->cuMemcpyDtoHAsync(chunk.host, chunk.device, chunk.bytes, stream)
              : api_->cuMemcpyHtoDAsync(chunk.device, chunk.host, chunk.bytes, stream);
      if (rc != CUDA_SUCCESS) {
        return DriverError(api_, rc,
                           direction_ == Direction::kDeviceToHost
                               ? "cuMemcpyDtoHAsync of " + std::to_string(chunk.bytes) + " bytes"
                               : "cuMemcpyHtoDAsync of " + std::to_string(chunk.bytes) + " bytes");
      }
      if (CUresult er = api_->cuEventRecord(events[event].get(), stream); er != CUDA_SUCCESS) {
        return DriverError(api_, er, "cuEventRecord after a tier copy chunk");
      }
      report.bytes += chunk.bytes;
    }
    return Status::Ok();
  }

  // The oldest chunk's copy is done (its event, or the stream, was waited for): unpin it.
  void Retire() {
    const InFlight done = in_flight_.front();
    in_flight_.pop_front();
    if (done.registered == nullptr) return;
    if (CUresult rc = api_->cuMemHostUnregister(done.registered); rc != CUDA_SUCCESS) {
      LogReleaseFailure(api_, rc, "cuMemHostUnregister of a tier copy chunk");
    }
  }

  const DriverApi* api_;
  Direction direction_;
  unsigned register_flags_;
  std::deque<InFlight> in_flight_;
};

// Every chunk copied by up to `max_workers` threads (chunk c by worker c % workers), each with
// its own stream and `context` current: registering a chunk (pinning, and for a demotion
// allocating, its pages) costs host time that one thread would not overlap with the copies
// enough to keep the link busy. The first error of any worker is returned, once all have
// finished.
Status CopyInParallel(const DriverApi* api, CUcontext context, Direction direction,
                      unsigned register_flags, const std::vector<Chunk>& chunks, size_t max_workers,
                      TierCopyReport& report) {
  const size_t workers = std::min(std::max<size_t>(max_workers, 1), chunks.size());
  std::vector<TierCopyReport> reports(workers);
  std::vector<Status> statuses(workers);
  std::vector<std::thread> threads;
  threads.reserve(workers);
  for (size_t w = 0; w < workers; ++w) {
    threads.emplace_back([&, w] {
      if (CUresult rc = api->cuCtxSetCurrent(context); rc != CUDA_SUCCESS) {
        statuses[w] = DriverError(api, rc, "cuCtxSetCurrent on a tier copy worker");
        return;
      }
      std::vector<Chunk> mine;
      for (size_t c = w; c < chunks.size(); c += workers) mine.push_back(chunks[c]);
      statuses[w] = ChunkCopier(api, direction, register_flags).Run(mine, reports[w]);
    });
  }
  for (auto& t : threads) t.join();
  for (size_t w = 0; w < workers; ++w) {
    report.bytes += reports[w].bytes;
    report.chunks += reports[w].chunks;
    report.unregistered += reports[w].unregistered;
  }
  for (const Status& s : statuses) {
    if (!s.ok()) return s;
  }
  return Status::Ok();
}

// ---- the host copy's segments ----

// One memfd of the host copy: bytes [offset, offset + bytes) of allocation `alloc`.
struct HostSegment {
  size_t alloc = 0;
  uint64_t offset = 0;
  uint64_t bytes = 0;
  int fd = -1;  // borrowed
};

uint64_t PageBytes() { return static_cast<uint64_t>(::sysconf(_SC_PAGESIZE)); }

// A demotion's segments (fds not yet made): each allocation cut into pieces of at most
// options.segment_bytes, and a copy smaller than threads × segment_bytes into about `threads`
// segments of whole pages, so that every worker has one to write.
std::vector<HostSegment> PlanSegments(std::span<const uint64_t> sizes,
                                      const TierCopyOptions& options) {
  const uint64_t page = PageBytes();
  uint64_t total = 0;
  for (uint64_t s : sizes) total += s;
  const uint64_t threads = std::max<uint64_t>(options.threads, 1);
  const uint64_t per_thread = (total / threads + page - 1) / page * page;
  const uint64_t segment = std::min(options.segment_bytes, std::max(per_thread, page));
  std::vector<HostSegment> segments;
  for (size_t a = 0; a < sizes.size(); ++a) {
    for (uint64_t at = 0; at < sizes[a]; at += segment) {
      segments.push_back({a, at, std::min(segment, sizes[a] - at), -1});
    }
  }
  return segments;
}

// A promotion's segments: `memfds` in order, their sizes (fstat) tiling `sizes` exactly.
Result<std::vector<HostSegment>> SegmentsOf(std::span<const int> memfds,
                                            std::span<const uint64_t> sizes) {
  std::vector<HostSegment> segments;
  size_t alloc = 0;
  uint64_t at = 0;
  for (size_t i = 0; i < memfds.size(); ++i) {
    auto bytes = os::FileSize(memfds[i]);
    if (!bytes.ok()) return bytes.status().Context("promotion: memfd " + std::to_string(i));
    if (alloc == sizes.size() || *bytes == 0 || *bytes > sizes[alloc] - at) {
      return InvalidArgument(
          "promotion: memfd " + std::to_string(i) + " of " + std::to_string(memfds.size()) +
          " holds " + std::to_string(*bytes) + " bytes, which do not fit " +
          (alloc == sizes.size() ? std::string("any allocation (all are filled)")
                                 : "the " + std::to_string(sizes[alloc] - at) +
                                       " bytes left of allocation " + std::to_string(alloc)));
    }
    segments.push_back({alloc, at, *bytes, memfds[i]});
    at += *bytes;
    if (at == sizes[alloc]) {
      ++alloc;
      at = 0;
    }
  }
  if (alloc != sizes.size()) {
    return InvalidArgument("promotion: " + std::to_string(memfds.size()) +
                           " memfd(s) end in allocation " + std::to_string(alloc) + " of " +
                           std::to_string(sizes.size()) + " (its bytes from " + std::to_string(at) +
                           " on, and any after it, are missing)");
  }
  return segments;
}

// ---- kStaged ----

// One piece of a staged copy: `bytes` at `offset` of the memfd `fd`, to or from `device`.
struct Piece {
  int fd = -1;
  uint64_t offset = 0;
  CUdeviceptr device = 0;
  size_t bytes = 0;
};

// The pieces of at most `piece_bytes` of `segment`, appended to `out`.
void AppendPieces(const HostSegment& segment, CUdeviceptr alloc_base, size_t piece_bytes,
                  std::vector<Piece>& out) {
  for (uint64_t at = 0; at < segment.bytes; at += piece_bytes) {
    out.push_back({segment.fd, at, alloc_base + segment.offset + at,
                   static_cast<size_t>(std::min<uint64_t>(piece_bytes, segment.bytes - at))});
  }
}

// Promotion: every piece of every segment, dealt round-robin to `workers` (reads of one file
// scale across threads).
std::vector<std::vector<Piece>> DealPieces(const std::vector<HostSegment>& segments,
                                           const std::vector<CUdeviceptr>& bases,
                                           size_t piece_bytes, size_t workers) {
  std::vector<Piece> all;
  for (const HostSegment& s : segments) AppendPieces(s, bases[s.alloc], piece_bytes, all);
  std::vector<std::vector<Piece>> dealt(std::min(workers, all.size()));
  for (size_t i = 0; i < all.size(); ++i) dealt[i % dealt.size()].push_back(all[i]);
  return dealt;
}

// Demotion: whole segments dealt round-robin to `workers`, so that one thread writes each memfd
// (the kernel serialises writers of one shmem file).
std::vector<std::vector<Piece>> DealSegments(const std::vector<HostSegment>& segments,
                                             const std::vector<CUdeviceptr>& bases,
                                             size_t piece_bytes, size_t workers) {
  std::vector<std::vector<Piece>> dealt(std::min(workers, segments.size()));
  for (size_t i = 0; i < segments.size(); ++i) {
    AppendPieces(segments[i], bases[segments[i].alloc], piece_bytes, dealt[i % dealt.size()]);
  }
  return dealt;
}

// Reads exactly `bytes` at `offset` of `fd` into `out`. kIo on an error or an early end.
Status ReadFully(int fd, std::byte* out, size_t bytes, uint64_t offset) {
  size_t done = 0;
  while (done < bytes) {
    const ssize_t n = ::pread(fd, out + done, bytes - done, static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return IoError("promotion: reading a demoted memfd", errno);
    if (n == 0) {
      return IoError(
          "promotion: a demoted memfd ended at " + std::to_string(offset + done) + " bytes", EIO);
    }
    done += static_cast<size_t>(n);
  }
  return Status::Ok();
}

// One staged worker: its own stream, two pinned buffers and two events; its pieces in order,
// the host side of piece k (a read, or for a demotion the write of piece k-1) overlapping the
// DMA of the other buffer.
class StagedCopier {
 public:
  StagedCopier(const DriverApi* api, Direction direction, size_t staging_bytes)
      : api_(api), direction_(direction), staging_bytes_(staging_bytes) {}

  Status Run(const std::vector<Piece>& pieces, TierCopyReport& report) {
    if (pieces.empty()) return Status::Ok();
    WEIGHTCACHE_ASSIGN_OR_RETURN(CudaStream stream, CudaStream::Create(api_));
    std::array<std::optional<CudaEvent>, 2> events;
    std::array<std::optional<PinnedHostBuffer>, 2> buffers;
    for (size_t b = 0; b < 2; ++b) {
      WEIGHTCACHE_ASSIGN_OR_RETURN(CudaEvent event, CudaEvent::Create(api_));
      events[b].emplace(std::move(event));
      WEIGHTCACHE_ASSIGN_OR_RETURN(PinnedHostBuffer buffer,
                                   PinnedHostBuffer::Create(api_, staging_bytes_));
      buffers[b].emplace(std::move(buffer));
    }
    Status status = direction_ == Direction::kHostToDevice
                        ? Promote(pieces, stream.get(), events, buffers, report)
                        : Demote(pieces, stream.get(), events, buffers, report);
    // Copies already issued may still use the staging buffers: wait before they are freed; a
    // stream that cannot be waited for leaves its buffers pinned and mapped rather than free
    // memory a copy may reach.
    if (!DrainStream(api_, stream.get(), &status)) {
      LOG_ERROR << status.ToString() << ": leaving its 2 staging buffers pinned";
      for (auto& buffer : buffers) buffer->Abandon();
    }
    return status;
  }

 private:
  using Events = std::array<std::optional<CudaEvent>, 2>;
  using Buffers = std::array<std::optional<PinnedHostBuffer>, 2>;

  Status Wait(const Events& events, size_t b) {
    if (CUresult rc = api_->cuEventSynchronize(events[b]->get()); rc != CUDA_SUCCESS) {
      return DriverError(api_, rc, "cuEventSynchronize of a staged tier copy piece");
    }
    return Status::Ok();
  }

  Status Promote(const std::vector<Piece>& pieces, CUstream stream, const Events& events,
                 const Buffers& buffers, TierCopyReport& report) {
    for (size_t k = 0; k < pieces.size(); ++k) {
      const Piece& p = pieces[k];
      const size_t b = k % 2;
      // The DMA of piece k-2 out of this buffer must be done before the buffer is refilled.
      if (k >= 2) WEIGHTCACHE_RETURN_IF_ERROR(Wait(events, b));
      WEIGHTCACHE_RETURN_IF_ERROR(ReadFully(p.fd, buffers[b]->data(), p.bytes, p.offset));
      if (CUresult rc = api_->cuMemcpyHtoDAsync(p.device, buffers[b]->data(), p.bytes, stream);
          rc != CUDA_SUCCESS) {
        return DriverError(api_, rc, "cuMemcpyHtoDAsync of " + std::to_string(p.bytes) + " bytes");
      }
      if (CUresult rc = api_->cuEventRecord(events[b]->get(), stream); rc != CUDA_SUCCESS) {
        return DriverError(api_, rc, "cuEventRecord after a staged tier copy piece");
      }
      ++report.chunks;
      report.bytes += p.bytes;
    }
    return Status::Ok();
  }

  // Piece k's DMA into buffer k%2 is issued, then piece k-1 (the other buffer) is waited for
  // and written into its memfd while piece k's DMA runs.
  Status Demote(const std::vector<Piece>& pieces, CUstream stream, const Events& events,
                const Buffers& buffers, TierCopyReport& report) {
    auto write_back = [&](size_t k) -> Status {
      const size_t b = k % 2;
      WEIGHTCACHE_RETURN_IF_ERROR(Wait(events, b));
      const Piece& p = pieces[k];
      Status written = os::PwriteAll(p.fd, buffers[b]->data(), p.bytes, p.offset);
      if (!written.ok()) return written.Context("demotion: a segment of the host copy");
      ++report.chunks;
      report.bytes += p.bytes;
      return Status::Ok();
    };
    for (size_t k = 0; k < pieces.size(); ++k) {
      const Piece& p = pieces[k];
      const size_t b = k % 2;
      if (CUresult rc = api_->cuMemcpyDtoHAsync(buffers[b]->data(), p.device, p.bytes, stream);
          rc != CUDA_SUCCESS) {
        return DriverError(api_, rc, "cuMemcpyDtoHAsync of " + std::to_string(p.bytes) + " bytes");
      }
      if (CUresult rc = api_->cuEventRecord(events[b]->get(), stream); rc != CUDA_SUCCESS) {
        return DriverError(api_, rc, "cuEventRecord after a staged tier copy piece");
      }
      if (k >= 1) WEIGHTCACHE_RETURN_IF_ERROR(write_back(k - 1));
    }
    return write_back(pieces.size() - 1);
  }

  const DriverApi* api_;
  Direction direction_;
  size_t staging_bytes_;
};

// Runs fn(w) on `workers` threads; the first error, once all have finished.
template <typename Fn>
Status OnThreads(size_t workers, Fn fn) {
  std::vector<Status> statuses(workers);
  std::vector<std::thread> threads;
  threads.reserve(workers);
  for (size_t w = 0; w < workers; ++w) {
    threads.emplace_back([&, w] { statuses[w] = fn(w); });
  }
  for (auto& t : threads) t.join();
  for (const Status& s : statuses) {
    if (!s.ok()) return s;
  }
  return Status::Ok();
}

// Each worker's pieces copied on a thread of its own, `context` current on each; staging buffers
// of the largest piece's size.
Status StagedInParallel(const DriverApi* api, CUcontext context, Direction direction,
                        const std::vector<std::vector<Piece>>& dealt, TierCopyReport& report) {
  size_t largest = 0;
  for (const auto& mine : dealt) {
    for (const Piece& p : mine) largest = std::max(largest, p.bytes);
  }
  std::vector<TierCopyReport> reports(dealt.size());
  Status status = OnThreads(dealt.size(), [&](size_t w) -> Status {
    if (CUresult rc = api->cuCtxSetCurrent(context); rc != CUDA_SUCCESS) {
      return DriverError(api, rc, "cuCtxSetCurrent on a tier copy worker");
    }
    return StagedCopier(api, direction, largest).Run(dealt[w], reports[w]);
  });
  for (const TierCopyReport& r : reports) {
    report.bytes += r.bytes;
    report.chunks += r.chunks;
  }
  return status;
}

Status CheckOptions(const TierCopyOptions& options, std::string_view what) {
  if (options.strategy == TierCopyStrategy::kStaged &&
      (options.threads == 0 || options.staging_bytes == 0)) {
    return InvalidArgument(std::string(what) + ": a staged copy needs threads and staging bytes");
  }
  if (options.segment_bytes == 0 || options.segment_bytes % PageBytes() != 0) {
    return InvalidArgument(std::string(what) + ": a segment of " +
                           std::to_string(options.segment_bytes) +
                           " bytes is not a whole number of pages");
  }
  return Status::Ok();
}

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// The chunks of `size` bytes at `host` and `device`.
void AppendChunks(std::byte* host, CUdeviceptr device, uint64_t size, std::vector<Chunk>& out) {
  for (uint64_t at = 0; at < size; at += kChunkBytes) {
    out.push_back({host + at, device + at, static_cast<size_t>(std::min(kChunkBytes, size - at))});
  }
}

Status CheckSizes(std::span<const uint64_t> sizes, std::string_view what) {
  if (sizes.empty()) return InvalidArgument(std::string(what) + ": no allocation sizes");
  if (std::ranges::any_of(sizes, [](uint64_t s) { return s == 0; })) {
    return InvalidArgument(std::string(what) + ": an allocation of 0 bytes");
  }
  return Status::Ok();
}

void Finish(TierCopyReport& report, std::chrono::steady_clock::time_point start) {
  report.seconds = SecondsSince(start);
  report.gb_per_s =
      report.seconds > 0 ? static_cast<double>(report.bytes) / 1e9 / report.seconds : 0;
}

}  // namespace

size_t DefaultTierCopyThreads() {
  return std::clamp<size_t>(std::thread::hardware_concurrency(), 4, 16);
}

Result<std::vector<UniqueFd>> CopyDeviceToMemfds(const DriverApi* api, CUdevice device,
                                                 std::span<const int> vmm_fds,
                                                 std::span<const uint64_t> sizes,
                                                 const std::string& name, TierCopyReport* report,
                                                 const TierCopyOptions& options) {
  WEIGHTCACHE_RETURN_IF_ERROR(CheckSizes(sizes, "demotion"));
  if (vmm_fds.size() != sizes.size()) {
    return InvalidArgument("demotion: " + std::to_string(vmm_fds.size()) + " fd(s) for " +
                           std::to_string(sizes.size()) + " allocation size(s)");
  }
  WEIGHTCACHE_RETURN_IF_ERROR(CheckOptions(options, "demotion"));
  std::vector<UniqueFd> dups;
  for (int fd : vmm_fds) {
    UniqueFd dup(::fcntl(fd, F_DUPFD_CLOEXEC, 0));
    if (!dup) return IoError("demotion: duplicating allocation fd " + std::to_string(fd), errno);
    dups.push_back(std::move(dup));
  }
  // Imported and mapped for this copy only; its context reference goes with it.
  WEIGHTCACHE_ASSIGN_OR_RETURN(ImportedArena arena,
                               ImportedArena::Import(api, device, std::move(dups), sizes));
  std::vector<CUdeviceptr> bases;
  for (const auto& allocation : arena.allocations()) bases.push_back(allocation.ptr);
  std::vector<HostSegment> segments = PlanSegments(sizes, options);
  std::vector<UniqueFd> memfds;
  for (HostSegment& segment : segments) {
    WEIGHTCACHE_ASSIGN_OR_RETURN(UniqueFd memfd, os::CreateMemfd(name, segment.bytes));
    segment.fd = memfd.get();
    memfds.push_back(std::move(memfd));
  }
  TierCopyReport local;
  TierCopyReport& r = report != nullptr ? *report : local;
  r = {};
  r.segments = segments.size();
  const auto start = std::chrono::steady_clock::now();
  Status copied = Status::Ok();
  if (options.strategy == TierCopyStrategy::kStaged) {
    copied =
        StagedInParallel(api, arena.context(), Direction::kDeviceToHost,
                         DealSegments(segments, bases, options.staging_bytes, options.threads), r);
  } else {
    // Writable mappings of the segments, gone before the seals (the kernel refuses F_SEAL_WRITE
    // while a writable shared mapping exists).
    std::vector<os::MappedRegion> regions;
    std::vector<Chunk> chunks;
    for (const HostSegment& segment : segments) {
      WEIGHTCACHE_ASSIGN_OR_RETURN(os::MappedRegion region,
                                   os::MapReadWrite(segment.fd, segment.bytes));
      AppendChunks(static_cast<std::byte*>(region.data()), bases[segment.alloc] + segment.offset,
                   segment.bytes, chunks);
      regions.push_back(std::move(region));
    }
    copied = CopyInParallel(api, arena.context(), Direction::kDeviceToHost,
                            CU_MEMHOSTREGISTER_PORTABLE, chunks, options.threads, r);
  }
  Finish(r, start);
  if (!copied.ok()) return copied.Context("demotion to host memory");
  for (size_t i = 0; i < memfds.size(); ++i) {
    Status sealed = os::SealReadOnly(memfds[i].get());
    if (!sealed.ok()) return sealed.Context("demotion: sealing memfd " + std::to_string(i));
  }
  return memfds;
}

// ---- the pinned host copy ----

struct PinnedHostCopy::State {
  explicit State(PrimaryContext c) : context(std::move(c)) {}
  State(const State&) = delete;
  State& operator=(const State&) = delete;
  // Unregisters what was registered (the context current here), before the members unmap the
  // segments and release the context.
  ~State() {
    if (std::none_of(registered.begin(), registered.end(), [](char r) { return r != 0; })) return;
    const DriverApi* api = context.api();
    if (Status current = context.MakeCurrent(); !current.ok()) {
      LOG_ERROR << current.ToString() << ": the pinned host copy stays registered";
      return;
    }
    for (size_t i = 0; i < regions.size(); ++i) {
      if (registered[i] == 0) continue;
      if (CUresult rc = api->cuMemHostUnregister(regions[i].data()); rc != CUDA_SUCCESS) {
        LOG_ERROR << DriverError(api, rc, "cuMemHostUnregister of a pinned host copy's segment")
                         .ToString();
      }
    }
  }

  PrimaryContext context;
  std::vector<os::MappedRegion> regions;
  std::vector<char> registered;  // per region; written by one worker each, read after the join
};

PinnedHostCopy::PinnedHostCopy(std::unique_ptr<State> state) : state_(std::move(state)) {}
PinnedHostCopy::PinnedHostCopy(PinnedHostCopy&&) noexcept = default;
PinnedHostCopy& PinnedHostCopy::operator=(PinnedHostCopy&&) noexcept = default;
PinnedHostCopy::~PinnedHostCopy() = default;

size_t PinnedHostCopy::segments() const { return state_->regions.size(); }
uint64_t PinnedHostCopy::bytes() const {
  uint64_t total = 0;
  for (const auto& region : state_->regions) total += region.size();
  return total;
}
const std::byte* PinnedHostCopy::data(size_t i) const {
  return static_cast<const std::byte*>(state_->regions[i].data());
}
uint64_t PinnedHostCopy::size(size_t i) const { return state_->regions[i].size(); }

Result<PinnedHostCopy> PinnedHostCopy::Pin(const DriverApi* api, CUdevice device,
                                           std::span<const int> memfds, size_t threads) {
  if (memfds.empty() || threads == 0) {
    return InvalidArgument("pinning a host copy: no memfds or no threads");
  }
  std::vector<os::MappedRegion> regions;
  for (size_t i = 0; i < memfds.size(); ++i) {
    Status sealed = os::CheckSealedReadOnly(memfds[i]);
    if (!sealed.ok()) return sealed.Context("pinning a host copy: memfd " + std::to_string(i));
    WEIGHTCACHE_ASSIGN_OR_RETURN(uint64_t bytes, os::FileSize(memfds[i]));
    if (bytes == 0) {
      return InvalidArgument("pinning a host copy: memfd " + std::to_string(i) + " is empty");
    }
    WEIGHTCACHE_ASSIGN_OR_RETURN(os::MappedRegion region, os::MapReadOnly(memfds[i], bytes));
    regions.push_back(std::move(region));
  }
  WEIGHTCACHE_ASSIGN_OR_RETURN(PrimaryContext context, PrimaryContext::Retain(api, device));
  auto state = std::make_unique<State>(std::move(context));
  state->regions = std::move(regions);
  state->registered.assign(state->regions.size(), 0);
  const size_t workers = std::min(threads, state->regions.size());
  std::vector<Status> statuses(workers);
  {
    std::vector<std::jthread> pool;
    pool.reserve(workers);
    for (size_t w = 0; w < workers; ++w) {
      pool.emplace_back([&, w] {
        if (Status current = state->context.MakeCurrent(); !current.ok()) {
          statuses[w] = current;
          return;
        }
        for (size_t i = w; i < state->regions.size() && statuses[w].ok(); i += workers) {
          os::MappedRegion& region = state->regions[i];
          const CUresult rc =
              api->cuMemHostRegister(region.data(), region.size(),
                                     CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_READ_ONLY);
          if (rc != CUDA_SUCCESS) {
            statuses[w] = DriverError(api, rc,
                                      "cuMemHostRegister of a " + std::to_string(region.size()) +
                                          "-byte segment of the host copy");
          } else {
            state->registered[i] = 1;
          }
        }
      });
    }
  }
  for (Status& s : statuses) {
    if (!s.ok()) return s.Context("pinning a host copy");  // `state` unwinds what was done
  }
  return PinnedHostCopy(std::move(state));
}

namespace {

// Streams a promotion from a pinned host copy spreads its pieces over, and the piece size:
// four streams keep the copy engines busy (the load's pipeline uses as many).
constexpr size_t kPinnedStreams = 4;
constexpr uint64_t kPinnedPieceBytes = uint64_t{64} << 20;

// A pinned host copy is of the promotion's memfds: the same segments, one for one.
Status CheckPinnedMatches(const PinnedHostCopy& pinned, std::span<const HostSegment> segments) {
  if (pinned.segments() != segments.size()) {
    return InvalidArgument("promotion: the pinned host copy has " +
                           std::to_string(pinned.segments()) + " segments, the memfds " +
                           std::to_string(segments.size()));
  }
  for (size_t i = 0; i < segments.size(); ++i) {
    if (pinned.size(i) != segments[i].bytes) {
      return InvalidArgument("promotion: segment " + std::to_string(i) + " of the pinned host " +
                             "copy holds " + std::to_string(pinned.size(i)) + " bytes, its memfd " +
                             std::to_string(segments[i].bytes));
    }
  }
  return Status::Ok();
}

// Promotion's copy from a pinned host copy (CheckPinnedMatches passed): every segment's bytes
// to its place in the arena, in pieces dealt round-robin over kPinnedStreams streams, then all
// of them waited for.
Status CopyFromPinned(const DriverApi* api, const PinnedHostCopy& pinned,
                      std::span<const HostSegment> segments, std::span<const CUdeviceptr> bases,
                      TierCopyReport& report) {
  std::vector<CudaStream> streams;
  for (size_t s = 0; s < kPinnedStreams; ++s) {
    WEIGHTCACHE_ASSIGN_OR_RETURN(CudaStream stream, CudaStream::Create(api));
    streams.push_back(std::move(stream));
  }
  Status status = Status::Ok();
  size_t piece = 0;
  for (size_t i = 0; i < segments.size() && status.ok(); ++i) {
    const CUdeviceptr to = bases[segments[i].alloc] + segments[i].offset;
    for (uint64_t at = 0; at < segments[i].bytes && status.ok(); at += kPinnedPieceBytes) {
      const size_t n = static_cast<size_t>(std::min(kPinnedPieceBytes, segments[i].bytes - at));
      if (CUresult rc = api->cuMemcpyHtoDAsync(to + at, pinned.data(i) + at, n,
                                               streams[piece++ % streams.size()].get());
          rc != CUDA_SUCCESS) {
        status = DriverError(api, rc, "cuMemcpyHtoDAsync from the pinned host copy");
      } else {
        report.bytes += n;
        ++report.chunks;
      }
    }
  }
  // The pinned copy outlives this call, so a stream that cannot be waited for leaves no copy
  // reading freed memory; the error is kept.
  for (const CudaStream& stream : streams) (void)DrainStream(api, stream.get(), &status);
  return status;
}

}  // namespace

Result<std::vector<UniqueFd>> CopyMemfdsToDevice(const DriverApi* api, CUdevice device,
                                                 std::span<const int> memfds,
                                                 std::span<const uint64_t> sizes,
                                                 TierCopyReport* report,
                                                 const TierCopyOptions& options) {
  WEIGHTCACHE_RETURN_IF_ERROR(CheckSizes(sizes, "promotion"));
  WEIGHTCACHE_RETURN_IF_ERROR(CheckOptions(options, "promotion"));
  WEIGHTCACHE_ASSIGN_OR_RETURN(std::vector<HostSegment> segments, SegmentsOf(memfds, sizes));
  if (options.pinned != nullptr) {
    WEIGHTCACHE_RETURN_IF_ERROR(CheckPinnedMatches(*options.pinned, segments));
  }
  std::vector<os::MappedRegion> regions;  // kRegistered: each segment's mapping
  if (options.strategy == TierCopyStrategy::kRegistered && options.pinned == nullptr) {
    for (const HostSegment& segment : segments) {
      WEIGHTCACHE_ASSIGN_OR_RETURN(os::MappedRegion region,
                                   os::MapReadOnly(segment.fd, segment.bytes));
      regions.push_back(std::move(region));
    }
  }
  // Retains the primary context and makes it current on this thread.
  auto arena = ExportedArena::Create(api, device, sizes);
  if (!arena.ok()) return arena.status().Context("promotion: allocating the arena");
  std::vector<CUdeviceptr> bases;
  for (size_t a = 0; a < sizes.size(); ++a) {
    const ExportedAllocation& alloc = arena->allocations()[a];
    bases.push_back(alloc.ptr);
    if (alloc.size != sizes[a]) {
      return InternalError("promotion: allocation " + std::to_string(a) + " came out " +
                           std::to_string(alloc.size) + " bytes, the demoted one had " +
                           std::to_string(sizes[a]));
    }
  }
  TierCopyReport local;
  TierCopyReport& r = report != nullptr ? *report : local;
  r = {};
  r.segments = segments.size();
  const auto start = std::chrono::steady_clock::now();
  Status copied = Status::Ok();
  if (options.pinned != nullptr) {
    copied = CopyFromPinned(api, *options.pinned, segments, bases, r);
  } else if (options.strategy == TierCopyStrategy::kStaged) {
    copied =
        StagedInParallel(api, arena->context(), Direction::kHostToDevice,
                         DealPieces(segments, bases, options.staging_bytes, options.threads), r);
  } else {
    std::vector<Chunk> chunks;
    for (size_t i = 0; i < segments.size(); ++i) {
      AppendChunks(static_cast<std::byte*>(regions[i].data()),
                   bases[segments[i].alloc] + segments[i].offset, segments[i].bytes, chunks);
    }
    copied = CopyInParallel(api, arena->context(), Direction::kHostToDevice,
                            CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_READ_ONLY, chunks,
                            options.threads, r);
  }
  Finish(r, start);
  if (!copied.ok()) return copied.Context("promotion to device memory");
  return std::move(arena).value().ReleaseToFds();
}

}  // namespace weightcache::cuda
