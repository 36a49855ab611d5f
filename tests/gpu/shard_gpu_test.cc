// The gpu tier of a sharded job on a real GPU (issue 12): `weightcache serve --tier gpu` for
// TP=2 ranks 0 and 1 of a Llama checkpoint (written by the safetensors library, with a
// config.json: the built-in llama rules), each rank attached by gpu_client_helper (a separate
// process, the public C++ API) that copies every tensor back with cuMemcpyDtoH and compares
// its SHA-256 with the held bytes this test reads from the file by the rank's plan
// (sharding::PlanShard + ReadHeldBytes). Each daemon's resident GPU memory is about its held
// bytes, half the checkpoint, not the whole of it. With the daemons gone, the client's disk
// fallback uploads the same slices.
//
// Skips (GTEST_SKIP, with the reason) without a driver, a GPU or VMM export.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "common/hash.h"
#include "gpu/gpu_e2e_support.h"
#include "sharding/gather.h"
#include "sharding/model_config.h"
#include "sharding/planner.h"
#include "sharding/rules.h"
#include "support/test_env.h"

namespace weightcache::testing {
namespace {

using namespace std::chrono_literals;

constexpr char kModelId[] = "shard";
constexpr char kNamespace[] = "default";

// Asserts a Result and yields its value.
#define ASSERT_OK_AND_MOVE(lhs, expr)                                   \
  auto lhs##_result_ = (expr);                                          \
  ASSERT_TRUE(lhs##_result_.ok()) << lhs##_result_.status().ToString(); \
  auto lhs = std::move(lhs##_result_).value()

// A Llama of 2 layers, hidden 1024, 16 heads and 8 kv heads of 64, intermediate 4096, vocab
// 8192, bf16: about 92 MiB, so that a rank's half differs from the whole by far more than the
// VMM granularity (2 MiB) the arena rounds to.
constexpr uint64_t kLayers = 2, kHidden = 1024, kHeads = 16, kKvHeads = 8, kHeadDim = 64,
                   kIntermediate = 4096, kVocab = 8192;

nlohmann::json Spec() {
  nlohmann::json spec = nlohmann::json::array();
  auto add = [&](const std::string& name, std::vector<uint64_t> shape) {
    spec.push_back({{"name", name}, {"shape", shape}, {"dtype", "bf16"}});
  };
  add("model.embed_tokens.weight", {kVocab, kHidden});
  for (uint64_t i = 0; i < kLayers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    add(p + "self_attn.q_proj.weight", {kHeads * kHeadDim, kHidden});
    add(p + "self_attn.k_proj.weight", {kKvHeads * kHeadDim, kHidden});
    add(p + "self_attn.v_proj.weight", {kKvHeads * kHeadDim, kHidden});
    add(p + "self_attn.o_proj.weight", {kHidden, kHeads * kHeadDim});
    add(p + "input_layernorm.weight", {kHidden});
    add(p + "post_attention_layernorm.weight", {kHidden});
    add(p + "mlp.gate_proj.weight", {kIntermediate, kHidden});
    add(p + "mlp.up_proj.weight", {kIntermediate, kHidden});
    add(p + "mlp.down_proj.weight", {kHidden, kIntermediate});
  }
  add("model.norm.weight", {kHidden});
  add("lm_head.weight", {kVocab, kHidden});
  return spec;
}

// What one rank holds, from the plan: its tensor count, held bytes, and the reference
// manifest (make_checkpoint.py's format: name -> sha256, nbytes of the held bytes).
struct RankReference {
  size_t tensors = 0;
  uint64_t bytes = 0;
  std::string manifest_path;
};

class GpuShardTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const GpuSetup& gpus = ProbeGpus();
    if (!gpus.skip_reason.empty()) GTEST_SKIP() << gpus.skip_reason;
    uuids_ = gpus.uuids;
    model_ = dir_.Join("llama");
    const std::string spec = dir_.Join("spec.json");
    WriteFile(spec, Spec().dump());
    auto made = RunCommand({PythonExe(), SourceDir() + "/tests/tools/make_checkpoint.py", "--out",
                            model_, "--spec", spec, "--shards", "2"});
    ASSERT_EQ(made.exit_code, 0) << made.err;
    const nlohmann::json config = {
        {"model_type", "llama"},         {"num_hidden_layers", kLayers},
        {"num_attention_heads", kHeads}, {"num_key_value_heads", kKvHeads},
        {"hidden_size", kHidden},        {"vocab_size", kVocab},
        {"tie_word_embeddings", false}};
    WriteFile(model_ + "/config.json", config.dump());
  }

  std::string runtime() const { return dir_.Join("rt"); }

  // The rank's plan of the checkpoint (built-in llama rules), its held bytes read from the
  // file and hashed into a reference manifest.
  void Reference(uint32_t rank, RankReference* out, uint64_t* checkpoint_bytes) {
    ASSERT_OK_AND_MOVE(ckpt, checkpoint::Checkpoint::Open(model_));
    ASSERT_OK_AND_MOVE(config, sharding::ReadModelConfig(model_));
    ASSERT_OK_AND_MOVE(rules, sharding::SelectRuleSet("", config.model_type));
    ASSERT_OK_AND_MOVE(plan,
                       sharding::PlanShard(ckpt, rules, config, {.tp_size = 2, .tp_rank = rank}));
    nlohmann::json tensors = nlohmann::json::object();
    std::unique_ptr<uint8_t[]> stage;
    for (const sharding::PlannedTensor& p : plan.tensors) {
      std::string held(p.bytes, '\0');
      Status read = sharding::ReadHeldBytes(ckpt, *p.tensor, p.copy, 0, p.bytes,
                                            reinterpret_cast<uint8_t*>(held.data()), stage);
      ASSERT_TRUE(read.ok()) << read.ToString();
      tensors[p.tensor->name] = {{"sha256", Sha256Hex(held)}, {"nbytes", p.bytes}};
    }
    out->tensors = plan.tensors.size();
    out->bytes = plan.bytes;
    out->manifest_path = dir_.Join("rank" + std::to_string(rank) + ".manifest.json");
    WriteFile(out->manifest_path, nlohmann::json({{"tensors", tensors}}).dump());
    *checkpoint_bytes = ckpt.total_bytes();
  }

  std::vector<std::string> RankArgs(uint32_t rank) const {
    return {"--model-id", kModelId, "--runtime-dir", runtime(),
            "--tp-size",  "2",      "--tp-rank",     std::to_string(rank)};
  }

  // gpu_client_helper attached as `rank`, every tensor read back and checked; its report.
  nlohmann::json AttachAndCheck(uint32_t rank, const RankReference& ref,
                                const std::string& on_missing) {
    std::vector<std::string> argv = {
        ClientHelperPath(), "--model",         model_,         "--device", "0",
        "--manifest",       ref.manifest_path, "--on-missing", on_missing};
    for (const std::string& a : RankArgs(rank)) argv.push_back(a);
    JsonRun r = RunJson(argv);
    EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
    EXPECT_FALSE(r.json.is_discarded()) << r.out << r.err;
    return r.json;
  }

  void ExpectHeldBytesCorrect(const nlohmann::json& report, const RankReference& ref) {
    ASSERT_EQ(report["event"], "attached") << report.dump();
    EXPECT_EQ(report["tensors"].get<size_t>(), ref.tensors) << report.dump();
    const nlohmann::json& check = report["check"];
    EXPECT_TRUE(check["ok"].get<bool>()) << check.dump();
    EXPECT_EQ(check["tensors_checked"].get<size_t>(), ref.tensors) << check.dump();
    EXPECT_EQ(check["bytes_checked"].get<uint64_t>(), ref.bytes) << check.dump();
  }

  std::vector<std::string> uuids_;
  TempDir dir_;
  std::string model_;
};

TEST_F(GpuShardTest, Tp2RanksHoldOnlyTheirSlicesOnTheGpuAndTheFallbackLoadsTheSame) {
  RankReference refs[2];
  uint64_t checkpoint_bytes = 0;
  for (uint32_t rank : {0u, 1u}) {
    Reference(rank, &refs[rank], &checkpoint_bytes);
    if (HasFatalFailure()) return;
    ASSERT_LT(refs[rank].bytes, checkpoint_bytes * 6 / 10) << "a rank holds about half";
  }

  std::unique_ptr<Daemon> daemons[2];
  for (uint32_t rank : {0u, 1u}) {
    std::vector<std::string> args = {"--model",  model_,    "--tier",    "gpu",
                                     "--device", uuids_[0], "--threads", "4"};
    for (const std::string& a : RankArgs(rank)) args.push_back(a);
    ASSERT_OK_AND_MOVE(d,
                       Daemon::Start(args, {}, dir_.Join("serve" + std::to_string(rank) + ".log")));
    daemons[rank] = std::move(d);
  }
  for (uint32_t rank : {0u, 1u}) {
    SCOPED_TRACE("tp rank " + std::to_string(rank));
    protocol::StatusReply status;
    ASSERT_OK_AND_MOVE(socket, daemons[rank]->WaitReady(runtime(), kNamespace, uuids_[0], &status));
    EXPECT_EQ(status.tier, Tier::kGpu);
    EXPECT_EQ(status.tensor_count, refs[rank].tensors);
    // The arena: the held bytes, each tensor 256-byte aligned, rounded up to the granularity
    // (2 MiB) per allocation; nowhere near the whole checkpoint.
    EXPECT_GE(status.bytes, refs[rank].bytes);
    EXPECT_LT(status.bytes, refs[rank].bytes + (uint64_t{4} << 20)) << "resident bytes";
    EXPECT_LT(status.bytes, checkpoint_bytes * 6 / 10);

    const nlohmann::json report = AttachAndCheck(rank, refs[rank], "error");
    ExpectHeldBytesCorrect(report, refs[rank]);
    EXPECT_EQ(report["source"], "daemon") << report.dump();
    EXPECT_EQ(report["daemon_pid"].get<pid_t>(), daemons[rank]->pid());
    EXPECT_EQ(report["socket"], socket);
    EXPECT_TRUE(report["pointer_ordinals_ok"].get<bool>());
  }
  for (uint32_t rank : {0u, 1u}) {
    ASSERT_OK_AND_MOVE(code, daemons[rank]->Terminate());
    EXPECT_EQ(code, 0) << daemons[rank]->Log();
  }

  // No daemon: the client's gpu-tier fallback plans the same and uploads the same slices.
  for (uint32_t rank : {0u, 1u}) {
    SCOPED_TRACE("fallback, tp rank " + std::to_string(rank));
    const nlohmann::json report = AttachAndCheck(rank, refs[rank], "fallback");
    ExpectHeldBytesCorrect(report, refs[rank]);
    EXPECT_NE(report["source"], "daemon") << report.dump();
  }
}

}  // namespace
}  // namespace weightcache::testing
