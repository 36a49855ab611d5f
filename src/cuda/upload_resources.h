// RAII owners of the driver resources the upload pipeline holds: pinned host buffers, streams
// and events. One class per resource; each is move-only, created through Create() (nothing
// half-built escapes) and released through the same DriverApi table it was created with.
//
// Thread-safety: none of these synchronize; the pipeline coordinates their use. Destruction
// must happen with a CUDA context current (the driver needs it to free) and with no GPU work
// still using the resource: the pipeline synchronizes its streams before any of these die.
#pragma once

#include <cuda.h>

#include <cstddef>
#include <string>
#include <utility>

#include "cuda/driver_api.h"
#include "weightcache/status.h"

namespace weightcache::cuda {

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
  PinnedHostBuffer(PinnedHostBuffer&& o) noexcept
      : api_(o.api_), data_(std::exchange(o.data_, nullptr)), size_(o.size_) {}
  PinnedHostBuffer& operator=(PinnedHostBuffer&&) = delete;
  PinnedHostBuffer(const PinnedHostBuffer&) = delete;
  ~PinnedHostBuffer() {
    if (data_ != nullptr) api_->cuMemFreeHost(data_);
  }
  std::byte* data() const { return static_cast<std::byte*>(data_); }
  size_t size() const { return size_; }

 private:
  PinnedHostBuffer(const DriverApi* api, void* data, size_t size)
      : api_(api), data_(data), size_(size) {}
  const DriverApi* api_;
  void* data_;
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
  CudaStream(CudaStream&& o) noexcept : api_(o.api_), stream_(std::exchange(o.stream_, nullptr)) {}
  CudaStream& operator=(CudaStream&&) = delete;
  CudaStream(const CudaStream&) = delete;
  ~CudaStream() {
    if (stream_ != nullptr) api_->cuStreamDestroy(stream_);
  }
  CUstream get() const { return stream_; }

 private:
  CudaStream(const DriverApi* api, CUstream s) : api_(api), stream_(s) {}
  const DriverApi* api_;
  CUstream stream_;
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
  CudaEvent(CudaEvent&& o) noexcept : api_(o.api_), event_(std::exchange(o.event_, nullptr)) {}
  CudaEvent& operator=(CudaEvent&&) = delete;
  CudaEvent(const CudaEvent&) = delete;
  ~CudaEvent() {
    if (event_ != nullptr) api_->cuEventDestroy(event_);
  }
  CUevent get() const { return event_; }

 private:
  CudaEvent(const DriverApi* api, CUevent e) : api_(api), event_(e) {}
  const DriverApi* api_;
  CUevent event_;
};

}  // namespace weightcache::cuda
