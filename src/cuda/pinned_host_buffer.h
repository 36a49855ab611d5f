// PinnedHostBuffer — the one owner of pinned (page-locked) host memory in the project: the
// upload pipeline's staging ring (cuda/upload_pipeline.h) and the client's gpu fallback loader
// (client/fallback_loader.h) both stage through it.
//
// The memory is private anonymous memory populated by the kernel (os::MapAnonymousPopulated),
// then registered with the driver (cuMemHostRegister, PORTABLE: every context sees it pinned).
// That is the fast way to pin on the machines we measured: cuMemHostAlloc of 512 MiB took
// ~285 ms inside a load on an H200 (the driver allocates and pins page by page; 4 GiB plus a
// touch took 2.6 s), while registering populated memory went at ~23 GB/s (4 GiB in 0.175 s).
// It is released the one way registered memory is: cuMemHostUnregister, then munmap.
// PinnedHostTraits is that rule, written once.
//
// Contract: move-only, created through Create() (nothing half-built escapes); a moved-from
// buffer owns nothing. Destruction never fails: a refused unregister is logged and the memory
// is then leaked on purpose (the device may still be able to reach it, so it is never handed
// back to the allocator). The memory must no longer be in use by an asynchronous copy when the
// buffer dies: its user synchronizes first. Creating buffers concurrently from several threads
// is safe and populates them in parallel. The DriverApi must outlive the buffer.
#pragma once

#include <cuda.h>

#include <cstddef>
#include <string>

#include "common/unique_handle.h"
#include "cuda/driver_api.h"
#include "os/file_mapping.h"
#include "weightcache/status.h"

namespace weightcache::cuda {

struct PinnedHostTraits {
  using Handle = void*;
  struct Context {
    const DriverApi* api = nullptr;
    size_t bytes = 0;
  };
  static constexpr Handle Null() { return nullptr; }
  static void Close(const Context& c, void* p) noexcept {
    if (CUresult rc = c.api->cuMemHostUnregister(p); rc != CUDA_SUCCESS) {
      LogReleaseFailure(c.api, rc, "cuMemHostUnregister of a pinned host buffer (leaked)");
      return;
    }
    os::UnmapAnonymous(p, c.bytes);
  }
};

class PinnedHostBuffer {
 public:
  // `bytes` of page-aligned, page-locked memory usable by every context. kIo (ENOMEM) when
  // the memory cannot be mapped, kCuda naming the call and the size when the driver
  // refuses to pin it.
  static Result<PinnedHostBuffer> Create(const DriverApi* api, size_t bytes) {
    WEIGHTCACHE_ASSIGN_OR_RETURN(void* p, os::MapAnonymousPopulated(bytes));
    if (CUresult rc = api->cuMemHostRegister(p, bytes, CU_MEMHOSTREGISTER_PORTABLE);
        rc != CUDA_SUCCESS) {
      os::UnmapAnonymous(p, bytes);
      return DriverError(
          api, rc,
          "cuMemHostRegister of a " + std::to_string(bytes) + "-byte pinned staging buffer");
    }
    return PinnedHostBuffer(api, p, bytes);
  }
  std::byte* data() const { return static_cast<std::byte*>(memory_.get()); }
  size_t size() const { return memory_.valid() ? memory_.context().bytes : 0; }
  // Gives the memory up without unregistering or unmapping it: it stays pinned and mapped for
  // the life of the process. For a user whose asynchronous copies could not be waited for (a
  // copy may still reach the memory); the buffer owns nothing after.
  void Abandon() { static_cast<void>(memory_.Release()); }

 private:
  PinnedHostBuffer(const DriverApi* api, void* data, size_t size)
      : memory_(PinnedHostTraits::Context{api, size}, data) {}
  UniqueHandle<PinnedHostTraits> memory_;
};

}  // namespace weightcache::cuda
