// Admission under the device's budget (docs/budget.md), as `serve` composes it around its
// daemon: the budget of the cache's tier (the flag, else the device's budget.conf), the
// admission into the device's ledger (evicting idle caches of the LRU order over their
// sockets, waiting for room with --wait), the demotion hooks a `--demote host` daemon calls,
// and leaving the ledger at stop. The ledger and its rules are daemon/budget.h; this is only
// their use by one serving process.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "daemon/budget.h"
#include "daemon/daemon.h"
#include "identity/resolve.h"
#include "weightcache/status.h"
#include "weightcache/tier.h"

namespace weightcache::serve {

// What serve's budget flags say (docs/budget.md).
struct BudgetOptions {
  std::string gpu_budget;   // --gpu-budget: bytes or N%; "" = the device's budget.conf, if any
  std::string host_budget;  // --host-budget: bytes; "" = budget.conf's, if any
  bool pin = false;         // --pin: never evicted to make room for another cache
  std::string demote;       // --demote host|host-pinned: demoted to host RAM when evicted
  // --wait[=SECONDS]: when nothing can be freed, wait for room. < 0: fail at once (no --wait);
  // 0: no limit (a bare --wait); otherwise the seconds to wait at most.
  double wait_s = -1;
};

// How long a serving daemon waits for the ledger's lock (its client-count writer, a
// demotion's move of its entry, and the removal at stop) before it gives up and logs it: a peer
// hung inside its critical section must not hang us (docs/budget.md).
inline constexpr std::chrono::seconds kLedgerLockWait{5};

// The budget of this cache's tier on its device: the flag, else the device's budget.conf, else
// none (std::nullopt). kInvalidArgument for a value that does not parse.
// `tier`: another tier's budget (a demotion's host budget); default the cache's own.
Result<std::optional<uint64_t>> TierBudget(const BudgetOptions& options,
                                           const identity::ResolvedIdentity& id,
                                           std::optional<Tier> tier = std::nullopt);

// `serve --demote host` (docs/budget.md, "Demotion and promotion"): the daemon's hooks into the
// device's ledger; empty (disabled) without --demote. kInvalidArgument for another tier.
Result<daemon::DemotionOptions> DemotionHooks(const BudgetOptions& options,
                                              const identity::ResolvedIdentity& id);

// Registers this cache (the checkpoint at `model_dir`) in the device's ledger, or fails
// kOutOfMemory naming the budget, the need and the holders; a stop signal on `signal_fd`
// ends a --wait. Returns the ledger to leave at stop (nullptr: no budget applies).
Result<std::unique_ptr<daemon::BudgetLedger>> AdmitUnderBudget(const BudgetOptions& options,
                                                               const identity::ResolvedIdentity& id,
                                                               const std::string& model_dir,
                                                               int signal_fd);

// Our own entry leaves the ledger at stop (an upgrade's successor registered its own pid). A
// lock held past kLedgerLockWait leaves it behind: the next reader reclaims it once we exit.
void LeaveBudget(daemon::BudgetLedger* ledger, const std::string& socket);

}  // namespace weightcache::serve
