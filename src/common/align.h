// AlignUp, AlignDown — the one rounding rule for sizes and offsets (arena layout, VMM granularity,
// O_DIRECT blocks). Pure, constexpr.
#pragma once

#include <cstdint>

namespace weightcache {

// Round `value` up to a multiple of `alignment` (a power of two). The caller keeps `value`
// at least `alignment` below 2^64.
constexpr uint64_t AlignUp(uint64_t value, uint64_t alignment) {
  return (value + alignment - 1) & ~(alignment - 1);
}

// Round `value` down to a multiple of `alignment` (any non-zero value).
constexpr uint64_t AlignDown(uint64_t value, uint64_t alignment) {
  return value / alignment * alignment;
}

}  // namespace weightcache
