// PlanArena — where each tensor of a shard lives inside an arena: the gpu tier's VMM allocations
// (at the device's VMM granularity) and the host tier's memfds (at the page size). Pure function:
// no driver, no I/O, thread-safe.
//
// Tensors are packed in the given order into a FEW large allocations so that attaching costs
// O(allocations), not O(tensors) (docs/design.md "Tiers"): each allocation is filled up to
// `max_allocation_bytes`; a tensor larger than that gets an allocation of its own. Every
// tensor starts on a kTensorAlignment boundary (what CUDA kernels and cuBLAS expect of
// cudaMalloc'ed memory), and every allocation size is a multiple of the VMM granularity,
// which is what cuMemCreate and cuMemMap require.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "common/align.h"

namespace weightcache::checkpoint {

inline constexpr uint64_t kTensorAlignment = 256;
// An attach pays per allocation, mostly in cuMemSetAccess: on an H200 (attach_bench steps,
// docs/benchmarks.md) importing 16 GiB took 0.67 ms as 5 allocations of <= 4 GiB, 0.47-0.52 ms
// as 2 of <= 16 GiB and 1.3-1.4 ms as 10-17 of <= 1 GiB. 16 GiB keeps a 140 GB shard at 9
// allocations; the arena is created before the upload, all or nothing, so a larger
// allocation risks nothing a smaller one would not.
inline constexpr uint64_t kDefaultMaxAllocationBytes = uint64_t{16} << 30;

struct TensorPlacement {
  uint32_t allocation = 0;  // index into ArenaPlan::allocation_bytes
  uint64_t offset = 0;      // bytes from the start of that allocation, kTensorAlignment-aligned
  uint64_t bytes = 0;       // the tensor's size, as given

  friend bool operator==(const TensorPlacement&, const TensorPlacement&) = default;
};

struct ArenaPlan {
  std::vector<uint64_t> allocation_bytes;   // each a non-zero multiple of the granularity
  std::vector<TensorPlacement> placements;  // one per input tensor, same order
  uint64_t total_bytes = 0;                 // sum of allocation_bytes
};

// Preconditions (checked by the callers that own the untrusted input — the checkpoint parser
// bounds every tensor by its file size): `granularity` is a power of two (VMM granularities
// are), and the sum of the tensor sizes plus padding fits in 63 bits. `max_allocation_bytes`
// of 0 means kDefaultMaxAllocationBytes. Zero-byte tensors get a valid, aligned placement.
// No tensors means no allocations.
ArenaPlan PlanArena(std::span<const uint64_t> tensor_bytes, uint64_t granularity,
                    uint64_t max_allocation_bytes = kDefaultMaxAllocationBytes);

}  // namespace weightcache::checkpoint
