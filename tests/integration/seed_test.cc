// `serve --seed-from` and `launch --seed-from auto` (docs/seeding.md) on the host tier, with real
// daemons and the CLI over a checkpoint written by the safetensors library. Four fake GPUs (an
// inventory file) give the caches their device keys: the host-tier cache of one identity with
// affinity to GPU 0 seeds the same identity's cache on GPU 1, which never reads its tensors
// from disk and verifies; a cache of another config is never a peer (auto) and is refused
// by name (explicit socket); a hung peer is skipped, and a peer killed mid-seed still seeds us
// (our fds keep its memory); a second TP=2 job seeds each rank from the first job's same rank.
#include <errno.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>

#include <chrono>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "common/test_hooks.h"
#include "common/unique_fd.h"
#include "integration/daemon_process.h"
#include "support/test_env.h"

namespace weightcache::testing {
namespace {

bool Contains(const std::string& text, const std::string& what) {
  return text.find(what) != std::string::npos;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

class SeedTest : public ::testing::Test {
 protected:
  void SetUp() override {
    model_ = MakeCheckpoint(dir_.Join("model"), 8, 2, 5, 65536);
    WriteFakeInventory(dir_.Join("inventory.json"), 4);
    std::ofstream(dir_.Join("rules.json"))
        << R"({"format": 1, "rules": [{"match": ".*", "mode": "replicate"}]})";
  }
  void TearDown() override {
    for (const std::string& run : runtimes_) {
      RunCommand({CliPath(), "stop", "--all", "--runtime-dir", run});
    }
  }

  // `weightcache <sub>` of our checkpoint's host-tier identity over the fake GPUs, then `rest`.
  std::vector<std::string> Command(const char* sub, std::vector<std::string> rest) const {
    std::vector<std::string> argv = {CliPath(),
                                     sub,
                                     "--model",
                                     model_,
                                     "--model-id",
                                     "tiny",
                                     "--tier",
                                     "host",
                                     "--device-inventory",
                                     dir_.Join("inventory.json")};
    argv.insert(argv.end(), rest.begin(), rest.end());
    return argv;
  }

  struct Served {
    int exit_code = -1;
    std::string socket;  // from serve --detach's output
    pid_t pid = 0;       // likewise
    std::string log;     // the daemon's log
    std::string err;
  };
  // `serve --detach` of the host-tier cache of our checkpoint with affinity to fake GPU
  // `device`, under `run`, then `extra`; returns once it is ready (or failed).
  // `env`: the serve's environment beyond the log level.
  Served Serve(const std::string& run, int device, std::vector<std::string> extra = {},
               std::vector<std::string> env = {}) {
    runtimes_.push_back(run);
    const std::string log = dir_.Join("serve-" + std::to_string(serves_++) + ".log");
    std::vector<std::string> argv =
        Command("serve", {"--device", std::to_string(device), "--runtime-dir", run, "--threads",
                          "2", "--no-keeper", "--detach", "--log-file", log});
    argv.insert(argv.end(), extra.begin(), extra.end());
    env.emplace_back("WEIGHTCACHE_LOG_LEVEL=info");
    const CommandResult r = RunCommand(argv, env);
    Served served;
    served.exit_code = r.exit_code;
    served.err = r.err;
    served.log = ReadFile(log);
    const size_t at = r.out.find("socket ");
    if (at != std::string::npos) {
      served.socket = r.out.substr(at + 7, r.out.find('\n', at) - at - 7);
    }
    const size_t pid = r.out.find("\npid ");
    if (pid != std::string::npos) served.pid = std::stoi(r.out.substr(pid + 5));
    return served;
  }

  // `attach --verify --json` of the cache on fake GPU `device` under `run`: every tensor's
  // checksum recomputed over the mapped memory, against the files.
  void ExpectVerified(const std::string& run, int device) {
    const CommandResult r =
        RunCommand(Command("attach", {"--device", std::to_string(device), "--runtime-dir", run,
                                      "--verify", "--json"}));
    ASSERT_EQ(r.exit_code, 0) << r.err;
    const auto j = nlohmann::json::parse(r.out);
    EXPECT_EQ(j["source"], "daemon") << r.out;
    EXPECT_EQ(j["verify"]["ok"], true) << r.out;
    EXPECT_EQ(j["verify"]["tensors"], 8) << r.out;
  }

  TempDir dir_;
  std::string model_;
  std::vector<std::string> runtimes_;
  int serves_ = 0;
};

TEST_F(SeedTest, TheSameIdentityOnAnotherGpuSeedsOurCache) {
  const std::string run = dir_.Join("run");
  const Served a = Serve(run, 0);
  ASSERT_EQ(a.exit_code, 0) << a.err << a.log;
  const Served b = Serve(run, 1, {"--seed-from", "auto"});
  ASSERT_EQ(b.exit_code, 0) << b.err << b.log;
  EXPECT_TRUE(Contains(b.log, "seed: copying from the peer cache of " + FakeGpuUuid(0))) << b.log;
  EXPECT_TRUE(Contains(b.log, "filled from the peer cache of " + FakeGpuUuid(0) + " (" + a.socket))
      << b.log;
  EXPECT_FALSE(Contains(b.log, "loading from disk")) << b.log;
  ExpectVerified(run, 1);

  // `ls` says where each cache's bytes came from: A's from disk, B's from A's device.
  const CommandResult ls = RunCommand({CliPath(), "ls", "--json", "--runtime-dir", run});
  ASSERT_EQ(ls.exit_code, 0) << ls.err;
  std::map<std::string, std::string> origins;
  const auto listed = nlohmann::json::parse(ls.out);
  for (const auto& row : listed["caches"]) {
    origins[row["device"].get<std::string>()] = row.value("origin", "(none)");
  }
  EXPECT_EQ(origins[FakeGpuUuid(0)], "disk") << ls.out;
  EXPECT_EQ(origins[FakeGpuUuid(1)], "peer " + FakeGpuUuid(0)) << ls.out;
  const CommandResult text = RunCommand({CliPath(), "ls", "--runtime-dir", run});
  EXPECT_TRUE(Contains(text.out, "seeded from the peer cache of " + FakeGpuUuid(0))) << text.out;
}

TEST_F(SeedTest, ACacheOfAnotherConfigIsNoPeerAndAnExplicitOneIsRefusedByName) {
  const std::string run = dir_.Join("run");
  // GPU 0 holds another revision: another digest, so no peer of ours.
  const Served other = Serve(run, 0, {"--revision", "other"});
  ASSERT_EQ(other.exit_code, 0) << other.err << other.log;
  const Served b = Serve(run, 1, {"--seed-from", "auto"});
  ASSERT_EQ(b.exit_code, 0) << b.err << b.log;
  EXPECT_TRUE(Contains(b.log, "seed: no peer cache of")) << b.log;
  EXPECT_TRUE(Contains(b.log, "loaded from disk")) << b.log;
  ExpectVerified(run, 1);

  // Named explicitly, its config is compared and every differing field named.
  const Served c = Serve(dir_.Join("run-c"), 2, {"--seed-from", other.socket});
  ASSERT_EQ(c.exit_code, 0) << c.err << c.log;
  EXPECT_TRUE(Contains(c.log, "not from " + other.socket)) << c.log;
  EXPECT_TRUE(Contains(c.log, "revision")) << c.log;
  EXPECT_TRUE(Contains(c.log, "loaded from disk")) << c.log;
  ExpectVerified(dir_.Join("run-c"), 2);
}

// A hung peer (stopped: its socket accepts, nothing answers) costs the new cache its answer
// deadline, not its start: it is skipped and the disk load follows.
TEST_F(SeedTest, AHungPeerIsSkippedAndTheDiskLoadFollows) {
  const std::string run = dir_.Join("run");
  const Served a = Serve(run, 0);
  ASSERT_EQ(a.exit_code, 0) << a.err << a.log;
  ASSERT_GT(a.pid, 0);
  ASSERT_EQ(::kill(a.pid, SIGSTOP), 0);
  // Without the deadline this serve would wait for the peer until ctest's timeout.
  const Served b = Serve(run, 1, {"--seed-from", "auto"});
  ::kill(a.pid, SIGCONT);
  ASSERT_EQ(b.exit_code, 0) << b.err << b.log;
  EXPECT_TRUE(Contains(b.log, "seed: not from " + a.socket)) << b.log;
  EXPECT_TRUE(Contains(b.log, "loaded from disk")) << b.log;
  ExpectVerified(run, 1);
}

// A peer killed (-9) once the seed holds its fds, before the copy (the daemon's test seam holds
// the seed there): the fds keep the peer's memory, so the copy goes on from them, is checked
// like any fill, and our cache is served with the peer's bytes, not the disk's.
TEST_F(SeedTest, APeerKilledBeforeTheCopyLeavesItsMemoryToTheSeed) {
  if (!TestHooksBuilt()) GTEST_SKIP() << "needs the test hooks (WEIGHTCACHE_TEST_HOOKS=ON)";
  const std::string run = dir_.Join("run");
  const Served a = Serve(run, 0);
  ASSERT_EQ(a.exit_code, 0) << a.err << a.log;
  ASSERT_GT(a.pid, 0);
  const std::string fifo = dir_.Join("seed.fifo");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0) << errno;
  Served b;
  std::thread serve_b([&] {
    b = Serve(run, 1, {"--seed-from", "auto"}, {"WEIGHTCACHE_TEST_SEED_PAUSE_FIFO=" + fifo});
  });
  // Opening the FIFO's write end without blocking succeeds once B waits on its read end. No
  // ASSERT until the join: B's serve must always be let go.
  UniqueFd writer;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!writer && std::chrono::steady_clock::now() < until) {
    writer = UniqueFd(::open(fifo.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC));
    if (!writer) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_TRUE(writer) << "B never held the peer's fds";
  bool a_gone = false;
  if (writer) {
    EXPECT_EQ(::kill(a.pid, SIGKILL), 0) << errno;
    // A detached daemon is not our child: gone once the kernel no longer knows its pid.
    while (!a_gone && std::chrono::steady_clock::now() < until) {
      a_gone = ::kill(a.pid, 0) != 0 && errno == ESRCH;
      if (!a_gone) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    EXPECT_TRUE(a_gone) << "A (pid " << a.pid << ") outlived SIGKILL";
  }
  writer.Reset();  // B reads EOF and copies
  serve_b.join();
  ASSERT_TRUE(a_gone);
  ASSERT_EQ(b.exit_code, 0) << b.err << b.log;
  EXPECT_TRUE(Contains(b.log, "filled from the peer cache of " + FakeGpuUuid(0) + " (" + a.socket))
      << b.log;
  EXPECT_FALSE(Contains(b.log, "loading from disk")) << b.log;
  ExpectVerified(run, 1);
}

// An explicit socket reaches a cache of our exact identity anywhere, e.g. in another runtime
// dir on the same GPU (on the gpu tier: the same device's copy engines).
TEST_F(SeedTest, AnExplicitSocketSeedsFromAnotherRuntimeDir) {
  const Served a = Serve(dir_.Join("run-a"), 0);
  ASSERT_EQ(a.exit_code, 0) << a.err << a.log;
  const Served b = Serve(dir_.Join("run-b"), 0, {"--seed-from", a.socket});
  ASSERT_EQ(b.exit_code, 0) << b.err << b.log;
  EXPECT_TRUE(Contains(b.log, "filled from the peer cache of " + FakeGpuUuid(0))) << b.log;
  EXPECT_FALSE(Contains(b.log, "loading from disk")) << b.log;
  ExpectVerified(dir_.Join("run-b"), 0);
}

TEST_F(SeedTest, BadSeedFlagsAreUsageErrors) {
  const Served relative = Serve(dir_.Join("run"), 0, {"--seed-from", "disk"});
  EXPECT_EQ(relative.exit_code, 2);
  EXPECT_TRUE(Contains(relative.err,
                       "--seed-from: \"disk\" is neither \"auto\" nor an absolute "
                       "socket path"))
      << relative.err;
  const CommandResult launch = RunCommand(
      Command("launch", {"--runtime-dir", dir_.Join("run"), "--seed-from", "/run/x.sock"}));
  EXPECT_EQ(launch.exit_code, 2) << launch.err;
  EXPECT_TRUE(Contains(launch.err, "--seed-from")) << launch.err;
}

// The sharded case: a second TP=2 job of the same model on GPUs 2 and 3 seeds each rank from
// the first job's daemon of the same rank (GPUs 0 and 1): the digest holds the rank.
TEST_F(SeedTest, ASecondTp2JobSeedsEachRankFromTheFirstJobsSameRank) {
  const std::string run = dir_.Join("run");
  runtimes_.push_back(run);
  auto launch = [&](int base, std::vector<std::string> extra) {
    std::vector<std::string> argv = Command(
        "launch", {"--tp-size", "2", "--shard-rules", dir_.Join("rules.json"), "--base-gpu-id",
                   std::to_string(base), "--runtime-dir", run, "--threads", "2", "--ready-timeout",
                   "60", "--json", "--log-dir", dir_.Join("logs-" + std::to_string(base))});
    argv.insert(argv.end(), extra.begin(), extra.end());
    return RunCommand(argv, {"WEIGHTCACHE_LOG_LEVEL=info"});
  };
  const CommandResult first = launch(0, {});
  ASSERT_EQ(first.exit_code, 0) << first.err;
  const CommandResult second = launch(2, {"--seed-from", "auto"});
  ASSERT_EQ(second.exit_code, 0) << second.err;
  const auto summary = nlohmann::json::parse(second.out);
  ASSERT_EQ(summary["daemons"].size(), 2u) << second.out;
  for (const auto& d : summary["daemons"]) {
    const std::string log = ReadFile(d["log"].get<std::string>());
    const int tp_rank = d["tp_rank"].get<int>();
    SCOPED_TRACE("tp rank " + std::to_string(tp_rank));
    EXPECT_EQ(d["device_uuid"], FakeGpuUuid(2 + tp_rank)) << second.out;
    // Rank r's peer is the first job's rank r, on GPU r.
    EXPECT_TRUE(Contains(log, "filled from the peer cache of " + FakeGpuUuid(tp_rank))) << log;
    EXPECT_FALSE(Contains(log, "loading from disk")) << log;
  }
}

}  // namespace
}  // namespace weightcache::testing
