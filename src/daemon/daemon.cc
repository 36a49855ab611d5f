#include "daemon/daemon.h"

#include <fcntl.h>
#include <linux/sockios.h>
#include <pthread.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <numeric>

#include "checkpoint/checkpoint.h"
#include "common/logging.h"
#include "common/mutex.h"
#include "common/test_hooks.h"
#include "cuda/tier_copy.h"
#include "daemon/byte_size.h"
#include "daemon/daemon_parts.h"
#include "daemon/load_memory.h"
#include "os/fd_passing.h"
#include "os/read_file.h"
#include "protocol/frame.h"
#include "protocol/manifest.h"
#include "sharding/planner.h"

namespace weightcache::daemon {

using protocol::CacheState;

Status EpollCtl(int epoll, int op, int fd, uint32_t events) {
  epoll_event ev{};
  ev.events = events;
  ev.data.fd = fd;
  if (::epoll_ctl(epoll, op, fd, &ev) != 0) {
    return IoError("epoll_ctl(fd " + std::to_string(fd) + ")", errno);
  }
  return Status::Ok();
}

void Wake(int eventfd) {
  const uint64_t one = 1;
  // A full counter (impossible in practice) or EINTR only loses a wakeup the next one repeats.
  ssize_t n = ::write(eventfd, &one, sizeof(one));
  (void)n;
}

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// ---- PublishedSocket --------------------------------------------------------------------------

void Daemon::SocketPathTraits::Close(NoContext /*unused*/, const std::string& path) noexcept {
  if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
    LOG_WARN << "could not remove socket " << path << ": " << std::strerror(errno);
  }
}

// ---- construction -----------------------------------------------------------------------------

Result<std::unique_ptr<Daemon>> Daemon::Create(DaemonOptions options) {
  const identity::CachePaths& paths = options.paths;
  // A daemon that serves other uids opens its directories and socket to them (0755, 0666):
  // who may talk to it is then decided by SO_PEERCRED against the allow lists (PeerAllowed).
  const bool shared = !options.allow_uids.empty() || !options.allow_gids.empty();
  WEIGHTCACHE_RETURN_IF_ERROR(identity::EnsureCacheDirs(
      paths, ::geteuid(), shared ? identity::DirAccess::kShared : identity::DirAccess::kPrivate));

  // The lock comes before anything else touches the cache's files: whoever holds it owns the
  // socket path, so everything below may replace what it finds there.
  auto lock = os::LockFile::TryAcquire(paths.lock);
  if (!lock.ok()) {
    Status status = lock.status();
    return status.Context("cache " + paths.socket);
  }
  return Publish(std::move(options), std::move(lock).value());
}

Result<std::unique_ptr<Daemon>> Daemon::CreateFromHandover(DaemonOptions options, TakenOver taken) {
  const bool shared = !options.allow_uids.empty() || !options.allow_gids.empty();
  WEIGHTCACHE_RETURN_IF_ERROR(identity::EnsureCacheDirs(
      options.paths, ::geteuid(),
      shared ? identity::DirAccess::kShared : identity::DirAccess::kPrivate));
  os::LockFile lock = std::move(taken.lock);
  WEIGHTCACHE_ASSIGN_OR_RETURN(std::unique_ptr<Daemon> daemon,
                               Publish(std::move(options), std::move(lock), taken.predecessor_pid));
  daemon->taken_over_.emplace(std::move(taken));
  return daemon;
}

Result<std::unique_ptr<Daemon>> Daemon::Publish(DaemonOptions options, os::LockFile lock,
                                                int64_t predecessor) {
  const identity::CachePaths& paths = options.paths;
  const bool shared = !options.allow_uids.empty() || !options.allow_gids.empty();
  struct stat st {};
  // Anything but a socket at the path is refused by ListenUnix (kIo, naming the path).
  if (::lstat(paths.socket.c_str(), &st) == 0 && S_ISSOCK(st.st_mode)) {
    // Lock held by us: a crashed daemon's leftover, or in an upgrade the live socket of the
    // daemon that handed us its lock. ListenUnix renames over it atomically, so clients never
    // see the path missing.
    if (predecessor > 0) {
      LOG_INFO << "taking over socket " << paths.socket << " from pid " << predecessor
               << " (it handed us its lock)";
    } else {
      LOG_INFO << "replacing stale socket " << paths.socket << " (its lock was free)";
    }
  }
  auto listen_fd = os::ListenUnix(paths.socket, shared ? 0666 : 0600, os::Blocking::kNonBlocking);
  if (!listen_fd.ok()) {
    Status status = listen_fd.status();
    return status.Context("publishing " + paths.socket);
  }
  PublishedSocket socket(std::move(listen_fd).value(), paths.socket);

  UniqueFd epoll(::epoll_create1(EPOLL_CLOEXEC));
  if (!epoll) return IoError("epoll_create1", errno);
  UniqueFd wakeup(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wakeup) return IoError("eventfd", errno);

  auto daemon = std::unique_ptr<Daemon>(new Daemon(
      std::move(options), std::move(lock), std::move(socket), std::move(epoll), std::move(wakeup)));
  daemon->socket_mode_ = shared ? 0666 : 0600;
  return daemon;
}

Daemon::Daemon(DaemonOptions options, os::LockFile lock, PublishedSocket socket, UniqueFd epoll,
               UniqueFd wakeup)
    : options_(std::move(options)),
      lock_(std::move(lock)),
      socket_(std::move(socket)),
      epoll_(std::move(epoll)),
      wakeup_(std::move(wakeup)) {
  if (!options_.metrics) {
    options_.metrics = std::make_shared<DaemonMetrics>(
        MetricsIdentity{options_.device_key, options_.config.model_id, options_.config.tier});
  }
}

void Daemon::SyncMetrics() {
  DaemonMetrics& m = *options_.metrics;
  m.SetState(state_);
  m.SetClients(clients_);
  m.SetCacheBytes(store_ ? store_->summary().resident_bytes : 0, state_ == CacheState::kDemoted);
  if (state_ == CacheState::kLoading) m.SetLoadProgress(bytes_done_.load(), bytes_total_.load());
}

void Daemon::RecordAttach(const Connection& conn, AttachResult result) {
  std::chrono::duration<double> seconds = Clock::now() - conn.hello_at;
  options_.metrics->RecordAttach(
      result, conn.greeting != Connection::Greeting::kNone ? seconds.count() : 0);
}

Daemon::~Daemon() {
  StopLoader();
  connections_.clear();
  socket_.Withdraw();  // explicit: before lock_ (a member declared earlier) is released
}

void Daemon::StopLoader() {
  cancel_.store(true);
  if (loader_.joinable()) loader_.join();
  if (committer_.joinable()) committer_.join();
  if (warmer_.joinable()) warmer_.join();      // bounded: one context creation
  if (mover_.joinable()) mover_.join();        // bounded: one copy, or a readmission (its deadline)
  if (releaser_.joinable()) releaser_.join();  // bounded: one unpin and close
}

// ---- the event loop ---------------------------------------------------------------------------

Status Daemon::Run(int signal_fd, DaemonEvents events) {
  events_ = std::move(events);
  WEIGHTCACHE_RETURN_IF_ERROR(EpollCtl(epoll_.get(), EPOLL_CTL_ADD, socket_.fd(), EPOLLIN));
  WEIGHTCACHE_RETURN_IF_ERROR(EpollCtl(epoll_.get(), EPOLL_CTL_ADD, wakeup_.get(), EPOLLIN));
  if (signal_fd >= 0) {
    WEIGHTCACHE_RETURN_IF_ERROR(EpollCtl(epoll_.get(), EPOLL_CTL_ADD, signal_fd, EPOLLIN));
  }
  load_start_ = Clock::now();
  if (taken_over_) {
    // An upgrade's successor: the cache is the one handed over, validated (upgrade.h).
    Status installed = InstallStore(std::move(taken_over_->store));
    if (!installed.ok()) return installed;
    if (events_.on_adopted) {
      events_.on_adopted("handed over by pid " + std::to_string(taken_over_->predecessor_pid) +
                         ", checksums of " + taken_over_->verified);
    }
    if (events_.on_ready) events_.on_ready(store_->summary(), SecondsSince(load_start_));
  } else if (identity::IsPublishedSource(options_.config.source)) {
    state_ = CacheState::kAwaiting;  // nothing to load: the publisher brings the weights
    LOG_INFO << "awaiting the publisher of " << options_.config.source;
    if (options_.config.tier == Tier::kGpu && options_.device.has_value()) {
      warmer_ = std::thread([this] { WarmContext(); });
    }
  } else {
    {
      MutexLock lock(result_mu_);
      loader_started_ = true;
    }
    loader_ = std::thread([this] { LoaderMain(); });
  }

  epoll_event ready[64];
  while (true) {
    SyncMetrics();
    const auto now = Clock::now();
    if (linger_until_ && state_ == CacheState::kFailed && now >= *linger_until_) {
      BeginDrain("the failed load's linger time is over");
    }
    if (state_ == CacheState::kDraining) {
      const bool flushed = std::none_of(connections_.begin(), connections_.end(),
                                        [](const auto& c) { return !c.second->outbox.empty(); });
      if (flushed || now >= *drain_until_) break;
    }
    if (handover_listen_until_ && now >= *handover_listen_until_) StopListeningAfterHandover();
    if (handed_over_until_ && !handover_listen_until_) {
      // Our connections are served when each has attached (or closed) with its replies sent:
      // the backlog accepted at the handover asked for nothing else.
      const bool served = std::all_of(connections_.begin(), connections_.end(), [](const auto& c) {
        return c.second->attached && c.second->outbox.empty();
      });
      if (served || now >= *handed_over_until_) break;
    }
    if (upgrade_ && now >= upgrade_->deadline) {
      FinishUpgrade(Status(StatusCode::kTimeout,
                           "successor pid " + std::to_string(upgrade_->successor->pid()) +
                               " did not take over within " +
                               std::to_string(options_.upgrade_timeout.count()) + " ms"));
    }
    if (accept_paused_until_ && now >= *accept_paused_until_) ResumeAccepting();
    if (sweep_at_ && now >= *sweep_at_) {
      sweep_at_.reset();
      if (Sweep(now)) ScheduleSweep();
    }
    std::optional<Clock::time_point> wake_at;
    auto wake_by = [&](const std::optional<Clock::time_point>& t) {
      if (t && (!wake_at || *t < *wake_at)) wake_at = t;
    };
    if (state_ == CacheState::kFailed) wake_by(linger_until_);
    if (state_ == CacheState::kDraining) wake_by(drain_until_);
    wake_by(handed_over_until_);
    wake_by(handover_listen_until_);
    if (upgrade_) wake_by(upgrade_->deadline);
    wake_by(accept_paused_until_);
    wake_by(sweep_at_);
    int timeout_ms = -1;
    if (wake_at) {
      auto left = std::chrono::ceil<std::chrono::milliseconds>(*wake_at - now).count();
      timeout_ms = static_cast<int>(std::clamp<int64_t>(left, 0, 60'000));
    }
    const int n = ::epoll_wait(epoll_.get(), ready, static_cast<int>(std::size(ready)), timeout_ms);
    if (n < 0) {
      if (errno == EINTR) continue;
      return IoError("epoll_wait", errno);
    }
    for (int i = 0; i < n; ++i) {
      const int fd = ready[i].data.fd;
      if (fd == socket_.fd() && state_ != CacheState::kDraining) {
        AcceptAll();
      } else if (upgrade_ && fd == upgrade_->channel.get()) {
        OnUpgradeChannel();
      } else if (fd == wakeup_.get()) {
        OnLoaderWakeup();
      } else if (fd == signal_fd) {
        OnSignal(signal_fd);
      } else if (connections_.count(fd) != 0) {
        OnConnectionEvent(fd, ready[i].events);
      }
    }
    if (!stop_requested_by_.empty()) BeginDrain(stop_requested_by_);
    if (!retired_stores_.empty() &&
        std::all_of(connections_.begin(), connections_.end(),
                    [](const auto& c) { return c.second->outbox.empty(); })) {
      retired_stores_.clear();  // no queued reply borrows their fds any more
    }
  }

  LOG_INFO << (handed_over_until_ ? "handed over" : "drained") << "; closing "
           << connections_.size() << " connection(s)";
  connections_.clear();
  StopLoader();
  // A demoted cache's pinned host copy (or one the mover finished pinning after the drain
  // began): unpinned, its context released.
  pinned_copy_.reset();
  {
    MutexLock lock(move_mu_);
    pin_result_.reset();
  }
  socket_.Withdraw();
  // Run ends by a drain or a handover. A drain is always deliberate (Stop, SIGTERM/SIGINT, a
  // failed load's linger): the kept memory goes. A crash never gets here. A handover keeps
  // it: the successor serves the same memory, which the keeper goes on holding for it.
  if (!handed_over_until_) DropKeeperAtStop();
  // A load that finished while draining still decides nothing: only a failure recorded
  // before the drain makes the exit non-zero.
  return failure_;
}

Status Daemon::InstallStore(WeightStore store) {
  // Every attach sends these few bytes plus the manifest memfd built at load: nothing is
  // encoded or copied per attach, whatever the tensor count.
  auto frame = protocol::EncodeAttachReply(store.summary().manifest.size,
                                           static_cast<uint32_t>(store.fds().size()));
  if (!frame.ok()) {
    Status status = frame.status();
    return status.Context("encoding the attach reply");
  }
  attach_frame_ = std::move(frame).value();
  if (store_) retired_stores_.push_back(std::move(*store_));
  store_.emplace(std::move(store));
  bytes_total_.store(store_->summary().tensor_bytes);
  bytes_done_.store(bytes_total_.load());
  state_ = CacheState::kReady;
  return Status::Ok();
}

void Daemon::Fail(Status failure) {
  failure_ = std::move(failure);
  state_ = CacheState::kFailed;
  linger_until_ = Clock::now() + options_.failed_linger;
  LOG_ERROR << "load failed: " << failure_.ToString() << "; answering `failed` for "
            << options_.failed_linger.count() << " ms, then exiting";
  if (events_.on_failed) events_.on_failed(failure_);
}

void Daemon::OnSignal(int signal_fd) {
  signalfd_siginfo info{};
  while (::read(signal_fd, &info, sizeof(info)) == static_cast<ssize_t>(sizeof(info))) {
    const int signo = static_cast<int>(info.ssi_signo);
    if (signo == SIGUSR2) {
      // The same upgrade as `weightcache upgrade`, its successor this daemon's own binary
      // with its own arguments (docs/upgrade.md, "SIGUSR2").
      const std::string by = "SIGUSR2 from pid " + std::to_string(info.ssi_pid);
      Status started = StartUpgrade(options_.self_binary, by, /*requester=*/0);
      if (!started.ok()) {
        LOG_WARN << by << " ignored: " << started.ToString();
      }
      continue;
    }
    if (signo == SIGHUP) {
      // The identity of a daemon is fixed for its life: there is nothing to reload, and a
      // daemon started from a terminal should survive that terminal going away.
      LOG_INFO << "SIGHUP from pid " << info.ssi_pid << " ignored (use SIGTERM to stop)";
      continue;
    }
    BeginDrain(std::string(signo == SIGINT ? "SIGINT" : "SIGTERM") + " from pid " +
               std::to_string(info.ssi_pid));
  }
}

void Daemon::BeginDrain(std::string_view reason) {
  if (state_ == CacheState::kDraining) return;
  // An upgrade in progress ends first: its successor may already listen at our path, which
  // the drain below unlinks.
  if (upgrade_) FinishUpgrade(Status(StatusCode::kUnavailable, "the daemon is draining"));
  StopListeningAfterHandover();  // handed over: the path is the successor's, never unlinked
  LOG_INFO << "draining: " << reason;
  if (events_.on_draining) events_.on_draining(reason);
  state_ = CacheState::kDraining;
  drain_until_ = Clock::now() + options_.drain_timeout;
  cancel_.store(true);
  // Stop accepting: withdraw the socket now, so nobody new finds it, and so `stop` (which
  // waits for the path to disappear) returns as soon as we are committed to exiting.
  (void)EpollCtl(epoll_.get(), EPOLL_CTL_DEL, socket_.fd(), 0);
  socket_.Withdraw();
  // Connections with nothing pending are done; the others get their replies flushed.
  std::vector<int> idle;
  for (auto& [fd, conn] : connections_) {
    if (conn->outbox.empty()) idle.push_back(fd);
    conn->closing = true;
  }
  for (int fd : idle) CloseConnection(fd);
}

}  // namespace weightcache::daemon
