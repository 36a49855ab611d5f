// The gpu tier: an exported VMM arena filled by the upload pipeline (see weight_store.h).
#include <cuda.h>

#include <algorithm>
#include <chrono>
#include <numeric>
#include <optional>
#include <string>

#include "checkpoint/arena_plan.h"
#include "common/checksum.h"
#include "common/logging.h"
#include "cuda/checksum_gpu.h"
#include "cuda/driver_api.h"
#include "cuda/exported_arena.h"
#include "cuda/upload_pipeline.h"
#include "cuda/vmm.h"
#include "daemon/load_memory.h"
#include "daemon/weight_store.h"
#include "identity/device_inventory.h"
#include "sharding/gather.h"

namespace weightcache::daemon {
// Every allocation the load makes for the load only (the pipeline and its pinned staging
// ring, the items, the plan, the checksum vectors) is a local that dies on return; what it
// reports in `memory` are the two points inside it worth a log line.
Result<WeightStore> LoadGpuStore(const checkpoint::Checkpoint& checkpoint,
                                 const LoadOptions& options, const LoadControl& control,
                                 std::string* memory) {
  const cuda::DriverApi* api = options.driver;
  if (api == nullptr) return InternalError("gpu tier: no CUDA driver given to the load");
  // The load's phases, for the debug timeline line (where a slow load spends its time).
  using Clock = std::chrono::steady_clock;
  auto mark = Clock::now();
  const auto lap = [&mark] {
    const auto now = Clock::now();
    const double ms = std::chrono::duration<double, std::milli>(now - mark).count();
    mark = now;
    return ms;
  };
  // The device was resolved once (identity::ResolveIdentity): its ordinal, checked by UUID.
  auto device_or = identity::CudaDevice(api, options.device);
  if (!device_or.ok()) return device_or.status().Context("gpu tier");
  const CUdevice device = *device_or;
  WEIGHTCACHE_RETURN_IF_ERROR(cuda::CheckVmmSupport(api, device));
  WEIGHTCACHE_ASSIGN_OR_RETURN(
      uint64_t granularity,
      cuda::AllocationGranularity(api, device, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));

  // A sharded cache places only the rank's held bytes (options.shard_plan), like the host tier.
  const auto& tensors = checkpoint.tensors();
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
  cuda::UploadOptions upload_options;
  upload_options.reader_threads = std::clamp(options.threads, 1, 64);
  // Two staging buffers per reader (one being read into, one whose copy is in flight) and 4
  // copy streams: 16 readers, 32 x 32 MiB and 4 streams moved a warm 16 GiB at 42.8 GB/s on an
  // H200, against 30.7 GB/s with 8, 16 and 2 (load_bench, docs/benchmarks.md).
  upload_options.staging_buffers = std::clamp(2 * upload_options.reader_threads, 4, 128);
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
  std::optional<cuda::UploadPipeline> pipeline(std::move(created));
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
  auto report = pipeline->Run(sources, items, upload_control);
  const double upload_ms = lap();
  *memory = "pipeline=" + DescribeProcessMemory(ReadProcessMemory());
  if (control.leftovers == nullptr) {
    pipeline.reset();
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

  std::vector<uint64_t> checksums;
  checksums.reserve(order.size());
  const uint64_t empty_checksum = TensorChecksum(nullptr, 0);
  for (size_t i = 0; i < order.size(); ++i) {
    checksums.push_back(item_of[i] == SIZE_MAX ? empty_checksum : report->checksums[item_of[i]]);
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
  // The upload is complete (Run synchronized its streams): from here the fds are all the
  // daemon needs. The fds alone serve: no mapping, no handle, no CUDA context. The device
  // memory lives while any fd does — ours, or the duplicates attached clients received.
  // Releasing the rest (the mappings, VA, handles and the context reference) drops the
  // daemon's CUDA context — the device memory and driver host memory a context costs — for the
  // life of the cache: here, or after `ready` by the caller's LoadLeftovers.
  WeightStore store(Tier::kGpu, arena->TakeFds(), std::move(summary));
  LoadLeftovers here;
  LoadLeftovers& leftovers = control.leftovers != nullptr ? *control.leftovers : here;
  // Released last kept first: the pipeline, the arena, then the context they were made in.
  leftovers.Keep(std::move(context).value());
  leftovers.Keep(std::move(arena).value());
  if (pipeline) leftovers.Keep(std::move(*pipeline));
  here.Release();
  // plan: device checks, held tensors, arena plan; context: the primary context retained;
  // arena: cuMemCreate/export/map; pipeline: streams; upload: Run (staging: populating and
  // pinning the ring; then the reads, copies and the checksum kernel); free: the pipeline's
  // teardown; release: manifest, unmapping, dropping the context (the last two ~0 when they
  // are left for after `ready`).
  LOG_DEBUG << "gpu tier: timeline ms: plan " << plan_ms << ", context " << context_ms << ", arena "
            << arena_ms << ", pipeline " << pipeline_ms << ", upload " << upload_ms << " (staging "
            << report->staging_seconds * 1e3 << ", checksums " << report->checksum_seconds * 1e3
            << "), free " << free_ms << ", release " << lap()
            << (control.leftovers != nullptr ? ", teardown after ready" : "");
  return store;
}

}  // namespace weightcache::daemon
