// TierCopy — moving a gpu-tier cache's allocations between device memory and host memory: the
// demotion of an idle cache to sealed memfds (its GPU memory freed) and its promotion back to a
// new exported VMM arena of the same layout (docs/budget.md, "Demotion and promotion").
//
// Contract:
//  * The layout is kept: allocation i of `sizes` becomes memfd i of exactly sizes[i] bytes, and
//    back. The attach manifest (which records the allocation sizes and each tensor's allocation
//    and offset) therefore stays valid across a demotion and a promotion: the bytes are equal.
//  * The host side of each copy is the memfd's own mapping, registered with the driver chunk by
//    chunk by a few worker threads, each on its own stream (cuMemHostRegister; read-only for a
//    promotion, whose memfds are sealed) so that the copy engine reads or writes it by DMA at
//    the pinned rate; a chunk the driver refuses to register is copied pageable (correct,
//    slower; the report says how many were).
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

struct TierCopyReport {
  uint64_t bytes = 0;
  double seconds = 0;       // the copies, registration included, allocation and sealing excluded
  double gb_per_s = 0;      // bytes / seconds, 1e9 bytes per GB
  size_t chunks = 0;        // registered chunks copied by DMA
  size_t unregistered = 0;  // chunks the driver would not register, copied pageable
};

// Demotion. `vmm_fds` (borrowed: duplicated for the import) are exported VMM allocations of
// `sizes` bytes on `device`. Each is imported, mapped and copied into a new memfd named `name`
// of the same size, which is then sealed read-only (F_SEAL_WRITE|GROW|SHRINK|SEAL). Returns the
// memfds, in order. kInvalidArgument for mismatched spans; kCuda naming the failed call; kIo
// for a memfd that cannot be made or sealed.
Result<std::vector<UniqueFd>> CopyDeviceToMemfds(const DriverApi* api, CUdevice device,
                                                 std::span<const int> vmm_fds,
                                                 std::span<const uint64_t> sizes,
                                                 const std::string& name,
                                                 TierCopyReport* report = nullptr);

// Promotion. A new exported arena of `sizes` on `device` (each a multiple of the device's
// granularity, as CopyDeviceToMemfds's inputs were), filled from `memfds` (borrowed, sealed,
// each at least its size). Returns the arena's exported fds (ExportedArena::ReleaseToFds).
Result<std::vector<UniqueFd>> CopyMemfdsToDevice(const DriverApi* api, CUdevice device,
                                                 std::span<const int> memfds,
                                                 std::span<const uint64_t> sizes,
                                                 TierCopyReport* report = nullptr);

}  // namespace weightcache::cuda
