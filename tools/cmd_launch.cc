// `weightcache launch`: start (and with --supervise, keep alive) every daemon of one TP×PP
// job on this node. Placement, lifecycle and exit codes: docs/launcher.md. This file only
// parses flags, prepares directories and signals, and prints; src/launcher does the work.
// The identity flags are serve's own (AddIdentityFlags, job scope), so every flag that shapes
// a daemon's CacheConfig is accepted here, and forwarded to every daemon by ServeArgsFor,
// written from the same table (identity_flags.h).
#include <signal.h>
#include <sys/signalfd.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <iostream>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "cli_common.h"
#include "common/unique_fd.h"
#include "daemon/stale_files.h"
#include "identity/device_inventory.h"
#include "identity/paths.h"
#include "identity/resolve.h"
#include "identity_flags.h"
#include "launcher/launcher.h"
#include "launcher/placement.h"
#include "launcher/serve_daemons.h"
#include "os/lock_file.h"
#include "os/read_file.h"
#include "registry_flags.h"
#include "sharding/rules.h"

namespace weightcache::cli {
namespace {

namespace fs = std::filesystem;
using launcher::LaunchReport;

struct LaunchArgs {
  launcher::ServeFlags serve;
  serve::FleetOptions registry;  // serve's fleet flags, forwarded to every daemon (docs/fleet.md)
  int nnodes = 1;
  int node_rank = 0;
  int base_gpu_id = 0;
  int gpu_id_step = 1;
  bool no_gpu = false;  // --no-gpu
  double ready_timeout_s = 600;
  double stop_grace_s = 10;
  bool supervise = false;
  bool json = false;
  std::string log_dir;
  std::string job;
};

// File-name-safe job name: [A-Za-z0-9._-], anything else becomes '_'.
std::string SafeName(std::string s) {
  for (char& c : s) {
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '_' && c != '-') c = '_';
  }
  return s.empty() ? "job" : s;
}

// Blocks the stop signals in this (the only) thread and returns a signalfd for them. The
// daemons are spawned with an empty mask, so they still receive what we send them.
Result<UniqueFd> StopSignalFd() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGHUP);
  if (int rc = ::pthread_sigmask(SIG_BLOCK, &set, nullptr); rc != 0) {
    return IoError("blocking SIGTERM/SIGINT/SIGHUP", rc);
  }
  UniqueFd fd(::signalfd(-1, &set, SFD_CLOEXEC | SFD_NONBLOCK));
  if (!fd) return IoError("signalfd", errno);
  return fd;
}

void PrintHuman(const LaunchReport& report) {
  for (const auto& d : report.daemons) {
    std::printf("%-10s %-6s %s  %-8s %6.2f GB  %6.2f s  pid %d  %s\n", d.name.c_str(),
                d.placement.GpuLabel().c_str(), d.placement.device_uuid.c_str(),
                std::string(launcher::DaemonStateName(d.state)).c_str(),
                static_cast<double>(d.bytes_total) / 1e9, d.seconds, static_cast<int>(d.pid),
                d.socket_path.c_str());
  }
  std::fflush(stdout);
}

int RunLaunch(const LaunchArgs& args) {
  constexpr std::string_view kCmd = "launch";
  auto signal_fd = StopSignalFd();
  if (!signal_fd.ok()) return Fail(kCmd, signal_fd.status());
  // The fleet flags' own rules first (and a build without the fleet refuses them): each
  // daemon's ports are checked once the plan is known, below.
  if (auto fleet = RegistryServeArgs(args.registry, 0); !fleet.ok()) {
    return Fail(kCmd, fleet.status());
  }

  if (args.no_gpu) {
    if (args.serve.identity.tier != Tier::kHost) {
      return Fail(kCmd, InvalidArgument("--no-gpu needs --tier host: the gpu tier's daemons "
                                        "each hold a GPU"));
    }
    if (!args.serve.seed_from.empty()) {
      return Fail(kCmd, InvalidArgument("--no-gpu and --seed-from: a seed copies from another "
                                        "GPU's cache of this node"));
    }
  }
  std::vector<identity::DeviceInfo> devices;
  if (!args.no_gpu) {
    identity::InventoryOptions inventory;
    inventory.inventory_file = args.serve.identity.device_inventory;
    auto visible = identity::VisibleDevices(inventory);
    if (!visible.ok()) return Fail(kCmd, visible.status());
    devices = std::move(visible).value();
  }

  launcher::LaunchTopology topology;
  topology.tp_size = args.serve.identity.tp_size;
  topology.pp_size = args.serve.identity.pp_size;
  topology.ep_size = args.serve.identity.ep_size;
  topology.nnodes = args.nnodes;
  topology.node_rank = args.node_rank;
  topology.base_gpu_id = args.base_gpu_id;
  topology.gpu_id_step = args.gpu_id_step;
  for (const auto& d : devices) topology.visible_device_uuids.push_back(d.uuid);
  topology.without_gpus = args.no_gpu;
  auto plan = launcher::PlanLaunch(topology);
  if (!plan.ok()) return Fail(kCmd, plan.status());
  // Every daemon's metrics address is valid (the largest rank's port fits), before any starts.
  for (const launcher::DaemonPlacement& p : *plan) {
    auto metrics = launcher::AddrForRank("--metrics-addr", args.serve.metrics_addr,
                                         launcher::JobRank(p, args.serve.identity.tp_size),
                                         launcher::RankedAddr::kHostPortOrUnixPath);
    if (!metrics.ok()) return Fail(kCmd, metrics.status());
  }
  // Likewise the fleet flags: the rules serve applies to them, and each daemon's ports.
  std::map<int, std::vector<std::string>> fleet_args;
  for (const launcher::DaemonPlacement& p : *plan) {
    const int rank = launcher::JobRank(p, args.serve.identity.tp_size);
    auto forwarded = RegistryServeArgs(args.registry, rank);
    if (!forwarded.ok()) return Fail(kCmd, forwarded.status());
    fleet_args[rank] = std::move(forwarded).value();
  }

  launcher::ServeFlags serve = args.serve;
  serve.identity_args = ServeArgsFor;
  serve.fleet_args = [fleet_args](int rank) { return fleet_args.at(rank); };
  IdentityOptions& id = serve.identity;
  if (id.namespace_name.empty()) id.namespace_name = std::string(identity::kDefaultNamespace);
  if (Status s = identity::ValidateNamespace(id.namespace_name); !s.ok()) return Fail(kCmd, s);
  auto runtime = identity::ResolveRuntimeDir(id.runtime_dir, identity::ProcessEnv());
  if (!runtime.ok()) return Fail(kCmd, runtime.status());
  id.runtime_dir = runtime->path;
  const std::string namespace_dir = runtime->path + "/" + id.namespace_name;
  for (const std::string& dir : {runtime->path, namespace_dir}) {
    if (Status s = identity::EnsurePrivateDirWithParents(dir); !s.ok()) return Fail(kCmd, s);
  }
  launcher::JobFiles files;
  files.log_dir =
      args.log_dir.empty() ? namespace_dir + "/logs" : fs::absolute(args.log_dir).string();
  if (Status s = identity::EnsurePrivateDirWithParents(files.log_dir); !s.ok())
    return Fail(kCmd, s);
  auto exe = os::SelfExecutable();
  if (!exe.ok()) return Fail(kCmd, exe.status());
  files.exe = *exe;
  // The daemons resolve file flags against their own working directory; make them absolute.
  // A published source has no checkpoint (no --model): its job is named by the model id.
  if (!id.model_dir.empty()) id.model_dir = fs::absolute(id.model_dir).lexically_normal().string();
  if (!id.quantization_config.empty()) {
    id.quantization_config = fs::absolute(id.quantization_config).lexically_normal().string();
  }
  if (!id.device_inventory.empty()) {
    id.device_inventory = fs::absolute(id.device_inventory).lexically_normal().string();
  }
  // --shard-rules: a built-in set's name stays a name; anything else is a rules file.
  if (!id.shard_rules.empty() && !sharding::BuiltinRuleSetText(id.shard_rules).ok()) {
    id.shard_rules = fs::absolute(id.shard_rules).lexically_normal().string();
  }
  const std::string model_name =
      id.model_dir.empty() ? id.model_id : fs::path(id.model_dir).filename().string();
  files.job = SafeName(args.job.empty() ? model_name : args.job);

  // The stale files of the namespace's dead caches (daemon/stale_files.h), one line each.
  auto swept = daemon::SweepStaleFiles(runtime->path, id.namespace_name);
  if (!swept.ok()) return Fail(kCmd, swept.status());
  for (const daemon::CleanedCache& c : swept->cleaned) {
    std::fprintf(stderr, "weightcache launch: %s\n", daemon::DescribeCleaned(c).c_str());
  }
  for (const std::string& w : swept->warnings) {
    std::fprintf(stderr, "weightcache launch: warning: %s\n", w.c_str());
  }

  launcher::LaunchOptions options;
  options.mode = args.supervise ? launcher::SupervisionMode::kSupervise
                                : launcher::SupervisionMode::kExitWhenReady;
  options.ready_timeout = std::chrono::milliseconds(static_cast<long>(args.ready_timeout_s * 1000));
  options.stop_grace = std::chrono::milliseconds(static_cast<long>(args.stop_grace_s * 1000));
  const bool tty = ::isatty(STDERR_FILENO) == 1;
  const auto start = std::chrono::steady_clock::now();
  bool progress_shown = false;
  if (tty) {
    options.on_progress = [&](const std::vector<launcher::DaemonSnapshot>& all) {
      const double elapsed =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      std::fprintf(stderr, "\r\033[K%s", launcher::FormatProgressLine(all, elapsed).c_str());
      progress_shown = true;
    };
  }
  options.on_ready = [&](const std::vector<launcher::DaemonSnapshot>& all) {
    if (progress_shown) std::fprintf(stderr, "\n");
    progress_shown = false;
    if (args.supervise) {
      std::fprintf(stderr, "weightcache launch: %zu daemons ready; supervising (SIGTERM stops)\n",
                   all.size());
    }
  };

  const std::string runtime_dir = runtime->path;
  const std::string ns = id.namespace_name;
  // Publish-await (docs/launcher.md): the daemons of a published source are up once each
  // awaits its publisher, the engine whose first start fills them (docs/engines.md).
  const launcher::AwaitingIs awaiting = identity::IsPublishedSource(id.source)
                                            ? launcher::AwaitingIs::kReady
                                            : launcher::AwaitingIs::kLoading;
  auto l = launcher::Launcher::Create(
      launcher::BuildDaemonSpecs(*plan, serve, files), options,
      [awaiting](const std::string& socket) {
        return launcher::ProbeDaemonState(socket, std::chrono::milliseconds(500), awaiting);
      },
      [](const std::string& lock) -> Result<bool> { return os::IsLockHeld(lock); },
      [runtime_dir, ns](pid_t pid) {
        return launcher::LocatePublishedSocket(runtime_dir, ns, pid);
      });
  if (!l.ok()) return Fail(kCmd, l.status());
  LaunchReport report = l->Run(signal_fd->get());
  if (progress_shown) std::fprintf(stderr, "\n");

  const int code = report.status.ok() ? kExitOk : ExitCodeFor(report.status);
  if (args.json) {
    std::cout << launcher::LaunchSummaryJson(report, code, daemon::CleanedToJson(swept->cleaned))
              << std::endl;
  } else if (report.status.ok()) {
    PrintHuman(report);
  }
  if (!report.status.ok()) {
    Fail(kCmd, report.status);
    if (report.failed_index >= 0 && !report.failed_log_tail.empty()) {
      const auto& d = report.daemons[report.failed_index];
      std::cerr << "--- last " << report.failed_log_tail.size() << " lines of " << d.log_path
                << " ---\n";
      for (const auto& line : report.failed_log_tail) std::cerr << line << "\n";
      std::cerr << "---" << std::endl;
    }
  }
  return code;
}

}  // namespace

void RegisterLaunchCommand(CLI::App& root) {
  auto args = std::make_shared<LaunchArgs>();
  CLI::App* sub = root.add_subcommand(
      "launch",
      "Start the daemons of a TP x PP job on this node's GPUs, wait until all are ready "
      "(exit 6 on --ready-timeout), and with --supervise keep them alive. First removes the "
      "stale files of the namespace's dead caches (those whose lock is free), one line each.");
  auto& s = args->serve;
  AddIdentityFlags(sub, &s.identity, IdentityScope::kJob);
  sub->add_option("--nnodes", args->nnodes, "Nodes of the job")->check(AtLeast(1));
  sub->add_option("--node-rank", args->node_rank, "This node's rank")->check(AtLeast(0));
  sub->add_option("--base-gpu-id", args->base_gpu_id, "First local GPU id")->check(AtLeast(0));
  sub->add_option("--gpu-id-step", args->gpu_id_step, "Local GPU id step between ranks")
      ->check(AtLeast(1));
  sub->add_flag("--no-gpu", args->no_gpu,
                "With --tier host: the daemons hold no GPU, for an engine that runs on CPUs "
                "(its plugin looks for its caches without a device; docs/engines.md)");
  sub->add_option("--ready-timeout", args->ready_timeout_s,
                  "Seconds until every daemon must be ready (exit 6)")
      ->check(Positive());
  sub->add_option("--stop-grace", args->stop_grace_s, "Seconds between SIGTERM and SIGKILL")
      ->check(AtLeast(0));
  sub->add_flag("--supervise", args->supervise,
                "Keep running after ready; restart daemons that die (exponential backoff)");
  sub->add_flag("--json", args->json, "Print a JSON summary on stdout");
  sub->add_option("--log-dir", args->log_dir, "Daemon logs (default <runtime>/<namespace>/logs)");
  sub->add_option("--job", args->job, "Log file prefix (default: the model directory's name)");
  sub->add_option("--memory-budget", s.memory_budget, "Per-daemon memory budget");
  sub->add_option("--threads", s.threads, "Reader threads of each daemon's load (serve's default)")
      ->check(InRange(1, 256));
  sub->add_option("--gpu-budget", s.gpu_budget,
                  "serve's --gpu-budget for every daemon: the device's budget, bytes or N% "
                  "(docs/budget.md)");
  sub->add_option("--host-budget", s.host_budget, "serve's --host-budget for every daemon");
  sub->add_flag("--pin", s.pin, "serve's --pin for every daemon: never evicted for another cache");
  sub->add_option("--demote", s.demote,
                  "serve's --demote for every daemon: `host` moves an evicted idle gpu cache to "
                  "host RAM instead of stopping it, `host-pinned` also pins that copy for a "
                  "promotion at the pinned-H2D rate (docs/budget.md)");
  sub->add_option("--seed-from", s.seed_from,
                  "auto: every daemon first copies its weights from a ready cache of its own "
                  "identity (its rank) on another GPU of this node, verified, then reads the "
                  "disk if none could (serve's --seed-from, docs/seeding.md)")
      ->check(CLI::IsMember({"auto"}));
  sub->add_option("--adopt-verify", s.adopt_verify,
                  "serve's --adopt-verify for every daemon: what a daemon restarted after a crash "
                  "(by --supervise, or by hand) checks of its keeper's memory before ready: "
                  "sample, full, or behind (every tensor right after ready; docs/keeper.md)")
      ->check(CLI::IsMember({"sample", "full", "behind"}));
  sub->add_option("--allow-uid", s.allow_uids,
                  "serve's --allow-uid for every daemon: a uid besides the owner's that may "
                  "attach (repeatable; e.g. engines running as another user)");
  sub->add_option("--allow-gid", s.allow_gids,
                  "serve's --allow-gid for every daemon: a gid whose members may attach "
                  "(repeatable)");
  sub->add_option("--metrics-addr", s.metrics_addr,
                  "serve's --metrics-addr, per daemon: a Unix socket path gets the suffix "
                  ".<rank>, HOST:PORT the port PORT+rank (rank = pp_rank * tp_size + tp_rank; "
                  "port 0: each picks a free one)");
  // --registry, --fill-from, --fill-serve …: serve's, for every daemon. A joining node of a
  // multi-node job (--nnodes, --node-rank) fills each of its ranks from the nodes that hold
  // the same rank (docs/fleet.md "Launch").
  AddRegistryFlags(sub, &args->registry, RegistryFlagScope::kLaunch);
  SetAction(sub, [args] { return RunLaunch(*args); });
}

}  // namespace weightcache::cli
