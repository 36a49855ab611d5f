// FakeDriver — a DriverApi whose VMM entry points are backed by bookkeeping instead of a GPU,
// with failure injection: "fail the Nth call of function F with CUresult X". It exists to
// prove exact rollback: after any failed Create/Import nothing may remain live.
//
// What it models: primary-context retain counts and the current context; VMM handles (created
// or imported) over shared "memory objects"; VA reservations; mappings (with the access flags
// set on them); exported POSIX fds, which are real memfds (created without CLOEXEC, like a
// driver that does not promise it) so the fd path — CLOEXEC, fstat checks, closing — is real.
// It also checks the rules the real driver enforces (sizes multiple of the granularity, map
// only into a reservation, no overlap, unmap exactly what was mapped, no free of a
// reservation with live mappings) and counts violations instead of crashing.
//
// Driver entry points are plain C function pointers, so the fake installs itself as the
// process-wide "current fake" for its lifetime; one FakeDriver at a time, single-threaded.
#pragma once

#include <cuda.h>
#include <sys/types.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "common/unique_fd.h"
#include "cuda/driver_api.h"

namespace weightcache::cuda::testing {

class FakeDriver {
 public:
  explicit FakeDriver(uint64_t granularity = uint64_t{2} << 20, int device_count = 2);
  ~FakeDriver();
  FakeDriver(const FakeDriver&) = delete;
  FakeDriver& operator=(const FakeDriver&) = delete;

  const DriverApi* api() const { return &api_; }

  // Make the `nth` (1-based) call of `function` (e.g. "cuMemMap") return `rc` without
  // changing any state. Several failures may be armed at once.
  void FailCall(const std::string& function, int nth, CUresult rc);
  // Report `value` for a device attribute (default 1 for every attribute).
  void SetAttribute(CUdevice_attribute attribute, int value) { attributes_[attribute] = value; }

  // Every call made so far, in order, by function name (cuGetErrorName/String excluded).
  const std::vector<std::string>& calls() const { return calls_; }
  void ClearCalls() { calls_.clear(); }

  // A memory object exported by "another process" (the daemon): a new memfd the fake will
  // accept in cuMemImportFromShareableHandle, for `size` bytes on `device`.
  UniqueFd ForeignExport(uint64_t size, CUdevice device);

  // Live state.
  int live_handles() const { return static_cast<int>(handles_.size()); }
  int live_reservations() const { return static_cast<int>(reservations_.size()); }
  int live_mappings() const { return static_cast<int>(mappings_.size()); }
  int context_refs(CUdevice device) const;
  int total_context_refs() const;
  int exported_fds_made() const { return exported_fds_made_; }
  int violations() const { return static_cast<int>(violation_log_.size()); }
  const std::vector<std::string>& violation_log() const { return violation_log_; }
  CUcontext current_context() const { return current_context_; }
  // As if the caller's thread had made `ctx` current before calling into the library.
  void set_current_context(CUcontext ctx) { current_context_ = ctx; }
  // Access flags set for `device` on the mapping that starts at `ptr` (PROT_NONE if none).
  unsigned long long AccessAt(CUdeviceptr ptr, CUdevice device) const;
  // The properties last passed to cuMemCreate.
  const CUmemAllocationProp& last_create_prop() const { return last_create_prop_; }

  // --- implementation of the entry points (public so the C trampolines can reach them) ---
  CUresult Hook(const char* function);
  CUresult PrimaryCtxRetain(CUcontext* ctx, CUdevice dev);
  CUresult PrimaryCtxRelease(CUdevice dev);
  CUresult CtxSetCurrent(CUcontext ctx);
  CUresult CtxGetCurrent(CUcontext* ctx);
  CUresult DeviceGetAttribute(int* value, CUdevice_attribute attribute, CUdevice dev);
  CUresult GetGranularity(size_t* granularity, const CUmemAllocationProp* prop);
  CUresult Create(CUmemGenericAllocationHandle* handle, size_t size,
                  const CUmemAllocationProp* prop);
  CUresult Release(CUmemGenericAllocationHandle handle);
  CUresult Export(void* shareable, CUmemGenericAllocationHandle handle,
                  CUmemAllocationHandleType type);
  CUresult Import(CUmemGenericAllocationHandle* handle, void* os_handle,
                  CUmemAllocationHandleType type);
  CUresult Reserve(CUdeviceptr* ptr, size_t size, size_t alignment);
  CUresult Free(CUdeviceptr ptr, size_t size);
  CUresult Map(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle);
  CUresult Unmap(CUdeviceptr ptr, size_t size);
  CUresult SetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc* desc, size_t count);

 private:
  struct MemoryObject {
    uint64_t size = 0;
    CUdevice device = 0;
    bool exportable = false;
  };
  struct Mapping {
    uint64_t size = 0;
    uint64_t memory = 0;
    std::map<CUdevice, unsigned long long> access;
  };
  struct Failure {
    std::string function;
    int nth;
    CUresult rc;
  };

  CUresult Violation(const std::string& what);
  uint64_t NewMemory(uint64_t size, CUdevice device, bool exportable);

  DriverApi api_;
  uint64_t granularity_;
  int device_count_;
  std::vector<Failure> failures_;
  std::map<std::string, int> call_counts_;
  std::vector<std::string> calls_;
  std::map<CUdevice_attribute, int> attributes_;
  std::map<CUdevice, int> context_refs_;
  CUcontext current_context_ = nullptr;
  std::map<uint64_t, MemoryObject> memory_;                   // id -> object
  std::map<CUmemGenericAllocationHandle, uint64_t> handles_;  // handle -> memory id
  std::map<CUdeviceptr, uint64_t> reservations_;              // base -> size
  std::map<CUdeviceptr, Mapping> mappings_;                   // ptr -> mapping
  std::map<ino_t, uint64_t> exports_;                         // memfd inode -> memory id
  uint64_t next_memory_ = 1;
  CUmemGenericAllocationHandle next_handle_ = 0x100;
  CUdeviceptr next_va_ = 0x7f0000000000;
  int exported_fds_made_ = 0;
  std::vector<std::string> violation_log_;
  CUmemAllocationProp last_create_prop_ = {};
};

// Open file descriptors of this process (from /proc/self/fd), to prove none leaked.
int CountOpenFds();

}  // namespace weightcache::cuda::testing
