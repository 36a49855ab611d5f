#include "launcher/launcher.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/epoll.h>
#include <sys/signalfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <utility>

#include "common/logging.h"
#include "launcher/ready_notice.h"
#include "os/lock_file.h"

namespace weightcache::launcher {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

constexpr uint64_t kSignalTag = UINT64_MAX;
// Or'ed into a daemon's index: the event is its ready notice, not its pidfd.
constexpr uint64_t kNoticeTag = uint64_t{1} << 62;

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

int MillisUntil(Clock::time_point t) {
  auto ms = std::chrono::duration_cast<milliseconds>(t - Clock::now()).count();
  // Round up so an epoll_wait never returns a hair before the deadline and spins.
  return static_cast<int>(std::clamp<long long>(ms + 1, 0, 1 << 30));
}

std::string Gb(uint64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f", static_cast<double>(bytes) / 1e9);
  return buf;
}

// A separator line in the daemon's log, so restarts and their causes read in order.
void AppendLogBanner(const std::string& path, const std::string& line) {
  UniqueFd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600));
  if (!fd) return;  // Spawn() reports the same failure with context.
  std::time_t t = std::time(nullptr);
  char when[32];
  std::tm tm{};
  ::localtime_r(&t, &tm);
  std::strftime(when, sizeof(when), "%Y-%m-%d %H:%M:%S", &tm);
  std::string text = std::string("=== ") + when + " weightcache launch: " + line + " ===\n";
  (void)!::write(fd.get(), text.data(), text.size());
}

std::string Describe(const DaemonSpec& spec, pid_t pid) {
  const DaemonPlacement& p = spec.placement;
  return spec.name + " (" +
         (p.local_gpu_id < 0 ? "no GPU"
                             : "GPU " + std::to_string(p.local_gpu_id) + " " + p.device_uuid) +
         ", pid " + std::to_string(pid) + ")";
}

}  // namespace

std::string_view DaemonStateName(DaemonState state) {
  switch (state) {
    case DaemonState::kStarting:
      return "starting";
    case DaemonState::kLoading:
      return "loading";
    case DaemonState::kReady:
      return "ready";
    case DaemonState::kFailed:
      return "failed";
    case DaemonState::kDraining:
      return "draining";
    case DaemonState::kExited:
      return "exited";
    case DaemonState::kStopped:
      return "stopped";
  }
  return "unknown";
}

Result<Launcher> Launcher::Create(std::vector<DaemonSpec> specs, LaunchOptions options,
                                  StateProbe state_probe, LockProbe lock_probe,
                                  SocketLocator locator) {
  if (specs.empty()) return InvalidArgument("launch plan has no daemons");
  if (!state_probe || !lock_probe) return InvalidArgument("launcher needs a state and lock probe");
  for (const auto& s : specs) {
    if (s.socket_path.empty() && !locator) {
      return InvalidArgument("daemon " + s.name + " has no socket path and no locator");
    }
  }
  if (options.poll_interval.count() <= 0 || options.ready_timeout.count() <= 0) {
    return InvalidArgument("poll interval and ready timeout must be positive");
  }
  UniqueFd epoll(::epoll_create1(EPOLL_CLOEXEC));
  if (!epoll) return IoError("epoll_create1", errno);
  return Launcher(std::move(specs), std::move(options), std::move(state_probe),
                  std::move(lock_probe), std::move(locator), std::move(epoll));
}

Launcher::Launcher(std::vector<DaemonSpec> specs, LaunchOptions options, StateProbe state_probe,
                   LockProbe lock_probe, SocketLocator locator, UniqueFd epoll)
    : options_(std::move(options)),
      state_probe_(std::move(state_probe)),
      lock_probe_(std::move(lock_probe)),
      locator_(std::move(locator)),
      epoll_(std::move(epoll)) {
  daemons_.reserve(specs.size());
  for (auto& s : specs) {
    Daemon d;
    d.spec = std::move(s);
    d.socket_path = d.spec.socket_path;
    d.lock_path = d.spec.lock_path;
    daemons_.push_back(std::move(d));
  }
}

// Children still owned here are killed and reaped by ~ChildProcess.
Launcher::~Launcher() = default;

Status Launcher::RemoveStaleFiles(const Daemon& d) {
  if (d.socket_path.empty()) return Status::Ok();  // not known (yet): the daemon cleans it
  auto held = lock_probe_(d.lock_path);
  if (!held.ok()) {
    Status s = held.status();
    return s.Context(d.spec.name + ": checking lock " + d.lock_path);
  }
  if (*held) {
    return Status(StatusCode::kAlreadyServed,
                  d.spec.name + ": " + d.socket_path + " is already served: its lock " +
                      d.lock_path +
                      " is held by a running daemon (stop it first, or use another --namespace)");
  }
  // Removed only while we hold its lock (a daemon starting meanwhile keeps its files).
  auto removed = os::RemoveIfUnlocked(d.lock_path, {d.socket_path});
  if (!removed.ok()) {
    Status s = removed.status();
    return s.Context(d.spec.name + ": removing stale socket " + d.socket_path);
  }
  return Status::Ok();
}

Status Launcher::SpawnDaemon(size_t index) {
  Daemon& d = daemons_[index];
  std::string argv_text;
  for (const auto& a : d.spec.spawn.argv) argv_text += (argv_text.empty() ? "" : " ") + a;
  AppendLogBanner(d.spec.spawn.log_path,
                  "starting " + d.spec.name +
                      (d.restarts > 0 ? " (restart " + std::to_string(d.restarts) + ")" : "") +
                      ": " + argv_text);
  // A launcher run by a service manager (NOTIFY_SOCKET) is the unit's main process: its
  // daemons must not notify in its name (a READY=1 or FDSTORE=1 of one daemon would speak for
  // the whole unit), so they get an empty NOTIFY_SOCKET, which `serve` reads as "no manager".
  SpawnOptions spawn = d.spec.spawn;
  spawn.env_overrides.emplace_back("NOTIFY_SOCKET=");
  // Its ready notice channel: a fresh one per spawn, so a restarted daemon's predecessor can
  // never speak for it (closing the old end also takes it out of the epoll set).
  d.notice.Reset();
  auto channel = MakeReadyNoticeChannel();
  if (!channel.ok()) {
    Status s = channel.status();
    return s.Context("starting daemon " + d.spec.name);
  }
  spawn.pass_fds.emplace_back(channel->daemon_end.get(), kReadyNoticeFd);
  spawn.env_overrides.push_back(std::string(kReadyNoticeEnv) + "=" +
                                std::to_string(kReadyNoticeFd));
  auto child = ChildProcess::Spawn(spawn);
  if (!child.ok()) {
    Status s = child.status();
    return s.Context("starting daemon " + d.spec.name);
  }
  channel->daemon_end.Reset();  // the child's copy is the only one left
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = index;
  if (::epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, child->pidfd(), &ev) != 0) {
    return IoError("epoll_ctl for daemon " + d.spec.name, errno);
  }
  ev.data.u64 = kNoticeTag | index;
  if (::epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, channel->launcher_end.get(), &ev) != 0) {
    return IoError("epoll_ctl for the ready notice of daemon " + d.spec.name, errno);
  }
  d.notice = std::move(channel->launcher_end);
  d.child.emplace(std::move(child).value());
  if (d.spec.socket_path.empty()) {
    // A new process: find where it publishes (normally the same path as before).
    d.socket_path.clear();
    d.lock_path.clear();
  }
  d.state = DaemonState::kStarting;
  d.last = ProbeReport{};
  d.reason.clear();
  d.exit.reset();
  d.started = Clock::now();
  d.ready_seconds = 0;
  LOG_DEBUG << "launch: started " << Describe(d.spec, d.child->pid());
  return Status::Ok();
}

Result<bool> Launcher::ReapIfExited(size_t index) {
  Daemon& d = daemons_[index];
  if (!d.child || d.child->reaped()) return false;
  WEIGHTCACHE_ASSIGN_OR_RETURN(std::optional<ExitInfo> exit, d.child->TryReap());
  if (!exit) return false;
  d.exit = *exit;
  return true;
}

void Launcher::ProbeAll() {
  const auto now = Clock::now();
  for (Daemon& d : daemons_) {
    if (!d.child || d.child->reaped()) continue;
    if (d.state != DaemonState::kStarting && d.state != DaemonState::kLoading &&
        d.state != DaemonState::kDraining) {
      continue;
    }
    if (d.socket_path.empty()) {
      auto found = locator_(d.child->pid());
      if (!found) {
        d.reason = "no socket published yet";
        continue;
      }
      d.socket_path = found->socket;
      d.lock_path = found->lock;
    }
    auto r = state_probe_(d.socket_path);
    if (!r.ok()) {
      d.reason = r.status().message();  // "not answering yet": only reported on timeout
      continue;
    }
    d.last = *r;
    d.reason.clear();
    switch (r->state) {
      case ProbeReport::State::kLoading:
        d.state = DaemonState::kLoading;
        break;
      case ProbeReport::State::kReady:
        d.state = DaemonState::kReady;
        d.ready_at = now;
        d.ready_seconds = Seconds(now - d.started);
        break;
      case ProbeReport::State::kFailed:
        d.state = DaemonState::kFailed;
        d.reason = r->reason;
        break;
      case ProbeReport::State::kDraining:
        d.state = DaemonState::kDraining;
        break;
    }
  }
}

void Launcher::StopAll() {
  std::vector<size_t> alive;
  for (size_t i = 0; i < daemons_.size(); ++i) {
    Daemon& d = daemons_[i];
    if (!d.child || d.child->reaped()) continue;
    // SIGCONT after SIGTERM: a stopped daemon (SIGSTOP, a debugger detached) must wake up to
    // act on the SIGTERM instead of sitting out the whole grace period.
    (void)d.child->Signal(SIGTERM);
    (void)d.child->Signal(SIGCONT);
    alive.push_back(i);
  }
  const auto deadline = Clock::now() + options_.stop_grace;
  // Wait on the pidfds alone: the signalfd stays out of this wait so that a pending second
  // SIGTERM cannot turn it into a busy loop.
  while (!alive.empty() && Clock::now() < deadline) {
    std::vector<pollfd> fds;
    fds.reserve(alive.size());
    for (size_t i : alive) fds.push_back({daemons_[i].child->pidfd(), POLLIN, 0});
    int n = ::poll(fds.data(), fds.size(), MillisUntil(deadline));
    if (n < 0 && errno != EINTR) break;
    std::vector<size_t> still;
    for (size_t k = 0; k < alive.size(); ++k) {
      if (fds[k].revents != 0) {
        auto exited = ReapIfExited(alive[k]);
        if (exited.ok() && *exited) continue;
      }
      still.push_back(alive[k]);
    }
    alive = std::move(still);
  }
  for (size_t i : alive) {
    Daemon& d = daemons_[i];
    LOG_WARN << "launch: " << Describe(d.spec, d.child->pid()) << " ignored SIGTERM for "
             << options_.stop_grace.count() << " ms; sending SIGKILL";
    (void)d.child->Signal(SIGKILL);
    auto exit = d.child->Wait();
    if (exit.ok()) d.exit = *exit;
  }
  for (Daemon& d : daemons_) {
    if (d.child && d.state != DaemonState::kFailed) d.state = DaemonState::kStopped;
    // The daemon removes its own files on a clean exit; after SIGKILL, or a crash, they are
    // left behind with a free lock, and nobody else will clean them until the next start.
    Status s = RemoveStaleFiles(d);
    if (!s.ok()) {
      LOG_DEBUG << "launch: leaving files of " << d.spec.name << ": " << s.ToString();
    }
  }
}

// What a daemon that exited said last: serve prints its failure as one "weightcache serve: …"
// line on stderr, which goes to its log. For exit 7 it names the lock and the pid that owns
// it, for exit 5 the bad file. "" when the log holds no such line.
std::string Launcher::LastServeError(const Daemon& d) const {
  constexpr std::string_view kPrefix = "weightcache serve: ";
  const std::vector<std::string> tail = TailLines(d.spec.spawn.log_path, options_.log_tail_lines);
  for (auto it = tail.rbegin(); it != tail.rend(); ++it) {
    if (it->starts_with(kPrefix)) return "; it said: " + it->substr(kPrefix.size());
  }
  return "";
}

Status Launcher::FailureFor(size_t index) const {
  const Daemon& d = daemons_[index];
  const pid_t pid = d.child ? d.child->pid() : -1;
  const std::string who = Describe(d.spec, pid);
  if (d.exit) {
    if (d.exit->exited() && d.exit->exit_code == kExitAlreadyServed) {
      return Status(StatusCode::kAlreadyServed,
                    "daemon " + who +
                        " exited with code 7: its identity is already served by another daemon" +
                        (d.socket_path.empty() ? std::string() : " (" + d.socket_path + ")") +
                        LastServeError(d));
    }
    // A daemon that found its checkpoint invalid (serve's exit 5) makes the launch exit 5 too:
    // restarting or retrying elsewhere will not help, and scripts can tell it apart.
    const StatusCode code = d.exit->exited() && d.exit->exit_code == kExitInvalidCheckpoint
                                ? StatusCode::kInvalidCheckpoint
                                : StatusCode::kUnavailable;
    return Status(code, "daemon " + who + " died before it was ready: " + d.exit->ToString() +
                            " (log: " + d.spec.spawn.log_path + ")" + LastServeError(d));
  }
  return Status(StatusCode::kUnavailable,
                "daemon " + who + " reported failed: " +
                    (d.reason.empty() ? std::string("(no reason given)") : d.reason) +
                    " (log: " + d.spec.spawn.log_path + ")");
}

std::vector<DaemonSnapshot> Launcher::Snapshots() const {
  const auto now = Clock::now();
  std::vector<DaemonSnapshot> out;
  out.reserve(daemons_.size());
  for (const Daemon& d : daemons_) {
    DaemonSnapshot s;
    s.name = d.spec.name;
    s.placement = d.spec.placement;
    s.socket_path = d.socket_path;
    s.log_path = d.spec.spawn.log_path;
    s.pid = d.child ? d.child->pid() : -1;
    s.state = d.state;
    s.bytes_done = d.last.bytes_done;
    s.bytes_total = d.last.bytes_total;
    if (d.child) {
      s.seconds = d.ready_seconds > 0 ? d.ready_seconds : Seconds(now - d.started);
    }
    s.bytes_per_second = s.seconds > 0 ? static_cast<double>(s.bytes_done) / s.seconds : 0;
    s.exit = d.exit;
    s.restarts = d.restarts;
    s.reason = d.reason;
    out.push_back(std::move(s));
  }
  return out;
}

LaunchReport Launcher::Finish(Status status, int failed_index) {
  LaunchReport report;
  report.status = std::move(status);
  report.daemons = Snapshots();
  report.failed_index = failed_index;
  report.stop_signal = stop_signal_;
  if (failed_index >= 0) {
    report.failed_log_tail =
        TailLines(daemons_[failed_index].spec.spawn.log_path, options_.log_tail_lines);
  }
  return report;
}

milliseconds RestartDelay(int failures, milliseconds initial, milliseconds max_delay) {
  milliseconds delay = initial;
  for (int i = 1; i < failures && delay < max_delay; ++i) delay *= 2;
  return std::min(delay, max_delay);
}

Result<int> Launcher::ReadSignal(int signal_fd) {
  signalfd_siginfo info{};
  ssize_t n;
  while ((n = ::read(signal_fd, &info, sizeof(info))) < 0 && errno == EINTR) {
  }
  if (n != static_cast<ssize_t>(sizeof(info))) return IoError("reading signalfd", errno);
  return static_cast<int>(info.ssi_signo);
}

bool Launcher::TakeNotice(uint64_t tag) {
  if (tag == kSignalTag || (tag & kNoticeTag) == 0) return false;
  Daemon& d = daemons_[tag & ~kNoticeTag];
  if (d.notice && !DrainReadyNotices(d.notice.get())) d.notice.Reset();
  return true;
}

LaunchReport Launcher::Run(int signal_fd) {
  if (signal_fd >= 0) {
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.u64 = kSignalTag;
    if (::epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, signal_fd, &ev) != 0) {
      return Finish(IoError("epoll_ctl for the signalfd", errno), -1);
    }
  }
  for (size_t i = 0; i < daemons_.size(); ++i) {
    Status s = RemoveStaleFiles(daemons_[i]);
    if (!s.ok()) return Finish(std::move(s), -1);
  }
  // --ready-timeout counts from the first spawn: the daemons' start-up is part of what it bounds.
  const auto start = Clock::now();
  const auto deadline = start + options_.ready_timeout;
  for (size_t i = 0; i < daemons_.size(); ++i) {
    Status s = SpawnDaemon(i);
    if (!s.ok()) {
      StopAll();
      return Finish(std::move(s), -1);
    }
  }

  // ---- start-up: every daemon must answer `ready` before the deadline ----
  // Probed at once, then 1, 2, 4 … ms apart up to poll_interval: a restart that adopts its
  // keeper's memory is ready some 15 ms after its spawn, and a fixed 100 ms step added most
  // of a step to what `serve --detach` and its supervisor saw; a long load settles at
  // poll_interval.
  std::chrono::milliseconds probe_gap = std::max(options_.first_probe_gap, milliseconds(1));
  epoll_event events[16];
  while (true) {
    // Readiness counts only if the probe that saw it began before the deadline: a daemon that
    // became ready after the deadline is late, however soon the launcher looked.
    const auto probe_started = Clock::now();
    ProbeAll();
    for (size_t i = 0; i < daemons_.size(); ++i) {
      if (daemons_[i].state == DaemonState::kFailed) {
        Status s = FailureFor(i);
        StopAll();
        return Finish(std::move(s), static_cast<int>(i));
      }
    }
    if (options_.on_progress) options_.on_progress(Snapshots());
    const bool all_ready = std::all_of(daemons_.begin(), daemons_.end(), [](const Daemon& d) {
      return d.state == DaemonState::kReady;
    });
    if (all_ready && probe_started < deadline) break;
    if (probe_started >= deadline) {
      std::string waiting;
      int first = -1;
      for (size_t i = 0; i < daemons_.size(); ++i) {
        const Daemon& d = daemons_[i];
        if (d.state == DaemonState::kReady) continue;
        if (first < 0) first = static_cast<int>(i);
        waiting += (waiting.empty() ? "" : "; ") + Describe(d.spec, d.child->pid()) + " " +
                   std::string(DaemonStateName(d.state));
        if (d.state == DaemonState::kLoading) {
          waiting += " " + Gb(d.last.bytes_done) + "/" + Gb(d.last.bytes_total) + " GB";
        } else if (!d.reason.empty()) {
          waiting += " (" + d.reason + ")";
        }
      }
      if (waiting.empty()) waiting = "all became ready only after the deadline";
      Status s(StatusCode::kTimeout,
               "daemons not ready after " +
                   std::to_string(options_.ready_timeout.count() / 1000.0).substr(0, 6) +
                   " s (--ready-timeout): " + waiting);
      StopAll();
      return Finish(std::move(s), first);
    }
    int n = ::epoll_wait(epoll_.get(), events, 16,
                         std::min<int>(static_cast<int>(probe_gap.count()), MillisUntil(deadline)));
    probe_gap = std::min(probe_gap * 2, options_.poll_interval);
    if (n < 0 && errno != EINTR) {
      Status s = IoError("epoll_wait", errno);
      StopAll();
      return Finish(std::move(s), -1);
    }
    for (int k = 0; k < n; ++k) {
      if (TakeNotice(events[k].data.u64)) continue;  // the next round probes at once
      if (events[k].data.u64 == kSignalTag) {
        auto sig = ReadSignal(signal_fd);
        stop_signal_ = sig.ok() ? *sig : SIGTERM;
        StopAll();
        return Finish(Status(StatusCode::kUnavailable,
                             std::string("interrupted by SIG") + ::sigabbrev_np(stop_signal_) +
                                 " before every daemon was ready; all daemons stopped"),
                      -1);
      }
      const size_t i = events[k].data.u64;
      auto exited = ReapIfExited(i);
      if (!exited.ok()) {
        StopAll();
        return Finish(exited.status(), static_cast<int>(i));
      }
      if (*exited) {
        daemons_[i].state = DaemonState::kFailed;
        Status s = FailureFor(i);
        StopAll();
        return Finish(std::move(s), static_cast<int>(i));
      }
    }
  }
  if (options_.on_ready) options_.on_ready(Snapshots());

  if (options_.mode == SupervisionMode::kExitWhenReady) {
    LaunchReport report = Finish(Status::Ok(), -1);
    // The daemons are long-lived servers in their own sessions with their own logs; from
    // here on `weightcache stop` (or SIGTERM to each) ends them.
    for (Daemon& d : daemons_) d.child->Detach();
    return report;
  }

  // ---- supervise: restart what dies, until a signal ----
  while (true) {
    auto now = Clock::now();
    int timeout = static_cast<int>(options_.poll_interval.count());
    for (const Daemon& d : daemons_) {
      if (d.restart_at) timeout = std::min(timeout, MillisUntil(*d.restart_at));
    }
    int n = ::epoll_wait(epoll_.get(), events, 16, timeout);
    if (n < 0 && errno != EINTR) {
      Status s = IoError("epoll_wait", errno);
      StopAll();
      return Finish(std::move(s), -1);
    }
    now = Clock::now();
    for (int k = 0; k < n; ++k) {
      if (TakeNotice(events[k].data.u64)) continue;  // ProbeAll below looks
      if (events[k].data.u64 == kSignalTag) {
        auto sig = ReadSignal(signal_fd);
        stop_signal_ = sig.ok() ? *sig : SIGTERM;
        LOG_INFO << "launch: SIG" << ::sigabbrev_np(stop_signal_) << " received, stopping "
                 << daemons_.size() << " daemons";
        StopAll();
        return Finish(Status::Ok(), -1);
      }
      const size_t i = events[k].data.u64;
      auto exited = ReapIfExited(i);
      if (!exited.ok() || !*exited) continue;
      Daemon& d = daemons_[i];
      d.state = DaemonState::kExited;
      ++d.consecutive_failures;
      const milliseconds delay = RestartDelay(
          d.consecutive_failures, options_.restart_backoff_initial, options_.restart_backoff_max);
      d.restart_at = now + delay;
      LOG_WARN << "launch: daemon " << Describe(d.spec, d.child->pid()) << " exited ("
               << d.exit->ToString() << "); restarting in " << delay.count() << " ms (log "
               << d.spec.spawn.log_path << ")";
    }
    for (size_t i = 0; i < daemons_.size(); ++i) {
      Daemon& d = daemons_[i];
      if (!d.restart_at || *d.restart_at > now) continue;
      d.restart_at.reset();
      ++d.restarts;
      Status s = RemoveStaleFiles(d);
      if (s.ok()) s = SpawnDaemon(i);
      if (!s.ok()) {
        ++d.consecutive_failures;
        d.restart_at = now + RestartDelay(d.consecutive_failures, options_.restart_backoff_initial,
                                          options_.restart_backoff_max);
        d.reason = s.message();
        LOG_WARN << "launch: restart of " << d.spec.name << " failed: " << s.ToString();
      }
    }
    ProbeAll();
    for (Daemon& d : daemons_) {
      if (!d.child || d.child->reaped()) continue;
      if (d.state == DaemonState::kFailed) {
        // A restarted daemon that reports failed is taken down; its exit schedules the next
        // attempt with a longer backoff.
        LOG_WARN << "launch: daemon " << d.spec.name << " reported failed: " << d.reason;
        (void)d.child->Signal(SIGTERM);
        d.state = DaemonState::kExited;
      } else if (d.state == DaemonState::kReady && d.consecutive_failures > 0 &&
                 now - d.ready_at >= options_.stable_after) {
        d.consecutive_failures = 0;
      }
    }
    if (options_.on_progress) options_.on_progress(Snapshots());
  }
}

std::string FormatProgressLine(const std::vector<DaemonSnapshot>& daemons, double elapsed_s) {
  size_t ready = 0;
  uint64_t done = 0, total = 0;
  std::string parts;
  for (const auto& d : daemons) {
    if (d.state == DaemonState::kReady) ++ready;
    done += d.bytes_done;
    total += d.bytes_total;
    char buf[96];
    if (d.state == DaemonState::kLoading && d.bytes_total > 0) {
      std::snprintf(buf, sizeof(buf), "%s %.1f GB/s %d%%", d.placement.GpuLabel().c_str(),
                    d.bytes_per_second / 1e9,
                    static_cast<int>(100.0 * static_cast<double>(d.bytes_done) /
                                     static_cast<double>(d.bytes_total)));
    } else {
      std::snprintf(buf, sizeof(buf), "%s %s", d.placement.GpuLabel().c_str(),
                    std::string(DaemonStateName(d.state)).c_str());
    }
    parts += (parts.empty() ? "" : " | ") + std::string(buf);
  }
  char head[96];
  std::snprintf(head, sizeof(head), "[launch %.1fs] %zu/%zu ready  %s/%s GB  ", elapsed_s, ready,
                daemons.size(), Gb(done).c_str(), Gb(total).c_str());
  return head + parts;
}

}  // namespace weightcache::launcher
