// Launcher — starts the daemons of one job on this node, waits until every one answers
// `ready`, and (in supervise mode) keeps them alive. The lifecycle is in docs/launcher.md.
//
//   clean stale files → spawn all → poll states until all ready (or one dies / reports
//   failed / the deadline passes: stop all, report the culprit with its last log lines)
//   → exit-when-ready: detach, return OK
//   → supervise: restart any daemon that dies (exponential backoff), until SIGTERM/SIGINT
//
// Contract:
//  * The launcher owns its children (ChildProcess): a Launcher destroyed mid-flight, or any
//    failure path, leaves no child running; only the exit-when-ready success detaches them.
//  * Liveness is each child's pidfd in one epoll set; signals arrive through a signalfd the
//    caller (main) owns and passes to Run(). The library installs no signal handlers.
//  * Each child gets a ready notice channel (launcher/ready_notice.h) in the same epoll set: a
//    notice only makes the launcher probe now; the probe's answer decides.
//  * The daemon's state comes through StateProbe (the protocol's Status request on its
//    socket) and lock ownership through LockProbe (IsLockHeld, an F_OFD_GETLK probe that never
//    takes the lock); both are seams so the lifecycle is testable with plain processes standing in
//    for daemons.
//  * A stale socket (one whose lock is not held) is removed before a daemon starts, when its
//    path is known then, and after it stops, with its lock file, both only while we hold that
//    lock (os::RemoveIfUnlocked); a socket with a held lock is never touched. The whole
//    namespace's stale files are swept before the launch by its caller (`launch`,
//    daemon/stale_files.h).
//  * Not thread-safe: Run() drives everything on the calling thread.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "common/unique_fd.h"
#include "launcher/child_process.h"
#include "launcher/placement.h"
#include "weightcache/status.h"

namespace weightcache::launcher {

// What a daemon's socket reports (docs/design.md "Lock and readiness").
struct ProbeReport {
  enum class State { kLoading, kReady, kFailed, kDraining };
  State state = State::kLoading;
  uint64_t bytes_done = 0;
  uint64_t bytes_total = 0;
  std::string reason;  // for kFailed
};

// Ask the daemon at `socket_path` for its state. Any error (no socket yet, connection
// refused) means "not answering yet"; the launcher keeps polling until its deadline.
using StateProbe = std::function<Result<ProbeReport>(const std::string& socket_path)>;
// Whether some live process holds the OFD lock on `lock_path` (false when the file is absent).
using LockProbe = std::function<Result<bool>(const std::string& lock_path)>;

struct PublishedPaths {
  std::string socket;
  std::string lock;
};
// Finds the socket that the daemon with `pid` published (the lock file records its owner's
// pid), or std::nullopt while it has not published one yet. Used for daemons whose DaemonSpec
// leaves the paths empty: the daemon derives its digest-keyed path from the checkpoint, and
// asking it which one it took means the launcher can never disagree with it.
using SocketLocator = std::function<std::optional<PublishedPaths>(pid_t pid)>;

struct DaemonSpec {
  DaemonPlacement placement;
  std::string name;  // "tp0-pp1": used in messages, logs, progress
  SpawnOptions spawn;
  // Known in advance, or empty: then found through the SocketLocator once the daemon runs.
  std::string socket_path;
  std::string lock_path;
};

enum class DaemonState {
  kStarting,  // spawned, socket not answering yet
  kLoading,
  kReady,
  kFailed,  // reported failed, or died before ready
  kDraining,
  kExited,   // died after ready (supervise mode: waiting for its restart)
  kStopped,  // stopped by the launcher
};
std::string_view DaemonStateName(DaemonState state);

struct DaemonSnapshot {
  std::string name;
  DaemonPlacement placement;
  std::string socket_path;
  std::string log_path;
  pid_t pid = -1;
  DaemonState state = DaemonState::kStarting;
  uint64_t bytes_done = 0;
  uint64_t bytes_total = 0;
  double seconds = 0;           // from spawn to ready (or to now while not ready)
  double bytes_per_second = 0;  // bytes_done / seconds
  std::optional<ExitInfo> exit;
  int restarts = 0;
  std::string reason;  // why it failed, or the last probe error while starting
};

enum class SupervisionMode { kExitWhenReady, kSupervise };

struct LaunchOptions {
  SupervisionMode mode = SupervisionMode::kExitWhenReady;
  std::chrono::milliseconds ready_timeout{std::chrono::minutes(10)};
  // Between SIGTERM and SIGKILL when stopping.
  std::chrono::milliseconds stop_grace{std::chrono::seconds(10)};
  std::chrono::milliseconds poll_interval{std::chrono::milliseconds(100)};
  // The start-up's first gap between probes, doubled up to poll_interval: a restart that
  // adopts its keeper's memory answers within milliseconds. Between probes, a daemon's ready
  // notice (launcher/ready_notice.h) makes the launcher probe at once.
  std::chrono::milliseconds first_probe_gap{std::chrono::milliseconds(1)};
  // Restart delay in supervise mode: initial, doubled per consecutive failure, capped; the
  // count resets once a restarted daemon has stayed ready for `stable_after`.
  std::chrono::milliseconds restart_backoff_initial{std::chrono::seconds(1)};
  std::chrono::milliseconds restart_backoff_max{std::chrono::seconds(60)};
  std::chrono::milliseconds stable_after{std::chrono::seconds(30)};
  size_t log_tail_lines = 20;
  // Called after every poll round with all daemons (progress display). Optional.
  std::function<void(const std::vector<DaemonSnapshot>&)> on_progress;
  // Called once when every daemon is ready (supervise mode keeps running after). Optional.
  std::function<void(const std::vector<DaemonSnapshot>&)> on_ready;
};

struct LaunchReport {
  // OK; kTimeout (exit 6); kAlreadyServed (exit 7) when a daemon found its identity served;
  // kInvalidCheckpoint (exit 5) when a daemon exited 5; kUnavailable when a daemon died
  // otherwise or reported failed, or a signal interrupted start-up; kIo on launcher faults.
  // The message names the daemon (name, device, pid) and what happened.
  Status status;
  std::vector<DaemonSnapshot> daemons;
  int failed_index = -1;                     // the daemon the failure is about, -1 if none
  std::vector<std::string> failed_log_tail;  // its last log lines
  int stop_signal = 0;                       // SIGTERM/SIGINT that ended the run, 0 if none
};

class Launcher {
 public:
  // `locator` is required when any spec leaves its socket path empty.
  static Result<Launcher> Create(std::vector<DaemonSpec> specs, LaunchOptions options,
                                 StateProbe state_probe, LockProbe lock_probe,
                                 SocketLocator locator = nullptr);

  Launcher(Launcher&&) noexcept = default;
  Launcher& operator=(Launcher&&) noexcept = default;
  ~Launcher();

  // Run the whole lifecycle. `signal_fd` is a signalfd delivering SIGTERM/SIGINT (the
  // caller blocks them), or -1 for none. Returns once the launch failed, succeeded
  // (exit-when-ready) or was stopped by a signal (supervise: OK when every daemon had been
  // ready; during start-up a signal is a failure).
  LaunchReport Run(int signal_fd);

 private:
  struct Daemon {
    DaemonSpec spec;
    std::string socket_path;  // spec's, or discovered
    std::string lock_path;
    std::optional<ChildProcess> child;
    UniqueFd notice;  // our end of its ready notice channel, in the epoll set; may be empty
    DaemonState state = DaemonState::kStarting;
    ProbeReport last;
    std::string reason;
    std::optional<ExitInfo> exit;
    std::chrono::steady_clock::time_point started;
    std::chrono::steady_clock::time_point ready_at;
    std::optional<std::chrono::steady_clock::time_point> restart_at;
    int restarts = 0;
    int consecutive_failures = 0;
    double ready_seconds = 0;
  };

  Launcher(std::vector<DaemonSpec> specs, LaunchOptions options, StateProbe state_probe,
           LockProbe lock_probe, SocketLocator locator, UniqueFd epoll);

  Status RemoveStaleFiles(const Daemon& d);
  Status SpawnDaemon(size_t index);
  // Reap a child whose pidfd fired. Returns true if it had exited.
  Result<bool> ReapIfExited(size_t index);
  void ProbeAll();
  void StopAll();
  Status FailureFor(size_t index) const;
  std::string LastServeError(const Daemon& d) const;
  std::vector<DaemonSnapshot> Snapshots() const;
  LaunchReport Finish(Status status, int failed_index);
  Result<int> ReadSignal(int signal_fd);
  // Handles one epoll event that is a ready notice: true if it was one (drained; closed if
  // its socket failed).
  bool TakeNotice(uint64_t tag);

  std::vector<Daemon> daemons_;
  LaunchOptions options_;
  StateProbe state_probe_;
  LockProbe lock_probe_;
  SocketLocator locator_;
  UniqueFd epoll_;
  int stop_signal_ = 0;
};

// Supervise mode's restart delay after `failures` consecutive failures (>= 1): initial,
// doubled per further failure, capped at max_delay.
std::chrono::milliseconds RestartDelay(int failures, std::chrono::milliseconds initial,
                                       std::chrono::milliseconds max_delay);

// One line for a terminal: "[launch 12.3s] 3/4 ready  41.2/64.0 GB  GPU0 ready · GPU2 2.1 GB/s
// 60% · …". Pure.
std::string FormatProgressLine(const std::vector<DaemonSnapshot>& daemons, double elapsed_s);

}  // namespace weightcache::launcher
