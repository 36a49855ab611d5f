// `weightcache launch` under attack (issue 10, "Done when"): a daemon that hangs while
// loading, a daemon killed while the launcher supervises it, SIGTERM to the launcher during
// start-up, and two launches of the same job. Real launcher and daemon processes (host tier,
// an 8-GPU device inventory), real checkpoints from tests/tools/make_checkpoint.py.
//
// A daemon is made to hang deterministically by stopping it (SIGSTOP) as soon as it has
// exec'd `serve`: the test watches the launcher's children (/proc/<pid>/task/<pid>/children)
// and stops or kills the one with the wanted --tp-rank before it can have loaded (the launcher
// only reads `ready` on its next 100 ms probe, and the checkpoint is large enough that the
// load takes longer than finding the child).
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "identity/paths.h"
#include "os/lock_file.h"
#include "support/child_process.h"
#include "support/test_env.h"
#include "unit/identity/test_devices.h"

namespace weightcache::testing {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

std::vector<std::string> CmdLine(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/cmdline", std::ios::binary);
  std::vector<std::string> argv;
  std::string arg;
  while (std::getline(in, arg, '\0')) argv.push_back(arg);
  return argv;
}

// The pid of the launcher's child that runs `serve` (exec'd: before exec its command line is
// the launcher's) with --tp-rank `tp_rank`, or nullopt.
std::optional<pid_t> ServeChild(pid_t launcher, int tp_rank) {
  const std::string p = "/proc/" + std::to_string(launcher);
  std::ifstream in(p + "/task/" + std::to_string(launcher) + "/children");
  pid_t child = 0;
  while (in >> child) {
    const std::vector<std::string> argv = CmdLine(child);
    if (argv.size() < 2 || argv[1] != "serve") continue;
    for (size_t i = 2; i + 1 < argv.size(); ++i) {
      if (argv[i] == "--tp-rank" && argv[i + 1] == std::to_string(tp_rank)) return child;
    }
  }
  return std::nullopt;
}

// Waits for that child, polling every millisecond, up to 20 s.
pid_t WaitServeChild(TestChild& launcher, int tp_rank) {
  const auto deadline = Clock::now() + 20s;
  while (Clock::now() < deadline) {
    if (auto pid = ServeChild(launcher.pid(), tp_rank)) return *pid;
    if (!launcher.Running()) break;
    std::this_thread::sleep_for(1ms);
  }
  ADD_FAILURE() << "no serve child with --tp-rank " << tp_rank << "; launcher "
                << launcher.DescribeExit() << ":\n"
                << launcher.Log();
  return -1;
}

bool Gone(pid_t pid) {
  // Reaped by the launcher (its child), so the pid no longer exists; a zombie would still
  // have a /proc entry with state Z, which also counts as gone.
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  if (!in) return true;
  std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t close = stat.rfind(')');
  return close != std::string::npos && close + 2 < stat.size() && stat[close + 2] == 'Z';
}

class LaunchAdversarialTest : public ::testing::Test {
 protected:
  void SetUp() override {
    WriteFile(dir_.Join("inventory.json"), identity::testing::InventoryJson(8));
    // The jobs here are sharded (--tp 2) over a checkpoint with no config.json: their rules
    // hold every tensor whole on every rank.
    WriteFile(dir_.Join("replicate-all.json"),
              R"({"format": 1, "rules": [{"match": ".*", "mode": "replicate"}]})");
    CommandResult r =
        RunCommand({PythonExe(), SourceDir() + "/tests/tools/make_checkpoint.py", "--out", model_,
                    "--tensors", "48", "--shards", "4", "--seed", "3"});
    ASSERT_EQ(r.exit_code, 0) << r.err;
  }
  void TearDown() override {
    for (pid_t pid : detached_) ::kill(pid, SIGKILL);  // a failed test's leftovers
  }

  std::vector<std::string> Args(std::vector<std::string> extra) const {
    std::vector<std::string> argv = {CliPath(),
                                     "launch",
                                     "--model",
                                     model_,
                                     "--tier",
                                     "host",
                                     "--shard-rules",
                                     dir_.Join("replicate-all.json"),
                                     "--runtime-dir",
                                     runtime(),
                                     "--device-inventory",
                                     dir_.Join("inventory.json"),
                                     "--stop-grace",
                                     "5",
                                     "--threads",
                                     "1",
                                     "--json"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    return argv;
  }
  TestChild Spawn(std::vector<std::string> extra, const std::string& log) {
    ChildSpec spec;
    spec.argv = Args(std::move(extra));
    spec.log_path = dir_.Join(log);
    auto child = TestChild::Spawn(spec);
    EXPECT_TRUE(child.ok()) << child.status().ToString();
    return std::move(child).value();
  }
  static nlohmann::json Summary(const std::string& log) {
    const size_t brace = log.find("{\n");
    if (brace == std::string::npos) return nlohmann::json();
    return nlohmann::json::parse(log.substr(brace, log.rfind('}') - brace + 1), nullptr, false);
  }
  std::vector<std::string> Sockets() const {
    auto all = identity::ListAllCacheSockets(runtime());
    std::vector<std::string> out;
    if (all.ok()) {
      for (auto& e : *all) out.push_back(e.socket);
    }
    return out;
  }
  bool AnyLockHeld() const {
    if (!std::filesystem::exists(runtime())) return false;
    for (auto& e : std::filesystem::recursive_directory_iterator(runtime())) {
      if (e.path().extension() == ".lock" && os::IsLockHeld(e.path().string())) return true;
    }
    return false;
  }
  // Every daemon reaped, no socket, no lock held. A keeper started with a load outlives a
  // daemon killed with SIGKILL by the moment it takes to see its depositor pipe close
  // (docs/keeper.md): its lock is given 10 s to go.
  void ExpectNothingLeft(const nlohmann::json& j) {
    for (const auto& d : j["daemons"]) EXPECT_TRUE(Gone(d["pid"].get<pid_t>())) << d.dump();
    EXPECT_TRUE(Sockets().empty());
    const auto deadline = Clock::now() + 10s;
    while (AnyLockHeld() && Clock::now() < deadline) std::this_thread::sleep_for(5ms);
    EXPECT_FALSE(AnyLockHeld());
  }
  std::string runtime() const { return dir_.Join("rt"); }

  TempDir dir_;
  std::string model_ = dir_.Join("model");
  std::vector<pid_t> detached_;
};

// A daemon that hangs while loading: the ready timeout passes, every daemon is stopped (the
// hung one too: SIGTERM is followed by SIGCONT), exit 6, and the hung daemon's last log lines
// are shown.
TEST_F(LaunchAdversarialTest, ADaemonHungWhileLoadingTimesOutStopsAllAndShowsItsLog) {
  TestChild launcher = Spawn({"--tp", "2", "--ready-timeout", "3"}, "launcher.log");
  const pid_t hung = WaitServeChild(launcher, 0);
  ASSERT_GT(hung, 0);
  ASSERT_EQ(::kill(hung, SIGSTOP), 0);
  ASSERT_EQ(launcher.WaitExit(), 6) << launcher.Log();
  const std::string log = launcher.Log();
  nlohmann::json j = Summary(log);
  ASSERT_FALSE(j.is_discarded()) << log;
  EXPECT_EQ(j["status"], "timeout");
  ASSERT_EQ(j["daemons"].size(), 2u);
  EXPECT_EQ(j["daemons"][0]["pid"], hung);
  EXPECT_EQ(j["daemons"][0]["failed"], true) << "the report is about the hung daemon";
  EXPECT_NE(j["daemons"][0]["state"], "ready");
  EXPECT_NE(log.find("daemons not ready after 3"), std::string::npos) << log;
  EXPECT_NE(log.find("tp0-pp0"), std::string::npos) << log;
  const std::string hung_log = j["daemons"][0]["log"];
  EXPECT_NE(log.find("--- last "), std::string::npos) << log;
  EXPECT_NE(log.find(" lines of " + hung_log + " ---"), std::string::npos) << log;
  ExpectNothingLeft(j);
}

// A daemon SIGKILLed while the launcher supervises the start-up: the launcher notices at once
// (pidfd), stops the rest, and exits non-zero naming the dead daemon and its signal.
TEST_F(LaunchAdversarialTest, ADaemonKilledDuringStartUpStopsTheRestAndIsNamed) {
  TestChild launcher = Spawn({"--tp", "2", "--ready-timeout", "60"}, "launcher.log");
  const pid_t victim = WaitServeChild(launcher, 1);
  ASSERT_GT(victim, 0);
  ASSERT_EQ(::kill(victim, SIGKILL), 0);
  EXPECT_EQ(launcher.WaitExit(), 1) << launcher.Log();
  const std::string log = launcher.Log();
  nlohmann::json j = Summary(log);
  ASSERT_FALSE(j.is_discarded()) << log;
  EXPECT_EQ(j["status"], "unavailable");
  EXPECT_NE(log.find("daemon tp1-pp0"), std::string::npos) << log;
  EXPECT_NE(log.find("pid " + std::to_string(victim)), std::string::npos) << log;
  EXPECT_NE(log.find("died before it was ready: killed by signal 9"), std::string::npos) << log;
  EXPECT_EQ(j["daemons"][1]["failed"], true);
  EXPECT_EQ(j["daemons"][1]["exit"]["signal"], SIGKILL);
  ExpectNothingLeft(j);
}

// After ready, --supervise restarts a daemon that is SIGKILLed: a new pid serves the same
// socket again, and the other daemon is not disturbed.
TEST_F(LaunchAdversarialTest, ADaemonKilledAfterReadyIsRestartedAndTheOthersStay) {
  TestChild launcher = Spawn({"--tp", "2", "--ready-timeout", "60", "--supervise"}, "launcher.log");
  const auto deadline = Clock::now() + 30s;
  while (Clock::now() < deadline &&
         launcher.Log().find("2 daemons ready; supervising") == std::string::npos) {
    ASSERT_TRUE(launcher.Running()) << launcher.Log();
    std::this_thread::sleep_for(10ms);
  }
  ASSERT_EQ(Sockets().size(), 2u) << launcher.Log();
  std::map<std::string, pid_t> owner;
  for (const std::string& s : Sockets()) owner[s] = *os::ReadLockOwner(identity::LockPathFor(s));
  const pid_t victim = *ServeChild(launcher.pid(), 1);
  ASSERT_EQ(::kill(victim, SIGKILL), 0);
  // Restarted after the 1 s backoff: the victim's socket gets a new owner, the other keeps its.
  bool restarted = false;
  while (Clock::now() < deadline + 30s && !restarted) {
    std::this_thread::sleep_for(20ms);
    auto again = ServeChild(launcher.pid(), 1);
    if (!again || *again == victim) continue;
    for (const auto& [socket, pid] : owner) {
      if (pid != victim) continue;
      auto now = os::ReadLockOwner(identity::LockPathFor(socket));
      restarted = now == *again && os::IsLockHeld(identity::LockPathFor(socket));
    }
  }
  ASSERT_TRUE(restarted) << launcher.Log();
  for (const auto& [socket, pid] : owner) {
    if (pid == victim) continue;
    EXPECT_EQ(os::ReadLockOwner(identity::LockPathFor(socket)), pid) << "tp0 was disturbed";
  }
  ASSERT_TRUE(launcher.Signal(SIGTERM).ok());
  EXPECT_EQ(launcher.WaitExit(), 0) << launcher.Log();
  nlohmann::json j = Summary(launcher.Log());
  ASSERT_FALSE(j.is_discarded()) << launcher.Log();
  EXPECT_EQ(j["daemons"][1]["restarts"], 1);
  ExpectNothingLeft(j);
}

// SIGTERM to the launcher while a daemon is still loading (held there by SIGSTOP): every
// child is stopped and reaped, no socket or held lock is left, and the launcher exits 1
// (docs/launcher.md: a signal during start-up is a failure) with stop_signal 15.
TEST_F(LaunchAdversarialTest, SigtermDuringStartUpLeavesNoChildSocketOrLock) {
  TestChild launcher = Spawn({"--tp", "2", "--ready-timeout", "60"}, "launcher.log");
  const pid_t held = WaitServeChild(launcher, 0);
  ASSERT_GT(held, 0);
  ASSERT_EQ(::kill(held, SIGSTOP), 0);
  const pid_t other = WaitServeChild(launcher, 1);
  ASSERT_GT(other, 0);
  ASSERT_TRUE(launcher.Signal(SIGTERM).ok());
  EXPECT_EQ(launcher.WaitExit(), 1) << launcher.Log();
  const std::string log = launcher.Log();
  nlohmann::json j = Summary(log);
  ASSERT_FALSE(j.is_discarded()) << log;
  EXPECT_EQ(j["stop_signal"], SIGTERM);
  EXPECT_EQ(j["exit_code"], 1);
  EXPECT_NE(log.find("interrupted by SIGTERM before every daemon was ready"), std::string::npos)
      << log;
  for (const auto& d : j["daemons"]) EXPECT_EQ(d["state"], "stopped") << d.dump();
  EXPECT_TRUE(Gone(held));
  EXPECT_TRUE(Gone(other));
  ExpectNothingLeft(j);
}

// Two launches of the same job: the second fails with exit 7 naming the first's daemon pid,
// and the first's daemons keep serving, untouched.
TEST_F(LaunchAdversarialTest, ASecondLaunchOfTheSameJobExitsSevenNamingTheFirstsDaemon) {
  CommandResult first = RunCommand(Args({"--tp", "2", "--ready-timeout", "60"}));
  ASSERT_EQ(first.exit_code, 0) << first.out << first.err;
  nlohmann::json a = nlohmann::json::parse(first.out);
  ASSERT_EQ(a["daemons"].size(), 2u);
  for (const auto& d : a["daemons"]) detached_.push_back(d["pid"].get<pid_t>());

  CommandResult second = RunCommand(Args({"--tp", "2", "--ready-timeout", "60"}));
  EXPECT_EQ(second.exit_code, 7) << second.out << second.err;
  nlohmann::json b = nlohmann::json::parse(second.out, nullptr, false);
  ASSERT_FALSE(b.is_discarded()) << second.out;
  EXPECT_EQ(b["status"], "already served");
  const std::string message = b["message"];
  bool names_an_owner = false;
  for (const auto& d : a["daemons"]) {
    names_an_owner |=
        message.find("held by pid " + std::to_string(d["pid"].get<pid_t>())) != std::string::npos;
  }
  EXPECT_TRUE(names_an_owner) << message;
  for (const auto& d : b["daemons"]) EXPECT_TRUE(Gone(d["pid"].get<pid_t>())) << d.dump();

  // The first launch's daemons still own their sockets and answer ready.
  for (const auto& d : a["daemons"]) {
    const std::string socket = d["socket"];
    EXPECT_EQ(os::ReadLockOwner(identity::LockPathFor(socket)), d["pid"].get<pid_t>());
    auto status = QueryStatus(socket);
    ASSERT_TRUE(status.ok()) << status.status().ToString();
    EXPECT_EQ(status->state, protocol::CacheState::kReady);
    EXPECT_EQ(status->pid, d["pid"].get<pid_t>());
  }
  CommandResult stop = RunCommand({CliPath(), "stop", "--all", "--runtime-dir", runtime()});
  EXPECT_EQ(stop.exit_code, 0) << stop.err;
  detached_.clear();
}

}  // namespace
}  // namespace weightcache::testing
