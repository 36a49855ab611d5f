// The stale-file sweep (daemon/stale_files.h, issue 39 §3) on real files, real listening
// sockets and real OFD locks: what goes (only files whose lock is free) and what stays.
#include "daemon/stale_files.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <optional>
#include <string>
#include <vector>

#include "daemon/budget.h"
#include "identity/paths.h"
#include "os/lock_file.h"
#include "os/unix_socket.h"
#include "support/test_env.h"

namespace weightcache::daemon {
namespace {

using identity::KeeperSocketFor;
using identity::LockPathFor;
using weightcache::testing::TempDir;
using weightcache::testing::WriteFile;

bool Exists(const std::string& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0;
}

class StaleFilesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (const char* ns : {"ns", "other"}) {
      ASSERT_EQ(::mkdir(dir_.Join(ns).c_str(), 0700), 0);
      ASSERT_EQ(::mkdir(DeviceDir(ns).c_str(), 0700), 0);
    }
  }
  std::string DeviceDir(const std::string& ns) const { return dir_.Join(ns) + "/host"; }
  // A listening socket at `path` (a dead daemon's leftover once nobody holds its lock).
  void Listen(const std::string& path) {
    auto fd = os::ListenUnix(path);
    ASSERT_TRUE(fd.ok()) << fd.status().ToString();
    listeners_.push_back(std::move(fd).value());
  }
  // The four files of one cache; its lock and its keeper's lock held or left free.
  std::string Cache(const std::string& ns, const std::string& stem, bool daemon_lives,
                    bool keeper_lives) {
    const std::string socket = DeviceDir(ns) + "/" + stem + ".sock";
    Listen(socket);
    Listen(KeeperSocketFor(socket));
    Hold(LockPathFor(socket), daemon_lives);
    Hold(LockPathFor(KeeperSocketFor(socket)), keeper_lives);
    return socket;
  }
  void Hold(const std::string& lock, bool held) {
    if (!held) {
      WriteFile(lock, "999999\n");  // a dead owner's pid
      return;
    }
    auto l = os::LockFile::TryAcquire(lock);
    ASSERT_TRUE(l.ok()) << l.status().ToString();
    locks_.push_back(std::move(l).value());
  }
  static std::vector<std::string> FilesOf(const std::string& socket) {
    return {socket, LockPathFor(socket), KeeperSocketFor(socket),
            LockPathFor(KeeperSocketFor(socket))};
  }

  TempDir dir_;
  std::vector<UniqueFd> listeners_;
  std::vector<os::LockFile> locks_;
};

TEST_F(StaleFilesTest, RemovesEveryFileOfADeadCacheAndNothingOfALiveOne) {
  const std::string live = Cache("ns", "aaaaaaaaaaaaaaaa", true, true);
  const std::string dead = Cache("ns", "bbbbbbbbbbbbbbbb", false, false);
  const std::string orphan = Cache("ns", "cccccccccccccccc", false, true);
  const std::string elsewhere = Cache("other", "dddddddddddddddd", false, false);
  // A lock file alone (a cleanly stopped daemon's) is a cache of its own.
  const std::string lock_only = DeviceDir("ns") + "/eeeeeeeeeeeeeeee.sock";
  WriteFile(LockPathFor(lock_only), "");

  auto sweep = SweepStaleFiles(dir_.path(), std::string("ns"));
  ASSERT_TRUE(sweep.ok()) << sweep.status().ToString();
  EXPECT_TRUE(sweep->warnings.empty());
  ASSERT_EQ(sweep->cleaned.size(), 3u);
  EXPECT_EQ(sweep->cleaned[0].socket, dead);
  EXPECT_EQ(sweep->cleaned[0].removed, FilesOf(dead));
  EXPECT_EQ(DescribeCleaned(sweep->cleaned[0]),
            dead + ": removed its stale socket, lock, keeper socket and keeper lock");
  // The orphan's keeper holds its memory for the next start: only the daemon's files go.
  EXPECT_EQ(sweep->cleaned[1].socket, orphan);
  EXPECT_EQ(sweep->cleaned[1].removed, (std::vector<std::string>{orphan, LockPathFor(orphan)}));
  EXPECT_EQ(sweep->cleaned[2].removed, (std::vector<std::string>{LockPathFor(lock_only)}));
  for (const std::string& f : FilesOf(dead)) EXPECT_FALSE(Exists(f)) << f;
  for (const std::string& f : FilesOf(live)) EXPECT_TRUE(Exists(f)) << f;
  EXPECT_TRUE(os::IsLockHeld(LockPathFor(live)));
  EXPECT_TRUE(Exists(KeeperSocketFor(orphan)));
  EXPECT_TRUE(os::IsLockHeld(LockPathFor(KeeperSocketFor(orphan))));
  // Another namespace is not swept unless asked for.
  for (const std::string& f : FilesOf(elsewhere)) EXPECT_TRUE(Exists(f)) << f;
  auto all = SweepStaleFiles(dir_.path(), std::nullopt);
  ASSERT_TRUE(all.ok()) << all.status().ToString();
  ASSERT_EQ(all->cleaned.size(), 1u);
  EXPECT_EQ(all->cleaned[0].socket, elsewhere);
  for (const std::string& f : FilesOf(elsewhere)) EXPECT_FALSE(Exists(f)) << f;
}

TEST_F(StaleFilesTest, AFileAtASocketPathIsLeftAloneWithItsLock) {
  const std::string socket = DeviceDir("ns") + "/ffffffffffffffff.sock";
  WriteFile(socket, "not a socket");
  WriteFile(LockPathFor(socket), "");
  auto sweep = SweepStaleFiles(dir_.path(), std::string("ns"));
  ASSERT_TRUE(sweep.ok()) << sweep.status().ToString();
  EXPECT_TRUE(sweep->cleaned.empty());
  ASSERT_EQ(sweep->warnings.size(), 1u);
  EXPECT_EQ(sweep->warnings[0], socket + " exists and is not a socket: left alone with its lock");
  EXPECT_TRUE(Exists(socket));
  EXPECT_TRUE(Exists(LockPathFor(socket)));
}

TEST_F(StaleFilesTest, DropsTheLedgerEntriesOfDeadOwnersAndKeepsTheLiving) {
  const std::string device = DeviceDir("ns");
  const std::string dead = device + "/1111111111111111.sock";
  const std::string live = device + "/2222222222222222.sock";
  BudgetLedger ledger(device);
  auto mine = SelfEntry(live, 100, Tier::kHost, false);
  ASSERT_TRUE(mine.ok()) << mine.status().ToString();
  LedgerEntry gone = *mine;
  gone.socket = dead;
  gone.pid = 999999;  // no such process
  gone.bytes = 42;
  // As a daemon killed after its admission leaves it.
  WriteFile(ledger.path(), SerializeLedger(Ledger{{*mine, gone}}));

  auto sweep = SweepStaleFiles(dir_.path(), std::string("ns"));
  ASSERT_TRUE(sweep.ok()) << sweep.status().ToString();
  ASSERT_EQ(sweep->cleaned.size(), 1u);
  EXPECT_EQ(sweep->cleaned[0].socket, dead);
  EXPECT_TRUE(sweep->cleaned[0].removed.empty());
  ASSERT_EQ(sweep->cleaned[0].ledger_entries.size(), 1u);
  EXPECT_EQ(sweep->cleaned[0].ledger_entries[0].pid, 999999);
  EXPECT_EQ(DescribeCleaned(sweep->cleaned[0]),
            dead + ": removed the budget ledger entry of dead pid 999999");
  const std::string text = weightcache::testing::ReadFile(ledger.path());
  EXPECT_EQ(text.find(dead), std::string::npos) << text;
  EXPECT_NE(text.find(live), std::string::npos) << text;
}

TEST_F(StaleFilesTest, ACorruptLedgerIsReportedAndLeftAsItIs) {
  const std::string path = identity::BudgetLedgerPath(DeviceDir("ns"));
  WriteFile(path, "{not json");
  auto sweep = SweepStaleFiles(dir_.path(), std::string("ns"));
  ASSERT_TRUE(sweep.ok()) << sweep.status().ToString();
  ASSERT_EQ(sweep->warnings.size(), 1u);
  EXPECT_NE(sweep->warnings[0].find("budget ledger " + path + " is corrupt"), std::string::npos)
      << sweep->warnings[0];
  EXPECT_EQ(weightcache::testing::ReadFile(path), "{not json");
}

TEST_F(StaleFilesTest, AMissingRuntimeDirHasNothingStale) {
  auto sweep = SweepStaleFiles(dir_.Join("absent"), std::nullopt);
  ASSERT_TRUE(sweep.ok()) << sweep.status().ToString();
  EXPECT_TRUE(sweep->cleaned.empty());
}

}  // namespace
}  // namespace weightcache::daemon
