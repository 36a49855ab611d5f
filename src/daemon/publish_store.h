// Publishing on the host tier (docs/publish.md): the arena a publisher fills, and its commit.
//
//   CreateHostPublication  the plan (already ValidatePublishPlan'd) laid out by the same arena
//                          planner a loaded cache uses (PlanArena, page granularity), checked
//                          against the memory budget, one writable memfd per allocation, and
//                          the manifest of the arena (records with checksum 0) for PublishArena
//   CommitHostPublication  seals every memfd read-only (refused while the publisher still has
//                          a writable mapping: it unmaps, then commits), checks their sizes,
//                          recomputes every tensor's checksum over the sealed bytes and
//                          compares it with the publisher's; then the attach manifest with the
//                          checksums and the WeightStore the daemon serves like a loaded one
//
// Contract: each owns what it acquires through RAII members; a failed commit drops the
// publication (its memfds close with it; the publisher's own fds and mappings are its
// business). Plain functions on the daemon's event loop thread; no shared state.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "checkpoint/arena_plan.h"
#include "common/unique_fd.h"
#include "daemon/weight_store.h"
#include "protocol/messages.h"
#include "weightcache/status.h"

namespace weightcache::daemon {

struct HostPublication {
  protocol::PublishBegin plan;
  checkpoint::ArenaPlan layout;  // placements parallel to plan.tensors (an alias: its target's)
  std::vector<UniqueFd> memfds;  // writable until the commit seals them
  ManifestFile arena_manifest;   // what PublishArena hands out (checksums 0)
  uint64_t tensor_bytes = 0;     // sum of the plan's nbytes, aliases not counted
};

// `plan` must have passed protocol::ValidatePublishPlan. kOutOfMemory over `memory_budget`
// (0 = none), naming both numbers (CheckMemoryBudget).
Result<HostPublication> CreateHostPublication(protocol::PublishBegin plan,
                                              const std::string& cache_name,
                                              uint64_t memory_budget);

// `checksums`: the publisher's, one per plan tensor in plan order. kInvalidArgument for a
// count that differs from the plan's or a checksum that differs from the bytes ("tensor
// '<name>' (plan index i): the publisher's checksum … but the arena holds …", the first such
// tensor in plan order); kPermissionDenied/kIo from the seal, with the unmap hint; the store
// otherwise.
Result<WeightStore> CommitHostPublication(HostPublication publication,
                                          std::span<const uint64_t> checksums);

}  // namespace weightcache::daemon
