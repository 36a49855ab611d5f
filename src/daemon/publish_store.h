// Publishing (docs/publish.md): the arena a publisher fills, and its commit, on either tier.
//
//   CreatePublication  the plan (already ValidatePublishPlan'd) laid out by the same arena
//                      planner a loaded cache uses (PlanArena: page granularity on the host
//                      tier, the device's VMM granularity on the gpu tier), checked against the
//                      memory budget, then the arena — one writable memfd per allocation (host),
//                      or a cuda::ExportedArena on the daemon's GPU whose exported fds the
//                      publisher imports read-write (gpu) — and the manifest of the arena
//                      (records with checksum 0) for PublishArena
//   CommitPublication  host: seals every memfd read-only (refused while the publisher still
//                      has a writable mapping: it unmaps, then commits), checks their sizes and
//                      recomputes every tensor's checksum over the sealed bytes; gpu: the GPU
//                      checksum kernel over the daemon's own mapping of the arena. Either
//                      compares with the publisher's checksums; then the attach manifest with
//                      them and the WeightStore the daemon serves like a loaded one (gpu: only
//                      now is the arena released to its fds, ExportedArena::ReleaseToFds)
//
// Contract: each owns what it acquires through RAII members; a failed commit or a dropped
// publication releases everything (memfds; or the VMM mapping, VA, handles, exported fds and
// the primary context reference), the publisher's own fds and mappings being its business.
// CreatePublication runs on the daemon's event loop thread (on the gpu tier the arena's
// primary context is made current there); CommitPublication on any one thread (it makes the
// arena's context current for its own calls). No shared state.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "checkpoint/arena_plan.h"
#include "common/unique_fd.h"
#include "cuda/driver_api.h"
#include "cuda/exported_arena.h"
#include "daemon/weight_store.h"
#include "identity/device_inventory.h"
#include "protocol/messages.h"
#include "weightcache/status.h"
#include "weightcache/tier.h"

namespace weightcache::daemon {

// Where a gpu-tier publication lives: the daemon's driver and its resolved device.
struct GpuPublishTarget {
  const cuda::DriverApi* driver = nullptr;
  identity::DeviceInfo device;
  // The committed store keeps the arena's creating handles (LoadOptions::keep_creating_handles).
  bool keep_creating_handles = false;
};

struct Publication {
  Tier tier = Tier::kHost;
  protocol::PublishBegin plan;
  checkpoint::ArenaPlan layout;  // placements parallel to plan.tensors (an alias: its target's)
  std::vector<UniqueFd> memfds;  // host tier: writable until the commit seals them
  // gpu tier: mapped read-write in the daemon, its fds borrowed by PublishArena; released to
  // fds only by a verified commit.
  std::optional<cuda::ExportedArena> gpu_arena;
  bool keep_creating_handles = false;      // GpuPublishTarget's
  std::vector<uint64_t> allocation_sizes;  // what the manifest lists (gpu: rounded up)
  ManifestFile arena_manifest;             // what PublishArena hands out (checksums 0)
  uint64_t tensor_bytes = 0;               // sum of the plan's nbytes, aliases not counted

  // The arena's fds, one per allocation in order (borrowed).
  std::vector<int> ArenaFds() const;
};

// `plan` must have passed protocol::ValidatePublishPlan. kOutOfMemory over `memory_budget`
// (0 = none), naming both numbers (CheckMemoryBudget). `gpu` is required for Tier::kGpu
// (kInternal without it); kUnavailable on the gpu tier in a build without the GPU checksum
// kernel (the commit could not be verified), the driver's error naming the device otherwise.
Result<Publication> CreatePublication(Tier tier, protocol::PublishBegin plan,
                                      const std::string& cache_name, uint64_t memory_budget,
                                      const GpuPublishTarget* gpu);

// `checksums`: the publisher's, one per plan tensor in plan order. kInvalidArgument for a
// count that differs from the plan's or a checksum that differs from the bytes ("tensor
// '<name>' (plan index i): the publisher's checksum … but the arena holds …", the first such
// tensor in plan order); host: kPermissionDenied/kIo from the seal, with the unmap hint; gpu:
// the driver's error of the checksum pass; the store otherwise.
Result<WeightStore> CommitPublication(Publication publication, std::span<const uint64_t> checksums);

}  // namespace weightcache::daemon
