// PinnedHostBuffer — the one owner of pinned (page-locked) host memory in the project: the
// upload pipeline's staging ring (cuda/upload_pipeline.h) and the client's gpu fallback loader
// (client/fallback_loader.h) both stage through it.
//
// Pinned host memory has one rule: it is allocated by cuMemHostAlloc (PORTABLE, so every
// context sees it pinned) and freed by cuMemFreeHost, the only call that frees
// cuMemHostAlloc'ed memory (cuMemHostUnregister is for cuMemHostRegister'ed memory the caller
// allocated, which the project does not use). PinnedHostTraits is that rule, written once.
//
// Contract: move-only, created through Create() (nothing half-built escapes); a moved-from
// buffer owns nothing. Destruction frees through the DriverApi table the buffer was created
// with and never fails (a failed free is logged). The memory must no longer be in use by an
// asynchronous copy when the buffer dies: its user synchronizes first. Not thread-safe per
// object. The DriverApi must outlive the buffer.
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

class PinnedHostBuffer {
 public:
  // cuMemHostAlloc(PORTABLE) of `bytes`: page-aligned, page-locked, usable by every context.
  // kCuda naming the call and the size when the driver refuses.
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

}  // namespace weightcache::cuda
