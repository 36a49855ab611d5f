// The daemon's loader (daemon_parts.h): its thread, adoption, the keeper deposit.
#include <pthread.h>
#include <unistd.h>

#include <algorithm>

#include "checkpoint/checkpoint.h"
#include "common/logging.h"
#include "common/mutex.h"
#include "common/test_hooks.h"
#include "daemon/daemon_parts.h"
#include "daemon/load_memory.h"
#include "os/read_file.h"
#include "protocol/manifest.h"
#include "sharding/planner.h"

namespace weightcache::daemon {

using protocol::CacheState;

namespace {

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

}  // namespace

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

}  // namespace weightcache::daemon
