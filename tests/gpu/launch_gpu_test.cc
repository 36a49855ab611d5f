// `weightcache launch --tier gpu --tp 2` on two real GPUs: both daemons ready on GPU 0 and
// GPU 1 (by UUID, as the driver reports them), a client per rank attaches to its own GPU's
// daemon and verifies its bytes, and SIGTERM to the supervising launcher stops both cleanly.
// Skips (with the reason) without a driver or with fewer than two GPUs.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "gpu/gpu_e2e_support.h"
#include "launcher/child_process.h"
#include "support/test_env.h"

namespace weightcache::testing {
namespace {

using namespace std::chrono_literals;
using ::testing::HasSubstr;
using Clock = std::chrono::steady_clock;

constexpr char kModelId[] = "launch-e2e";

TEST(GpuLaunchTest, Tp2PlacesADaemonPerGpuClientsReachTheirOwnAndSigtermStopsBoth) {
  const GpuSetup& gpus = ProbeGpus();
  if (!gpus.skip_reason.empty()) GTEST_SKIP() << gpus.skip_reason;
  if (gpus.uuids.size() < 2) {
    GTEST_SKIP() << "needs 2 GPUs for --tp 2, the driver shows " << gpus.uuids.size();
  }
  TempDir dir;
  auto model = MakeModel(dir.Join("model"), 24, 2, 21, 1 << 18);
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  const std::string runtime = dir.Join("rt");

  launcher::SpawnOptions o;
  o.argv = {
      CliPath(),         "launch", "--model",      model->dir, "--model-id",    kModelId,
      "--tier",          "gpu",    "--tp",         "2",        "--runtime-dir", runtime,
      "--ready-timeout", "120",    "--stop-grace", "10",       "--json",        "--supervise"};
  o.log_path = dir.Join("launcher.out");
  auto launcher = launcher::ChildProcess::Spawn(o);
  ASSERT_TRUE(launcher.ok()) << launcher.status().ToString();

  const auto deadline = Clock::now() + 150s;
  while (Clock::now() < deadline &&
         ReadFile(o.log_path).find("2 daemons ready; supervising") == std::string::npos) {
    auto exit = launcher->TryReap();
    ASSERT_TRUE(exit.ok());
    ASSERT_FALSE(exit->has_value()) << "launcher exited: " << (*exit)->ToString() << "\n"
                                    << ReadFile(o.log_path);
    std::this_thread::sleep_for(50ms);
  }
  ASSERT_THAT(ReadFile(o.log_path), HasSubstr("2 daemons ready; supervising"));

  // Rank r's daemon is on local GPU r, found under that GPU's UUID, in state ready.
  std::vector<pid_t> daemon_pids;
  std::vector<std::string> sockets;
  for (int rank = 0; rank < 2; ++rank) {
    SCOPED_TRACE("tp_rank " + std::to_string(rank));
    std::vector<std::string> found = SocketsUnder(runtime, "default", gpus.uuids[rank]);
    ASSERT_EQ(found.size(), 1u) << "one daemon on GPU " << gpus.uuids[rank];
    auto st = StatusOf(found[0]);
    ASSERT_TRUE(st.ok()) << st.status().ToString();
    EXPECT_EQ(st->state, protocol::CacheState::kReady);
    EXPECT_EQ(st->tier, Tier::kGpu);
    EXPECT_EQ(st->device_uuid, gpus.uuids[rank]);
    EXPECT_EQ(st->model_id, kModelId);
    EXPECT_EQ(st->tensor_count, model->tensor_count);
    daemon_pids.push_back(static_cast<pid_t>(st->pid));
    sockets.push_back(found[0]);
  }
  ASSERT_NE(daemon_pids[0], daemon_pids[1]);

  // A client per rank, as that rank's engine: --device <rank>, its tp ranks; attach + verify
  // with the GPU checksum kernel, and the bytes against the reference reader.
  for (int rank = 0; rank < 2; ++rank) {
    SCOPED_TRACE("tp_rank " + std::to_string(rank));
    const std::vector<std::string> ranks = {"--tp-size", "2", "--tp-rank", std::to_string(rank)};
    std::vector<std::string> attach = {
        CliPath(),       "attach", "--model",      model->dir, "--model-id",
        kModelId,        "--tier", "gpu",          "--device", std::to_string(rank),
        "--runtime-dir", runtime,  "--on-missing", "error",    "--verify",
        "--json"};
    attach.insert(attach.end(), ranks.begin(), ranks.end());
    JsonRun r = RunJson(attach);
    ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
    EXPECT_EQ(r.json["source"], "daemon");
    EXPECT_EQ(r.json["device"], gpus.uuids[rank]);
    EXPECT_EQ(r.json["socket"], sockets[rank]);
    EXPECT_EQ(r.json["daemon_pid"].get<pid_t>(), daemon_pids[rank]);
    EXPECT_TRUE(r.json["verify"]["ok"].get<bool>()) << r.json.dump();
    EXPECT_EQ(r.json["verify"]["tensors"].get<size_t>(), model->tensor_count);

    // The same rank as an engine started with only its GPU visible (device 0 = GPU rank).
    std::vector<std::string> helper = {ClientHelperPath(),
                                       "--model",
                                       model->dir,
                                       "--model-id",
                                       kModelId,
                                       "--device",
                                       "0",
                                       "--runtime-dir",
                                       runtime,
                                       "--manifest",
                                       model->manifest_path,
                                       "--on-missing",
                                       "error"};
    helper.insert(helper.end(), ranks.begin(), ranks.end());
    JsonRun h = RunJson(helper, {"CUDA_VISIBLE_DEVICES=" + VisibleDevicesFor(rank)});
    ASSERT_EQ(h.exit_code, 0) << h.out << h.err;
    EXPECT_EQ(h.json["source"], "daemon") << h.json.dump();
    EXPECT_EQ(h.json["device"], gpus.uuids[rank]);
    EXPECT_EQ(h.json["daemon_pid"].get<pid_t>(), daemon_pids[rank]);
    EXPECT_TRUE(h.json["check"]["ok"].get<bool>()) << h.json.dump();
    EXPECT_EQ(h.json["check"]["tensors_checked"].get<size_t>(), model->tensor_count);
    EXPECT_EQ(h.json["check"]["bytes_checked"].get<uint64_t>(), model->total_bytes);
  }

  // SIGTERM stops both daemons cleanly; the launcher exits 0 and reports each one stopped.
  ASSERT_TRUE(launcher->Signal(SIGTERM).ok());
  auto exit = launcher->Wait();
  ASSERT_TRUE(exit.ok()) << exit.status().ToString();
  const std::string out = ReadFile(o.log_path);
  EXPECT_TRUE(exit->exited() && exit->exit_code == 0) << exit->ToString() << "\n" << out;
  const size_t brace = out.find('{');
  ASSERT_NE(brace, std::string::npos) << out;
  nlohmann::json j = nlohmann::json::parse(out.substr(brace), nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << out;
  EXPECT_EQ(j["stop_signal"], SIGTERM);
  ASSERT_EQ(j["daemons"].size(), 2u);
  std::set<std::string> uuids_seen;
  for (const auto& d : j["daemons"]) {
    const int rank = d["tp_rank"].get<int>();
    EXPECT_EQ(d["local_gpu_id"], rank);
    EXPECT_EQ(d["device_uuid"], gpus.uuids[rank]);
    EXPECT_EQ(d["pid"].get<pid_t>(), daemon_pids[rank]);
    EXPECT_EQ(d["state"], "stopped");
    EXPECT_EQ(d["exit"]["code"], 0) << "a daemon stopped by SIGTERM exits cleanly: " << d.dump();
    uuids_seen.insert(d["device_uuid"].get<std::string>());
  }
  EXPECT_EQ(uuids_seen.size(), 2u);
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_TRUE(SocketsUnder(runtime, "default", gpus.uuids[rank]).empty())
        << "a cleanly stopped daemon withdraws its socket";
  }
}

}  // namespace
}  // namespace weightcache::testing
