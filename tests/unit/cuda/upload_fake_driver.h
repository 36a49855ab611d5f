// UploadFakeDriver — a thread-safe, memory-backed DriverApi for the upload pipeline and the
// checksum launcher, with failure injection. "Device memory" is host memory (a CUdeviceptr is
// a host address). It exists to test ordering, cleanup and error paths without a GPU:
//
//  * cuMemcpyHtoDAsync does NOT copy when called: it queues the copy (source pointer, not
//    bytes) on its stream. Queued copies run only when something waits for them —
//    cuEventSynchronize on an event recorded after them, cuStreamSynchronize — or when the
//    stream has more than `max_queued` pending. So a pipeline that refills a staging buffer
//    before waiting for its copy uploads the wrong bytes, and the tests see it.
//  * cuLaunchKernel runs the checksum kernel's algorithm (the same xxh64_core.h) on the host
//    when the function is the one cuModuleGetFunction handed out.
//  * FailCall("cuEventSynchronize", 3, CUDA_ERROR_UNKNOWN) makes the 3rd call fail.
//  * Live resources are counted, so a test can assert that everything was released.
//
// The entry points are plain function pointers, so one fake at a time is installed as the
// process-wide current fake for its lifetime. Its methods may be called from any thread.
#pragma once

#include <cuda.h>

#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <string>

#include "cuda/driver_api.h"

namespace weightcache::cuda::testing {

class UploadFakeDriver {
 public:
  UploadFakeDriver();
  ~UploadFakeDriver();
  UploadFakeDriver(const UploadFakeDriver&) = delete;
  UploadFakeDriver& operator=(const UploadFakeDriver&) = delete;

  const DriverApi* api() const { return &api_; }

  void FailCall(const std::string& function, int nth, CUresult rc);
  int CallCount(const std::string& function) const;
  // No current context (cuCtxGetCurrent reports null) until set.
  void SetHasContext(bool has) { has_context_ = has; }
  // Queued copies per stream beyond which the oldest one runs (models a bounded queue).
  void SetMaxQueued(size_t n) { max_queued_ = n; }

  int live_host_buffers() const;
  int live_streams() const;
  int live_events() const;
  int live_device_allocs() const;
  int loaded_modules() const;
  size_t pending_copies() const;  // queued on any stream, not yet executed
  uint64_t launched_chunks() const { return launched_chunks_; }

  // --- entry point implementations (public for the C trampolines) ---
  CUresult Hook(const char* function);
  CUresult CtxGetCurrent(CUcontext* ctx);
  CUresult HostAlloc(void** p, size_t bytes);
  CUresult FreeHost(void* p);
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
  CUresult ModuleLoadData(CUmodule* m, const void* image);
  CUresult ModuleUnload(CUmodule m);
  CUresult ModuleGetFunction(CUfunction* f, CUmodule m, const char* name);
  CUresult LaunchKernel(CUfunction f, unsigned grid, unsigned block, CUstream s, void** params);

 private:
  struct Copy {
    void* dst;
    const void* src;
    size_t bytes;
    uint64_t seq;
  };
  struct Stream {
    std::deque<Copy> queue;
    uint64_t next_seq = 1;
    uint64_t done_seq = 0;  // copies with seq <= done_seq have run
  };
  struct Event {
    CUstream stream = nullptr;
    uint64_t seq = 0;  // the stream position it marks
  };

  // Runs queued copies of `s` up to and including `seq`. Caller holds mu_.
  void RunUntil(Stream& s, uint64_t seq);

  DriverApi api_;
  mutable std::mutex mu_;
  std::map<std::string, int> calls_;
  std::map<std::string, std::map<int, CUresult>> failures_;
  bool has_context_ = true;
  size_t max_queued_ = 1 << 20;
  std::map<void*, size_t> host_buffers_;  // pointer -> size
  std::set<CUdeviceptr> device_allocs_;
  std::map<CUstream, Stream> streams_;  // nullptr key: the legacy default stream
  std::map<CUevent, Event> events_;
  std::set<CUmodule> modules_;
  uint64_t next_handle_ = 0x1000;
  uint64_t launched_chunks_ = 0;
};

}  // namespace weightcache::cuda::testing
