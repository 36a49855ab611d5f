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
#include "daemon/load_memory.h"
#include "os/fd_passing.h"
#include "os/read_file.h"
#include "protocol/frame.h"
#include "protocol/manifest.h"
#include "sharding/planner.h"

namespace weightcache::daemon {

using Clock = std::chrono::steady_clock;
using protocol::CacheState;
using protocol::MessageType;

struct Daemon::Connection {
  Connection(UniqueFd socket, os::PeerCred cred, Clock::time_point now, os::SysCalls& sys)
      : fd(std::move(socket)),
        peer(cred),
        reader(protocol::Expect::kRequest, sys),
        last_request(now) {}

  UniqueFd fd;
  os::PeerCred peer;
  protocol::FrameReader reader;
  std::deque<protocol::FrameWriter> outbox;
  bool hello_seen = false;
  bool hello_matched = false;
  Clock::time_point hello_at;     // the last Hello (the attach duration's start)
  bool mismatch_counted = false;  // this Hello's mismatch is in the metrics already
  bool attached = false;
  uint64_t id = 0;                  // unique for the daemon's life (fd numbers are reused)
  bool publishing = false;          // its arena is out or being committed: never idle-closed
  bool committing = false;          // its PublishCommit is being verified: unread until answered
  bool upgrading = false;           // its Upgrade awaits the successor: never idle-closed
  bool awaiting_promotion = false;  // its Attach waits for the promotion: unread until answered
  bool close_after_flush = false;   // after an error that ends this connection
  uint32_t armed = 0;               // the epoll mask currently registered
  Clock::time_point last_request;   // the accept, then each complete request
  bool fds_sent = false;            // an AttachReply went out: its fds may be unread
  bool held = false;                // not read until its peer reads our replies
  // Held, and its one early look done: a request that arrives while held is a cue to check at
  // once whether its peer has read our replies (it usually has: a publisher reads the arena's
  // fds before it sends its commit); if it has not, nothing is read, and no event is asked for,
  // until Sweep sees the peer catch up. At most one wake-up per hold.
  bool held_checked = false;
  std::optional<Clock::time_point> backed_up_since;  // replies queued or unread since

  std::string Describe() const {
    return "peer pid " + std::to_string(peer.pid) + " uid " + std::to_string(peer.uid);
  }
};

namespace {

// Replies a peer may leave unread in its socket before we stop reading its requests (beyond
// an AttachReply's fds, which always stop it: one set of fds in flight per connection).
constexpr int kMaxUnreadReplyBytes = 256 * 1024;
// Accept back-off after a failed accept (no fds, no memory): doubling between these.
constexpr std::chrono::milliseconds kAcceptBackoffMin{50};
constexpr std::chrono::milliseconds kAcceptBackoffMax{1000};
// At most one log line per this interval about failing accepts (with the count since).
constexpr std::chrono::seconds kAcceptLogInterval{10};

// Bytes we sent on `fd` that its peer has not read yet (SIOCOUTQ: for AF_UNIX, what our
// sends still occupy in the peer's receive queue); 0 when unknown.
int UnreadBytes(int fd) {
  int queued = 0;
  if (::ioctl(fd, SIOCOUTQ, &queued) != 0) return 0;
  return queued;
}

// Test seam (tests/adversarial/checkpoint_adversarial_test.cc): with WEIGHTCACHE_TEST_LOADED_FIFO
// naming a FIFO, the loader, once every byte is read and before it re-checks the files, opens
// that FIFO and reads it to its end. A test holds the loader there, rewrites a shard, then
// closes its end: the race of a file rewritten during a load, made deterministic. Compiled out
// of release builds (common/test_hooks.h).
void PauseAfterLoadForTest() {
  const std::optional<std::string> fifo = TestHookValue(TestHook::kLoadedFifo);
  if (!fifo) return;
  os::WaitForFifoEof(fifo->c_str());
}

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

}  // namespace

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
  options_.metrics->RecordAttach(result, conn.hello_seen ? seconds.count() : 0);
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

// ---- the loader thread ------------------------------------------------------------------------

void Daemon::LoaderMain() {
  // Named for `top -H` and for the benches, which wait for this thread to end (the load's
  // teardown runs on it after `ready`) before they read the daemon's memory.
  ::pthread_setname_np(::pthread_self(), "wc-loader");
  if (std::optional<AdoptedStore> adopted = AdoptKept()) {
    std::string how =
        (adopted->keeper_pid != 0 ? "from keeper pid " + std::to_string(adopted->keeper_pid)
                                  : std::string("from the service manager's fd store")) +
        " (loaded by pid " + std::to_string(adopted->depositor_pid) + "), checksums of " +
        adopted->verified + " (" + adopted->timings + ")";
    {
      MutexLock lock(result_mu_);
      load_result_.emplace(std::move(adopted->store));
      adopted_how_ = std::move(how);
      load_finished_ = true;
      loader_settled_ = !adopted->verify_behind.has_value();
    }
    loader_settled_cv_.NotifyAll();
    Wake(wakeup_.get());
    if (adopted->verify_behind) VerifyAdoptedBehindReady(*adopted->verify_behind);
    return;
  }
  // The keeper starts with the load, so that its fork (while this process is small), exec and
  // start are not on the ready path; it exits by itself if the load fails or we die.
  std::optional<keeper::StartingKeeper> keeper = StartKeeperForLoad();
  std::string memory;  // the loader's memory at its steps, for the log line below
  LoadLeftovers leftovers;
  Result<WeightStore> result = Load(&memory, &leftovers);
  std::optional<keeper::StartingKeeper> unused;  // the keeper of a load that did not complete
  if (result.ok()) {
    DepositLoaded(*result, std::move(keeper));
  } else {
    unused = std::move(keeper);
  }
  {
    MutexLock lock(result_mu_);
    load_result_.emplace(std::move(result));
    load_finished_ = true;
  }
  Wake(wakeup_.get());
  // The event loop announces `ready` now; what the load holds that serving does not need (the
  // gpu tier's pipeline, arena mappings and CUDA context) goes after, here, so that its
  // teardown is not on the ready path (docs/daemon.md "The load's teardown comes after ready").
  const auto teardown_start = Clock::now();
  // A failed or cancelled load's keeper holds nothing: it goes, and is waited for, so that the
  // daemon (which joins this thread before it exits) leaves none behind.
  if (unused) EndUnusedKeeper(std::move(*unused), options_.paths, options_.keeper);
  const bool had_leftovers = !leftovers.empty();
  leftovers.Release();
  // Everything the load allocated is gone now — the checkpoint with its parsed headers
  // included, and a failed load's allocations too (a failed daemon lingers): give the pages
  // back here, on the loader thread, once (load_memory.h).
  ReleaseLoadMemory();
  const double teardown_ms = SecondsSince(teardown_start) * 1e3;
  LOG_INFO << TierName(options_.config.tier)
           << " tier: load memory: " << (memory.empty() ? "" : memory + "; ")
           << "released=" << DescribeProcessMemory(ReadProcessMemory());
  if (had_leftovers) {
    LOG_INFO << "the load's pipeline, mappings and CUDA context released while serving ("
             << teardown_ms << " ms)";
  }
  {
    MutexLock lock(result_mu_);
    loader_settled_ = true;
  }
  loader_settled_cv_.NotifyAll();
}

void Daemon::WaitLoaderSettled() {
  MutexLock lock(result_mu_);
  while (loader_started_ && !loader_settled_) loader_settled_cv_.Wait(result_mu_);
}

std::optional<GpuAdoptContext> Daemon::GpuAdoptContextOf() const {
  if (options_.config.tier != Tier::kGpu || !options_.device.has_value()) return std::nullopt;
  auto driver = options_.env.load_driver();
  if (!driver.ok()) return std::nullopt;
  return GpuAdoptContext{*driver, *options_.device};
}

std::optional<AdoptedStore> Daemon::AdoptKept() {
  const KeeperLinkOptions& keeper = options_.keeper;
  if (options_.fd_store) {
    const std::optional<GpuAdoptContext> gpu = GpuAdoptContextOf();
    return options_.fd_store->Adopt(options_.config, options_.model_path, keeper,
                                    gpu ? &*gpu : nullptr);
  }
  if (!keeper.enabled) {
    LOG_INFO << "no keeper (--no-keeper): a crash of this daemon loses the loaded memory";
    return std::nullopt;
  }
  if (options_.paths.keeper_socket.empty()) {
    LOG_INFO << "no keeper: its socket path would exceed the sun_path limit (socket "
             << options_.paths.socket << "); a crash of this daemon loses the loaded memory";
    return std::nullopt;
  }
  const std::optional<GpuAdoptContext> gpu = GpuAdoptContextOf();
  return AdoptFromKeeper(options_.paths, options_.config, options_.model_path, keeper,
                         gpu ? &*gpu : nullptr);
}

void Daemon::VerifyAdoptedBehindReady(const protocol::Handoff& handoff) {
  const std::optional<GpuAdoptContext> gpu = GpuAdoptContextOf();
  const auto start = Clock::now();
  std::string timings;
  Status verified =
      VerifyKeptBehindReady(handoff, options_.config, gpu ? &*gpu : nullptr, &timings);
  if (verified.ok()) {
    LOG_INFO << "the adopted memory is verified behind ready: checksums of all "
             << handoff.manifest.tensor_count() << " tensors match (" << timings << "; "
             << SecondsSince(start) * 1e3 << " ms after ready)";
  }
  {
    MutexLock lock(result_mu_);
    if (!verified.ok()) behind_failure_ = std::move(verified);
    loader_settled_ = true;
  }
  loader_settled_cv_.NotifyAll();
  Wake(wakeup_.get());
}

std::optional<keeper::StartingKeeper> Daemon::StartKeeperForLoad() {
  if (options_.fd_store) return std::nullopt;
  auto started = StartCacheKeeper(options_.paths, options_.keeper);
  if (!started.ok()) {
    LOG_WARN << "starting the keeper with the load: " << started.status().ToString()
             << " (another try at ready)";
    return std::nullopt;
  }
  return std::move(started).value();
}

void Daemon::DepositLoaded(const WeightStore& store,
                           std::optional<keeper::StartingKeeper> started) {
  if (options_.fd_store) {
    Status deposited = options_.fd_store->Deposit(options_.config, store);
    if (!deposited.ok()) {
      LOG_WARN << "serving without the fd store: " << deposited.ToString()
               << " (a crash of this daemon loses the loaded memory)";
      return;
    }
    LOG_INFO << "deposited in the service manager's fd store: a crash of this daemon keeps the "
                "memory for its restart";
    return;
  }
  if (!options_.keeper.enabled || options_.paths.keeper_socket.empty()) return;
  const bool early = started.has_value();
  const auto start = Clock::now();
  Status deposited = DepositWithKeeper(options_.paths, options_.config, store, options_.keeper,
                                       std::move(started));
  if (!deposited.ok()) {
    LOG_WARN << "serving without a keeper: " << deposited.ToString()
             << " (a crash of this daemon loses the loaded memory)";
    return;
  }
  LOG_INFO << "deposited with the keeper " << options_.paths.keeper_socket
           << ": a crash of this daemon keeps the memory for its successor ("
           << SecondsSince(start) * 1e3 << " ms at ready; the keeper "
           << (early ? "started with the load)" : "started now)");
}

void Daemon::DropKeeperAtStop() {
  if (options_.fd_store) {
    Status removed = options_.fd_store->Remove(store_ ? store_->fds().size() : 0);
    if (removed.ok()) {
      LOG_INFO << "removed from the fd store: the cache's memory is freed once no client maps it";
    } else {
      LOG_WARN << "FDSTOREREMOVE failed: " << removed.ToString();
    }
    return;
  }
  if (!options_.keeper.enabled || options_.paths.keeper_socket.empty() ||
      identity::IsPublishedSource(options_.config.source)) {
    return;
  }
  Status dropped = DropCacheKeeper(options_.paths, options_.keeper);
  if (dropped.ok()) {
    LOG_INFO << "keeper dropped: the cache's memory is freed once no client maps it";
  } else if (dropped.code() != StatusCode::kNoDaemon) {
    LOG_WARN << "dropping the keeper failed: " << dropped.ToString();
  }
}

Result<WeightStore> Daemon::Load(std::string* memory, LoadLeftovers* leftovers) {
  WEIGHTCACHE_ASSIGN_OR_RETURN(checkpoint::Checkpoint checkpoint,
                               checkpoint::Checkpoint::Open(options_.model_path));
  // The identity (and so the socket path) was computed from the checkpoint's headers before
  // the lock; a checkpoint replaced since then would be served under the wrong identity.
  if (checkpoint.fingerprint() != options_.config.checkpoint_fingerprint) {
    return InvalidCheckpoint("checkpoint " + options_.model_path +
                             " changed while the daemon started: fingerprint " +
                             checkpoint.fingerprint() + ", identity computed from " +
                             options_.config.checkpoint_fingerprint);
  }
  if (checkpoint.files_digest() != options_.config.checkpoint_files) {
    return InvalidCheckpoint("checkpoint " + options_.model_path +
                             " changed while the daemon started: its files (checkpoint_files " +
                             checkpoint.files_digest() +
                             ") are not the ones the identity was "
                             "computed from (" +
                             options_.config.checkpoint_files + ")");
  }
  // A sharded cache loads this rank's plan only; every rank of a job refuses a checkpoint its
  // rules cannot shard alike (kInvalidCheckpoint naming the tensor and the rule).
  LoadOptions load = options_.load;
  std::optional<sharding::ShardPlan> plan;
  if (options_.shard.has_value()) {
    WEIGHTCACHE_ASSIGN_OR_RETURN(
        plan, sharding::PlanShard(checkpoint, options_.shard->rules, options_.shard->model_config,
                                  options_.shard->ranks));
    load.shard_plan = &*plan;
  }
  bytes_total_.store(plan ? plan->bytes : checkpoint.total_bytes());

  // Throttle wakeups: about every 1 % or 250 ms, whichever comes first.
  Mutex progress_mu;
  uint64_t last_reported = 0;
  Clock::time_point last_time = Clock::now();
  LoadControl control;
  control.cancel = &cancel_;
  control.leftovers = leftovers;
  control.progress = [&](uint64_t done, uint64_t total) {
    bytes_done_.store(done);
    MutexLock lock(progress_mu);
    const auto now = Clock::now();
    if (done - std::min(done, last_reported) >= total / 100 ||
        now - last_time >= std::chrono::milliseconds(250) || done == total) {
      last_reported = done;
      last_time = now;
      Wake(wakeup_.get());
    }
  };
  Result<WeightStore> store = [&] {
    if (options_.config.tier == Tier::kHost) {
      return LoadHostStore(checkpoint, load, control, memory);
    }
    if (!options_.device.has_value()) {
      return Result<WeightStore>(
          InternalError("gpu tier: no device resolved for " + options_.device_key));
    }
    load.device = *options_.device;
    auto driver = options_.env.load_driver();
    if (!driver.ok()) return Result<WeightStore>(driver.status());
    load.driver = *driver;
    return LoadGpuStore(checkpoint, load, control, memory);
  }();
  if (!store.ok()) return store;
  // The bytes are the checkpoint's only if no shard changed while they were read: a file
  // rewritten in place (same size, same header) would otherwise be served as a mix of old
  // and new bytes. Stat calls only (Checkpoint::CheckUnchanged).
  PauseAfterLoadForTest();
  Status unchanged = checkpoint.CheckUnchanged();
  if (!unchanged.ok()) return unchanged.Context("after the load");
  return store;
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

void Daemon::OnLoaderWakeup() {
  uint64_t counter = 0;
  ssize_t n = ::read(wakeup_.get(), &counter, sizeof(counter));
  (void)n;  // EAGAIN: a spurious wakeup; the state below is what matters
  OnCommitDone();
  OnMoveDone();
  std::optional<Result<WeightStore>> result;
  std::string adopted_how;
  std::optional<Status> behind_failure;
  {
    MutexLock lock(result_mu_);
    behind_failure.swap(behind_failure_);
    if (load_finished_ && load_result_) {
      result = std::move(load_result_);
      load_result_.reset();
      adopted_how = std::move(adopted_how_);
    }
  }
  if (behind_failure && state_ != CacheState::kDraining) {
    // `--adopt-verify behind`: the memory served since ready is not what was loaded. It is
    // never served again: drain (the keeper is dropped with it) and exit with the reason.
    LOG_ERROR << "the adopted memory failed its verification behind ready: "
              << behind_failure->ToString();
    failure_ = *behind_failure;
    if (events_.on_failed) events_.on_failed(failure_);
    BeginDrain("the adopted memory failed its verification behind ready");
    return;
  }
  if (!result) {
    if (state_ == CacheState::kLoading && events_.on_progress) {
      events_.on_progress(bytes_done_.load(), bytes_total_.load(), SecondsSince(load_start_));
    }
    return;
  }
  // The loader thread is not joined here: it is still releasing what the load held (above,
  // LoaderMain). StopLoader joins it.
  const double seconds = SecondsSince(load_start_);
  if (state_ == CacheState::kDraining) return;  // cancelled or irrelevant now
  if (!result->ok()) return Fail(result->status());
  Status installed = InstallStore(std::move(*result).value());
  if (!installed.ok()) return Fail(installed);
  options_.metrics->RecordLoadDone(bytes_total_.load(), seconds);
  if (events_.on_progress) {
    events_.on_progress(bytes_total_.load(), bytes_total_.load(), seconds);
  }
  if (!adopted_how.empty() && events_.on_adopted) events_.on_adopted(adopted_how);
  if (events_.on_ready) events_.on_ready(store_->summary(), seconds);
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
    conn->close_after_flush = true;
  }
  for (int fd : idle) CloseConnection(fd);
}

// ---- connections ------------------------------------------------------------------------------

bool Daemon::PeerAllowed(const os::PeerCred& peer) const {
  if (peer.uid == ::geteuid()) return true;
  if (std::find(options_.allow_uids.begin(), options_.allow_uids.end(), peer.uid) !=
      options_.allow_uids.end()) {
    return true;
  }
  return std::find(options_.allow_gids.begin(), options_.allow_gids.end(), peer.gid) !=
         options_.allow_gids.end();
}

void Daemon::AcceptAll() {
  while (true) {
    auto accepted =
        os::AcceptConnection(socket_.fd(), os::Blocking::kNonBlocking, *options_.env.syscalls);
    if (!accepted.ok()) {
      // EMFILE and friends. The listener stays readable (the connection waits in the
      // backlog), so retrying at once would spin: pause it instead.
      PauseAccepting(accepted.status());
      return;
    }
    if (!accepted->has_value()) return;
    if (accept_failures_ > 0) {
      LOG_INFO << "accepting again on " << options_.paths.socket << " after " << accept_failures_
               << " failed accept(s)";
      accept_failures_ = 0;
      accept_failures_unlogged_ = 0;
      accept_backoff_ = std::chrono::milliseconds(0);
    }
    UniqueFd fd = std::move(**accepted);
    auto cred = os::PeerCredentials(fd.get());
    if (!cred.ok()) {
      LOG_WARN << "dropping a connection without peer credentials: " << cred.status().ToString();
      continue;
    }
    auto refuse = [&](const Status& why) {
      // Best effort, one non-blocking send: a fresh socket's buffer takes a small frame.
      auto frame = protocol::EncodeError(why);
      if (frame.ok()) (void)os::SendSome(fd.get(), *frame, {}, *options_.env.syscalls);
    };
    if (!PeerAllowed(*cred)) {
      LOG_WARN << "refused connection from pid " << cred->pid << " uid " << cred->uid << " gid "
               << cred->gid << ": not our uid " << ::geteuid() << " nor in --allow-uid/--allow-gid";
      refuse(PermissionDenied(
          "peer pid " + std::to_string(cred->pid) + " uid " + std::to_string(cred->uid) +
          " is not allowed by daemon pid " + std::to_string(::getpid()) + " (same uid " +
          std::to_string(::geteuid()) + " or --allow-uid/--allow-gid required)"));
      continue;
    }
    if (connections_.size() >= options_.max_connections) {
      LOG_WARN << "refused connection from pid " << cred->pid << ": " << options_.max_connections
               << " connections open";
      refuse(Status(StatusCode::kUnavailable, "daemon has too many connections (" +
                                                  std::to_string(options_.max_connections) + ")"));
      continue;
    }
    const int raw = fd.get();
    Status added = EpollCtl(epoll_.get(), EPOLL_CTL_ADD, raw, EPOLLIN | EPOLLRDHUP);
    if (!added.ok()) {
      LOG_WARN << added.ToString();
      continue;
    }
    LOG_DEBUG << "connection from pid " << cred->pid << " uid " << cred->uid;
    auto conn =
        std::make_unique<Connection>(std::move(fd), *cred, Clock::now(), *options_.env.syscalls);
    conn->armed = EPOLLIN | EPOLLRDHUP;
    conn->id = next_connection_id_++;
    connections_.emplace(raw, std::move(conn));
    ScheduleSweep();  // its handshake deadline
  }
}

void Daemon::PauseAccepting(const Status& error) {
  const auto now = Clock::now();
  ++accept_failures_;
  accept_backoff_ = std::clamp(2 * accept_backoff_, kAcceptBackoffMin, kAcceptBackoffMax);
  accept_paused_until_ = now + accept_backoff_;
  (void)::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, socket_.fd(), nullptr);
  if (accept_failures_ == 1 || now >= accept_log_next_) {
    LOG_WARN << "accept on " << options_.paths.socket << ": " << error.ToString()
             << "; not accepting for " << accept_backoff_.count() << " ms ("
             << accept_failures_unlogged_ + 1 << " failed accept(s) since the last such line, "
             << connections_.size() << " connection(s) open)";
    accept_failures_unlogged_ = 0;
    accept_log_next_ = now + kAcceptLogInterval;
  } else {
    ++accept_failures_unlogged_;
  }
}

void Daemon::ResumeAccepting() {
  accept_paused_until_.reset();
  if (state_ == CacheState::kDraining) return;  // the listener is gone
  Status added = EpollCtl(epoll_.get(), EPOLL_CTL_ADD, socket_.fd(), EPOLLIN);
  if (!added.ok()) {
    LOG_WARN << "resuming accepts: " << added.ToString();
  }
}

void Daemon::ScheduleSweep() {
  if (sweep_at_) return;
  const auto shortest = std::min(options_.handshake_timeout, options_.stall_timeout);
  const auto tick = std::clamp<std::chrono::milliseconds>(
      shortest / 4, std::chrono::milliseconds(10), std::chrono::milliseconds(100));
  sweep_at_ = Clock::now() + tick;
}

bool Daemon::Sweep(Clock::time_point now) {
  bool again = false;
  std::vector<int> expired, caught_up;
  for (auto& [fd, conn_ptr] : connections_) {
    Connection& conn = *conn_ptr;
    const int unread = UnreadBytes(fd);
    const bool backed_up = !conn.outbox.empty() || (conn.held && unread > 0);
    if (backed_up) {
      if (!conn.backed_up_since) conn.backed_up_since = now;
      if (now - *conn.backed_up_since >= options_.stall_timeout) {
        LOG_WARN << "closing connection of " << conn.Describe() << ": its replies (" << unread
                 << " bytes in its socket, " << conn.outbox.size() << " queued) stayed unread for "
                 << options_.stall_timeout.count() << " ms (--stall-timeout)";
        expired.push_back(fd);
        continue;
      }
      again = true;
      continue;
    }
    conn.backed_up_since.reset();
    if (conn.held) {
      // Its peer caught up: read its requests again (level-triggered, so anything already
      // waiting in its socket is reported at once).
      conn.held = false;
      caught_up.push_back(fd);
    }
    if (fd == publisher_fd_ && publication_ && !conn.committing) {
      if (now - publish_begun_ >= options_.publish_timeout) {
        AbandonPublication("its publisher (pid " + std::to_string(publisher_pid_) +
                           ") did not commit within " +
                           std::to_string(options_.publish_timeout.count()) +
                           " ms of its PublishBegin (--publish-timeout)");
        expired.push_back(fd);
        continue;
      }
      again = true;
    }
    if (!conn.attached && !conn.publishing && !conn.upgrading && !conn.awaiting_promotion &&
        !conn.close_after_flush) {
      if (now - conn.last_request >= options_.handshake_timeout) {
        LOG_WARN << "closing connection of " << conn.Describe() << ": no "
                 << (conn.hello_seen ? "further " : "") << "request within "
                 << options_.handshake_timeout.count() << " ms (--handshake-timeout)";
        expired.push_back(fd);
        continue;
      }
      again = true;
    }
  }
  for (int fd : expired) CloseConnection(fd);
  for (int fd : caught_up) {
    if (auto it = connections_.find(fd); it != connections_.end()) FlushAndRearm(*it->second);
  }
  return again;
}

bool Daemon::Readable(Connection& conn) {
  if (!conn.outbox.empty() || conn.close_after_flush || conn.committing ||
      conn.awaiting_promotion) {
    return false;
  }
  const int unread = UnreadBytes(conn.fd.get());
  if ((conn.fds_sent && unread > 0) || unread > kMaxUnreadReplyBytes) {
    // Its peer has not read what we sent (an AttachReply's fds, or a pile of replies): read
    // nothing more from it until it does (Sweep checks), or until the stall timeout.
    if (conn.held) {
      conn.held_checked = true;  // woken by a request while still unread: no more wake-ups
    } else {
      conn.held = true;
      conn.held_checked = false;
      ScheduleSweep();
    }
    return false;
  }
  if (conn.held) {
    // Caught up before Sweep saw it (woken by its next request).
    conn.held = false;
    conn.backed_up_since.reset();
  }
  conn.fds_sent = false;  // all read: nothing of ours is in flight any more
  return true;
}

void Daemon::OnConnectionEvent(int fd, uint32_t events) {
  Connection& conn = *connections_.at(fd);
  if (events & EPOLLOUT) {
    FlushAndRearm(conn);
    if (connections_.count(fd) == 0) return;
  }
  // Read only while nothing is pending: one request, one reply. A client that pipelines
  // requests without reading the replies is throttled by its own socket, not our memory, and
  // never has more than one AttachReply's fds in flight (Readable).
  while (Readable(conn)) {
    auto frame = conn.reader.ReadAvailable(fd);
    if (!frame.ok()) {
      const Status& status = frame.status();
      if (status.code() == StatusCode::kUnavailable) {
        LOG_DEBUG << "connection closed by " << conn.Describe();
        CloseConnection(fd);
        return;
      }
      CloseWithError(conn, status,
                     "closing connection of " + conn.Describe() + ": " + status.ToString());
      break;
    }
    if (!frame->has_value()) break;  // need more bytes
    conn.last_request = Clock::now();
    HandleFrame(conn, **frame);
    if (!conn.outbox.empty()) FlushAndRearm(conn);
    if (connections_.count(fd) == 0) return;
  }
  if ((events & (EPOLLHUP | EPOLLERR)) && conn.outbox.empty()) {
    CloseConnection(fd);
    return;
  }
  FlushAndRearm(conn);
}

void Daemon::QueueFrame(Connection& conn, Result<std::vector<uint8_t>> frame,
                        std::vector<int> fds) {
  if (!frame.ok()) {
    // Our own reply failed to encode (e.g. a config over the frame bound): a bug or an absurd
    // input; tell the client instead of going silent.
    LOG_ERROR << "encoding a reply for " << conn.Describe() << ": " << frame.status().ToString();
    auto error = protocol::EncodeError(frame.status());
    if (!error.ok()) {
      conn.close_after_flush = true;
      return;
    }
    conn.outbox.emplace_back(std::move(error).value(), std::vector<int>{}, *options_.env.syscalls);
    return;
  }
  conn.outbox.emplace_back(std::move(frame).value(), std::move(fds), *options_.env.syscalls);
}

void Daemon::QueueError(Connection& conn, const Status& status) {
  QueueFrame(conn, protocol::EncodeError(status));
}

void Daemon::FlushAndRearm(Connection& conn) {
  const int fd = conn.fd.get();
  while (!conn.outbox.empty()) {
    auto flushed = conn.outbox.front().Flush(fd);
    if (!flushed.ok()) {
      LOG_WARN << "sending to " << conn.Describe() << ": " << flushed.status().ToString();
      CloseConnection(fd);
      return;
    }
    if (!*flushed) break;  // socket full: wait for EPOLLOUT
    conn.outbox.pop_front();
  }
  if (conn.outbox.empty() && conn.close_after_flush) {
    CloseConnection(fd);
    return;
  }
  // Held: EPOLLIN only until its one early look (held_checked), then no events but
  // EPOLLHUP/EPOLLERR (always reported) until Sweep sees its peer read; EPOLLRDHUP would
  // report a half-closed peer again and again.
  // Committing: nothing but EPOLLHUP/EPOLLERR either, until its PublishCommit is answered.
  // Awaiting a promotion: the same, until its Attach is answered.
  const uint32_t want = !conn.outbox.empty()                ? EPOLLOUT
                        : (conn.held && !conn.held_checked) ? EPOLLIN
                        : (conn.held || conn.committing || conn.awaiting_promotion)
                            ? 0u
                            : (EPOLLIN | EPOLLRDHUP);
  if (!conn.outbox.empty()) ScheduleSweep();  // its stall deadline
  if (want != conn.armed) {
    Status status = EpollCtl(epoll_.get(), EPOLL_CTL_MOD, fd, want);
    if (!status.ok()) {
      LOG_WARN << status.ToString();
      CloseConnection(fd);
      return;
    }
    conn.armed = want;
  }
}

void Daemon::CloseConnection(int fd) {
  auto it = connections_.find(fd);
  if (it == connections_.end()) return;
  if (it->second->attached) {
    --clients_;
    options_.metrics->SetClients(clients_);
    if (events_.on_clients) events_.on_clients(clients_);
  }
  if (fd == publisher_fd_) {
    AbandonPublication("its publisher (pid " + std::to_string(publisher_pid_) +
                       ") closed the connection before PublishCommit");
  }
  (void)::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, fd, nullptr);
  connections_.erase(it);  // closes the fd
}

// ---- requests ---------------------------------------------------------------------------------

void Daemon::CloseWithError(Connection& conn, const Status& status, std::string_view log_line) {
  LOG_WARN << log_line;
  QueueError(conn, status);
  conn.close_after_flush = true;
}

template <typename Reply>
void Daemon::FillLoadState(Reply& reply) const {
  reply.state = state_;
  reply.bytes_done = bytes_done_.load();
  reply.bytes_total = bytes_total_.load();
  if (!failure_.ok()) {
    reply.failure_reason = failure_.ToString();
    if (state_ == CacheState::kFailed) reply.failure_code = failure_.code();
  }
}

protocol::StatusReply Daemon::MakeStatusReply() const {
  protocol::StatusReply reply;
  FillLoadState(reply);
  // A demoted cache's memory is host RAM until its promotion.
  reply.tier = demoted_.empty() ? options_.config.tier : Tier::kHost;
  reply.device_uuid = options_.device_key;
  reply.model_id = options_.config.model_id;
  if (store_) {
    reply.tensor_count = store_->summary().tensor_count;
    reply.bytes = store_->summary().resident_bytes;
    reply.origin = store_->summary().origin;
  }
  reply.clients = clients_;
  reply.pid = ::getpid();
  reply.config_digest = options_.config.Digest();
  return reply;
}

void Daemon::HandleFrame(Connection& conn, const protocol::Frame& frame) {
  switch (frame.type) {
    case MessageType::kHello:
      HandleHello(conn, frame.payload);
      return;
    case MessageType::kStatus:
      if (DecodeEmptyRequest(conn, frame)) HandleStatus(conn);
      return;
    case MessageType::kMetrics:
      if (DecodeEmptyRequest(conn, frame)) HandleMetrics(conn);
      return;
    case MessageType::kAttach:
      if (DecodeEmptyRequest(conn, frame)) HandleAttach(conn);
      return;
    case MessageType::kStop:
      if (DecodeEmptyRequest(conn, frame)) HandleStop(conn);
      return;
    case MessageType::kEvict:
      if (DecodeEmptyRequest(conn, frame)) HandleEvict(conn);
      return;
    case MessageType::kUpgrade:
      HandleUpgrade(conn, frame.payload);
      return;
    case MessageType::kPublishBegin:
      HandlePublishBegin(conn, frame.payload);
      return;
    case MessageType::kPublishCommit:
      HandlePublishCommit(conn, frame.payload);
      return;
    default: {
      // FrameReader(kRequest) already refuses reply types; anything else is a bug here.
      Status status = ProtocolError("unexpected " + protocol::MessageTypeName(frame.type) +
                                    " frame from a client");
      CloseWithError(conn, status, conn.Describe() + ": " + status.message());
      return;
    }
  }
}

bool Daemon::DecodeEmptyRequest(Connection& conn, const protocol::Frame& frame) {
  Status empty = protocol::DecodeEmptyRequest(frame.type, frame.payload);
  if (empty.ok()) return true;
  CloseWithError(conn, empty,
                 "bad " + protocol::MessageTypeName(frame.type) + " from " + conn.Describe() +
                     ": " + empty.ToString());
  return false;
}

void Daemon::HandleHello(Connection& conn, std::span<const uint8_t> payload) {
  auto hello = protocol::DecodeHello(payload);
  if (!hello.ok()) {
    CloseWithError(conn, hello.status(),
                   "bad Hello from " + conn.Describe() + ": " + hello.status().ToString());
    return;
  }
  if (hello->protocol_version != protocol::kProtocolVersion) {
    Status status =
        ProtocolError("Hello for protocol version " + std::to_string(hello->protocol_version) +
                      "; this daemon speaks version " + std::to_string(protocol::kProtocolVersion));
    CloseWithError(conn, status, conn.Describe() + ": " + status.message());
    return;
  }
  auto theirs = identity::CacheConfig::FromJson(hello->config);
  if (!theirs.ok()) {
    Status status = theirs.status();
    status.Context("Hello config");
    CloseWithError(conn, status, "bad Hello from " + conn.Describe() + ": " + status.ToString());
    return;
  }
  protocol::HelloReply reply;
  FillLoadState(reply);
  reply.daemon_config = options_.config.ToJson();
  for (auto& d : identity::Diff(options_.config, *theirs)) {
    reply.differences.push_back({d.field, d.ours, d.theirs});
  }
  reply.match = reply.differences.empty();
  conn.hello_seen = true;
  conn.hello_matched = reply.match;
  conn.hello_at = Clock::now();
  // A miss for this cache: a client of the same model whose config differs (the client's
  // sibling scan, docs/client.md). A Hello of another model id (`ls`'s observer) is no attach.
  conn.mismatch_counted = !reply.match && theirs->model_id == options_.config.model_id;
  if (conn.mismatch_counted) RecordAttach(conn, AttachResult::kMismatch);
  LOG_DEBUG << "Hello from " << conn.Describe() << " (" << hello->client_name << "): "
            << (reply.match ? "match"
                            : std::to_string(reply.differences.size()) + " differing field(s)");
  QueueFrame(conn, protocol::EncodeHelloReply(reply));
}

void Daemon::HandleStatus(Connection& conn) {
  QueueFrame(conn, protocol::EncodeStatusReply(MakeStatusReply()));
}

void Daemon::HandleMetrics(Connection& conn) {
  const DaemonMetrics& m = *options_.metrics;
  protocol::MetricsReply reply;
  reply.hits = m.hits();
  reply.misses = m.misses();
  reply.attaches_daemon = m.attaches(AttachResult::kDaemon);
  reply.attaches_mismatch = m.attaches(AttachResult::kMismatch);
  reply.attaches_unavailable = m.attaches(AttachResult::kUnavailable);
  reply.attaches_error = m.attaches(AttachResult::kError);
  reply.last_attach_unix_ms = static_cast<uint64_t>(std::max<int64_t>(m.last_attach_unix_ms(), 0));
  reply.clients = clients_;
  QueueFrame(conn, protocol::EncodeMetricsReply(reply));
}

void Daemon::HandleAttach(Connection& conn) {
  if (!conn.hello_seen) {
    // Out of sequence: the protocol requires a Hello first, so this client is either broken
    // or probing; end the conversation.
    Status status =
        ProtocolError("Attach before a Hello (cache " + options_.config.ShortDigest() + ")");
    RecordAttach(conn, AttachResult::kError);
    CloseWithError(conn, status, conn.Describe() + ": " + status.message());
    return;
  }
  if (!conn.hello_matched) {
    // A client may send Attach right behind its Hello (docs/protocol.md §1, pipelining):
    // after a Hello that did not match, the Attach is refused as an application error; the
    // client has the HelloReply with the differences and reports those.
    LOG_DEBUG << conn.Describe() << ": Attach after a non-matching Hello refused";
    if (!conn.mismatch_counted) RecordAttach(conn, AttachResult::kMismatch);
    conn.mismatch_counted = true;
    QueueError(conn, Status(StatusCode::kMismatch,
                            "Attach refused: the Hello's config does not match this cache (" +
                                options_.config.ShortDigest() + ")"));
    return;
  }
  if (state_ == CacheState::kDemoted && stop_requested_by_.empty()) {
    // Answered once the promotion ends (FinishPromotion), within the client's own deadline: a
    // client that gives up closes its connection, which drops it from the waiters.
    conn.awaiting_promotion = true;
    promotion_waiters_.push_back(conn.id);
    if (move_ == Move::kNone) StartPromotion();
    return;
  }
  if (state_ != CacheState::kReady) {
    std::string why = "cache is " + std::string(protocol::CacheStateName(state_));
    if (state_ == CacheState::kLoading) {
      why += " (" + std::to_string(bytes_done_.load()) + "/" + std::to_string(bytes_total_.load()) +
             " bytes)";
    } else if (state_ == CacheState::kFailed) {
      why += ": " + failure_.ToString();
    } else if (state_ == CacheState::kAwaiting) {
      why += " its publisher (" + options_.config.source + ")";
    }
    RecordAttach(conn, AttachResult::kUnavailable);
    QueueError(conn, Status(StatusCode::kUnavailable, why));
    return;
  }
  // The manifest memfd first, then one fd per allocation (docs/protocol.md §4).
  std::vector<int> fds = store_->fds();
  fds.insert(fds.begin(), store_->summary().manifest.fd.get());
  // Counted before the reply is queued (it may be flushed at once), so a client that has its
  // AttachReply finds itself in the metrics.
  RecordAttach(conn, AttachResult::kDaemon);
  if (!conn.attached) {
    conn.attached = true;
    ++clients_;
    options_.metrics->SetClients(clients_);
    LOG_INFO << "attached: " << conn.Describe() << " (" << clients_ << " client(s))";
    if (events_.on_clients) events_.on_clients(clients_);
  }
  QueueFrame(conn, attach_frame_, std::move(fds));
  conn.fds_sent = true;
}

// Requests that end the daemon (Stop, Evict): only the daemon's own uid, even when --allow-uid
// lets other users attach.
bool Daemon::RequireOwner(Connection& conn, std::string_view request, std::string_view verb) {
  if (conn.peer.uid == ::geteuid()) return true;
  LOG_WARN << "refused " << request << " from " << conn.Describe();
  QueueError(conn, PermissionDenied(std::string(request) + " refused for " + conn.Describe() +
                                    ": only uid " + std::to_string(::geteuid()) +
                                    " (the daemon's owner) may " + std::string(verb) + " it"));
  return false;
}

void Daemon::HandleStop(Connection& conn) {
  if (!RequireOwner(conn, "Stop", "stop")) return;
  protocol::StopReply reply;
  reply.clients = clients_;
  QueueFrame(conn, protocol::EncodeStopReply(reply));
  stop_requested_by_ = "Stop requested by " + conn.Describe();
}

// Budget admission asks an idle cache to give its memory back (docs/budget.md). The ledger's
// view may be stale by the time the request arrives: the cache decides on its own state, here.
void Daemon::HandleEvict(Connection& conn) {
  if (!RequireOwner(conn, "Evict", "evict")) return;
  protocol::EvictReply reply;
  reply.clients = clients_;
  if (options_.pinned) {
    reply.reason = "pinned (serve --pin)";
  } else if (clients_ > 0) {
    reply.reason = std::to_string(clients_) + " client(s) attached";
  } else if (state_ == CacheState::kDemoted &&
             (move_ == Move::kDemoting || move_ == Move::kPromoting ||
              !promotion_waiters_.empty())) {
    reply.reason = move_ == Move::kDemoting ? "being demoted" : "being promoted for an attach";
  } else if (state_ == CacheState::kDemoted && stop_requested_by_.empty()) {
    reply.evicted = true;  // a demoted cache asked for its host memory: it stops
  } else if (state_ != CacheState::kReady) {
    reply.reason = "not ready (" + std::string(protocol::CacheStateName(state_)) + ")";
  } else if (!stop_requested_by_.empty()) {
    reply.reason = "already stopping";
  } else {
    reply.evicted = true;
    if (Status can = CanDemote(); can.ok()) {
      reply.reason = "demoted to host";
    } else if (options_.demotion.enabled) {
      LOG_INFO << "not demoting (" << can.message() << "): stopping instead";
    }
  }
  QueueFrame(conn, protocol::EncodeEvictReply(reply));
  if (!reply.evicted) {
    LOG_INFO << "Evict from " << conn.Describe() << " refused: " << reply.reason;
    return;
  }
  if (!reply.reason.empty()) {
    LOG_INFO << "Evict from " << conn.Describe() << ": demoting to host RAM";
    StartDemotion();
    return;
  }
  options_.metrics->RecordEviction();
  stop_requested_by_ = "evicted to make room under the device's budget, for " + conn.Describe();
}

// ---- demotion and promotion (docs/budget.md)
// -----------------------------------------------------

namespace {

std::string DescribeCopy(const cuda::TierCopyReport& report) {
  std::string text = std::to_string(report.bytes) + " bytes in " + std::to_string(report.seconds) +
                     " s (" + std::to_string(report.gb_per_s) + " GB/s)";
  if (report.unregistered > 0) {
    text += ", " + std::to_string(report.unregistered) + " chunk(s) copied unregistered";
  }
  return text;
}

}  // namespace

Result<Daemon::CopyDevice> Daemon::CacheDevice() const {
  WEIGHTCACHE_ASSIGN_OR_RETURN(const cuda::DriverApi* api, options_.env.load_driver());
  WEIGHTCACHE_ASSIGN_OR_RETURN(CUdevice device, identity::CudaDevice(api, *options_.device));
  return CopyDevice{api, device};
}

std::vector<int> Daemon::DemotedFds() const {
  std::vector<int> fds;
  fds.reserve(demoted_.size());
  for (const UniqueFd& fd : demoted_) fds.push_back(fd.get());
  return fds;
}

Status Daemon::CanDemote() const {
  if (!options_.demotion.enabled) return Status(StatusCode::kUnavailable, "no --demote host");
  if (options_.config.tier != Tier::kGpu) {
    return Status(StatusCode::kUnavailable, "a host-tier cache is in host RAM already");
  }
  if (!store_ || !options_.device.has_value()) {
    return Status(StatusCode::kUnavailable, "no loaded gpu store");
  }
  if (identity::IsPublishedSource(options_.config.source)) {
    return Status(StatusCode::kUnavailable, "a published cache is not demoted");
  }
  if (options_.demotion.host_room) {
    Status room = options_.demotion.host_room(store_->summary().resident_bytes);
    if (!room.ok()) return room;
  }
  return Status::Ok();
}

void Daemon::StartDemotion() {
  const ManifestFile& file = store_->summary().manifest;
  auto manifest =
      protocol::MapManifestMemfd(file.fd.get(), file.size, protocol::RecordCheck::kDeferred);
  if (!manifest.ok()) {
    // Our own manifest: a bug. The Evict was accepted, so the memory is given back anyway.
    LOG_ERROR << "demotion: reading the manifest: " << manifest.status().ToString()
              << "; stopping instead";
    options_.metrics->RecordEviction();
    stop_requested_by_ = "evicted (the demotion could not start)";
    return;
  }
  allocation_sizes_ = manifest->allocation_sizes();
  // The keeper's duplicates of the GPU allocations (or the fd store's) go before the copy, not
  // after it: a daemon killed in the middle of its demotion must give the memory back (the
  // Evict was accepted and the ledger counts the memory as leaving the GPU), not leave it to
  // its keeper as an orphan outside the budget. The copy reads the daemon's own fds.
  DropKeeperAtStop();
  // After the keeper let go: a kill from here on frees the memory (scripts/gpu-budget.sh step 5
  // kills on this line, so that its kill is mid-copy and never races the drop).
  LOG_INFO << "demotion: copying "
           << FormatBytes(
                  std::accumulate(allocation_sizes_.begin(), allocation_sizes_.end(), uint64_t{0}))
           << " to host RAM";
  state_ = CacheState::kDemoted;  // attaches from now on wait for the promotion
  move_ = Move::kDemoting;
  move_start_ = Clock::now();
  mover_ = std::thread([this, fds = store_->fds(), sizes = allocation_sizes_] {
    std::string how;
    Result<std::vector<UniqueFd>> result = [&]() -> Result<std::vector<UniqueFd>> {
      WEIGHTCACHE_ASSIGN_OR_RETURN(const CopyDevice gpu, CacheDevice());
      const auto& [api, device] = gpu;
      cuda::TierCopyReport report;
      auto memfds = cuda::CopyDeviceToMemfds(
          api, device, fds, sizes, "weightcache:" + options_.config.ShortDigest() + ":demoted",
          &report);
      how = DescribeCopy(report);
      return memfds;
    }();
    {
      MutexLock lock(move_mu_);
      move_result_.emplace(std::move(result));
      move_how_ = std::move(how);
    }
    Wake(wakeup_.get());
  });
}

// --demote host-pinned: the host copy registered behind the demotion (cuda::PinnedHostCopy),
// so that the promotion is DMA alone. A failure only costs the promotion its speed.
void Daemon::StartPinning() {
  move_ = Move::kPinning;
  move_start_ = Clock::now();
  mover_ = std::thread([this, memfds = DemotedFds()] {
    Result<cuda::PinnedHostCopy> result = [&]() -> Result<cuda::PinnedHostCopy> {
      WEIGHTCACHE_ASSIGN_OR_RETURN(const CopyDevice gpu, CacheDevice());
      const auto& [api, device] = gpu;
      return cuda::PinnedHostCopy::Pin(api, device, memfds, cuda::DefaultTierCopyThreads());
    }();
    {
      MutexLock lock(move_mu_);
      pin_result_.emplace(std::move(result));
    }
    Wake(wakeup_.get());
  });
}

void Daemon::StartPromotion() {
  move_ = Move::kPromoting;
  move_start_ = Clock::now();
  LOG_INFO << "promoting back to the GPU for " << promotion_waiters_.size() << " attach(es)"
           << (pinned_copy_ ? " from the pinned host copy" : "");
  // The loop leaves pinned_copy_ alone until this promotion's result is taken (OnMoveDone).
  const cuda::PinnedHostCopy* pinned = pinned_copy_ ? &*pinned_copy_ : nullptr;
  mover_ = std::thread([this, memfds = DemotedFds(), sizes = allocation_sizes_, pinned] {
    std::string how;
    Result<std::vector<UniqueFd>> result = [&]() -> Result<std::vector<UniqueFd>> {
      if (options_.demotion.readmit) {
        Status admitted = options_.demotion.readmit();
        if (!admitted.ok()) return admitted.Context("re-admission under the gpu budget");
      }
      WEIGHTCACHE_ASSIGN_OR_RETURN(const CopyDevice gpu, CacheDevice());
      const auto& [api, device] = gpu;
      cuda::TierCopyReport report;
      cuda::TierCopyOptions copy;
      copy.pinned = pinned;
      auto fds = cuda::CopyMemfdsToDevice(api, device, memfds, sizes, &report, copy);
      how = DescribeCopy(report) + (pinned != nullptr ? ", DMA from the pinned host copy" : "");
      return fds;
    }();
    {
      MutexLock lock(move_mu_);
      move_result_.emplace(std::move(result));
      move_how_ = std::move(how);
    }
    Wake(wakeup_.get());
  });
}

void Daemon::OnMoveDone() {
  std::optional<Result<std::vector<UniqueFd>>> result;
  std::optional<Result<cuda::PinnedHostCopy>> pinned;
  std::string how;
  {
    MutexLock lock(move_mu_);
    if (!move_result_ && !pin_result_) return;
    result = std::exchange(move_result_, std::nullopt);
    pinned = std::exchange(pin_result_, std::nullopt);
    how = std::move(move_how_);
  }
  if (mover_.joinable()) mover_.join();
  const Move move = std::exchange(move_, Move::kNone);
  if (state_ == CacheState::kDraining) return;  // the drain decides now; the copy just goes
  if (move == Move::kPinning) {
    FinishPinning(std::move(*pinned));
  } else if (move == Move::kDemoting) {
    FinishDemotion(std::move(*result), how);
  } else {
    FinishPromotion(std::move(*result), how);
  }
}

void Daemon::FinishDemotion(Result<std::vector<UniqueFd>> memfds, const std::string& how) {
  if (!memfds.ok()) {
    // The Evict was accepted: the GPU memory is given back by stopping, as without --demote.
    LOG_ERROR << "demotion to host RAM failed: " << memfds.status().ToString()
              << "; stopping instead";
    options_.metrics->RecordEviction();
    stop_requested_by_ = "evicted to make room under the device's budget (the demotion failed: " +
                         memfds.status().message() + ")";
    return;
  }
  // Our fds go (the keeper's went when the demotion started): the GPU memory is freed (no
  // client maps it: the cache had none).
  (void)store_->ExchangeFds({});
  demoted_ = std::move(memfds).value();
  options_.metrics->RecordDemotion();
  LOG_INFO
      << "demoted to host RAM in "
      << std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - move_start_).count()
      << " ms (copy: " << how << "); its GPU memory is freed";
  if (options_.demotion.moved) options_.demotion.moved(Tier::kHost, DemotedFds());
  if (!promotion_waiters_.empty()) {
    StartPromotion();  // an attach is waiting already: pinning first would only delay it
  } else if (options_.demotion.pin_host_copy) {
    StartPinning();
  }
}

// The host copy of a promoted cache goes on a thread of its own, so that neither the waiting
// attaches nor the other connections wait for it: unpinning and closing 16 GiB of segments took
// 2.0–3.3 s on the H200 machine (demote_bench's kept_unpin_and_close_s), and the loop did it
// before it answered the attaches that waited for the promotion.
void Daemon::ReleaseHostCopyBehind() {
  if (releaser_.joinable()) releaser_.join();  // a release one promotion ago, done by now
  releaser_ = std::thread([pinned = std::exchange(pinned_copy_, std::nullopt),
                           host = std::exchange(demoted_, {})]() mutable {
    ::pthread_setname_np(::pthread_self(), "wc-release");
    pinned.reset();  // unpinned, its context released
    host.clear();    // the segments' pages go with their last fd
  });
}

void Daemon::FinishPinning(Result<cuda::PinnedHostCopy> pinned) {
  const auto ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - move_start_).count();
  if (pinned.ok()) {
    pinned_copy_.emplace(std::move(pinned).value());
    LOG_INFO << "host copy pinned in " << ms << " ms (" << pinned_copy_->bytes() << " bytes in "
             << pinned_copy_->segments()
             << " segments): the promotion will be DMA alone; the device's CUDA context is held "
                "while demoted";
  } else {
    LOG_WARN << "pinning the host copy: " << pinned.status().ToString()
             << "; the promotion will stage its copy";
  }
  if (!promotion_waiters_.empty()) StartPromotion();
}

void Daemon::FinishPromotion(Result<std::vector<UniqueFd>> fds, const std::string& how) {
  const std::vector<uint64_t> waiters = std::exchange(promotion_waiters_, {});
  const auto ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - move_start_).count();
  Status failure;
  if (fds.ok()) {
    (void)store_->ExchangeFds(std::move(fds).value());
    ReleaseHostCopyBehind();
    state_ = CacheState::kReady;
    options_.metrics->RecordPromotion();
    LOG_INFO << "promoted back to the GPU in " << ms << " ms (copy: " << how << ")";
    if (options_.demotion.moved) options_.demotion.moved(options_.config.tier, store_->fds());
    DepositLoaded(*store_);  // a crash keeps the memory again
  } else {
    failure = Status(StatusCode::kUnavailable,
                     "cache " + options_.config.ShortDigest() +
                         " is demoted to host RAM and its promotion back to the GPU failed: " +
                         fds.status().ToString());
    LOG_ERROR << failure.message();
    // A readmission may have moved the ledger entry to the gpu tier already.
    if (options_.demotion.moved) options_.demotion.moved(Tier::kHost, DemotedFds());
  }
  for (uint64_t id : waiters) {
    for (auto& [fd, conn] : connections_) {
      if (conn->id != id) continue;
      conn->awaiting_promotion = false;
      if (failure.ok()) {
        HandleAttach(*conn);
      } else {
        RecordAttach(*conn, AttachResult::kUnavailable);
        QueueError(*conn, failure);
      }
      FlushAndRearm(*conn);  // may close it: the loop ends here either way
      break;
    }
  }
}

// ---- upgrade (docs/upgrade.md) -----------------------------------------------------------------

namespace {

// After a handover, how long we keep accepting connects that resolved the socket path just
// before the successor's rename (they reach our listener within microseconds of it).
constexpr std::chrono::milliseconds kHandoverAcceptGrace{50};

// A successor whose channel failed (EOF, EPIPE): it exited or crashed before taking over.
Status SuccessorGone(pid_t pid, const Status& how) {
  const bool closed = how.code() == StatusCode::kUnavailable || how.code() == StatusCode::kIo;
  return Status(closed ? StatusCode::kInternal : how.code(),
                "successor pid " + std::to_string(pid) +
                    " ended the handover without taking over (" + how.message() + ")");
}

}  // namespace

void Daemon::HandleUpgrade(Connection& conn, std::span<const uint8_t> payload) {
  auto request = protocol::DecodeUpgradeRequest(payload);
  if (!request.ok()) {
    CloseWithError(conn, request.status(),
                   "bad Upgrade from " + conn.Describe() + ": " + request.status().ToString());
    return;
  }
  // Only the daemon's own uid: the successor runs as this daemon, with its memory.
  if (conn.peer.uid != ::geteuid()) {
    LOG_WARN << "refused Upgrade from " << conn.Describe();
    QueueError(conn, PermissionDenied("Upgrade refused for " + conn.Describe() + ": only uid " +
                                      std::to_string(::geteuid()) +
                                      " (the daemon's owner) may upgrade it"));
    return;
  }
  const std::string binary = request->binary.empty() ? options_.self_binary : request->binary;
  Status started = StartUpgrade(binary, conn.Describe(), conn.id);
  if (!started.ok()) {
    QueueError(conn, started);
    return;
  }
  if (upgrade_) conn.upgrading = true;
}

Status Daemon::StartUpgrade(const std::string& binary, const std::string& requested_by,
                            uint64_t requester) {
  if (!options_.start_successor) {
    return Status(StatusCode::kUnavailable,
                  "this daemon was not started by `weightcache serve`: it has no binary to "
                  "start a successor from");
  }
  if (upgrade_) {
    return Status(StatusCode::kUnavailable, "an upgrade is in progress (successor pid " +
                                                std::to_string(upgrade_->successor->pid()) + ")");
  }
  if (state_ != CacheState::kReady || !store_) {
    return Status(StatusCode::kUnavailable,
                  "cache " + options_.config.ShortDigest() + " is " +
                      std::string(protocol::CacheStateName(state_)) +
                      ": only a ready cache is handed over (a loading daemon restarts "
                      "as fast as its successor would load)");
  }
  if (publication_ || committing_conn_ != 0) {
    return Status(StatusCode::kUnavailable,
                  "a publish is in progress (pid " + std::to_string(publisher_pid_) + ")");
  }
  auto fail = [&](const Status& why) {
    LOG_WARN << "upgrade requested by " << requested_by << " failed: " << why.ToString();
    return why;
  };
  int pair[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair) != 0) {
    return fail(IoError("socketpair for the upgrade channel", errno));
  }
  UniqueFd ours(pair[0]);
  UniqueFd theirs(pair[1]);
  const auto started = Clock::now();
  if (events_.on_handing_over) events_.on_handing_over();
  auto successor = options_.start_successor(binary, theirs.get());
  if (!successor.ok()) {
    if (events_.on_handover_failed) events_.on_handover_failed();
    Status status = successor.status();
    return fail(status.Context("starting successor " + binary));
  }
  theirs.Reset();  // the successor has its own copy: its exit is our EOF
  LOG_INFO << "upgrade requested by " << requested_by << ": successor pid " << (*successor)->pid()
           << " (" << binary << ") takes the handover";
  upgrade_.emplace(PendingUpgrade{std::move(successor).value(), std::move(ours), requester, started,
                                  started + options_.upgrade_timeout});
  Status sent = SendHandover(upgrade_->channel.get(), options_.config, *store_, lock_.fd(),
                             std::chrono::milliseconds(5'000));
  if (!sent.ok()) {
    FinishUpgrade(SuccessorGone(upgrade_->successor->pid(), sent));
    return Status::Ok();  // FinishUpgrade answered the requester
  }
  Status added = EpollCtl(epoll_.get(), EPOLL_CTL_ADD, upgrade_->channel.get(), EPOLLIN);
  if (!added.ok()) FinishUpgrade(added);
  return Status::Ok();
}

void Daemon::OnUpgradeChannel() {
  auto frame = protocol::ReadFrame(upgrade_->channel.get(), protocol::Expect::kKeeperReply,
                                   os::Deadline::After(std::chrono::milliseconds(1'000)));
  if (!frame.ok()) return FinishUpgrade(SuccessorGone(upgrade_->successor->pid(), frame.status()));
  if (frame->type == MessageType::kError) {
    auto error = protocol::DecodeError(frame->payload);
    if (!error.ok()) return FinishUpgrade(error.status());
    return FinishUpgrade(Status(error->code, "successor pid " +
                                                 std::to_string(upgrade_->successor->pid()) +
                                                 " refused the handover: " + error->message));
  }
  if (frame->type != MessageType::kHandoverDone ||
      !protocol::CheckEmptyHandoff(frame->type, frame->payload).ok()) {
    return FinishUpgrade(
        ProtocolError("successor pid " + std::to_string(upgrade_->successor->pid()) + " sent " +
                      protocol::MessageTypeName(frame->type) + " instead of HandoverDone"));
  }
  FinishUpgrade(Status::Ok());
}

void Daemon::FinishUpgrade(const Status& result) {
  PendingUpgrade upgrade = std::move(*upgrade_);
  upgrade_.reset();
  (void)::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, upgrade.channel.get(), nullptr);
  const pid_t pid = upgrade.successor->pid();
  Connection* requester = nullptr;
  for (auto& [fd, conn] : connections_) {
    if (conn->id == upgrade.requester) requester = conn.get();
  }
  if (requester != nullptr) {
    requester->upgrading = false;
    requester->last_request = Clock::now();
  }
  if (!result.ok()) {
    upgrade.successor.reset();  // killed and reaped: it can no longer touch the path
    // It may have renamed its socket over ours before it died: publish ours again (we hold
    // the lock, so the path is ours), after taking what waits in our backlog.
    AcceptAll();
    auto listen_fd =
        os::ListenUnix(options_.paths.socket, socket_mode_, os::Blocking::kNonBlocking);
    if (listen_fd.ok()) {
      (void)::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, socket_.fd(), nullptr);
      socket_.ReplaceFd(std::move(listen_fd).value());
      if (!accept_paused_until_) (void)EpollCtl(epoll_.get(), EPOLL_CTL_ADD, socket_.fd(), EPOLLIN);
    } else {
      LOG_ERROR << "re-publishing " << options_.paths.socket
                << " after the failed upgrade: " << listen_fd.status().ToString();
    }
    LOG_WARN << "upgrade failed, serving on: " << result.ToString();
    if (events_.on_handover_failed) events_.on_handover_failed();
    if (requester != nullptr) {
      QueueError(*requester, result);
      FlushAndRearm(*requester);
    }
    return;
  }
  const auto took =
      std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - upgrade.started);
  upgrade.successor->Release();
  if (events_.on_handed_over) events_.on_handed_over();
  LOG_INFO << "handed over to successor pid " << pid << " in " << took.count() / 1000.0
           << " ms; serving what waits in the backlog, then exiting";
  if (requester != nullptr) {
    protocol::UpgradeReply reply;
    reply.successor_pid = pid;
    reply.handover_us = static_cast<uint64_t>(took.count());
    QueueFrame(*requester, protocol::EncodeUpgradeReply(reply));
    requester->close_after_flush = true;
    FlushAndRearm(*requester);
  }
  // The path is the successor's now. A connect that resolved it just before the rename
  // lands in our backlog within microseconds: keep accepting for a grace period, then stop
  // listening (the loop does, at listen_until), so that no such connect is reset by the close.
  handed_over_until_ = Clock::now() + options_.drain_timeout;
  handover_listen_until_ = Clock::now() + kHandoverAcceptGrace;
}

void Daemon::StopListeningAfterHandover() {
  if (!handover_listen_until_) return;
  handover_listen_until_.reset();
  AcceptAll();
  (void)::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, socket_.fd(), nullptr);
  socket_.Abandon();  // the path is the successor's: closed, not unlinked
  accept_paused_until_.reset();
}

// ---- publishing (docs/publish.md) -------------------------------------------------------------

Status Daemon::CanPublish(const Connection& conn) const {
  if (!identity::IsPublishedSource(options_.config.source)) {
    return InvalidArgument("cache " + options_.config.ShortDigest() + " has source \"" +
                           options_.config.source +
                           "\": only a daemon started with --source published:<tag> takes a "
                           "publish");
  }
  if (publication_ || committing_conn_ != 0) {
    return Status(StatusCode::kUnavailable,
                  "cache " + options_.config.ShortDigest() + " is being published by pid " +
                      std::to_string(publisher_pid_) +
                      (publisher_fd_ == conn.fd.get() ? " (this connection)" : "") +
                      "; one publisher at a time");
  }
  if (state_ == CacheState::kReady && options_.replace == ReplacePolicy::kRefuse) {
    return Status(StatusCode::kAlreadyServed,
                  "cache " + options_.config.ShortDigest() +
                      " is already ready (published by pid " + std::to_string(published_by_) +
                      "); a daemon started with --replace accepts a new publish");
  }
  if (state_ != CacheState::kAwaiting && state_ != CacheState::kReady) {
    return Status(StatusCode::kUnavailable, "cache " + options_.config.ShortDigest() + " is " +
                                                std::string(protocol::CacheStateName(state_)));
  }
  return Status::Ok();
}

void Daemon::WarmContext() {
  const auto start = Clock::now();
  Result<cuda::PrimaryContext> context = [&]() -> Result<cuda::PrimaryContext> {
    WEIGHTCACHE_ASSIGN_OR_RETURN(const CopyDevice gpu, CacheDevice());
    const auto& [api, device] = gpu;
    return cuda::PrimaryContext::Retain(api, device);
  }();
  if (!context.ok()) {
    // Not fatal: the PublishBegin creates the context itself, and reports a failure then.
    LOG_WARN << "preparing the device's CUDA context for the publisher: "
             << context.status().ToString();
    return;
  }
  warm_context_.emplace(std::move(context).value());
  LOG_INFO << "the device's CUDA context is ready for the publisher (created in "
           << SecondsSince(start) << " s)";
}

Result<Publication> Daemon::CreateArenaFor(protocol::PublishBegin plan) {
  const Tier tier = options_.config.tier;
  if (tier != Tier::kGpu) {
    return CreatePublication(tier, std::move(plan), options_.load.cache_name,
                             options_.load.memory_budget, nullptr);
  }
  // The gpu tier: a VMM arena on the daemon's own device, through the Env's driver (the load's
  // seam). Creating it makes the device's primary context current on this thread.
  if (!options_.device.has_value()) return InternalError("gpu tier publish without a device");
  if (warmer_.joinable()) warmer_.join();  // its context, if it made one, is retained below
  auto driver = options_.env.load_driver();
  if (!driver.ok()) return driver.status().Context("gpu tier publish");
  GpuPublishTarget target{*driver, *options_.device, options_.load.keep_creating_handles};
  return CreatePublication(tier, std::move(plan), options_.load.cache_name,
                           options_.load.memory_budget, &target);
}

void Daemon::HandlePublishBegin(Connection& conn, std::span<const uint8_t> payload) {
  if (!conn.hello_seen) {
    Status status =
        ProtocolError("PublishBegin before a Hello (cache " + options_.config.ShortDigest() + ")");
    CloseWithError(conn, status, conn.Describe() + ": " + status.message());
    return;
  }
  auto plan = protocol::DecodePublishBegin(payload);
  if (!plan.ok()) {
    CloseWithError(conn, plan.status(),
                   "bad PublishBegin from " + conn.Describe() + ": " + plan.status().ToString());
    return;
  }
  if (!conn.hello_matched) {
    QueueError(conn, Status(StatusCode::kMismatch,
                            "PublishBegin refused: the Hello's config does not match this cache (" +
                                options_.config.ShortDigest() + ")"));
    return;
  }
  Status refused = CanPublish(conn);
  if (refused.ok()) refused = protocol::ValidatePublishPlan(*plan);
  Result<Publication> pub = refused;
  const auto arena_start = Clock::now();
  if (refused.ok()) pub = CreateArenaFor(std::move(plan).value());
  const double arena_seconds = SecondsSince(arena_start);
  Result<std::vector<uint8_t>> frame =
      pub.ok() ? protocol::EncodePublishArena(pub->arena_manifest.size,
                                              static_cast<uint32_t>(pub->ArenaFds().size()))
               : Result<std::vector<uint8_t>>(pub.status());
  if (!frame.ok()) {
    LOG_WARN << "PublishBegin from " << conn.Describe()
             << " refused: " << frame.status().ToString();
    QueueError(conn, frame.status());
    return;
  }
  publication_.emplace(std::move(pub).value());
  publisher_fd_ = conn.fd.get();
  publisher_pid_ = conn.peer.pid;
  conn.publishing = true;
  publish_begun_ = Clock::now();
  ScheduleSweep();  // its publish deadline
  if (state_ == CacheState::kAwaiting) {
    bytes_total_.store(publication_->tensor_bytes);
    bytes_done_.store(0);
  }
  // The manifest memfd first, then one writable fd per allocation (the AttachReply layout):
  // memfds, or the gpu arena's exported VMM fds.
  std::vector<int> fds{publication_->arena_manifest.fd.get()};
  for (int fd : publication_->ArenaFds()) fds.push_back(fd);
  QueueFrame(conn, std::move(frame), std::move(fds));
  conn.fds_sent = true;
  LOG_INFO << "publishing: " << conn.Describe() << " plans " << publication_->plan.tensors.size()
           << " tensors, " << FormatBytes(publication_->tensor_bytes) << " in "
           << publication_->ArenaFds().size() << " " << TierName(publication_->tier)
           << " allocation(s) made in " << arena_seconds << " s, metadata "
           << publication_->plan.metadata.size() << " bytes";
}

void Daemon::HandlePublishCommit(Connection& conn, std::span<const uint8_t> payload) {
  if (publisher_fd_ != conn.fd.get() || !publication_) {
    Status status =
        ProtocolError("PublishCommit without a PublishBegin on this connection (cache " +
                      options_.config.ShortDigest() + ")");
    CloseWithError(conn, status, conn.Describe() + ": " + status.message());
    return;
  }
  auto commit = protocol::DecodePublishCommit(payload);
  if (!commit.ok()) {
    CloseWithError(conn, commit.status(),
                   "bad PublishCommit from " + conn.Describe() + ": " + commit.status().ToString());
    return;  // closing the connection abandons the publication
  }
  Publication pub = std::move(*publication_);
  publication_.reset();
  publisher_fd_ = -1;
  conn.committing = true;  // read nothing more from it until the commit is answered
  committing_conn_ = conn.id;
  commit_start_ = Clock::now();
  LOG_INFO << "publish commit from " << conn.Describe() << ": checking "
           << FormatBytes(pub.tensor_bytes);
  committer_ =
      std::thread([this, pub = std::move(pub), checksums = std::move(commit->checksums)]() mutable {
        Result<WeightStore> store = CommitPublication(std::move(pub), checksums);
        {
          MutexLock lock(commit_mu_);
          commit_result_.emplace(std::move(store));
        }
        Wake(wakeup_.get());
      });
}

void Daemon::OnCommitDone() {
  std::optional<Result<WeightStore>> result;
  {
    MutexLock lock(commit_mu_);
    if (commit_result_) {
      result = std::move(commit_result_);
      commit_result_.reset();
    }
  }
  if (!result) return;
  if (committer_.joinable()) committer_.join();
  Connection* conn = nullptr;
  for (auto& [fd, c] : connections_) {
    if (c->id == committing_conn_) conn = c.get();
  }
  committing_conn_ = 0;
  const double seconds = SecondsSince(commit_start_);
  Status installed;
  if (!result->ok()) {
    installed = result->status();
  } else if (state_ == CacheState::kDraining) {
    installed = Status(StatusCode::kUnavailable, "the daemon began draining during the commit");
  } else {
    installed = InstallStore(std::move(*result).value());
  }
  if (!installed.ok()) {
    LOG_WARN << "publish by pid " << publisher_pid_
             << " refused at commit: " << installed.ToString() << "; the arena is freed, state "
             << protocol::CacheStateName(state_);
    if (state_ == CacheState::kAwaiting) bytes_total_.store(0);
    if (conn != nullptr) QueueError(*conn, installed);
  } else {
    published_by_ = publisher_pid_;
    LOG_INFO << "published by pid " << publisher_pid_ << " (sealed and checksums verified in "
             << seconds << " s)";
    if (conn != nullptr) {
      protocol::PublishCommitted reply;
      reply.tensor_count = store_->summary().tensor_count;
      reply.bytes = store_->summary().resident_bytes;
      QueueFrame(*conn, protocol::EncodePublishCommitted(reply));
    }
    if (events_.on_ready) events_.on_ready(store_->summary(), seconds);
  }
  if (conn != nullptr) {
    conn->committing = false;
    conn->publishing = false;
    FlushAndRearm(*conn);
  }
  // Installed: the store is fds, nothing here needs the context any more. Released after the
  // reply is on its way (the last release destroys the context, which takes a while).
  if (installed.ok()) warm_context_.reset();
}

void Daemon::AbandonPublication(std::string_view why) {
  if (!publication_) return;
  LOG_WARN << "publish abandoned: " << why << "; its arena is freed, state "
           << protocol::CacheStateName(state_);
  publication_.reset();
  publisher_fd_ = -1;
  if (state_ == CacheState::kAwaiting) bytes_total_.store(0);
}

}  // namespace weightcache::daemon
