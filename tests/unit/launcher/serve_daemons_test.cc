// The real-daemon side of the launcher: command lines, log names, lock-based socket
// discovery and the stale sweep, on real files, real sockets and real flocks.
#include "launcher/serve_daemons.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "os/lock_file.h"
#include "os/unix_socket.h"
#include "support/test_env.h"

namespace weightcache::launcher {
namespace {

using weightcache::testing::TempDir;
using weightcache::testing::WriteFile;

constexpr const char* kGpu0 = "GPU-1a2b3c4d-0000-4000-8000-000000000000";
constexpr const char* kGpu2 = "GPU-5e6f7a8b-0000-4000-8000-000000000002";

bool Exists(const std::string& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0;
}

TEST(BuildDaemonSpecsTest, EachDaemonServesItsRanksOnItsGpuByUuid) {
  std::vector<DaemonPlacement> plan(2);
  plan[0] = {.tp_rank = 0, .pp_rank = 1, .ep_rank = 0, .local_gpu_id = 0, .device_uuid = kGpu0};
  plan[1] = {.tp_rank = 1, .pp_rank = 1, .ep_rank = 1, .local_gpu_id = 2, .device_uuid = kGpu2};
  ServeFlags flags;
  flags.identity.model_dir = "/models/llama";
  flags.identity.tier = Tier::kGpu;
  flags.identity.model_id = "llama";
  flags.identity.namespace_name = "jobA";
  flags.identity.runtime_dir = "/run/user/1000/weightcache";
  flags.identity.tp_size = 2;
  flags.identity.pp_size = 2;
  flags.identity.ep_size = 2;
  JobFiles files{.exe = "/opt/bin/weightcache", .log_dir = "/var/log/wc", .job = "llama"};
  auto specs = BuildDaemonSpecs(plan, flags, files);
  ASSERT_EQ(specs.size(), 2u);
  EXPECT_EQ(specs[1].name, "tp1-pp1");
  EXPECT_EQ(specs[1].spawn.argv, (std::vector<std::string>{"/opt/bin/weightcache",
                                                           "serve",
                                                           "--model",
                                                           "/models/llama",
                                                           "--tier",
                                                           "gpu",
                                                           "--device",
                                                           kGpu2,
                                                           "--tp-size",
                                                           "2",
                                                           "--tp-rank",
                                                           "1",
                                                           "--pp-size",
                                                           "2",
                                                           "--pp-rank",
                                                           "1",
                                                           "--ep-size",
                                                           "2",
                                                           "--ep-rank",
                                                           "1",
                                                           "--dp-size",
                                                           "1",
                                                           "--namespace",
                                                           "jobA",
                                                           "--runtime-dir",
                                                           "/run/user/1000/weightcache",
                                                           "--model-id",
                                                           "llama",
                                                           "--source",
                                                           "disk"}));
  EXPECT_EQ(specs[0].spawn.log_path, "/var/log/wc/llama-tp0-pp1-1a2b3c4d.log");
  EXPECT_EQ(specs[1].spawn.log_path, "/var/log/wc/llama-tp1-pp1-5e6f7a8b.log");
  // Paths are discovered from the running daemon.
  EXPECT_TRUE(specs[0].socket_path.empty());
}

// SPEC §5: launch applies every identity flag of serve to every daemon. Each field set to a
// non-default value must reach each daemon's command line with its serve flag; the ranks and
// device come from the placement, never from the job's options.
TEST(BuildDaemonSpecsTest, EveryIdentityFlagAndLoadFlagIsForwardedToEveryDaemon) {
  std::vector<DaemonPlacement> plan(2);
  plan[0] = {.tp_rank = 0, .pp_rank = 0, .ep_rank = 0, .local_gpu_id = 0, .device_uuid = kGpu0};
  plan[1] = {.tp_rank = 1, .pp_rank = 0, .ep_rank = 0, .local_gpu_id = 2, .device_uuid = kGpu2};
  ServeFlags flags;
  AttachOptions& id = flags.identity;
  id.model_dir = "/models/q";
  id.tier = Tier::kHost;
  id.model_id = "q-model";
  id.revision = "r7";
  id.dtype = "bf16";
  id.quantization = "fp8";
  id.quantization_config = "/cfg/quant.json";
  id.tp_size = 2;
  id.dp_size = 3;
  id.layout_tag = "fused-qkv";
  id.source = "published:sglang";
  id.namespace_name = "ns";
  id.runtime_dir = "/rt";
  id.device_inventory = "/inv.json";
  // Per-daemon or client-only: must not leak into the command line.
  id.tp_rank = 5;
  id.device = "7";
  id.socket = "/elsewhere/{device_uuid}.sock";
  flags.memory_budget = "20G";
  flags.threads = 4;
  JobFiles files{.exe = "/bin/wc", .log_dir = "/logs", .job = "q"};
  auto specs = BuildDaemonSpecs(plan, flags, files);
  ASSERT_EQ(specs.size(), 2u);
  for (size_t i = 0; i < specs.size(); ++i) {
    SCOPED_TRACE(i);
    const std::vector<std::string>& argv = specs[i].spawn.argv;
    ASSERT_GE(argv.size(), 2u);
    EXPECT_EQ(argv[1], "serve");
    ASSERT_EQ(argv.size() % 2, 0u) << "flags and values come in pairs";
    std::map<std::string, std::string> got;
    for (size_t a = 2; a + 1 < argv.size(); a += 2) {
      EXPECT_TRUE(got.emplace(argv[a], argv[a + 1]).second) << "repeated " << argv[a];
    }
    const std::map<std::string, std::string> want = {
        {"--model", "/models/q"},
        {"--tier", "host"},
        {"--device", plan[i].device_uuid},
        {"--tp-size", "2"},
        {"--tp-rank", std::to_string(plan[i].tp_rank)},
        {"--pp-size", "1"},
        {"--pp-rank", "0"},
        {"--ep-size", "1"},
        {"--ep-rank", "0"},
        {"--dp-size", "3"},
        {"--namespace", "ns"},
        {"--runtime-dir", "/rt"},
        {"--model-id", "q-model"},
        {"--revision", "r7"},
        {"--dtype", "bf16"},
        {"--quantization", "fp8"},
        {"--quantization-config", "/cfg/quant.json"},
        {"--layout-tag", "fused-qkv"},
        {"--source", "published:sglang"},
        {"--device-inventory", "/inv.json"},
        {"--memory-budget", "20G"},
        {"--threads", "4"},
    };
    EXPECT_EQ(got, want);
  }
}

TEST(LockPathForTest, SwapsTheSocketSuffix) {
  EXPECT_EQ(LockPathFor("/r/ns/GPU-x/0123456789abcdef.sock"), "/r/ns/GPU-x/0123456789abcdef.lock");
  EXPECT_EQ(LockPathFor("/tmp/custom"), "/tmp/custom.lock");
}

class NamespaceDirTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dev_dir_ = dir_.Join("ns/") + kGpu0;
    ASSERT_EQ(::mkdir(dir_.Join("ns").c_str(), 0700), 0);
    ASSERT_EQ(::mkdir(dev_dir_.c_str(), 0700), 0);
  }
  // A published socket (a real listening socket) and its lock file, locked or not.
  std::string Publish(const std::string& stem, std::optional<os::LockFile>* lock) {
    const std::string sock = dev_dir_ + "/" + stem + ".sock";
    if (lock != nullptr) {
      auto l = os::LockFile::TryAcquire(dev_dir_ + "/" + stem + ".lock");
      EXPECT_TRUE(l.ok()) << l.status().ToString();
      lock->emplace(std::move(l).value());
    } else {
      WriteFile(dev_dir_ + "/" + stem + ".lock", "999999\n");
    }
    auto fd = os::ListenUnix(sock);
    EXPECT_TRUE(fd.ok()) << fd.status().ToString();
    listeners_.push_back(std::move(fd).value());
    return sock;
  }
  TempDir dir_;
  std::string dev_dir_;
  std::vector<UniqueFd> listeners_;
};

TEST_F(NamespaceDirTest, SweepRemovesOnlySocketsWhoseLockIsFree) {
  std::optional<os::LockFile> held;
  const std::string live = Publish("aaaaaaaaaaaaaaaa", &held);
  const std::string stale = Publish("bbbbbbbbbbbbbbbb", nullptr);
  auto removed = SweepStaleSockets(dir_.path(), "ns");
  ASSERT_TRUE(removed.ok()) << removed.status().ToString();
  EXPECT_EQ(*removed, (std::vector<std::string>{stale}));
  EXPECT_TRUE(Exists(live));
  EXPECT_FALSE(Exists(stale));
  EXPECT_TRUE(Exists(LockPathFor(stale))) << "lock files are never unlinked";
  // Other namespaces are not ours to sweep.
  auto other = SweepStaleSockets(dir_.path(), "other-ns");
  ASSERT_TRUE(other.ok());
  EXPECT_TRUE(other->empty());
}

TEST_F(NamespaceDirTest, LocateFindsTheSocketWhoseHeldLockNamesThePid) {
  std::optional<os::LockFile> held;
  const std::string stale = Publish("bbbbbbbbbbbbbbbb", nullptr);  // names pid 999999, unlocked
  const std::string live = Publish("aaaaaaaaaaaaaaaa", &held);     // records our pid
  auto found = LocatePublishedSocket(dir_.path(), "ns", ::getpid());
  ASSERT_TRUE(found.has_value());
  EXPECT_EQ(found->socket, live);
  EXPECT_EQ(found->lock, LockPathFor(live));
  EXPECT_FALSE(LocatePublishedSocket(dir_.path(), "ns", 999999).has_value())
      << "a recorded owner without the flock is a previous holder";
  EXPECT_FALSE(LocatePublishedSocket(dir_.path(), "other-ns", ::getpid()).has_value());
  (void)stale;
}

TEST(LaunchSummaryJsonTest, CarriesEveryDaemonsIdentityAndOutcome) {
  LaunchReport r;
  r.status = Status(StatusCode::kTimeout, "daemons not ready after 2 s");
  r.failed_index = 0;
  DaemonSnapshot d;
  d.name = "tp0-pp0";
  d.placement.local_gpu_id = 4;
  d.placement.device_uuid = kGpu0;
  d.socket_path = "/r/ns/x.sock";
  d.log_path = "/r/ns/logs/j-tp0-pp0.log";
  d.pid = 1234;
  d.state = DaemonState::kStopped;
  d.bytes_done = 5;
  d.bytes_total = 10;
  d.seconds = 2.0;
  d.exit = ExitInfo{.exit_code = -1, .signal = 15};
  r.daemons.push_back(d);
  auto j = nlohmann::json::parse(LaunchSummaryJson(r, 6));
  EXPECT_EQ(j["status"], "timeout") << j.dump();
  EXPECT_EQ(j["exit_code"], 6);
  ASSERT_EQ(j["daemons"].size(), 1u);
  const auto& e = j["daemons"][0];
  EXPECT_EQ(e["device_uuid"], kGpu0);
  EXPECT_EQ(e["local_gpu_id"], 4);
  EXPECT_EQ(e["pid"], 1234);
  EXPECT_EQ(e["state"], "stopped");
  EXPECT_EQ(e["bytes_done"], 5);
  EXPECT_EQ(e["bytes_total"], 10);
  EXPECT_EQ(e["socket"], "/r/ns/x.sock");
  EXPECT_EQ(e["exit"]["signal"], 15);
  EXPECT_EQ(e["failed"], true);
}

}  // namespace
}  // namespace weightcache::launcher
