// ChildProcess — sole owner of one spawned child process, watched through a pidfd.
//
// Contract:
//  * Spawn() starts argv[0] (an absolute path, no PATH search) with the caller's environment
//    plus overrides, stdin on /dev/null, stdout and stderr appended to one log file, every
//    signal unblocked and at its default disposition (the launcher blocks SIGTERM/SIGINT for
//    its signalfd, and a blocked mask would otherwise be inherited by the daemon), in a new
//    session so a terminal's Ctrl-C reaches only the launcher, which stops daemons in order.
//  * Liveness is the pidfd: it becomes readable when the child exits (a zombie counts as
//    exited). Signals go through pidfd_send_signal, so they can never reach a recycled pid.
//    Nothing here uses kill(pid, 0).
//  * Destruction of a child that was not reaped and not Detach()ed kills it (SIGKILL) and
//    reaps it: a half-built launch never leaves a stray process. Detach() hands the process
//    over to init (the launcher's "start and exit" mode).
//  * Move-only. Not thread-safe; one owner drives it.
#pragma once

#include <sys/types.h>

#include <optional>
#include <string>
#include <vector>

#include "common/unique_fd.h"
#include "weightcache/status.h"

namespace weightcache::launcher {

struct ExitInfo {
  int exit_code = -1;  // when the child exited normally
  int signal = 0;      // when it was killed by a signal
  bool exited() const { return signal == 0; }
  // "exit code 7" / "killed by signal 9 (Killed)"
  std::string ToString() const;
};

struct SpawnOptions {
  std::vector<std::string> argv;  // argv[0] is the absolute path of the program
  // "NAME=VALUE" entries replacing or adding to the inherited environment.
  std::vector<std::string> env_overrides;
  std::string log_path;  // created 0600 if absent, appended to
};

class ChildProcess {
 public:
  static Result<ChildProcess> Spawn(const SpawnOptions& options);

  ChildProcess(ChildProcess&& other) noexcept;
  ChildProcess& operator=(ChildProcess&& other) noexcept;
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;
  ~ChildProcess();

  pid_t pid() const { return pid_; }
  // Readable (POLLIN) once the child has exited; valid until Reap/Detach/destruction.
  int pidfd() const { return pidfd_.get(); }
  bool reaped() const { return exit_.has_value(); }
  const std::optional<ExitInfo>& exit_info() const { return exit_; }

  // Send `sig` through the pidfd. Signalling a child that already exited (but is not reaped
  // yet) is not an error; signalling a reaped or detached child is kInternal.
  Status Signal(int sig);

  // Reap without blocking: the exit info if the child has exited (it is then reaped and its
  // pidfd closed), std::nullopt while it runs.
  Result<std::optional<ExitInfo>> TryReap();

  // Block until the child exits and reap it.
  Result<ExitInfo> Wait();

  // Give up ownership: the child keeps running and is never signalled or reaped by us.
  void Detach();

 private:
  ChildProcess(pid_t pid, UniqueFd pidfd) : pid_(pid), pidfd_(std::move(pidfd)) {}
  void KillAndReap();

  pid_t pid_ = -1;
  UniqueFd pidfd_;
  std::optional<ExitInfo> exit_;
};

// The last `max_lines` lines of a text file (a daemon's log), at most `max_bytes` read from
// its end. A missing file gives an empty list.
std::vector<std::string> TailLines(const std::string& path, size_t max_lines,
                                   size_t max_bytes = size_t{64} * 1024);

}  // namespace weightcache::launcher
