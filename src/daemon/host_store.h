// The steps of the host-tier loader (LoadHostStore, weight_store.h), each on its own so that
// it can be tested on its own:
//
//   PlanHostLayout    file order, page-granular arena plan, where each tensor's checksum chunk
//                     hashes go; checked against the memory budget by the caller. With a
//                     shard plan (sharding/planner.h) only the tensors this rank holds, each
//                     sized by its held bytes and read by its copy geometry
//   MakeHostItems     the plan cut into work items of about kHostItemBytes, in file order
//   CreateHostMemfds  one memfd per allocation of the plan, named "<cache>-<index>"
//   FillHostFromPeers the fill from other nodes (serve --fill-from), verified, instead of
//                     RunHostItems when it succeeds
//   RunHostItems      reader threads: pread → hash → pwrite, through a bounce buffer each
//   SealHostMemfds    F_SEAL_WRITE|GROW|SHRINK|SEAL on every memfd
//   SummarizeHostStore  the tensors' checksums, the attach manifest (name order), the totals
//
// Contract: every step only reads the checkpoint; what a step acquires is returned as RAII
// values (UniqueFd), so a failed load releases everything. Thread-safety: RunHostItems starts
// and joins its own threads; the other steps are plain functions.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "checkpoint/arena_plan.h"
#include "checkpoint/checkpoint.h"
#include "common/unique_fd.h"
#include "daemon/weight_store.h"
#include "sharding/planner.h"
#include "weightcache/status.h"

namespace weightcache::daemon {

// A work item covers about this many bytes: big enough that claiming one costs nothing next
// to its read, small enough that two threads share even a single large tensor evenly and a
// cancellation (SIGTERM mid-load) is noticed within milliseconds. A multiple of the checksum
// chunk, so the pieces of one tensor hash independently.
inline constexpr uint64_t kHostItemBytes = uint64_t{8} << 20;
// The bounce buffer of each reader thread: one pread, the hash and one pwrite per step. 1 MiB
// still sits in the core's L2 when the checksum and the pwrite walk over it. Also a multiple
// of the checksum chunk.
inline constexpr uint64_t kHostStepBytes = uint64_t{1} << 20;

// Where every tensor of a host-tier load goes.
struct HostLayout {
  std::vector<size_t> order;    // indices into checkpoint.tensors(), in file order (FileOrder)
  std::vector<uint64_t> sizes;  // sizes[i]: the bytes held of tensor order[i]
  // copy[i]: where the held bytes of tensor order[i] lie in it (one run for a whole tensor).
  std::vector<sharding::CopyGeometry> copy;
  // planned[i]: the shard plan's entry of tensor order[i]; empty when the load is unsharded.
  std::vector<const sharding::PlannedTensor*> planned;
  checkpoint::ArenaPlan plan;  // placements parallel to `order`
  // Every tensor's chunk hashes in one flat array: those of tensor order[i] are
  // [chunk_begin[i], chunk_begin[i + 1]); chunk_begin.back() is the array's size.
  std::vector<uint64_t> chunk_begin;
};

// Packs the tensors in file order at `page_size` granularity (a memfd is sized in pages
// anyway, and mmap needs page-aligned lengths). `plan` (may be null: every tensor whole) is
// the rank's shard plan of `checkpoint`, and must outlive the layout.
HostLayout PlanHostLayout(const checkpoint::Checkpoint& checkpoint, uint64_t page_size,
                          const sharding::ShardPlan* plan = nullptr);

// One unit of loader work, in file order: either the whole tensors [first, first + count) of
// the layout's order (small tensors grouped up to kHostItemBytes), or the byte range
// [from, from + length) of the single tensor `first` (count == 1) when it is larger than an
// item. `length` is always the item's bytes.
struct HostItem {
  size_t first = 0;
  size_t count = 1;
  uint64_t from = 0;
  uint64_t length = 0;
};
std::vector<HostItem> MakeHostItems(const std::vector<uint64_t>& sizes);

// One memfd per allocation of `plan`, sized to it and named "<cache_name>-<index>"; the error
// names the allocation and its size.
Result<std::vector<UniqueFd>> CreateHostMemfds(const std::string& cache_name,
                                               const checkpoint::ArenaPlan& plan);

// Runs `items` on up to `threads` threads (clamped to 1..256 and to the item count): each
// reads its ranges from the checkpoint, hashes their checksum chunks into `chunk_hashes`
// (sized layout.chunk_begin.back()) and pwrites them into their place in `memfds`. Reports
// progress per item; stops at the first error, which it returns (kUnavailable "load
// cancelled" when control.cancel was set, else the error in the context of the checkpoint).
Status RunHostItems(const checkpoint::Checkpoint& checkpoint, const HostLayout& layout,
                    const std::vector<HostItem>& items, const std::vector<UniqueFd>& memfds,
                    int threads, const LoadControl& control, std::vector<uint64_t>* chunk_hashes);

// The fill from other nodes (LoadOptions::peer_fill) into `memfds` (created, not yet sealed):
// maps them writable, runs `fill` with an accept() that decodes each source's manifest and
// takes it only when its layout (tier, allocation sizes, every tensor's name, dtype, shape,
// slice, allocation, offset and bytes) equals our plan's and it is byte-equal to the first
// accepted one (daemon/peer_fill.h); then hashes every tensor in OUR memory into
// `chunk_hashes` (on up to `threads` threads, clamped to 1..256 and the work items) and compares
// each checksum with that manifest's; when the fill's outcome carries a content anchor (serve
// --fill-trust content) proves every shard file's SHA-256 over our header and the filled bytes
// against it (ProveFillContent, one thread per file, at most `threads`); compares
// kFillSampleChunks random chunks with the checkpoint's own bytes, and zeroes the bytes
// between tensors.
// `control`'s progress gets the fill's, in the tensors' bytes the load holds (a failed fill
// is followed by the disk's pass from 0); its cancel flag is handed to the fill.
// OK: the fill's outcome (its origin and description); the memfds hold verified bytes. An
// error (kMismatch for a layout, checksum, SHA-256 or sample difference, naming the tensor or
// file): the memfds hold partial or wrong data and must be discarded. The mappings are gone on
// return (the memfds can be sealed).
Result<FillOutcome> FillHostFromPeers(const checkpoint::Checkpoint& checkpoint,
                                      const HostLayout& layout, const std::vector<UniqueFd>& memfds,
                                      const PeerFill& fill, int threads, const LoadControl& control,
                                      std::vector<uint64_t>* chunk_hashes);

// Seals every memfd read-only; the error names the allocation. No writable mapping may exist
// (the kernel refuses F_SEAL_WRITE while one does); the loader never maps them.
Status SealHostMemfds(const std::vector<UniqueFd>& memfds);

// The summary of a finished load: each tensor's checksum from its chunk hashes, the attach
// manifest in name order (the order the client's table is kept in, so attaching needs no
// sort; a sharded load's records carry the held shapes and slices), the tensor count and the
// byte totals (tensor_bytes: the held bytes).
Result<StoreSummary> SummarizeHostStore(const checkpoint::Checkpoint& checkpoint,
                                        const HostLayout& layout,
                                        const std::vector<uint64_t>& chunk_hashes);

}  // namespace weightcache::daemon
