// The gpu tier's crash survival (docs/keeper.md) on a real GPU: `serve --tier gpu` deposits its
// exported VMM fds with its keeper at ready; an engine (gpu_client_helper) attaches and holds
// its tensors; the daemon is killed with SIGKILL; a new `serve` re-adopts the kept allocations
// — every withdrawn fd imported and every tensor checksummed by the GPU kernel
// (`--adopt-verify full`) — and is ready without reading the checkpoint (its /proc/PID/io
// rchar stays under a quarter of the tensor bytes, where a load reads them all). The holder's
// bytes stay correct, a second engine attaches to the adopted cache and reads the same bytes,
// and `attach --verify` runs the kernel over every tensor again. The time to ready is printed
// ("keeper_gpu_test: adopted ready in … s") for docs/benchmarks.md.
#include <gtest/gtest.h>

#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "gpu/gpu_e2e_support.h"
#include "identity/paths.h"
#include "os/lock_file.h"
#include "support/test_env.h"

namespace weightcache::testing {
namespace {

using namespace std::chrono_literals;

constexpr char kModelId[] = "keeper-gpu";
constexpr char kNamespace[] = "default";

#define ASSERT_OK_AND_MOVE(lhs, expr)                                   \
  auto lhs##_result_ = (expr);                                          \
  ASSERT_TRUE(lhs##_result_.ok()) << lhs##_result_.status().ToString(); \
  auto lhs = std::move(lhs##_result_).value()

class KeeperGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const GpuSetup& gpus = ProbeGpus();
    if (!gpus.skip_reason.empty()) GTEST_SKIP() << gpus.skip_reason;
    uuid_ = gpus.uuids[0];
    auto made = MakeModel(dir_.Join("model"), 48, 3, 11, 1 << 18);
    ASSERT_TRUE(made.ok()) << made.status().ToString();
    model_ = *made;
  }
  std::string runtime() const { return dir_.Join("rt"); }
  std::unique_ptr<Daemon> Serve(const std::string& name, std::vector<std::string> extra = {}) {
    std::vector<std::string> a = {"--model",       model_.dir, "--model-id", kModelId,
                                  "--tier",        "gpu",      "--device",   uuid_,
                                  "--runtime-dir", runtime(),  "--threads",  "4"};
    a.insert(a.end(), extra.begin(), extra.end());
    auto d = Daemon::Start(a, {}, dir_.Join(name + ".log"));
    EXPECT_TRUE(d.ok()) << d.status().ToString();
    return d.ok() ? std::move(d).value() : nullptr;
  }
  std::vector<std::string> Helper(std::vector<std::string> extra = {}) const {
    std::vector<std::string> a = {
        ClientHelperPath(), "--model", model_.dir,   "--model-id",        kModelId, "--device", "0",
        "--runtime-dir",    runtime(), "--manifest", model_.manifest_path};
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  }
  void ExpectBytesCorrect(const nlohmann::json& report) {
    ASSERT_TRUE(report.contains("check")) << report.dump();
    EXPECT_TRUE(report["check"]["ok"].get<bool>()) << report.dump();
    EXPECT_EQ(report["check"]["tensors_checked"].get<size_t>(), model_.tensor_count);
    EXPECT_EQ(report["check"]["bytes_checked"].get<uint64_t>(), model_.total_bytes);
  }

  // The engine that held its tensors (`holder`, which attached as `attached`) still reads
  // correct bytes, and a second engine attaches to the cache now served and reads the same.
  void ExpectHolderAndAFreshEngineRead(PipedChild& holder, const nlohmann::json& attached) {
    ASSERT_TRUE(holder.WriteLine("read").ok());
    ASSERT_OK_AND_MOVE(after, holder.ReadJson());
    ExpectBytesCorrect(after);
    auto fresh = PipedChild::Spawn(Helper(), {}, dir_.Join("fresh.err"));
    ASSERT_TRUE(fresh.ok());
    ASSERT_OK_AND_MOVE(f, (*fresh)->ReadJson());
    EXPECT_EQ(f["source"], "daemon") << f.dump();
    ExpectBytesCorrect(f);
    EXPECT_EQ(f["check"]["digest"], attached["check"]["digest"]);
  }

  TempDir dir_;
  // A fresh client process attaches with --verify: served by the daemon, every tensor's
  // checksum recomputed over the device memory and equal to the manifest's.
  void ExpectAFreshAttachVerifiesEveryTensor() {
    JsonRun verify =
        RunJson({CliPath(), "attach", "--model", model_.dir, "--model-id", kModelId, "--tier",
                 "gpu", "--device", "0", "--runtime-dir", runtime(), "--json", "--verify"});
    ASSERT_EQ(verify.exit_code, 0) << verify.out << verify.err;
    EXPECT_EQ(verify.json["source"], "daemon");
    EXPECT_TRUE(verify.json["verify"]["ok"].get<bool>()) << verify.json.dump();
    EXPECT_EQ(verify.json["verify"]["tensors"].get<size_t>(), model_.tensor_count);
  }

  TestModel model_;
  std::string uuid_;
};

TEST_F(KeeperGpuTest, Kill9WithAnEngineAttachedThenRestartReadoptsVerifiedWithoutReading) {
  auto first = Serve("first");
  ASSERT_NE(first, nullptr);
  ASSERT_OK_AND_MOVE(socket, first->WaitReady(runtime(), kNamespace, uuid_, nullptr));
  EXPECT_NE(first->Log().find("deposited with the keeper"), std::string::npos) << first->Log();

  auto holder = PipedChild::Spawn(Helper({"--hold"}), {}, dir_.Join("holder.err"));
  ASSERT_TRUE(holder.ok()) << holder.status().ToString();
  ASSERT_OK_AND_MOVE(attached, (*holder)->ReadJson());
  ASSERT_EQ(attached["source"], "daemon") << attached.dump();
  ExpectBytesCorrect(attached);

  ASSERT_TRUE(first->Kill9().ok());

  auto second = Serve("second", {"--adopt-verify", "full"});
  ASSERT_NE(second, nullptr);
  ASSERT_OK_AND_MOVE(again, second->WaitReady(runtime(), kNamespace, uuid_, nullptr));
  EXPECT_EQ(again, socket);
  const std::string log = second->Log();
  const size_t ready = log.find("ready: adopted");
  ASSERT_NE(ready, std::string::npos) << log;
  EXPECT_NE(
      log.find("checksums of all " + std::to_string(model_.tensor_count) + " tensors verified"),
      std::string::npos)
      << log;
  std::cout << "keeper_gpu_test: " << log.substr(ready, log.find('\n', ready) - ready) << std::endl;
  EXPECT_LT(ProcessReadChars(second->pid()), model_.total_bytes / 4) << log;

  // The engine that held its tensors through the crash still reads correct bytes; a second
  // engine attaches to the adopted cache and reads the same.
  ExpectHolderAndAFreshEngineRead(**holder, attached);
  if (HasFatalFailure()) return;
  ExpectAFreshAttachVerifiesEveryTensor();
  if (HasFatalFailure()) return;

  // A deliberate stop frees the kept memory: the keeper exits.
  ASSERT_OK_AND_MOVE(code, second->Terminate());
  EXPECT_EQ(code, 0);
  const std::string keeper_lock = identity::LockPathFor(identity::KeeperSocketFor(socket));
  EXPECT_FALSE(os::IsLockHeld(keeper_lock));
  (*holder)->CloseStdin();
  EXPECT_EQ((*holder)->Wait(30s), 0) << (*holder)->StderrLog();
}

// `--adopt-verify behind` on a real GPU: the restart is ready on the kept allocations before
// any CUDA context of its own, then imports them and runs the checksum kernel over every
// tensor; an engine attached meanwhile reads correct bytes.
TEST_F(KeeperGpuTest, Kill9ThenRestartWithAdoptVerifyBehindIsReadyThenVerifiesOnTheGpu) {
  auto first = Serve("first");
  ASSERT_NE(first, nullptr);
  ASSERT_OK_AND_MOVE(socket, first->WaitReady(runtime(), kNamespace, uuid_, nullptr));
  ASSERT_TRUE(first->Kill9().ok());

  auto second = Serve("second", {"--adopt-verify", "behind"});
  ASSERT_NE(second, nullptr);
  ASSERT_OK_AND_MOVE(again, second->WaitReady(runtime(), kNamespace, uuid_, nullptr));
  EXPECT_EQ(again, socket);
  const std::string all = "all " + std::to_string(model_.tensor_count) + " tensors";
  const auto deadline = std::chrono::steady_clock::now() + 30s;
  while (second->Log().find("verified behind ready") == std::string::npos &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  const std::string log = second->Log();
  const size_t ready = log.find("ready: adopted");
  ASSERT_NE(ready, std::string::npos) << log;
  EXPECT_NE(log.find("checksums of " + all + " to be checked behind ready ("), std::string::npos)
      << log;
  const size_t behind =
      log.find("the adopted memory is verified behind ready: checksums of " + all);
  ASSERT_NE(behind, std::string::npos) << log;
  std::cout << "keeper_gpu_test: " << log.substr(ready, log.find('\n', ready) - ready) << "\n"
            << "keeper_gpu_test: " << log.substr(behind, log.find('\n', behind) - behind)
            << std::endl;
  EXPECT_LT(ProcessReadChars(second->pid()), model_.total_bytes / 4) << log;
  ExpectAFreshAttachVerifiesEveryTensor();
  if (HasFatalFailure()) return;
  ASSERT_OK_AND_MOVE(code, second->Terminate());
  EXPECT_EQ(code, 0);
}

// The upgrade handover (docs/upgrade.md) on a real GPU: `weightcache upgrade` starts a
// successor (this build's binary), which imports every handed-over VMM fd, runs the checksum
// kernel over every tensor (`--adopt-verify full`, inherited from the old daemon's command
// line), renames its socket into place and serves without reading the checkpoint. The engine
// attached to the old daemon keeps correct bytes; a new engine attaches to the successor. The
// handover time and the successor's ready line are printed for docs/benchmarks.md.
TEST_F(KeeperGpuTest, UpgradeWithAnEngineAttachedHandsOverVerifiedWithoutReading) {
  auto old = Serve("old", {"--adopt-verify", "full"});
  ASSERT_NE(old, nullptr);
  ASSERT_OK_AND_MOVE(socket, old->WaitReady(runtime(), kNamespace, uuid_, nullptr));
  auto holder = PipedChild::Spawn(Helper({"--hold"}), {}, dir_.Join("holder.err"));
  ASSERT_TRUE(holder.ok()) << holder.status().ToString();
  ASSERT_OK_AND_MOVE(attached, (*holder)->ReadJson());
  ASSERT_EQ(attached["source"], "daemon") << attached.dump();

  JsonRun up = RunJson({CliPath(), "upgrade", "--socket", socket, "--json"});
  ASSERT_EQ(up.exit_code, 0) << up.out << up.err << old->Log();
  const pid_t successor = up.json["successor_pid"].get<pid_t>();
  std::cout << "keeper_gpu_test: upgrade handover "
            << up.json["handover_us"].get<uint64_t>() / 1000.0
            << " ms (successor start to HandoverDone)" << std::endl;
  const std::optional<int> code = old->child().WaitExit(30s);  // it exits by itself
  ASSERT_TRUE(code.has_value()) << old->Log();
  EXPECT_EQ(*code, 0) << old->Log();
  const std::string log = old->Log();  // the successor writes to the same log
  const size_t ready = log.find("ready: adopted");
  ASSERT_NE(ready, std::string::npos) << log;
  EXPECT_NE(log.find("handed over by pid " + std::to_string(old->pid())), std::string::npos) << log;
  EXPECT_NE(
      log.find("checksums of all " + std::to_string(model_.tensor_count) + " tensors verified"),
      std::string::npos)
      << log;
  std::cout << "keeper_gpu_test: " << log.substr(ready, log.find('\n', ready) - ready) << std::endl;
  EXPECT_LT(ProcessReadChars(successor), model_.total_bytes / 4) << log;

  ExpectHolderAndAFreshEngineRead(**holder, attached);
  if (HasFatalFailure()) return;

  JsonRun stop = RunJson({CliPath(), "stop", "--socket", socket});
  EXPECT_EQ(stop.exit_code, 0) << stop.err;
  (*holder)->CloseStdin();
  EXPECT_EQ((*holder)->Wait(30s), 0) << (*holder)->StderrLog();
}

}  // namespace
}  // namespace weightcache::testing
