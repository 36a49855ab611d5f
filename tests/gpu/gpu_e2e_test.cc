// The gpu tier end to end (issue 4), on a real GPU with real processes: `weightcache serve
// --tier gpu` daemons, checkpoints written by the real safetensors library, and clients that
// are separate processes — gpu_client_helper (the C++ API, then every tensor read back with
// cuMemcpyDtoH and compared with the reference reader's SHA-256) and `weightcache attach
// --tier gpu --verify` (the GPU checksum kernel against the daemon's record).
//
//   * two clients on one GPU read identical, correct bytes; attach --verify passes;
//   * (2 GPUs) CUDA_VISIBLE_DEVICES=1 --device 0 finds GPU 1's daemon, not GPU 0's, although
//     both serve the same config;
//   * (2 GPUs) two jobs, same namespace, model and ranks, each with its tp_rank 0 on its own
//     GPU: each job's clients reach only their own daemon, and when one job's daemon is gone
//     its clients fall back rather than cross to the other job's;
//   * after `kill -9` of the daemon, attached clients still read and verify their weights;
//     a fresh client falls back to disk with correct bytes;
//   * a different revision on the gpu tier exits 4 naming the field.
//
// Skips (GTEST_SKIP, with the reason) without a driver, a GPU, VMM export, or a second GPU
// for the tests that need two.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "gpu/gpu_e2e_support.h"
#include "support/test_env.h"

namespace weightcache::testing {
namespace {

using namespace std::chrono_literals;
using ::testing::HasSubstr;

constexpr char kModelId[] = "e2e";
constexpr char kNamespace[] = "default";

// Asserts a Result and yields its value.
#define ASSERT_OK_AND_MOVE(lhs, expr)                                   \
  auto lhs##_result_ = (expr);                                          \
  ASSERT_TRUE(lhs##_result_.ok()) << lhs##_result_.status().ToString(); \
  auto lhs = std::move(lhs##_result_).value()

class GpuE2eTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const GpuSetup& gpus = ProbeGpus();
    if (!gpus.skip_reason.empty()) GTEST_SKIP() << gpus.skip_reason;
    uuids_ = gpus.uuids;
    // One checkpoint for the whole suite: 3 shards, every common dtype, up to 1 MiB tensors.
    if (model_ == nullptr) {
      static TempDir model_dir;  // removed at exit
      auto made = MakeModel(model_dir.Join("model"), 48, 3, 11, 1 << 18);
      ASSERT_TRUE(made.ok()) << made.status().ToString();
      model_ = new TestModel(*made);
    }
  }

  bool HasGpus(size_t n) const { return uuids_.size() >= n; }

  std::string runtime() const { return dir_.Join("rt"); }

  std::vector<std::string> ServeArgs(const std::string& device,
                                     std::vector<std::string> extra = {}) const {
    std::vector<std::string> a = {"--model",       model_->dir, "--model-id", kModelId,
                                  "--tier",        "gpu",       "--device",   device,
                                  "--runtime-dir", runtime(),   "--threads",  "4"};
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  }

  std::unique_ptr<Daemon> StartDaemon(const std::string& name, const std::string& device,
                                      std::vector<std::string> extra = {},
                                      std::vector<std::string> env = {}) {
    auto d = Daemon::Start(ServeArgs(device, std::move(extra)), env, dir_.Join(name + ".log"));
    EXPECT_TRUE(d.ok()) << d.status().ToString();
    return d.ok() ? std::move(d).value() : nullptr;
  }

  std::vector<std::string> HelperArgs(const std::string& device,
                                      std::vector<std::string> extra = {}) const {
    std::vector<std::string> a = {
        ClientHelperPath(),   "--model", model_->dir,     "--model-id", kModelId,
        "--device",           device,    "--runtime-dir", runtime(),    "--manifest",
        model_->manifest_path};
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  }

  std::vector<std::string> AttachArgs(const std::string& device,
                                      std::vector<std::string> extra = {}) const {
    std::vector<std::string> a = {CliPath(),       "attach",  "--model", model_->dir, "--model-id",
                                  kModelId,        "--tier",  "gpu",     "--device",  device,
                                  "--runtime-dir", runtime(), "--json",  "--verify"};
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  }

  // A helper client that stays attached (--hold); its first JSON line is the attach report.
  std::unique_ptr<PipedChild> SpawnHolder(const std::string& name, const std::string& device,
                                          std::vector<std::string> env = {}) {
    std::vector<std::string> args = HelperArgs(device, {"--hold"});
    auto c = PipedChild::Spawn(args, env, dir_.Join(name + ".err"));
    EXPECT_TRUE(c.ok()) << c.status().ToString();
    return c.ok() ? std::move(c).value() : nullptr;
  }

  // The helper's byte check: every tensor of the manifest, all bytes, SHA-256 equal.
  void ExpectBytesCorrect(const nlohmann::json& report) {
    ASSERT_TRUE(report.contains("check")) << report.dump();
    const nlohmann::json& check = report["check"];
    EXPECT_TRUE(check["ok"].get<bool>()) << check.dump();
    EXPECT_EQ(check["tensors_checked"].get<size_t>(), model_->tensor_count) << check.dump();
    EXPECT_EQ(check["bytes_checked"].get<uint64_t>(), model_->total_bytes) << check.dump();
  }

  // `weightcache attach --verify --json` on the gpu tier: the GPU checksum kernel over every
  // tensor agrees with the record (the daemon's, or the fallback loader's).
  void ExpectVerified(const JsonRun& r) {
    ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
    ASSERT_FALSE(r.json.is_discarded()) << r.out;
    EXPECT_EQ(r.json["tier"], "gpu");
    EXPECT_TRUE(r.json["verify"]["ok"].get<bool>()) << r.json.dump();
    EXPECT_EQ(r.json["verify"]["tensors"].get<size_t>(), model_->tensor_count);
    EXPECT_EQ(r.json["verify"]["bytes"].get<uint64_t>(), model_->total_bytes);
  }

  static TestModel* model_;
  std::vector<std::string> uuids_;
  TempDir dir_;
};

TestModel* GpuE2eTest::model_ = nullptr;

TEST_F(GpuE2eTest, TwoClientsOnOneGpuReadIdenticalCorrectBytesAndVerifyPasses) {
  auto daemon = StartDaemon("serve", uuids_[0]);
  ASSERT_NE(daemon, nullptr);
  protocol::StatusReply status;
  ASSERT_OK_AND_MOVE(socket, daemon->WaitReady(runtime(), kNamespace, uuids_[0], &status));
  EXPECT_EQ(status.tier, Tier::kGpu);
  EXPECT_EQ(status.device_uuid, uuids_[0]);
  EXPECT_EQ(status.tensor_count, model_->tensor_count);
  EXPECT_GE(status.bytes, model_->total_bytes) << "resident bytes cover every tensor";
  EXPECT_THAT(daemon->Log(), HasSubstr("ready: " + std::to_string(model_->tensor_count)));

  // Both clients attached at the same time, each in its own process and CUDA context.
  auto a = SpawnHolder("client-a", "0");
  auto b = SpawnHolder("client-b", "0");
  ASSERT_TRUE(a && b);
  ASSERT_OK_AND_MOVE(ja, a->ReadJson());
  ASSERT_OK_AND_MOVE(jb, b->ReadJson());
  for (const nlohmann::json* j : {&ja, &jb}) {
    ASSERT_EQ((*j)["event"], "attached") << j->dump();
    EXPECT_EQ((*j)["source"], "daemon") << j->dump();
    EXPECT_EQ((*j)["daemon_pid"].get<pid_t>(), daemon->pid());
    EXPECT_EQ((*j)["device"], uuids_[0]);
    EXPECT_EQ((*j)["socket"], socket);
    EXPECT_EQ((*j)["tensors"].get<size_t>(), model_->tensor_count);
    EXPECT_TRUE((*j)["pointer_ordinals_ok"].get<bool>()) << "tensors map on the client's GPU";
    ExpectBytesCorrect(*j);
  }
  EXPECT_EQ(ja["check"]["digest"], jb["check"]["digest"]) << "both clients read the same bytes";
  ASSERT_OK_AND_MOVE(held, StatusOf(socket));
  EXPECT_EQ(held.clients, 2u) << "both clients are connected while they hold";

  JsonRun verify = RunJson(AttachArgs("0", {"--on-missing", "error"}));
  ExpectVerified(verify);
  EXPECT_EQ(verify.json["source"], "daemon");
  EXPECT_EQ(verify.json["daemon_pid"].get<pid_t>(), daemon->pid());

  // The holders re-read after another client came and went: still correct.
  ASSERT_TRUE(a->WriteLine("again").ok());
  ASSERT_OK_AND_MOVE(again, a->ReadJson());
  EXPECT_EQ(again["event"], "recheck");
  EXPECT_TRUE(again["daemon_alive"].get<bool>());
  ExpectBytesCorrect(again);
  a->CloseStdin();
  b->CloseStdin();
  EXPECT_EQ(a->Wait(30s), 0) << a->StderrLog();
  EXPECT_EQ(b->Wait(30s), 0) << b->StderrLog();
  ASSERT_OK_AND_MOVE(code, daemon->Terminate());
  EXPECT_EQ(code, 0) << daemon->Log();
}

TEST_F(GpuE2eTest, CudaVisibleDevices1AndDevice0FindsGpu1sDaemonNotGpu0s) {
  // In the test body: GTEST_SKIP in a helper would return from the helper only, and the test
  // would go on to index a second GPU that is not there.
  if (!HasGpus(2)) GTEST_SKIP() << "needs 2 GPUs, the driver shows " << uuids_.size();
  // Same model, same ranks, same namespace and runtime dir: only the GPU differs.
  auto d0 = StartDaemon("serve-gpu0", uuids_[0]);
  auto d1 = StartDaemon("serve-gpu1", uuids_[1]);
  ASSERT_TRUE(d0 && d1);
  ASSERT_OK_AND_MOVE(socket0, d0->WaitReady(runtime(), kNamespace, uuids_[0], nullptr));
  ASSERT_OK_AND_MOVE(socket1, d1->WaitReady(runtime(), kNamespace, uuids_[1], nullptr));
  ASSERT_NE(socket0, socket1);
  EXPECT_THAT(socket1, HasSubstr("/" + uuids_[1] + "/"));

  const std::vector<std::string> only_gpu1 = {"CUDA_VISIBLE_DEVICES=" + VisibleDevicesFor(1)};
  auto client = SpawnHolder("client-gpu1", "0", only_gpu1);
  ASSERT_NE(client, nullptr);
  ASSERT_OK_AND_MOVE(j, client->ReadJson());
  ASSERT_EQ(j["event"], "attached") << j.dump();
  EXPECT_EQ(j["source"], "daemon") << j.dump();
  EXPECT_EQ(j["device"], uuids_[1]) << "local device 0 of this client is physical GPU 1";
  EXPECT_EQ(j["device_ordinal"], 0);
  EXPECT_EQ(j["socket"], socket1);
  EXPECT_EQ(j["daemon_pid"].get<pid_t>(), d1->pid()) << "GPU 0's daemon is " << d0->pid();
  EXPECT_TRUE(j["pointer_ordinals_ok"].get<bool>());
  ExpectBytesCorrect(j);

  JsonRun verify = RunJson(AttachArgs("0", {"--on-missing", "error"}), only_gpu1);
  ExpectVerified(verify);
  EXPECT_EQ(verify.json["device"], uuids_[1]);
  EXPECT_EQ(verify.json["socket"], socket1);
  EXPECT_EQ(verify.json["daemon_pid"].get<pid_t>(), d1->pid());

  // The control: without the restriction, --device 0 is GPU 0 and its daemon.
  JsonRun plain = RunJson(AttachArgs("0", {"--on-missing", "error"}));
  ExpectVerified(plain);
  EXPECT_EQ(plain.json["device"], uuids_[0]);
  EXPECT_EQ(plain.json["daemon_pid"].get<pid_t>(), d0->pid());
}

TEST_F(GpuE2eTest, TwoJobsEachWithItsOwnTpRank0NeverCross) {
  // In the test body: GTEST_SKIP in a helper would return from the helper only, and the test
  // would go on to index a second GPU that is not there.
  if (!HasGpus(2)) GTEST_SKIP() << "needs 2 GPUs, the driver shows " << uuids_.size();
  // Job A runs on physical GPU 0, job B on GPU 1, each seeing its GPU as device 0. Same
  // namespace, model, tp_size and tp_rank: the GPU UUID is the only thing that separates them.
  struct Job {
    std::string name;
    std::vector<std::string> env;
    std::string uuid;
    std::unique_ptr<Daemon> daemon;
    std::string socket;
  };
  std::vector<Job> jobs;
  jobs.push_back(
      {"job-a", {"CUDA_VISIBLE_DEVICES=" + VisibleDevicesFor(0)}, uuids_[0], nullptr, ""});
  jobs.push_back(
      {"job-b", {"CUDA_VISIBLE_DEVICES=" + VisibleDevicesFor(1)}, uuids_[1], nullptr, ""});
  const std::vector<std::string> ranks = {"--tp-size", "2", "--tp-rank", "0"};
  for (Job& job : jobs) {
    job.daemon = StartDaemon(job.name, "0", ranks, job.env);
    ASSERT_NE(job.daemon, nullptr);
  }
  for (Job& job : jobs) {
    protocol::StatusReply status;
    ASSERT_OK_AND_MOVE(socket, job.daemon->WaitReady(runtime(), kNamespace, job.uuid, &status));
    EXPECT_EQ(status.device_uuid, job.uuid) << job.name << "'s daemon serves its own GPU";
    job.socket = socket;
  }
  ASSERT_NE(jobs[0].socket, jobs[1].socket);

  for (Job& job : jobs) {
    SCOPED_TRACE(job.name);
    auto client = SpawnHolder(job.name + "-client", "0", job.env);
    ASSERT_NE(client, nullptr);
    ASSERT_OK_AND_MOVE(j, client->ReadJson());
    // A client without the ranks (tp 1/1) has a different config: the answer must be an
    // explicit mismatch against THIS job's daemon (the sibling search stays under this
    // job's GPU), never the other job's.
    ASSERT_EQ(j["event"], "error") << j.dump();
    EXPECT_EQ(j["code"], std::string(StatusCodeName(StatusCode::kMismatch))) << j.dump();
    EXPECT_THAT(j["message"].get<std::string>(),
                HasSubstr("pid " + std::to_string(job.daemon->pid())));
    EXPECT_THAT(j["message"].get<std::string>(), HasSubstr("tp_size"));

    auto ranked = PipedChild::Spawn(HelperArgs("0", ranks), job.env, dir_.Join(job.name + ".c2"));
    ASSERT_TRUE(ranked.ok()) << ranked.status().ToString();
    ASSERT_OK_AND_MOVE(r, (*ranked)->ReadJson());
    ASSERT_EQ(r["event"], "attached") << r.dump();
    EXPECT_EQ(r["source"], "daemon");
    EXPECT_EQ(r["device"], job.uuid);
    EXPECT_EQ(r["socket"], job.socket);
    EXPECT_EQ(r["daemon_pid"].get<pid_t>(), job.daemon->pid());
    ExpectBytesCorrect(r);

    std::vector<std::string> cli_extra = ranks;
    cli_extra.insert(cli_extra.end(), {"--on-missing", "error"});
    JsonRun verify = RunJson(AttachArgs("0", cli_extra), job.env);
    ExpectVerified(verify);
    EXPECT_EQ(verify.json["device"], job.uuid);
    EXPECT_EQ(verify.json["daemon_pid"].get<pid_t>(), job.daemon->pid());
  }

  // Job B's daemon goes away: job B's client must report "no daemon" for ITS GPU, not find
  // job A's daemon (which serves the very same config on the other GPU).
  ASSERT_OK_AND_MOVE(code, jobs[1].daemon->Terminate());
  EXPECT_EQ(code, 0) << jobs[1].daemon->Log();
  std::vector<std::string> cli_extra = ranks;
  cli_extra.insert(cli_extra.end(), {"--on-missing", "error"});
  JsonRun orphan = RunJson(AttachArgs("0", cli_extra), jobs[1].env);
  EXPECT_EQ(orphan.exit_code, 3) << orphan.out << orphan.err;
  EXPECT_THAT(orphan.err, HasSubstr("/" + uuids_[1] + "/")) << "names job B's own GPU path";
  EXPECT_THAT(orphan.err, ::testing::Not(HasSubstr(uuids_[0])));
}

TEST_F(GpuE2eTest, AttachedClientsSurviveKill9AndAFreshClientFallsBackToDisk) {
  auto daemon = StartDaemon("serve", uuids_[0]);
  ASSERT_NE(daemon, nullptr);
  ASSERT_OK_AND_MOVE(socket, daemon->WaitReady(runtime(), kNamespace, uuids_[0], nullptr));

  // Two holders: the helper (bytes vs the manifest) and the CLI (checksum kernel vs record).
  auto helper = SpawnHolder("holder", "0");
  ASSERT_NE(helper, nullptr);
  ASSERT_OK_AND_MOVE(attached, helper->ReadJson());
  ASSERT_EQ(attached["source"], "daemon") << attached.dump();
  ExpectBytesCorrect(attached);
  std::vector<std::string> hold_args = AttachArgs("0", {"--hold"});
  auto cli = PipedChild::Spawn(hold_args, {}, dir_.Join("cli-holder.err"));
  ASSERT_TRUE(cli.ok()) << cli.status().ToString();
  ASSERT_OK_AND_MOVE(summary, (*cli)->ReadJson());
  ASSERT_EQ(summary["source"], "daemon") << summary.dump();
  ASSERT_TRUE(summary["verify"]["ok"].get<bool>()) << summary.dump();

  ASSERT_TRUE(daemon->Kill9().ok());

  // The CLI holder's watcher reports the death; then it re-verifies over the same mapping.
  ASSERT_OK_AND_MOVE(gone, (*cli)->ReadLine(30s));
  EXPECT_EQ(gone, "daemon-gone");
  ASSERT_TRUE((*cli)->WriteLine("verify").ok());
  ASSERT_OK_AND_MOVE(reverified, (*cli)->ReadLine(60s));
  EXPECT_EQ(reverified, "verify ok alive=0") << (*cli)->StderrLog();

  ASSERT_TRUE(helper->WriteLine("read").ok());
  ASSERT_OK_AND_MOVE(after, helper->ReadJson());
  EXPECT_EQ(after["event"], "recheck");
  EXPECT_FALSE(after["daemon_alive"].get<bool>());
  ExpectBytesCorrect(after);

  // A fresh client: the socket is stale (its lock died with the daemon), so it loads from
  // disk itself, with the same bytes.
  auto fresh = PipedChild::Spawn(HelperArgs("0"), {}, dir_.Join("fresh.err"));
  ASSERT_TRUE(fresh.ok());
  ASSERT_OK_AND_MOVE(f, (*fresh)->ReadJson());
  ASSERT_EQ(f["event"], "attached") << f.dump();
  EXPECT_EQ(f["source"], "fallback") << f.dump();
  EXPECT_THAT(f["reason"].get<std::string>(), HasSubstr("stale socket " + socket));
  EXPECT_EQ(f["daemon_pid"], 0);
  EXPECT_TRUE(f["pointer_ordinals_ok"].get<bool>());
  ExpectBytesCorrect(f);
  EXPECT_EQ(f["check"]["digest"], attached["check"]["digest"]);

  JsonRun verify = RunJson(AttachArgs("0"));
  ExpectVerified(verify);
  EXPECT_EQ(verify.json["source"], "fallback");
  JsonRun strict = RunJson(AttachArgs("0", {"--on-missing", "error"}));
  EXPECT_EQ(strict.exit_code, 3) << strict.out << strict.err;
  EXPECT_THAT(strict.err, HasSubstr("stale socket " + socket));

  helper->CloseStdin();
  (*cli)->CloseStdin();
  EXPECT_EQ(helper->Wait(30s), 0) << helper->StderrLog();
  EXPECT_EQ((*cli)->Wait(30s), 0) << (*cli)->StderrLog();
}

TEST_F(GpuE2eTest, DifferentRevisionOnTheGpuTierExits4NamingTheField) {
  auto daemon = StartDaemon("serve", uuids_[0], {"--revision", "rev-a"});
  ASSERT_NE(daemon, nullptr);
  ASSERT_OK_AND_MOVE(socket, daemon->WaitReady(runtime(), kNamespace, uuids_[0], nullptr));

  JsonRun r = RunJson(AttachArgs("0", {"--revision", "rev-b"}));
  EXPECT_EQ(r.exit_code, 4) << r.out << r.err;
  EXPECT_THAT(r.err, HasSubstr("revision: ours="));
  EXPECT_THAT(r.err, HasSubstr("rev-b"));
  EXPECT_THAT(r.err, HasSubstr("rev-a"));
  EXPECT_THAT(r.err, HasSubstr(socket)) << "names the daemon that holds the other config";
  EXPECT_TRUE(r.out.empty()) << "a mismatch is never a silent fallback: " << r.out;

  // The same through the C++ API in its own process: kMismatch, not a fallback.
  auto client =
      PipedChild::Spawn(HelperArgs("0", {"--revision", "rev-b"}), {}, dir_.Join("client.err"));
  ASSERT_TRUE(client.ok());
  ASSERT_OK_AND_MOVE(j, (*client)->ReadJson());
  EXPECT_EQ(j["event"], "error") << j.dump();
  EXPECT_EQ(j["code"], std::string(StatusCodeName(StatusCode::kMismatch))) << j.dump();
  EXPECT_THAT(j["message"].get<std::string>(), HasSubstr("revision"));
  EXPECT_EQ((*client)->Wait(30s), 1);
}

}  // namespace
}  // namespace weightcache::testing
