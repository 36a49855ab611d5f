#include "cuda/vmm.h"

#include <fcntl.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <utility>

#include "common/logging.h"

namespace weightcache::cuda {
namespace {

std::string Bytes(uint64_t n) { return std::to_string(n) + " bytes"; }

}  // namespace

CUmemAllocationProp ArenaAllocationProp(CUdevice device) {
  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  return prop;
}

Result<uint64_t> AllocationGranularity(const DriverApi* api, CUdevice device,
                                       CUmemAllocationGranularity_flags option) {
  CUmemAllocationProp prop = ArenaAllocationProp(device);
  size_t granularity = 0;
  WEIGHTCACHE_CU_RETURN_IF_ERROR(
      api, cuMemGetAllocationGranularity(&granularity, &prop, option),
      "cuMemGetAllocationGranularity(device " + std::to_string(device) + ")");
  if (granularity == 0 || (granularity & (granularity - 1)) != 0) {
    return InternalError("cuMemGetAllocationGranularity(device " + std::to_string(device) +
                         ") returned " + std::to_string(granularity) + ", not a power of two");
  }
  return static_cast<uint64_t>(granularity);
}

std::string HexPtr(CUdeviceptr ptr) {
  char buf[24];
  std::snprintf(buf, sizeof(buf), "0x%llx", static_cast<unsigned long long>(ptr));
  return buf;
}

// ---- context guards --------------------------------------------------------------------------

CallerContextGuard::CallerContextGuard(const DriverApi* api) : api_(api) {
  if (api_->cuCtxGetCurrent(&saved_) != CUDA_SUCCESS) saved_ = nullptr;
}

CallerContextGuard::~CallerContextGuard() {
  if (saved_ == nullptr) return;
  CUcontext now = nullptr;
  if (api_->cuCtxGetCurrent(&now) == CUDA_SUCCESS && now != saved_) {
    if (CUresult rc = api_->cuCtxSetCurrent(saved_); rc != CUDA_SUCCESS) {
      LOG_WARN << DriverError(api_, rc, "restoring the caller's CUDA context").ToString();
    }
  }
}

ScopedCurrentContext::ScopedCurrentContext(const DriverApi* api, CUcontext context) : api_(api) {
  if (api_->cuCtxGetCurrent(&saved_) != CUDA_SUCCESS) saved_ = nullptr;
  if (saved_ != context && api_->cuCtxSetCurrent(context) == CUDA_SUCCESS) switched_ = true;
}

ScopedCurrentContext::~ScopedCurrentContext() {
  if (!switched_) return;
  if (CUresult rc = api_->cuCtxSetCurrent(saved_); rc != CUDA_SUCCESS) {
    LOG_WARN << DriverError(api_, rc, "restoring the previous CUDA context").ToString();
  }
}

// ---- PrimaryContext ----------------------------------------------------------------------------

Result<PrimaryContext> PrimaryContext::Retain(const DriverApi* api, CUdevice device) {
  CUcontext context = nullptr;
  WEIGHTCACHE_CU_RETURN_IF_ERROR(api, cuDevicePrimaryCtxRetain(&context, device),
                                 "cuDevicePrimaryCtxRetain(device " + std::to_string(device) + ")");
  PrimaryContext retained(api, device, context);  // released by its destructor on error below
  WEIGHTCACHE_RETURN_IF_ERROR(retained.MakeCurrent());
  return retained;
}

void PrimaryContextTraits::Close(const DriverApi* api, const Handle& h) noexcept {
  if (CUresult rc = api->cuDevicePrimaryCtxRelease(h.device); rc != CUDA_SUCCESS) {
    LogReleaseFailure(api, rc,
                      "cuDevicePrimaryCtxRelease(device " + std::to_string(h.device) + ")");
  }
}

Status PrimaryContext::MakeCurrent() const {
  WEIGHTCACHE_CU_RETURN_IF_ERROR(
      api(), cuCtxSetCurrent(get()),
      "cuCtxSetCurrent(primary context of device " + std::to_string(device()) + ")");
  return Status::Ok();
}

// ---- VmmHandle ---------------------------------------------------------------------------------

Result<VmmHandle> VmmHandle::Create(const DriverApi* api, uint64_t size,
                                    const CUmemAllocationProp& prop) {
  CUmemGenericAllocationHandle handle = 0;
  WEIGHTCACHE_CU_RETURN_IF_ERROR(
      api, cuMemCreate(&handle, size, &prop, 0),
      "cuMemCreate(" + Bytes(size) + " on device " + std::to_string(prop.location.id) + ")");
  return VmmHandle(api, handle, size);
}

Result<VmmHandle> VmmHandle::ImportPosixFd(const DriverApi* api, int fd, uint64_t size) {
  CUmemGenericAllocationHandle handle = 0;
  // For POSIX fds the "OS handle" is the fd number itself, passed by value in the pointer.
  void* os_handle = reinterpret_cast<void*>(static_cast<uintptr_t>(fd));
  WEIGHTCACHE_CU_RETURN_IF_ERROR(
      api,
      cuMemImportFromShareableHandle(&handle, os_handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
      "cuMemImportFromShareableHandle(fd " + std::to_string(fd) + ")");
  return VmmHandle(api, handle, size);
}

void VmmHandleTraits::Close(const DriverApi* api, const Handle& h) noexcept {
  if (CUresult rc = api->cuMemRelease(h.handle); rc != CUDA_SUCCESS) {
    LogReleaseFailure(api, rc, "cuMemRelease(" + Bytes(h.size) + ")");
  }
}

Result<UniqueFd> VmmHandle::ExportPosixFd() const {
  int raw = -1;
  WEIGHTCACHE_CU_RETURN_IF_ERROR(
      owned_.context(),
      cuMemExportToShareableHandle(&raw, get(), CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
      "cuMemExportToShareableHandle(" + Bytes(size()) + ", POSIX fd)");
  UniqueFd fd(raw);
  // The driver does not promise CLOEXEC; an fd leaked into an exec'd child would keep the
  // whole allocation alive for that child's lifetime.
  int flags = ::fcntl(fd.get(), F_GETFD);
  if (flags < 0 || ::fcntl(fd.get(), F_SETFD, flags | FD_CLOEXEC) < 0) {
    return IoError("setting FD_CLOEXEC on exported VMM fd " + std::to_string(fd.get()), errno);
  }
  return fd;
}

// ---- VaRange -----------------------------------------------------------------------------------

Result<VaRange> VaRange::Reserve(const DriverApi* api, uint64_t size, uint64_t alignment) {
  CUdeviceptr base = 0;
  WEIGHTCACHE_CU_RETURN_IF_ERROR(
      api, cuMemAddressReserve(&base, size, alignment, 0, 0),
      "cuMemAddressReserve(" + Bytes(size) + ", alignment " + std::to_string(alignment) + ")");
  return VaRange(api, base, size);
}

void VaRangeTraits::Close(const DriverApi* api, const Handle& h) noexcept {
  if (CUresult rc = api->cuMemAddressFree(h.base, h.size); rc != CUDA_SUCCESS) {
    LogReleaseFailure(api, rc, "cuMemAddressFree(" + HexPtr(h.base) + ", " + Bytes(h.size) + ")");
  }
}

// ---- MappedRange -------------------------------------------------------------------------------

Result<MappedRange> MappedRange::Map(const DriverApi* api, CUdeviceptr ptr,
                                     const VmmHandle& handle) {
  return Map(api, ptr, handle.get(), handle.size());
}

Result<MappedRange> MappedRange::Map(const DriverApi* api, CUdeviceptr ptr,
                                     CUmemGenericAllocationHandle handle, uint64_t size) {
  WEIGHTCACHE_CU_RETURN_IF_ERROR(api, cuMemMap(ptr, size, 0, handle, 0),
                                 "cuMemMap(" + HexPtr(ptr) + ", " + Bytes(size) + ")");
  return MappedRange(api, ptr, size);
}

void MappedRangeTraits::Close(const DriverApi* api, const Handle& h) noexcept {
  if (CUresult rc = api->cuMemUnmap(h.ptr, h.size); rc != CUDA_SUCCESS) {
    LogReleaseFailure(api, rc, "cuMemUnmap(" + HexPtr(h.ptr) + ", " + Bytes(h.size) + ")");
  }
}

Status MappedRange::SetAccess(CUdevice device, CUmemAccess_flags flags) const {
  CUmemAccessDesc desc = {};
  desc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  desc.location.id = device;
  desc.flags = flags;
  WEIGHTCACHE_CU_RETURN_IF_ERROR(owned_.context(), cuMemSetAccess(ptr(), size(), &desc, 1),
                                 "cuMemSetAccess(" + HexPtr(ptr()) + ", " + Bytes(size()) +
                                     ", device " + std::to_string(device) + ")");
  return Status::Ok();
}

std::string AllocationName(size_t index, size_t count) {
  return "allocation " + std::to_string(index) + " of " + std::to_string(count);
}

}  // namespace weightcache::cuda
