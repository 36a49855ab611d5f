// `weightcache serve`: run one daemon in the foreground (docs/design.md "Command line",
// docs/daemon.md).
//
// The library's composition root, src/serve/, holds admission under the budget, the demotion
// hooks, seeding and the upgrade's two ends; what is composed here still (registration, the
// metrics server, systemd readiness, detach) moves there next (docs/design.md "Target layout").
//
// The identity flags are the attach's own (AddIdentityFlags + identity::ResolveIdentity), so
// a daemon and an engine given the same flags compute the same CacheConfig, device key and
// socket path by construction. This file owns the process-level concerns the library must
// not touch: signals (blocked in every thread, read through a signalfd by the event loop),
// SIGPIPE, and the human-facing log lines (what is served, progress, ready/failed).
//
// --detach runs this same command line as a background daemon through the launcher (Detach).
//
// Exit codes: 0 clean stop (--detach: the daemon serves); 2 usage; 5 invalid checkpoint; 7 already
// served (the message names the owner's pid); 8 no room under the device's budget (docs/budget.md);
// otherwise the failed load's code (1 for I/O, budget, CUDA).
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "cli_common.h"
#include "common/logging.h"
#include "common/unique_fd.h"
#include "daemon/budget.h"
#include "daemon/byte_size.h"
#include "daemon/daemon.h"
#include "daemon/metrics_server.h"
#include "fleet_flags.h"
#include "identity/resolve.h"
#include "identity_flags.h"
#include "launcher/child_process.h"
#include "launcher/launcher.h"
#include "launcher/ready_notice.h"
#include "launcher/serve_daemons.h"
#include "os/lock_file.h"
#include "os/read_file.h"
#include "protocol/handoff.h"
#include "serve/admission.h"
#include "serve/seed_fill.h"
#include "serve/successor.h"
#include "sharding/planner.h"

namespace weightcache::cli {
namespace {

struct ServeArgs {
  IdentityOptions identity;
  std::vector<uint32_t> allow_uids;
  std::vector<uint32_t> allow_gids;
  std::string memory_budget;
  serve::BudgetOptions budget;  // --gpu-budget, --host-budget, --pin, --demote, --wait
  int threads = 16;
  double failed_linger_s = 30;
  double handshake_timeout_s = 10;
  double publish_timeout_s = 600;
  double stall_timeout_s = 30;
  size_t max_connections = 4096;
  bool replace = false;
  bool no_keeper = false;
  std::string adopt_verify = "sample";
  // --detach: start the daemon in the background, return once it serves (docs/daemon.md).
  bool detach = false;
  bool json = false;
  double ready_timeout_s = 600;
  std::string log_file;
  int handover_fd = -1;  // an upgrade's successor: the channel from the old daemon
  double upgrade_timeout_s = 60;
  std::string metrics_addr;  // --metrics-addr: HOST:PORT or a Unix socket path (docs/metrics.md)
  double metrics_timeout_s = 2;
  int metrics_fd = -1;     // an upgrade's successor: the old daemon's metrics listener
  RegistryFlags registry;  // --registry and its flags (docs/fleet.md)
  std::string seed_from;   // --seed-from auto|SOCKET (docs/seeding.md)
};

std::chrono::milliseconds Millis(double seconds) {
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
}

std::string Rate(uint64_t bytes, double seconds) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.2f GB/s", seconds > 0 ? bytes / seconds / 1e9 : 0.0);
  return buf;
}

// Progress: a rewritten line on a terminal (bytes, GB/s, ETA); on a pipe or file, a line at
// each quarter so logs stay short.
class ProgressPrinter {
 public:
  ProgressPrinter() : tty_(::isatty(STDERR_FILENO) == 1) {}

  void Update(uint64_t done, uint64_t total, double seconds) {
    if (total == 0) return;
    if (tty_) {
      const double rate = seconds > 0 ? done / seconds : 0;
      const double eta = rate > 0 ? (total - done) / rate : 0;
      char buf[160];
      std::snprintf(buf, sizeof(buf), "\rloading: %s / %s (%5.1f%%)  %s  ETA %.0fs   ",
                    daemon::FormatBytes(done).c_str(), daemon::FormatBytes(total).c_str(),
                    100.0 * done / total, Rate(done, seconds).c_str(), eta);
      std::cerr << buf << std::flush;
      line_open_ = true;
      return;
    }
    const int quarter = static_cast<int>(4 * done / total);
    if (quarter > last_quarter_ && done < total) {
      last_quarter_ = quarter;
      LOG_INFO << "loading: " << daemon::FormatBytes(done) << " / " << daemon::FormatBytes(total)
               << " (" << 25 * quarter << "%), " << Rate(done, seconds);
    }
  }
  void EndLine() {
    if (line_open_) std::cerr << "\n";
    line_open_ = false;
  }

 private:
  bool tty_;
  bool line_open_ = false;
  int last_quarter_ = 0;
};

// The daemon's keeper link (docs/keeper.md): on unless --no-keeper; a published cache has none.
daemon::KeeperLinkOptions KeeperOptionsFor(const ServeArgs& args) {
  daemon::KeeperLinkOptions keeper;
  keeper.enabled = !args.no_keeper;
  keeper.verify = args.adopt_verify == "sample" ? protocol::ChecksumCheck::kSample
                                                : protocol::ChecksumCheck::kFull;
  keeper.verify_behind_ready = args.adopt_verify == "behind";
  keeper.allow_uids.assign(args.allow_uids.begin(), args.allow_uids.end());
  return keeper;
}

// --detach's daemon log: --log-file, else <runtime>/<namespace>/logs/serve-<digest16>.log
// (launch's log dir), or <socket>.log beside an explicit socket.
Result<std::string> DetachedLogPath(const ServeArgs& args, const identity::ResolvedIdentity& id) {
  std::error_code ec;
  if (!args.log_file.empty()) {
    std::filesystem::path path = std::filesystem::absolute(args.log_file, ec);
    if (ec) return IoError("--log-file " + args.log_file, ec.value());
    return path.string();
  }
  if (id.paths.namespace_dir.empty()) return id.paths.socket + ".log";
  const std::string dir = id.paths.namespace_dir + "/logs";
  for (const std::string& d : {id.paths.runtime_dir, id.paths.namespace_dir, dir}) {
    WEIGHTCACHE_RETURN_IF_ERROR(MakePrivateDirWithParents(d));
  }
  return dir + "/serve-" + id.config.ShortDigest() + ".log";
}

// `serve --detach`: this same command line, less --detach, runs as a daemon in a new session
// (stdin /dev/null, stdout and stderr to its log), spawned and polled by the launcher, the one
// home of both: done when the daemon answers `ready`, or `awaiting` for a published source (it
// can take its publisher then); the daemon is then left running and this process exits 0,
// printing the socket and pid (--json: launch's summary). A daemon that exits first makes this
// exit with its exit code (7 already served, 5 invalid checkpoint, ...), its last error line
// quoted; one that does not answer within --ready-timeout is stopped (exit 6).
int Detach(const ServeArgs& args, const identity::ResolvedIdentity& id, int signal_fd) {
  constexpr std::string_view kCmd = "serve";
  auto exe = os::SelfExecutable();
  if (!exe.ok()) return Fail(kCmd, exe.status());
  auto log = DetachedLogPath(args, id);
  if (!log.ok()) return Fail(kCmd, log.status());

  launcher::DaemonSpec spec;
  spec.name = "serve " + id.config.ShortDigest();
  if (id.device) spec.placement.device_uuid = id.device->uuid;
  spec.socket_path = id.paths.socket;
  spec.lock_path = id.paths.lock;
  spec.spawn.argv.push_back(*exe);
  const std::vector<std::string>& line = ProgramArgs();
  for (size_t i = 1; i < line.size(); ++i) {
    if (line[i] != "--detach") spec.spawn.argv.push_back(line[i]);
  }
  spec.spawn.log_path = *log;

  launcher::LaunchOptions options;
  options.mode = launcher::SupervisionMode::kExitWhenReady;
  options.ready_timeout = Millis(args.ready_timeout_s);
  std::vector<launcher::DaemonSpec> specs;
  specs.push_back(std::move(spec));
  auto l = launcher::Launcher::Create(
      std::move(specs), options,
      [](const std::string& socket) {
        return launcher::ProbeDaemonState(socket, std::chrono::milliseconds(500),
                                          launcher::AwaitingIs::kReady);
      },
      [](const std::string& lock) -> Result<bool> { return os::IsLockHeld(lock); });
  if (!l.ok()) return Fail(kCmd, l.status());
  launcher::LaunchReport report = l->Run(signal_fd);

  int code = report.status.ok() ? kExitOk : ExitCodeFor(report.status);
  if (!report.status.ok() && !report.daemons.empty()) {
    const auto& exit = report.daemons.front().exit;
    // The daemon's own exit code (it applied the one table where the error was found), and
    // the status code of that exit code's row for --json, where the row is the only one.
    if (exit && exit->exited() && exit->exit_code != kExitOk && exit->exit_code != code) {
      code = exit->exit_code;
      for (const StatusCodeInfo& row : kStatusCodeTable) {
        if (row.exit_code == code && code != kExitError) {
          report.status = Status(row.code, report.status.message());
          break;
        }
      }
    }
  }
  if (args.json) {
    std::cout << launcher::LaunchSummaryJson(report, code) << std::endl;
  } else if (report.status.ok()) {
    const auto& d = report.daemons.front();
    std::cout << "socket " << d.socket_path << "\npid " << d.pid << "\nlog " << d.log_path
              << std::endl;
  }
  if (!report.status.ok()) {
    std::cerr << "weightcache " << kCmd << ": " << report.status.ToString() << std::endl;
  }
  return code;
}

int Run(ServeArgs& args) {
  constexpr std::string_view kCmd = "serve";
  if (args.identity.tier == Tier::kGpu && args.identity.device.empty()) {
    // A daemon never picks a GPU by default: an implicit GPU 0 is the very bug this project
    // exists to prevent (docs/design.md "What it is").
    return Fail(kCmd, InvalidArgument("--tier gpu needs --device N|UUID"));
  }
  if (Status seed = serve::CheckSeedFrom(args.seed_from); !seed.ok()) return Fail(kCmd, seed);
  daemon::DaemonOptions options;
  if (!args.memory_budget.empty()) {
    auto budget = daemon::ParseByteSize(args.memory_budget);
    if (!budget.ok()) return Fail(kCmd, budget.status().Context("--memory-budget"));
    options.load.memory_budget = *budget;
  }
  // Before anything can start a thread: resolving a gpu identity loads the CUDA driver, whose
  // cuInit starts threads of its own, and a thread that does not block the stop signals would
  // take SIGTERM's default action (death) instead of the signalfd getting it. The launcher's
  // ready notice is taken before then too (it edits the environment).
  std::optional<launcher::ReadyNotice> ready_notice;
  if (auto taken = launcher::ReadyNotice::Take(); !taken.ok()) {
    LOG_WARN << taken.status().message() << "; the launcher finds our readiness by its probes";
  } else {
    ready_notice = std::move(taken).value();
  }
  auto signals = TakeShutdownSignals(UpgradeSignal::kYes);
  if (!signals.ok()) return Fail(kCmd, signals.status());

  auto id = identity::ResolveIdentity(args.identity);
  if (!id.ok()) return Fail(kCmd, id.status());
  if (id->shard.has_value()) {
    // A checkpoint the rules cannot shard is refused before the daemon takes its lock (exit 5
    // naming the tensor and the rule); the loader plans again on the checkpoint it reads.
    auto ckpt = checkpoint::Checkpoint::Open(args.identity.model_dir);
    if (!ckpt.ok()) return Fail(kCmd, ckpt.status());
    auto plan =
        sharding::PlanShard(*ckpt, id->shard->rules, id->shard->model_config, id->shard->ranks);
    if (!plan.ok()) return Fail(kCmd, plan.status());
  }

  options.config = id->config;
  options.paths = id->paths;
  options.model_path = args.identity.model_dir;
  options.device_key = id->device_key;
  options.device = id->device;
  options.shard = id->shard;
  options.load.threads = args.threads;
  options.load.cache_name = "weightcache:" + id->config.ShortDigest();
  options.allow_uids.assign(args.allow_uids.begin(), args.allow_uids.end());
  options.allow_gids.assign(args.allow_gids.begin(), args.allow_gids.end());
  options.failed_linger = Millis(args.failed_linger_s);
  options.pinned = args.budget.pin;
  auto demotion = serve::DemotionHooks(args.budget, *id);
  if (!demotion.ok()) return Fail(kCmd, demotion.status());
  options.demotion = std::move(demotion).value();
  // The fleet registry (docs/fleet.md): the entry is put once the cache is ready, follows a
  // demotion and promotion, and is withdrawn at drain and stop. Its etcd calls run on the
  // registrar's own thread: the event loop only hands it the entry.
  auto registration_or = ServeRegistration::Create(args.registry, *id, args.identity.model_dir);
  if (!registration_or.ok()) return Fail(kCmd, registration_or.status());
  std::shared_ptr<ServeRegistration> registration = std::move(registration_or).value();
  // --seed-from (docs/seeding.md), then --fill-from (docs/fleet.md "Fill"): the load tries a
  // peer cache of this node, then other nodes, then reads the disk; on either tier. A peer
  // still loading is not waited for: only ready ones seed.
  options.load.peer_fill =
      serve::FirstFillOf(serve::SeedFiller(*id, args.seed_from, std::chrono::milliseconds(0)),
                         registration ? registration->Filler() : daemon::PeerFill());
  options.load.keep_creating_handles = registration && registration->ServesFill();
  if (registration && options.demotion.moved) {
    // Weak: the daemon's copies of the options must not keep the registration (and its
    // lease) alive past our reset below.
    options.demotion.moved = [moved = options.demotion.moved,
                              weak = std::weak_ptr<ServeRegistration>(registration)](
                                 Tier tier, std::span<const int> fds) {
      auto live = weak.lock();
      // Leaving the GPU, the fill source lets go of its mapping of the GPU memory before the
      // ledger stops counting that memory; back on the GPU, it serves once the ledger does.
      if (live && tier == Tier::kHost) live->Moved(tier, fds);
      moved(tier, fds);
      if (live && tier != Tier::kHost) live->Moved(tier, fds);
    };
  }
  options.handshake_timeout = Millis(args.handshake_timeout_s);
  options.stall_timeout = Millis(args.stall_timeout_s);
  options.publish_timeout = Millis(args.publish_timeout_s);
  options.max_connections = args.max_connections;
  options.replace = args.replace ? daemon::ReplacePolicy::kReplace : daemon::ReplacePolicy::kRefuse;
  if (args.replace && !identity::IsPublishedSource(options.config.source)) {
    return Fail(kCmd, InvalidArgument("--replace needs --source published:<tag>"));
  }
  options.keeper = KeeperOptionsFor(args);
  // Under systemd (NOTIFY_SOCKET): readiness through sd_notify, and the service manager's fd
  // store keeps the cache instead of a keeper (docs/keeper.md, "Under systemd"): the manager
  // already outlives us, and a keeper would be a second owner of the same memory.
  std::shared_ptr<daemon::ServiceManager> service_manager;
  if (auto service = daemon::ServiceManagerFromEnvironment(); !service.ok()) {
    LOG_WARN << service.status().message() << "; the keeper keeps the cache";
  } else if (service->has_value()) {
    service_manager = (*service)->manager;
    if (!args.detach && !identity::IsPublishedSource(options.config.source)) {
      options.fd_store = std::make_shared<daemon::FdStore>(std::move(**service));
      options.keeper.enabled = false;
      LOG_INFO << "under a service manager (NOTIFY_SOCKET): the cache is kept in its fd store";
    }
  }
  auto notify = [&service_manager](const std::string& state) {
    if (!service_manager) return;
    Status sent = service_manager->Notify(state, {});
    if (!sent.ok()) {
      LOG_WARN << "sd_notify: " << sent.ToString();
    }
  };
  if (args.detach) {
    if (args.handover_fd >= 0) {
      return Fail(kCmd, InvalidArgument("--detach and --handover-fd exclude each other"));
    }
    return Detach(args, *id, signals->get());
  }
  options.upgrade_timeout = Millis(args.upgrade_timeout_s);
  if (auto self = os::SelfExecutable(); self.ok()) options.self_binary = *self;

  // One fd per client: take every fd the hard limit allows (the soft default of 1024 is a
  // select()-era guess). A daemon that still runs out pauses accepting (docs/daemon.md).
  auto fd_limit = os::RaiseFdLimitToHard();
  if (!fd_limit.ok()) {
    LOG_WARN << fd_limit.status().ToString();
  } else if (fd_limit->raised) {
    LOG_DEBUG << "RLIMIT_NOFILE soft limit raised to the hard limit, " << fd_limit->soft;
  }

  options.metrics = std::make_shared<daemon::DaemonMetrics>(
      daemon::MetricsIdentity{id->device_key, id->config.model_id, id->config.tier});
  if (args.metrics_fd >= 0 && (args.handover_fd < 0 || args.metrics_addr.empty())) {
    return Fail(kCmd, InvalidArgument("--metrics-fd is an upgrade's: it needs --handover-fd and "
                                      "--metrics-addr"));
  }
  std::unique_ptr<daemon::MetricsServer> metrics_server;
  if (!args.metrics_addr.empty()) {
    daemon::MetricsServerOptions metrics_options;
    metrics_options.address = args.metrics_addr;
    metrics_options.request_timeout = Millis(args.metrics_timeout_s);
    // An upgrade's successor serves the listener its predecessor handed over (--metrics-fd)
    // instead of binding the address, which the predecessor holds until it exits.
    metrics_options.inherited_fd = args.metrics_fd;
    auto server = daemon::MetricsServer::Create(
        metrics_options, [metrics = options.metrics] { return metrics->Render(); });
    if (server.ok()) {
      metrics_server = std::move(server).value();
    } else if (args.handover_fd >= 0 && args.metrics_fd < 0) {
      // The successor of an older build, which hands over no metrics listener: the address
      // is still its predecessor's.
      LOG_WARN << "metrics not served: " << server.status().ToString()
               << " (the predecessor handed over no metrics listener)";
    } else {
      return Fail(kCmd, server.status());
    }
  }
  // A successor inherits our metrics listener (docs/metrics.md "Upgrade").
  options.start_successor = [listener = metrics_server ? metrics_server->listener_fd() : -1](
                                const std::string& binary, int channel) {
    return serve::StartSuccessor(ProgramArgs(), binary, channel, listener);
  };

  int64_t predecessor = 0;
  Result<std::unique_ptr<daemon::Daemon>> daemon = [&] {
    if (args.handover_fd < 0) return daemon::Daemon::Create(options);
    return serve::TakeOver(args.handover_fd, *id, options, &predecessor);
  }();
  if (!daemon.ok()) return Fail(kCmd, daemon.status());
  // Admission once we hold the identity lock (and the device dir exists), before loading.
  auto budget_ledger =
      serve::AdmitUnderBudget(args.budget, *id, args.identity.model_dir, signals->get());
  if (!budget_ledger.ok()) {
    daemon->reset();
    return Fail(kCmd, budget_ledger.status());
  }

  {
    std::string device = id->device_key;
    if (id->device) {
      device +=
          " (" + id->device->name + ", local index " + std::to_string(id->device->index) + ")";
    }
    LOG_INFO << "serving " << options.config.model_id
             << (options.config.revision.empty() ? "" : "@" + options.config.revision) << " tp "
             << options.config.tp_rank << "/" << options.config.tp_size << " pp "
             << options.config.pp_rank << "/" << options.config.pp_size << " ep "
             << options.config.ep_rank << "/" << options.config.ep_size << ", tier "
             << TierName(options.config.tier) << ", device " << device << ", digest "
             << options.config.ShortDigest() << ", socket " << options.paths.socket << ", pid "
             << ::getpid();
  }

  if (metrics_server) {
    metrics_server->Start();
    LOG_INFO << "metrics at " << metrics_server->endpoint()
             << (args.metrics_fd >= 0 ? " (handed over by pid " + std::to_string(predecessor) + ")"
                                      : std::string());
  }

  ProgressPrinter progress;
  daemon::DaemonEvents events;
  std::string adopted;  // set by on_adopted: the ready line says so
  events.on_adopted = [&](std::string_view how) { adopted = how; };
  // The unit's STATUS follows the load (`systemctl status`): at most once a second, and at its
  // end, so that a slow load shows where it is without a datagram per batch.
  // Empty until the first STATUS (a time_point::min() start would overflow `now - last`).
  std::optional<std::chrono::steady_clock::time_point> last_status;
  events.on_progress = [&](uint64_t done, uint64_t total, double seconds) {
    progress.Update(done, total, seconds);
    const auto now = std::chrono::steady_clock::now();
    const bool recent = last_status && now - *last_status < std::chrono::seconds(1);
    if (!service_manager || (recent && done < total)) return;
    last_status = now;
    const uint64_t percent = total == 0 ? 100 : done * 100 / total;
    notify("STATUS=loading " + options.config.model_id + ": " + std::to_string(percent) + "% (" +
           daemon::FormatBytes(done) + " of " + daemon::FormatBytes(total) + ")");
  };
  events.on_ready = [&](const daemon::StoreSummary& s, double seconds) {
    progress.EndLine();
    if (registration) {
      registration->Ready(s, (*daemon)->StoreFds(), (*daemon)->StoreCreatingHandles());
    }
    if (ready_notice) ready_notice->Send(launcher::ReadyNotice::What::kReady);
    // MAINPID: an upgrade's successor (NotifyAccess=all in the unit) becomes the main process.
    notify("READY=1\nMAINPID=" + std::to_string(::getpid()) +
           "\nSTATUS=ready: " + std::to_string(s.tensor_count) + " tensors, " +
           daemon::FormatBytes(s.tensor_bytes) + (adopted.empty() ? "" : ", adopted " + adopted));
    if (!adopted.empty()) {
      LOG_INFO << "ready: adopted " << s.tensor_count << " tensors, "
               << daemon::FormatBytes(s.tensor_bytes) << " ("
               << daemon::FormatBytes(s.resident_bytes) << " resident) in " << seconds << " s ("
               << SecondsSinceStart() << " s since serve started), " << adopted
               << "; no checkpoint byte read";
      return;
    }
    LOG_INFO << "ready: " << s.tensor_count << " tensors, " << daemon::FormatBytes(s.tensor_bytes)
             << " (" << daemon::FormatBytes(s.resident_bytes) << " resident) in " << seconds
             << " s, " << Rate(s.tensor_bytes, seconds) << ", "
             << (s.filled_from.empty() ? std::string("loaded from disk") : s.filled_from);
  };
  events.on_failed = [&](const Status& why) {
    progress.EndLine();
    if (ready_notice) ready_notice->Send(launcher::ReadyNotice::What::kFailed);
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
    progress.EndLine();
    if (registration) registration->Draining();
    notify("STOPPING=1\nSTATUS=draining: " + std::string(reason));
  };
  notify("STATUS=loading " + options.config.model_id + " (digest " + options.config.ShortDigest() +
         ")");
  // Each change of the client count goes to the ledger from the writer's thread, never from
  // the event loop (a ledger lock held by a hung peer must not stall attaches).
  std::optional<daemon::LedgerClientsWriter> clients_writer;
  if (*budget_ledger) {
    clients_writer.emplace(**budget_ledger, options.paths.socket, serve::kLedgerLockWait);
    events.on_clients = [&clients_writer](uint32_t clients) { clients_writer->Set(clients); };
  }

  Status result = (*daemon)->Run(signals->get(), events);
  // The registry entry goes first, while we still hold the lock: once `stop` sees the lock
  // free, no registry reader finds us any more (the revocation is bounded by
  // --registry-timeout per endpoint).
  registration.reset();
  daemon->reset();  // withdraw the socket, then release the lock, before we report
  clients_writer.reset();
  serve::LeaveBudget(budget_ledger->get(), options.paths.socket);
  if (!result.ok()) return Fail(kCmd, result);
  LOG_INFO << "stopped";
  return kExitOk;
}

}  // namespace

void RegisterServeCommand(CLI::App& root) {
  auto args = std::make_shared<ServeArgs>();
  CLI::App* sub = root.add_subcommand(
      "serve",
      "Run one cache daemon in the foreground: load a checkpoint once (or, with --source "
      "published:<tag>, await its publisher), serve it");
  AddIdentityFlags(sub, &args->identity, IdentityScope::kOneCache);
  sub->add_option("--allow-uid", args->allow_uids,
                  "also accept clients of this uid (repeatable; default: our uid only). With "
                  "--allow-uid/--allow-gid the cache dirs are made 0755 and the socket 0666, "
                  "and SO_PEERCRED decides who may talk to the daemon");
  sub->add_option("--allow-gid", args->allow_gids,
                  "also accept clients whose primary gid is this (repeatable)");
  sub->add_option("--memory-budget", args->memory_budget,
                  "refuse to load a plan larger than this (e.g. 20G, 512M, bytes)");
  sub->add_option("--gpu-budget", args->budget.gpu_budget,
                  "the device's budget for gpu-tier caches, bytes or N% of the device's memory "
                  "(default: gpu_budget in the device's budget.conf; docs/budget.md)");
  sub->add_option("--host-budget", args->budget.host_budget,
                  "the budget for host-tier caches of this runtime dir, bytes (default: "
                  "host_budget in budget.conf)");
  sub->add_flag("--pin", args->budget.pin, "never evict this cache to make room for another");
  sub->add_option("--demote", args->budget.demote,
                  "`host`: when evicted, an idle gpu-tier cache moves its memory to host RAM "
                  "(within the host budget) and stays up; the next attach promotes it back. "
                  "`host-pinned`: the same, and the host copy is pinned behind the demotion so "
                  "that a promotion runs at the pinned-H2D rate, for a CUDA context (its device "
                  "memory) held while demoted (docs/budget.md)");
  CLI::Option* wait =
      sub->add_flag(
             "--wait{0}", args->budget.wait_s,
             "--wait[=SECONDS]: when the budget has no room and no idle cache can be evicted, "
             "wait for room (planning again every 250 ms) instead of exiting 8 at once; a bare "
             "--wait has no limit, --wait=SECONDS gives up after SECONDS with the same exit 8")
          ->check(AtLeast(0));
  sub->add_option("--threads", args->threads, "reader threads of the load (default 16)")
      ->check(InRange(1, 256));
  sub->add_option("--failed-linger", args->failed_linger_s,
                  "seconds a failed daemon keeps answering `failed` before exiting (default 30)")
      ->check(AtLeast(0));
  sub->add_option("--handshake-timeout", args->handshake_timeout_s,
                  "seconds a connection that has not attached may go without a request before "
                  "it is closed (default 10)")
      ->check(Positive());
  sub->add_option("--stall-timeout", args->stall_timeout_s,
                  "seconds a connection may leave our replies unread before it is closed "
                  "(default 30)")
      ->check(Positive());
  sub->add_option("--publish-timeout", args->publish_timeout_s,
                  "seconds a publisher (--source published:<tag>) may take from its plan to "
                  "its commit before its arena is freed (default 600)")
      ->check(Positive());
  sub->add_option("--max-connections", args->max_connections,
                  "connections served at once; the next get an Error and are closed (default "
                  "4096)")
      ->check(InRange(1, 1 << 20));
  sub->add_flag("--replace", args->replace,
                "with --source published:<tag>: a publish into the ready cache replaces it "
                "(attached clients keep the old weights; new attaches get the new ones)");
  sub->add_flag("--no-keeper", args->no_keeper,
                "run without a keeper: a crash or kill -9 of the daemon loses the loaded memory "
                "(default: a ready cache is deposited with its keeper, and a restart re-adopts it "
                "without reading the checkpoint; docs/keeper.md)");
  sub->add_option("--adopt-verify", args->adopt_verify,
                  "what a re-adoption checks against the kept memory: sample (64 tensors spread "
                  "over the cache, the default: sealed memory cannot change, and the time stays "
                  "flat in the cache's size), full (every tensor), or behind (ready once the fds, "
                  "the config and the checkpoint are checked, then every tensor checked right "
                  "after ready: no CUDA context before ready; a mismatch drains the daemon and "
                  "drops the keeper; clients attaching meanwhile get memory not yet re-checked)")
      ->check(CLI::IsMember({"sample", "full", "behind"}));
  sub->add_flag("--detach", args->detach,
                "start the daemon in the background and exit 0 once it serves (`ready`, or "
                "`awaiting` its publisher for --source published:<tag>), printing its socket, "
                "pid and log; a daemon that fails first makes this exit with its exit code");
  sub->add_flag("--json", args->json, "with --detach: print launch's JSON summary");
  sub->add_option("--ready-timeout", args->ready_timeout_s,
                  "with --detach: seconds the daemon may take to serve before it is stopped "
                  "(exit 6; default 600)")
      ->check(Positive());
  sub->add_option("--log-file", args->log_file,
                  "with --detach: the daemon's log (default "
                  "<runtime>/<namespace>/logs/serve-<digest>.log)");
  sub->add_option("--upgrade-timeout", args->upgrade_timeout_s,
                  "seconds an upgrade's successor has to validate the handover and take over "
                  "before it is killed and this daemon serves on (default 60; docs/upgrade.md)")
      ->check(Positive());
  sub->add_option("--handover-fd", args->handover_fd,
                  "internal: set by `weightcache upgrade` on the successor it starts (the "
                  "channel the old daemon hands the cache over on)")
      ->check(InRange(3, 1 << 20));
  sub->add_option("--metrics-addr", args->metrics_addr,
                  "serve Prometheus metrics (GET /metrics) on HOST:PORT (port 0: a free one, "
                  "printed at start) or on an absolute Unix socket path (docs/metrics.md); a "
                  "path someone listens on is busy (exit 1), a stale socket there is replaced");
  sub->add_option("--metrics-timeout", args->metrics_timeout_s,
                  "seconds a scraper has to send its request, and then to take the response, "
                  "before its connection is closed (default 2; when all 16 connections are "
                  "taken, one that has sent no complete request within 250 ms is closed for a "
                  "waiting scraper: docs/metrics.md)")
      ->check(Positive());
  sub->add_option("--metrics-fd", args->metrics_fd,
                  "internal: set by `weightcache upgrade` on the successor it starts (the old "
                  "daemon's metrics listener, served instead of binding --metrics-addr)")
      ->check(InRange(3, 1 << 20));
  sub->add_option("--seed-from", args->seed_from,
                  "auto, or the socket of a cache of this exact identity: before reading the "
                  "checkpoint, copy the weights from a peer cache (auto: the same identity on "
                  "another device of this runtime dir and namespace, each in turn; the gpu tier "
                  "copies device to device, which another GPU's cache allows with peer access), "
                  "verified like a fill (layout, every tensor's checksum, a sample of our own "
                  "checkpoint) before ready; tried before --fill-from; any failure reads the disk "
                  "(docs/seeding.md)");
  AddRegistryFlags(sub, &args->registry, RegistryFlagScope::kServe);
  SetAction(sub, [args, wait] {
    if (wait->count() == 0) args->budget.wait_s = -1;  // no --wait: fail at once
    return Run(*args);
  });
}

}  // namespace weightcache::cli
