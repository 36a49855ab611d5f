// The checks of a fill from other nodes (LoadOptions::peer_fill, docs/fleet.md "Fill") that
// are the same on either tier: which source manifest is accepted, the checksum comparison, the
// sample against our own checkpoint and the gaps between tensors. The tiers differ only in how
// they read, hash and zero their memory: host_store.cc (FillHostFromPeers) through mappings of
// the memfds, gpu_store.cc (FillGpuFromPeers) through the driver. Under --fill-trust content
// (FillOutcome::content_anchor) the filled bytes are also proven against our checkpoint's own
// SHA-256s (ProveFillContent), the one check that does not rest on what the source says.
//
// Contract: plain functions over our plan (FillPlan, whose references must outlive the call);
// every difference is kMismatch naming the tensor; nothing here writes memory.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "checkpoint/arena_plan.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/content_anchor.h"
#include "protocol/manifest.h"
#include "sharding/planner.h"
#include "weightcache/status.h"

namespace weightcache::daemon {

// The sample of step 4: this many chunks of this many bytes at random places.
inline constexpr int kFillSampleChunks = 16;
inline constexpr uint64_t kFillSampleBytes = uint64_t{256} << 10;

// What a fill compares against: our own load's plan, in file order (`order`, `sizes`, `copy`
// and `arena.placements` parallel), as both loaders make it.
struct FillPlan {
  const checkpoint::Checkpoint& checkpoint;
  const std::vector<size_t>& order;    // indices into checkpoint.tensors()
  const std::vector<uint64_t>& sizes;  // the bytes held of each
  const std::vector<sharding::CopyGeometry>& copy;
  const checkpoint::ArenaPlan& arena;
  const std::vector<uint64_t>& allocation_sizes;  // as made (at least the plan's)
};

Status FillMismatch(std::string message);

// What accept() keeps across the sources of one fill: our plan's manifest (`ours`, encoded by
// the same encoder as a source's, its checksums zero) and the first accepted source's bytes.
// A source is accepted when its layout — tier, allocation sizes, every tensor's name, dtype,
// shape, slice, allocation, offset and bytes — equals ours; every later source must serve a
// manifest byte-equal to the first (so every byte is checked against one set of checksums).
struct FillAcceptor {
  protocol::Manifest ours;
  std::vector<uint8_t> accepted;

  Status Accept(std::span<const uint8_t> manifest);
  // The next Accept() is a first one again (PeerFillRequest::forget_accepted).
  void Forget() { accepted.clear(); }
};

// checksums[k]: the checksum of tensor order[k] computed over OUR memory after the fill; each
// must equal the accepted manifest's record of that tensor (records are in name order).
Status CompareFillChecksums(const FillPlan& plan, const std::vector<uint64_t>& checksums,
                            const protocol::Manifest& theirs);

// Reads `length` bytes of our memory at `offset` of allocation `allocation` into `out`.
using ReadFilled =
    std::function<Status(uint32_t allocation, uint64_t offset, uint64_t length, uint8_t* out)>;

// kFillSampleChunks chunks at random places (seeded from std::random_device), each read from
// our memory by `read` and from our own checkpoint: the fleet key leaves out the files, and the
// manifest with its checksums comes from the source itself.
Status CheckFillSample(const FillPlan& plan, const ReadFilled& read);

// Whether `plan` holds every tensor of the checkpoint whole (PeerFillRequest::holds_whole_files):
// what a proof against whole-file SHA-256s needs.
bool HoldsWholeFiles(const FillPlan& plan);

// The bytes each proof thread hashes at a time (one buffer of this size per thread).
inline constexpr uint64_t kFillProofChunkBytes = uint64_t{4} << 20;

// The proof of a fill against our checkpoint's content anchor (FillOutcome::content_anchor):
// for each shard file, the SHA-256 of our own header bytes (the 8-byte length and the JSON,
// pread from our file), then the data section in file offset order — each tensor's bytes read
// from our filled memory by `read`, any byte no tensor covers pread from our file — must equal
// the anchor's digest of that file. Files in parallel, one thread each, at most `threads`
// (clamped to 1..256); `on_thread` (may be empty) runs first on each thread that is not the
// caller's (the gpu tier makes the load's context current there). kMismatch naming the file,
// the digest of the filled bytes and the anchor's (and where the anchor came from); kMismatch
// too when the plan does not hold every tensor whole or the anchor lacks a file.
Status ProveFillContent(const FillPlan& plan, const checkpoint::ContentAnchor& anchor,
                        const ReadFilled& read, int threads,
                        const std::function<Status()>& on_thread = {});

// The byte ranges of each allocation that no tensor occupies (the source's bytes there are to
// be zeroed, as a disk load leaves them), in allocation order then offset order.
struct FillGap {
  uint32_t allocation = 0;
  uint64_t offset = 0;
  uint64_t length = 0;
};
std::vector<FillGap> FillGaps(const FillPlan& plan);

// The fill's progress (bytes of the allocations, padding included) scaled to the tensor bytes
// the load holds, as a disk load would report them; `report` may be empty.
std::function<void(uint64_t done, uint64_t total)> ScaledFillProgress(
    std::function<void(uint64_t done, uint64_t total)> report, uint64_t held_bytes);

}  // namespace weightcache::daemon
