// WeightStore — the loaded weights of one cache, in one tier, and the loaders that fill it.
//
//   host tier  a few memfds (PlanArena with page granularity), filled with pwrite from a
//              per-thread bounce buffer (pread, checksum, pwrite: one pass, no mapping), then
//              sealed read-only (F_SEAL_WRITE|GROW|SHRINK|SEAL): after sealing nobody, the
//              daemon included, can change a byte. The manifest lists tensors by name.
//   gpu tier   an ExportedArena (cuMemCreate allocations exported as POSIX fds) on one device,
//              filled by the UploadPipeline (pinned staging ring + async H2D), checksums
//              computed host-side by the pipeline from the same staging buffers.
//
// Contract:
//  * A loader either returns a complete store or releases everything it acquired (each
//    resource is an RAII member). Loaders only READ the checkpoint: a failure mid-load, a
//    cancellation or a crash never writes to disk.
//  * The store owns its allocation fds; fds() are borrowed and valid for the store's life.
//    sendmsg(SCM_RIGHTS) duplicates them into the peer, so clients keep the memory after the
//    daemon exits (memfd: the file lives while any fd or mapping does; VMM: refcounted).
//  * summary().manifest is the attach manifest (protocol/manifest.h), encoded once at load
//    into a sealed read-only memfd that every AttachReply hands out (protocol version 2 and later):
//    no per-attach encoding or copying, and the daemon keeps no heap copy of it.
//  * Loaders run on the daemon's loader thread; a finished store is immutable and its const
//    methods may be called from any thread.
//  * The memory budget (0 = none) is checked against the plan BEFORE anything is allocated:
//    exceeding it is kOutOfMemory naming both numbers.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "checkpoint/content_anchor.h"
#include "common/unique_fd.h"
#include "cuda/driver_api.h"
#include "cuda/vmm.h"
#include "identity/device_inventory.h"
#include "protocol/manifest.h"
#include "sharding/planner.h"
#include "weightcache/status.h"

namespace weightcache::daemon {

// The encoded attach manifest in its sealed memfd (protocol::CreateManifestMemfd).
struct ManifestFile {
  UniqueFd fd;
  uint64_t size = 0;
};

// What every store reports about itself, fixed at the end of its load.
struct StoreSummary {
  ManifestFile manifest;
  uint64_t tensor_count = 0;
  uint64_t tensor_bytes = 0;    // sum of the tensors' bytes (what the checkpoint holds)
  uint64_t resident_bytes = 0;  // sum of the allocations (what the cache occupies)
  // Where the bytes came from (`status` and `ls` show it): "disk" (the checkpoint), "fleet"
  // (other nodes, serve --fill-from), "peer <device key>" (a peer cache of this node, serve
  // --seed-from), "published" (an engine's publish) or "adopted" (a keeper's memory, after a
  // restart).
  std::string origin = "disk";
  // A fill's own account (LoadOptions::peer_fill), "" after a disk load: e.g. "filled from 1
  // source(s) (node-a 12 MB) in 0.1 s, ...".
  std::string filled_from;
};

// The loaded weights, whatever the tier: one fd per allocation (sealed memfds, or exported VMM
// fds with no mapping or context left in the daemon) — the fds alone keep the memory — and
// the summary. One concrete class: both tiers serve the same way once loaded. Move-only.
//
// A gpu-tier store this process created may also keep the allocations' creating handles
// (LoadOptions::keep_creating_handles, for `serve --fill-serve`): they need no context and keep
// nothing alive that the fds do not, but a mapping of them is exportable again, which a
// mapping of the fds is not (ExportedArena::TakeHandles). They go with the fds: ExchangeFds
// releases them.
class WeightStore {
 public:
  WeightStore(Tier tier, std::vector<UniqueFd> fds, StoreSummary summary,
              std::vector<cuda::VmmHandle> creating_handles = {})
      : tier_(tier),
        fds_(std::move(fds)),
        creating_handles_(std::move(creating_handles)),
        summary_(std::move(summary)) {}
  WeightStore(WeightStore&&) noexcept = default;
  WeightStore& operator=(WeightStore&&) noexcept = default;
  WeightStore(const WeightStore&) = delete;
  WeightStore& operator=(const WeightStore&) = delete;

  Tier tier() const { return tier_; }
  // Borrowed, one per allocation, in manifest order.
  std::vector<int> fds() const {
    std::vector<int> fds;
    fds.reserve(fds_.size());
    for (const auto& fd : fds_) fds.push_back(fd.get());
    return fds;
  }
  // Borrowed, one per allocation in manifest order, or empty when the store keeps none.
  std::vector<CUmemGenericAllocationHandle> creating_handles() const {
    std::vector<CUmemGenericAllocationHandle> handles;
    handles.reserve(creating_handles_.size());
    for (const auto& handle : creating_handles_) handles.push_back(handle.get());
    return handles;
  }
  const StoreSummary& summary() const { return summary_; }
  // Demotion and promotion (docs/budget.md): the same layout in other memory. Takes `fds` (one
  // per allocation, same sizes) and returns the old ones; the creating handles, if any, are
  // released (they name the old memory). Not while another thread reads fds().
  std::vector<UniqueFd> ExchangeFds(std::vector<UniqueFd> fds) {
    creating_handles_.clear();
    fds_.swap(fds);
    return fds;
  }

 private:
  Tier tier_;
  std::vector<UniqueFd> fds_;
  std::vector<cuda::VmmHandle> creating_handles_;
  StoreSummary summary_;
};

// A fill from elsewhere (the fleet: docs/fleet.md "Fill"), offered the allocations before the
// checkpoint's tensor data is read. The loader checks what it brings (host_store.h,
// FillHostFromPeers; gpu_store.cc, FillGpuFromPeers): a source's manifest must be accepted by
// `accept` (its layout equal to our own plan, every accepted source's manifest byte-equal to
// the first's) before a byte of it is read; afterwards every tensor's checksum over our memory
// must equal that manifest's, and a random sample of chunks must equal our own checkpoint's
// bytes.
enum class FillMemory {
  kHost,    // writable mappings of the unsealed memfds (host tier)
  kDevice,  // the arena's device memory, mapped in the primary context of the load's device,
            // which is current on the calling (loader) thread (gpu tier)
};
struct PeerFillRequest {
  // Each allocation's address and size in this process: host or device memory (`memory`).
  std::vector<std::span<uint8_t>> allocations;
  FillMemory memory = FillMemory::kHost;
  // Host tier: each allocation's memfd, writable until the load seals it. A pwrite into it
  // gets shmem's pages inside the write, with no user page fault per 4 KiB page as a copy into
  // the mapping takes (daemon/host_store.cc): the faster way in for a fill that holds its
  // source bytes in this process. Empty on the gpu tier.
  std::vector<int> fds;
  std::function<Status(std::span<const uint8_t> manifest)> accept;
  // Forgets the manifest accept() took. A fill that gives up on its sources and tries others
  // (FirstFillOf: this node's peer caches, then the fleet) calls it first, so that the next
  // sources are held to their own manifest, not to one whose bytes never arrived: every byte
  // is then written again and checked against the manifest of the sources that wrote it.
  std::function<void()> forget_accepted;
  // The allocations' bytes written so far, of all of them, from the filling thread; the
  // loader reports them as the load's progress. Never null.
  std::function<void(uint64_t done, uint64_t total)> progress;
  // The load's cancel flag (LoadControl::cancel), or null: once true the fill should stop
  // and fail soon (the loader then stops too, "load cancelled").
  const std::atomic<bool>* cancel = nullptr;
  // Whether the load holds every tensor of every shard file whole (no sharding rule slices or
  // drops one): only then can the filled bytes be proven against whole-file SHA-256s
  // (FillOutcome::content_anchor). A fill that must prove its bytes refuses at once when not.
  bool holds_whole_files = true;
};
// OK: every byte of every allocation written; `origin` is the store's origin once the bytes
// pass the checks (StoreSummary::origin: "fleet", "peer <device key>"), `description` says
// from where ("1 source(s) (node-a 12 MB) in 0.10 s, 0.12 GB/s"). An error: the allocations
// hold partial data (the loader discards them and reads the disk).
struct FillOutcome {
  std::string origin;
  std::string description;
  // Set by a fill whose bytes must be proven against our own checkpoint's content anchor
  // before ready (the fleet under `serve --fill-trust content`, docs/fleet.md "Fill"): after
  // the checksums, the loader recomputes each shard file's SHA-256 from our own header and the
  // filled bytes (ProveFillContent, daemon/peer_fill.h) and fails the fill on a difference.
  // Null: the fill's other checks only.
  std::shared_ptr<const checkpoint::ContentAnchor> content_anchor;
};
using PeerFill = std::function<Result<FillOutcome>(const PeerFillRequest& request)>;

struct LoadOptions {
  int threads = 16;            // reader threads (host tier: pread; gpu tier: pipeline readers)
  uint64_t memory_budget = 0;  // bytes the plan may occupy; 0 = unlimited
  // Gpu tier: the device to load onto (resolved, with its CUDA ordinal) and the driver table
  // (the daemon's Env).
  identity::DeviceInfo device;
  const cuda::DriverApi* driver = nullptr;
  std::string cache_name;  // names the memfds ("weightcache:<digest16>") for /proc readers
  // A sharded cache: this rank's plan of the checkpoint being loaded (either tier loads only
  // what it lists, ListHeldTensors); null = every tensor whole.
  const sharding::ShardPlan* shard_plan = nullptr;
  // Either tier: tried before the disk when set (serve --fill-from); any failure is logged and
  // the load reads the disk as if it were not set.
  PeerFill peer_fill;
  // Gpu tier: the store keeps the allocations' creating handles (WeightStore above), so that a
  // fill source serving it to other nodes maps exportable memory (serve --fill-serve).
  bool keep_creating_handles = false;
};

// What a finished load still holds that serving does not need: the gpu tier's upload pipeline
// (pinned staging ring, streams, events), the arena's mappings, VA and handles, and the CUDA
// context reference. Tearing that down took 100 ms for one 16 GB load and 270 ms for each of
// four rank daemons sharing an H200 (the driver serializes context destruction); a loader
// given a LoadLeftovers moves it there, and the daemon drops it on the loader thread after it
// has announced `ready` (docs/daemon.md "The load's teardown comes after ready").
// Contract: Release() destroys what was kept, the last kept first, on the calling thread (the
// gpu tier's pieces want the loader thread, whose current context is theirs); the destructor
// releases what is left. Move-only; one thread uses it.
class LoadLeftovers {
 public:
  LoadLeftovers() = default;
  LoadLeftovers(LoadLeftovers&&) = default;
  LoadLeftovers& operator=(LoadLeftovers&&) = delete;
  LoadLeftovers(const LoadLeftovers&) = delete;
  LoadLeftovers& operator=(const LoadLeftovers&) = delete;
  ~LoadLeftovers() { Release(); }

  template <typename T>
  void Keep(T value) {
    kept_.push_back(std::make_shared<T>(std::move(value)));
  }
  void Release() {
    while (!kept_.empty()) kept_.pop_back();
  }
  bool empty() const { return kept_.empty(); }

 private:
  std::vector<std::shared_ptr<void>> kept_;
};

struct LoadControl {
  // (bytes done, bytes total); monotone; may be called from several threads, serialized.
  std::function<void(uint64_t, uint64_t)> progress;
  // Polled between batches; when true the loader stops with kUnavailable "load cancelled".
  const std::atomic<bool>* cancel = nullptr;
  // Where a successful gpu load leaves what serving does not need (above); null: the load
  // releases it before it returns.
  LoadLeftovers* leftovers = nullptr;
};

// The loaders. `memory` receives the process's memory at the load's steps worth a log line
// (load_memory.h); the caller trims the heap and logs once the checkpoint is gone too.
Result<WeightStore> LoadHostStore(const checkpoint::Checkpoint& checkpoint,
                                  const LoadOptions& options, const LoadControl& control,
                                  std::string* memory);

Result<WeightStore> LoadGpuStore(const checkpoint::Checkpoint& checkpoint,
                                 const LoadOptions& options, const LoadControl& control,
                                 std::string* memory);

// Budget check shared by both tiers: kOutOfMemory "<tier> plan needs X (N allocations), over
// the memory budget of Y (--memory-budget)".
Status CheckMemoryBudget(Tier tier, uint64_t plan_bytes, size_t allocations, uint64_t budget);

// The order tensors are packed in: by (shard, offset), i.e. file order, so reads and writes
// both stream. Indices into checkpoint.tensors().
std::vector<size_t> FileOrder(const checkpoint::Checkpoint& checkpoint);

// The tensors a load holds, in file order: every tensor whole, or (with a shard plan) the
// tensors the rank's plan lists, each sized by its held bytes and read by its copy geometry.
// Both tiers pack and read what this lists, so they hold the same bytes of a sharded cache.
struct HeldTensors {
  std::vector<size_t> order;    // indices into checkpoint.tensors(), in file order (FileOrder)
  std::vector<uint64_t> sizes;  // sizes[i]: the bytes held of tensor order[i]
  // copy[i]: where the held bytes of tensor order[i] lie in it (one run for a whole tensor).
  std::vector<sharding::CopyGeometry> copy;
  // planned[i]: the shard plan's entry of tensor order[i]; empty when the load is unsharded
  // (what BuildManifest takes as `planned`).
  std::vector<const sharding::PlannedTensor*> planned;
};
// `plan` (may be null) is the rank's plan of `checkpoint` and must outlive the result.
HeldTensors ListHeldTensors(const checkpoint::Checkpoint& checkpoint,
                            const sharding::ShardPlan* plan);

// The attach manifest of `checkpoint` packed as `placements` (parallel to `order`), with one
// checksum per entry of `order` (common/checksum.h), in its sealed memfd; the records are in
// name order whatever `order` is (protocol/manifest.h). A checkpoint that opened is within the
// manifest's bounds (checkpoint/limits.h), so an encoding error here is an internal one.
// `planned` (empty, or parallel to `order`): a sharded load's entries, whose held shape,
// bytes and slice the records carry instead of the whole tensor's.
struct PlacedTensor {
  uint32_t allocation = 0;
  uint64_t offset = 0;
};
Result<ManifestFile> BuildManifest(Tier tier, const checkpoint::Checkpoint& checkpoint,
                                   const std::vector<size_t>& order,
                                   const std::vector<PlacedTensor>& placements,
                                   const std::vector<uint64_t>& checksums,
                                   const std::vector<uint64_t>& allocation_sizes,
                                   std::span<const sharding::PlannedTensor* const> planned = {});

}  // namespace weightcache::daemon
