// The per-chunk XXH64 kernel behind GpuTensorChecksums (cuda/checksum_gpu.h). Compiled by nvcc
// to a fatbin (sm_80, sm_90 SASS + compute_90 PTX) that is embedded in the library and loaded
// through the driver API, so nothing links the CUDA runtime.
//
// One thread per chunk. XXH64 is sequential inside a chunk, so the parallelism is across
// chunks (a 16 GiB model has 65,536 chunks of 256 KiB). Coalescing across a warp is
// impossible — neighbouring threads read addresses a chunk apart — so each thread instead
// reads whole 128-byte lines with eight 128-bit loads in flight: every DRAM sector fetched is
// fully used, and the loads in flight per SM hide the memory latency.
#include "cuda/kernels/checksum_abi.h"
#include "cuda/kernels/xxh64_core.h"

namespace wc = weightcache::cuda;

extern "C" __global__ void __launch_bounds__(wc::kernels::kChunkXxh64BlockThreads)
    weightcache_chunk_xxh64(const wc::kernels::ChecksumRange* __restrict__ ranges,
                            uint32_t num_ranges, uint64_t total_chunks, uint64_t chunk_bytes,
                            uint64_t seed, uint64_t* __restrict__ chunk_hashes) {
  const uint64_t chunk = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (chunk >= total_chunks) return;

  // The range holding this chunk: the last one whose first_chunk <= chunk.
  uint32_t lo = 0;
  uint32_t hi = num_ranges;  // invariant: ranges[lo].first_chunk <= chunk < ranges[hi].first_chunk
  while (hi - lo > 1) {
    const uint32_t mid = lo + (hi - lo) / 2;
    if (ranges[mid].first_chunk <= chunk) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  const wc::kernels::ChecksumRange range = ranges[lo];
  const uint64_t offset = (chunk - range.first_chunk) * chunk_bytes;
  const uint64_t remaining = range.size - offset;
  const uint64_t len = remaining < chunk_bytes ? remaining : chunk_bytes;
  const uint8_t* p = reinterpret_cast<const uint8_t*>(range.ptr + offset);

  uint64_t h;
  if ((reinterpret_cast<uintptr_t>(p) & 15) == 0) {
    h = wc::xxh64::Hash<wc::xxh64::Access::kVector16>(p, len, seed);
  } else {
    // A misaligned tensor (an odd offset inside a packed buffer): correct, just slower.
    h = wc::xxh64::Hash<wc::xxh64::Access::kBytewise>(p, len, seed);
  }
  chunk_hashes[chunk] = h;
}
