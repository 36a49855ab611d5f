// The daemon's publisher (daemon_parts.h): an arena, then its commit.
#include "common/logging.h"
#include "common/mutex.h"
#include "cuda/tier_copy.h"
#include "daemon/byte_size.h"
#include "daemon/daemon_parts.h"
#include "protocol/manifest.h"
#include "protocol/messages.h"

namespace weightcache::daemon {

using protocol::CacheState;

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
  if (conn.greeting == Connection::Greeting::kNone) {
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
  if (conn.greeting != Connection::Greeting::kMatched) {
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
  committing_conn_ = conn.id;  // read nothing more from it until the commit is answered
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
