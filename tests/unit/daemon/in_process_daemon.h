// InProcessDaemon — a daemon::Daemon served on a thread of the test process, with whatever Env
// the test gives it (a fake CUDA driver, faulty syscalls), so that the event loop, the load and
// the clients attaching to it all run in process, in CI, without a GPU.
//
// Start creates the daemon (lock, socket) and runs it on its own thread; WaitLoaded blocks until
// the load ended (ready or failed; no timeout: ctest's bounds a hang). Stop (also run by the
// destructor) delivers SIGTERM as the serve command's signalfd would, through a non-blocking
// pipe carrying a signalfd_siginfo, and joins the thread; it returns Run's status.
//
// Thread-safety: one test thread drives it. The Env's parts must outlive it.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "common/mutex.h"
#include "common/unique_fd.h"
#include "daemon/daemon.h"
#include "identity/resolve.h"
#include "weightcache/status.h"

namespace weightcache::testing {

// DaemonOptions for the identity `options` resolved under `env` (the same resolution `serve`
// makes), with no failed linger (a failed daemon drains at once).
Result<daemon::DaemonOptions> DaemonOptionsFor(const IdentityOptions& options,
                                               const identity::Env& env);

class InProcessDaemon {
 public:
  static Result<std::unique_ptr<InProcessDaemon>> Start(daemon::DaemonOptions options);
  // Start for the identity `options` resolved under `env` (DaemonOptionsFor), then WaitLoaded:
  // a daemon ready to attach to, or the first failing step's error.
  static Result<std::unique_ptr<InProcessDaemon>> StartLoaded(const IdentityOptions& options,
                                                              const identity::Env& env);
  ~InProcessDaemon();
  InProcessDaemon(const InProcessDaemon&) = delete;
  InProcessDaemon& operator=(const InProcessDaemon&) = delete;

  // The load's outcome: OK once ready, else the failure the daemon reports; when ready, also
  // once the loader thread has released what the load held (Daemon::WaitLoaderSettled), so
  // that the driver's books hold the cache only.
  Status WaitLoaded();
  // The load's outcome as soon as the daemon announces it (its teardown may still run).
  Status WaitReady();
  // SIGTERM, then Run's status (idempotent).
  Status Stop();

  const daemon::DaemonOptions& options() const { return daemon_->options(); }
  const std::string& socket() const { return daemon_->options().paths.socket; }

 private:
  InProcessDaemon(std::unique_ptr<daemon::Daemon> daemon, UniqueFd signal_read,
                  UniqueFd signal_write);

  std::unique_ptr<daemon::Daemon> daemon_;
  UniqueFd signal_read_;
  UniqueFd signal_write_;
  Mutex mu_;
  CondVar loaded_cv_;
  std::optional<Status> loaded_ WEIGHTCACHE_GUARDED_BY(mu_);
  std::optional<Status> run_status_;
  std::thread thread_;
};

}  // namespace weightcache::testing
