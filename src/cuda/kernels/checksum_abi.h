// The launch interface of the checksum kernel, shared by kernels/checksum.cu (nvcc) and the
// host launcher cuda/checksum_gpu.cc, which passes these through cuLaunchKernel. Changing a
// field or a parameter here changes both sides at once.
#pragma once

#include <stdint.h>

namespace weightcache::cuda::kernels {

// The kernel's symbol in the embedded module (extern "C": no mangling to depend on).
inline constexpr const char kChunkXxh64Kernel[] = "weightcache_chunk_xxh64";
inline constexpr unsigned kChunkXxh64BlockThreads = 128;

// One non-empty device range. Chunk `first_chunk + i` of the flattened chunk list is chunk i
// of this range. Ranges are sorted by first_chunk (the launcher builds them in order).
struct ChecksumRange {
  uint64_t ptr;          // CUdeviceptr of the range's first byte
  uint64_t size;         // bytes, > 0
  uint64_t first_chunk;  // index of its first chunk in the output array
};
static_assert(sizeof(ChecksumRange) == 24, "host and device must agree on the layout");

// Kernel parameters, in order:
//   const ChecksumRange* ranges, uint32_t num_ranges, uint64_t total_chunks,
//   uint64_t chunk_bytes, uint64_t seed, uint64_t* chunk_hashes (total_chunks entries)

}  // namespace weightcache::cuda::kernels
