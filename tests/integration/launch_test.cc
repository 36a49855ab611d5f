// `weightcache launch` end to end: real `serve` daemons (host tier), an 8-GPU device
// inventory, real safetensors checkpoints from tests/tools/make_checkpoint.py, real clients.
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "identity/paths.h"
#include "launcher/child_process.h"
#include "os/lock_file.h"
#include "support/test_env.h"

namespace weightcache {
namespace {

using namespace std::chrono_literals;
using testing::CliPath;
using testing::CommandResult;
using testing::ReadFile;
using testing::RunCommand;
using testing::TempDir;
using testing::WriteFile;
using Clock = std::chrono::steady_clock;

std::string Uuid(int i) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "GPU-%08x-0000-4000-8000-%012x", 0xc0de00 + i, i);
  return buf;
}

// A pidfd for `pid`, or -1 once the pid is gone (exited and reaped).
int OpenPidfd(pid_t pid) { return static_cast<int>(::syscall(SYS_pidfd_open, pid, 0u)); }

// True when `pid` has exited (reaped, or a zombie awaiting a parent that is not us): the
// pidfd reads as exited. Never kill(pid, 0).
bool Exited(pid_t pid, std::chrono::milliseconds wait = 0ms) {
  int fd = OpenPidfd(pid);
  if (fd < 0) return errno == ESRCH;
  pollfd p{fd, POLLIN, 0};
  int n = ::poll(&p, 1, static_cast<int>(wait.count()));
  ::close(fd);
  return n == 1;
}

void Terminate(pid_t pid) {
  int fd = OpenPidfd(pid);
  if (fd < 0) return;
  ::syscall(SYS_pidfd_send_signal, fd, SIGTERM, nullptr, 0u);
  ::close(fd);
}

class LaunchTest : public ::testing::Test {
 protected:
  void SetUp() override {
    nlohmann::json inv = nlohmann::json::array();
    for (int i = 0; i < 8; ++i) {
      inv.push_back({{"index", i},
                     {"uuid", Uuid(i)},
                     {"name", "Fake H200"},
                     {"memory_bytes", 150'000'000'000ULL}});
    }
    WriteFile(dir_.Join("inventory.json"), inv.dump());
    model_ = MakeCheckpoint("model", 16, 2);
    // The jobs here are sharded (--tp 2 ...) over a checkpoint with no config.json: their
    // rules hold every tensor whole on every rank.
    rules_ = dir_.Join("replicate-all.json");
    WriteFile(rules_, R"({"format": 1, "rules": [{"match": ".*", "mode": "replicate"}]})");
  }
  void TearDown() override {
    // Daemons of a successful launch outlive it: stop every one we were told about.
    for (pid_t pid : started_) {
      Terminate(pid);
      EXPECT_TRUE(Exited(pid, 5000ms)) << "daemon " << pid << " ignored SIGTERM";
    }
  }

  std::string MakeCheckpoint(const std::string& name, int tensors, int shards) {
    const std::string out = dir_.Join(name);
    CommandResult r =
        RunCommand({testing::PythonExe(), testing::SourceDir() + "/tests/tools/make_checkpoint.py",
                    "--out", out, "--tensors", std::to_string(tensors), "--shards",
                    std::to_string(shards), "--seed", "7"});
    EXPECT_EQ(r.exit_code, 0) << r.err;
    return out;
  }

  // `weightcache COMMAND` with the identity flags every command of these tests shares: this
  // model on the host tier, its rules, the runtime dir and the fake inventory.
  std::vector<std::string> CommandArgs(const std::string& command) const {
    return {CliPath(),
            command,
            "--model",
            model_,
            "--tier",
            "host",
            "--shard-rules",
            rules_,
            "--runtime-dir",
            runtime(),
            "--device-inventory",
            dir_.Join("inventory.json")};
  }

  std::vector<std::string> LaunchArgs(std::vector<std::string> extra) {
    std::vector<std::string> argv = CommandArgs("launch");
    argv.insert(argv.end(), {"--stop-grace", "3", "--json"});
    if (std::find(extra.begin(), extra.end(), "--ready-timeout") == extra.end()) {
      extra.insert(extra.end(), {"--ready-timeout", "30"});
    }
    argv.insert(argv.end(), extra.begin(), extra.end());
    return argv;
  }

  // Runs a launch to completion and parses its JSON summary.
  nlohmann::json Launch(std::vector<std::string> extra, int expect_exit,
                        const std::vector<std::string>& env = {}) {
    CommandResult r = RunCommand(LaunchArgs(std::move(extra)), env);
    EXPECT_EQ(r.exit_code, expect_exit) << r.out << r.err;
    nlohmann::json j = nlohmann::json::parse(r.out, nullptr, /*allow_exceptions=*/false);
    EXPECT_FALSE(j.is_discarded()) << r.out;
    last_err_ = r.err;
    if (expect_exit == 0 && !j.is_discarded()) {
      for (const auto& d : j["daemons"]) started_.push_back(d["pid"].get<pid_t>());
    }
    return j;
  }

  // `weightcache attach --json` of rank `rank` of a --tp 2 job on the visible device `rank`,
  // failing when no daemon serves it.
  std::vector<std::string> AttachArgs(int rank) const {
    std::vector<std::string> argv = CommandArgs("attach");
    argv.insert(argv.end(), {"--device", std::to_string(rank), "--tp-size", "2", "--tp-rank",
                             std::to_string(rank), "--on-missing", "error", "--json"});
    return argv;
  }

  // Every *.sock under the runtime dir, and whether any lock file there is still held.
  std::vector<std::string> Sockets() {
    auto all = identity::ListAllCacheSockets(runtime());
    EXPECT_TRUE(all.ok()) << all.status().ToString();
    std::vector<std::string> out;
    if (all.ok()) {
      for (auto& e : *all) out.push_back(e.socket);
    }
    return out;
  }
  bool AnyLockHeld() {
    if (!std::filesystem::exists(runtime())) return false;
    for (auto& e : std::filesystem::recursive_directory_iterator(runtime())) {
      if (e.path().extension() == ".lock" && os::IsLockHeld(e.path().string())) return true;
    }
    return false;
  }

  std::string runtime() const { return dir_.Join("rt"); }

  // The state a daemon's Status reply names ("awaiting", "ready", …), via `ls --json`.
  std::string QueryState(const std::string& socket) const {
    CommandResult r = RunCommand({CliPath(), "ls", "--json", "--runtime-dir", runtime()});
    EXPECT_EQ(r.exit_code, 0) << r.err;
    const nlohmann::json listing = nlohmann::json::parse(r.out);
    for (const auto& c : listing["caches"]) {
      if (c["socket"] == socket) return c["state"];
    }
    return "absent";
  }

  TempDir dir_;
  std::string model_;
  std::string rules_;
  std::vector<pid_t> started_;
  std::string last_err_;
};

TEST_F(LaunchTest, Pp2Tp2Step2StartsOneReadyDaemonPerRankOnGpus0246) {
  nlohmann::json j = Launch({"--tp", "2", "--pp", "2", "--gpu-id-step", "2"}, 0);
  ASSERT_EQ(j["status"], "ok");
  ASSERT_EQ(j["daemons"].size(), 4u);
  const int want_gpu[4] = {0, 2, 4, 6};
  for (int i = 0; i < 4; ++i) {
    const auto& d = j["daemons"][i];
    EXPECT_EQ(d["tp_rank"], i % 2);
    EXPECT_EQ(d["pp_rank"], i / 2);
    EXPECT_EQ(d["local_gpu_id"], want_gpu[i]);
    EXPECT_EQ(d["device_uuid"], Uuid(want_gpu[i]));
    EXPECT_EQ(d["state"], "ready");
    EXPECT_GT(d["bytes_total"].get<uint64_t>(), 0u);
    EXPECT_EQ(d["bytes_done"], d["bytes_total"]);
    // The socket is under the rank's own GPU, and its daemon is the one we were told.
    const std::string socket = d["socket"];
    EXPECT_NE(socket.find("/default/" + Uuid(want_gpu[i]) + "/"), std::string::npos) << socket;
    EXPECT_EQ(os::ReadLockOwner(identity::LockPathFor(socket)), d["pid"].get<pid_t>());
    EXPECT_FALSE(Exited(d["pid"].get<pid_t>())) << "daemons outlive a successful launch";
    const std::string log = ReadFile(d["log"].get<std::string>());
    EXPECT_NE(log.find("weightcache launch: starting " + d["name"].get<std::string>() + ": " +
                       CliPath() + " serve --model " + model_ + " "),
              std::string::npos)
        << log;
    EXPECT_NE(log.find(" --tier host --device " + Uuid(want_gpu[i]) + " "), std::string::npos)
        << log;
  }
}

// Publish-await for an engine on CPUs (docs/engines.md): launch of a published source with
// --no-gpu is done once every daemon awaits its publisher, none holds a GPU, and a publisher and
// a client without a device meet at those daemons.
TEST_F(LaunchTest, APublishedSourceWithoutGpusIsUpOnceEveryDaemonAwaitsItsPublisher) {
  const std::vector<std::string> identity = {
      "--source", "published:engine-1", "--model-id", "tiny",          "--tier",
      "host",     "--tp-size",          "2",          "--runtime-dir", runtime()};
  std::vector<std::string> argv = {CliPath(),      "launch", "--no-gpu",        "--json",
                                   "--stop-grace", "3",      "--ready-timeout", "30"};
  argv.insert(argv.end(), identity.begin(), identity.end());
  CommandResult r = RunCommand(argv);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  ASSERT_EQ(j["daemons"].size(), 2u) << r.out;
  for (const auto& d : j["daemons"]) {
    started_.push_back(d["pid"].get<pid_t>());
    EXPECT_EQ(d["local_gpu_id"], -1);
    EXPECT_EQ(d["device_uuid"], "");
    EXPECT_NE(d["socket"].get<std::string>().find("/default/host/"), std::string::npos) << d;
    EXPECT_EQ(QueryState(d["socket"].get<std::string>()), "awaiting") << d["socket"];
  }

  // Rank 1's publisher and then its client, neither with a device, find rank 1's daemon.
  std::string shard;
  for (const auto& e : std::filesystem::directory_iterator(model_)) {
    if (e.path().extension() == ".safetensors") shard = e.path().string();
  }
  ASSERT_FALSE(shard.empty());
  std::vector<std::string> publish = {CliPath(), "publish", "--tp-rank", "1"};
  publish.insert(publish.end(), identity.begin(), identity.end());
  publish.push_back(shard);
  CommandResult published = RunCommand(publish);
  ASSERT_EQ(published.exit_code, 0) << published.out << published.err;
  std::vector<std::string> attach = {CliPath(),      "attach", "--tp-rank", "1",
                                     "--on-missing", "error",  "--json"};
  attach.insert(attach.end(), identity.begin(), identity.end());
  CommandResult attached = RunCommand(attach);
  ASSERT_EQ(attached.exit_code, 0) << attached.out << attached.err;
  EXPECT_EQ(nlohmann::json::parse(attached.out)["daemon_pid"], j["daemons"][1]["pid"]);
  EXPECT_EQ(QueryState(j["daemons"][0]["socket"].get<std::string>()), "awaiting");
}

TEST_F(LaunchTest, NoGpuIsForTheHostTierOnly) {
  CommandResult r =
      RunCommand({CliPath(), "launch", "--no-gpu", "--tier", "gpu", "--source",
                  "published:engine-1", "--model-id", "tiny", "--runtime-dir", runtime()});
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("--no-gpu needs --tier host"), std::string::npos) << r.err;
  EXPECT_TRUE(Sockets().empty());
}

TEST_F(LaunchTest, TwoJobsOnDisjointGpuSetsCoexistAndClientsNeverCross) {
  // Job A sees physical GPUs 0-3, job B 4-7: both have a tp_rank 0 on their local GPU 0.
  nlohmann::json a = Launch({"--tp", "2"}, 0, {"CUDA_VISIBLE_DEVICES=0,1,2,3"});
  nlohmann::json b = Launch({"--tp", "2"}, 0, {"CUDA_VISIBLE_DEVICES=4,5,6,7"});
  ASSERT_EQ(a["daemons"].size(), 2u);
  ASSERT_EQ(b["daemons"].size(), 2u);
  EXPECT_EQ(a["daemons"][0]["device_uuid"], Uuid(0));
  EXPECT_EQ(b["daemons"][0]["device_uuid"], Uuid(4));
  EXPECT_NE(a["daemons"][0]["socket"], b["daemons"][0]["socket"]);
  // A client of job B, rank 0 on its local GPU 0, attaches to job B's daemon, never A's.
  for (auto [visible, job] : {std::pair{"4,5,6,7", &b}, std::pair{"0,1,2,3", &a}}) {
    for (int rank = 0; rank < 2; ++rank) {
      CommandResult r =
          RunCommand(AttachArgs(rank), {std::string("CUDA_VISIBLE_DEVICES=") + visible});
      ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
      auto got = nlohmann::json::parse(r.out);
      EXPECT_EQ(got["daemon_pid"], (*job)["daemons"][rank]["pid"]) << visible << " " << r.out;
      EXPECT_EQ(got["socket"], (*job)["daemons"][rank]["socket"]);
    }
  }
}

// docs/design.md "Launcher": launch takes every identity flag of serve and applies it to every
// daemon. A client given the same flags attaches to its rank's daemon; one that leaves a flag out
// is told that exactly that field differs.
TEST_F(LaunchTest, EveryIdentityFlagOfServeReachesEveryDaemon) {
  WriteFile(dir_.Join("quant.json"), R"({"bits": 8, "group_size": 128})");
  const std::vector<std::string> identity = {"--model-id",
                                             "tiny-q",
                                             "--revision",
                                             "r9",
                                             "--dtype",
                                             "bf16",
                                             "--quantization",
                                             "fp8",
                                             "--layout-tag",
                                             "fused-qkv",
                                             "--quantization-config",
                                             dir_.Join("quant.json"),
                                             "--dp-size",
                                             "2"};
  // Not --source published:<tag>: such daemons load nothing and await their publisher
  // (docs/publish.md); its forwarding is checked by launch_flags_test.
  std::vector<std::string> extra = {"--tp", "2", "--threads", "3"};
  extra.insert(extra.end(), identity.begin(), identity.end());
  nlohmann::json j = Launch(extra, 0);
  ASSERT_EQ(j["daemons"].size(), 2u) << j.dump();
  for (int rank = 0; rank < 2; ++rank) {
    SCOPED_TRACE(rank);
    const auto& d = j["daemons"][rank];
    const std::string log = ReadFile(d["log"].get<std::string>());
    for (const std::string flag :
         {"--dtype bf16", "--layout-tag fused-qkv", "--threads 3", "--quantization fp8"}) {
      EXPECT_NE(log.find(flag), std::string::npos) << flag << " not in " << log;
    }
    const std::vector<std::string> attach = AttachArgs(rank);
    std::vector<std::string> exact = attach;
    exact.insert(exact.end(), identity.begin(), identity.end());
    CommandResult r = RunCommand(exact);
    ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
    auto got = nlohmann::json::parse(r.out);
    EXPECT_EQ(got["source"], "daemon");
    EXPECT_EQ(got["daemon_pid"], d["pid"]);

    // Everything but --dtype: the daemon's dtype is the launch's, not the default.
    std::vector<std::string> no_dtype = attach;
    for (size_t i = 0; i < identity.size(); i += 2) {
      if (identity[i] != "--dtype") no_dtype.insert(no_dtype.end(), {identity[i], identity[i + 1]});
    }
    CommandResult m = RunCommand(no_dtype);
    EXPECT_EQ(m.exit_code, 4) << m.out << m.err;
    EXPECT_NE(m.err.find("dtype: ours=\"auto\" theirs=\"bf16\""), std::string::npos) << m.err;
  }
}

TEST_F(LaunchTest, ACorruptCheckpointFailsTheLaunchFastAndLeavesNothingBehind) {
  // Truncate one shard: its header promises more data than the file holds.
  const std::string bad = MakeCheckpoint("bad", 8, 2);
  std::string shard;
  for (auto& e : std::filesystem::directory_iterator(bad)) {
    if (e.path().extension() == ".safetensors") shard = e.path().string();
  }
  ASSERT_FALSE(shard.empty());
  std::filesystem::resize_file(shard, std::filesystem::file_size(shard) - 16);
  model_ = bad;
  nlohmann::json j = Launch({"--tp", "4"}, 5);
  // At once, without a wall-clock assertion: the status is the daemon's death, not the ready
  // timeout ("timeout", exit 6), so the launcher did not wait for the deadline.
  EXPECT_EQ(j["status"], "invalid checkpoint");
  EXPECT_NE(last_err_.find("died before it was ready: exit code 5"), std::string::npos)
      << last_err_;
  EXPECT_NE(last_err_.find("--- last "), std::string::npos) << "the failed daemon's log tail";
  for (const auto& d : j["daemons"]) {
    EXPECT_TRUE(Exited(d["pid"].get<pid_t>())) << d.dump();
  }
  EXPECT_TRUE(Sockets().empty());
  EXPECT_FALSE(AnyLockHeld());
}

TEST_F(LaunchTest, TimeoutExitsSixAndStopsEveryDaemon) {
  // A bigger model and a deadline no load can meet.
  model_ = MakeCheckpoint("big", 64, 4);
  nlohmann::json j = Launch({"--tp", "2", "--pp", "2", "--ready-timeout", "0.001"}, 6);
  EXPECT_EQ(j["status"], "timeout");
  EXPECT_NE(last_err_.find("daemons not ready after"), std::string::npos) << last_err_;
  ASSERT_EQ(j["daemons"].size(), 4u);
  for (const auto& d : j["daemons"]) {
    EXPECT_EQ(d["state"], "stopped");
    EXPECT_TRUE(Exited(d["pid"].get<pid_t>())) << d.dump();
  }
  EXPECT_TRUE(Sockets().empty());
  EXPECT_FALSE(AnyLockHeld());
}

TEST_F(LaunchTest, SigtermToASupervisingLauncherStopsEveryDaemonCleanly) {
  launcher::SpawnOptions o;
  o.argv = LaunchArgs({"--tp", "2", "--pp", "2", "--supervise"});
  o.log_path = dir_.Join("launcher.out");
  auto child = launcher::ChildProcess::Spawn(o);
  ASSERT_TRUE(child.ok()) << child.status().ToString();
  // The launcher says when every daemon answered `ready` and it starts supervising.
  const auto deadline = Clock::now() + 20s;
  while (Clock::now() < deadline &&
         ReadFile(o.log_path).find("4 daemons ready; supervising") == std::string::npos) {
    std::this_thread::sleep_for(20ms);
  }
  ASSERT_NE(ReadFile(o.log_path).find("4 daemons ready; supervising"), std::string::npos)
      << ReadFile(o.log_path);
  ASSERT_EQ(Sockets().size(), 4u);
  ASSERT_TRUE(AnyLockHeld());
  ASSERT_FALSE(Exited(child->pid())) << "a supervising launcher keeps running";
  ASSERT_TRUE(child->Signal(SIGTERM).ok());
  auto exit = child->Wait();
  ASSERT_TRUE(exit.ok());
  EXPECT_EQ(exit->exit_code, 0) << ReadFile(o.log_path);
  const std::string out = ReadFile(o.log_path);
  auto j = nlohmann::json::parse(out.substr(out.find('{')), nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << out;
  EXPECT_EQ(j["stop_signal"], SIGTERM);
  for (const auto& d : j["daemons"]) {
    EXPECT_EQ(d["state"], "stopped");
    EXPECT_TRUE(Exited(d["pid"].get<pid_t>())) << d.dump();
    // (`value`: a daemon SIGKILLed after the stop grace has {"signal": 9} and no "code".)
    EXPECT_EQ(d.value("exit", nlohmann::json::object()).value("code", -1), 0)
        << "a daemon stopped by SIGTERM exits cleanly: " << d.dump() << "\n"
        << out;
  }
  EXPECT_TRUE(Sockets().empty());
  EXPECT_FALSE(AnyLockHeld());
}

}  // namespace
}  // namespace weightcache
