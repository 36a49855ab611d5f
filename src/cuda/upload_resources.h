// RAII owners of the driver resources the upload pipeline holds: pinned host buffers
// (cuda/pinned_host_buffer.h, shared with the client's fallback loader), streams and events.
// One class per resource; each is move-only, created through Create() (nothing half-built
// escapes), owns its handle through a UniqueHandle (common/unique_handle.h) and releases it
// through the same DriverApi table it was created with; a failed release is logged.
//
// Thread-safety: none of these synchronize; the pipeline coordinates their use. Destruction
// must happen with a CUDA context current (the driver needs it to free) and with no GPU work
// still using the resource: the pipeline synchronizes its streams before any of these die.
#pragma once

#include <cuda.h>

#include <string>

#include "common/unique_handle.h"
#include "cuda/driver_api.h"
#include "cuda/pinned_host_buffer.h"
#include "weightcache/status.h"

namespace weightcache::cuda {

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
