#include "upload_fake_driver.h"

#include <cstdlib>
#include <cstring>

#include "cuda/kernels/checksum_abi.h"
#include "cuda/kernels/xxh64_core.h"

namespace weightcache::cuda::testing {
namespace {

UploadFakeDriver* g_fake = nullptr;

// One fake context, one fake module, one fake function: opaque non-null handles.
CUcontext FakeContext() { return reinterpret_cast<CUcontext>(uintptr_t{0xC0DE}); }
CUfunction FakeFunction() { return reinterpret_cast<CUfunction>(uintptr_t{0xF00D}); }

const char* ErrorName(CUresult rc) {
  switch (rc) {
    case CUDA_SUCCESS:
      return "CUDA_SUCCESS";
    case CUDA_ERROR_OUT_OF_MEMORY:
      return "CUDA_ERROR_OUT_OF_MEMORY";
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
    default:
      return nullptr;
  }
}

#define WC_HOOK(name)                              \
  do {                                             \
    CUresult hook_rc_ = g_fake->Hook(name);        \
    if (hook_rc_ != CUDA_SUCCESS) return hook_rc_; \
  } while (0)

}  // namespace

UploadFakeDriver::UploadFakeDriver() {
  g_fake = this;
  streams_[nullptr];  // the legacy default stream always exists
  api_.cuGetErrorName = [](CUresult rc, const char** s) -> CUresult {
    *s = ErrorName(rc);
    return *s != nullptr ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
  };
  api_.cuGetErrorString = [](CUresult rc, const char** s) -> CUresult {
    *s = ErrorName(rc) != nullptr ? "injected by UploadFakeDriver" : nullptr;
    return *s != nullptr ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
  };
  api_.cuCtxGetCurrent = [](CUcontext* c) -> CUresult {
    WC_HOOK("cuCtxGetCurrent");
    return g_fake->CtxGetCurrent(c);
  };
  api_.cuCtxSetCurrent = [](CUcontext c) -> CUresult {
    WC_HOOK("cuCtxSetCurrent");
    return c == FakeContext() ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
  };
  api_.cuMemHostAlloc = [](void** p, size_t bytes, unsigned int) -> CUresult {
    WC_HOOK("cuMemHostAlloc");
    return g_fake->HostAlloc(p, bytes);
  };
  api_.cuMemFreeHost = [](void* p) -> CUresult {
    WC_HOOK("cuMemFreeHost");
    return g_fake->FreeHost(p);
  };
  api_.cuMemAlloc = [](CUdeviceptr* p, size_t bytes) -> CUresult {
    WC_HOOK("cuMemAlloc");
    return g_fake->MemAlloc(p, bytes);
  };
  api_.cuMemFree = [](CUdeviceptr p) -> CUresult {
    WC_HOOK("cuMemFree");
    return g_fake->MemFree(p);
  };
  api_.cuStreamCreate = [](CUstream* s, unsigned int) -> CUresult {
    WC_HOOK("cuStreamCreate");
    return g_fake->StreamCreate(s);
  };
  api_.cuStreamDestroy = [](CUstream s) -> CUresult {
    WC_HOOK("cuStreamDestroy");
    return g_fake->StreamDestroy(s);
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
  api_.cuMemcpyDtoHAsync = [](void* dst, CUdeviceptr src, size_t n, CUstream s) -> CUresult {
    WC_HOOK("cuMemcpyDtoHAsync");
    return g_fake->MemcpyAsync(dst, reinterpret_cast<const void*>(src), n, s);
  };
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

UploadFakeDriver::~UploadFakeDriver() {
  for (const auto& [p, size] : host_buffers_) std::free(p);
  for (CUdeviceptr p : device_allocs_) std::free(reinterpret_cast<void*>(p));
  g_fake = nullptr;
}

void UploadFakeDriver::FailCall(const std::string& function, int nth, CUresult rc) {
  std::lock_guard<std::mutex> lock(mu_);
  failures_[function][nth] = rc;
}

int UploadFakeDriver::CallCount(const std::string& function) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = calls_.find(function);
  return it == calls_.end() ? 0 : it->second;
}

CUresult UploadFakeDriver::Hook(const char* function) {
  std::lock_guard<std::mutex> lock(mu_);
  const int n = ++calls_[function];
  auto f = failures_.find(function);
  if (f == failures_.end()) return CUDA_SUCCESS;
  auto hit = f->second.find(n);
  return hit == f->second.end() ? CUDA_SUCCESS : hit->second;
}

int UploadFakeDriver::live_host_buffers() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int>(host_buffers_.size());
}
int UploadFakeDriver::live_streams() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int>(streams_.size()) - 1;  // minus the default stream
}
int UploadFakeDriver::live_events() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int>(events_.size());
}
int UploadFakeDriver::live_device_allocs() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int>(device_allocs_.size());
}
int UploadFakeDriver::loaded_modules() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int>(modules_.size());
}
size_t UploadFakeDriver::pending_copies() const {
  std::lock_guard<std::mutex> lock(mu_);
  size_t n = 0;
  for (const auto& [handle, s] : streams_) n += s.queue.size();
  return n;
}

CUresult UploadFakeDriver::CtxGetCurrent(CUcontext* ctx) {
  *ctx = has_context_ ? FakeContext() : nullptr;
  return CUDA_SUCCESS;
}

CUresult UploadFakeDriver::HostAlloc(void** p, size_t bytes) {
  void* mem = std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096);
  if (mem == nullptr) return CUDA_ERROR_OUT_OF_MEMORY;
  std::lock_guard<std::mutex> lock(mu_);
  host_buffers_[mem] = bytes;
  *p = mem;
  return CUDA_SUCCESS;
}

CUresult UploadFakeDriver::FreeHost(void* p) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = host_buffers_.find(p);
  if (it == host_buffers_.end()) return CUDA_ERROR_INVALID_VALUE;
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

CUresult UploadFakeDriver::MemAlloc(CUdeviceptr* p, size_t bytes) {
  void* mem = std::aligned_alloc(256, (bytes + 255) / 256 * 256);
  if (mem == nullptr) return CUDA_ERROR_OUT_OF_MEMORY;
  std::lock_guard<std::mutex> lock(mu_);
  device_allocs_.insert(reinterpret_cast<CUdeviceptr>(mem));
  *p = reinterpret_cast<CUdeviceptr>(mem);
  return CUDA_SUCCESS;
}

CUresult UploadFakeDriver::MemFree(CUdeviceptr p) {
  std::lock_guard<std::mutex> lock(mu_);
  if (device_allocs_.erase(p) == 0) return CUDA_ERROR_INVALID_VALUE;
  std::free(reinterpret_cast<void*>(p));
  return CUDA_SUCCESS;
}

CUresult UploadFakeDriver::StreamCreate(CUstream* s) {
  std::lock_guard<std::mutex> lock(mu_);
  *s = reinterpret_cast<CUstream>(next_handle_++);
  streams_[*s];
  return CUDA_SUCCESS;
}

CUresult UploadFakeDriver::StreamDestroy(CUstream s) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = streams_.find(s);
  if (s == nullptr || it == streams_.end()) return CUDA_ERROR_INVALID_HANDLE;
  RunUntil(it->second, it->second.next_seq - 1);  // pending work completes, as on a GPU
  streams_.erase(it);
  return CUDA_SUCCESS;
}

CUresult UploadFakeDriver::StreamSynchronize(CUstream s) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = streams_.find(s);
  if (it == streams_.end()) return CUDA_ERROR_INVALID_HANDLE;
  RunUntil(it->second, it->second.next_seq - 1);
  return CUDA_SUCCESS;
}

CUresult UploadFakeDriver::EventCreate(CUevent* e) {
  std::lock_guard<std::mutex> lock(mu_);
  *e = reinterpret_cast<CUevent>(next_handle_++);
  events_[*e];
  return CUDA_SUCCESS;
}

CUresult UploadFakeDriver::EventDestroy(CUevent e) {
  std::lock_guard<std::mutex> lock(mu_);
  return events_.erase(e) == 1 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

CUresult UploadFakeDriver::EventRecord(CUevent e, CUstream s) {
  std::lock_guard<std::mutex> lock(mu_);
  auto ev = events_.find(e);
  auto st = streams_.find(s);
  if (ev == events_.end() || st == streams_.end()) return CUDA_ERROR_INVALID_HANDLE;
  ev->second = {s, st->second.next_seq - 1};
  return CUDA_SUCCESS;
}

CUresult UploadFakeDriver::EventSynchronize(CUevent e) {
  std::lock_guard<std::mutex> lock(mu_);
  auto ev = events_.find(e);
  if (ev == events_.end()) return CUDA_ERROR_INVALID_HANDLE;
  auto st = streams_.find(ev->second.stream);
  if (st != streams_.end()) RunUntil(st->second, ev->second.seq);
  return CUDA_SUCCESS;
}

CUresult UploadFakeDriver::MemcpyAsync(void* dst, const void* src, size_t bytes, CUstream s) {
  std::lock_guard<std::mutex> lock(mu_);
  auto st = streams_.find(s);
  if (st == streams_.end()) return CUDA_ERROR_INVALID_HANDLE;
  Stream& stream = st->second;
  stream.queue.push_back({dst, src, bytes, stream.next_seq++});
  if (stream.queue.size() > max_queued_) RunUntil(stream, stream.queue.front().seq);
  return CUDA_SUCCESS;
}

void UploadFakeDriver::RunUntil(Stream& s, uint64_t seq) {
  while (!s.queue.empty() && s.queue.front().seq <= seq) {
    const Copy& c = s.queue.front();
    std::memcpy(c.dst, c.src, c.bytes);
    s.done_seq = c.seq;
    s.queue.pop_front();
  }
}

CUresult UploadFakeDriver::ModuleLoadData(CUmodule* m, const void* image) {
  if (image == nullptr) return CUDA_ERROR_INVALID_IMAGE;
  std::lock_guard<std::mutex> lock(mu_);
  *m = reinterpret_cast<CUmodule>(next_handle_++);
  modules_.insert(*m);
  return CUDA_SUCCESS;
}

CUresult UploadFakeDriver::ModuleUnload(CUmodule m) {
  std::lock_guard<std::mutex> lock(mu_);
  return modules_.erase(m) == 1 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

CUresult UploadFakeDriver::ModuleGetFunction(CUfunction* f, CUmodule m, const char* name) {
  std::lock_guard<std::mutex> lock(mu_);
  if (modules_.count(m) == 0) return CUDA_ERROR_INVALID_HANDLE;
  if (std::strcmp(name, kernels::kChunkXxh64Kernel) != 0) return CUDA_ERROR_NOT_FOUND;
  *f = FakeFunction();
  return CUDA_SUCCESS;
}

CUresult UploadFakeDriver::LaunchKernel(CUfunction f, unsigned grid, unsigned block, CUstream s,
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
  // The device code's thread loop, run serially: thread `chunk` finds its range and hashes.
  for (uint64_t chunk = 0; chunk < total_chunks && chunk < threads; ++chunk) {
    uint32_t r = 0;
    while (r + 1 < num_ranges && ranges[r + 1].first_chunk <= chunk) ++r;
    const uint64_t offset = (chunk - ranges[r].first_chunk) * chunk_bytes;
    const uint64_t len = std::min(chunk_bytes, ranges[r].size - offset);
    const auto* p = reinterpret_cast<const uint8_t*>(ranges[r].ptr + offset);
    out[chunk] = (reinterpret_cast<uintptr_t>(p) % 16 == 0)
                     ? xxh64::Hash<xxh64::Access::kVector16>(p, len, seed)
                     : xxh64::Hash<xxh64::Access::kBytewise>(p, len, seed);
    ++launched_chunks_;
  }
  return CUDA_SUCCESS;
}

}  // namespace weightcache::cuda::testing
