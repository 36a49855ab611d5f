// TierCopy — moving a gpu-tier cache's allocations between device memory and host memory: the
// demotion of an idle cache to sealed memfds (its GPU memory freed) and its promotion back to a
// new exported VMM arena of the same layout (docs/budget.md, "Demotion and promotion").
//
// Contract:
//  * The layout is kept: allocation i of `sizes` becomes memfd i of exactly sizes[i] bytes, and
//    back. The attach manifest (which records the allocation sizes and each tensor's allocation
//    and offset) therefore stays valid across a demotion and a promotion: the bytes are equal.
//  * Two strategies (TierCopyOptions::strategy), the copy engine moving the bytes by DMA in both:
//    - kStaged (the default): `threads` workers, each with its own stream and two pinned staging
//      buffers of `staging_bytes` (cuda/pinned_host_buffer.h), take every threads-th piece of at
//      most staging_bytes. A promotion pread()s a piece from the memfd into one buffer while the
//      other's cuMemcpyHtoDAsync runs. A demotion first populates the memfds' pages in parallel
//      (their mapping advised MADV_HUGEPAGE, then MADV_POPULATE_WRITE over disjoint ranges, or
//      fallocate where the kernel lacks it), then each worker copies a piece D2H into one buffer
//      while it memcpy()s the previous one into the mapping. No page of the memfd is pinned.
//    - kRegistered: the memfd's own mapping is registered with the driver chunk by chunk by
//      four workers (cuMemHostRegister; read-only for a promotion, whose memfds are sealed) and
//      copied to or from directly; a chunk the driver refuses to register is copied pageable
//      (correct, slower; the report says how many were). Kept to measure against kStaged.
//  * Either function returns a complete result or releases everything it acquired: no memfd,
//    mapping, registration, stream, imported handle, arena or context reference survives an
//    error (proved against the fault-injecting fake driver in tests/unit/cuda/).
//  * Each retains the device's primary context for the copy only (made current on the calling
//    thread) and releases it before returning: the caller keeps no context.
//  * All driver calls go through `api`. Not cancellable: each is one pass over the bytes.
#pragma once

#include <cuda.h>

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "common/unique_fd.h"
#include "cuda/driver_api.h"
#include "weightcache/status.h"

namespace weightcache::cuda {

enum class TierCopyStrategy { kStaged, kRegistered };

struct TierCopyOptions {
  TierCopyStrategy strategy = TierCopyStrategy::kStaged;
  size_t threads = 8;                       // kStaged: worker threads (at least 1)
  size_t staging_bytes = size_t{32} << 20;  // kStaged: each worker's two buffers, each
};

struct TierCopyReport {
  uint64_t bytes = 0;
  double seconds = 0;           // populate + copies (staging or registration included); allocation,
                                // import and sealing excluded
  double gb_per_s = 0;          // bytes / seconds, 1e9 bytes per GB
  double populate_seconds = 0;  // kStaged demotion: the memfds' pages allocated
  double copy_seconds = 0;      // the copy phase (staging buffers pinned, or registration, in it)
  size_t chunks = 0;            // chunks (kRegistered) or pieces (kStaged) copied by DMA
  size_t unregistered = 0;  // kRegistered: chunks the driver would not register, copied pageable
};

// Demotion. `vmm_fds` (borrowed: duplicated for the import) are exported VMM allocations of
// `sizes` bytes on `device`. Each is imported, mapped and copied into a new memfd named `name`
// of the same size, which is then sealed read-only (F_SEAL_WRITE|GROW|SHRINK|SEAL). Returns the
// memfds, in order. kInvalidArgument for mismatched spans or options (no threads, no staging
// bytes); kCuda naming the failed call; kIo for a memfd that cannot be made, populated or sealed.
Result<std::vector<UniqueFd>> CopyDeviceToMemfds(const DriverApi* api, CUdevice device,
                                                 std::span<const int> vmm_fds,
                                                 std::span<const uint64_t> sizes,
                                                 const std::string& name,
                                                 TierCopyReport* report = nullptr,
                                                 const TierCopyOptions& options = {});

// Promotion. A new exported arena of `sizes` on `device` (each a multiple of the device's
// granularity, as CopyDeviceToMemfds's inputs were), filled from `memfds` (borrowed, sealed,
// each at least its size). Returns the arena's exported fds (ExportedArena::ReleaseToFds).
// kIo for a failed or short read of a memfd (kStaged).
Result<std::vector<UniqueFd>> CopyMemfdsToDevice(const DriverApi* api, CUdevice device,
                                                 std::span<const int> memfds,
                                                 std::span<const uint64_t> sizes,
                                                 TierCopyReport* report = nullptr,
                                                 const TierCopyOptions& options = {});

}  // namespace weightcache::cuda
