#include "serve/serve.h"

#include <unistd.h>

#include <chrono>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>

#include "checkpoint/checkpoint.h"
#include "common/logging.h"
#include "daemon/budget.h"
#include "daemon/byte_size.h"
#include "daemon/fd_store.h"
#include "daemon/metrics_server.h"
#include "os/read_file.h"
#include "os/syscalls.h"
#include "protocol/handoff.h"
#include "serve/registration.h"
#include "serve/seed_fill.h"
#include "serve/successor.h"
#include "sharding/planner.h"

namespace weightcache::serve {

struct Plan::Parts {
  ServeOptions options;
  identity::ResolvedIdentity id;
  daemon::DaemonOptions daemon;
  std::shared_ptr<Registration> registration;               // null without the fleet's options
  std::shared_ptr<daemon::ServiceManager> service_manager;  // null unless under systemd
};

Plan::Plan(std::unique_ptr<Parts> parts) : parts_(std::move(parts)) {}
Plan::~Plan() = default;
Plan::Plan(Plan&&) noexcept = default;
Plan& Plan::operator=(Plan&&) noexcept = default;
const identity::ResolvedIdentity& Plan::identity() const { return parts_->id; }

namespace {

// The daemon's keeper link (docs/keeper.md): on unless --no-keeper; a published cache has none.
daemon::KeeperLinkOptions KeeperOptionsFor(const ServeOptions& options) {
  daemon::KeeperLinkOptions keeper;
  keeper.enabled = options.keeper;
  keeper.verify = options.adopt_verify == "sample" ? protocol::ChecksumCheck::kSample
                                                   : protocol::ChecksumCheck::kFull;
  keeper.verify_behind_ready = options.adopt_verify == "behind";
  keeper.allow_uids.assign(options.allow_uids.begin(), options.allow_uids.end());
  return keeper;
}

// The fill source follows the cache's memory: leaving the GPU, it lets go of its mapping of the
// GPU memory before the ledger stops counting that memory; back on the GPU, it serves once the
// ledger does. Weak: the daemon's copies of the options must not keep the registration (and
// its lease) alive past Run's reset.
void FollowMovesWith(const std::shared_ptr<Registration>& registration,
                     daemon::DemotionOptions* demotion) {
  if (!registration || !demotion->moved) return;
  demotion->moved = [moved = demotion->moved, weak = std::weak_ptr<Registration>(registration)](
                        Tier tier, std::span<const int> fds) {
    auto live = weak.lock();
    if (live && tier == Tier::kHost) live->Moved(tier, fds);
    moved(tier, fds);
    if (live && tier != Tier::kHost) live->Moved(tier, fds);
  };
}

// The line that says what this process serves.
void LogServing(const Plan::Parts& p) {
  const identity::CacheConfig& c = p.daemon.config;
  std::string device = p.id.device_key;
  if (p.id.device) {
    device +=
        " (" + p.id.device->name + ", local index " + std::to_string(p.id.device->index) + ")";
  }
  LOG_INFO << "serving " << c.model_id << (c.revision.empty() ? "" : "@" + c.revision) << " tp "
           << c.tp_rank << "/" << c.tp_size << " pp " << c.pp_rank << "/" << c.pp_size << " ep "
           << c.ep_rank << "/" << c.ep_size << ", tier " << TierName(c.tier) << ", device "
           << device << ", digest " << c.ShortDigest() << ", socket " << p.daemon.paths.socket
           << ", pid " << ::getpid();
}

// --metrics-addr (docs/metrics.md): null without it. An upgrade's successor serves the listener
// its predecessor handed over (--metrics-fd) instead of binding the address, which the
// predecessor holds until it exits.
Result<std::unique_ptr<daemon::MetricsServer>> MakeMetricsServer(
    const ServeOptions& options, std::shared_ptr<daemon::DaemonMetrics> metrics) {
  if (options.metrics_fd >= 0 && (options.handover_fd < 0 || options.metrics_addr.empty())) {
    return InvalidArgument(
        "--metrics-fd is an upgrade's: it needs --handover-fd and --metrics-addr");
  }
  if (options.metrics_addr.empty()) return std::unique_ptr<daemon::MetricsServer>();
  daemon::MetricsServerOptions metrics_options;
  metrics_options.address = options.metrics_addr;
  metrics_options.request_timeout = options.metrics_timeout;
  metrics_options.inherited_fd = options.metrics_fd;
  auto server = daemon::MetricsServer::Create(
      metrics_options, [metrics = std::move(metrics)] { return metrics->Render(); });
  if (server.ok()) return server;
  if (options.handover_fd >= 0 && options.metrics_fd < 0) {
    // The successor of an older build, which hands over no metrics listener: the address is
    // still its predecessor's.
    LOG_WARN << "metrics not served: " << server.status().ToString()
             << " (the predecessor handed over no metrics listener)";
    return std::unique_ptr<daemon::MetricsServer>();
  }
  return server.status();
}

}  // namespace

Result<Plan> Prepare(const ServeOptions& options) {
  if (options.identity.tier == Tier::kGpu && options.identity.device.empty()) {
    // A daemon never picks a GPU by default: an implicit GPU 0 is the very bug this project
    // exists to prevent (docs/design.md "What it is").
    return InvalidArgument("--tier gpu needs --device N|UUID");
  }
  WEIGHTCACHE_RETURN_IF_ERROR(CheckSeedFrom(options.seed_from));
  auto parts = std::make_unique<Plan::Parts>();
  parts->options = options;
  WEIGHTCACHE_ASSIGN_OR_RETURN(parts->id, identity::ResolveIdentity(options.identity));
  const identity::ResolvedIdentity& id = parts->id;
  if (id.shard.has_value()) {
    // A checkpoint the rules cannot shard is refused before the daemon takes its lock (exit 5
    // naming the tensor and the rule); the loader plans again on the checkpoint it reads.
    WEIGHTCACHE_ASSIGN_OR_RETURN(auto ckpt,
                                 checkpoint::Checkpoint::Open(options.identity.model_dir));
    WEIGHTCACHE_RETURN_IF_ERROR(
        sharding::PlanShard(ckpt, id.shard->rules, id.shard->model_config, id.shard->ranks)
            .status());
  }

  daemon::DaemonOptions& d = parts->daemon;
  d.load.memory_budget = options.memory_budget;
  d.config = id.config;
  d.paths = id.paths;
  d.model_path = options.identity.model_dir;
  d.device_key = id.device_key;
  d.device = id.device;
  d.shard = id.shard;
  d.load.threads = options.threads;
  d.load.cache_name = "weightcache:" + id.config.ShortDigest();
  d.allow_uids.assign(options.allow_uids.begin(), options.allow_uids.end());
  d.allow_gids.assign(options.allow_gids.begin(), options.allow_gids.end());
  d.failed_linger = options.failed_linger;
  d.pinned = options.budget.pin;
  WEIGHTCACHE_ASSIGN_OR_RETURN(d.demotion, DemotionHooks(options.budget, id));
  // The fleet registry (docs/fleet.md): the entry is put once the cache is ready, follows a
  // demotion and promotion, and is withdrawn at drain and stop. Its etcd calls run on the
  // registrar's own thread: the event loop only hands it the entry.
  WEIGHTCACHE_ASSIGN_OR_RETURN(parts->registration,
                               Registration::Create(options.fleet, id, options.identity.model_dir));
  const std::shared_ptr<Registration>& registration = parts->registration;
  // --seed-from (docs/seeding.md), then --fill-from (docs/fleet.md "Fill"): the load tries a
  // peer cache of this node, then other nodes, then reads the disk; on either tier. A peer
  // still loading is not waited for: only ready ones seed.
  d.load.peer_fill = FirstFillOf(SeedFiller(id, options.seed_from, std::chrono::milliseconds(0)),
                                 registration ? registration->Filler() : daemon::PeerFill());
  d.load.keep_creating_handles = registration && registration->ServesFill();
  FollowMovesWith(registration, &d.demotion);
  d.handshake_timeout = options.handshake_timeout;
  d.stall_timeout = options.stall_timeout;
  d.publish_timeout = options.publish_timeout;
  d.max_connections = options.max_connections;
  d.replace = options.replace ? daemon::ReplacePolicy::kReplace : daemon::ReplacePolicy::kRefuse;
  if (options.replace && !identity::IsPublishedSource(d.config.source)) {
    return InvalidArgument("--replace needs --source published:<tag>");
  }
  d.keeper = KeeperOptionsFor(options);
  // Under systemd (NOTIFY_SOCKET): readiness through sd_notify, and the service manager's fd
  // store keeps the cache instead of a keeper (docs/keeper.md, "Under systemd"): the manager
  // already outlives us, and a keeper would be a second owner of the same memory.
  if (auto service = daemon::ServiceManagerFromEnvironment(); !service.ok()) {
    LOG_WARN << service.status().message() << "; the keeper keeps the cache";
  } else if (service->has_value()) {
    parts->service_manager = (*service)->manager;
    if (!options.detach && !identity::IsPublishedSource(d.config.source)) {
      d.fd_store = std::make_shared<daemon::FdStore>(std::move(**service));
      d.keeper.enabled = false;
      LOG_INFO << "under a service manager (NOTIFY_SOCKET): the cache is kept in its fd store";
    }
  }
  d.upgrade_timeout = options.upgrade_timeout;
  return Plan(std::move(parts));
}

Status Run(Plan plan, int signal_fd, std::optional<launcher::ReadyNotice> notice,
           const ServeHooks& hooks) {
  Plan::Parts& p = *plan.parts_;
  const ServeOptions& options = p.options;
  daemon::DaemonOptions& d = p.daemon;
  if (auto self = os::SelfExecutable(); self.ok()) d.self_binary = *self;
  // One fd per client: take every fd the hard limit allows (the soft default of 1024 is a
  // select()-era guess). A daemon that still runs out pauses accepting (docs/daemon.md).
  if (auto fd_limit = os::RaiseFdLimitToHard(); !fd_limit.ok()) {
    LOG_WARN << fd_limit.status().ToString();
  } else if (fd_limit->raised) {
    LOG_DEBUG << "RLIMIT_NOFILE soft limit raised to the hard limit, " << fd_limit->soft;
  }

  d.metrics = std::make_shared<daemon::DaemonMetrics>(
      daemon::MetricsIdentity{p.id.device_key, p.id.config.model_id, p.id.config.tier});
  WEIGHTCACHE_ASSIGN_OR_RETURN(std::unique_ptr<daemon::MetricsServer> metrics_server,
                               MakeMetricsServer(options, d.metrics));
  // A successor inherits our metrics listener (docs/metrics.md "Upgrade").
  d.start_successor = [args = options.program_args,
                       listener = metrics_server ? metrics_server->listener_fd() : -1](
                          const std::string& binary, int channel) {
    return StartSuccessor(args, binary, channel, listener);
  };

  int64_t predecessor = 0;
  Result<std::unique_ptr<daemon::Daemon>> daemon = [&] {
    if (options.handover_fd < 0) return daemon::Daemon::Create(d);
    return TakeOver(options.handover_fd, p.id, d, &predecessor);
  }();
  WEIGHTCACHE_RETURN_IF_ERROR(daemon.status());
  // Admission once we hold the identity lock (and the device dir exists), before loading.
  auto budget_ledger =
      AdmitUnderBudget(options.budget, p.id, options.identity.model_dir, signal_fd);
  if (!budget_ledger.ok()) {
    daemon->reset();
    return budget_ledger.status();
  }
  LogServing(p);
  if (metrics_server) {
    metrics_server->Start();
    LOG_INFO << "metrics at " << metrics_server->endpoint()
             << (options.metrics_fd >= 0
                     ? " (handed over by pid " + std::to_string(predecessor) + ")"
                     : std::string());
  }

  const std::shared_ptr<daemon::ServiceManager>& service_manager = p.service_manager;
  auto notify = [&service_manager](const std::string& state) {
    if (!service_manager) return;
    if (Status sent = service_manager->Notify(state, {}); !sent.ok()) {
      LOG_WARN << "sd_notify: " << sent.ToString();
    }
  };
  auto end_progress = [&hooks] {
    if (hooks.end_progress) hooks.end_progress();
  };
  std::shared_ptr<Registration>& registration = p.registration;
  const identity::CacheConfig& config = d.config;
  daemon::DaemonEvents events;
  std::string adopted;  // set by on_adopted: the ready line says so
  events.on_adopted = [&](std::string_view how) { adopted = how; };
  // The unit's STATUS follows the load (`systemctl status`): at most once a second, and at its
  // end, so that a slow load shows where it is without a datagram per batch.
  // Empty until the first STATUS (a time_point::min() start would overflow `now - last`).
  std::optional<std::chrono::steady_clock::time_point> last_status;
  events.on_progress = [&](uint64_t done, uint64_t total, double seconds) {
    if (hooks.on_progress) hooks.on_progress(done, total, seconds);
    const auto now = std::chrono::steady_clock::now();
    const bool recent = last_status && now - *last_status < std::chrono::seconds(1);
    if (!service_manager || (recent && done < total)) return;
    last_status = now;
    const uint64_t percent = total == 0 ? 100 : done * 100 / total;
    notify("STATUS=loading " + config.model_id + ": " + std::to_string(percent) + "% (" +
           daemon::FormatBytes(done) + " of " + daemon::FormatBytes(total) + ")");
  };
  events.on_ready = [&](const daemon::StoreSummary& s, double seconds) {
    end_progress();
    if (registration) {
      registration->Ready(s, (*daemon)->StoreFds(), (*daemon)->StoreCreatingHandles());
    }
    if (notice) notice->Send(launcher::ReadyNotice::What::kReady);
    // MAINPID: an upgrade's successor (NotifyAccess=all in the unit) becomes the main process.
    notify("READY=1\nMAINPID=" + std::to_string(::getpid()) +
           "\nSTATUS=ready: " + std::to_string(s.tensor_count) + " tensors, " +
           daemon::FormatBytes(s.tensor_bytes) + (adopted.empty() ? "" : ", adopted " + adopted));
    if (!adopted.empty()) {
      const double since_start =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - options.process_start)
              .count();
      LOG_INFO << "ready: adopted " << s.tensor_count << " tensors, "
               << daemon::FormatBytes(s.tensor_bytes) << " ("
               << daemon::FormatBytes(s.resident_bytes) << " resident) in " << seconds << " s ("
               << since_start << " s since serve started), " << adopted
               << "; no checkpoint byte read";
      return;
    }
    LOG_INFO << "ready: " << s.tensor_count << " tensors, " << daemon::FormatBytes(s.tensor_bytes)
             << " (" << daemon::FormatBytes(s.resident_bytes) << " resident) in " << seconds
             << " s, " << daemon::FormatRate(s.tensor_bytes, seconds) << ", "
             << (s.filled_from.empty() ? std::string("loaded from disk") : s.filled_from);
  };
  events.on_failed = [&](const Status& why) {
    end_progress();
    if (notice) notice->Send(launcher::ReadyNotice::What::kFailed);
    notify("STATUS=failed: " + why.ToString());
  };
  // The successor of an upgrade runs with our flags: our fill source lets go of its port first.
  events.on_handing_over = [&] {
    if (registration) registration->HandingOver();
  };
  // The successor serves our metrics listener now: stop accepting on it, leave its path.
  events.on_handed_over = [&] {
    if (metrics_server) metrics_server->HandOff();
  };
  events.on_handover_failed = [&] {
    if (registration) {
      registration->HandoverFailed((*daemon)->StoreFds(), (*daemon)->StoreCreatingHandles());
    }
  };
  events.on_draining = [&](std::string_view reason) {
    end_progress();
    if (registration) registration->Draining();
    notify("STOPPING=1\nSTATUS=draining: " + std::string(reason));
  };
  notify("STATUS=loading " + config.model_id + " (digest " + config.ShortDigest() + ")");
  // Each change of the client count goes to the ledger from the writer's thread, never from
  // the event loop (a ledger lock held by a hung peer must not stall attaches).
  std::optional<daemon::LedgerClientsWriter> clients_writer;
  if (*budget_ledger) {
    clients_writer.emplace(**budget_ledger, d.paths.socket, kLedgerLockWait);
    events.on_clients = [&clients_writer](uint32_t clients) { clients_writer->Set(clients); };
  }

  Status result = (*daemon)->Run(signal_fd, events);
  // The registry entry goes first, while we still hold the lock: once `stop` sees the lock
  // free, no registry reader finds us any more (the revocation is bounded by
  // --registry-timeout per endpoint).
  registration.reset();
  daemon->reset();  // withdraw the socket, then release the lock, before we report
  clients_writer.reset();
  LeaveBudget(budget_ledger->get(), d.paths.socket);
  return result;
}

}  // namespace weightcache::serve
