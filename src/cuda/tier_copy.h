// TierCopy — moving a gpu-tier cache's allocations between device memory and host memory: the
// demotion of an idle cache to sealed memfds (its GPU memory freed) and its promotion back to a
// new exported VMM arena of the same layout (docs/budget.md, "Demotion and promotion").
//
// Contract:
//  * The host copy is a list of sealed memfds, "segments": allocation i of `sizes` is held by
//    consecutive memfds of at most TierCopyOptions::segment_bytes each, in order, none crossing
//    into the next allocation. The attach manifest (which records the allocation sizes and each
//    tensor's allocation and offset) therefore stays valid across a demotion and a promotion:
//    the promotion makes allocation i of exactly sizes[i] bytes again from its segments, which
//    it learns from the memfds' own sizes. Segments let several threads write the host copy at
//    once: the kernel serialises page allocation within one shmem file (measured on the H200
//    machine: ~5 GB/s into one memfd whatever the thread count, 24 GB/s into 16 memfds).
//  * Two strategies (TierCopyOptions::strategy), the copy engine moving the bytes by DMA in both:
//    - kStaged (the default): `threads` workers, each with its own stream and two pinned staging
//      buffers of `staging_bytes` (cuda/pinned_host_buffer.h). A promotion pread()s a piece of
//      a segment into one buffer while the other's cuMemcpyHtoDAsync runs (pieces dealt
//      round-robin: reads of one file scale). A demotion gives each worker whole segments; it
//      copies a piece D2H into one buffer while it pwrite()s the previous one into its segment,
//      which allocates the segment's pages as it fills them (no fault, no zeroing, no mapping).
//    - kRegistered: each segment's own mapping is registered with the driver chunk by chunk by
//      `threads` workers (cuMemHostRegister; read-only for a promotion, whose memfds are
//      sealed) and copied to or from directly; a chunk the driver refuses to register is copied
//      pageable (correct, slower; the report says how many were). Kept to measure against
//      kStaged.
//    A promotion may instead copy from a PinnedHostCopy of its memfds (TierCopyOptions::pinned):
//    registered once behind the demotion, the copy is then DMA alone.
//  * Either function returns a complete result or releases everything it acquired: no memfd,
//    mapping, registration, stream, imported handle, arena or context reference survives an
//    error (proved against the fault-injecting fake driver in tests/unit/cuda/).
//  * Each retains the device's primary context for the copy only (made current on the calling
//    thread) and releases it before returning: the caller keeps no context.
//  * All driver calls go through `api`. Not cancellable: each is one pass over the bytes.
#pragma once

#include <cuda.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "common/unique_fd.h"
#include "cuda/driver_api.h"
#include "weightcache/status.h"

namespace weightcache::cuda {

enum class TierCopyStrategy { kStaged, kRegistered };

// A demoted cache's host copy kept registered with the driver (pinned) while the cache is
// demoted (`serve --demote host-pinned`, docs/budget.md), so that its promotion is one DMA pass
// from the segments' own mappings at the pinned-H2D rate. Pinning shmem pages is the slow part
// of a promotion from pageable memory and does not scale with threads (measured on the H200
// machine: 14–16 GB/s for 16 GiB with 16 threads; a staged promotion 20–21 GB/s, a promotion
// from the pinned copy 55 GB/s = 0.99 × pinned H2D), so the pinning is done once, behind the
// demotion, off the attach's path. The price: the device's primary context stays retained
// while the copy is pinned (its device memory in use, though the cache holds none).
//
// Contract: Pin maps each sealed memfd read-only and registers the mapping
// (CU_MEMHOSTREGISTER_READ_ONLY | PORTABLE) on `threads` workers; it returns a complete copy
// or releases everything it acquired. The memfds are borrowed: the caller keeps them open
// (and sealed: the registration is of their pages). Move-only; destruction unregisters every
// mapping (the context made current on the destroying thread), unmaps them and releases the
// context. Pinning the same memfds twice is allowed (two registrations of distinct mappings).
class PinnedHostCopy {
 public:
  static Result<PinnedHostCopy> Pin(const DriverApi* api, CUdevice device,
                                    std::span<const int> memfds, size_t threads);
  PinnedHostCopy(PinnedHostCopy&&) noexcept;
  PinnedHostCopy& operator=(PinnedHostCopy&&) noexcept;
  PinnedHostCopy(const PinnedHostCopy&) = delete;
  PinnedHostCopy& operator=(const PinnedHostCopy&) = delete;
  ~PinnedHostCopy();

  size_t segments() const;
  uint64_t bytes() const;
  // Segment i's pinned mapping and its size.
  const std::byte* data(size_t i) const;
  uint64_t size(size_t i) const;

 private:
  struct State;
  explicit PinnedHostCopy(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

// The default worker count: this machine's cores, at least 4 and at most 16 (the H200 machine's
// 16 cores write 16 segments at 24 GB/s, 8 at 17 GB/s).
size_t DefaultTierCopyThreads();

struct TierCopyOptions {
  TierCopyStrategy strategy = TierCopyStrategy::kStaged;
  size_t threads = DefaultTierCopyThreads();  // worker threads (at least 1)
  // kStaged: each worker's two buffers, each. Small, so that what the copy engine just wrote
  // is still in the last-level cache when the CPU copies it on: measured on the H200 machine
  // (demote_bench, 16 GiB, 16 workers), a demotion ran at 26.6–27.2 GB/s with 1 or 2 MiB,
  // 23.6–24.2 with 4 MiB and 19.0 with 16 MiB; a staged promotion at 21.8–22.2 with 2 MiB
  // against 18.7–18.9 with 16 MiB.
  size_t staging_bytes = size_t{2} << 20;
  // Demotion: the largest memfd of the host copy (a multiple of the page size; at least one
  // page). A smaller copy is cut into about `threads` segments so that every worker has one.
  uint64_t segment_bytes = uint64_t{512} << 20;
  // Promotion: the same memfds pinned by PinnedHostCopy::Pin (borrowed, must outlive the call):
  // copied by DMA from its mappings on kPinnedStreams streams (`strategy` is then not used).
  // Its segments must be the memfds' one for one (kInvalidArgument otherwise).
  const PinnedHostCopy* pinned = nullptr;
};

struct TierCopyReport {
  uint64_t bytes = 0;
  double seconds = 0;       // the copies (staging buffers pinned, or registration, included);
                            // allocation, import and sealing excluded
  double gb_per_s = 0;      // bytes / seconds, 1e9 bytes per GB
  size_t chunks = 0;        // chunks (kRegistered) or pieces (kStaged) copied by DMA
  size_t segments = 0;      // memfds of the host copy written or read
  size_t unregistered = 0;  // kRegistered: chunks the driver would not register, copied pageable
};

// Demotion. `vmm_fds` (borrowed: duplicated for the import) are exported VMM allocations of
// `sizes` bytes on `device`. Each is imported, mapped and copied into new memfds named `name`
// (its segments), which are then sealed read-only (F_SEAL_WRITE|GROW|SHRINK|SEAL). Returns the
// segments, in order. kInvalidArgument for mismatched spans or options (no threads, no staging
// bytes, a segment size that is not a whole number of pages); kCuda naming the failed call; kIo
// for a memfd that cannot be made, written or sealed.
Result<std::vector<UniqueFd>> CopyDeviceToMemfds(const DriverApi* api, CUdevice device,
                                                 std::span<const int> vmm_fds,
                                                 std::span<const uint64_t> sizes,
                                                 const std::string& name,
                                                 TierCopyReport* report = nullptr,
                                                 const TierCopyOptions& options = {});

// Promotion. A new exported arena of `sizes` on `device` (each a multiple of the device's
// granularity, as CopyDeviceToMemfds's inputs were), filled from `memfds` (borrowed, sealed):
// a demotion's segments, whose sizes must tile `sizes` exactly (kInvalidArgument naming the
// first that does not, before any driver call). Returns the arena's exported fds
// (ExportedArena::ReleaseToFds). kIo for a failed or short read of a memfd (kStaged).
Result<std::vector<UniqueFd>> CopyMemfdsToDevice(const DriverApi* api, CUdevice device,
                                                 std::span<const int> memfds,
                                                 std::span<const uint64_t> sizes,
                                                 TierCopyReport* report = nullptr,
                                                 const TierCopyOptions& options = {});

}  // namespace weightcache::cuda
