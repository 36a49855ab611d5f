// VMM building blocks: one RAII class per CUDA resource, each holding the `const DriverApi*` it
// was created with so that tests can drive them against a fake driver.
//
//   PrimaryContext  cuDevicePrimaryCtxRetain / cuDevicePrimaryCtxRelease (+ made current)
//   VmmHandle       cuMemCreate or cuMemImportFromShareableHandle / cuMemRelease
//   VaRange         cuMemAddressReserve / cuMemAddressFree
//   MappedRange     cuMemMap / cuMemUnmap (access flags are a property of the mapping and go
//                   away with it, so they need no class of their own)
//   exported fd     UniqueFd, returned by VmmHandle::ExportPosixFd with FD_CLOEXEC set
//
// Contract:
//  * Each class is move-only and owns exactly one resource, through a UniqueHandle
//    (common/unique_handle.h) whose traits below name the release call; a moved-from object
//    owns nothing.
//    Construction is only through the static factories, which return the driver's error as a
//    kCuda Status naming the call, the sizes and the device.
//  * Destructors release the resource and never fail: a driver error on release is logged
//    (LOG_WARN) and otherwise ignored, because there is nothing a caller could do about it.
//  * Objects composed of these must declare them in acquisition order (context, handles, VA,
//    mappings, fds), so that destruction runs in the reverse order — unmap before the VA is
//    freed, everything before the context is released — and a half-built object unwinds
//    itself.
//  * Not thread-safe per object; distinct objects may be used from distinct threads.
//  * The DriverApi must outlive every object made from it (the real one lives for the
//    process).
#pragma once

#include <cuda.h>

#include <cstdint>
#include <string>

#include "common/unique_fd.h"
#include "common/unique_handle.h"
#include "cuda/driver_api.h"
#include "weightcache/status.h"

namespace weightcache::cuda {

// The allocation properties of every arena allocation: pinned device memory on `device`,
// exportable as a POSIX fd. Exporter and importer use the same properties so their
// granularities agree.
CUmemAllocationProp ArenaAllocationProp(CUdevice device);

// cuMemGetAllocationGranularity for ArenaAllocationProp(device).
Result<uint64_t> AllocationGranularity(const DriverApi* api, CUdevice device,
                                       CUmemAllocationGranularity_flags option);

// "0x7f12a0000000" — for messages.
std::string HexPtr(CUdeviceptr ptr);

// The release rule of each VMM resource, for UniqueHandle. Close logs a failed release
// (LogReleaseFailure) and carries on.
struct PrimaryContextTraits {
  struct Handle {
    CUdevice device = 0;
    CUcontext context = nullptr;
    friend bool operator==(const Handle&, const Handle&) = default;
  };
  using Context = const DriverApi*;
  static constexpr Handle Null() { return {}; }
  static void Close(const DriverApi* api, const Handle& h) noexcept;  // cuDevicePrimaryCtxRelease
};
struct VmmHandleTraits {
  struct Handle {
    CUmemGenericAllocationHandle handle = 0;
    uint64_t size = 0;  // never 0 for a live handle
    friend bool operator==(const Handle&, const Handle&) = default;
  };
  using Context = const DriverApi*;
  static constexpr Handle Null() { return {}; }
  static void Close(const DriverApi* api, const Handle& h) noexcept;  // cuMemRelease
};
struct VaRangeTraits {
  struct Handle {
    CUdeviceptr base = 0;
    uint64_t size = 0;
    friend bool operator==(const Handle&, const Handle&) = default;
  };
  using Context = const DriverApi*;
  static constexpr Handle Null() { return {}; }
  static void Close(const DriverApi* api, const Handle& h) noexcept;  // cuMemAddressFree
};
struct MappedRangeTraits {
  struct Handle {
    CUdeviceptr ptr = 0;
    uint64_t size = 0;
    friend bool operator==(const Handle&, const Handle&) = default;
  };
  using Context = const DriverApi*;
  static constexpr Handle Null() { return {}; }
  static void Close(const DriverApi* api, const Handle& h) noexcept;  // cuMemUnmap
};

class PrimaryContext {
 public:
  // Retains the device's primary context (the one the CUDA runtime and torch also use, so
  // attaching does not create a second context) and makes it current on the calling thread.
  // Release does not change the thread's current context: other users of the same primary
  // context (the runtime) keep it current and it stays alive while anyone retains it.
  static Result<PrimaryContext> Retain(const DriverApi* api, CUdevice device);

  // Make the context current on the calling thread (for use from another thread).
  Status MakeCurrent() const;
  CUcontext get() const { return owned_.get().context; }
  const DriverApi* api() const { return owned_.context(); }
  CUdevice device() const { return owned_.get().device; }

 private:
  PrimaryContext(const DriverApi* api, CUdevice device, CUcontext context)
      : owned_(api, {device, context}) {}

  UniqueHandle<PrimaryContextTraits> owned_;
};

// Keeps a library entry point from switching its caller's thread to another context: records
// the calling thread's current context and, on destruction, makes it current again if there
// was one and it changed. A thread that had no current context keeps the one the entry point
// made current (the device's primary context — what cudaSetDevice would have done), so a plain
// C++ client can use the memory it just attached without further calls.
class CallerContextGuard {
 public:
  explicit CallerContextGuard(const DriverApi* api);
  CallerContextGuard(const CallerContextGuard&) = delete;
  CallerContextGuard& operator=(const CallerContextGuard&) = delete;
  ~CallerContextGuard();

 private:
  const DriverApi* api_;
  CUcontext saved_ = nullptr;
};

// Makes `context` current for its lifetime and restores the previous current context (even
// none) afterwards: for calls such as cuMemFree in a destructor, which may run on any thread.
class ScopedCurrentContext {
 public:
  ScopedCurrentContext(const DriverApi* api, CUcontext context);
  ScopedCurrentContext(const ScopedCurrentContext&) = delete;
  ScopedCurrentContext& operator=(const ScopedCurrentContext&) = delete;
  ~ScopedCurrentContext();

 private:
  const DriverApi* api_;
  CUcontext saved_ = nullptr;
  bool switched_ = false;
};

class VmmHandle {
 public:
  // cuMemCreate of `size` bytes (a multiple of the granularity) with `prop`.
  static Result<VmmHandle> Create(const DriverApi* api, uint64_t size,
                                  const CUmemAllocationProp& prop);
  // cuMemImportFromShareableHandle of a POSIX fd. The fd stays owned by the caller: the
  // driver takes its own reference, so the caller may close it right after.
  static Result<VmmHandle> ImportPosixFd(const DriverApi* api, int fd, uint64_t size);

  // cuMemExportToShareableHandle as a POSIX fd, returned CLOEXEC. The fd is an independent
  // reference to the memory: it keeps the allocation alive after the handle is released and
  // after this process exits (docs/design.md "VMM memory lifetime").
  Result<UniqueFd> ExportPosixFd() const;

  CUmemGenericAllocationHandle get() const { return owned_.get().handle; }
  uint64_t size() const { return owned_.get().size; }

 private:
  VmmHandle(const DriverApi* api, CUmemGenericAllocationHandle handle, uint64_t size)
      : owned_(api, {handle, size}) {}

  UniqueHandle<VmmHandleTraits> owned_;
};

class VaRange {
 public:
  // cuMemAddressReserve of `size` bytes aligned to `alignment` (the granularity).
  static Result<VaRange> Reserve(const DriverApi* api, uint64_t size, uint64_t alignment);

  CUdeviceptr base() const { return owned_.get().base; }
  uint64_t size() const { return owned_.get().size; }

 private:
  VaRange(const DriverApi* api, CUdeviceptr base, uint64_t size) : owned_(api, {base, size}) {}

  UniqueHandle<VaRangeTraits> owned_;
};

class MappedRange {
 public:
  // cuMemMap of all of `handle` at `ptr` (inside a VaRange that outlives the mapping). The
  // mapping holds its own reference to the memory: `handle` may be released afterwards.
  static Result<MappedRange> Map(const DriverApi* api, CUdeviceptr ptr, const VmmHandle& handle);
  // The same for a handle owned elsewhere (borrowed for the call) of `size` bytes.
  static Result<MappedRange> Map(const DriverApi* api, CUdeviceptr ptr,
                                 CUmemGenericAllocationHandle handle, uint64_t size);

  // cuMemSetAccess over this mapping for `device`. A new mapping has no access at all.
  Status SetAccess(CUdevice device, CUmemAccess_flags flags) const;

  CUdeviceptr ptr() const { return owned_.get().ptr; }
  uint64_t size() const { return owned_.get().size; }

 private:
  MappedRange(const DriverApi* api, CUdeviceptr ptr, uint64_t size) : owned_(api, {ptr, size}) {}

  UniqueHandle<MappedRangeTraits> owned_;
};

// "allocation i of n": how messages about one allocation of an arena name it.
std::string AllocationName(size_t index, size_t count);

}  // namespace weightcache::cuda
