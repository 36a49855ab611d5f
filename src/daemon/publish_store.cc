#include "daemon/publish_store.h"

#include <unistd.h>

#include <algorithm>
#include <map>
#include <string_view>
#include <utility>

#include "common/checksum.h"
#include "cuda/checksum_gpu.h"
#include "cuda/vmm.h"
#include "daemon/host_store.h"
#include "os/memfd.h"

namespace weightcache::daemon {
namespace {

// The manifest of a publication: its placements, with `checksums` (plan order) or 0s.
Result<ManifestFile> PublicationManifest(const Publication& pub,
                                         std::span<const uint64_t> checksums,
                                         const std::string& name) {
  std::vector<protocol::TensorEntry> entries;
  entries.reserve(pub.plan.tensors.size());
  for (size_t i = 0; i < pub.plan.tensors.size(); ++i) {
    const protocol::PlannedTensor& t = pub.plan.tensors[i];
    protocol::TensorEntry e;
    e.name = t.name;
    e.dtype = t.dtype;
    e.ndim = static_cast<uint32_t>(t.shape.size());
    std::copy(t.shape.begin(), t.shape.end(), e.shape.begin());
    e.allocation = pub.layout.placements[i].allocation;
    e.offset = pub.layout.placements[i].offset;
    e.nbytes = t.nbytes;
    e.checksum = checksums.empty() ? 0 : checksums[i];
    entries.push_back(e);
  }
  auto manifest =
      protocol::EncodeManifest(pub.tier, pub.allocation_sizes, entries, pub.plan.metadata);
  if (!manifest.ok()) {
    Status status = manifest.status();
    return status.Context("building the manifest of the published arena");
  }
  auto fd = protocol::CreateManifestMemfd(*manifest, name);
  if (!fd.ok()) {
    Status status = fd.status();
    return status.Context("writing the manifest of the published arena");
  }
  return ManifestFile{std::move(fd).value(), manifest->size()};
}

// The plan laid out at `granularity`: an alias takes its target's placement, only tensors with
// bytes of their own are planned.
Status PlanPublication(Publication& pub, uint64_t granularity, uint64_t memory_budget) {
  const size_t n = pub.plan.tensors.size();
  std::vector<uint64_t> sizes;
  std::vector<size_t> owner(n);  // plan index → index into sizes
  std::map<std::string_view, size_t> own;
  for (size_t i = 0; i < n; ++i) {
    const protocol::PlannedTensor& t = pub.plan.tensors[i];
    if (!t.alias_of.empty()) continue;
    owner[i] = sizes.size();
    own.emplace(t.name, sizes.size());
    sizes.push_back(t.nbytes);
    pub.tensor_bytes += t.nbytes;
  }
  for (size_t i = 0; i < n; ++i) {
    const protocol::PlannedTensor& t = pub.plan.tensors[i];
    if (t.alias_of.empty()) continue;
    auto target = own.find(t.alias_of);
    if (target == own.end()) {  // ValidatePublishPlan refuses this first
      return InvalidArgument("publish plan: tensor '" + t.name.substr(0, 256) +
                             "': alias_of names no tensor with bytes of its own");
    }
    owner[i] = target->second;
  }
  checkpoint::ArenaPlan planned = checkpoint::PlanArena(sizes, granularity);
  pub.layout.allocation_bytes = std::move(planned.allocation_bytes);
  pub.layout.total_bytes = planned.total_bytes;
  pub.layout.placements.reserve(n);
  for (size_t i = 0; i < n; ++i) pub.layout.placements.push_back(planned.placements[owner[i]]);
  return CheckMemoryBudget(pub.tier, pub.layout.total_bytes, pub.layout.allocation_bytes.size(),
                           memory_budget);
}

// The gpu tier's arena: a VMM arena on the daemon's device, planned at its granularity.
Status CreateGpuArena(Publication& pub, const GpuPublishTarget& gpu, uint64_t memory_budget) {
  if (!cuda::GpuChecksumKernelBuilt()) {
    // The commit is verified by the kernel over the device memory; without it nothing would
    // check the publisher's bytes.
    return Status(StatusCode::kUnavailable,
                  "publishing to the gpu tier needs the GPU checksum kernel, which this build "
                  "of the daemon lacks (built with WEIGHTCACHE_BUILD_KERNELS=OFF or without nvcc)");
  }
  const cuda::DriverApi* api = gpu.driver;
  auto device = identity::CudaDevice(api, gpu.device);
  if (!device.ok()) return device.status().Context("gpu tier publish");
  WEIGHTCACHE_RETURN_IF_ERROR(cuda::CheckVmmSupport(api, *device));
  WEIGHTCACHE_ASSIGN_OR_RETURN(
      uint64_t granularity,
      cuda::AllocationGranularity(api, *device, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
  WEIGHTCACHE_RETURN_IF_ERROR(PlanPublication(pub, granularity, memory_budget));
  if (pub.layout.allocation_bytes.empty()) {
    return InvalidArgument("publish plan: its tensors hold no bytes to place on the device");
  }
  auto arena = cuda::ExportedArena::Create(api, *device, pub.layout.allocation_bytes);
  if (!arena.ok()) {
    Status status = arena.status();
    return status.Context("gpu tier publish: allocating " + std::to_string(pub.layout.total_bytes) +
                          " bytes on " + gpu.device.uuid);
  }
  for (const cuda::ExportedAllocation& a : arena->allocations()) {
    pub.allocation_sizes.push_back(a.size);
  }
  pub.gpu_arena.emplace(std::move(arena).value());
  pub.keep_creating_handles = gpu.keep_creating_handles;
  return Status::Ok();
}

Result<WeightStore> CommitHostPublication(Publication pub, std::span<const uint64_t> checksums);
Result<WeightStore> CommitGpuPublication(Publication pub, std::span<const uint64_t> checksums);

// The store of a verified publication: its manifest with `checksums`.
Result<StoreSummary> PublishedSummary(const Publication& pub, std::span<const uint64_t> checksums) {
  StoreSummary summary;
  WEIGHTCACHE_ASSIGN_OR_RETURN(summary.manifest,
                               PublicationManifest(pub, checksums, "weightcache-manifest"));
  summary.origin = "published";
  summary.tensor_count = pub.plan.tensors.size();
  summary.tensor_bytes = pub.tensor_bytes;
  summary.resident_bytes = 0;
  for (uint64_t size : pub.allocation_sizes) summary.resident_bytes += size;
  return summary;
}

// The first tensor whose checksum differs, as the refusal.
Status CompareChecksums(const Publication& pub, std::span<const uint64_t> expected,
                        std::span<const uint64_t> actual) {
  const size_t n = pub.plan.tensors.size();
  if (expected.size() != n) {
    return InvalidArgument("PublishCommit: " + std::to_string(expected.size()) +
                           " checksums for a plan of " + std::to_string(n) + " tensors");
  }
  for (size_t i = 0; i < expected.size(); ++i) {
    if (actual[i] != expected[i]) {
      return InvalidArgument(
          "publish commit refused: tensor '" + pub.plan.tensors[i].name.substr(0, 256) +
          "' (plan index " + std::to_string(i) + "): the publisher's checksum " +
          std::to_string(expected[i]) + " but the arena holds " + std::to_string(actual[i]));
    }
  }
  return Status::Ok();
}

}  // namespace

std::vector<int> Publication::ArenaFds() const {
  std::vector<int> fds;
  if (gpu_arena) {
    for (const cuda::ExportedAllocation& a : gpu_arena->allocations()) fds.push_back(a.fd);
  } else {
    for (const UniqueFd& fd : memfds) fds.push_back(fd.get());
  }
  return fds;
}

Result<Publication> CreatePublication(Tier tier, protocol::PublishBegin plan,
                                      const std::string& cache_name, uint64_t memory_budget,
                                      const GpuPublishTarget* gpu) {
  Publication pub;
  pub.tier = tier;
  pub.plan = std::move(plan);
  if (tier == Tier::kGpu) {
    if (gpu == nullptr || gpu->driver == nullptr) {
      return InternalError("gpu tier publish without a CUDA driver and device");
    }
    WEIGHTCACHE_RETURN_IF_ERROR(CreateGpuArena(pub, *gpu, memory_budget));
  } else {
    WEIGHTCACHE_RETURN_IF_ERROR(
        PlanPublication(pub, static_cast<uint64_t>(::sysconf(_SC_PAGESIZE)), memory_budget));
    pub.allocation_sizes = pub.layout.allocation_bytes;
    WEIGHTCACHE_ASSIGN_OR_RETURN(pub.memfds, CreateHostMemfds(cache_name, pub.layout));
  }
  WEIGHTCACHE_ASSIGN_OR_RETURN(pub.arena_manifest,
                               PublicationManifest(pub, {}, "weightcache-publish-manifest"));
  return pub;
}

Result<WeightStore> CommitPublication(Publication pub, std::span<const uint64_t> checksums) {
  if (pub.tier == Tier::kGpu) return CommitGpuPublication(std::move(pub), checksums);
  return CommitHostPublication(std::move(pub), checksums);
}

namespace {

Result<WeightStore> CommitHostPublication(Publication pub, std::span<const uint64_t> checksums) {
  const size_t n = pub.plan.tensors.size();
  // Sealed first: from here on nobody, the publisher included, can change a byte, so the
  // checksums below are of what every client will map.
  for (size_t a = 0; a < pub.memfds.size(); ++a) {
    Status sealed = os::SealReadOnly(pub.memfds[a].get());
    if (!sealed.ok()) {
      return sealed.Context("publish commit: sealing allocation " + std::to_string(a) +
                            " (the publisher must unmap the arena before PublishCommit)");
    }
    auto size = os::FileSize(pub.memfds[a].get());
    if (!size.ok()) return size.status().Context("allocation " + std::to_string(a));
    if (*size != pub.layout.allocation_bytes[a]) {
      return InvalidArgument("publish commit: allocation " + std::to_string(a) + " is " +
                             std::to_string(*size) + " bytes, the arena planned " +
                             std::to_string(pub.layout.allocation_bytes[a]) +
                             " (resized by the publisher)");
    }
  }
  {
    std::vector<os::MappedRegion> regions;
    regions.reserve(pub.memfds.size());
    for (size_t a = 0; a < pub.memfds.size(); ++a) {
      auto region = os::MapReadOnly(pub.memfds[a].get(), pub.layout.allocation_bytes[a]);
      if (!region.ok()) return region.status().Context("allocation " + std::to_string(a));
      regions.push_back(std::move(region).value());
    }
    std::vector<uint64_t> actual;
    actual.reserve(n);
    for (size_t i = 0; i < n; ++i) {
      const checkpoint::TensorPlacement& place = pub.layout.placements[i];
      const auto* base = static_cast<const uint8_t*>(regions[place.allocation].data());
      actual.push_back(TensorChecksum(base + place.offset, place.bytes));
    }
    WEIGHTCACHE_RETURN_IF_ERROR(CompareChecksums(pub, checksums, actual));
  }  // the daemon's read-only mappings go here: it serves the fds, never maps them
  WEIGHTCACHE_ASSIGN_OR_RETURN(StoreSummary summary, PublishedSummary(pub, checksums));
  return WeightStore(Tier::kHost, std::move(pub.memfds), std::move(summary));
}

// No seal exists for device memory: the publisher's mapping is gone when it commits
// (Publisher::Commit unmaps first), and a client that writes through its own read-write
// mapping later is no different from any gpu-tier client (docs/client.md). The checksums are of
// the bytes at the time of the check.
Result<WeightStore> CommitGpuPublication(Publication pub, std::span<const uint64_t> checksums) {
  if (!pub.gpu_arena) return InternalError("gpu tier publish commit without an arena");
  const size_t n = pub.plan.tensors.size();
  // The arena's context is current on this thread for every call below, the arena's teardown
  // included: `arena` is declared after the guard, so a refused commit releases it (unmap, VA,
  // handles, exported fds, context reference) while the context is still current.
  const cuda::ScopedCurrentContext current(pub.gpu_arena->api(), pub.gpu_arena->context());
  std::optional<cuda::ExportedArena> arena = std::move(pub.gpu_arena);
  pub.gpu_arena.reset();
  std::vector<cuda::DeviceRange> ranges;
  ranges.reserve(n);
  const auto allocations = arena->allocations();
  for (size_t i = 0; i < n; ++i) {
    const checkpoint::TensorPlacement& place = pub.layout.placements[i];
    ranges.push_back({allocations[place.allocation].ptr + place.offset, place.bytes});
  }
  {
    auto kernel = cuda::ChecksumKernel::Create(arena->api());
    if (!kernel.ok()) return kernel.status().Context("publish commit: the GPU checksum kernel");
    auto actual = kernel->Checksums(nullptr, ranges);
    if (!actual.ok()) {
      return actual.status().Context("publish commit: checksumming the arena on the device");
    }
    WEIGHTCACHE_RETURN_IF_ERROR(CompareChecksums(pub, checksums, *actual));
  }  // the module is unloaded here, before the context reference goes
  WEIGHTCACHE_ASSIGN_OR_RETURN(StoreSummary summary, PublishedSummary(pub, checksums));
  // Verified: only now does the arena become fds that clients are served (docs/publish.md).
  std::vector<cuda::VmmHandle> handles;
  if (pub.keep_creating_handles) handles = arena->TakeHandles();
  std::vector<UniqueFd> fds = std::move(*arena).ReleaseToFds();
  arena.reset();
  return WeightStore(Tier::kGpu, std::move(fds), std::move(summary), std::move(handles));
}

}  // namespace
}  // namespace weightcache::daemon
