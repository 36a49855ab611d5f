// `weightcache serve` as a library call (docs/daemon.md): the composition root that puts around
// one daemon what a serving process needs — the identity and its shard plan checked before the
// lock, admission under the device's budget, the demotion hooks, seeding and the fleet's fill,
// the fleet registration, the keeper or the service manager's fd store, systemd readiness and
// status, the metrics server, an upgrade's successor or takeover, and the launcher's ready
// notice — then runs it until a stop signal, and releases it all in order.
//
// Two steps, so that the CLI can detach in between (serve --detach re-runs its own command line
// as a background daemon once everything it would refuse has been refused here):
//   1. Prepare(options): every check that needs no lock (exit 2, 5 and the fleet's refusals come
//      from here, before anything starts); it resolves the identity, which loads the CUDA driver
//      for the gpu tier, so the caller blocks its stop signals first.
//   2. Run(plan, signal_fd, notice, hooks): the daemon, from its lock to its stop.
// The CLI (tools/cmd_serve.cc) parses flags into ServeOptions, owns the process (signals, the
// terminal's progress line) and prints.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "daemon/daemon.h"
#include "identity/resolve.h"
#include "launcher/ready_notice.h"
#include "serve/admission.h"
#include "serve/fleet_options.h"
#include "weightcache/identity_options.h"
#include "weightcache/status.h"

namespace weightcache::serve {

struct ServeOptions {
  IdentityOptions identity;
  std::vector<uint32_t> allow_uids;  // besides our own uid (SO_PEERCRED)
  std::vector<uint32_t> allow_gids;
  uint64_t memory_budget = 0;  // --memory-budget: refuse a larger plan; 0 = no limit
  BudgetOptions budget;        // --gpu-budget, --host-budget, --pin, --demote, --wait
  int threads = 16;            // reader threads of the load
  std::chrono::milliseconds failed_linger{30'000};
  std::chrono::milliseconds handshake_timeout{10'000};
  std::chrono::milliseconds stall_timeout{30'000};
  std::chrono::milliseconds publish_timeout{600'000};
  std::chrono::milliseconds upgrade_timeout{60'000};
  size_t max_connections = 4096;
  bool replace = false;                 // --replace: a publish into the ready cache replaces it
  bool keeper = true;                   // --no-keeper: false
  std::string adopt_verify = "sample";  // sample|full|behind (docs/keeper.md)
  std::string metrics_addr;             // HOST:PORT or a Unix socket path; "" = none
  std::chrono::milliseconds metrics_timeout{2'000};
  int metrics_fd = -1;    // an upgrade's successor: the old daemon's metrics listener
  int handover_fd = -1;   // an upgrade's successor: the channel from the old daemon
  FleetOptions fleet;     // --registry, --fill-* (docs/fleet.md)
  std::string seed_from;  // auto|SOCKET (docs/seeding.md)
  // --detach: this process only starts the daemon (the fd store is then the daemon's to take).
  bool detach = false;
  // This process's command line, which an upgrade's successor runs again (serve/successor.h).
  std::vector<std::string> program_args;
  // When the process started: the adopted ready line says how long it all took.
  std::chrono::steady_clock::time_point process_start = std::chrono::steady_clock::now();
};

// What the caller shows of a load in progress (the CLI's terminal line); both may be empty.
struct ServeHooks {
  std::function<void(uint64_t done, uint64_t total, double seconds)> on_progress;
  // The load's progress is over (ready, failed or draining): a line left open is ended.
  std::function<void()> end_progress;
};

// What Prepare resolved and built, for Run. Move-only.
class Plan {
 public:
  ~Plan();
  Plan(Plan&&) noexcept;
  Plan& operator=(Plan&&) noexcept;
  const identity::ResolvedIdentity& identity() const;

  struct Parts;  // serve.cc's

 private:
  friend Result<Plan> Prepare(const ServeOptions& options);
  friend Status Run(Plan plan, int signal_fd, std::optional<launcher::ReadyNotice> notice,
                    const ServeHooks& hooks);
  explicit Plan(std::unique_ptr<Parts> parts);
  std::unique_ptr<Parts> parts_;
};

// Checks and resolves `options`: kInvalidArgument for what the flags themselves refuse (--tier
// gpu without --device, --seed-from, --replace without a published source, the fleet's rules),
// the identity's errors, kInvalidCheckpoint for a checkpoint the shard rules cannot shard, and
// the fleet's (serve/registration.h). Takes no lock and starts no daemon.
Result<Plan> Prepare(const ServeOptions& options);

// Serves `plan` until a stop signal on `signal_fd` (a signalfd of the blocked stop signals) or a
// drain: the daemon takes its lock (kAlreadyServed naming the owner), is admitted under the
// budget (kUnavailable… exit 8), loads or adopts, serves, and on return has withdrawn its
// registry entry, its socket, its lock and its ledger entry, in that order. `notice`: the
// launcher's (launcher/ready_notice.h), told of ready and failed. The load's own error when it
// failed; Ok after a clean stop.
Status Run(Plan plan, int signal_fd, std::optional<launcher::ReadyNotice> notice,
           const ServeHooks& hooks);

}  // namespace weightcache::serve
