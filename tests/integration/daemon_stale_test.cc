// Stale files (issue 39 §3, docs/daemon.md "Stale files"): a daemon killed -9 at each step of a
// load leaves its socket, lock, keeper files and budget ledger entry; `stop --all` and the
// launcher's start remove them, say so, and never touch a live daemon's files.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <nlohmann/json.hpp>
#include <thread>

#include "identity/paths.h"
#include "integration/daemon_process.h"
#include "os/lock_file.h"
#include "support/test_env.h"

namespace weightcache::testing {
namespace {

using namespace std::chrono_literals;
using identity::KeeperSocketFor;
using identity::LockPathFor;
using protocol::CacheState;

bool Exists(const std::string& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0;
}

// The files one cache may leave in its device dir.
std::vector<std::string> FilesOf(const std::string& socket) {
  return {socket, LockPathFor(socket), KeeperSocketFor(socket),
          LockPathFor(KeeperSocketFor(socket))};
}

class StaleFilesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    model_ = MakeCheckpoint(dir_.Join("model"), 6, 1, 5, 4096);
    runtime_ = dir_.Join("run");
  }
  void TearDown() override { DropAllKeepers(runtime_, 5s); }

  // HostServeArgs with another model id.
  std::vector<std::string> ServeArgs(const std::string& model_id,
                                     std::vector<std::string> extra = {}) const {
    std::vector<std::string> args = {"--model",   model_, "--model-id",    model_id,
                                     "--tier",    "host", "--runtime-dir", runtime_,
                                     "--threads", "2"};
    args.insert(args.end(), extra.begin(), extra.end());
    return args;
  }
  CommandResult Cli(std::vector<std::string> args) {
    args.insert(args.begin(), CliPath());
    return RunCommand(args);
  }
  // Waits until the only socket of the default namespace answers `state`; returns it.
  std::string WaitState(TestChild& child, CacheState state) {
    const auto until = std::chrono::steady_clock::now() + 30s;
    while (std::chrono::steady_clock::now() < until) {
      const std::vector<std::string> sockets = FindSockets(runtime_, "default");
      if (sockets.size() == 1) {
        auto st = QueryStatus(sockets[0]);
        if (st.ok() && st->state == state) return sockets[0];
      }
      if (child.WaitExit(20ms).has_value()) break;
    }
    ADD_FAILURE() << "no daemon answered " << protocol::CacheStateName(state) << ": "
                  << child.Log();
    return "";
  }
  void Kill(TestChild& child) {
    ASSERT_TRUE(child.Signal(SIGKILL).ok());
    ASSERT_EQ(child.WaitExit(10s), 128 + SIGKILL);
  }
  std::string LedgerText() const {
    const std::string path = identity::BudgetLedgerPath(runtime_ + "/default/host");
    return Exists(path) ? ReadFile(path) : "";
  }
  // `ls --json` of the default namespace: the state of `socket`'s row, "" when not listed.
  std::string ListedState(const std::string& socket) {
    const CommandResult ls = Cli({"ls", "--json", "--runtime-dir", runtime_});
    EXPECT_EQ(ls.exit_code, 0) << ls.err;
    const nlohmann::json listing = nlohmann::json::parse(ls.out);
    for (const auto& row : listing["caches"]) {
      if (row.value("socket", std::string()) == socket) return row.value("state", std::string());
    }
    return "(not listed) " + ls.out;
  }
  // `stop --all --json`, then: rc 0, one "removed" line for `socket`, its `cleaned` entry, and
  // no file of it left, nor its ledger entry, nor a row in `ls`.
  void StopAllLeavesNothingOf(const std::string& socket) {
    const CommandResult stop = Cli({"stop", "--all", "--json", "--runtime-dir", runtime_});
    ASSERT_EQ(stop.exit_code, 0) << stop.err;
    EXPECT_NE(stop.err.find("weightcache stop: " + socket + ": removed its stale socket"),
              std::string::npos)
        << stop.err;
    const auto out = nlohmann::json::parse(stop.out);
    ASSERT_EQ(out["cleaned"].size(), 1u) << stop.out;
    EXPECT_EQ(out["cleaned"][0]["socket"], socket);
    EXPECT_EQ(out["exit_code"], 0);
    for (const std::string& f : FilesOf(socket)) EXPECT_FALSE(Exists(f)) << f;
    EXPECT_EQ(LedgerText().find(socket), std::string::npos) << LedgerText();
    EXPECT_EQ(ListedState(socket).substr(0, 13), "(not listed) ");
    // Nothing is left to clean: a second stop --all says nothing of it.
    const CommandResult again = Cli({"stop", "--all", "--json", "--runtime-dir", runtime_});
    ASSERT_EQ(again.exit_code, 0) << again.err;
    EXPECT_TRUE(nlohmann::json::parse(again.out)["cleaned"].empty()) << again.out;
  }

  TempDir dir_;
  std::string model_, runtime_;
};

// Killed while `awaiting` its publisher (a published cache loads nothing).
TEST_F(StaleFilesTest, KilledWhileAwaitingItsPublisher) {
  auto serve = SpawnServe({"--source", "published:eng", "--tier", "host", "--model-id", "pub",
                           "--runtime-dir", runtime_},
                          {}, dir_.Join("serve.log"));
  ASSERT_TRUE(serve.ok()) << serve.status().ToString();
  const std::string socket = WaitState(*serve, CacheState::kAwaiting);
  ASSERT_FALSE(socket.empty());
  Kill(*serve);
  EXPECT_TRUE(Exists(socket));
  EXPECT_EQ(ListedState(socket), "stale");
  StopAllLeavesNothingOf(socket);
}

// Killed mid-load: the loader held by the daemon's test seam after the last byte is read
// (WEIGHTCACHE_TEST_LOADED_FIFO), admitted under a budget (a ledger entry), its keeper started
// and waiting for the deposit.
TEST_F(StaleFilesTest, KilledMidLoadWithALedgerEntryAndAWaitingKeeper) {
  const std::string fifo = dir_.Join("loaded.fifo");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  auto serve = SpawnServe(HostServeArgs(model_, runtime_, {"--host-budget", "1G"}),
                          {"WEIGHTCACHE_TEST_LOADED_FIFO=" + fifo}, dir_.Join("serve.log"));
  ASSERT_TRUE(serve.ok()) << serve.status().ToString();
  UniqueFd writer;
  while (!writer) {
    writer = UniqueFd(::open(fifo.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC));
    if (writer) break;
    ASSERT_EQ(errno, ENXIO);
    ASSERT_FALSE(serve->WaitExit(10ms).has_value()) << serve->Log();
  }
  const std::vector<std::string> sockets = FindSockets(runtime_, "default");
  ASSERT_EQ(sockets.size(), 1u);
  const std::string socket = sockets[0];
  auto loading = QueryStatus(socket);
  ASSERT_TRUE(loading.ok()) << loading.status().ToString();
  EXPECT_EQ(loading->state, CacheState::kLoading);
  EXPECT_NE(LedgerText().find(socket), std::string::npos) << "admitted: " << LedgerText();
  // The keeper starts with the load (its exec may still be under way): kill once it holds its
  // lock, so that it is gone, not still starting, when `stop --all` runs. (A keeper that takes
  // its lock after a sweep leaves its lock file to the next one.)
  const std::string keeper_lock = LockPathFor(KeeperSocketFor(socket));
  const auto started_by = std::chrono::steady_clock::now() + 10s;
  while (!os::IsLockHeld(keeper_lock) && std::chrono::steady_clock::now() < started_by) {
    std::this_thread::sleep_for(5ms);
  }
  ASSERT_TRUE(os::IsLockHeld(keeper_lock)) << serve->Log();
  Kill(*serve);
  writer.Reset();
  // The keeper leaves with its depositor (docs/keeper.md); its lock file stays behind.
  const auto until = std::chrono::steady_clock::now() + 10s;
  while (os::IsLockHeld(keeper_lock) && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(10ms);
  }
  ASSERT_FALSE(os::IsLockHeld(keeper_lock)) << "the keeper outlived its depositor";
  EXPECT_TRUE(Exists(socket));
  EXPECT_NE(LedgerText().find(socket), std::string::npos) << LedgerText();
  StopAllLeavesNothingOf(socket);
}

// Killed once ready, without a keeper: nothing holds the memory, only files remain.
TEST_F(StaleFilesTest, KilledReadyWithoutAKeeper) {
  auto serve = SpawnServe(HostServeArgs(model_, runtime_, {"--no-keeper", "--host-budget", "1G"}),
                          {}, dir_.Join("serve.log"));
  ASSERT_TRUE(serve.ok()) << serve.status().ToString();
  const std::string socket = WaitState(*serve, CacheState::kReady);
  ASSERT_FALSE(socket.empty());
  Kill(*serve);
  EXPECT_EQ(ListedState(socket), "stale");
  StopAllLeavesNothingOf(socket);
}

// Killed once ready with its keeper: an orphan. `stop --all` frees the keeper's memory first,
// then removes what the daemon and the keeper left.
TEST_F(StaleFilesTest, KilledReadyWithItsKeeperHoldingTheMemory) {
  auto serve = SpawnServe(HostServeArgs(model_, runtime_, {"--host-budget", "1G"}), {},
                          dir_.Join("serve.log"));
  ASSERT_TRUE(serve.ok()) << serve.status().ToString();
  const std::string socket = WaitState(*serve, CacheState::kReady);
  ASSERT_FALSE(socket.empty());
  Kill(*serve);
  EXPECT_EQ(ListedState(socket), "orphan");
  StopAllLeavesNothingOf(socket);
}

// The launcher's start cleans its namespace too, and a live daemon of that namespace keeps every
// file (the lock decides) and keeps serving.
TEST_F(StaleFilesTest, LaunchCleansTheNamespaceAndLeavesALiveDaemonAlone) {
  auto live = ServeProcess::Start(ServeArgs("live"), dir_.Join("live.log"));
  ASSERT_NE(live, nullptr);
  auto live_socket = WaitForState(*live, runtime_, CacheState::kReady);
  ASSERT_TRUE(live_socket.ok()) << live_socket.status().ToString();
  auto dead = SpawnServe(ServeArgs("dead", {"--no-keeper"}), {}, dir_.Join("dead.log"));
  ASSERT_TRUE(dead.ok()) << dead.status().ToString();
  std::string dead_socket;
  const auto until = std::chrono::steady_clock::now() + 30s;
  while (dead_socket.empty() && std::chrono::steady_clock::now() < until) {
    for (const std::string& s : FindSockets(runtime_, "default")) {
      auto st = QueryStatus(s);
      if (s != *live_socket && st.ok() && st->state == CacheState::kReady) dead_socket = s;
    }
    std::this_thread::sleep_for(20ms);
  }
  ASSERT_FALSE(dead_socket.empty()) << dead->Log();
  Kill(*dead);

  nlohmann::json inventory = nlohmann::json::array({{{"index", 0},
                                                     {"uuid", FakeGpuUuid(0)},
                                                     {"name", "Fake H200"},
                                                     {"memory_bytes", 1u << 30}}});
  WriteFile(dir_.Join("inventory.json"), inventory.dump());
  const CommandResult launch =
      Cli({"launch", "--model", model_, "--model-id", "job", "--tier", "host", "--tp", "1",
           "--runtime-dir", runtime_, "--device-inventory", dir_.Join("inventory.json"),
           "--ready-timeout", "30", "--stop-grace", "3", "--json"});
  ASSERT_EQ(launch.exit_code, 0) << launch.err << launch.out;
  const auto summary = nlohmann::json::parse(launch.out);
  for (const auto& d : summary["daemons"]) {  // the job's daemon outlives the launch
    const pid_t pid = d["pid"].get<pid_t>();
    ::kill(pid, SIGTERM);
    const auto gone_by = std::chrono::steady_clock::now() + 10s;
    while (::kill(pid, 0) == 0 && std::chrono::steady_clock::now() < gone_by) {
      std::this_thread::sleep_for(10ms);
    }
  }
  EXPECT_NE(launch.err.find("weightcache launch: " + dead_socket + ": removed its stale socket"),
            std::string::npos)
      << launch.err;
  ASSERT_EQ(summary["cleaned"].size(), 1u) << launch.out;
  EXPECT_EQ(summary["cleaned"][0]["socket"], dead_socket);
  for (const std::string& f : FilesOf(dead_socket)) EXPECT_FALSE(Exists(f)) << f;
  EXPECT_TRUE(Exists(*live_socket));
  EXPECT_TRUE(os::IsLockHeld(LockPathFor(*live_socket)));
  EXPECT_EQ(os::ReadLockOwner(LockPathFor(*live_socket)), live->pid());
  auto st = QueryStatus(*live_socket);
  ASSERT_TRUE(st.ok()) << st.status().ToString();
  EXPECT_EQ(st->state, CacheState::kReady);
}

}  // namespace
}  // namespace weightcache::testing
