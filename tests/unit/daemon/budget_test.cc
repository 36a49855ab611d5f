// The device's budget ledger (daemon/budget.h): entries of dead or reused pids reclaimed by
// any reader, a corrupt file refused naming itself and left as it was, updates from separate
// processes serialized by the OFD lock, a writer killed mid-update leaving the previous ledger,
// and the LRU admission plan.
#include "daemon/budget.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "daemon/byte_size.h"
#include "identity/paths.h"
#include "os/ledger_file.h"
#include "os/lock_file.h"
#include "support/test_env.h"

namespace weightcache::daemon {
namespace {

using weightcache::testing::ReadFile;
using weightcache::testing::TempDir;
using weightcache::testing::WriteFile;

// A process that has exited and been reaped: its pid names no process (until reused).
pid_t ReapedPid() {
  const pid_t pid = ::fork();
  if (pid == 0) ::_exit(0);
  int status = 0;
  ::waitpid(pid, &status, 0);
  return pid;
}

// Fork, run `body` in the child, and return the child's exit code (128 + signal if killed).
template <typename Body>
int RunInChild(Body body) {
  const pid_t pid = ::fork();
  if (pid == 0) ::_exit(body());
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

LedgerEntry Entry(std::string socket, uint64_t bytes, int64_t last_used_ms,
                  Tier tier = Tier::kHost) {
  auto entry = SelfEntry(std::move(socket), bytes, tier, /*pinned=*/false);
  EXPECT_TRUE(entry.ok()) << entry.status().ToString();
  entry->last_used_ms = last_used_ms;
  return *entry;
}

TEST(BudgetPaths, LiveInTheDeviceDirAndAreNoSockets) {
  EXPECT_EQ(identity::BudgetLedgerPath("/r/default/host"), "/r/default/host/budget.ledger");
  EXPECT_EQ(identity::BudgetLedgerLockPath("/r/default/host"),
            "/r/default/host/budget.ledger.lock");
  EXPECT_EQ(identity::BudgetConfigPath("/r/default/host"), "/r/default/host/budget.conf");
}

TEST(ProcessStartTime, IsStableForOneProcessAndNotFoundForAGoneOne) {
  auto first = ProcessStartTime(::getpid());
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  EXPECT_GT(*first, 0u);
  EXPECT_EQ(*ProcessStartTime(::getpid()), *first);
  auto gone = ProcessStartTime(ReapedPid());
  ASSERT_FALSE(gone.ok());
  EXPECT_EQ(gone.status().code(), StatusCode::kNotFound);
}

TEST(BudgetLedger, AMissingLedgerIsEmptyAndPutRoundTrips) {
  TempDir dir;
  BudgetLedger ledger(dir.path());
  auto empty = ledger.Read();
  ASSERT_TRUE(empty.ok()) << empty.status().ToString();
  EXPECT_TRUE(empty->entries.empty());

  LedgerEntry a = Entry(dir.Join("a.sock"), 100, 5);
  a.pinned = true;
  a.clients = 2;
  ASSERT_TRUE(ledger.Put(a).ok());
  LedgerEntry b = Entry(dir.Join("b.sock"), 200, 6, Tier::kGpu);
  ASSERT_TRUE(ledger.Put(b).ok());
  b.bytes = 300;  // Put replaces the entry of the same socket
  ASSERT_TRUE(ledger.Put(b).ok());

  auto read = ledger.Read();
  ASSERT_TRUE(read.ok()) << read.status().ToString();
  ASSERT_EQ(read->entries.size(), 2u);
  EXPECT_EQ(read->entries[0], a);
  EXPECT_EQ(read->entries[1], b);
  EXPECT_EQ(read->BytesOn(Tier::kHost), 100u);
  EXPECT_EQ(read->BytesOn(Tier::kGpu), 300u);
  EXPECT_EQ(read->BytesOn(Tier::kGpu, b.socket), 0u);

  ASSERT_TRUE(ledger.Remove(a.socket).ok());
  read = ledger.Read();
  ASSERT_EQ(read->entries.size(), 1u);
  EXPECT_EQ(read->entries[0].socket, b.socket);
}

TEST(BudgetLedger, EveryReaderReclaimsTheEntryOfADeadPid) {
  TempDir dir;
  BudgetLedger ledger(dir.path());
  LedgerEntry live = Entry(dir.Join("live.sock"), 10, 1);
  LedgerEntry dead = Entry(dir.Join("dead.sock"), 20, 2);
  dead.pid = ReapedPid();
  Ledger on_disk{{live, dead}};
  WriteFile(ledger.path(), SerializeLedger(on_disk));

  auto read = ledger.Read();
  ASSERT_TRUE(read.ok()) << read.status().ToString();
  ASSERT_EQ(read->entries.size(), 1u);
  EXPECT_EQ(read->entries[0].socket, live.socket);
  // Written back: the file no longer holds the dead entry either.
  auto file = ParseLedger(ReadFile(ledger.path()), ledger.path());
  ASSERT_TRUE(file.ok());
  EXPECT_EQ(file->entries, read->entries);
}

TEST(BudgetLedger, APidReusedByAnotherProcessIsReclaimedByItsStartTime) {
  TempDir dir;
  BudgetLedger ledger(dir.path());
  // Our own pid, but recorded with another start time: the process that registered it is
  // gone and the pid now names someone else (us).
  LedgerEntry reused = Entry(dir.Join("reused.sock"), 10, 1);
  reused.pid_start_time += 1;
  LedgerEntry same = Entry(dir.Join("same.sock"), 10, 1);
  EXPECT_FALSE(OwnerAlive(reused));
  EXPECT_TRUE(OwnerAlive(same));
  WriteFile(ledger.path(), SerializeLedger(Ledger{{reused, same}}));
  auto read = ledger.Read();
  ASSERT_TRUE(read.ok()) << read.status().ToString();
  ASSERT_EQ(read->entries.size(), 1u);
  EXPECT_EQ(read->entries[0].socket, same.socket);
}

// A dead pid's entry stays while a lock says its memory may still be held: its socket's lock
// (its daemon seen from another pid namespace, or an upgrade's successor, which has another
// pid) or its keeper's (the daemon died; the keeper holds the memory for the next start).
// Reclaimed once neither is held. Before, a daemon killed with its keeper on was dropped from
// the ledger while the keeper still held its memory, and the next cache was let onto a full
// device.
TEST(BudgetLedger, ADeadPidsEntryStaysWhileItsDaemonsOrKeepersLockIsHeld) {
  TempDir dir;
  BudgetLedger ledger(dir.path());
  LedgerEntry by_daemon = Entry(dir.Join("a.sock"), 10, 2);
  by_daemon.pid = ReapedPid();
  LedgerEntry by_keeper = Entry(dir.Join("b.sock"), 20, 1);  // the least recently used
  by_keeper.pid = ReapedPid();
  EXPECT_FALSE(OwnerAlive(by_daemon));
  EXPECT_FALSE(OwnerAlive(by_keeper));
  {
    auto daemon_lock = os::LockFile::TryAcquire(identity::LockPathFor(by_daemon.socket));
    ASSERT_TRUE(daemon_lock.ok()) << daemon_lock.status().ToString();
    auto keeper_lock = os::LockFile::TryAcquire(
        identity::LockPathFor(identity::KeeperSocketFor(by_keeper.socket)));
    ASSERT_TRUE(keeper_lock.ok()) << keeper_lock.status().ToString();
    EXPECT_TRUE(OwnerAlive(by_daemon));
    EXPECT_FALSE(KeptByKeeper(by_daemon));
    EXPECT_TRUE(OwnerAlive(by_keeper));
    EXPECT_TRUE(KeptByKeeper(by_keeper));
    WriteFile(ledger.path(), SerializeLedger(Ledger{{by_daemon, by_keeper}}));
    auto read = ledger.Read();
    ASSERT_TRUE(read.ok()) << read.status().ToString();
    EXPECT_EQ(read->entries.size(), 2u);

    // The kept cache answers no Evict (its daemon is gone) and does not go: the newcomer is
    // refused, told who holds the memory and how to free it.
    auto no_daemon = [](const LedgerEntry&) -> Result<EvictAnswer> {
      return Status(StatusCode::kUnavailable, "connect: Connection refused");
    };
    Status refused = AdmitEvicting(ledger, Entry(dir.Join("new.sock"), 15, 300), 40, no_daemon,
                                   std::chrono::steady_clock::now() + std::chrono::seconds(10));
    EXPECT_EQ(refused.code(), StatusCode::kOutOfMemory) << refused.ToString();
    EXPECT_NE(refused.message().find("its daemon is gone and its keeper holds the memory: "
                                     "`weightcache stop --socket " +
                                     by_keeper.socket + "` drops it"),
              std::string::npos)
        << refused.ToString();
  }
  auto read = ledger.Read();
  ASSERT_TRUE(read.ok()) << read.status().ToString();
  EXPECT_TRUE(read->entries.empty());
}

// The budget an entry was admitted under round-trips; an entry written before the field
// existed (no "budget") reads as 0, not as corrupt.
TEST(BudgetLedger, TheAdmissionBudgetIsKeptAndOptional) {
  TempDir dir;
  BudgetLedger ledger(dir.path());
  LedgerEntry e = Entry(dir.Join("a.sock"), 10, 1);
  e.budget = uint64_t{40} << 30;
  ASSERT_TRUE(ledger.Put(e).ok());
  auto read = ledger.Read();
  ASSERT_TRUE(read.ok()) << read.status().ToString();
  ASSERT_EQ(read->entries.size(), 1u);
  EXPECT_EQ(read->entries[0].budget, uint64_t{40} << 30);

  auto old = ParseLedger(
      "{\"version\": 1, \"entries\": [{\"socket\": \"/s\", \"pid\": 1, \"pid_start_time\": 1, "
      "\"bytes\": 1, \"clients\": 0, \"last_used_ms\": 0, \"tier\": \"gpu\", \"pinned\": false}]}",
      "ledger");
  ASSERT_TRUE(old.ok()) << old.status().ToString();
  ASSERT_EQ(old->entries.size(), 1u);
  EXPECT_EQ(old->entries[0].budget, 0u);
}

TEST(BudgetLedger, ACorruptLedgerIsAnErrorNamingTheFileAndIsLeftAsItWas) {
  TempDir dir;
  BudgetLedger ledger(dir.path());
  const LedgerEntry e = Entry(dir.Join("a.sock"), 1, 1);
  std::string twice = SerializeLedger(Ledger{{e, e}});
  const struct {
    std::string text;
    std::string why;
  } cases[] = {
      {"{\"version\": 1, \"entries\": [", "not valid JSON"},
      {"[]", "not a JSON object"},
      {"{\"version\": 2, \"entries\": []}", "'version' must be 1"},
      {"{\"version\": 1}", "'entries' must be an array"},
      {"{\"version\": 1, \"entries\": [7]}", "entry 0 is not an object"},
      {"{\"version\": 1, \"entries\": [{\"socket\": \"/s\", \"pid\": -1}]}",
       "entry 0: 'pid' must be an unsigned integer"},
      {"{\"version\": 1, \"entries\": [{\"socket\": \"/s\", \"pid\": 1, \"pid_start_time\": 1, "
       "\"bytes\": 1, \"clients\": 0, \"last_used_ms\": 0, \"tier\": \"disk\", "
       "\"pinned\": false}]}",
       "entry 0: 'tier' must be \"gpu\" or \"host\""},
      {"{\"version\": 1, \"entries\": [{\"socket\": \"/s\", \"pid\": 1, \"pid_start_time\": 1, "
       "\"bytes\": 1, \"clients\": 0, \"last_used_ms\": 0, \"tier\": \"gpu\", "
       "\"pinned\": false, \"budget\": \"40G\"}]}",
       "entry 0: 'budget' must be an unsigned integer"},
      {twice, "is listed twice"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.text);
    WriteFile(ledger.path(), c.text);
    auto read = ledger.Read();
    ASSERT_FALSE(read.ok());
    // kIo: damaged state on disk is a runtime condition (exit 1), not usage (issue 39 §10).
    EXPECT_EQ(read.status().code(), StatusCode::kIo);
    const std::string message = read.status().message();
    EXPECT_NE(message.find("budget ledger " + ledger.path() + " is corrupt"), std::string::npos)
        << message;
    EXPECT_NE(message.find(c.why), std::string::npos) << message;
    EXPECT_NE(message.find("remove it"), std::string::npos) << message;
    EXPECT_EQ(ledger.Put(Entry(dir.Join("b.sock"), 1, 1)).code(), StatusCode::kIo);
    EXPECT_EQ(ReadFile(ledger.path()), c.text);  // never silently reset
  }
}

// Another open file description holding the lock (OFD locks conflict within one process too):
// UpdateUntil gives up at its deadline with kTimeout naming the lock, reading and writing
// nothing; once the lock is free it updates.
TEST(BudgetLedger, UpdateUntilGivesUpOnAHeldLock) {
  TempDir dir;
  BudgetLedger ledger(dir.path());
  ASSERT_TRUE(ledger.Put(Entry(dir.Join("a.sock"), 1, 1)).ok());
  const std::string before = ReadFile(ledger.path());
  auto add_b = [&](Ledger& l) {
    l.entries.push_back(Entry(dir.Join("b.sock"), 2, 2));
    return Status::Ok();
  };
  {
    auto held = os::ExclusiveFileLock::Acquire(ledger.lock_path());
    ASSERT_TRUE(held.ok()) << held.status().ToString();
    auto r =
        ledger.UpdateUntil(add_b, std::chrono::steady_clock::now() + std::chrono::milliseconds(50));
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kTimeout);
    EXPECT_NE(r.status().message().find(ledger.lock_path()), std::string::npos)
        << r.status().message();
    EXPECT_EQ(ReadFile(ledger.path()), before);
  }
  auto r = ledger.UpdateUntil(add_b, std::chrono::steady_clock::now() + std::chrono::seconds(30));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->entries.size(), 2u);
}

// ReadOnly drops a dead owner from its view only: the file and its directory are unchanged
// (no lock file created either).
TEST(BudgetLedger, ReadOnlyNeverWrites) {
  TempDir dir;
  BudgetLedger ledger(dir.path());
  auto empty = ledger.ReadOnly();
  ASSERT_TRUE(empty.ok()) << empty.status().ToString();
  EXPECT_TRUE(empty->entries.empty());
  EXPECT_FALSE(std::filesystem::exists(ledger.lock_path()));
  EXPECT_FALSE(std::filesystem::exists(ledger.path()));
  LedgerEntry dead = Entry(dir.Join("dead.sock"), 5, 1);
  dead.pid = ReapedPid();
  ASSERT_TRUE(ledger
                  .Update([&](Ledger& l) {
                    l.entries.push_back(Entry(dir.Join("live.sock"), 7, 2));
                    l.entries.push_back(dead);
                    return Status::Ok();
                  })
                  .ok());
  const std::string before = ReadFile(ledger.path());
  auto view = ledger.ReadOnly();
  ASSERT_TRUE(view.ok()) << view.status().ToString();
  ASSERT_EQ(view->entries.size(), 1u);
  EXPECT_EQ(view->entries[0].socket, dir.Join("live.sock"));
  EXPECT_EQ(ReadFile(ledger.path()), before);
}

// The writer coalesces: counts set while the lock is held are written as the latest one once
// it is free; Set never waits for the lock.
TEST(LedgerClientsWriter, WritesTheLatestCountOnceTheLockIsFree) {
  TempDir dir;
  BudgetLedger ledger(dir.path());
  const LedgerEntry mine = Entry(dir.Join("mine.sock"), 1, 1);
  ASSERT_TRUE(ledger.Put(mine).ok());
  auto clients = [&]() -> int64_t {
    auto view = ledger.ReadOnly();
    const LedgerEntry* e = view.ok() ? view->Find(mine.socket) : nullptr;
    return e != nullptr ? e->clients : -1;
  };
  auto wait_for = [&](int64_t want) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (clients() != want && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return clients();
  };
  LedgerClientsWriter writer(ledger, mine.socket, std::chrono::milliseconds(20),
                             std::chrono::milliseconds(20));
  writer.Set(1);
  EXPECT_EQ(wait_for(1), 1);
  {
    auto held = os::ExclusiveFileLock::Acquire(ledger.lock_path());
    ASSERT_TRUE(held.ok()) << held.status().ToString();
    writer.Set(2);
    writer.Set(3);
    EXPECT_EQ(clients(), 1);  // nothing can be written while the lock is held
  }
  EXPECT_EQ(wait_for(3), 3);
}

TEST(BudgetLedger, UpdatesFromSeparateProcessesAreSerializedByTheLock) {
  TempDir dir;
  BudgetLedger ledger(dir.path());
  LedgerEntry counter = Entry(dir.Join("counter.sock"), 0, 0);
  ASSERT_TRUE(ledger.Put(counter).ok());
  constexpr int kChildren = 4;
  constexpr int kUpdates = 50;
  std::vector<pid_t> children;
  for (int c = 0; c < kChildren; ++c) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      BudgetLedger mine(dir.path());
      for (int i = 0; i < kUpdates; ++i) {
        // Read-modify-write: without the lock, concurrent increments would be lost.
        auto r = mine.Update([&](Ledger& l) {
          LedgerEntry* e = l.Find(counter.socket);
          if (e == nullptr) return InternalError("counter entry missing");
          e->bytes += 1;
          return Status::Ok();
        });
        if (!r.ok()) ::_exit(1);
      }
      ::_exit(0);
    }
    children.push_back(pid);
  }
  for (const pid_t pid : children) {
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
  auto read = ledger.Read();
  ASSERT_TRUE(read.ok()) << read.status().ToString();
  ASSERT_EQ(read->entries.size(), 1u);
  EXPECT_EQ(read->entries[0].bytes, static_cast<uint64_t>(kChildren) * kUpdates);
}

TEST(BudgetLedger, AWriterKilledMidUpdateLeavesThePreviousLedgerAndNoLock) {
  TempDir dir;
  BudgetLedger ledger(dir.path());
  const LedgerEntry kept = Entry(dir.Join("kept.sock"), 10, 1);
  ASSERT_TRUE(ledger.Put(kept).ok());
  const std::string before = ReadFile(ledger.path());

  // The child updates under the lock and is killed just before it writes.
  const int code = RunInChild([&] {
    BudgetLedger dying(dir.path(), BudgetLedgerOptions{[] { ::raise(SIGKILL); }});
    (void)dying.Put(Entry(dir.Join("never.sock"), 99, 2));
    return 0;
  });
  EXPECT_EQ(code, 128 + SIGKILL);
  EXPECT_EQ(ReadFile(ledger.path()), before);
  // A torn temp of a writer killed mid-write is no ledger: readers never look at it.
  WriteFile(ledger.path() + ".tmp", "{\"version\": 1, \"entr");

  // The lock died with the child: the next reader gets in and sees the previous ledger.
  auto read = ledger.Read();
  ASSERT_TRUE(read.ok()) << read.status().ToString();
  ASSERT_EQ(read->entries.size(), 1u);
  EXPECT_EQ(read->entries[0], kept);
  ASSERT_TRUE(ledger.Put(Entry(dir.Join("next.sock"), 1, 3)).ok());
  EXPECT_EQ(ledger.Read()->entries.size(), 2u);
}

TEST(PlanAdmission, EvictsTheLeastRecentlyUsedIdleCacheFirst) {
  TempDir dir;
  LedgerEntry old_idle = Entry("/d/old.sock", 40, 100);
  LedgerEntry new_idle = Entry("/d/new.sock", 40, 200);
  Ledger ledger{{new_idle, old_idle}};
  // Budget 100, 80 held, need 40: one victim, the older one.
  AdmissionPlan plan = PlanAdmission(ledger, Tier::kHost, 100, 40, "/d/third.sock");
  EXPECT_TRUE(plan.fits);
  EXPECT_EQ(plan.held, 80u);
  ASSERT_EQ(plan.victims.size(), 1u);
  EXPECT_EQ(plan.victims[0].socket, old_idle.socket);
  // Need 20: fits without anyone leaving.
  plan = PlanAdmission(ledger, Tier::kHost, 100, 20, "/d/third.sock");
  EXPECT_TRUE(plan.fits);
  EXPECT_TRUE(plan.victims.empty());
  // Need 100: both go, oldest first.
  plan = PlanAdmission(ledger, Tier::kHost, 100, 100, "/d/third.sock");
  ASSERT_TRUE(plan.fits);
  ASSERT_EQ(plan.victims.size(), 2u);
  EXPECT_EQ(plan.victims[0].socket, old_idle.socket);
  EXPECT_EQ(plan.victims[1].socket, new_idle.socket);
  // The cache's own entry and the other tier do not count.
  ledger.entries.push_back(Entry("/d/third.sock", 90, 1));
  ledger.entries.push_back(Entry("/d/gpu.sock", 90, 1, Tier::kGpu));
  plan = PlanAdmission(ledger, Tier::kHost, 100, 20, "/d/third.sock");
  EXPECT_TRUE(plan.fits);
  EXPECT_TRUE(plan.victims.empty());
}

TEST(PlanAdmission, NeverTouchesAPinnedOrAttachedCacheAndNamesThemWhenExhausted) {
  LedgerEntry pinned = Entry("/d/pinned.sock", 40, 1);
  pinned.pinned = true;
  LedgerEntry attached = Entry("/d/attached.sock", 40, 2);
  attached.clients = 1;
  LedgerEntry idle = Entry("/d/idle.sock", 10, 3);
  const Ledger ledger{{pinned, attached, idle}};
  // Evicting the idle one frees 10, not enough for 40 under 100 with 90 held.
  AdmissionPlan plan = PlanAdmission(ledger, Tier::kHost, 100, 40, "/d/new.sock");
  EXPECT_FALSE(plan.fits);
  EXPECT_TRUE(plan.victims.empty());  // nobody is evicted for nothing
  EXPECT_EQ(plan.held, 90u);
  const std::string& m = plan.refusal;
  EXPECT_NE(m.find("the host budget is 100 B; this cache needs 40 B, 90 B is held"),
            std::string::npos)
      << m;
  const std::string self = std::to_string(::getpid());
  EXPECT_NE(m.find("/d/pinned.sock 40 B (pid " + self + ", 0 clients, pinned)"), std::string::npos)
      << m;
  EXPECT_NE(m.find("/d/attached.sock 40 B (pid " + self + ", 1 client)"), std::string::npos) << m;
  EXPECT_NE(m.find("/d/idle.sock 10 B (pid " + self + ", 0 clients)"), std::string::npos) << m;
  // A need over the whole budget never fits, even on an empty device.
  plan = PlanAdmission(Ledger{}, Tier::kHost, 100, 101, "/d/new.sock");
  EXPECT_FALSE(plan.fits);
  EXPECT_NE(plan.refusal.find("this cache needs 101 B, 0 B is held"), std::string::npos)
      << plan.refusal;
}

// Admission asks the LRU idle cache to evict and waits for its entry to leave; a victim that
// refuses (it gained a client) leaves the newcomer refused, naming it and its reason.
TEST(AdmitEvicting, EvictsTheVictimThenRegistersOrNamesTheRefusal) {
  TempDir dir;
  BudgetLedger ledger(dir.path());
  ASSERT_TRUE(ledger.Put(Entry("/d/old.sock", 60, 100)).ok());
  const LedgerEntry self = Entry("/d/new.sock", 60, 300);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  std::vector<std::string> asked;
  auto refuse = [&](const LedgerEntry& v) -> Result<EvictAnswer> {
    asked.push_back(v.socket);
    return EvictAnswer{.accepted = false, .reason = "1 client(s) attached"};
  };
  Status refused = AdmitEvicting(ledger, self, 100, refuse, deadline);
  EXPECT_EQ(refused.code(), StatusCode::kOutOfMemory) << refused.ToString();
  EXPECT_NE(refused.message().find("no idle cache gave its memory back (/d/old.sock"),
            std::string::npos)
      << refused.ToString();
  EXPECT_NE(refused.message().find("refused: 1 client(s) attached"), std::string::npos)
      << refused.ToString();
  EXPECT_EQ(asked, std::vector<std::string>{"/d/old.sock"});
  // An evicted daemon removes its entry as it stops (here: the evict function does it).
  auto accept = [&](const LedgerEntry& v) -> Result<EvictAnswer> {
    WEIGHTCACHE_RETURN_IF_ERROR(ledger.Remove(v.socket));
    return EvictAnswer{.accepted = true, .reason = {}};
  };
  Status admitted = AdmitEvicting(ledger, self, 100, accept, deadline);
  ASSERT_TRUE(admitted.ok()) << admitted.ToString();
  auto now = ledger.Read();
  ASSERT_TRUE(now.ok());
  ASSERT_EQ(now->entries.size(), 1u);
  EXPECT_EQ(now->entries[0].socket, "/d/new.sock");
}

// A victim killed in the middle of the Evict gives no answer (its connection closes): it is
// not a refusal. Its owner is gone — here a zombie, killed and not yet reaped, which
// ProcessStartTime counts as exited — so its entry is reclaimed and the newcomer admitted
// (found on the H200 by scripts/gpu-budget.sh step 5: the newcomer exited 8 instead).
TEST(AdmitEvicting, AVictimThatDiesWithoutAnsweringIsReclaimedAndTheNewcomerAdmitted) {
  TempDir dir;
  BudgetLedger ledger(dir.path());
  const pid_t child = ::fork();
  if (child == 0) {
    ::pause();
    ::_exit(0);
  }
  LedgerEntry victim = Entry("/d/old.sock", 60, 100);
  victim.pid = child;
  auto started = ProcessStartTime(child);
  ASSERT_TRUE(started.ok()) << started.status().ToString();
  victim.pid_start_time = *started;
  ASSERT_TRUE(ledger.Put(victim).ok());
  auto killed_unanswered = [&](const LedgerEntry& v) -> Result<EvictAnswer> {
    EXPECT_EQ(v.pid, child);
    ::kill(child, SIGKILL);
    return Status(StatusCode::kUnavailable, "peer closed the connection");
  };
  Status admitted = AdmitEvicting(ledger, Entry("/d/new.sock", 60, 300), 100, killed_unanswered,
                                  std::chrono::steady_clock::now() + std::chrono::seconds(10));
  // Still unreaped: a zombie is not a live owner.
  auto zombie = ProcessStartTime(child);
  EXPECT_EQ(zombie.status().code(), StatusCode::kNotFound) << zombie.status().ToString();
  int status = 0;
  ::waitpid(child, &status, 0);
  ASSERT_TRUE(admitted.ok()) << admitted.ToString();
  auto now = ledger.Read();
  ASSERT_TRUE(now.ok());
  ASSERT_EQ(now->entries.size(), 1u);
  EXPECT_EQ(now->entries[0].socket, "/d/new.sock");
}

// No answer from a victim that stays alive (hung, unreachable) is a refusal, after the grace
// for its exit, naming why.
TEST(AdmitEvicting, AVictimThatGivesNoAnswerAndLivesOnIsARefusal) {
  TempDir dir;
  BudgetLedger ledger(dir.path());
  ASSERT_TRUE(ledger.Put(Entry("/d/old.sock", 60, 100)).ok());  // this process: alive
  auto silent = [](const LedgerEntry&) -> Result<EvictAnswer> {
    return Status(StatusCode::kTimeout, "no Evict reply within 5 s");
  };
  Status s = AdmitEvicting(ledger, Entry("/d/new.sock", 60, 300), 100, silent,
                           std::chrono::steady_clock::now() + std::chrono::seconds(10));
  EXPECT_EQ(s.code(), StatusCode::kOutOfMemory) << s.ToString();
  EXPECT_NE(s.message().find("/d/old.sock"), std::string::npos) << s.ToString();
  EXPECT_NE(s.message().find("no Evict reply within 5 s"), std::string::npos) << s.ToString();
}

// A peer hung inside the ledger's critical section holds no admission past its deadline:
// before, the plan waited for the lock with no bound (F_OFD_SETLKW), and a promotion's
// admission on the mover thread held a stop that joins it forever.
TEST(AdmitEvicting, AHeldLedgerLockEndsTheAdmissionAtItsDeadline) {
  TempDir dir;
  BudgetLedger ledger(dir.path());
  ASSERT_TRUE(ledger.Put(Entry(dir.Join("old.sock"), 60, 100)).ok());
  auto held = os::ExclusiveFileLock::Acquire(ledger.lock_path());
  ASSERT_TRUE(held.ok()) << held.status().ToString();
  auto never_asked = [](const LedgerEntry&) -> Result<EvictAnswer> {
    ADD_FAILURE() << "no plan can be made without the lock";
    return EvictAnswer{.accepted = true, .reason = {}};
  };
  Status s = AdmitEvicting(ledger, Entry(dir.Join("new.sock"), 60, 300), 100, never_asked,
                           std::chrono::steady_clock::now() + std::chrono::milliseconds(100));
  EXPECT_EQ(s.code(), StatusCode::kTimeout) << s.ToString();
  EXPECT_NE(s.message().find(ledger.lock_path()), std::string::npos) << s.ToString();
}

// A victim that accepts but never gives its memory back: kTimeout naming it.
TEST(AdmitEvicting, AVictimThatKeepsItsMemoryPastTheDeadlineIsATimeout) {
  TempDir dir;
  BudgetLedger ledger(dir.path());
  ASSERT_TRUE(ledger.Put(Entry("/d/old.sock", 60, 100)).ok());
  auto accept_and_stay = [](const LedgerEntry&) -> Result<EvictAnswer> {
    return EvictAnswer{.accepted = true, .reason = {}};
  };
  Status s = AdmitEvicting(ledger, Entry("/d/new.sock", 60, 300), 100, accept_and_stay,
                           std::chrono::steady_clock::now() + std::chrono::milliseconds(100));
  EXPECT_EQ(s.code(), StatusCode::kTimeout) << s.ToString();
  EXPECT_NE(s.message().find("/d/old.sock"), std::string::npos) << s.ToString();
}

// A gpu-tier victim demoted to host RAM (`serve --demote host`) keeps its entry but moves it to
// the host tier: its gpu memory is free, so the newcomer is admitted and the victim stays
// registered, on the host tier, with its bytes.
TEST(AdmitEvicting, AVictimDemotedToTheHostTierCountsAsFreed) {
  TempDir dir;
  BudgetLedger ledger(dir.path());
  ASSERT_TRUE(ledger.Put(Entry("/d/old.sock", 60, 100, Tier::kGpu)).ok());
  const LedgerEntry self = Entry("/d/new.sock", 60, 300, Tier::kGpu);
  auto demote = [&](const LedgerEntry& v) -> Result<EvictAnswer> {
    WEIGHTCACHE_RETURN_IF_ERROR(ledger
                                    .Update([&](Ledger& now) {
                                      now.Find(v.socket)->tier = Tier::kHost;
                                      return Status::Ok();
                                    })
                                    .status());
    return EvictAnswer{.accepted = true, .reason = {}};
  };
  Status admitted = AdmitEvicting(ledger, self, 100, demote,
                                  std::chrono::steady_clock::now() + std::chrono::seconds(10));
  ASSERT_TRUE(admitted.ok()) << admitted.ToString();
  auto now = ledger.Read();
  ASSERT_TRUE(now.ok());
  ASSERT_EQ(now->entries.size(), 2u);
  ASSERT_NE(now->Find("/d/old.sock"), nullptr);
  EXPECT_EQ(now->Find("/d/old.sock")->tier, Tier::kHost);
  EXPECT_EQ(now->Find("/d/old.sock")->bytes, 60u);
  EXPECT_EQ(now->Find("/d/new.sock")->tier, Tier::kGpu);
  EXPECT_EQ(now->BytesOn(Tier::kGpu), 60u);
  EXPECT_EQ(now->BytesOn(Tier::kHost), 60u);
}

TEST(ParseByteSizeOrPercent, TakesBytesOrAWholePercentOfTheTotal) {
  EXPECT_EQ(*ParseByteSizeOrPercent("40G", 0), uint64_t{40} << 30);
  EXPECT_EQ(*ParseByteSizeOrPercent("50%", 1000), 500u);
  EXPECT_EQ(*ParseByteSizeOrPercent("100%", 1001), 1001u);
  EXPECT_EQ(*ParseByteSizeOrPercent("33%", 1001), 330u);
  EXPECT_EQ(*ParseByteSizeOrPercent("1%", UINT64_MAX), UINT64_MAX / 100);
  for (const char* bad : {"%", "0%", "101%", "12.5%", "-5%", "1000%", "x%"}) {
    auto r = ParseByteSizeOrPercent(bad, 1000);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(r.status().message().find("whole percentage from 1% to 100%"), std::string::npos)
        << r.status().message();
  }
  auto unknown = ParseByteSizeOrPercent("50%", 0);
  ASSERT_FALSE(unknown.ok());
  EXPECT_NE(unknown.status().message().find("total memory is unknown"), std::string::npos);
}

}  // namespace
}  // namespace weightcache::daemon
