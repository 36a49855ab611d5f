#include "unit/cuda/fake_driver.h"

#include <dirent.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cassert>
#include <cstdint>
#include <cstdlib>
#include <iterator>
#include <string>
#include <vector>

namespace weightcache::cuda::testing {
namespace {

FakeDriver* g_fake = nullptr;  // the installed fake; the C trampolines forward to it

CUresult GetErrorName(CUresult rc, const char** name) {
  switch (rc) {
    case CUDA_ERROR_INVALID_VALUE:
      *name = "CUDA_ERROR_INVALID_VALUE";
      break;
    case CUDA_ERROR_OUT_OF_MEMORY:
      *name = "CUDA_ERROR_OUT_OF_MEMORY";
      break;
    case CUDA_ERROR_NOT_SUPPORTED:
      *name = "CUDA_ERROR_NOT_SUPPORTED";
      break;
    case CUDA_ERROR_NOT_PERMITTED:
      *name = "CUDA_ERROR_NOT_PERMITTED";
      break;
    case CUDA_ERROR_INVALID_DEVICE:
      *name = "CUDA_ERROR_INVALID_DEVICE";
      break;
    default:
      *name = nullptr;
      return CUDA_ERROR_INVALID_VALUE;
  }
  return CUDA_SUCCESS;
}

CUresult GetErrorString(CUresult rc, const char** desc) {
  *desc = "injected by FakeDriver";
  return CUDA_SUCCESS;
}

// One trampoline per entry point: record the call, apply any injected failure, forward.
#define WC_FAKE_CALL(name, ...)                                 \
  do {                                                          \
    if (CUresult rc = g_fake->Hook(name); rc != CUDA_SUCCESS) { \
      return rc;                                                \
    }                                                           \
    return g_fake->__VA_ARGS__;                                 \
  } while (0)

CUresult FakeRetain(CUcontext* ctx, CUdevice dev) {
  WC_FAKE_CALL("cuDevicePrimaryCtxRetain", PrimaryCtxRetain(ctx, dev));
}
CUresult FakeRelease(CUdevice dev) {
  WC_FAKE_CALL("cuDevicePrimaryCtxRelease", PrimaryCtxRelease(dev));
}
CUresult FakeSetCurrent(CUcontext ctx) { WC_FAKE_CALL("cuCtxSetCurrent", CtxSetCurrent(ctx)); }
CUresult FakeGetCurrent(CUcontext* ctx) { WC_FAKE_CALL("cuCtxGetCurrent", CtxGetCurrent(ctx)); }
CUresult FakeAttribute(int* value, CUdevice_attribute attribute, CUdevice dev) {
  WC_FAKE_CALL("cuDeviceGetAttribute", DeviceGetAttribute(value, attribute, dev));
}
CUresult FakeGranularity(size_t* granularity, const CUmemAllocationProp* prop,
                         CUmemAllocationGranularity_flags) {
  WC_FAKE_CALL("cuMemGetAllocationGranularity", GetGranularity(granularity, prop));
}
CUresult FakeCreate(CUmemGenericAllocationHandle* handle, size_t size,
                    const CUmemAllocationProp* prop, unsigned long long) {
  WC_FAKE_CALL("cuMemCreate", Create(handle, size, prop));
}
CUresult FakeMemRelease(CUmemGenericAllocationHandle handle) {
  WC_FAKE_CALL("cuMemRelease", Release(handle));
}
CUresult FakeExport(void* shareable, CUmemGenericAllocationHandle handle,
                    CUmemAllocationHandleType type, unsigned long long) {
  WC_FAKE_CALL("cuMemExportToShareableHandle", Export(shareable, handle, type));
}
CUresult FakeImport(CUmemGenericAllocationHandle* handle, void* os_handle,
                    CUmemAllocationHandleType type) {
  WC_FAKE_CALL("cuMemImportFromShareableHandle", Import(handle, os_handle, type));
}
CUresult FakeReserve(CUdeviceptr* ptr, size_t size, size_t alignment, CUdeviceptr,
                     unsigned long long) {
  WC_FAKE_CALL("cuMemAddressReserve", Reserve(ptr, size, alignment));
}
CUresult FakeFree(CUdeviceptr ptr, size_t size) {
  WC_FAKE_CALL("cuMemAddressFree", Free(ptr, size));
}
CUresult FakeMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                 unsigned long long) {
  WC_FAKE_CALL("cuMemMap", Map(ptr, size, offset, handle));
}
CUresult FakeUnmap(CUdeviceptr ptr, size_t size) { WC_FAKE_CALL("cuMemUnmap", Unmap(ptr, size)); }
CUresult FakeSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc* desc, size_t count) {
  WC_FAKE_CALL("cuMemSetAccess", SetAccess(ptr, size, desc, count));
}
#undef WC_FAKE_CALL

CUcontext ContextFor(CUdevice dev) {
  return reinterpret_cast<CUcontext>(static_cast<uintptr_t>(0xc0de0000 + dev));
}

}  // namespace

FakeDriver::FakeDriver(uint64_t granularity, int device_count)
    : granularity_(granularity), device_count_(device_count) {
  assert(g_fake == nullptr && "one FakeDriver at a time");
  g_fake = this;
  api_.cuGetErrorName = GetErrorName;
  api_.cuGetErrorString = GetErrorString;
  api_.cuDevicePrimaryCtxRetain = FakeRetain;
  api_.cuDevicePrimaryCtxRelease = FakeRelease;
  api_.cuCtxSetCurrent = FakeSetCurrent;
  api_.cuCtxGetCurrent = FakeGetCurrent;
  api_.cuDeviceGetAttribute = FakeAttribute;
  api_.cuMemGetAllocationGranularity = FakeGranularity;
  api_.cuMemCreate = FakeCreate;
  api_.cuMemRelease = FakeMemRelease;
  api_.cuMemExportToShareableHandle = FakeExport;
  api_.cuMemImportFromShareableHandle = FakeImport;
  api_.cuMemAddressReserve = FakeReserve;
  api_.cuMemAddressFree = FakeFree;
  api_.cuMemMap = FakeMap;
  api_.cuMemUnmap = FakeUnmap;
  api_.cuMemSetAccess = FakeSetAccess;
}

FakeDriver::~FakeDriver() { g_fake = nullptr; }

void FakeDriver::FailCall(const std::string& function, int nth, CUresult rc) {
  failures_.push_back(Failure{function, nth, rc});
}

CUresult FakeDriver::Hook(const char* function) {
  calls_.push_back(function);
  int n = ++call_counts_[function];
  for (const Failure& f : failures_) {
    if (f.function == function && f.nth == n) return f.rc;
  }
  return CUDA_SUCCESS;
}

CUresult FakeDriver::Violation(const std::string& what) {
  violation_log_.push_back(what);
  return CUDA_ERROR_INVALID_VALUE;
}

int FakeDriver::context_refs(CUdevice device) const {
  auto it = context_refs_.find(device);
  return it == context_refs_.end() ? 0 : it->second;
}

int FakeDriver::total_context_refs() const {
  int total = 0;
  for (const auto& [dev, refs] : context_refs_) total += refs;
  return total;
}

unsigned long long FakeDriver::AccessAt(CUdeviceptr ptr, CUdevice device) const {
  auto it = mappings_.find(ptr);
  constexpr unsigned long long kNone = CU_MEM_ACCESS_FLAGS_PROT_NONE;
  if (it == mappings_.end()) return kNone;
  auto a = it->second.access.find(device);
  return a == it->second.access.end() ? kNone : a->second;
}

uint64_t FakeDriver::NewMemory(uint64_t size, CUdevice device, bool exportable) {
  uint64_t id = next_memory_++;
  memory_[id] = MemoryObject{size, device, exportable};
  return id;
}

UniqueFd FakeDriver::ForeignExport(uint64_t size, CUdevice device) {
  uint64_t id = NewMemory(size, device, /*exportable=*/true);
  UniqueFd fd(::memfd_create("fake-foreign-vmm", MFD_CLOEXEC));
  if (!fd.valid()) std::abort();
  struct stat st = {};
  if (::fstat(fd.get(), &st) != 0) std::abort();
  exports_[st.st_ino] = id;
  return fd;
}

CUresult FakeDriver::PrimaryCtxRetain(CUcontext* ctx, CUdevice dev) {
  if (dev < 0 || dev >= device_count_) return CUDA_ERROR_INVALID_DEVICE;
  ++context_refs_[dev];
  *ctx = ContextFor(dev);
  return CUDA_SUCCESS;
}

CUresult FakeDriver::PrimaryCtxRelease(CUdevice dev) {
  if (context_refs(dev) == 0) return Violation("cuDevicePrimaryCtxRelease without a retain");
  if (--context_refs_[dev] == 0) context_refs_.erase(dev);
  return CUDA_SUCCESS;
}

CUresult FakeDriver::CtxSetCurrent(CUcontext ctx) {
  current_context_ = ctx;
  return CUDA_SUCCESS;
}

CUresult FakeDriver::CtxGetCurrent(CUcontext* ctx) {
  *ctx = current_context_;
  return CUDA_SUCCESS;
}

CUresult FakeDriver::DeviceGetAttribute(int* value, CUdevice_attribute attribute, CUdevice dev) {
  if (dev < 0 || dev >= device_count_) return CUDA_ERROR_INVALID_DEVICE;
  auto it = attributes_.find(attribute);
  *value = it == attributes_.end() ? 1 : it->second;
  return CUDA_SUCCESS;
}

CUresult FakeDriver::GetGranularity(size_t* granularity, const CUmemAllocationProp* prop) {
  if (prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE || prop->location.id < 0 ||
      prop->location.id >= device_count_) {
    return CUDA_ERROR_INVALID_DEVICE;
  }
  *granularity = granularity_;
  return CUDA_SUCCESS;
}

CUresult FakeDriver::Create(CUmemGenericAllocationHandle* handle, size_t size,
                            const CUmemAllocationProp* prop) {
  last_create_prop_ = *prop;
  if (prop->type != CU_MEM_ALLOCATION_TYPE_PINNED) return Violation("cuMemCreate: not pinned");
  if (prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE) {
    return Violation("cuMemCreate: location is not a device");
  }
  if (size == 0 || size % granularity_ != 0) {
    return Violation("cuMemCreate: size " + std::to_string(size) + " not granularity-aligned");
  }
  uint64_t id = NewMemory(size, prop->location.id,
                          prop->requestedHandleTypes == CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  *handle = next_handle_++;
  handles_[*handle] = id;
  return CUDA_SUCCESS;
}

CUresult FakeDriver::Release(CUmemGenericAllocationHandle handle) {
  if (handles_.erase(handle) == 0) return Violation("cuMemRelease of an unknown handle");
  return CUDA_SUCCESS;
}

CUresult FakeDriver::Export(void* shareable, CUmemGenericAllocationHandle handle,
                            CUmemAllocationHandleType type) {
  auto it = handles_.find(handle);
  if (it == handles_.end()) return Violation("cuMemExportToShareableHandle: unknown handle");
  if (type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR || !memory_[it->second].exportable) {
    return Violation("cuMemExportToShareableHandle: not exportable as a POSIX fd");
  }
  // No MFD_CLOEXEC on purpose: the code under test must set it.
  int fd = ::memfd_create("fake-vmm-export", 0);
  if (fd < 0) std::abort();
  struct stat st = {};
  if (::fstat(fd, &st) != 0) std::abort();
  exports_[st.st_ino] = it->second;
  ++exported_fds_made_;
  *static_cast<int*>(shareable) = fd;
  return CUDA_SUCCESS;
}

CUresult FakeDriver::Import(CUmemGenericAllocationHandle* handle, void* os_handle,
                            CUmemAllocationHandleType type) {
  if (type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) {
    return Violation("cuMemImportFromShareableHandle: not a POSIX fd");
  }
  int fd = static_cast<int>(reinterpret_cast<uintptr_t>(os_handle));
  struct stat st = {};
  if (::fstat(fd, &st) != 0) return CUDA_ERROR_INVALID_VALUE;
  auto it = exports_.find(st.st_ino);
  if (it == exports_.end()) return CUDA_ERROR_INVALID_VALUE;  // not a VMM export
  *handle = next_handle_++;
  handles_[*handle] = it->second;
  return CUDA_SUCCESS;
}

CUresult FakeDriver::Reserve(CUdeviceptr* ptr, size_t size, size_t alignment) {
  if (size == 0 || size % granularity_ != 0) {
    return Violation("cuMemAddressReserve: size not granularity-aligned");
  }
  uint64_t align = alignment == 0 ? granularity_ : alignment;
  CUdeviceptr base = (next_va_ + align - 1) & ~(align - 1);
  next_va_ = base + size + granularity_;  // a guard gap, so adjacent ranges never touch
  reservations_[base] = size;
  *ptr = base;
  return CUDA_SUCCESS;
}

CUresult FakeDriver::Free(CUdeviceptr ptr, size_t size) {
  auto it = reservations_.find(ptr);
  if (it == reservations_.end() || it->second != size) {
    return Violation("cuMemAddressFree of a range that was not reserved");
  }
  auto m = mappings_.lower_bound(ptr);
  if (m != mappings_.end() && m->first < ptr + size) {
    return Violation("cuMemAddressFree while mappings are live in the range");
  }
  reservations_.erase(it);
  return CUDA_SUCCESS;
}

CUresult FakeDriver::Map(CUdeviceptr ptr, size_t size, size_t offset,
                         CUmemGenericAllocationHandle handle) {
  auto h = handles_.find(handle);
  if (h == handles_.end()) return Violation("cuMemMap of an unknown handle");
  if (offset != 0) return Violation("cuMemMap with a non-zero offset");
  if (ptr % granularity_ != 0 || size == 0 || size % granularity_ != 0) {
    return Violation("cuMemMap: ptr or size not granularity-aligned");
  }
  if (size > memory_[h->second].size) return CUDA_ERROR_INVALID_VALUE;  // larger than the memory
  auto r = reservations_.upper_bound(ptr);
  if (r == reservations_.begin()) return Violation("cuMemMap outside any reservation");
  --r;
  if (ptr + size > r->first + r->second) return Violation("cuMemMap outside any reservation");
  auto next = mappings_.lower_bound(ptr);
  if (next != mappings_.end() && next->first < ptr + size) {
    return Violation("cuMemMap over an existing mapping");
  }
  if (next != mappings_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second.size > ptr) return Violation("cuMemMap over a mapping");
  }
  mappings_[ptr] = Mapping{size, h->second, {}};
  return CUDA_SUCCESS;
}

CUresult FakeDriver::Unmap(CUdeviceptr ptr, size_t size) {
  auto it = mappings_.find(ptr);
  if (it == mappings_.end() || it->second.size != size) {
    return Violation("cuMemUnmap of a range that is not exactly one mapping");
  }
  mappings_.erase(it);
  return CUDA_SUCCESS;
}

CUresult FakeDriver::SetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc* desc,
                               size_t count) {
  // The range must be fully mapped: walk the mappings from ptr, contiguously.
  std::vector<Mapping*> covered;
  CUdeviceptr at = ptr;
  while (at < ptr + size) {
    auto it = mappings_.find(at);
    if (it == mappings_.end()) return Violation("cuMemSetAccess over an unmapped range");
    covered.push_back(&it->second);
    at += it->second.size;
  }
  if (at != ptr + size) return Violation("cuMemSetAccess ends inside a mapping");
  for (size_t i = 0; i < count; ++i) {
    if (desc[i].location.type != CU_MEM_LOCATION_TYPE_DEVICE || desc[i].location.id < 0 ||
        desc[i].location.id >= device_count_) {
      return CUDA_ERROR_INVALID_DEVICE;
    }
  }
  for (Mapping* m : covered) {
    for (size_t i = 0; i < count; ++i) m->access[desc[i].location.id] = desc[i].flags;
  }
  return CUDA_SUCCESS;
}

int CountOpenFds() {
  DIR* dir = ::opendir("/proc/self/fd");
  if (dir == nullptr) std::abort();
  int n = 0;
  while (const dirent* e = ::readdir(dir)) {
    if (e->d_name[0] != '.') ++n;
  }
  ::closedir(dir);
  return n - 1;  // the directory's own fd
}

}  // namespace weightcache::cuda::testing
