// ChildProcess — sole owner of one spawned child process, watched through a pidfd. The one
// spawner of the project: the launcher starts its daemons with it, and the tests' TestChild
// (tests/support/child_process.h) is built on it.
//
// Contract:
//  * Spawn() starts argv[0] (an absolute path, no PATH search) with the caller's environment
//    plus overrides, every signal unblocked and at its default disposition (the launcher
//    blocks SIGTERM/SIGINT for its signalfd, a test thread may block signals too, and a
//    blocked mask would otherwise be inherited by the child). Each standard stream is the
//    parent's own, /dev/null, appended to one log file, or a pipe to the parent (Stdio). By
//    default — what the launcher gives its daemons — stdin is /dev/null, stdout and stderr go
//    to the log, and the child runs in a new session, so a terminal's Ctrl-C reaches only the
//    launcher, which stops daemons in order.
//  * Every fd this opens is CLOEXEC (the log, /dev/null, both ends of each pipe): a concurrent
//    spawn on another thread inherits none of them; the child gets its ends through dup2 only.
//  * Liveness is the pidfd: it becomes readable when the child exits (a zombie counts as
//    exited). Signals go through pidfd_send_signal, so they can never reach a recycled pid.
//    Nothing here uses kill(pid, 0).
//  * Destruction of a child that was not reaped and not Detach()ed kills it (SIGKILL) and
//    reaps it: a half-built launch never leaves a stray process. Detach() hands the process
//    over to init (the launcher's "start and exit" mode).
//  * The parent's ends of the pipes belong to the ChildProcess until TakePipes() hands them
//    over; those never taken are closed on destruction.
//  * Move-only. Not thread-safe; one owner drives it.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/unique_fd.h"
#include "common/unique_handle.h"
#include "weightcache/status.h"

namespace weightcache::launcher {

struct ExitInfo {
  int exit_code = -1;  // when the child exited normally
  int signal = 0;      // when it was killed by a signal
  bool exited() const { return signal == 0; }
  // "exit code 7" / "killed by signal 9 (Killed)"
  std::string ToString() const;
};

// Where one standard stream of the child goes.
enum class Stdio {
  kInherit,  // the parent's own
  kNull,     // /dev/null
  kLog,      // appended to SpawnOptions::log_path
  kPipe,     // a pipe to the parent, whose end TakePipes() hands over
};

// Whether the child leads a new session (setsid) or stays in the parent's process group (so
// that a signal to the parent's group, a terminal's Ctrl-C, reaches it too).
enum class Session { kNew, kInherit };

struct SpawnOptions {
  std::vector<std::string> argv;  // argv[0] is the absolute path of the program
  // "NAME=VALUE" entries replacing or adding to the inherited environment; of several for one
  // NAME, the last wins.
  std::vector<std::string> env_overrides;
  std::string log_path;  // where the kLog streams go; created 0600 if absent, appended to
  Stdio in = Stdio::kNull;
  Stdio out = Stdio::kLog;
  Stdio err = Stdio::kLog;
  Session session = Session::kNew;
  // Further fds the child gets: {parent fd, the child's fd number} (>= 3), dup2'ed after the
  // standard streams; the parent's fd stays CLOEXEC (an upgrade's handover channel).
  std::vector<std::pair<int, int>> pass_fds;
};

// The parent's ends of the streams spawned as Stdio::kPipe (the others stay invalid), CLOEXEC.
struct StdioPipes {
  UniqueFd in;   // write end of the child's stdin
  UniqueFd out;  // read end of the child's stdout
  UniqueFd err;  // read end of the child's stderr
};

// The release rule of a spawned, unreaped child, for UniqueHandle: SIGKILL through its pidfd,
// reap it, close the pidfd.
struct ChildTraits {
  struct Handle {
    pid_t pid = -1;
    int pidfd = -1;
    friend bool operator==(const Handle&, const Handle&) = default;
  };
  using Context = NoContext;
  static constexpr Handle Null() { return {}; }
  static void Close(NoContext /*unused*/, const Handle& h) noexcept;
};

class ChildProcess {
 public:
  // kInvalidArgument for an argv[0] that is not an absolute path, or a kLog stream without a
  // log_path; an I/O error naming the log, the program or the failing call when opening the
  // log or /dev/null, a pipe, the spawn or the pidfd fails (no child is left running then).
  static Result<ChildProcess> Spawn(const SpawnOptions& options);

  pid_t pid() const { return pid_; }
  // Readable (POLLIN) once the child has exited; valid until Reap/Detach/destruction.
  int pidfd() const { return child_.get().pidfd; }
  bool reaped() const { return exit_.has_value(); }
  const std::optional<ExitInfo>& exit_info() const { return exit_; }

  // Hands over the parent's ends of the pipes (invalid ones where a stream was no kPipe, and
  // all invalid on a second call).
  StdioPipes TakePipes() { return std::move(pipes_); }

  // Send `sig` through the pidfd. Signalling a child that already exited (but is not reaped
  // yet) is not an error; signalling a reaped (the message says how it ended) or detached
  // child is kInternal.
  Status Signal(int sig);

  // Reap without blocking: the exit info if the child has exited (it is then reaped and its
  // pidfd closed), std::nullopt while it runs.
  Result<std::optional<ExitInfo>> TryReap();

  // Wait in poll() on the pidfd, at most `timeout` (0: just look): the exit info as soon as
  // the child exits (it is then reaped), std::nullopt if it still runs at the deadline.
  Result<std::optional<ExitInfo>> WaitFor(std::chrono::milliseconds timeout);

  // Block until the child exits and reap it.
  Result<ExitInfo> Wait();

  // Give up ownership: the child keeps running and is never signalled or reaped by us.
  void Detach();

 private:
  ChildProcess(pid_t pid, int pidfd, StdioPipes pipes)
      : pid_(pid), pipes_(std::move(pipes)), child_(ChildTraits::Handle{pid, pidfd}) {}
  // Records how the child ended and gives up the handle (closing its pidfd): the child is
  // reaped, nothing is left to kill.
  void Reaped(int wait_status);

  pid_t pid_ = -1;  // kept once reaped (for messages); -1 once detached
  StdioPipes pipes_;
  // Declared after pipes_: destruction kills and reaps the child before its pipes close.
  UniqueHandle<ChildTraits> child_;  // empty once reaped or detached
  std::optional<ExitInfo> exit_;
};

// The last `max_lines` lines of a text file (a daemon's log), at most `max_bytes` read from
// its end. A missing file gives an empty list.
std::vector<std::string> TailLines(const std::string& path, size_t max_lines,
                                   size_t max_bytes = size_t{64} * 1024);

}  // namespace weightcache::launcher
