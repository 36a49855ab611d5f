// Tensor checksums computed on the GPU, over device memory, with the embedded per-chunk XXH64
// kernel (kernels/checksum.cu). The values equal TensorChecksum() (cuda/checksum.h) over the
// same bytes; that is what `attach --verify` and `weightcache verify` compare against the
// checksums recorded at load time.
//
// Contract:
//  * Every call needs the CUDA context that owns the memory to be current on the calling
//    thread. A ChecksumKernel loads its module into that context and is only valid there.
//  * Without the kernel (built with WEIGHTCACHE_BUILD_KERNELS=OFF or without nvcc), Create and
//    GpuTensorChecksums return kUnavailable; GpuChecksumKernelBuilt() says so up front.
//  * A ChecksumKernel is move-only and owns its module (unloaded on destruction). Checksums()
//    is synchronous: it returns after the stream has finished the work, so the device memory
//    it read may be released right afterwards. Thread-safe for concurrent calls (the module
//    and function are read-only; each call allocates its own scratch).
#pragma once

#include <cuda.h>

#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "common/unique_handle.h"
#include "cuda/driver_api.h"
#include "weightcache/status.h"

namespace weightcache::cuda {

struct DeviceRange {
  CUdeviceptr ptr = 0;
  uint64_t size = 0;  // bytes; an empty range is allowed (its checksum needs no GPU work)
};

// True when this build embeds the kernel image.
bool GpuChecksumKernelBuilt();

// A loaded module, unloaded with cuModuleUnload.
struct ModuleTraits {
  using Handle = CUmodule;
  using Context = const DriverApi*;
  static constexpr Handle Null() { return nullptr; }
  static void Close(const DriverApi* api, CUmodule module) noexcept;
};

class ChecksumKernel {
 public:
  static Result<ChecksumKernel> Create(const DriverApi* api);

  // One checksum per range, in order. One kernel launch for all ranges. Uses a small device
  // scratch allocation (24 bytes per range + 8 bytes per chunk).
  Result<std::vector<uint64_t>> Checksums(CUstream stream,
                                          std::span<const DeviceRange> ranges) const;

  // The chunk hashes of every range, concatenated in order (ChecksumChunkCount(size) each):
  // lets a verifier name the first differing chunk, not only the tensor.
  Result<std::vector<uint64_t>> ChunkHashes(CUstream stream,
                                            std::span<const DeviceRange> ranges) const;

 private:
  ChecksumKernel(UniqueHandle<ModuleTraits> module, CUfunction function)
      : module_(std::move(module)), function_(function) {}

  UniqueHandle<ModuleTraits> module_;
  CUfunction function_ = nullptr;  // belongs to module_
};

// Loads the kernel, computes, unloads: for one-off verification. A caller verifying often
// should keep a ChecksumKernel.
Result<std::vector<uint64_t>> GpuTensorChecksums(const DriverApi* api, CUstream stream,
                                                 std::span<const DeviceRange> ranges);

}  // namespace weightcache::cuda
