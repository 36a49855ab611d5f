// StagingRing — the upload pipeline's ring of pinned staging slots (cuda/upload_pipeline.h),
// made while the readers already run. Populating and pinning 16 x 32 MiB took 150-330 ms on an
// H200 (more with four daemons loading at once), all of it before the first read when the ring
// was made up front; now up to 8 maker threads make it in slot order while the readers fill
// the slots made first. Each pin (one PinnedHostBuffer) holds `group` consecutive slots:
// pinning has a fixed cost per call that the driver serializes, so 64 pins of 2 MiB cost more
// than 8 of 16 MiB.
//
// Contract:
//  * A ring made by an earlier Run() (`made`, as many pins as this ring has) is adopted whole;
//    otherwise StartMaking() starts the makers.
//  * Any pin that cannot be made fails the ring: every later Wait() returns that error (so the
//    readers stop), the makers start no further pin, and Finish() returns it.
//  * Wait() is safe from any thread; StartMaking() and Finish() are the owning thread's.
//    Finish() only once no copy reads the ring any more (after the pipeline's drain).
#pragma once

#include <cuda.h>

#include <chrono>
#include <cstddef>
#include <optional>
#include <thread>
#include <vector>

#include "common/mutex.h"
#include "cuda/driver_api.h"
#include "cuda/pinned_host_buffer.h"
#include "weightcache/status.h"

namespace weightcache::cuda {

class StagingRing {
 public:
  // `slots` of `bytes` each, `group` slots a pin (at least one).
  StagingRing(const DriverApi* api, CUcontext context, size_t slots, size_t bytes, size_t group,
              std::vector<PinnedHostBuffer> made);
  StagingRing(const StagingRing&) = delete;
  StagingRing& operator=(const StagingRing&) = delete;
  ~StagingRing() { static_cast<void>(Finish()); }

  size_t size() const { return slots_; }

  // Starts the makers of a ring not adopted whole, and returns once each has made its
  // thread's CUDA context current (or failed to): a failure there is the ring's before any
  // reader can Wait, so no copy is issued from a ring that failed at its start.
  void StartMaking();

  // Blocks until slot `slot` is made: its memory, or the ring's error.
  Result<std::byte*> Wait(size_t slot);

  // Stops the making (a pin being made is finished), joins the makers, and returns the ring's
  // pins when every one was made (the pipeline keeps them for its next Run), else the error.
  Result<std::vector<PinnedHostBuffer>> Finish();

  // From StartMaking to the last slot made (0 for an adopted ring).
  double seconds() const;

 private:
  // Maker `t` of `workers`: pins t, t + workers, ...
  void Make(size_t t, size_t workers);
  void FailLocked(Status s) WEIGHTCACHE_REQUIRES(mu_) {
    if (error_.ok()) error_ = std::move(s);
  }

  const DriverApi* const api_;
  CUcontext context_;  // set once, at construction
  const size_t bytes_;
  const size_t slots_;
  const size_t group_;  // slots per pin
  const size_t pins_;
  std::vector<std::thread> makers_;     // the StartMaking thread's only
  std::vector<PinnedHostBuffer> made_;  // an adopted ring
  mutable Mutex mu_;
  CondVar cv_;
  std::vector<std::optional<PinnedHostBuffer>> made_pins_ WEIGHTCACHE_GUARDED_BY(mu_);
  std::vector<std::byte*> data_ WEIGHTCACHE_GUARDED_BY(mu_);  // null until made
  size_t ready_ WEIGHTCACHE_GUARDED_BY(mu_) = 0;
  size_t contexts_set_ WEIGHTCACHE_GUARDED_BY(mu_) = 0;
  bool stop_ WEIGHTCACHE_GUARDED_BY(mu_) = false;
  Status error_ WEIGHTCACHE_GUARDED_BY(mu_);
  std::chrono::steady_clock::time_point started_at_ WEIGHTCACHE_GUARDED_BY(mu_);
  double seconds_ WEIGHTCACHE_GUARDED_BY(mu_) = 0;
};

}  // namespace weightcache::cuda
