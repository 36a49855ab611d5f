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

// Destructors cannot report: say what leaked and carry on releasing the rest.
void WarnOnRelease(const DriverApi* api, CUresult rc, const std::string& what) {
  if (rc == CUDA_SUCCESS) return;
  LOG_WARN << "releasing CUDA resource failed, continuing: "
           << DriverError(api, rc, what).message();
}

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

PrimaryContext::PrimaryContext(PrimaryContext&& other) noexcept
    : api_(std::exchange(other.api_, nullptr)),
      device_(other.device_),
      context_(std::exchange(other.context_, nullptr)) {}

PrimaryContext& PrimaryContext::operator=(PrimaryContext&& other) noexcept {
  if (this != &other) {
    Reset();
    api_ = std::exchange(other.api_, nullptr);
    device_ = other.device_;
    context_ = std::exchange(other.context_, nullptr);
  }
  return *this;
}

PrimaryContext::~PrimaryContext() { Reset(); }

void PrimaryContext::Reset() {
  if (api_ == nullptr) return;
  WarnOnRelease(api_, api_->cuDevicePrimaryCtxRelease(device_),
                "cuDevicePrimaryCtxRelease(device " + std::to_string(device_) + ")");
  api_ = nullptr;
  context_ = nullptr;
}

Status PrimaryContext::MakeCurrent() const {
  WEIGHTCACHE_CU_RETURN_IF_ERROR(
      api_, cuCtxSetCurrent(context_),
      "cuCtxSetCurrent(primary context of device " + std::to_string(device_) + ")");
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

VmmHandle::VmmHandle(VmmHandle&& other) noexcept
    : api_(std::exchange(other.api_, nullptr)),
      handle_(std::exchange(other.handle_, 0)),
      size_(std::exchange(other.size_, 0)) {}

VmmHandle& VmmHandle::operator=(VmmHandle&& other) noexcept {
  if (this != &other) {
    Reset();
    api_ = std::exchange(other.api_, nullptr);
    handle_ = std::exchange(other.handle_, 0);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

VmmHandle::~VmmHandle() { Reset(); }

void VmmHandle::Reset() {
  if (api_ == nullptr) return;
  WarnOnRelease(api_, api_->cuMemRelease(handle_), "cuMemRelease(" + Bytes(size_) + ")");
  api_ = nullptr;
  handle_ = 0;
  size_ = 0;
}

Result<UniqueFd> VmmHandle::ExportPosixFd() const {
  int raw = -1;
  WEIGHTCACHE_CU_RETURN_IF_ERROR(
      api_,
      cuMemExportToShareableHandle(&raw, handle_, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
      "cuMemExportToShareableHandle(" + Bytes(size_) + ", POSIX fd)");
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

VaRange::VaRange(VaRange&& other) noexcept
    : api_(std::exchange(other.api_, nullptr)),
      base_(std::exchange(other.base_, 0)),
      size_(std::exchange(other.size_, 0)) {}

VaRange& VaRange::operator=(VaRange&& other) noexcept {
  if (this != &other) {
    Reset();
    api_ = std::exchange(other.api_, nullptr);
    base_ = std::exchange(other.base_, 0);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

VaRange::~VaRange() { Reset(); }

void VaRange::Reset() {
  if (api_ == nullptr) return;
  WarnOnRelease(api_, api_->cuMemAddressFree(base_, size_),
                "cuMemAddressFree(" + HexPtr(base_) + ", " + Bytes(size_) + ")");
  api_ = nullptr;
  base_ = 0;
  size_ = 0;
}

// ---- MappedRange -------------------------------------------------------------------------------

Result<MappedRange> MappedRange::Map(const DriverApi* api, CUdeviceptr ptr,
                                     const VmmHandle& handle) {
  WEIGHTCACHE_CU_RETURN_IF_ERROR(api, cuMemMap(ptr, handle.size(), 0, handle.get(), 0),
                                 "cuMemMap(" + HexPtr(ptr) + ", " + Bytes(handle.size()) + ")");
  return MappedRange(api, ptr, handle.size());
}

MappedRange::MappedRange(MappedRange&& other) noexcept
    : api_(std::exchange(other.api_, nullptr)),
      ptr_(std::exchange(other.ptr_, 0)),
      size_(std::exchange(other.size_, 0)) {}

MappedRange& MappedRange::operator=(MappedRange&& other) noexcept {
  if (this != &other) {
    Reset();
    api_ = std::exchange(other.api_, nullptr);
    ptr_ = std::exchange(other.ptr_, 0);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

MappedRange::~MappedRange() { Reset(); }

void MappedRange::Reset() {
  if (api_ == nullptr) return;
  WarnOnRelease(api_, api_->cuMemUnmap(ptr_, size_),
                "cuMemUnmap(" + HexPtr(ptr_) + ", " + Bytes(size_) + ")");
  api_ = nullptr;
  ptr_ = 0;
  size_ = 0;
}

Status MappedRange::SetAccess(CUdevice device, CUmemAccess_flags flags) const {
  CUmemAccessDesc desc = {};
  desc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  desc.location.id = device;
  desc.flags = flags;
  WEIGHTCACHE_CU_RETURN_IF_ERROR(api_, cuMemSetAccess(ptr_, size_, &desc, 1),
                                 "cuMemSetAccess(" + HexPtr(ptr_) + ", " + Bytes(size_) +
                                     ", device " + std::to_string(device) + ")");
  return Status::Ok();
}

}  // namespace weightcache::cuda
