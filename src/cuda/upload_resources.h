// RAII owners of the driver resources the upload pipeline holds: pinned host buffers, streams
// and events. One class per resource; each is move-only, created through Create() (nothing
// half-built escapes), owns its handle through a UniqueHandle (common/unique_handle.h) and
// releases it through the same DriverApi table it was created with; a failed release is logged.
//
// Pinned host memory has one rule in the project: it is allocated by cuMemHostAlloc
// (PORTABLE, so every context sees it pinned) and freed by cuMemFreeHost, the only call that
// frees cuMemHostAlloc'ed memory (cuMemHostUnregister is for cuMemHostRegister'ed memory the
// caller allocated, which the project does not use). PinnedHostBuffer is that rule.
//
// Thread-safety: none of these synchronize; the pipeline coordinates their use. Destruction
// must happen with a CUDA context current (the driver needs it to free) and with no GPU work
// still using the resource: the pipeline synchronizes its streams before any of these die.
#pragma once

#include <cuda.h>

#include <cstddef>
#include <string>

#include "common/unique_handle.h"
#include "cuda/driver_api.h"
#include "weightcache/status.h"

namespace weightcache::cuda {

struct PinnedHostTraits {
  using Handle = void*;
  using Context = const DriverApi*;
  static constexpr Handle Null() { return nullptr; }
  static void Close(const DriverApi* api, void* p) noexcept {
    if (CUresult rc = api->cuMemFreeHost(p); rc != CUDA_SUCCESS) {
      LogReleaseFailure(api, rc, "cuMemFreeHost of a pinned host buffer");
    }
  }
};

struct StreamTraits {
  using Handle = CUstream;
  using Context = const DriverApi*;
  static constexpr Handle Null() { return nullptr; }
  static void Close(const DriverApi* api, CUstream s) noexcept {
    if (CUresult rc = api->cuStreamDestroy(s); rc != CUDA_SUCCESS) {
      LogReleaseFailure(api, rc, "cuStreamDestroy");
    }
  }
};

struct EventTraits {
  using Handle = CUevent;
  using Context = const DriverApi*;
  static constexpr Handle Null() { return nullptr; }
  static void Close(const DriverApi* api, CUevent e) noexcept {
    if (CUresult rc = api->cuEventDestroy(e); rc != CUDA_SUCCESS) {
      LogReleaseFailure(api, rc, "cuEventDestroy");
    }
  }
};

class PinnedHostBuffer {
 public:
  // cuMemHostAlloc(PORTABLE): page-aligned, page-locked, usable by every context.
  static Result<PinnedHostBuffer> Create(const DriverApi* api, size_t bytes) {
    void* p = nullptr;
    WEIGHTCACHE_CU_RETURN_IF_ERROR(
        api, cuMemHostAlloc(&p, bytes, CU_MEMHOSTALLOC_PORTABLE),
        "cuMemHostAlloc of a " + std::to_string(bytes) + "-byte pinned staging buffer");
    return PinnedHostBuffer(api, p, bytes);
  }
  std::byte* data() const { return static_cast<std::byte*>(memory_.get()); }
  size_t size() const { return size_; }

 private:
  PinnedHostBuffer(const DriverApi* api, void* data, size_t size)
      : memory_(api, data), size_(size) {}
  UniqueHandle<PinnedHostTraits> memory_;
  size_t size_;
};

class CudaStream {
 public:
  static Result<CudaStream> Create(const DriverApi* api) {
    CUstream s = nullptr;
    WEIGHTCACHE_CU_RETURN_IF_ERROR(api, cuStreamCreate(&s, CU_STREAM_NON_BLOCKING),
                                   "cuStreamCreate for the upload pipeline");
    return CudaStream(api, s);
  }
  CUstream get() const { return stream_.get(); }

 private:
  CudaStream(const DriverApi* api, CUstream s) : stream_(api, s) {}
  UniqueHandle<StreamTraits> stream_;
};

class CudaEvent {
 public:
  // Timing disabled: these only order buffer reuse, and timing-free events are cheaper.
  static Result<CudaEvent> Create(const DriverApi* api) {
    CUevent e = nullptr;
    WEIGHTCACHE_CU_RETURN_IF_ERROR(api, cuEventCreate(&e, CU_EVENT_DISABLE_TIMING),
                                   "cuEventCreate for the upload pipeline");
    return CudaEvent(api, e);
  }
  CUevent get() const { return event_.get(); }

 private:
  CudaEvent(const DriverApi* api, CUevent e) : event_(api, e) {}
  UniqueHandle<EventTraits> event_;
};

}  // namespace weightcache::cuda
