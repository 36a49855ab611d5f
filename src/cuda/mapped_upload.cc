#include "cuda/mapped_upload.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <deque>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "common/align.h"
#include "common/logging.h"
#include "common/mutex.h"
#include "cuda/checksum_gpu.h"
#include "os/file_mapping.h"

namespace weightcache::cuda {
namespace {

// One copy out of a registered chunk: a contiguous piece of an item, or a whole strided item.
struct MappedCopy {
  size_t item;
  uint64_t item_offset;  // where the piece lands in the item (0 for a strided item)
  uint64_t file_offset;  // its first byte in the file
  uint64_t length;       // bytes copied (a strided item: rows * row_bytes)
};

// A page-aligned range [begin, end) of one source, registered as one piece.
struct MappedChunk {
  size_t source;
  uint64_t begin;
  uint64_t end;
  uint64_t bytes = 0;  // bytes its copies move
  std::vector<MappedCopy> copies;
};

std::string DescribeRange(const UploadSource& src, uint64_t begin, uint64_t end) {
  return src.path + " bytes [" + std::to_string(begin) + ", " + std::to_string(end) + ")";
}

// Item extents must lie inside their files; the mapping ends there. Returns the extent's end.
Result<uint64_t> ItemEnd(const UploadItem& it, size_t index, const UploadSource& src,
                         uint64_t file_size) {
  uint64_t end = it.file_offset + it.length;
  if (it.stride)
    end = it.file_offset + (it.stride->rows - 1) * it.stride->source_pitch + it.stride->row_bytes;
  if (end > file_size) {
    return Status(StatusCode::kIo, "upload item " + std::to_string(index) + ": " +
                                       DescribeRange(src, it.file_offset, end) +
                                       " run past the end of the file (" +
                                       std::to_string(file_size) + " bytes)");
  }
  return end;
}

// Cuts what the items need into chunks: per source, in file order, page-aligned and disjoint.
// A contiguous item is split at chunk ends; a strided item's extent is never split (one 2D
// copy), so it widens the chunk it starts in. Bytes no item needs are never registered, except
// inside a strided extent (the rows of other ranks) and up to the page boundaries.
Result<std::vector<MappedChunk>> PlanChunks(std::span<const UploadSource> sources,
                                            std::span<const UploadItem> items,
                                            std::span<const os::ReadOnlyMapping> maps,
                                            uint64_t chunk_bytes, uint64_t page) {
  std::vector<size_t> order(items.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return items[a].source != items[b].source ? items[a].source < items[b].source
                                              : items[a].file_offset < items[b].file_offset;
  });
  std::vector<MappedChunk> chunks;
  size_t first_of_source = 0;  // chunks of the current source start here
  for (size_t k = 0; k < order.size(); ++k) {
    const size_t i = order[k];
    const UploadItem& it = items[i];
    if (it.length == 0) continue;
    if (k > 0 && items[order[k - 1]].source != it.source) first_of_source = chunks.size();
    const uint64_t file_size = maps[it.source].size();
    WEIGHTCACHE_ASSIGN_OR_RETURN(uint64_t end, ItemEnd(it, i, sources[it.source], file_size));
    const uint64_t map_end = AlignUp(file_size, page);
    MappedChunk* back = chunks.size() > first_of_source ? &chunks.back() : nullptr;
    if (it.stride) {
      if (back == nullptr || it.file_offset >= back->end) {
        chunks.push_back({it.source, AlignDown(it.file_offset, page), 0, 0, {}});
        back = &chunks.back();
      }
      back->end = std::max(back->end, std::min(AlignUp(end, page), map_end));
      back->copies.push_back({i, 0, it.file_offset, it.length});
      back->bytes += it.length;
      continue;
    }
    for (uint64_t pos = it.file_offset; pos < end;) {
      if (back == nullptr || pos >= back->end) {
        const uint64_t start = AlignDown(pos, page);
        if (back != nullptr && start == back->end && back->end - back->begin < chunk_bytes) {
          back->end = std::min({AlignUp(end, page), back->begin + chunk_bytes, map_end});
        } else {
          chunks.push_back({it.source,
                            start,
                            std::min({AlignUp(end, page), start + chunk_bytes, map_end}),
                            0,
                            {}});
          back = &chunks.back();
        }
      }
      const uint64_t take = std::min(end, back->end) - pos;
      back->copies.push_back({i, pos - it.file_offset, pos, take});
      back->bytes += take;
      pos += take;
    }
  }
  return chunks;
}

// The worker threads of one run, and what they share.
class MappedRun {
 public:
  MappedRun(const DriverApi* api, CUcontext context, std::span<const CudaStream> streams,
            std::span<const UploadSource> sources, std::span<const UploadItem> items,
            std::span<const os::ReadOnlyMapping> maps, std::span<const MappedChunk> chunks,
            const UploadControl& control, uint64_t total)
      : api_(api),
        context_(context),
        streams_(streams),
        sources_(sources),
        items_(items),
        maps_(maps),
        chunks_(chunks),
        control_(control),
        total_(total) {}

  // Runs `workers` threads, each keeping up to `depth` registered chunks in flight; returns the
  // first error. When it returns every chunk it registered is unregistered.
  Status Run(size_t workers, size_t depth) {
    // Every worker's events, created before any thread starts: a creation failure stops
    // nothing half-way.
    std::vector<std::vector<CudaEvent>> events(std::min(workers, chunks_.size()));
    for (auto& own : events) {
      for (size_t e = 0; e <= depth; ++e) {
        WEIGHTCACHE_ASSIGN_OR_RETURN(CudaEvent ev, CudaEvent::Create(api_));
        own.push_back(std::move(ev));
      }
    }
    std::vector<std::thread> threads;
    threads.reserve(events.size());
    for (size_t t = 0; t < events.size(); ++t) {
      threads.emplace_back([this, t, depth, &events] { Worker(t, depth, events[t]); });
    }
    for (std::thread& t : threads) t.join();
    MutexLock lock(mu_);
    return first_error_;
  }

 private:
  struct InFlight {
    size_t chunk;
    const CudaEvent* event;
    CUstream stream;
  };

  void Worker(size_t t, size_t depth, std::span<const CudaEvent> events) {
    if (CUresult rc = api_->cuCtxSetCurrent(context_); rc != CUDA_SUCCESS) {
      return Fail(DriverError(api_, rc, "cuCtxSetCurrent on a mapped-upload thread"));
    }
    CUstream stream = streams_[t % streams_.size()].get();
    std::deque<InFlight> in_flight;
    size_t issued = 0;
    while (!stop_.load()) {
      const size_t c = next_chunk_.fetch_add(1);
      if (c >= chunks_.size()) break;
      if (control_.cancel != nullptr && control_.cancel->load()) {
        Fail(Status(StatusCode::kUnavailable, "upload cancelled"));
        break;
      }
      const MappedChunk& chunk = chunks_[c];
      void* base = ChunkBase(chunk);
      if (CUresult rc =
              api_->cuMemHostRegister(base, chunk.end - chunk.begin, CU_MEMHOSTREGISTER_READ_ONLY);
          rc != CUDA_SUCCESS) {
        Fail(DriverError(api_, rc,
                         "cuMemHostRegister (read-only) of " +
                             DescribeRange(sources_[chunk.source], chunk.begin, chunk.end)));
        break;
      }
      const CudaEvent* event = &events[issued++ % events.size()];
      Status s = IssueCopies(chunk, stream);
      CUresult rc = s.ok() ? api_->cuEventRecord(event->get(), stream) : CUDA_SUCCESS;
      if (rc != CUDA_SUCCESS) s = DriverError(api_, rc, "cuEventRecord after a mapped chunk");
      if (!s.ok()) {
        // Copies already issued may still read the chunk: wait for the stream before the pages
        // are unpinned.
        api_->cuStreamSynchronize(stream);
        Unregister(chunk);
        Fail(std::move(s));
        break;
      }
      in_flight.push_back({c, event, stream});
      if (in_flight.size() > depth) {
        Retire(in_flight.front());
        in_flight.pop_front();
      }
    }
    for (const InFlight& f : in_flight) Retire(f);
  }

  void* ChunkBase(const MappedChunk& chunk) const {
    // The driver takes a non-const pointer; READ_ONLY registration never writes through it.
    return const_cast<std::byte*>(maps_[chunk.source].data() + chunk.begin);
  }

  Status IssueCopies(const MappedChunk& chunk, CUstream stream) {
    const std::byte* map = maps_[chunk.source].data();
    for (const MappedCopy& copy : chunk.copies) {
      const UploadItem& it = items_[copy.item];
      CUresult rc = CUDA_SUCCESS;
      if (it.stride && it.stride->rows > 1) {
        CUDA_MEMCPY2D m{};
        m.srcMemoryType = CU_MEMORYTYPE_HOST;
        m.srcHost = map + copy.file_offset;
        m.srcPitch = it.stride->source_pitch;
        m.dstMemoryType = CU_MEMORYTYPE_DEVICE;
        m.dstDevice = it.dst;
        m.dstPitch = it.stride->row_bytes;
        m.WidthInBytes = it.stride->row_bytes;
        m.Height = it.stride->rows;
        rc = api_->cuMemcpy2DAsync(&m, stream);
      } else {
        rc = api_->cuMemcpyHtoDAsync(it.dst + copy.item_offset, map + copy.file_offset, copy.length,
                                     stream);
      }
      if (rc != CUDA_SUCCESS) {
        return DriverError(api_, rc,
                           "copying item " + std::to_string(copy.item) + " (" +
                               DescribeRange(sources_[it.source], copy.file_offset,
                                             copy.file_offset + copy.length) +
                               ") to device address " + std::to_string(it.dst + copy.item_offset));
      }
    }
    return Status::Ok();
  }

  // Waits for the chunk's copies, then unpins it. Errors are recorded; the unpin is tried
  // regardless (after a stream synchronize, so no copy can still read the pages).
  void Retire(const InFlight& f) {
    const MappedChunk& chunk = chunks_[f.chunk];
    if (CUresult rc = api_->cuEventSynchronize(f.event->get()); rc != CUDA_SUCCESS) {
      Fail(DriverError(api_, rc, "cuEventSynchronize after a mapped chunk"));
      api_->cuStreamSynchronize(f.stream);
    }
    Unregister(chunk);
    ReportProgress(chunk.bytes);
  }

  void Unregister(const MappedChunk& chunk) {
    if (CUresult rc = api_->cuMemHostUnregister(ChunkBase(chunk)); rc != CUDA_SUCCESS) {
      Fail(DriverError(api_, rc,
                       "cuMemHostUnregister of " +
                           DescribeRange(sources_[chunk.source], chunk.begin, chunk.end)));
    }
  }

  void Fail(Status s) {
    MutexLock lock(mu_);
    if (first_error_.ok()) first_error_ = std::move(s);
    stop_ = true;
  }

  void ReportProgress(uint64_t bytes) {
    MutexLock lock(progress_mu_);
    bytes_done_ += bytes;
    if (control_.progress) control_.progress(bytes_done_, total_);
  }

  const DriverApi* const api_;
  CUcontext context_;  // set once, at construction
  const std::span<const CudaStream> streams_;
  const std::span<const UploadSource> sources_;
  const std::span<const UploadItem> items_;
  const std::span<const os::ReadOnlyMapping> maps_;
  const std::span<const MappedChunk> chunks_;
  const UploadControl& control_;
  const uint64_t total_;

  Mutex mu_;
  Status first_error_ WEIGHTCACHE_GUARDED_BY(mu_);
  std::atomic<bool> stop_{false};
  std::atomic<size_t> next_chunk_{0};
  Mutex progress_mu_;
  uint64_t bytes_done_ WEIGHTCACHE_GUARDED_BY(progress_mu_) = 0;
};

}  // namespace

Status CheckMappedUpload(const DriverApi* api, std::span<const UploadSource> sources,
                         bool checksums, double min_residency) {
  CUdevice device = 0;
  WEIGHTCACHE_CU_RETURN_IF_ERROR(api, cuCtxGetDevice(&device), "cuCtxGetDevice");
  int read_only = 0;
  WEIGHTCACHE_CU_RETURN_IF_ERROR(
      api,
      cuDeviceGetAttribute(&read_only, CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED,
                           device),
      "cuDeviceGetAttribute(READ_ONLY_HOST_REGISTER_SUPPORTED)");
  if (read_only == 0) {
    return Status(StatusCode::kUnavailable,
                  "the device cannot register read-only host memory (a file's page cache)");
  }
  if (checksums && !GpuChecksumKernelBuilt()) {
    return Status(StatusCode::kUnavailable,
                  "checksums need the GPU checksum kernel, and this build has none");
  }
  // ReadMode::kMapped asks for no residency: nothing to map and count.
  for (size_t i = 0; min_residency > 0 && i < sources.size(); ++i) {
    const UploadSource& src = sources[i];
    WEIGHTCACHE_ASSIGN_OR_RETURN(os::ReadOnlyMapping map,
                                 os::ReadOnlyMapping::Map(src.fd, src.path));
    WEIGHTCACHE_ASSIGN_OR_RETURN(double resident, os::PageCacheResidency(map));
    if (resident < min_residency) {
      return Status(StatusCode::kUnavailable,
                    src.path + " is " + std::to_string(static_cast<int>(resident * 100)) +
                        "% in the page cache (the mapped path needs " +
                        std::to_string(static_cast<int>(min_residency * 100)) + "%)");
    }
  }
  return Status::Ok();
}

Result<std::vector<uint64_t>> DeviceItemChecksums(const DriverApi* api, CUcontext context,
                                                  CUstream stream,
                                                  std::span<const UploadItem> items) {
  WEIGHTCACHE_CU_RETURN_IF_ERROR(api, cuCtxSetCurrent(context), "cuCtxSetCurrent");
  WEIGHTCACHE_ASSIGN_OR_RETURN(ChecksumKernel kernel, ChecksumKernel::Create(api));
  std::vector<DeviceRange> ranges;
  ranges.reserve(items.size());
  for (const UploadItem& it : items) ranges.push_back({it.dst, it.length});
  return kernel.Checksums(stream, ranges);
}

Result<UploadReport> RunMappedUpload(const DriverApi* api, CUcontext context,
                                     std::span<const CudaStream> streams,
                                     std::span<const UploadSource> sources,
                                     std::span<const UploadItem> items,
                                     const UploadOptions& options, const UploadControl& control,
                                     uint64_t total_bytes) {
  const auto t0 = std::chrono::steady_clock::now();
  const auto page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  std::vector<os::ReadOnlyMapping> maps;
  maps.reserve(sources.size());
  for (const UploadSource& src : sources) {
    WEIGHTCACHE_ASSIGN_OR_RETURN(os::ReadOnlyMapping map,
                                 os::ReadOnlyMapping::Map(src.fd, src.path));
    maps.push_back(std::move(map));
  }
  WEIGHTCACHE_ASSIGN_OR_RETURN(
      std::vector<MappedChunk> chunks,
      PlanChunks(sources, items, maps, AlignUp(options.mapped_chunk_bytes, page), page));
  if (control.progress) control.progress(0, total_bytes);
  MappedRun run(api, context, streams, sources, items, maps, chunks, control, total_bytes);
  WEIGHTCACHE_RETURN_IF_ERROR(run.Run(static_cast<size_t>(options.reader_threads),
                                      static_cast<size_t>(options.mapped_depth)));

  UploadReport report;
  report.bytes = total_bytes;
  report.mapped_chunks = chunks.size();
  if (options.checksums != ChecksumMode::kNone) {
    WEIGHTCACHE_ASSIGN_OR_RETURN(report.checksums,
                                 DeviceItemChecksums(api, context, streams[0].get(), items));
  }
  report.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  report.gb_per_s =
      report.seconds > 0 ? static_cast<double>(total_bytes) / report.seconds / 1e9 : 0;
  LOG_DEBUG << "upload (mapped): " << total_bytes << " bytes in " << report.seconds << " s ("
            << report.gb_per_s << " GB/s), " << chunks.size() << " registered chunks";
  return report;
}

}  // namespace weightcache::cuda
