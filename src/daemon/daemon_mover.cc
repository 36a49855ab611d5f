// The daemon's mover (daemon_parts.h): demotion, pinning, promotion.
#include <pthread.h>

#include <numeric>

#include "common/logging.h"
#include "common/mutex.h"
#include "cuda/tier_copy.h"
#include "daemon/byte_size.h"
#include "daemon/daemon_parts.h"
#include "protocol/manifest.h"

namespace weightcache::daemon {

using protocol::CacheState;

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

}  // namespace weightcache::daemon
