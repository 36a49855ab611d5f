#include "checkpoint/arena_plan.h"

#include <algorithm>
#include <cassert>

namespace weightcache::checkpoint {

ArenaPlan PlanArena(std::span<const uint64_t> tensor_bytes, uint64_t granularity,
                    uint64_t max_allocation_bytes) {
  assert(granularity != 0 && (granularity & (granularity - 1)) == 0);
  if (max_allocation_bytes == 0) max_allocation_bytes = kDefaultMaxAllocationBytes;
  // An allocation is never smaller than one granule, and tensors inside it stay aligned to
  // the larger of the two alignments' common multiple (both are powers of two).
  const uint64_t alloc_align = std::max(granularity, kTensorAlignment);

  ArenaPlan plan;
  plan.placements.reserve(tensor_bytes.size());
  uint64_t used = 0;  // bytes used in the open allocation
  bool open = false;  // whether an allocation is being filled
  auto close_open = [&] {
    if (!open) return;
    plan.allocation_bytes.push_back(std::max(AlignUp(used, alloc_align), alloc_align));
    plan.total_bytes += plan.allocation_bytes.back();
    used = 0;
    open = false;
  };

  for (uint64_t bytes : tensor_bytes) {
    uint64_t offset = AlignUp(used, kTensorAlignment);
    // Start a new allocation when this tensor would overflow a non-empty one. An empty
    // allocation takes any tensor, so an oversize tensor ends up alone.
    if (open && used > 0 && offset + bytes > max_allocation_bytes) {
      close_open();
      offset = 0;
    }
    open = true;
    plan.placements.push_back(
        TensorPlacement{.allocation = static_cast<uint32_t>(plan.allocation_bytes.size()),
                        .offset = offset,
                        .bytes = bytes});
    used = offset + bytes;
    if (used >= max_allocation_bytes) close_open();  // an oversize tensor stays alone
  }
  close_open();
  return plan;
}

}  // namespace weightcache::checkpoint
