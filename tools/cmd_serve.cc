// `weightcache serve`: run one daemon in the foreground (docs/design.md "Command line",
// docs/daemon.md).
//
// The flags are parsed here into serve::ServeOptions, and the library's composition root
// (src/serve/serve.h: Prepare, then Run) does the rest: admission under the budget, the
// demotion hooks, seeding, the fleet, the keeper or fd store, systemd readiness, the metrics
// server and the upgrade's two ends.
//
// The identity flags are the attach's own (AddIdentityFlags + identity::ResolveIdentity), so
// a daemon and an engine given the same flags compute the same CacheConfig, device key and
// socket path by construction. This file owns the process-level concerns the library must
// not touch: signals (blocked in every thread, read through a signalfd by the event loop),
// SIGPIPE, the launcher's ready notice (taken from the environment before any thread starts),
// and the terminal's progress line.
//
// --detach runs this same command line as a background daemon (serve/detach.h), once
// serve::Prepare has refused what it would refuse.
//
// Exit codes: 0 clean stop (--detach: the daemon serves); 2 usage; 5 invalid checkpoint; 7 already
// served (the message names the owner's pid); 8 no room under the device's budget (docs/budget.md);
// otherwise the failed load's code (1 for I/O, budget, CUDA).
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <iostream>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "cli_common.h"
#include "common/logging.h"
#include "daemon/byte_size.h"
#include "identity/resolve.h"
#include "identity_flags.h"
#include "launcher/ready_notice.h"
#include "launcher/serve_daemons.h"
#include "os/read_file.h"
#include "registry_flags.h"
#include "serve/detach.h"
#include "serve/serve.h"

namespace weightcache::cli {
namespace {

// The flags, bound by the table in RegisterServeCommand: the library's options (their defaults
// are the options' own), the text of --memory-budget, and --detach's own.
struct ServeArgs {
  serve::ServeOptions options;
  std::string memory_budget;
  // --detach's: its summary as JSON, how long the daemon may take to serve, its log.
  bool json = false;
  double ready_timeout_s = 600;
  std::string log_file;
};

std::chrono::milliseconds Millis(double seconds) {
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
}

// A flag of seconds (fractions allowed) bound to one of the options' durations.
CLI::Option* AddSeconds(CLI::App* sub, const std::string& name, std::chrono::milliseconds* target,
                        const std::string& help) {
  return sub->add_option_function<double>(
      name, [target](double seconds) { *target = Millis(seconds); }, help);
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
                    100.0 * done / total, daemon::FormatRate(done, seconds).c_str(), eta);
      std::cerr << buf << std::flush;
      line_open_ = true;
      return;
    }
    const int quarter = static_cast<int>(4 * done / total);
    if (quarter > last_quarter_ && done < total) {
      last_quarter_ = quarter;
      LOG_INFO << "loading: " << daemon::FormatBytes(done) << " / " << daemon::FormatBytes(total)
               << " (" << 25 * quarter << "%), " << daemon::FormatRate(done, seconds);
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

// `serve --detach` (serve/detach.h): prints the socket and pid (--json: launch's summary).
int Detach(const ServeArgs& args, const identity::ResolvedIdentity& id, int signal_fd) {
  constexpr std::string_view kCmd = "serve";
  auto exe = os::SelfExecutable();
  if (!exe.ok()) return Fail(kCmd, exe.status());
  serve::DetachOptions options;
  options.argv = ProgramArgs();
  options.argv.front() = *exe;
  options.log_file = args.log_file;
  options.ready_timeout = Millis(args.ready_timeout_s);
  auto detached = serve::Detach(options, id, signal_fd);
  if (!detached.ok()) return Fail(kCmd, detached.status());
  const launcher::LaunchReport& report = detached->report;
  if (args.json) {
    std::cout << launcher::LaunchSummaryJson(report, detached->exit_code) << std::endl;
  } else if (report.status.ok()) {
    const auto& d = report.daemons.front();
    std::cout << "socket " << d.socket_path << "\npid " << d.pid << "\nlog " << d.log_path
              << std::endl;
  }
  if (!report.status.ok()) {
    std::cerr << "weightcache " << kCmd << ": " << report.status.ToString() << std::endl;
  }
  return detached->exit_code;
}

int Run(ServeArgs& args) {
  constexpr std::string_view kCmd = "serve";
  serve::ServeOptions& options = args.options;
  if (!args.memory_budget.empty()) {
    auto budget = daemon::ParseByteSize(args.memory_budget);
    if (!budget.ok()) return Fail(kCmd, budget.status().Context("--memory-budget"));
    options.memory_budget = *budget;
  }
  options.program_args = ProgramArgs();
  options.process_start = ProcessStart();
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

  auto plan = serve::Prepare(options);
  if (!plan.ok()) return Fail(kCmd, plan.status());
  if (options.detach) {
    if (options.handover_fd >= 0) {
      return Fail(kCmd, InvalidArgument("--detach and --handover-fd exclude each other"));
    }
    return Detach(args, plan->identity(), signals->get());
  }
  ProgressPrinter progress;
  serve::ServeHooks hooks;
  hooks.on_progress = [&progress](uint64_t done, uint64_t total, double seconds) {
    progress.Update(done, total, seconds);
  };
  hooks.end_progress = [&progress] { progress.EndLine(); };
  Status result =
      serve::Run(std::move(plan).value(), signals->get(), std::move(ready_notice), hooks);
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
  AddIdentityFlags(sub, &args->options.identity, IdentityScope::kOneCache);
  sub->add_option("--allow-uid", args->options.allow_uids,
                  "also accept clients of this uid (repeatable; default: our uid only). With "
                  "--allow-uid/--allow-gid the cache dirs are made 0755 and the socket 0666, "
                  "and SO_PEERCRED decides who may talk to the daemon");
  sub->add_option("--allow-gid", args->options.allow_gids,
                  "also accept clients whose primary gid is this (repeatable)");
  sub->add_option("--memory-budget", args->memory_budget,
                  "refuse to load a plan larger than this (e.g. 20G, 512M, bytes)");
  sub->add_option("--gpu-budget", args->options.budget.gpu_budget,
                  "the device's budget for gpu-tier caches, bytes or N% of the device's memory "
                  "(default: gpu_budget in the device's budget.conf; docs/budget.md)");
  sub->add_option("--host-budget", args->options.budget.host_budget,
                  "the budget for host-tier caches of this runtime dir, bytes (default: "
                  "host_budget in budget.conf)");
  sub->add_flag("--pin", args->options.budget.pin,
                "never evict this cache to make room for another");
  sub->add_option("--demote", args->options.budget.demote,
                  "`host`: when evicted, an idle gpu-tier cache moves its memory to host RAM "
                  "(within the host budget) and stays up; the next attach promotes it back. "
                  "`host-pinned`: the same, and the host copy is pinned behind the demotion so "
                  "that a promotion runs at the pinned-H2D rate, for a CUDA context (its device "
                  "memory) held while demoted (docs/budget.md)");
  CLI::Option* wait =
      sub->add_flag(
             "--wait{0}", args->options.budget.wait_s,
             "--wait[=SECONDS]: when the budget has no room and no idle cache can be evicted, "
             "wait for room (planning again every 250 ms) instead of exiting 8 at once; a bare "
             "--wait has no limit, --wait=SECONDS gives up after SECONDS with the same exit 8")
          ->check(AtLeast(0));
  sub->add_option("--threads", args->options.threads, "reader threads of the load (default 16)")
      ->check(InRange(1, 256));
  AddSeconds(sub, "--failed-linger", &args->options.failed_linger,
             "seconds a failed daemon keeps answering `failed` before exiting (default 30)")
      ->check(AtLeast(0));
  AddSeconds(sub, "--handshake-timeout", &args->options.handshake_timeout,
             "seconds a connection that has not attached may go without a request before "
             "it is closed (default 10)")
      ->check(Positive());
  AddSeconds(sub, "--stall-timeout", &args->options.stall_timeout,
             "seconds a connection may leave our replies unread before it is closed "
             "(default 30)")
      ->check(Positive());
  AddSeconds(sub, "--publish-timeout", &args->options.publish_timeout,
             "seconds a publisher (--source published:<tag>) may take from its plan to "
             "its commit before its arena is freed (default 600)")
      ->check(Positive());
  sub->add_option("--max-connections", args->options.max_connections,
                  "connections served at once; the next get an Error and are closed (default "
                  "4096)")
      ->check(InRange(1, 1 << 20));
  sub->add_flag("--replace", args->options.replace,
                "with --source published:<tag>: a publish into the ready cache replaces it "
                "(attached clients keep the old weights; new attaches get the new ones)");
  sub->add_flag_function(
      "--no-keeper", [args](int64_t) { args->options.keeper = false; },
      "run without a keeper: a crash or kill -9 of the daemon loses the loaded memory "
      "(default: a ready cache is deposited with its keeper, and a restart re-adopts it "
      "without reading the checkpoint; docs/keeper.md)");
  sub->add_option("--adopt-verify", args->options.adopt_verify,
                  "what a re-adoption checks against the kept memory: sample (64 tensors spread "
                  "over the cache, the default: sealed memory cannot change, and the time stays "
                  "flat in the cache's size), full (every tensor), or behind (ready once the fds, "
                  "the config and the checkpoint are checked, then every tensor checked right "
                  "after ready: no CUDA context before ready; a mismatch drains the daemon and "
                  "drops the keeper; clients attaching meanwhile get memory not yet re-checked)")
      ->check(CLI::IsMember({"sample", "full", "behind"}));
  sub->add_flag("--detach", args->options.detach,
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
  AddSeconds(sub, "--upgrade-timeout", &args->options.upgrade_timeout,
             "seconds an upgrade's successor has to validate the handover and take over "
             "before it is killed and this daemon serves on (default 60; docs/upgrade.md)")
      ->check(Positive());
  sub->add_option("--handover-fd", args->options.handover_fd,
                  "internal: set by `weightcache upgrade` on the successor it starts (the "
                  "channel the old daemon hands the cache over on)")
      ->check(InRange(3, 1 << 20));
  sub->add_option("--metrics-addr", args->options.metrics_addr,
                  "serve Prometheus metrics (GET /metrics) on HOST:PORT (port 0: a free one, "
                  "printed at start) or on an absolute Unix socket path (docs/metrics.md); a "
                  "path someone listens on is busy (exit 1), a stale socket there is replaced");
  AddSeconds(sub, "--metrics-timeout", &args->options.metrics_timeout,
             "seconds a scraper has to send its request, and then to take the response, "
             "before its connection is closed (default 2; when all 16 connections are "
             "taken, one that has sent no complete request within 250 ms is closed for a "
             "waiting scraper: docs/metrics.md)")
      ->check(Positive());
  sub->add_option("--metrics-fd", args->options.metrics_fd,
                  "internal: set by `weightcache upgrade` on the successor it starts (the old "
                  "daemon's metrics listener, served instead of binding --metrics-addr)")
      ->check(InRange(3, 1 << 20));
  sub->add_option("--seed-from", args->options.seed_from,
                  "auto, or the socket of a cache of this exact identity: before reading the "
                  "checkpoint, copy the weights from a peer cache (auto: the same identity on "
                  "another device of this runtime dir and namespace, each in turn; the gpu tier "
                  "copies device to device, which another GPU's cache allows with peer access), "
                  "verified like a fill (layout, every tensor's checksum, a sample of our own "
                  "checkpoint) before ready; tried before --fill-from; any failure reads the disk "
                  "(docs/seeding.md)");
  AddRegistryFlags(sub, &args->options.fleet, RegistryFlagScope::kServe);
  SetAction(sub, [args, wait] {
    if (wait->count() == 0) args->options.budget.wait_s = -1;  // no --wait: fail at once
    return Run(*args);
  });
}

}  // namespace weightcache::cli
