// The stale files of dead caches (docs/daemon.md "Stale files"): what a daemon, its
// keeper and its budget admission leave behind when they are killed (kill -9 mid-load or
// ready) — the cache's socket and lock, its keeper's socket and lock, and its entry in the
// device's budget ledger. `stop --all` and the launcher's start remove them (SweepStaleFiles);
// `ls` lists a stale cache only until then.
//
// Contract:
//  * The lock decides, and only while we hold it: a cache's socket and lock file are removed by
//    os::RemoveIfUnlocked on its lock (taken without waiting, never when anyone else holds it),
//    its keeper's by the same on the keeper's lock. A live daemon's or keeper's files, and
//    those of one starting at this very moment, are never touched. The keeper's files of a
//    cache whose daemon lives, or whose keeper lives (an orphan: its memory waits for the
//    next start, docs/keeper.md), stay.
//  * A path of the layout that holds something else than a socket (a file at the socket path)
//    is never removed: the sweep leaves that cache alone and says so in `warnings`.
//  * Ledger entries go by the ledger's own rule (BudgetLedger::ReclaimDead: owner gone, and
//    neither the daemon's nor the keeper's lock held). A corrupt ledger is left as it is and
//    reported in `warnings`; the sweep goes on.
//  * Only the layout (<runtime>/<namespace>/<device key>/): explicit sockets (--socket) are
//    not found by a scan, and logs are kept.
//  * Thread-safe: no shared state; concurrent sweeps and daemons resolve through the locks.
#pragma once

#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "daemon/budget.h"
#include "weightcache/status.h"

namespace weightcache::daemon {

struct CleanedCache {
  std::string socket;                       // the cache socket the files belonged to
  std::vector<std::string> removed;         // paths removed, in order
  std::vector<LedgerEntry> ledger_entries;  // its ledger entries of a dead owner, dropped
};

struct StaleSweep {
  std::vector<CleanedCache> cleaned;  // one per cache that had anything stale, by socket
  std::vector<std::string> warnings;  // what was left alone, and why
};

// Sweeps the device dirs of `namespace_name` under `runtime_dir` (every namespace when
// std::nullopt). A runtime dir that does not exist has nothing stale.
Result<StaleSweep> SweepStaleFiles(const std::string& runtime_dir,
                                   const std::optional<std::string>& namespace_name);

// "<socket>: removed its stale socket, lock, keeper socket and keeper lock, and the budget
// ledger entry of dead pid 123": the one line a command prints per cleaned cache.
std::string DescribeCleaned(const CleanedCache& cleaned);
// {"socket": …, "removed": [paths], "ledger_entries": [{"pid": …, "bytes": …}]} per cache:
// the `cleaned` field of `stop --json` and `launch --json`.
nlohmann::json CleanedToJson(const std::vector<CleanedCache>& cleaned);

}  // namespace weightcache::daemon
