// The device's memory budget ledger (docs/budget.md): which caches hold memory on one device,
// shared by every cache process of that device dir.
//
// Contract:
//  * One ledger per device dir: identity::BudgetLedgerPath(device dir), JSON, guarded by the
//    OFD lock on identity::BudgetLedgerLockPath (os::ExclusiveFileLock) and replaced by
//    temp + rename (os::WriteFileAtomically), so that a reader never sees a torn file and a
//    writer killed at any point leaves the previous ledger, and no lock, behind.
//  * An entry names its owner by pid AND the pid's start time (/proc/<pid>/stat field 22), so
//    a pid reused by an unrelated process is not taken for the cache. Every Update (Read is an
//    Update that changes nothing) first drops the entries whose owner is gone, then writes the
//    ledger back if anything changed: memory of a killed cache returns to the budget at the
//    next Update, whoever makes it (ReadOnly drops them from its view only).
//  * A ledger that does not parse, or whose fields have the wrong types, is kInvalidArgument
//    naming the file and saying how to recover; it is never silently reset (the entries it
//    lost would be memory in use that the budget no longer sees). Unknown keys are ignored
//    (a newer build may add some).
//  * UpdateUntil is Update with a bound on the lock wait (kTimeout past it): what a serving
//    daemon uses, so that a peer hung inside its critical section cannot stall it. ReadOnly
//    reads without the lock and never writes: the dead are dropped from the returned view only
//    (what `status` and `ls` use: a read-only command must not change the file).
//  * LedgerClientsWriter publishes a serving cache's client count from a thread of its own:
//    the event loop only records the latest count (latest wins), and a ledger whose lock is
//    held for long delays the entry, never an attach.
//  * PlanAdmission is pure: which entries to evict (LRU among the evictable) so that a new
//    cache fits, or why nothing can make it fit.
//  * BudgetLedger holds only paths: thread-safe (the lock serializes every Update, also
//    between threads of one process).
#pragma once

#include <sys/types.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "common/mutex.h"
#include "weightcache/status.h"
#include "weightcache/tier.h"

namespace weightcache::daemon {

struct LedgerEntry {
  std::string socket;           // the cache's socket: its identity on this device
  pid_t pid = 0;                // the daemon holding the memory
  uint64_t pid_start_time = 0;  // /proc/<pid>/stat field 22, clock ticks since boot
  uint64_t bytes = 0;
  // Where the bytes live now: GPU memory, or host memory (a host-tier cache, or a gpu-tier
  // cache demoted to sealed memfds). Budgets are per tier; the ledger spells it TierName().
  Tier tier = Tier::kGpu;
  bool pinned = false;       // `serve --pin`: never evicted or demoted
  uint32_t clients = 0;      // attached clients; only 0 is evictable
  int64_t last_used_ms = 0;  // unix ms of the last attach or last client detach (LRU key)
  // The budget its admission ran under (its serve flag, or budget.conf's then), for `status`
  // when budget.conf has none; 0: not recorded (an entry written before this field existed).
  uint64_t budget = 0;

  bool operator==(const LedgerEntry&) const = default;
};

struct Ledger {
  std::vector<LedgerEntry> entries;
  // Bytes held on `tier` by every entry but `except_socket` ("" = none).
  uint64_t BytesOn(Tier tier, std::string_view except_socket = {}) const;
  LedgerEntry* Find(std::string_view socket);
};

// The start time of `pid` (/proc/<pid>/stat field 22); kNotFound when there is no such process
// or it has exited (a zombie, state Z or X: it holds nothing any more).
Result<uint64_t> ProcessStartTime(pid_t pid);

// Whether the entry's memory may still be held, so that the entry must stay counted:
//  * its owner is still the process that registered it (same pid, same start time; a /proc
//    read failing for another reason than a missing process counts as alive: a live cache
//    must never be reclaimed);
//  * or, whatever /proc says, the lock of its socket is held (identity::LockPathFor: its
//    daemon, or an upgrade's successor, which has another pid). Locks are seen across pid
//    namespaces, where a pid means nothing (daemons in containers sharing one runtime dir);
//  * or its keeper's lock is held (KeptByKeeper): the daemon died, and its keeper holds the
//    memory for the next start (docs/keeper.md) until `stop` drops it.
bool OwnerAlive(const LedgerEntry& entry);
// The first two of those: its daemon (or an upgrade's successor) holds the memory.
bool DaemonHolds(const LedgerEntry& entry);
// The last: the entry's keeper holds the memory (its lock is held).
bool KeptByKeeper(const LedgerEntry& entry);

// The ledger's text and back. Parse errors are kInvalidArgument naming `path`.
std::string SerializeLedger(const Ledger& ledger);
Result<Ledger> ParseLedger(std::string_view text, const std::string& path);

// The entry of this process for `socket` (pid and start time of the caller).
Result<LedgerEntry> SelfEntry(std::string socket, uint64_t bytes, Tier tier, bool pinned);

// Milliseconds since the Unix epoch (the clock of last_used_ms).
int64_t NowUnixMs();

struct BudgetLedgerOptions {
  // Fault hook for tests: runs under the lock, after the update and before the new ledger is
  // written (a process killed here must leave the previous ledger intact). Empty: nothing.
  std::function<void()> before_write;
};

class BudgetLedger {
 public:
  explicit BudgetLedger(const std::string& device_dir, BudgetLedgerOptions options = {});

  // Under the lock: read (a missing file is an empty ledger), drop the entries whose owner is
  // gone, run `update` on the rest (its error aborts without writing), write back if the
  // ledger changed. Returns the ledger as written.
  Result<Ledger> Update(const std::function<Status(Ledger&)>& update);
  // Update, giving up with kTimeout (nothing read or written) when the lock is still held by
  // another open file description at `lock_deadline`.
  Result<Ledger> UpdateUntil(const std::function<Status(Ledger&)>& update,
                             std::chrono::steady_clock::time_point lock_deadline);
  // Update with no change (it still reclaims the dead).
  Result<Ledger> Read();
  // Read, returning the entries it dropped because their owner is gone (the stale-file sweep
  // reports them, daemon/stale_files.h). A missing ledger drops nothing and is not created.
  Result<std::vector<LedgerEntry>> ReclaimDead();
  // The ledger as the next Update would see it (dead owners dropped), read without the lock
  // and without writing anything: not even the lock file is created. The atomic replacement
  // makes the read whole; it may be one update behind a writer that holds the lock now.
  Result<Ledger> ReadOnly() const;
  // Insert or replace the entry of entry.socket.
  Status Put(const LedgerEntry& entry);
  // Remove the entry of `socket` (absent: nothing happens).
  Status Remove(std::string_view socket);

  const std::string& path() const { return path_; }
  const std::string& lock_path() const { return lock_path_; }

 private:
  Result<Ledger> UpdateLocked(const std::function<Status(Ledger&)>& update,
                              std::vector<LedgerEntry>* dropped = nullptr);

  std::string path_;
  std::string lock_path_;
  BudgetLedgerOptions options_;
};

// A serving cache's `clients` and `last_used_ms` in its ledger entry, written by a thread of
// its own (docs/budget.md, "serve"). Set() only records the count and its time and wakes the
// thread; the thread writes the latest one (counts set while it writes are coalesced), waiting
// at most `lock_wait` for the ledger's lock. A write that fails (the lock held by a hung peer,
// an I/O error) is logged once per run of failures and retried every `retry` until it succeeds
// or a newer count replaces it. Only the entry of `socket` owned by this pid is changed (an
// upgrade's successor owns the same socket under its own pid).
// Thread-safety: Set() from any thread; the destructor joins the thread (a pending count is
// dropped: the caller is leaving the ledger), waiting at most one `lock_wait`.
class LedgerClientsWriter {
 public:
  LedgerClientsWriter(BudgetLedger& ledger, std::string socket,
                      std::chrono::milliseconds lock_wait = std::chrono::seconds(5),
                      std::chrono::milliseconds retry = std::chrono::seconds(1));
  ~LedgerClientsWriter();
  LedgerClientsWriter(const LedgerClientsWriter&) = delete;
  LedgerClientsWriter& operator=(const LedgerClientsWriter&) = delete;

  void Set(uint32_t clients);

 private:
  struct Pending {
    uint32_t clients = 0;
    int64_t at_ms = 0;
  };
  void Loop();

  BudgetLedger& ledger_;
  const std::string socket_;
  const std::chrono::milliseconds lock_wait_;
  const std::chrono::milliseconds retry_;
  Mutex mu_;
  std::condition_variable_any cv_;  // over mu_ (CondVar has no timed wait)
  std::optional<Pending> pending_ WEIGHTCACHE_GUARDED_BY(mu_);
  bool stop_ WEIGHTCACHE_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

// How a cache of `need` bytes on `tier` gets in under `budget` bytes.
struct AdmissionPlan {
  bool fits = false;                 // true: evicting `victims` (maybe none) makes room
  std::vector<LedgerEntry> victims;  // LRU first: zero clients, not pinned
  uint64_t held = 0;                 // bytes on the tier held by the others now
  // When !fits: the budget, the need, and every cache holding memory with its clients.
  std::string refusal;
};

// `self_socket`'s own entry, if any, is not counted (a cache re-reserving itself). Victims are
// the evictable entries (zero clients, not pinned) of that tier in LRU order (oldest
// last_used_ms first), taken until the need fits; none are proposed when even evicting all
// of them would not make room.
AdmissionPlan PlanAdmission(const Ledger& ledger, Tier tier, uint64_t budget, uint64_t need,
                            std::string_view self_socket);

// The device's budget file, identity::BudgetConfigPath (docs/budget.md): lines
// `gpu_budget = 40G` (bytes or N% of the device's memory) and `host_budget = 16G`; blank lines
// and `#` comments are ignored. A missing file is an empty config; an unknown key or a line
// without `=` is kInvalidArgument naming the file and the line. Values are checked by the
// caller (ParseByteSizeOrPercent), which knows the device's total.
struct BudgetConfig {
  std::string gpu_budget;   // "" = no gpu budget
  std::string host_budget;  // "" = no host budget
};
Result<BudgetConfig> ReadBudgetConfig(const std::string& path);

// A victim's answer to an Evict: accepted (it is stopping, or demoting to host RAM), or refused
// with its reason (it gained a client, it is pinned).
struct EvictAnswer {
  bool accepted = false;
  std::string reason;
};
// Asks the daemon of `victim` to give its memory back (an Evict request). An error means no
// answer came (the daemon is unreachable, hung, or died before answering).
using EvictFn = std::function<Result<EvictAnswer>(const LedgerEntry& victim)>;

// How long a victim that gave no answer has to turn out dead before it counts as refusing.
inline constexpr std::chrono::milliseconds kVictimExitGrace{2000};

// Admission of `self` under `budget` bytes of its tier (docs/budget.md "Admission"). Under the
// ledger's lock: when the plan fits with no victim, `self` is registered and Ok is returned; when
// it cannot fit even by evicting every idle cache, kOutOfMemory with the plan's refusal (budget,
// need, holders with their clients). Otherwise, outside the lock, each victim in LRU order is
// asked to evict (`evict`), the ledger is polled until the accepted ones are gone (their
// daemons remove their entries once their memory is freed, or a demoted one moves its entry to
// another tier), and the plan is made again. A victim that gives no answer and whose owner is
// gone within kVictimExitGrace (exited, or a zombie) counts as accepted: its entry is reclaimed
// by the next read.
// kOutOfMemory when every victim refused (naming each and why), kTimeout when an evicted cache
// still holds its memory at `deadline`, or when the ledger's lock is still held by another
// process then (every wait for it ends at `deadline`: a peer hung in its critical section).
// Each Evict is bounded by `evict` itself (EvictVictim: 5 s).
Status AdmitEvicting(BudgetLedger& ledger, const LedgerEntry& self, uint64_t budget,
                     const EvictFn& evict, std::chrono::steady_clock::time_point deadline);

}  // namespace weightcache::daemon
