// The gpu tier: an exported VMM arena filled by the upload pipeline (see weight_store.h).
#include <cuda.h>

#include <algorithm>
#include <chrono>
#include <numeric>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "checkpoint/arena_plan.h"
#include "common/checksum.h"
#include "common/logging.h"
#include "cuda/checksum_gpu.h"
#include "cuda/driver_api.h"
#include "cuda/exported_arena.h"
#include "cuda/upload_pipeline.h"
#include "cuda/vmm.h"
#include "daemon/load_memory.h"
#include "daemon/peer_fill.h"
#include "daemon/weight_store.h"
#include "identity/device_inventory.h"
#include "sharding/gather.h"

namespace weightcache::daemon {
namespace {

// The milliseconds since the last call (or the construction): the load's phases, for the debug
// timeline line (where a slow load spends its time).
class Lap {
 public:
  double operator()() {
    const auto now = std::chrono::steady_clock::now();
    const double ms = std::chrono::duration<double, std::milli>(now - mark_).count();
    mark_ = now;
    return ms;
  }

 private:
  std::chrono::steady_clock::time_point mark_ = std::chrono::steady_clock::now();
};

// The checksums of `ranges` of device memory: by the GPU kernel when this build has it; else
// copied to the host in pieces and hashed there (a build without nvcc, the fake driver).
Result<std::vector<uint64_t>> DeviceChecksums(const cuda::DriverApi* api,
                                              std::span<const cuda::DeviceRange> ranges) {
  if (cuda::GpuChecksumKernelBuilt()) return cuda::GpuTensorChecksums(api, nullptr, ranges);
  constexpr uint64_t kPiece = 256 * kChecksumChunkBytes;  // 64 MiB
  std::vector<uint8_t> host;
  std::vector<uint64_t> chunks;
  std::vector<uint64_t> checksums;
  checksums.reserve(ranges.size());
  for (const cuda::DeviceRange& range : ranges) {
    chunks.assign(ChecksumChunkCount(range.size), 0);
    for (uint64_t at = 0; at < range.size; at += kPiece) {
      const uint64_t n = std::min(kPiece, range.size - at);
      host.resize(n);
      const CUresult rc = api->cuMemcpyDtoH(host.data(), range.ptr + at, n);
      if (rc != CUDA_SUCCESS) return cuda::DriverError(api, rc, "cuMemcpyDtoH (fill checksums)");
      HashChunks(
          host.data(), n,
          std::span<uint64_t>(chunks).subspan(at / kChecksumChunkBytes, ChecksumChunkCount(n)));
    }
    checksums.push_back(range.size == 0 ? TensorChecksum(nullptr, 0) : CombineChunkHashes(chunks));
  }
  return checksums;
}

struct GpuFill {
  FillOutcome outcome;
  std::vector<uint64_t> checksums;  // parallel to held.order, over our memory
};

// The fill from other nodes (LoadOptions::peer_fill) into the arena's allocations, mapped in
// the primary context current on this thread, then the checks of daemon/peer_fill.h: the
// sources' manifests against our plan, every tensor's checksum over OUR device memory (the
// kernel), under --fill-trust content each file's SHA-256 over the bytes copied back (on up to
// `threads` threads, one file each) against our content anchor, a sample of chunks copied back
// against our checkpoint, the gaps zeroed. An error
// leaves the allocations with partial or wrong bytes: the caller uploads from disk over them.
Result<GpuFill> FillGpuFromPeers(const cuda::DriverApi* api,
                                 const checkpoint::Checkpoint& checkpoint, const HeldTensors& held,
                                 const checkpoint::ArenaPlan& plan,
                                 std::span<const cuda::DeviceRange> allocations,
                                 const std::vector<uint64_t>& allocation_sizes,
                                 const PeerFill& fill, int threads, const LoadControl& control) {
  const size_t n = held.order.size();
  if (n == 0) return FillMismatch("nothing to fill: the plan holds no tensor");
  const FillPlan fill_plan{checkpoint, held.order, held.sizes, held.copy, plan, allocation_sizes};
  std::vector<PlacedTensor> placements;
  placements.reserve(n);
  for (const auto& p : plan.placements) placements.push_back({p.allocation, p.offset});
  FillAcceptor acceptor;
  {
    // Our plan's manifest, encoded exactly as a source's was (its checksums are zero here).
    WEIGHTCACHE_ASSIGN_OR_RETURN(
        ManifestFile ours,
        BuildManifest(Tier::kGpu, checkpoint, held.order, placements, std::vector<uint64_t>(n, 0),
                      allocation_sizes, held.planned));
    WEIGHTCACHE_ASSIGN_OR_RETURN(acceptor.ours,
                                 protocol::MapManifestMemfd(ours.fd.get(), ours.size));
  }
  PeerFillRequest request;
  request.memory = FillMemory::kDevice;
  for (const cuda::DeviceRange& a : allocations) {
    // A device address, never dereferenced here: the fill hands it to its transport.
    request.allocations.emplace_back(reinterpret_cast<uint8_t*>(a.ptr), a.size);
  }
  request.accept = [&acceptor](std::span<const uint8_t> manifest) {
    return acceptor.Accept(manifest);
  };
  request.forget_accepted = [&acceptor] { acceptor.Forget(); };
  request.progress = ScaledFillProgress(
      control.progress, std::accumulate(held.sizes.begin(), held.sizes.end(), uint64_t{0}));
  request.cancel = control.cancel;
  request.holds_whole_files = HoldsWholeFiles(fill_plan);
  GpuFill result;
  WEIGHTCACHE_ASSIGN_OR_RETURN(result.outcome, fill(request));
  if (acceptor.accepted.empty()) return InternalError("the fill accepted no source's manifest");
  WEIGHTCACHE_ASSIGN_OR_RETURN(protocol::Manifest theirs,
                               protocol::Manifest::Decode(acceptor.accepted));

  std::vector<cuda::DeviceRange> ranges;
  ranges.reserve(n);
  for (size_t k = 0; k < n; ++k) {
    ranges.push_back(
        {allocations[placements[k].allocation].ptr + placements[k].offset, held.sizes[k]});
  }
  WEIGHTCACHE_ASSIGN_OR_RETURN(result.checksums, DeviceChecksums(api, ranges));
  WEIGHTCACHE_RETURN_IF_ERROR(CompareFillChecksums(fill_plan, result.checksums, theirs));
  if (result.outcome.content_anchor) {
    // Each proof thread copies its file's tensors back through its own host buffer, in the
    // load's context (current on this thread).
    CUcontext context = nullptr;
    const CUresult got = api->cuCtxGetCurrent(&context);
    if (got != CUDA_SUCCESS) return cuda::DriverError(api, got, "cuCtxGetCurrent (fill proof)");
    WEIGHTCACHE_RETURN_IF_ERROR(ProveFillContent(
        fill_plan, *result.outcome.content_anchor,
        [&](uint32_t allocation, uint64_t offset, uint64_t length, uint8_t* out) {
          const CUresult rc = api->cuMemcpyDtoH(out, allocations[allocation].ptr + offset, length);
          return rc == CUDA_SUCCESS ? Status::Ok()
                                    : cuda::DriverError(api, rc, "cuMemcpyDtoH (fill proof)");
        },
        threads,
        [api, context]() -> Status {
          const CUresult rc = api->cuCtxSetCurrent(context);
          return rc == CUDA_SUCCESS ? Status::Ok()
                                    : cuda::DriverError(api, rc, "cuCtxSetCurrent (fill proof)");
        }));
  }
  WEIGHTCACHE_RETURN_IF_ERROR(CheckFillSample(
      fill_plan, [&](uint32_t allocation, uint64_t offset, uint64_t length, uint8_t* out) {
        const CUresult rc = api->cuMemcpyDtoH(out, allocations[allocation].ptr + offset, length);
        return rc == CUDA_SUCCESS ? Status::Ok()
                                  : cuda::DriverError(api, rc, "cuMemcpyDtoH (fill sample)");
      }));
  for (const FillGap& gap : FillGaps(fill_plan)) {
    const CUresult rc =
        api->cuMemsetD8(allocations[gap.allocation].ptr + gap.offset, 0, gap.length);
    if (rc != CUDA_SUCCESS) return cuda::DriverError(api, rc, "cuMemsetD8 (fill gaps)");
  }
  const CUresult synced = api->cuCtxSynchronize();
  if (synced != CUDA_SUCCESS) return cuda::DriverError(api, synced, "cuCtxSynchronize (fill)");
  return result;
}

// The disk path: the upload pipeline reads the held bytes of `checkpoint` into the arena's
// `allocations` and checksums them (parallel to held.order). `pipeline` receives the pipeline:
// kept for the caller's LoadLeftovers, or reset here when there are none.
struct DiskUpload {
  std::vector<uint64_t> checksums;
  std::string timeline;  // ", pipeline …, upload … (staging …, checksums …), free …" (ms)
};
Result<DiskUpload> UploadFromDisk(const cuda::DriverApi* api,
                                  const checkpoint::Checkpoint& checkpoint,
                                  const LoadOptions& options, const LoadControl& control,
                                  const HeldTensors& held, const checkpoint::ArenaPlan& plan,
                                  std::span<const cuda::ExportedAllocation> allocations,
                                  std::optional<cuda::UploadPipeline>* pipeline,
                                  std::string* memory) {
  Lap lap;
  const auto& tensors = checkpoint.tensors();
  const std::vector<size_t>& order = held.order;
  const std::vector<uint64_t>& sizes = held.sizes;
  const uint64_t held_bytes = std::accumulate(sizes.begin(), sizes.end(), uint64_t{0});
  cuda::UploadOptions upload_options;
  upload_options.reader_threads = std::clamp(options.threads, 1, 64);
  // Small staging buffers, four per reader, and 4 copy streams. A load makes its ring afresh
  // (the daemon loads once), and pinning is what a big ring costs: 32 x 32 MiB took 170-820 ms
  // of a 16 GB load on an H100, 64 x 2 MiB 56 ms, all of it behind the first reads. And a
  // 2 MiB buffer is still in the last-level cache when the copy engine reads what a reader
  // just wrote: load_bench over a page-cache-warm 16 GB, 16 readers, first run (the ring made
  // in it) / later runs: 32 x 32 MiB 22.3 / 40.1 GB/s, 64 x 8 MiB 27.9 / 41.8, 64 x 2 MiB
  // 39.8 / 46.2, 128 x 1 MiB 37.6 / 42.7 (pinned H2D 55.5; docs/benchmarks.md "Page cache to
  // GPU").
  upload_options.staging_buffer_bytes = uint64_t{2} << 20;
  upload_options.staging_buffers = std::clamp(4 * upload_options.reader_threads, 8, 256);
  // Pinned 16 MiB at a time (8 slots): the driver serializes each registration's fixed cost.
  upload_options.staging_pin_bytes = uint64_t{16} << 20;
  upload_options.copy_streams = 4;
  // The checksums by the GPU kernel once the bytes are on the device (a few ms for 16 GB),
  // which leaves the host's memory bandwidth to the reads and copies; by hasher threads over
  // the staging buffers in a build without the kernel.
  upload_options.checksums =
      cuda::GpuChecksumKernelBuilt() ? cuda::ChecksumMode::kDevice : cuda::ChecksumMode::kCompute;
  // Read through the pinned staging ring (ReadMode::kBuffered). The mapped path (the copy
  // engine reading the page cache through registered chunks) measured slower inside the daemon
  // on an H200 (16 GB warm: upload 1.73 s against 0.81 s staged; docs/benchmarks.md), so it is
  // not the default until that is understood.
  WEIGHTCACHE_ASSIGN_OR_RETURN(auto created, cuda::UploadPipeline::Create(api, upload_options));
  // Held in an optional so that it is destroyed right after Run() (or handed to the caller's
  // LoadLeftovers): its streams, pinned staging buffers and events are never kept for the life
  // of the store.
  pipeline->emplace(std::move(created));
  const double pipeline_ms = lap();

  std::vector<cuda::UploadSource> sources;
  for (uint32_t s = 0; s < checkpoint.shards().size(); ++s) {
    sources.push_back({checkpoint.shard_fd(s), checkpoint.shards()[s].path});
  }
  std::vector<cuda::UploadItem> items;
  std::vector<size_t> item_of;  // position in `order` → item index, or SIZE_MAX (empty)
  item_of.reserve(order.size());
  for (size_t i = 0; i < order.size(); ++i) {
    if (sizes[i] == 0) {
      item_of.push_back(SIZE_MAX);
      continue;
    }
    const auto& t = tensors[order[i]];
    const auto& place = plan.placements[i];
    // Where the held bytes lie in the shard file: one run, or a dim>0 slice's strided rows.
    auto run = sharding::HeldRun(t, held.copy[i]);
    if (!run.ok()) return run.status().Context("gpu tier");
    item_of.push_back(items.size());
    cuda::UploadItem item{t.shard, run->file_offset, sizes[i],
                          allocations[place.allocation].ptr + place.offset, std::nullopt};
    if (run->rows > 1) item.stride = cuda::UploadStride{run->rows, run->row_bytes, run->pitch};
    items.push_back(item);
  }
  cuda::UploadControl upload_control;
  upload_control.progress = control.progress;
  upload_control.cancel = control.cancel;
  if (control.progress) control.progress(0, held_bytes);
  auto report = (*pipeline)->Run(sources, items, upload_control);
  const double upload_ms = lap();
  *memory = "pipeline=" + DescribeProcessMemory(ReadProcessMemory());
  if (control.leftovers == nullptr) {
    pipeline->reset();
    *memory += "; pipeline_freed=" + DescribeProcessMemory(ReadProcessMemory());
  }
  const double free_ms = lap();
  if (!report.ok()) {
    Status status = report.status();
    return status.Context("gpu tier: uploading " + checkpoint.path() + " to " +
                          options.device.uuid);
  }
  LOG_DEBUG << "gpu tier: uploaded " << report->bytes << " bytes in " << report->seconds << " s ("
            << report->gb_per_s << " GB/s), path " << cuda::ReadModeName(report->path) << ", "
            << report->direct_sources << " source(s) read with O_DIRECT";

  DiskUpload result;
  std::vector<uint64_t>& checksums = result.checksums;
  checksums.reserve(order.size());
  const uint64_t empty_checksum = TensorChecksum(nullptr, 0);
  for (size_t i = 0; i < order.size(); ++i) {
    checksums.push_back(item_of[i] == SIZE_MAX ? empty_checksum : report->checksums[item_of[i]]);
  }
  result.timeline =
      ", pipeline " + std::to_string(pipeline_ms) + ", upload " + std::to_string(upload_ms) +
      " (staging " + std::to_string(report->staging_seconds * 1e3) + ", checksums " +
      std::to_string(report->checksum_seconds * 1e3) + "), free " + std::to_string(free_ms);
  return result;
}

}  // namespace

// Every allocation the load makes for the load only (the pipeline and its pinned staging
// ring, the items, the plan, the checksum vectors) is a local that dies on return; what it
// reports in `memory` are the two points inside it worth a log line.
Result<WeightStore> LoadGpuStore(const checkpoint::Checkpoint& checkpoint,
                                 const LoadOptions& options, const LoadControl& control,
                                 std::string* memory) {
  const cuda::DriverApi* api = options.driver;
  if (api == nullptr) return InternalError("gpu tier: no CUDA driver given to the load");
  Lap lap;
  // The device was resolved once (identity::ResolveIdentity): its ordinal, checked by UUID.
  auto device_or = identity::CudaDevice(api, options.device);
  if (!device_or.ok()) return device_or.status().Context("gpu tier");
  const CUdevice device = *device_or;
  WEIGHTCACHE_RETURN_IF_ERROR(cuda::CheckVmmSupport(api, device));
  WEIGHTCACHE_ASSIGN_OR_RETURN(
      uint64_t granularity,
      cuda::AllocationGranularity(api, device, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));

  // A sharded cache places only the rank's held bytes (options.shard_plan), like the host tier.
  const HeldTensors held = ListHeldTensors(checkpoint, options.shard_plan);
  const std::vector<size_t>& order = held.order;
  const std::vector<uint64_t>& sizes = held.sizes;
  const uint64_t held_bytes = std::accumulate(sizes.begin(), sizes.end(), uint64_t{0});
  const checkpoint::ArenaPlan plan = checkpoint::PlanArena(sizes, granularity);
  WEIGHTCACHE_RETURN_IF_ERROR(CheckMemoryBudget(
      Tier::kGpu, plan.total_bytes, plan.allocation_bytes.size(), options.memory_budget));
  if (plan.allocation_bytes.empty()) {
    return InvalidArgument("gpu tier: checkpoint " + checkpoint.path() +
                           " holds no bytes to place on the device");
  }

  const double plan_ms = lap();
  // Retains the primary context and makes it current on this (the loader) thread, which the
  // pipeline needs at Create.
  auto context = cuda::PrimaryContext::Retain(api, device);
  if (!context.ok()) return context.status().Context("gpu tier: " + options.device.uuid);
  const double context_ms = lap();
  auto arena = cuda::ExportedArena::Create(api, device, plan.allocation_bytes);
  if (!arena.ok()) {
    Status status = arena.status();
    return status.Context("gpu tier: allocating " + std::to_string(plan.total_bytes) +
                          " bytes on " + options.device.uuid);
  }
  const auto allocations = arena->allocations();
  std::vector<uint64_t> allocation_sizes;
  for (size_t a = 0; a < allocations.size(); ++a) {
    if (allocations[a].size < plan.allocation_bytes[a]) {
      return InternalError("gpu tier: allocation " + std::to_string(a) + " came out " +
                           std::to_string(allocations[a].size) + " bytes, the plan needs " +
                           std::to_string(plan.allocation_bytes[a]));
    }
    allocation_sizes.push_back(allocations[a].size);
  }
  const double arena_ms = lap();

  // serve --fill-from (docs/fleet.md "Fill"): other nodes' copies first, verified; the disk
  // upload below runs only when that fails (over whatever the fill left).
  std::optional<FillOutcome> fill;
  std::vector<uint64_t> checksums;
  if (options.peer_fill) {
    std::vector<cuda::DeviceRange> ranges;
    for (size_t a = 0; a < allocations.size(); ++a) {
      ranges.push_back({allocations[a].ptr, allocation_sizes[a]});
    }
    auto filled = FillGpuFromPeers(api, checkpoint, held, plan, ranges, allocation_sizes,
                                   options.peer_fill, options.threads, control);
    if (filled.ok()) {
      fill = std::move(filled->outcome);
      checksums = std::move(filled->checksums);
      if (control.progress) control.progress(held_bytes, held_bytes);
    } else if (control.cancel != nullptr && control.cancel->load()) {
      return Status(StatusCode::kUnavailable, "load cancelled (during the fill)");
    } else {
      LOG_WARN << "fill: " << filled.status().ToString() << "; loading from disk";
      // The disk upload writes the tensors only: whatever the failed fill wrote between them
      // (a rejected source's padding) would stay there and be mapped by every client. The
      // whole arena is zeroed first, as a load from disk alone leaves it (milliseconds).
      for (const cuda::DeviceRange& range : ranges) {
        const CUresult rc = api->cuMemsetD8(range.ptr, 0, range.size);
        if (rc != CUDA_SUCCESS) return cuda::DriverError(api, rc, "cuMemsetD8 (after the fill)");
      }
      const CUresult synced = api->cuCtxSynchronize();
      if (synced != CUDA_SUCCESS) {
        return cuda::DriverError(api, synced, "cuCtxSynchronize (after the fill)");
      }
    }
  }
  const double fill_ms = lap();
  std::optional<cuda::UploadPipeline> pipeline;
  std::string timeline_upload;
  if (!fill) {
    WEIGHTCACHE_ASSIGN_OR_RETURN(DiskUpload upload,
                                 UploadFromDisk(api, checkpoint, options, control, held, plan,
                                                allocations, &pipeline, memory));
    checksums = std::move(upload.checksums);
    timeline_upload = std::move(upload.timeline);
    (void)lap();  // the upload timed its own phases; `release` starts here
  } else {
    *memory = "filled=" + DescribeProcessMemory(ReadProcessMemory());
  }
  std::vector<PlacedTensor> placements;
  placements.reserve(order.size());
  for (const auto& p : plan.placements) placements.push_back({p.allocation, p.offset});
  StoreSummary summary;
  WEIGHTCACHE_ASSIGN_OR_RETURN(summary.manifest,
                               BuildManifest(Tier::kGpu, checkpoint, order, placements, checksums,
                                             allocation_sizes, held.planned));
  summary.tensor_count = order.size();
  summary.tensor_bytes = held_bytes;
  summary.resident_bytes = arena->total_bytes();
  if (fill) {
    summary.origin = std::move(fill->origin);
    summary.filled_from = "filled from " + fill->description;
  }
  // The upload is complete (Run synchronized its streams): from here the fds are all the
  // daemon needs. The fds alone serve: no mapping, no handle, no CUDA context. The device
  // memory lives while any fd does — ours, or the duplicates attached clients received.
  // Releasing the rest (the mappings, VA, handles and the context reference) drops the
  // daemon's CUDA context — the device memory and driver host memory a context costs — for the
  // life of the cache: here, or after `ready` by the caller's LoadLeftovers.
  WeightStore store(
      Tier::kGpu, arena->TakeFds(), std::move(summary),
      options.keep_creating_handles ? arena->TakeHandles() : std::vector<cuda::VmmHandle>{});
  LoadLeftovers here;
  LoadLeftovers& leftovers = control.leftovers != nullptr ? *control.leftovers : here;
  // Released last kept first: the pipeline, the arena, then the context they were made in.
  leftovers.Keep(std::move(context).value());
  leftovers.Keep(std::move(arena).value());
  if (pipeline) leftovers.Keep(std::move(*pipeline));
  here.Release();
  // plan: device checks, held tensors, arena plan; context: the primary context retained;
  // arena: cuMemCreate/export/map; fill: the pull from other nodes and its checks (0 without
  // --fill-from); pipeline: streams; upload: Run (staging: populating and pinning the ring;
  // then the reads, copies and the checksum kernel); free: the pipeline's teardown (the three
  // absent after a fill); release: manifest, unmapping, dropping the context (the last two ~0
  // when they are left for after `ready`).
  LOG_DEBUG << "gpu tier: timeline ms: plan " << plan_ms << ", context " << context_ms << ", arena "
            << arena_ms << ", fill " << fill_ms << timeline_upload << ", release " << lap()
            << (control.leftovers != nullptr ? ", teardown after ready" : "");
  return store;
}

}  // namespace weightcache::daemon
