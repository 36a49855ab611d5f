#include "cuda/checksum_gpu.h"

#include <limits>
#include <string>
#include <utility>

#include "common/checksum.h"
#include "common/hash.h"
#include "cuda/kernels/checksum_abi.h"

namespace weightcache::cuda {
namespace kernels {
// Defined in the generated checksum_fatbin.cc (kernels/embed_fatbin.cmake).
extern const unsigned char kChecksumFatbin[];
extern const size_t kChecksumFatbinSize;
}  // namespace kernels

namespace {

// The kernel's scratch: the range table followed by the chunk-hash output. One allocation
// per call, freed (cuMemFree) on every path.
struct DeviceMemoryTraits {
  using Handle = CUdeviceptr;
  using Context = const DriverApi*;
  static constexpr Handle Null() { return 0; }
  static void Close(const DriverApi* api, CUdeviceptr p) noexcept {
    if (CUresult rc = api->cuMemFree(p); rc != CUDA_SUCCESS) {
      LogReleaseFailure(api, rc, "cuMemFree of checksum scratch");
    }
  }
};
using DeviceScratch = UniqueHandle<DeviceMemoryTraits>;

Result<DeviceScratch> AllocateScratch(const DriverApi* api, size_t bytes) {
  CUdeviceptr ptr = 0;
  WEIGHTCACHE_CU_RETURN_IF_ERROR(
      api, cuMemAlloc(&ptr, bytes),
      "cuMemAlloc of " + std::to_string(bytes) + " bytes of checksum scratch");
  return DeviceScratch(api, ptr);
}

}  // namespace

bool GpuChecksumKernelBuilt() { return kernels::kChecksumFatbinSize > 0; }

Result<ChecksumKernel> ChecksumKernel::Create(const DriverApi* api) {
  if (!GpuChecksumKernelBuilt()) {
    return Status(StatusCode::kUnavailable,
                  "GPU checksum kernel not built into this binary (configure with "
                  "-DWEIGHTCACHE_BUILD_KERNELS=ON and nvcc on PATH)");
  }
  CUmodule module = nullptr;
  WEIGHTCACHE_CU_RETURN_IF_ERROR(api, cuModuleLoadData(&module, kernels::kChecksumFatbin),
                                 "cuModuleLoadData of the embedded checksum kernel");
  UniqueHandle<ModuleTraits> owned(api, module);  // unloaded on the error path too
  CUfunction function = nullptr;
  WEIGHTCACHE_CU_RETURN_IF_ERROR(
      api, cuModuleGetFunction(&function, module, kernels::kChunkXxh64Kernel),
      std::string("cuModuleGetFunction(") + kernels::kChunkXxh64Kernel + ")");
  return ChecksumKernel(std::move(owned), function);
}

void ModuleTraits::Close(const DriverApi* api, CUmodule module) noexcept {
  if (CUresult rc = api->cuModuleUnload(module); rc != CUDA_SUCCESS) {
    LogReleaseFailure(api, rc, "cuModuleUnload of the checksum kernel");
  }
}

Result<std::vector<uint64_t>> ChecksumKernel::ChunkHashes(
    CUstream stream, std::span<const DeviceRange> ranges) const {
  const DriverApi* api = module_.context();
  std::vector<kernels::ChecksumRange> table;
  table.reserve(ranges.size());
  uint64_t total_chunks = 0;
  for (const DeviceRange& r : ranges) {
    if (r.size == 0) continue;  // no chunks: nothing for the kernel to do
    if (r.ptr == 0) return InvalidArgument("checksum of a null device range");
    table.push_back({r.ptr, r.size, total_chunks});
    total_chunks += ChecksumChunkCount(r.size);
  }
  std::vector<uint64_t> hashes(total_chunks);
  if (total_chunks == 0) return hashes;
  if (table.size() > std::numeric_limits<uint32_t>::max()) {
    return InvalidArgument("checksum of more than 2^32 ranges in one call");
  }
  const uint64_t blocks =
      (total_chunks + kernels::kChunkXxh64BlockThreads - 1) / kernels::kChunkXxh64BlockThreads;
  if (blocks > std::numeric_limits<int32_t>::max()) {
    return InvalidArgument("checksum of more than 2^31 blocks of chunks in one call");
  }

  const size_t table_bytes = table.size() * sizeof(kernels::ChecksumRange);
  const size_t out_offset = (table_bytes + 255) / 256 * 256;
  const size_t out_bytes = hashes.size() * sizeof(uint64_t);
  WEIGHTCACHE_ASSIGN_OR_RETURN(DeviceScratch scratch, AllocateScratch(api, out_offset + out_bytes));
  CUdeviceptr d_ranges = scratch.get();
  CUdeviceptr d_out = scratch.get() + out_offset;
  WEIGHTCACHE_CU_RETURN_IF_ERROR(api,
                                 cuMemcpyHtoDAsync(d_ranges, table.data(), table_bytes, stream),
                                 "copying the checksum range table to the device");

  auto num_ranges = static_cast<uint32_t>(table.size());
  uint64_t chunk_bytes = kChecksumChunkBytes;
  uint64_t seed = kChecksumSeed;
  void* params[] = {&d_ranges, &num_ranges, &total_chunks, &chunk_bytes, &seed, &d_out};
  CUresult rc =
      api->cuLaunchKernel(function_, static_cast<unsigned>(blocks), 1, 1,
                          kernels::kChunkXxh64BlockThreads, 1, 1, 0, stream, params, nullptr);
  if (rc != CUDA_SUCCESS) {
    // The table copy may still be reading `table`; finish it before the vector goes away.
    api->cuStreamSynchronize(stream);
    return DriverError(api, rc,
                       "cuLaunchKernel(checksum) over " + std::to_string(total_chunks) +
                           " chunks in " + std::to_string(table.size()) + " ranges");
  }
  rc = api->cuMemcpyDtoHAsync(hashes.data(), d_out, out_bytes, stream);
  CUresult sync_rc = api->cuStreamSynchronize(stream);
  if (rc != CUDA_SUCCESS) return DriverError(api, rc, "copying the chunk hashes to the host");
  if (sync_rc != CUDA_SUCCESS) {
    // The copy into `hashes` may still be queued behind whatever failed: synchronize once more
    // (it returns at once on a broken context) before the vector goes away.
    api->cuStreamSynchronize(stream);
    // A kernel fault (an invalid range) surfaces here, as CUDA_ERROR_ILLEGAL_ADDRESS.
    return DriverError(api, sync_rc,
                       "checksum kernel over " + std::to_string(table.size()) + " device ranges");
  }
  return hashes;
}

Result<std::vector<uint64_t>> ChecksumKernel::Checksums(CUstream stream,
                                                        std::span<const DeviceRange> ranges) const {
  WEIGHTCACHE_ASSIGN_OR_RETURN(std::vector<uint64_t> hashes, ChunkHashes(stream, ranges));
  std::vector<uint64_t> checksums;
  checksums.reserve(ranges.size());
  size_t next = 0;
  for (const DeviceRange& r : ranges) {
    const uint64_t n = ChecksumChunkCount(r.size);
    checksums.push_back(CombineChunkHashes(std::span<const uint64_t>(hashes).subspan(next, n)));
    next += n;
  }
  return checksums;
}

Result<std::vector<uint64_t>> GpuTensorChecksums(const DriverApi* api, CUstream stream,
                                                 std::span<const DeviceRange> ranges) {
  WEIGHTCACHE_ASSIGN_OR_RETURN(ChecksumKernel kernel, ChecksumKernel::Create(api));
  return kernel.Checksums(stream, ranges);
}

}  // namespace weightcache::cuda
