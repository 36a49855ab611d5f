#include "unit/cuda/fake_driver.h"

#include <dirent.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cassert>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <string>
#include <vector>

#include "cuda/kernels/checksum_abi.h"
#include "cuda/kernels/xxh64_core.h"

namespace weightcache::cuda::testing {
namespace {

FakeDriver* g_fake = nullptr;  // the installed fake; the C trampolines forward to it

// One fake function handle: what cuModuleGetFunction hands out for the checksum kernel.
CUfunction FakeFunction() { return reinterpret_cast<CUfunction>(uintptr_t{0xF00D}); }

const char* ErrorName(CUresult rc) {
  switch (rc) {
    case CUDA_SUCCESS:
      return "CUDA_SUCCESS";
    case CUDA_ERROR_INVALID_VALUE:
      return "CUDA_ERROR_INVALID_VALUE";
    case CUDA_ERROR_OUT_OF_MEMORY:
      return "CUDA_ERROR_OUT_OF_MEMORY";
    case CUDA_ERROR_NOT_SUPPORTED:
      return "CUDA_ERROR_NOT_SUPPORTED";
    case CUDA_ERROR_NOT_PERMITTED:
      return "CUDA_ERROR_NOT_PERMITTED";
    case CUDA_ERROR_INVALID_DEVICE:
      return "CUDA_ERROR_INVALID_DEVICE";
    case CUDA_ERROR_UNKNOWN:
      return "CUDA_ERROR_UNKNOWN";
    case CUDA_ERROR_LAUNCH_FAILED:
      return "CUDA_ERROR_LAUNCH_FAILED";
    case CUDA_ERROR_ILLEGAL_ADDRESS:
      return "CUDA_ERROR_ILLEGAL_ADDRESS";
    case CUDA_ERROR_INVALID_IMAGE:
      return "CUDA_ERROR_INVALID_IMAGE";
    case CUDA_ERROR_NOT_FOUND:
      return "CUDA_ERROR_NOT_FOUND";
    case CUDA_ERROR_INVALID_HANDLE:
      return "CUDA_ERROR_INVALID_HANDLE";
    case CUDA_ERROR_INVALID_CONTEXT:
      return "CUDA_ERROR_INVALID_CONTEXT";
    default:
      return nullptr;
  }
}

// Record the call, apply any injected failure.
#define WC_HOOK(name)                              \
  do {                                             \
    CUresult hook_rc_ = g_fake->Hook(name);        \
    if (hook_rc_ != CUDA_SUCCESS) return hook_rc_; \
  } while (0)

}  // namespace

CUcontext FakeDriver::ContextOf(CUdevice device) {
  return reinterpret_cast<CUcontext>(static_cast<uintptr_t>(0xc0de0000 + device));
}

CUdevice FakeDriver::DeviceOf(CUcontext context) {
  return static_cast<CUdevice>(reinterpret_cast<uintptr_t>(context) - 0xc0de0000);
}

CUuuid FakeDriver::UuidOf(CUdevice device) {
  CUuuid uuid{};
  for (size_t i = 0; i < sizeof(uuid.bytes); ++i) uuid.bytes[i] = static_cast<char>(0x10 + i);
  uuid.bytes[15] = static_cast<char>(device);
  return uuid;
}

FakeDriver::FakeDriver(uint64_t granularity, int device_count)
    : granularity_(granularity), device_count_(device_count) {
  assert(g_fake == nullptr && "one FakeDriver at a time");
  g_fake = this;
  streams_[nullptr];  // the legacy default stream always exists
  api_.cuGetErrorName = [](CUresult rc, const char** s) -> CUresult {
    *s = ErrorName(rc);
    return *s != nullptr ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
  };
  api_.cuGetErrorString = [](CUresult rc, const char** s) -> CUresult {
    *s = ErrorName(rc) != nullptr ? "injected by FakeDriver" : nullptr;
    return *s != nullptr ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
  };
  // Contexts and devices.
  api_.cuDevicePrimaryCtxRetain = [](CUcontext* ctx, CUdevice dev) -> CUresult {
    WC_HOOK("cuDevicePrimaryCtxRetain");
    return g_fake->PrimaryCtxRetain(ctx, dev);
  };
  api_.cuDevicePrimaryCtxRelease = [](CUdevice dev) -> CUresult {
    WC_HOOK("cuDevicePrimaryCtxRelease");
    return g_fake->PrimaryCtxRelease(dev);
  };
  api_.cuCtxSetCurrent = [](CUcontext ctx) -> CUresult {
    WC_HOOK("cuCtxSetCurrent");
    return g_fake->CtxSetCurrent(ctx);
  };
  api_.cuCtxGetCurrent = [](CUcontext* ctx) -> CUresult {
    WC_HOOK("cuCtxGetCurrent");
    return g_fake->CtxGetCurrent(ctx);
  };
  api_.cuCtxGetDevice = [](CUdevice* dev) -> CUresult {
    WC_HOOK("cuCtxGetDevice");
    return g_fake->CtxGetDevice(dev);
  };
  api_.cuDeviceGetCount = [](int* count) -> CUresult {
    WC_HOOK("cuDeviceGetCount");
    *count = g_fake->device_count_;
    return CUDA_SUCCESS;
  };
  api_.cuDeviceGet = [](CUdevice* dev, int ordinal) -> CUresult {
    WC_HOOK("cuDeviceGet");
    if (ordinal < 0 || ordinal >= g_fake->device_count_) return CUDA_ERROR_INVALID_DEVICE;
    *dev = ordinal;
    return CUDA_SUCCESS;
  };
  api_.cuDeviceCanAccessPeer = [](int* can, CUdevice dev, CUdevice peer) -> CUresult {
    WC_HOOK("cuDeviceCanAccessPeer");
    return g_fake->CanAccessPeer(can, dev, peer);
  };
  api_.cuDeviceGetUuid = [](CUuuid* uuid, CUdevice dev) -> CUresult {
    WC_HOOK("cuDeviceGetUuid");
    if (dev < 0 || dev >= g_fake->device_count_) return CUDA_ERROR_INVALID_DEVICE;
    *uuid = UuidOf(dev);
    return CUDA_SUCCESS;
  };
  api_.cuDeviceGetName = [](char* name, int length, CUdevice dev) -> CUresult {
    WC_HOOK("cuDeviceGetName");
    if (dev < 0 || dev >= g_fake->device_count_) return CUDA_ERROR_INVALID_DEVICE;
    std::snprintf(name, static_cast<size_t>(length), "Fake GPU %d", dev);
    return CUDA_SUCCESS;
  };
  api_.cuDeviceTotalMem = [](size_t* bytes, CUdevice dev) -> CUresult {
    WC_HOOK("cuDeviceTotalMem");
    if (dev < 0 || dev >= g_fake->device_count_) return CUDA_ERROR_INVALID_DEVICE;
    *bytes = size_t{80} << 30;
    return CUDA_SUCCESS;
  };
  api_.cuDeviceGetPCIBusId = [](char* bus, int length, CUdevice dev) -> CUresult {
    WC_HOOK("cuDeviceGetPCIBusId");
    if (dev < 0 || dev >= g_fake->device_count_) return CUDA_ERROR_INVALID_DEVICE;
    std::snprintf(bus, static_cast<size_t>(length), "0000:%02x:00.0", 0x10 + dev);
    return CUDA_SUCCESS;
  };
  api_.cuDeviceGetAttribute = [](int* value, CUdevice_attribute attribute,
                                 CUdevice dev) -> CUresult {
    WC_HOOK("cuDeviceGetAttribute");
    return g_fake->DeviceGetAttribute(value, attribute, dev);
  };
  // VMM.
  api_.cuMemGetAllocationGranularity = [](size_t* granularity, const CUmemAllocationProp* prop,
                                          CUmemAllocationGranularity_flags) -> CUresult {
    WC_HOOK("cuMemGetAllocationGranularity");
    return g_fake->GetGranularity(granularity, prop);
  };
  api_.cuMemCreate = [](CUmemGenericAllocationHandle* handle, size_t size,
                        const CUmemAllocationProp* prop, unsigned long long) -> CUresult {
    WC_HOOK("cuMemCreate");
    return g_fake->Create(handle, size, prop);
  };
  api_.cuMemRelease = [](CUmemGenericAllocationHandle handle) -> CUresult {
    WC_HOOK("cuMemRelease");
    return g_fake->Release(handle);
  };
  api_.cuMemExportToShareableHandle = [](void* shareable, CUmemGenericAllocationHandle handle,
                                         CUmemAllocationHandleType type,
                                         unsigned long long) -> CUresult {
    WC_HOOK("cuMemExportToShareableHandle");
    return g_fake->Export(shareable, handle, type);
  };
  api_.cuMemImportFromShareableHandle = [](CUmemGenericAllocationHandle* handle, void* os_handle,
                                           CUmemAllocationHandleType type) -> CUresult {
    WC_HOOK("cuMemImportFromShareableHandle");
    return g_fake->Import(handle, os_handle, type);
  };
  api_.cuMemAddressReserve = [](CUdeviceptr* ptr, size_t size, size_t alignment, CUdeviceptr,
                                unsigned long long) -> CUresult {
    WC_HOOK("cuMemAddressReserve");
    return g_fake->Reserve(ptr, size, alignment);
  };
  api_.cuMemAddressFree = [](CUdeviceptr ptr, size_t size) -> CUresult {
    WC_HOOK("cuMemAddressFree");
    return g_fake->Free(ptr, size);
  };
  api_.cuMemMap = [](CUdeviceptr ptr, size_t size, size_t offset,
                     CUmemGenericAllocationHandle handle, unsigned long long) -> CUresult {
    WC_HOOK("cuMemMap");
    return g_fake->Map(ptr, size, offset, handle);
  };
  api_.cuMemUnmap = [](CUdeviceptr ptr, size_t size) -> CUresult {
    WC_HOOK("cuMemUnmap");
    return g_fake->Unmap(ptr, size);
  };
  api_.cuMemSetAccess = [](CUdeviceptr ptr, size_t size, const CUmemAccessDesc* desc,
                           size_t count) -> CUresult {
    WC_HOOK("cuMemSetAccess");
    return g_fake->SetAccess(ptr, size, desc, count);
  };
  // Memory-backed allocations.
  api_.cuMemHostAlloc = [](void** p, size_t bytes, unsigned int) -> CUresult {
    WC_HOOK("cuMemHostAlloc");
    return g_fake->HostAlloc(p, bytes);
  };
  api_.cuMemFreeHost = [](void* p) -> CUresult {
    WC_HOOK("cuMemFreeHost");
    return g_fake->FreeHost(p);
  };
  api_.cuMemHostRegister = [](void* p, size_t bytes, unsigned int) -> CUresult {
    WC_HOOK("cuMemHostRegister");
    return g_fake->HostRegister(p, bytes);
  };
  api_.cuMemHostUnregister = [](void* p) -> CUresult {
    WC_HOOK("cuMemHostUnregister");
    return g_fake->HostUnregister(p);
  };
  api_.cuMemAlloc = [](CUdeviceptr* p, size_t bytes) -> CUresult {
    WC_HOOK("cuMemAlloc");
    return g_fake->MemAlloc(p, bytes);
  };
  api_.cuMemFree = [](CUdeviceptr p) -> CUresult {
    WC_HOOK("cuMemFree");
    return g_fake->MemFree(p);
  };
  // Streams, events, copies.
  api_.cuStreamCreate = [](CUstream* s, unsigned int) -> CUresult {
    WC_HOOK("cuStreamCreate");
    return g_fake->StreamCreate(s);
  };
  api_.cuStreamDestroy = [](CUstream s) -> CUresult {
    WC_HOOK("cuStreamDestroy");
    return g_fake->StreamDestroy(s);
  };
  // What the code under test queued on the legacy default stream (its synchronous copies and
  // memsets run at once in the fake; named streams are synchronized by their own calls).
  api_.cuCtxSynchronize = []() -> CUresult {
    WC_HOOK("cuCtxSynchronize");
    return g_fake->StreamSynchronize(nullptr);
  };
  api_.cuStreamSynchronize = [](CUstream s) -> CUresult {
    WC_HOOK("cuStreamSynchronize");
    return g_fake->StreamSynchronize(s);
  };
  api_.cuEventCreate = [](CUevent* e, unsigned int) -> CUresult {
    WC_HOOK("cuEventCreate");
    return g_fake->EventCreate(e);
  };
  api_.cuEventDestroy = [](CUevent e) -> CUresult {
    WC_HOOK("cuEventDestroy");
    return g_fake->EventDestroy(e);
  };
  api_.cuEventRecord = [](CUevent e, CUstream s) -> CUresult {
    WC_HOOK("cuEventRecord");
    return g_fake->EventRecord(e, s);
  };
  api_.cuEventSynchronize = [](CUevent e) -> CUresult {
    WC_HOOK("cuEventSynchronize");
    return g_fake->EventSynchronize(e);
  };
  api_.cuMemcpyHtoDAsync = [](CUdeviceptr dst, const void* src, size_t n, CUstream s) -> CUresult {
    WC_HOOK("cuMemcpyHtoDAsync");
    return g_fake->MemcpyAsync(reinterpret_cast<void*>(dst), src, n, s);
  };
  // A 2D copy, host to device only (what the upload's mapped path issues): one queued copy per
  // row, so ordering and the reads of the source are checked as for any copy.
  api_.cuMemcpy2DAsync = [](const CUDA_MEMCPY2D* m, CUstream s) -> CUresult {
    WC_HOOK("cuMemcpy2DAsync");
    if (m == nullptr || m->srcMemoryType != CU_MEMORYTYPE_HOST ||
        m->dstMemoryType != CU_MEMORYTYPE_DEVICE || m->srcXInBytes != 0 || m->srcY != 0 ||
        m->dstXInBytes != 0 || m->dstY != 0 || m->WidthInBytes > m->srcPitch ||
        m->WidthInBytes > m->dstPitch) {
      return CUDA_ERROR_INVALID_VALUE;
    }
    for (size_t r = 0; r < m->Height; ++r) {
      const CUresult rc = g_fake->MemcpyAsync(
          reinterpret_cast<void*>(m->dstDevice + r * m->dstPitch),
          static_cast<const char*>(m->srcHost) + r * m->srcPitch, m->WidthInBytes, s);
      if (rc != CUDA_SUCCESS) return rc;
    }
    return CUDA_SUCCESS;
  };
  api_.cuMemcpyDtoHAsync = [](void* dst, CUdeviceptr src, size_t n, CUstream s) -> CUresult {
    WC_HOOK("cuMemcpyDtoHAsync");
    return g_fake->MemcpyAsync(dst, reinterpret_cast<const void*>(src), n, s);
  };
  api_.cuMemcpyDtoDAsync = [](CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s) -> CUresult {
    WC_HOOK("cuMemcpyDtoDAsync");
    return g_fake->MemcpyDtoDAsync(dst, src, n, s);
  };
  // A synchronous copy: queued on the legacy default stream, then run with everything before it.
  api_.cuMemcpyHtoD = [](CUdeviceptr dst, const void* src, size_t n) -> CUresult {
    WC_HOOK("cuMemcpyHtoD");
    const CUresult rc = g_fake->MemcpyAsync(reinterpret_cast<void*>(dst), src, n, nullptr);
    return rc != CUDA_SUCCESS ? rc : g_fake->StreamSynchronize(nullptr);
  };
  api_.cuMemcpyDtoH = [](void* dst, CUdeviceptr src, size_t n) -> CUresult {
    WC_HOOK("cuMemcpyDtoH");
    const CUresult rc = g_fake->MemcpyAsync(dst, reinterpret_cast<const void*>(src), n, nullptr);
    return rc != CUDA_SUCCESS ? rc : g_fake->StreamSynchronize(nullptr);
  };
  // A memset as a synchronous copy of `n` bytes of `value` (backed memory takes them).
  api_.cuMemsetD8 = [](CUdeviceptr dst, unsigned char value, size_t n) -> CUresult {
    WC_HOOK("cuMemsetD8");
    const std::vector<unsigned char> bytes(n, value);
    const CUresult rc = g_fake->MemcpyAsync(reinterpret_cast<void*>(dst), bytes.data(), n, nullptr);
    return rc != CUDA_SUCCESS ? rc : g_fake->StreamSynchronize(nullptr);
  };
  // The unified-addressing copy (a published tensor from any pointer): as cuMemcpyHtoD, the
  // source being host memory in the fake.
  api_.cuMemcpy = [](CUdeviceptr dst, CUdeviceptr src, size_t n) -> CUresult {
    WC_HOOK("cuMemcpy");
    const CUresult rc = g_fake->MemcpyAsync(reinterpret_cast<void*>(dst),
                                            reinterpret_cast<const void*>(src), n, nullptr);
    return rc != CUDA_SUCCESS ? rc : g_fake->StreamSynchronize(nullptr);
  };
  // Modules and kernels.
  api_.cuModuleLoadData = [](CUmodule* m, const void* image) -> CUresult {
    WC_HOOK("cuModuleLoadData");
    return g_fake->ModuleLoadData(m, image);
  };
  api_.cuModuleUnload = [](CUmodule m) -> CUresult {
    WC_HOOK("cuModuleUnload");
    return g_fake->ModuleUnload(m);
  };
  api_.cuModuleGetFunction = [](CUfunction* f, CUmodule m, const char* name) -> CUresult {
    WC_HOOK("cuModuleGetFunction");
    return g_fake->ModuleGetFunction(f, m, name);
  };
  api_.cuLaunchKernel = [](CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                           unsigned by, unsigned bz, unsigned, CUstream s, void** params,
                           void**) -> CUresult {
    WC_HOOK("cuLaunchKernel");
    if (gy != 1 || gz != 1 || by != 1 || bz != 1) return CUDA_ERROR_INVALID_VALUE;
    return g_fake->LaunchKernel(f, gx, bx, s, params);
  };
}

FakeDriver::~FakeDriver() {
  for (const auto& [p, size] : host_buffers_) std::free(p);
  for (CUdeviceptr p : device_allocs_) std::free(reinterpret_cast<void*>(p));
  g_fake = nullptr;
}

#undef WC_HOOK

void FakeDriver::FailCall(const std::string& function, int nth, CUresult rc) {
  std::lock_guard<std::mutex> lock(mu_);
  failures_.push_back(Failure{function, nth, rc});
}

void FakeDriver::FailStep(int step, CUresult rc) {
  std::lock_guard<std::mutex> lock(mu_);
  fail_step_ = step;
  fail_step_rc_ = rc;
}

int FakeDriver::steps() const {
  std::lock_guard<std::mutex> lock(mu_);
  return steps_;
}

void FakeDriver::SetAttribute(CUdevice_attribute attribute, int value) {
  std::lock_guard<std::mutex> lock(mu_);
  attributes_[attribute] = value;
}

void FakeDriver::SetMaxQueued(size_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  max_queued_ = n;
}

void FakeDriver::BeforeCall(const std::string& function, std::function<void()> hook) {
  std::lock_guard<std::mutex> lock(mu_);
  before_call_[function] = std::move(hook);
}

CUresult FakeDriver::Hook(const char* function) {
  std::function<void()> before;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto it = before_call_.find(function); it != before_call_.end()) before = it->second;
  }
  if (before) before();
  std::lock_guard<std::mutex> lock(mu_);
  calls_.emplace_back(function);
  if (++steps_ == fail_step_) return fail_step_rc_;
  const int n = ++call_counts_[function];
  for (const Failure& f : failures_) {
    if (f.function == function && f.nth == n) return f.rc;
  }
  return CUDA_SUCCESS;
}

int FakeDriver::CallCount(const std::string& function) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = call_counts_.find(function);
  return it == call_counts_.end() ? 0 : it->second;
}

void FakeDriver::ClearCalls() {
  std::lock_guard<std::mutex> lock(mu_);
  calls_.clear();
}

CUresult FakeDriver::Violation(const std::string& what) {
  violation_log_.push_back(what);
  return CUDA_ERROR_INVALID_VALUE;
}

// ---- live state --------------------------------------------------------------------------------

#define WC_LOCKED_COUNT(method, expr)      \
  int FakeDriver::method() const {         \
    std::lock_guard<std::mutex> lock(mu_); \
    return static_cast<int>(expr);         \
  }
WC_LOCKED_COUNT(live_handles, handles_.size())
WC_LOCKED_COUNT(live_reservations, reservations_.size())
WC_LOCKED_COUNT(live_mappings, mappings_.size())
WC_LOCKED_COUNT(exported_fds_made, exported_fds_made_)
WC_LOCKED_COUNT(violations, violation_log_.size())
WC_LOCKED_COUNT(live_host_buffers, host_buffers_.size())
WC_LOCKED_COUNT(live_host_registrations, host_registrations_.size())

void FakeDriver::ClearHostRegistrations() {
  std::lock_guard<std::mutex> lock(mu_);
  host_registrations_.clear();
}
WC_LOCKED_COUNT(live_streams, streams_.size() - 1)  // minus the default stream
WC_LOCKED_COUNT(live_events, events_.size())
WC_LOCKED_COUNT(live_device_allocs, device_allocs_.size())
WC_LOCKED_COUNT(loaded_modules, modules_.size())
#undef WC_LOCKED_COUNT

int FakeDriver::context_refs(CUdevice device) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = context_refs_.find(device);
  return it == context_refs_.end() ? 0 : it->second;
}

int FakeDriver::total_context_refs() const {
  std::lock_guard<std::mutex> lock(mu_);
  int total = 0;
  for (const auto& [dev, refs] : context_refs_) total += refs;
  return total;
}

CUcontext FakeDriver::current_context() const {
  std::lock_guard<std::mutex> lock(mu_);
  return current_context_;
}

void FakeDriver::set_current_context(CUcontext ctx) {
  std::lock_guard<std::mutex> lock(mu_);
  current_context_ = ctx;
}

unsigned long long FakeDriver::AccessAt(CUdeviceptr ptr, CUdevice device) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = mappings_.find(ptr);
  constexpr unsigned long long kNone = CU_MEM_ACCESS_FLAGS_PROT_NONE;
  if (it == mappings_.end()) return kNone;
  auto a = it->second.access.find(device);
  return a == it->second.access.end() ? kNone : a->second;
}

bool FakeDriver::MappingExportable(CUdeviceptr ptr) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = mappings_.find(ptr);
  return it != mappings_.end() && it->second.exportable;
}

CUmemAllocationProp FakeDriver::last_create_prop() const {
  std::lock_guard<std::mutex> lock(mu_);
  return last_create_prop_;
}

size_t FakeDriver::pending_copies() const {
  std::lock_guard<std::mutex> lock(mu_);
  size_t n = 0;
  for (const auto& [handle, s] : streams_) n += s.queue.size();
  return n;
}

uint64_t FakeDriver::launched_chunks() const {
  std::lock_guard<std::mutex> lock(mu_);
  return launched_chunks_;
}

// ---- VMM ---------------------------------------------------------------------------------------

uint64_t FakeDriver::NewMemory(uint64_t size, CUdevice device, bool exportable) {
  uint64_t id = next_memory_++;
  memory_[id] = MemoryObject{size, device, exportable, {}};
  if (back_vmm_) memory_[id].bytes.resize(size);
  return id;
}

UniqueFd FakeDriver::ForeignExport(uint64_t size, CUdevice device) {
  std::lock_guard<std::mutex> lock(mu_);
  uint64_t id = NewMemory(size, device, /*exportable=*/true);
  UniqueFd fd(::memfd_create("fake-foreign-vmm", MFD_CLOEXEC));
  if (!fd.valid()) std::abort();
  struct stat st = {};
  if (::fstat(fd.get(), &st) != 0) std::abort();
  exports_[st.st_ino] = id;
  return fd;
}

void FakeDriver::BackVmmMemory() {
  std::lock_guard<std::mutex> lock(mu_);
  back_vmm_ = true;
}

std::string FakeDriver::ExportedBytes(int fd, uint64_t offset, uint64_t length) const {
  std::lock_guard<std::mutex> lock(mu_);
  struct stat st = {};
  if (::fstat(fd, &st) != 0) return "";
  auto e = exports_.find(st.st_ino);
  if (e == exports_.end()) return "";
  const std::vector<uint8_t>& bytes = memory_.at(e->second).bytes;
  if (offset > bytes.size() || length > bytes.size() - offset) return "";
  return std::string(reinterpret_cast<const char*>(bytes.data() + offset), length);
}

CUresult FakeDriver::PrimaryCtxRetain(CUcontext* ctx, CUdevice dev) {
  std::lock_guard<std::mutex> lock(mu_);
  if (dev < 0 || dev >= device_count_) return CUDA_ERROR_INVALID_DEVICE;
  ++context_refs_[dev];
  *ctx = ContextOf(dev);
  return CUDA_SUCCESS;
}

CUresult FakeDriver::PrimaryCtxRelease(CUdevice dev) {
  std::lock_guard<std::mutex> lock(mu_);
  auto refs = context_refs_.find(dev);
  if (refs == context_refs_.end()) return Violation("cuDevicePrimaryCtxRelease without a retain");
  if (--refs->second == 0) context_refs_.erase(refs);
  return CUDA_SUCCESS;
}

CUresult FakeDriver::CtxSetCurrent(CUcontext ctx) {
  std::lock_guard<std::mutex> lock(mu_);
  current_context_ = ctx;
  return CUDA_SUCCESS;
}

CUresult FakeDriver::CtxGetCurrent(CUcontext* ctx) {
  std::lock_guard<std::mutex> lock(mu_);
  *ctx = current_context_;
  return CUDA_SUCCESS;
}

CUresult FakeDriver::CtxGetDevice(CUdevice* dev) {
  std::lock_guard<std::mutex> lock(mu_);
  if (current_context_ == nullptr) return CUDA_ERROR_INVALID_CONTEXT;
  *dev = DeviceOf(current_context_);
  return CUDA_SUCCESS;
}

CUresult FakeDriver::DeviceGetAttribute(int* value, CUdevice_attribute attribute, CUdevice dev) {
  std::lock_guard<std::mutex> lock(mu_);
  if (dev < 0 || dev >= device_count_) return CUDA_ERROR_INVALID_DEVICE;
  auto it = attributes_.find(attribute);
  *value = it == attributes_.end() ? 1 : it->second;
  return CUDA_SUCCESS;
}

CUresult FakeDriver::GetGranularity(size_t* granularity, const CUmemAllocationProp* prop) {
  std::lock_guard<std::mutex> lock(mu_);
  if (prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE || prop->location.id < 0 ||
      prop->location.id >= device_count_) {
    return CUDA_ERROR_INVALID_DEVICE;
  }
  *granularity = granularity_;
  return CUDA_SUCCESS;
}

CUresult FakeDriver::Create(CUmemGenericAllocationHandle* handle, size_t size,
                            const CUmemAllocationProp* prop) {
  std::lock_guard<std::mutex> lock(mu_);
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
  std::lock_guard<std::mutex> lock(mu_);
  if (handles_.erase(handle) == 0) return Violation("cuMemRelease of an unknown handle");
  imported_handles_.erase(handle);
  return CUDA_SUCCESS;
}

CUresult FakeDriver::Export(void* shareable, CUmemGenericAllocationHandle handle,
                            CUmemAllocationHandleType type) {
  std::lock_guard<std::mutex> lock(mu_);
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
  std::lock_guard<std::mutex> lock(mu_);
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
  imported_handles_.insert(*handle);
  return CUDA_SUCCESS;
}

CUresult FakeDriver::Reserve(CUdeviceptr* ptr, size_t size, size_t alignment) {
  std::lock_guard<std::mutex> lock(mu_);
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
  std::lock_guard<std::mutex> lock(mu_);
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
  std::lock_guard<std::mutex> lock(mu_);
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
  mappings_[ptr] = Mapping{
      size, h->second, {}, memory_[h->second].exportable && imported_handles_.count(handle) == 0};
  return CUDA_SUCCESS;
}

CUresult FakeDriver::Unmap(CUdeviceptr ptr, size_t size) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = mappings_.find(ptr);
  if (it == mappings_.end() || it->second.size != size) {
    return Violation("cuMemUnmap of a range that is not exactly one mapping");
  }
  mappings_.erase(it);
  return CUDA_SUCCESS;
}

CUresult FakeDriver::SetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc* desc,
                               size_t count) {
  std::lock_guard<std::mutex> lock(mu_);
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
    // Another device's memory needs peer access to it (SetPeerAccess).
    for (const Mapping* m : covered) {
      if (!peer_access_ && memory_.at(m->memory).device != desc[i].location.id) {
        return CUDA_ERROR_INVALID_DEVICE;
      }
    }
  }
  for (Mapping* m : covered) {
    for (size_t i = 0; i < count; ++i) m->access[desc[i].location.id] = desc[i].flags;
  }
  return CUDA_SUCCESS;
}

// ---- memory-backed allocations -----------------------------------------------------------------

CUresult FakeDriver::HostAlloc(void** p, size_t bytes) {
  void* mem = std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096);
  if (mem == nullptr) return CUDA_ERROR_OUT_OF_MEMORY;
  std::lock_guard<std::mutex> lock(mu_);
  host_buffers_[mem] = bytes;
  *p = mem;
  return CUDA_SUCCESS;
}

CUresult FakeDriver::FreeHost(void* p) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = host_buffers_.find(p);
  if (it == host_buffers_.end()) {
    return Violation(host_registrations_.count(p) != 0
                         ? "cuMemFreeHost of cuMemHostRegister'ed memory"
                         : "cuMemFreeHost of memory cuMemHostAlloc did not return");
  }
  // Freeing a buffer a queued copy still reads from is a use-after-free on a real GPU;
  // fail the whole test binary loudly rather than let it pass.
  const auto* begin = static_cast<const char*>(p);
  for (const auto& [handle, s] : streams_) {
    for (const Copy& c : s.queue) {
      const auto* src = static_cast<const char*>(c.src);
      if (src >= begin && src < begin + it->second) std::abort();
    }
  }
  host_buffers_.erase(it);
  std::free(p);
  return CUDA_SUCCESS;
}

CUresult FakeDriver::HostRegister(void* p, size_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  if (p == nullptr || bytes == 0) return CUDA_ERROR_INVALID_VALUE;
  if (host_buffers_.count(p) != 0) return CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED;
  // The real driver refuses a range that shares a page with a registered one.
  const auto* begin = static_cast<const char*>(p);
  for (const auto& [q, size] : host_registrations_) {
    const auto* other = static_cast<const char*>(q);
    if (begin < other + size && other < begin + bytes) {
      return CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED;
    }
  }
  host_registrations_.emplace(p, bytes);
  return CUDA_SUCCESS;
}

CUresult FakeDriver::HostUnregister(void* p) {
  std::lock_guard<std::mutex> lock(mu_);
  // Unpinning pages a queued copy still reads is a use-after-free on a real GPU (the copy
  // engine reads whatever the pages hold next): fail the test binary, as for cuMemFreeHost.
  if (auto reg = host_registrations_.find(p); reg != host_registrations_.end()) {
    const auto* begin = static_cast<const char*>(p);
    for (const auto& [handle, s] : streams_) {
      for (const Copy& c : s.queue) {
        const auto* src = static_cast<const char*>(c.src);
        if (src >= begin && src < begin + reg->second) std::abort();
      }
    }
  }
  if (host_registrations_.erase(p) == 0) {
    return Violation(host_buffers_.count(p) != 0
                         ? "cuMemHostUnregister of cuMemHostAlloc'ed memory"
                         : "cuMemHostUnregister of memory that is not registered");
  }
  return CUDA_SUCCESS;
}

CUresult FakeDriver::MemAlloc(CUdeviceptr* p, size_t bytes) {
  void* mem = std::aligned_alloc(256, (bytes + 255) / 256 * 256);
  if (mem == nullptr) return CUDA_ERROR_OUT_OF_MEMORY;
  std::lock_guard<std::mutex> lock(mu_);
  device_allocs_.insert(reinterpret_cast<CUdeviceptr>(mem));
  *p = reinterpret_cast<CUdeviceptr>(mem);
  return CUDA_SUCCESS;
}

CUresult FakeDriver::MemFree(CUdeviceptr p) {
  std::lock_guard<std::mutex> lock(mu_);
  if (device_allocs_.erase(p) == 0)
    return Violation("cuMemFree of memory cuMemAlloc did not return");
  std::free(reinterpret_cast<void*>(p));
  return CUDA_SUCCESS;
}

// ---- streams, events, copies -------------------------------------------------------------------

CUresult FakeDriver::StreamCreate(CUstream* s) {
  std::lock_guard<std::mutex> lock(mu_);
  *s = reinterpret_cast<CUstream>(next_object_++);
  streams_[*s];
  return CUDA_SUCCESS;
}

CUresult FakeDriver::StreamDestroy(CUstream s) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = streams_.find(s);
  if (s == nullptr || it == streams_.end()) return CUDA_ERROR_INVALID_HANDLE;
  RunUntil(it->second, it->second.next_seq - 1);  // pending work completes, as on a GPU
  streams_.erase(it);
  return CUDA_SUCCESS;
}

CUresult FakeDriver::StreamSynchronize(CUstream s) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = streams_.find(s);
  if (it == streams_.end()) return CUDA_ERROR_INVALID_HANDLE;
  RunUntil(it->second, it->second.next_seq - 1);
  return CUDA_SUCCESS;
}

CUresult FakeDriver::EventCreate(CUevent* e) {
  std::lock_guard<std::mutex> lock(mu_);
  *e = reinterpret_cast<CUevent>(next_object_++);
  events_[*e];
  return CUDA_SUCCESS;
}

CUresult FakeDriver::EventDestroy(CUevent e) {
  std::lock_guard<std::mutex> lock(mu_);
  return events_.erase(e) == 1 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

CUresult FakeDriver::EventRecord(CUevent e, CUstream s) {
  std::lock_guard<std::mutex> lock(mu_);
  auto ev = events_.find(e);
  auto st = streams_.find(s);
  if (ev == events_.end() || st == streams_.end()) return CUDA_ERROR_INVALID_HANDLE;
  ev->second = {s, st->second.next_seq - 1};
  return CUDA_SUCCESS;
}

CUresult FakeDriver::EventSynchronize(CUevent e) {
  std::lock_guard<std::mutex> lock(mu_);
  auto ev = events_.find(e);
  if (ev == events_.end()) return CUDA_ERROR_INVALID_HANDLE;
  auto st = streams_.find(ev->second.stream);
  if (st != streams_.end()) RunUntil(st->second, ev->second.seq);
  return CUDA_SUCCESS;
}

CUresult FakeDriver::MemcpyAsync(void* dst, const void* src, size_t bytes, CUstream s) {
  std::lock_guard<std::mutex> lock(mu_);
  auto st = streams_.find(s);
  if (st == streams_.end()) return CUDA_ERROR_INVALID_HANDLE;
  Stream& stream = st->second;
  // VMM addresses are not backed: a copy into a reservation must land in mapped memory, and is
  // then checked and dropped (a copy out of one reads zeros).
  const auto in_reservation = [&](const void* p) {
    const auto ptr = reinterpret_cast<CUdeviceptr>(p);
    auto r = reservations_.upper_bound(ptr);
    if (r == reservations_.begin()) return false;
    --r;
    return ptr < r->first + r->second;
  };
  const auto mapped = [&](const void* p) {
    const auto ptr = reinterpret_cast<CUdeviceptr>(p);
    auto m = mappings_.upper_bound(ptr);
    if (m == mappings_.begin()) return false;
    --m;
    return ptr + bytes <= m->first + m->second.size;
  };
  if (in_reservation(dst)) {
    if (!mapped(dst)) return Violation("copy into unmapped VMM memory");
    const auto ptr = reinterpret_cast<CUdeviceptr>(dst);
    auto m = std::prev(mappings_.upper_bound(ptr));
    std::vector<uint8_t>& backing = memory_[m->second.memory].bytes;
    if (backing.empty()) return CUDA_SUCCESS;  // not backed: checked and dropped
    stream.queue.push_back({backing.data() + (ptr - m->first), src, bytes, stream.next_seq++});
    if (stream.queue.size() > max_queued_) RunUntil(stream, stream.queue.front().seq);
    return CUDA_SUCCESS;
  }
  if (in_reservation(src)) {
    if (!mapped(src)) return Violation("copy from unmapped VMM memory");
    const auto ptr = reinterpret_cast<CUdeviceptr>(src);
    auto m = std::prev(mappings_.upper_bound(ptr));
    const std::vector<uint8_t>& backing = memory_[m->second.memory].bytes;
    if (backing.empty()) {  // not backed: reads zeros
      std::memset(dst, 0, bytes);
      return CUDA_SUCCESS;
    }
    stream.queue.push_back({dst, backing.data() + (ptr - m->first), bytes, stream.next_seq++});
    if (stream.queue.size() > max_queued_) RunUntil(stream, stream.queue.front().seq);
    return CUDA_SUCCESS;
  }
  stream.queue.push_back({dst, src, bytes, stream.next_seq++});
  if (stream.queue.size() > max_queued_) RunUntil(stream, stream.queue.front().seq);
  return CUDA_SUCCESS;
}

CUresult FakeDriver::CanAccessPeer(int* can, CUdevice dev, CUdevice peer) {
  std::lock_guard<std::mutex> lock(mu_);
  if (dev < 0 || dev >= device_count_ || peer < 0 || peer >= device_count_ || dev == peer) {
    return CUDA_ERROR_INVALID_DEVICE;
  }
  *can = peer_access_ ? 1 : 0;
  return CUDA_SUCCESS;
}

void FakeDriver::SetPeerAccess(bool allowed) {
  std::lock_guard<std::mutex> lock(mu_);
  peer_access_ = allowed;
}

CUresult FakeDriver::MemcpyDtoDAsync(CUdeviceptr dst, CUdeviceptr src, size_t bytes, CUstream s) {
  const void* from = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (current_context_ == nullptr) return CUDA_ERROR_INVALID_CONTEXT;
    const CUdevice device = DeviceOf(current_context_);
    // Each end: a VMM mapping (the whole range in one), readable and writable by the current
    // context's device, or cuMemAlloc'ed memory (host memory in the fake).
    for (const CUdeviceptr end : {dst, src}) {
      auto m = mappings_.upper_bound(end);
      if (m != mappings_.begin() && end < std::prev(m)->first + std::prev(m)->second.size) {
        --m;
      } else {
        auto r = reservations_.upper_bound(end);
        if (r != reservations_.begin() && end < std::prev(r)->first + std::prev(r)->second) {
          return Violation("cuMemcpyDtoDAsync: an end in unmapped VMM memory");
        }
        continue;  // cuMemAlloc'ed: host memory in the fake
      }
      if (end + bytes > m->first + m->second.size) {
        return Violation("cuMemcpyDtoDAsync: a range past its mapping");
      }
      auto access = m->second.access.find(device);
      if (access == m->second.access.end() ||
          access->second != CU_MEM_ACCESS_FLAGS_PROT_READWRITE) {
        return Violation("cuMemcpyDtoDAsync: a mapping without read-write access for device " +
                         std::to_string(device));
      }
      if (end == src) {
        const std::vector<uint8_t>& backing = memory_.at(m->second.memory).bytes;
        if (backing.empty()) return CUDA_SUCCESS;  // not backed: checked and dropped
        from = backing.data() + (src - m->first);
      }
    }
  }
  return MemcpyAsync(reinterpret_cast<void*>(dst),
                     from != nullptr ? from : reinterpret_cast<const void*>(src), bytes, s);
}

void FakeDriver::RunUntil(Stream& s, uint64_t seq) {
  while (!s.queue.empty() && s.queue.front().seq <= seq) {
    const Copy& c = s.queue.front();
    std::memcpy(c.dst, c.src, c.bytes);
    s.queue.pop_front();
  }
}

// ---- modules and kernels -----------------------------------------------------------------------

CUresult FakeDriver::ModuleLoadData(CUmodule* m, const void* image) {
  if (image == nullptr) return CUDA_ERROR_INVALID_IMAGE;
  std::lock_guard<std::mutex> lock(mu_);
  *m = reinterpret_cast<CUmodule>(next_object_++);
  modules_.insert(*m);
  return CUDA_SUCCESS;
}

CUresult FakeDriver::ModuleUnload(CUmodule m) {
  std::lock_guard<std::mutex> lock(mu_);
  return modules_.erase(m) == 1 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

CUresult FakeDriver::ModuleGetFunction(CUfunction* f, CUmodule m, const char* name) {
  std::lock_guard<std::mutex> lock(mu_);
  if (modules_.count(m) == 0) return CUDA_ERROR_INVALID_HANDLE;
  if (std::strcmp(name, kernels::kChunkXxh64Kernel) != 0) return CUDA_ERROR_NOT_FOUND;
  *f = FakeFunction();
  return CUDA_SUCCESS;
}

// What the kernel reads at `ptr`: host memory for cuMemAlloc'ed "device" memory, the backing
// bytes of a mapped VMM address (BackVmmMemory), or zeros for an unbacked one (as a copy out of
// it reads). Called with mu_ held.
const uint8_t* FakeDriver::KernelView(CUdeviceptr ptr, uint64_t len, std::vector<uint8_t>* zeros) {
  auto m = mappings_.upper_bound(ptr);
  if (m != mappings_.begin()) {
    --m;
    if (ptr < m->first + m->second.size) {
      const std::vector<uint8_t>& backing = memory_.at(m->second.memory).bytes;
      if (!backing.empty()) return backing.data() + (ptr - m->first);
      zeros->assign(len, 0);
      return zeros->data();
    }
  }
  return reinterpret_cast<const uint8_t*>(ptr);
}

CUresult FakeDriver::LaunchKernel(CUfunction f, unsigned grid, unsigned block, CUstream s,
                                  void** params) {
  if (f != FakeFunction()) return CUDA_ERROR_INVALID_HANDLE;
  std::lock_guard<std::mutex> lock(mu_);
  auto st = streams_.find(s);
  if (st == streams_.end()) return CUDA_ERROR_INVALID_HANDLE;
  // Stream order: the range table copied before the launch must have landed.
  RunUntil(st->second, st->second.next_seq - 1);
  const auto* ranges =
      reinterpret_cast<const kernels::ChecksumRange*>(*static_cast<CUdeviceptr*>(params[0]));
  const uint32_t num_ranges = *static_cast<uint32_t*>(params[1]);
  const uint64_t total_chunks = *static_cast<uint64_t*>(params[2]);
  const uint64_t chunk_bytes = *static_cast<uint64_t*>(params[3]);
  const uint64_t seed = *static_cast<uint64_t*>(params[4]);
  auto* out = reinterpret_cast<uint64_t*>(*static_cast<CUdeviceptr*>(params[5]));
  const uint64_t threads = uint64_t{grid} * block;
  std::vector<uint8_t> zeros;
  // The device code's thread loop, run serially: thread `chunk` finds its range and hashes.
  for (uint64_t chunk = 0; chunk < total_chunks && chunk < threads; ++chunk) {
    uint32_t r = 0;
    while (r + 1 < num_ranges && ranges[r + 1].first_chunk <= chunk) ++r;
    const uint64_t offset = (chunk - ranges[r].first_chunk) * chunk_bytes;
    const uint64_t len = std::min(chunk_bytes, ranges[r].size - offset);
    const uint8_t* p = KernelView(ranges[r].ptr + offset, len, &zeros);
    out[chunk] = (reinterpret_cast<uintptr_t>(p) % 16 == 0)
                     ? xxh64::Hash<xxh64::Access::kVector16>(p, len, seed)
                     : xxh64::Hash<xxh64::Access::kBytewise>(p, len, seed);
    ++launched_chunks_;
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
