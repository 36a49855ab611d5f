#include "serve/admission.h"

#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <string>

#include "checkpoint/checkpoint.h"
#include "common/logging.h"
#include "daemon/byte_size.h"
#include "identity/paths.h"
#include "os/syscalls.h"
#include "protocol/connection.h"

namespace weightcache::serve {
namespace {

// How long admission waits for the caches it evicted to give their memory back.
constexpr std::chrono::seconds kEvictionTimeout{30};

// An idle cache of the LRU order gives its memory back when asked (an Evict over its socket):
// it stops, or is demoted to host RAM (--demote host); it refuses when it has clients or is
// pinned.
Result<daemon::EvictAnswer> EvictVictim(const daemon::LedgerEntry& victim) {
  const auto timeout = std::chrono::seconds(5);
  WEIGHTCACHE_ASSIGN_OR_RETURN(auto conn, protocol::Connection::Connect(victim.socket, timeout));
  WEIGHTCACHE_ASSIGN_OR_RETURN(protocol::EvictReply reply,
                               conn.Evict(os::Deadline::After(timeout)));
  return daemon::EvictAnswer{.accepted = reply.evicted, .reason = reply.reason};
}

// How often a waiting admission (--wait) plans again, and how often it says it still waits.
constexpr std::chrono::milliseconds kWaitPoll{250};
constexpr std::chrono::seconds kWaitProgressEvery{10};

// One admission (daemon::AdmitEvicting); with --wait, an admission that finds nothing to free
// (kOutOfMemory) is planned again every kWaitPoll (the ledger re-read, idle caches asked
// again) until it gets in, the wait runs out (the last refusal, exit 8), or a stop signal
// arrives (the same, saying so). A progress line says what it waits for.
Status AdmitOrWait(const BudgetOptions& options, daemon::BudgetLedger& ledger,
                   const daemon::LedgerEntry& self, uint64_t budget, const daemon::EvictFn& evict,
                   int signal_fd) {
  const auto start = std::chrono::steady_clock::now();
  const bool forever = options.wait_s == 0;
  const auto until = start + std::chrono::duration_cast<std::chrono::milliseconds>(
                                 std::chrono::duration<double>(std::max(options.wait_s, 0.0)));
  auto last_progress = start - kWaitProgressEvery;
  for (;;) {
    Status admitted = daemon::AdmitEvicting(ledger, self, budget, evict,
                                            std::chrono::steady_clock::now() + kEvictionTimeout);
    if (admitted.ok() || admitted.code() != StatusCode::kOutOfMemory || options.wait_s < 0) {
      return admitted;
    }
    const auto now = std::chrono::steady_clock::now();
    if (!forever && now >= until) {
      return Status(StatusCode::kOutOfMemory,
                    admitted.message() + " (waited " +
                        std::to_string(static_cast<int64_t>(options.wait_s)) + " s, --wait)");
    }
    if (now - last_progress >= kWaitProgressEvery) {
      last_progress = now;
      const auto waited = std::chrono::duration_cast<std::chrono::seconds>(now - start).count();
      std::string left = "no limit";
      if (!forever) {
        left =
            std::to_string(std::chrono::duration_cast<std::chrono::seconds>(until - now).count()) +
            " s left";
      }
      LOG_INFO << "waiting for room (--wait, " << waited << " s so far, " << left
               << "): " << admitted.message();
    }
    pollfd stop{};
    stop.fd = signal_fd;
    stop.events = POLLIN;
    const int ready = os::SysCalls::Default().Poll(&stop, 1, static_cast<int>(kWaitPoll.count()));
    if (ready > 0) {
      return Status(StatusCode::kOutOfMemory,
                    "stopped while waiting for room (--wait): " + admitted.message());
    }
  }
}

}  // namespace

// The budget of this cache's tier on its device: the flag, else the device's budget.conf, else
// none (std::nullopt). kInvalidArgument for a value that does not parse.
// `tier`: another tier's budget (a demotion's host budget); default the cache's own.
Result<std::optional<uint64_t>> TierBudget(const BudgetOptions& options,
                                           const identity::ResolvedIdentity& id,
                                           std::optional<Tier> tier) {
  const bool gpu = tier.value_or(id.config.tier) == Tier::kGpu;
  std::string text = gpu ? options.gpu_budget : options.host_budget;
  std::string from = gpu ? "--gpu-budget" : "--host-budget";
  if (text.empty()) {
    const std::string conf = identity::BudgetConfigPath(id.paths.device_dir);
    WEIGHTCACHE_ASSIGN_OR_RETURN(daemon::BudgetConfig config, daemon::ReadBudgetConfig(conf));
    text = gpu ? config.gpu_budget : config.host_budget;
    from = conf + (gpu ? " gpu_budget" : " host_budget");
  }
  if (text.empty()) return std::optional<uint64_t>();
  auto bytes = gpu ? daemon::ParseByteSizeOrPercent(text, id.device ? id.device->memory_bytes : 0)
                   : daemon::ParseByteSize(text);
  if (!bytes.ok()) return Status(bytes.status()).Context(from);
  return std::optional<uint64_t>(*bytes);
}

// `serve --demote host` (docs/budget.md, "Demotion and promotion"): the daemon's hooks into the
// device's ledger. Each opens the ledger by path (BudgetLedger holds only paths), so they need
// nothing from serve's own admission.
Result<daemon::DemotionOptions> DemotionHooks(const BudgetOptions& options,
                                              const identity::ResolvedIdentity& id) {
  daemon::DemotionOptions demotion;
  if (options.demote.empty()) return demotion;
  if (options.demote != "host" && options.demote != "host-pinned") {
    return InvalidArgument("--demote " + options.demote +
                           ": the only tier to demote to is host (`host` or `host-pinned`)");
  }
  demotion.enabled = true;
  demotion.pin_host_copy = options.demote == "host-pinned";
  WEIGHTCACHE_ASSIGN_OR_RETURN(std::optional<uint64_t> host_budget,
                               TierBudget(options, id, Tier::kHost));
  WEIGHTCACHE_ASSIGN_OR_RETURN(std::optional<uint64_t> gpu_budget,
                               TierBudget(options, id, Tier::kGpu));
  const std::string device_dir = id.paths.device_dir;
  const std::string socket = id.paths.socket;
  const bool pinned = options.pin;
  if (host_budget.has_value()) {
    demotion.host_room = [device_dir, socket, budget = *host_budget](uint64_t bytes) -> Status {
      daemon::BudgetLedger ledger(device_dir);
      WEIGHTCACHE_ASSIGN_OR_RETURN(daemon::Ledger now, ledger.ReadOnly());
      const uint64_t held = now.BytesOn(Tier::kHost, socket);
      if (held + bytes > budget) {
        return Status(StatusCode::kOutOfMemory,
                      "the host budget is " + daemon::FormatBytes(budget) + ", " +
                          daemon::FormatBytes(held) + " is held and the demotion needs " +
                          daemon::FormatBytes(bytes));
      }
      return Status::Ok();
    };
  }
  demotion.moved = [device_dir, socket](Tier tier, std::span<const int> /*fds*/) {
    const pid_t self = ::getpid();
    Status updated = daemon::BudgetLedger(device_dir)
                         .UpdateUntil(
                             [&](daemon::Ledger& now) {
                               daemon::LedgerEntry* mine = now.Find(socket);
                               if (mine != nullptr && mine->pid == self) mine->tier = tier;
                               return Status::Ok();
                             },
                             std::chrono::steady_clock::now() + kLedgerLockWait)
                         .status();
    if (!updated.ok()) {
      LOG_WARN << "moving the budget ledger entry: " << updated.ToString();
    }
  };
  if (gpu_budget.has_value()) {
    demotion.readmit = [device_dir, socket, pinned, budget = *gpu_budget]() -> Status {
      daemon::BudgetLedger ledger(device_dir);
      // Bounded like the admission below: this runs on the mover thread, which a stop joins.
      const auto deadline = std::chrono::steady_clock::now() + kEvictionTimeout;
      WEIGHTCACHE_ASSIGN_OR_RETURN(
          daemon::Ledger now,
          ledger.UpdateUntil([](daemon::Ledger&) { return Status::Ok(); }, deadline));
      const daemon::LedgerEntry* mine = now.Find(socket);
      if (mine == nullptr) return Status::Ok();  // not in the ledger (removed by hand)
      WEIGHTCACHE_ASSIGN_OR_RETURN(daemon::LedgerEntry self,
                                   daemon::SelfEntry(socket, mine->bytes, Tier::kGpu, pinned));
      self.last_used_ms = daemon::NowUnixMs();
      self.budget = budget;
      return daemon::AdmitEvicting(ledger, self, budget, EvictVictim, deadline);
    };
  }
  return demotion;
}

// Admission under the device's budget (docs/budget.md): registers this cache in the device's
// ledger, or fails kOutOfMemory naming the budget, the need and the holders. Returns the
// ledger to unregister from at stop (nullptr: no budget applies).
Result<std::unique_ptr<daemon::BudgetLedger>> AdmitUnderBudget(const BudgetOptions& options,
                                                               const identity::ResolvedIdentity& id,
                                                               const std::string& model_dir,
                                                               int signal_fd) {
  WEIGHTCACHE_ASSIGN_OR_RETURN(std::optional<uint64_t> budget, TierBudget(options, id));
  if (!budget.has_value()) return std::unique_ptr<daemon::BudgetLedger>();
  if (identity::IsPublishedSource(id.config.source)) {
    return InvalidArgument(
        "a budget needs --model (a published cache's size is not known up front)");
  }
  WEIGHTCACHE_ASSIGN_OR_RETURN(checkpoint::Checkpoint ckpt,
                               checkpoint::Checkpoint::Open(model_dir));
  WEIGHTCACHE_ASSIGN_OR_RETURN(
      daemon::LedgerEntry self,
      daemon::SelfEntry(id.paths.socket, ckpt.total_bytes(), id.config.tier, options.pin));
  self.last_used_ms = daemon::NowUnixMs();
  self.budget = *budget;  // what `status` shows when budget.conf gives none
  auto ledger = std::make_unique<daemon::BudgetLedger>(id.paths.device_dir);
  WEIGHTCACHE_RETURN_IF_ERROR(AdmitOrWait(options, *ledger, self, *budget, EvictVictim, signal_fd));
  LOG_INFO << "admitted under the " << TierName(id.config.tier) << " budget of "
           << daemon::FormatBytes(*budget) << ": " << daemon::FormatBytes(self.bytes);
  return ledger;
}

// Our own entry leaves the ledger at stop (an upgrade's successor registered its own pid). A
// lock held past kLedgerLockWait leaves it behind: the next reader reclaims it once we exit.
void LeaveBudget(daemon::BudgetLedger* ledger, const std::string& socket) {
  if (ledger == nullptr) return;
  const pid_t self = ::getpid();
  Status removed = ledger
                       ->UpdateUntil(
                           [&](daemon::Ledger& now) {
                             std::erase_if(now.entries, [&](const daemon::LedgerEntry& e) {
                               return e.socket == socket && e.pid == self;
                             });
                             return Status::Ok();
                           },
                           std::chrono::steady_clock::now() + kLedgerLockWait)
                       .status();
  if (!removed.ok()) {
    LOG_WARN << "leaving the budget ledger (the next reader reclaims our entry once we exit): "
             << removed.ToString();
  }
}

}  // namespace weightcache::serve
