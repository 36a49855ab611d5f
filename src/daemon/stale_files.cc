#include "daemon/stale_files.h"

#include <sys/stat.h>

#include <map>
#include <utility>

#include "identity/paths.h"
#include "os/lock_file.h"

namespace weightcache::daemon {
namespace {

// Whether `path` exists and is something else than a socket (never ours to remove).
bool HoldsANonSocket(const std::string& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0 && !S_ISSOCK(st.st_mode);
}

// One cache of a device dir: its socket and lock under its lock, then its keeper's under the
// keeper's lock, as the contract says. Appends what it removed to `cleaned`.
Status SweepCache(const std::string& socket, CleanedCache& cleaned,
                  std::vector<std::string>& warnings) {
  const std::string keeper_socket = identity::KeeperSocketFor(socket);
  const std::string keeper_lock = identity::LockPathFor(keeper_socket);
  for (const std::string& path : {socket, keeper_socket}) {
    if (HoldsANonSocket(path)) {
      warnings.push_back(path + " exists and is not a socket: left alone with its lock");
      return Status::Ok();
    }
  }
  // The keeper lives (the daemon's too, or an orphan whose memory waits for the next start):
  // only the daemon's own files can be stale.
  const bool keeper_lives = os::IsLockHeld(keeper_lock);
  WEIGHTCACHE_ASSIGN_OR_RETURN(os::RemovedUnderLock cache,
                               os::RemoveIfUnlocked(identity::LockPathFor(socket), {socket}));
  cleaned.removed = std::move(cache.removed);
  if (cache.held || keeper_lives) return Status::Ok();  // a live daemon may start its keeper
  WEIGHTCACHE_ASSIGN_OR_RETURN(os::RemovedUnderLock keeper,
                               os::RemoveIfUnlocked(keeper_lock, {keeper_socket}));
  cleaned.removed.insert(cleaned.removed.end(), keeper.removed.begin(), keeper.removed.end());
  return Status::Ok();
}

std::string Noun(const std::string& path, const std::string& socket) {
  if (path == socket) return "socket";
  if (path == identity::LockPathFor(socket)) return "lock";
  const std::string keeper_socket = identity::KeeperSocketFor(socket);
  if (path == keeper_socket) return "keeper socket";
  if (path == identity::LockPathFor(keeper_socket)) return "keeper lock";
  return path;
}

std::string JoinAnd(const std::vector<std::string>& items) {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) {
    if (i > 0) out += i + 1 == items.size() ? " and " : ", ";
    out += items[i];
  }
  return out;
}

}  // namespace

Result<StaleSweep> SweepStaleFiles(const std::string& runtime_dir,
                                   const std::optional<std::string>& namespace_name) {
  StaleSweep sweep;
  WEIGHTCACHE_ASSIGN_OR_RETURN(std::vector<identity::DeviceDirEntry> dirs,
                               identity::ListAllDeviceDirs(runtime_dir));
  for (const identity::DeviceDirEntry& dir : dirs) {
    if (namespace_name && dir.namespace_name != *namespace_name) continue;
    const std::string& device_dir = dir.path;
    std::map<std::string, CleanedCache> by_socket;
    WEIGHTCACHE_ASSIGN_OR_RETURN(std::vector<std::string> caches,
                                 identity::ListCacheIdentities(device_dir));
    for (const std::string& socket : caches) {
      CleanedCache cleaned{socket, {}, {}};
      Status s = SweepCache(socket, cleaned, sweep.warnings);
      if (!s.ok()) return s.Context("removing the stale files of " + socket);
      if (!cleaned.removed.empty()) by_socket.emplace(socket, std::move(cleaned));
    }
    // After the files: an entry's owner counts as alive while its daemon's or keeper's lock is
    // held, so the entries of the caches swept above go now.
    auto dropped = BudgetLedger(device_dir).ReclaimDead();
    if (!dropped.ok()) {
      sweep.warnings.push_back(dropped.status().ToString() + " (its entries were left)");
    } else {
      for (LedgerEntry& e : *dropped) {
        CleanedCache& c = by_socket[e.socket];
        c.socket = e.socket;
        c.ledger_entries.push_back(std::move(e));
      }
    }
    for (auto& [socket, cleaned] : by_socket) sweep.cleaned.push_back(std::move(cleaned));
  }
  return sweep;
}

std::string DescribeCleaned(const CleanedCache& cleaned) {
  std::vector<std::string> nouns;
  for (const std::string& path : cleaned.removed) nouns.push_back(Noun(path, cleaned.socket));
  std::vector<std::string> pids;
  for (const LedgerEntry& e : cleaned.ledger_entries) pids.push_back(std::to_string(e.pid));
  std::string text = cleaned.socket + ": removed";
  if (!nouns.empty()) text += " its stale " + JoinAnd(nouns);
  if (!pids.empty()) {
    text += std::string(nouns.empty() ? "" : ", and") + " the budget ledger entr" +
            (pids.size() == 1 ? "y" : "ies") + " of dead pid " + JoinAnd(pids);
  }
  return text;
}

nlohmann::json CleanedToJson(const std::vector<CleanedCache>& cleaned) {
  nlohmann::json out = nlohmann::json::array();
  for (const CleanedCache& c : cleaned) {
    nlohmann::json entries = nlohmann::json::array();
    for (const LedgerEntry& e : c.ledger_entries) {
      entries.push_back({{"pid", e.pid}, {"bytes", e.bytes}, {"tier", TierName(e.tier)}});
    }
    out.push_back({{"socket", c.socket}, {"removed", c.removed}, {"ledger_entries", entries}});
  }
  return out;
}

}  // namespace weightcache::daemon
