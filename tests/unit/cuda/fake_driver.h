// FakeDriver — the one fake CUDA driver of the unit tests: a DriverApi whose entry points are
// backed by bookkeeping and host memory instead of a GPU, with failure injection ("fail the Nth
// call of function F with CUresult X") on every entry point it implements. The VMM arena tests
// use it to prove exact rollback; the upload-pipeline and checksum-launcher tests use it to
// prove ordering, cleanup and error paths. What it models:
//
//  * Contexts: primary-context retain counts per device and one current context (set with
//    cuCtxSetCurrent, or by a test through set_current_context; null at construction).
//  * VMM: handles (created or imported) over shared "memory objects", VA reservations, mappings
//    with the access flags set on them and whether they are exportable (as the real driver's
//    CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES: a mapping of a handle created with POSIX-fd
//    export is, a mapping of an imported handle never is, measured on an H200), and exported
//    POSIX fds, which are real memfds (created
//    without CLOEXEC, like a driver that does not promise it) so the fd path is real. It checks
//    the rules the real driver enforces (sizes multiple of the granularity, map only into a
//    reservation, no overlap, unmap exactly what was mapped, no free of a reservation with live
//    mappings) and counts violations instead of crashing. VMM addresses are not backed unless a
//    test asks (BackVmmMemory): then memory objects have host bytes that copies into their
//    mappings land in (queued like any copy) and copies out of them read, read back through an
//    exported fd (ExportedBytes).
//  * Memory-backed resources: cuMemAlloc and cuMemHostAlloc return host memory (a CUdeviceptr
//    from cuMemAlloc is a host address), and each kind is freed only by its own call
//    (cuMemFree, cuMemFreeHost); a wrong release call is a violation. cuMemHostRegister and
//    cuMemHostUnregister track registrations of caller memory the same way.
//  * Streams and events: cuMemcpyHtoDAsync/DtoHAsync do NOT copy when called: the copy (source
//    pointer, not bytes) is queued on its stream and runs only when something waits for it —
//    cuEventSynchronize on an event recorded after it, cuStreamSynchronize, cuStreamDestroy — or
//    when the stream has more than `max_queued` pending. So a pipeline that refills a staging
//    buffer before waiting for its copy uploads the wrong bytes, and the tests see it; freeing
//    pinned memory a queued copy still reads aborts the test binary.
//  * Kernels: cuLaunchKernel runs the checksum kernel's algorithm (the same xxh64_core.h) on
//    the host for the function cuModuleGetFunction handed out, over host memory or over
//    mapped VMM memory that is backed (BackVmmMemory).
//
//  * Devices: `device_count` devices, ordinals 0..n-1, each with a fixed UUID (UuidOf), a
//    name, 80 GiB and a PCI bus id, so the identity layer enumerates them as it does the real
//    driver's; cuCtxGetDevice names the device of the current (primary) context.
//
// Failure injection: FailCall fails the nth call of one function; FailStep fails the nth call
// of any function (the "fail at step N" sweep: run once to count the steps, then fail each).
//
// Driver entry points are plain C function pointers, so the fake installs itself as the
// process-wide "current fake" for its lifetime: one FakeDriver at a time. Its entry points and
// counters are thread-safe (the upload pipeline calls them from its threads); the accessors
// that return references (calls(), violation_log()) are for after the code under test returns.
#pragma once

#include <cuda.h>
#include <sys/types.h>

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <set>
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

  // The primary context the fake hands out for `device`.
  static CUcontext ContextOf(CUdevice device);
  // The device whose primary context `context` is (ContextOf's inverse).
  static CUdevice DeviceOf(CUcontext context);
  // The UUID cuDeviceGetUuid reports for `device` (bytes 10 11 … 1e, then the ordinal).
  static CUuuid UuidOf(CUdevice device);

  // Make the `nth` (1-based) call of `function` (e.g. "cuMemMap") return `rc` without
  // changing any state. Several failures may be armed at once.
  void FailCall(const std::string& function, int nth, CUresult rc);
  // Make the `step`-th (1-based) driver call, whatever its function, return `rc` without
  // changing any state (0: none). Calls are counted from construction (steps()).
  void FailStep(int step, CUresult rc);
  int steps() const;  // driver calls so far, cuGetErrorName/String excluded
  // Runs `hook` at the start of every call of `function`, on the calling thread and outside
  // the fake's lock (it may block: a test holds a call back to see what happens meanwhile).
  // Set before the calls it watches begin.
  void BeforeCall(const std::string& function, std::function<void()> hook);
  // Report `value` for a device attribute (default 1 for every attribute).
  void SetAttribute(CUdevice_attribute attribute, int value);
  // Queued copies per stream beyond which the oldest one runs (models a bounded queue).
  void SetMaxQueued(size_t n);

  // Every call made so far, in order, by function name (cuGetErrorName/String excluded).
  const std::vector<std::string>& calls() const { return calls_; }
  int CallCount(const std::string& function) const;
  void ClearCalls();

  // A memory object exported by "another process" (the daemon): a new memfd the fake will
  // accept in cuMemImportFromShareableHandle, for `size` bytes on `device`.
  UniqueFd ForeignExport(uint64_t size, CUdevice device);

  // Whether cuDeviceCanAccessPeer says yes for two different devices (the default), and
  // cuMemSetAccess grants a device access to another device's memory.
  void SetPeerAccess(bool allowed);

  // Memory objects created from now on get host bytes (zeros) that copies into their mappings
  // land in. For tests that check what was uploaded; keep their allocations small.
  void BackVmmMemory();
  // `length` bytes at `offset` of the backed memory object that `fd` (an fd exported by
  // cuMemExportToShareableHandle, or a duplicate of one) names; empty if it names none.
  std::string ExportedBytes(int fd, uint64_t offset, uint64_t length) const;

  // Live state.
  int live_handles() const;
  int live_reservations() const;
  int live_mappings() const;
  int context_refs(CUdevice device) const;
  int total_context_refs() const;
  int exported_fds_made() const;
  int violations() const;
  const std::vector<std::string>& violation_log() const { return violation_log_; }
  CUcontext current_context() const;
  // As if the caller's thread had made `ctx` current before calling into the library.
  void set_current_context(CUcontext ctx);
  // Whether the mapping that starts at `ptr` could be exported again (false if none): what
  // UCX's cuda_ipc asks before it hands memory to a peer.
  bool MappingExportable(CUdeviceptr ptr) const;
  // Access flags set for `device` on the mapping that starts at `ptr` (PROT_NONE if none).
  unsigned long long AccessAt(CUdeviceptr ptr, CUdevice device) const;
  // The properties last passed to cuMemCreate.
  CUmemAllocationProp last_create_prop() const;
  int live_host_buffers() const;  // cuMemHostAlloc'ed, not yet freed
  int live_host_registrations() const;
  // Forgets every registration (after a test made cuMemHostUnregister fail on purpose).
  void ClearHostRegistrations();
  int live_streams() const;
  int live_events() const;
  int live_device_allocs() const;  // cuMemAlloc'ed, not yet freed
  int loaded_modules() const;
  size_t pending_copies() const;  // queued on any stream, not yet executed
  uint64_t launched_chunks() const;

  // --- implementation of the entry points (public so the C trampolines can reach them) ---
  CUresult Hook(const char* function);
  CUresult PrimaryCtxRetain(CUcontext* ctx, CUdevice dev);
  CUresult PrimaryCtxRelease(CUdevice dev);
  CUresult CtxSetCurrent(CUcontext ctx);
  CUresult CtxGetCurrent(CUcontext* ctx);
  CUresult CtxGetDevice(CUdevice* dev);
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
  CUresult HostAlloc(void** p, size_t bytes);
  CUresult FreeHost(void* p);
  const uint8_t* KernelView(CUdeviceptr ptr, uint64_t len, std::vector<uint8_t>* zeros);
  CUresult HostRegister(void* p, size_t bytes);
  CUresult HostUnregister(void* p);
  CUresult MemAlloc(CUdeviceptr* p, size_t bytes);
  CUresult MemFree(CUdeviceptr p);
  CUresult StreamCreate(CUstream* s);
  CUresult StreamDestroy(CUstream s);
  CUresult StreamSynchronize(CUstream s);
  CUresult EventCreate(CUevent* e);
  CUresult EventDestroy(CUevent e);
  CUresult EventRecord(CUevent e, CUstream s);
  CUresult EventSynchronize(CUevent e);
  CUresult MemcpyAsync(void* dst, const void* src, size_t bytes, CUstream s);
  // Both ends device memory; a VMM end must be mapped with read-write access for the current
  // context's device (a violation otherwise, as the GPU would fault).
  CUresult MemcpyDtoDAsync(CUdeviceptr dst, CUdeviceptr src, size_t bytes, CUstream s);
  CUresult CanAccessPeer(int* can, CUdevice dev, CUdevice peer);
  CUresult ModuleLoadData(CUmodule* m, const void* image);
  CUresult ModuleUnload(CUmodule m);
  CUresult ModuleGetFunction(CUfunction* f, CUmodule m, const char* name);
  CUresult LaunchKernel(CUfunction f, unsigned grid, unsigned block, CUstream s, void** params);

 private:
  // What the checksum kernel reads at `ptr` (mu_ held): a backed VMM mapping's bytes, or host
  // memory.
  struct MemoryObject {
    uint64_t size = 0;
    CUdevice device = 0;
    bool exportable = false;
    std::vector<uint8_t> bytes;  // BackVmmMemory: the object's contents
  };
  struct Mapping {
    uint64_t size = 0;
    uint64_t memory = 0;
    std::map<CUdevice, unsigned long long> access;
    bool exportable = false;
  };
  struct Failure {
    std::string function;
    int nth;
    CUresult rc;
  };
  struct Copy {
    void* dst;
    const void* src;
    size_t bytes;
    uint64_t seq;
  };
  struct Stream {
    std::deque<Copy> queue;
    uint64_t next_seq = 1;
  };
  struct Event {
    CUstream stream = nullptr;
    uint64_t seq = 0;  // the stream position it marks
  };

  // Caller holds mu_.
  CUresult Violation(const std::string& what);
  uint64_t NewMemory(uint64_t size, CUdevice device, bool exportable);
  void RunUntil(Stream& s, uint64_t seq);  // runs queued copies of `s` up to `seq`

  DriverApi api_;
  uint64_t granularity_;
  int device_count_;
  mutable std::mutex mu_;
  std::vector<Failure> failures_;
  std::map<std::string, std::function<void()>> before_call_;
  int steps_ = 0;
  int fail_step_ = 0;
  CUresult fail_step_rc_ = CUDA_SUCCESS;
  std::map<std::string, int> call_counts_;
  std::vector<std::string> calls_;
  std::map<CUdevice_attribute, int> attributes_;
  std::map<CUdevice, int> context_refs_;
  CUcontext current_context_ = nullptr;
  // VMM.
  std::map<uint64_t, MemoryObject> memory_;  // id -> object
  bool back_vmm_ = false;
  bool peer_access_ = true;
  std::map<CUmemGenericAllocationHandle, uint64_t> handles_;  // handle -> memory id
  std::set<CUmemGenericAllocationHandle> imported_handles_;
  std::map<CUdeviceptr, uint64_t> reservations_;  // base -> size
  std::map<CUdeviceptr, Mapping> mappings_;       // ptr -> mapping
  std::map<ino_t, uint64_t> exports_;             // memfd inode -> memory id
  uint64_t next_memory_ = 1;
  CUmemGenericAllocationHandle next_handle_ = 0x100;
  CUdeviceptr next_va_ = 0x7f0000000000;
  int exported_fds_made_ = 0;
  std::vector<std::string> violation_log_;
  CUmemAllocationProp last_create_prop_ = {};
  // Memory-backed resources, streams, events, modules.
  size_t max_queued_ = size_t{1} << 20;
  std::map<void*, size_t> host_buffers_;        // cuMemHostAlloc'ed: pointer -> size
  std::map<void*, size_t> host_registrations_;  // cuMemHostRegister'ed: pointer -> size
  std::set<CUdeviceptr> device_allocs_;
  std::map<CUstream, Stream> streams_;  // nullptr key: the legacy default stream
  std::map<CUevent, Event> events_;
  std::set<CUmodule> modules_;
  uint64_t next_object_ = 0x1000;
  uint64_t launched_chunks_ = 0;
};

// Open file descriptors of this process (from /proc/self/fd), to prove none leaked.
int CountOpenFds();

}  // namespace weightcache::cuda::testing
