// DriverApi — the one seam for CUDA. Every driver call in the project goes through a table of
// function pointers. The real table is filled at run time by dlopen("libcuda.so.1") and
// cuGetProcAddress, so one binary runs on hosts without a driver (LoadDriver() then returns
// kUnavailable with a clear message). Tests fill a table with fakes that fail at step N.
//
// Thread-safety: the table is immutable once loaded; LoadDriver() is safe to call from any
// thread and returns the same process-wide table every time.
#pragma once

#include <cuda.h>

#include <string>
#include <string_view>

#include "weightcache/status.h"

namespace weightcache::cuda {

// X-macro list: (member name, driver symbol base name). The member's type is the prototype
// from cuda.h, which maps versioned names (cuMemcpyHtoDAsync → _v2, cuDeviceGetUuid → _v2).
#define WEIGHTCACHE_CUDA_DRIVER_FUNCTIONS(X) \
  X(cuInit)                                  \
  X(cuDriverGetVersion)                      \
  X(cuGetErrorName)                          \
  X(cuGetErrorString)                        \
  X(cuDeviceGet)                             \
  X(cuDeviceGetCount)                        \
  X(cuDeviceGetName)                         \
  X(cuDeviceGetUuid)                         \
  X(cuDeviceTotalMem)                        \
  X(cuDeviceGetAttribute)                    \
  X(cuDeviceGetPCIBusId)                     \
  X(cuDeviceCanAccessPeer)                   \
  X(cuDevicePrimaryCtxRetain)                \
  X(cuDevicePrimaryCtxRelease)               \
  X(cuCtxSetCurrent)                         \
  X(cuCtxGetCurrent)                         \
  X(cuCtxGetDevice)                          \
  X(cuCtxSynchronize)                        \
  X(cuMemGetInfo)                            \
  X(cuMemAlloc)                              \
  X(cuMemFree)                               \
  X(cuMemGetAllocationGranularity)           \
  X(cuMemCreate)                             \
  X(cuMemRelease)                            \
  X(cuMemExportToShareableHandle)            \
  X(cuMemImportFromShareableHandle)          \
  X(cuMemAddressReserve)                     \
  X(cuMemAddressFree)                        \
  X(cuMemMap)                                \
  X(cuMemUnmap)                              \
  X(cuMemSetAccess)                          \
  X(cuMemGetAccess)                          \
  X(cuPointerGetAttribute)                   \
  X(cuMemHostAlloc)                          \
  X(cuMemFreeHost)                           \
  X(cuMemHostRegister)                       \
  X(cuMemHostUnregister)                     \
  X(cuMemcpy)                                \
  X(cuMemcpyHtoD)                            \
  X(cuMemcpyDtoH)                            \
  X(cuMemcpyHtoDAsync)                       \
  X(cuMemcpy2DAsync)                         \
  X(cuMemcpyDtoHAsync)                       \
  X(cuMemcpyDtoDAsync)                       \
  X(cuMemcpyPeerAsync)                       \
  X(cuMemsetD8)                              \
  X(cuStreamCreate)                          \
  X(cuStreamDestroy)                         \
  X(cuStreamSynchronize)                     \
  X(cuEventCreate)                           \
  X(cuEventRecord)                           \
  X(cuEventSynchronize)                      \
  X(cuEventQuery)                            \
  X(cuEventElapsedTime)                      \
  X(cuEventDestroy)                          \
  X(cuModuleLoadData)                        \
  X(cuModuleUnload)                          \
  X(cuModuleGetFunction)                     \
  X(cuLaunchKernel)                          \
  X(cuIpcGetMemHandle)                       \
  X(cuIpcOpenMemHandle)                      \
  X(cuIpcCloseMemHandle)

struct DriverApi {
  // NOLINTNEXTLINE(bugprone-macro-parentheses): `name` is declared, it cannot be parenthesised.
#define WEIGHTCACHE_DECLARE_MEMBER_(name) decltype(&::name) name = nullptr;
  WEIGHTCACHE_CUDA_DRIVER_FUNCTIONS(WEIGHTCACHE_DECLARE_MEMBER_)
#undef WEIGHTCACHE_DECLARE_MEMBER_
};

// The real driver, loaded once per process. kUnavailable (with the dlopen error) when
// libcuda.so.1 is absent; kCuda when cuInit fails (no device, driver/library mismatch).
// Never returns a partially filled table.
Result<const DriverApi*> LoadDriver();

// A Status for a failed driver call: "<what>: <CUDA_ERROR_NAME> (<description>)", code kCuda,
// with the CUresult attached. `api` may be null (then only the number is printed).
Status DriverError(const DriverApi* api, CUresult rc, std::string_view what);

// For release calls in destructors, which cannot report: logs (LOG_WARN) the failed `what` and
// returns, so the caller carries on releasing the rest.
void LogReleaseFailure(const DriverApi* api, CUresult rc, std::string_view what);

}  // namespace weightcache::cuda

// Call a driver function through `api`, returning a Status from the enclosing function on error.
#define WEIGHTCACHE_CU_RETURN_IF_ERROR(api, call, what)                  \
  do {                                                                   \
    CUresult wc_cu_rc_ = (api)->call;                                    \
    if (wc_cu_rc_ != CUDA_SUCCESS) {                                     \
      return ::weightcache::cuda::DriverError((api), wc_cu_rc_, (what)); \
    }                                                                    \
  } while (0)
