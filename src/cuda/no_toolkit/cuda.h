// The stand-in for the CUDA toolkit's cuda.h in a build without the gpu tier
// (WEIGHTCACHE_GPU=OFF, or AUTO on a machine without the CUDA toolkit headers; CMakeLists.txt).
// On the include path only in such a build, it declares the driver API's types, constants and
// prototypes that the code names, so that every module compiles unchanged; no driver function
// is ever called: the driver table (src/cuda/driver_api.cc) refuses to load in this build, so
// every gpu-tier call fails there with kUnavailable ("gpu tier not built: ..."). Nothing else
// may include it, and it declares only what the code uses.
#pragma once

#include <cstddef>
#include <cstdint>

extern "C" {

using cuuint64_t = std::uint64_t;
using CUdeviceptr = unsigned long long;  // NOLINT(google-runtime-int): the driver's own type.
using CUdevice = int;
using CUmemGenericAllocationHandle = unsigned long long;  // NOLINT(google-runtime-int)
using CUcontext = struct CUctx_st*;
using CUstream = struct CUstream_st*;
using CUevent = struct CUevent_st*;
using CUmodule = struct CUmod_st*;
using CUfunction = struct CUfunc_st*;
using CUarray = struct CUarray_st*;

enum CUresult { CUDA_SUCCESS = 0, CUDA_ERROR_NOT_SUPPORTED = 801 };

struct CUuuid {
  char bytes[16];
};
struct CUipcMemHandle {
  char reserved[64];
};

enum CUdevice_attribute {
  CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102,
  CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED = 103,
  CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED = 113,
};
enum CUmemAllocationType { CU_MEM_ALLOCATION_TYPE_PINNED = 1 };
enum CUmemAllocationHandleType { CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1 };
enum CUmemLocationType { CU_MEM_LOCATION_TYPE_DEVICE = 1 };
enum CUmemAccess_flags { CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3 };
enum CUmemAllocationGranularity_flags {
  CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0,
  CU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 1,
};
enum CUmemorytype { CU_MEMORYTYPE_HOST = 1, CU_MEMORYTYPE_DEVICE = 2 };
enum CUpointer_attribute { CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9 };
enum CUdriverProcAddressQueryResult { CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND = 1 };
enum CUdriverProcAddress_flags { CU_GET_PROC_ADDRESS_DEFAULT = 0 };
enum CUstream_flags { CU_STREAM_NON_BLOCKING = 1 };
enum CUevent_flags { CU_EVENT_DISABLE_TIMING = 2 };
enum CUmemhostregister_flags { CU_MEMHOSTREGISTER_PORTABLE = 1, CU_MEMHOSTREGISTER_READ_ONLY = 8 };

struct CUmemLocation {
  CUmemLocationType type;
  int id;
};
struct CUmemAllocationProp {
  CUmemAllocationType type;
  CUmemAllocationHandleType requestedHandleTypes;
  CUmemLocation location;
  void* win32HandleMetaData;
  struct {
    unsigned char compressionType;
    unsigned char gpuDirectRDMACapable;
    unsigned short usage;  // NOLINT(google-runtime-int)
    unsigned char reserved[4];
  } allocFlags;
};
struct CUmemAccessDesc {
  CUmemLocation location;
  CUmemAccess_flags flags;
};
struct CUDA_MEMCPY2D {
  size_t srcXInBytes, srcY;
  CUmemorytype srcMemoryType;
  const void* srcHost;
  CUdeviceptr srcDevice;
  CUarray srcArray;
  size_t srcPitch;
  size_t dstXInBytes, dstY;
  CUmemorytype dstMemoryType;
  void* dstHost;
  CUdeviceptr dstDevice;
  CUarray dstArray;
  size_t dstPitch;
  size_t WidthInBytes;
  size_t Height;
};

// Prototypes only (DriverApi takes decltype of each); none has a definition in this build.
CUresult cuInit(unsigned int flags);
CUresult cuDriverGetVersion(int* version);
CUresult cuGetErrorName(CUresult error, const char** str);
CUresult cuGetErrorString(CUresult error, const char** str);
CUresult cuDeviceGet(CUdevice* device, int ordinal);
CUresult cuDeviceGetCount(int* count);
CUresult cuDeviceGetName(char* name, int len, CUdevice dev);
CUresult cuDeviceGetUuid(CUuuid* uuid, CUdevice dev);
CUresult cuDeviceTotalMem(size_t* bytes, CUdevice dev);
CUresult cuDeviceGetAttribute(int* value, CUdevice_attribute attrib, CUdevice dev);
CUresult cuDeviceGetPCIBusId(char* bus_id, int len, CUdevice dev);
CUresult cuDeviceCanAccessPeer(int* can_access, CUdevice dev, CUdevice peer);
CUresult cuDevicePrimaryCtxRetain(CUcontext* ctx, CUdevice dev);
CUresult cuDevicePrimaryCtxRelease(CUdevice dev);
CUresult cuCtxSetCurrent(CUcontext ctx);
CUresult cuCtxGetCurrent(CUcontext* ctx);
CUresult cuCtxGetDevice(CUdevice* device);
CUresult cuCtxSynchronize();
CUresult cuMemGetInfo(size_t* free, size_t* total);
CUresult cuMemAlloc(CUdeviceptr* ptr, size_t bytes);
CUresult cuMemFree(CUdeviceptr ptr);
CUresult cuMemGetAllocationGranularity(size_t* granularity, const CUmemAllocationProp* prop,
                                       CUmemAllocationGranularity_flags option);
CUresult cuMemCreate(CUmemGenericAllocationHandle* handle, size_t size,
                     const CUmemAllocationProp* prop, unsigned long long flags);  // NOLINT
CUresult cuMemRelease(CUmemGenericAllocationHandle handle);
CUresult cuMemExportToShareableHandle(void* shareable, CUmemGenericAllocationHandle handle,
                                      CUmemAllocationHandleType type,
                                      unsigned long long flags);  // NOLINT
CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle* handle, void* os_handle,
                                        CUmemAllocationHandleType type);
CUresult cuMemAddressReserve(CUdeviceptr* ptr, size_t size, size_t alignment, CUdeviceptr addr,
                             unsigned long long flags);  // NOLINT
CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size);
CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                  unsigned long long flags);  // NOLINT
CUresult cuMemUnmap(CUdeviceptr ptr, size_t size);
CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc* desc, size_t count);
CUresult cuMemGetAccess(unsigned long long* flags, const CUmemLocation* location,  // NOLINT
                        CUdeviceptr ptr);
CUresult cuPointerGetAttribute(void* data, CUpointer_attribute attribute, CUdeviceptr ptr);
CUresult cuMemHostAlloc(void** ptr, size_t bytes, unsigned int flags);
CUresult cuMemFreeHost(void* ptr);
CUresult cuMemHostRegister(void* ptr, size_t bytes, unsigned int flags);
CUresult cuMemHostUnregister(void* ptr);
CUresult cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t bytes);
CUresult cuMemcpyHtoD(CUdeviceptr dst, const void* src, size_t bytes);
CUresult cuMemcpyDtoH(void* dst, CUdeviceptr src, size_t bytes);
CUresult cuMemcpyHtoDAsync(CUdeviceptr dst, const void* src, size_t bytes, CUstream stream);
CUresult cuMemcpy2DAsync(const CUDA_MEMCPY2D* copy, CUstream stream);
CUresult cuMemcpyDtoHAsync(void* dst, CUdeviceptr src, size_t bytes, CUstream stream);
CUresult cuMemcpyDtoDAsync(CUdeviceptr dst, CUdeviceptr src, size_t bytes, CUstream stream);
CUresult cuMemcpyPeerAsync(CUdeviceptr dst, CUcontext dst_ctx, CUdeviceptr src, CUcontext src_ctx,
                           size_t bytes, CUstream stream);
CUresult cuMemsetD8(CUdeviceptr dst, unsigned char value, size_t count);
CUresult cuStreamCreate(CUstream* stream, unsigned int flags);
CUresult cuStreamDestroy(CUstream stream);
CUresult cuStreamSynchronize(CUstream stream);
CUresult cuEventCreate(CUevent* event, unsigned int flags);
CUresult cuEventRecord(CUevent event, CUstream stream);
CUresult cuEventSynchronize(CUevent event);
CUresult cuEventQuery(CUevent event);
CUresult cuEventElapsedTime(float* ms, CUevent start, CUevent end);
CUresult cuEventDestroy(CUevent event);
CUresult cuModuleLoadData(CUmodule* module, const void* image);
CUresult cuModuleUnload(CUmodule module);
CUresult cuModuleGetFunction(CUfunction* function, CUmodule module, const char* name);
CUresult cuLaunchKernel(CUfunction f, unsigned int grid_x, unsigned int grid_y, unsigned int grid_z,
                        unsigned int block_x, unsigned int block_y, unsigned int block_z,
                        unsigned int shared_bytes, CUstream stream, void** params, void** extra);
CUresult cuIpcGetMemHandle(CUipcMemHandle* handle, CUdeviceptr ptr);
CUresult cuIpcOpenMemHandle(CUdeviceptr* ptr, CUipcMemHandle handle, unsigned int flags);
CUresult cuIpcCloseMemHandle(CUdeviceptr ptr);

}  // extern "C"
