// `weightcache shard-plan` through the real binary on real checkpoints: the JSON shape of the
// contract, checkpoint order, the digest (recomputed by Python), and the exit codes.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "checkpoint/checkpoint.h"
#include "support/test_env.h"
#include "unit/sharding/sharding_fixture.h"

namespace weightcache::sharding {
namespace {

using ::testing::AllOf;
using testing::DenseModel;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using weightcache::testing::CliPath;
using weightcache::testing::CommandResult;
using weightcache::testing::PythonExe;
using weightcache::testing::RunCommand;
using weightcache::testing::WriteFile;

class ShardPlanCliTest : public testing::ShardingFixture {
 protected:
  static CommandResult Cli(std::vector<std::string> args) {
    args.insert(args.begin(), {CliPath(), "shard-plan"});
    return RunCommand(args);
  }
};

TEST_F(ShardPlanCliTest, JsonPlanHasTheContractShapeInCheckpointOrder) {
  DenseModel m;
  const std::string dir = Make("llama", m.Tensors(), m.Config(), 3);
  const CommandResult r = Cli({"--model", dir, "--tp-size", "2", "--tp-rank", "1", "--pp-size", "2",
                               "--pp-rank", "1", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["model_type"], "llama");
  EXPECT_EQ(j["rules"]["name"], "llama");
  EXPECT_EQ(j["rules"]["source"], "builtin");
  EXPECT_EQ(j["rules"]["digest"].get<std::string>().size(), 64u);
  EXPECT_EQ(j["tp_size"], 2);
  EXPECT_EQ(j["tp_rank"], 1);
  EXPECT_EQ(j["pp_size"], 2);
  EXPECT_EQ(j["pp_rank"], 1);
  EXPECT_EQ(j["ep_size"], 1);
  EXPECT_EQ(j["ep_rank"], 0);
  std::vector<std::string> keys;
  for (const auto& [k, v] : j.items()) keys.push_back(k);
  std::sort(keys.begin(), keys.end());
  EXPECT_THAT(keys, ElementsAre("bytes", "ep_rank", "ep_size", "full_bytes", "model_type",
                                "pp_rank", "pp_size", "rules", "tensors", "tp_rank", "tp_size"));

  Result<checkpoint::Checkpoint> c = checkpoint::Checkpoint::Open(dir);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(j["full_bytes"].get<uint64_t>(), c->total_bytes());
  // Stage 1 of 2 holds layer 1, the final norm and the lm_head; in checkpoint order.
  std::vector<std::pair<uint32_t, uint64_t>> positions;
  uint64_t bytes = 0;
  bool saw_q = false;
  for (const auto& t : j["tensors"]) {
    const std::string name = t["name"];
    EXPECT_TRUE(name.starts_with("model.layers.1.") || name == "model.norm.weight" ||
                name == "lm_head.weight")
        << name;
    const checkpoint::TensorInfo* info = c->Find(name);
    ASSERT_NE(info, nullptr) << name;
    positions.emplace_back(info->shard, info->offset);
    EXPECT_EQ(t["dtype"], "BF16");
    EXPECT_EQ(t["full_shape"], info->shape);
    uint64_t elements = 1;
    for (uint64_t d : t["shape"].get<std::vector<uint64_t>>()) elements *= d;
    bytes += elements * 2;
    if (name == "model.layers.1.self_attn.q_proj.weight") {
      saw_q = true;
      EXPECT_EQ(t["shape"], nlohmann::json({32, 64}));
      EXPECT_EQ(t["slice"], nlohmann::json({{"dim", 0}, {"offset", 32}, {"length", 32}}));
      EXPECT_EQ(t["rule"], 1);
      EXPECT_EQ(t["mode"], "split");
    }
    if (name == "model.norm.weight") {
      EXPECT_TRUE(t["slice"].is_null());
      EXPECT_EQ(t["mode"], "replicate");
    }
  }
  EXPECT_TRUE(saw_q);
  EXPECT_TRUE(std::is_sorted(positions.begin(), positions.end()));
  EXPECT_EQ(j["bytes"].get<uint64_t>(), bytes);

  // The text table names the same tensors.
  const CommandResult text = Cli({"--model", dir, "--tp-size", "2", "--tp-rank", "1"});
  ASSERT_EQ(text.exit_code, 0) << text.err;
  EXPECT_THAT(text.out,
              AllOf(HasSubstr("rules:       llama (builtin, digest "),
                    HasSubstr("model.layers.0.self_attn.q_proj.weight"), HasSubstr("0:32+32")));
}

TEST_F(ShardPlanCliTest, PrintedRulesSavedToAFileHaveTheSameDigestAsPythonComputes) {
  DenseModel m;
  const std::string dir = Make("llama", m.Tensors(), m.Config());
  const CommandResult printed = Cli({"--print-rules", "llama"});
  ASSERT_EQ(printed.exit_code, 0) << printed.err;
  const std::string file = tmp_.Join("my-llama.json");
  WriteFile(file, printed.out);
  const CommandResult builtin = Cli({"--model", dir, "--json"});
  const CommandResult from_file = Cli({"--model", dir, "--shard-rules", file, "--json"});
  ASSERT_EQ(builtin.exit_code, 0) << builtin.err;
  ASSERT_EQ(from_file.exit_code, 0) << from_file.err;
  const auto b = nlohmann::json::parse(builtin.out);
  const auto f = nlohmann::json::parse(from_file.out);
  EXPECT_EQ(f["rules"]["source"], "file");
  EXPECT_EQ(f["rules"]["name"], "llama");
  EXPECT_EQ(f["rules"]["digest"], b["rules"]["digest"]);
  EXPECT_EQ(f["tensors"], b["tensors"]);
  auto py = RunCommand({PythonExe(), "-c",
                        "import hashlib, json, sys\n"
                        "o = json.load(open(sys.argv[1]))\n"
                        "print(hashlib.sha256(json.dumps(o, sort_keys=True, separators=(',', "
                        "':')).encode()).hexdigest())\n",
                        file});
  ASSERT_EQ(py.exit_code, 0) << py.err;
  EXPECT_EQ(py.out, b["rules"]["digest"].get<std::string>() + "\n");

  const CommandResult list = Cli({"--list-rules"});
  ASSERT_EQ(list.exit_code, 0) << list.err;
  EXPECT_EQ(list.out, "llama\nmistral\nqwen2\nqwen3\nmixtral\nqwen3_moe\ndeepseek_v3\nreplicate\n");
}

// Issue 39 §4: the built-in set `replicate` holds every tensor whole on every rank, for a
// checkpoint whose model_type has no rules (an engine that shards by itself).
TEST_F(ShardPlanCliTest, ReplicateHoldsEveryTensorWholeOnEveryRank) {
  DenseModel m;
  nlohmann::json gpt = m.Config();
  gpt["model_type"] = "gpt2";
  const std::string dir = Make("gpt", m.Tensors(), gpt, 2);
  Result<checkpoint::Checkpoint> c = checkpoint::Checkpoint::Open(dir);
  ASSERT_TRUE(c.ok());
  for (const std::vector<std::string>& rank :
       {std::vector<std::string>{"--tp-size", "2", "--tp-rank", "1"},
        std::vector<std::string>{"--tp-size", "4", "--tp-rank", "3", "--pp-size", "2", "--pp-rank",
                                 "1", "--ep-size", "2", "--ep-rank", "1"}}) {
    std::vector<std::string> args = {"--model", dir, "--shard-rules", "replicate", "--json"};
    args.insert(args.end(), rank.begin(), rank.end());
    const CommandResult r = Cli(args);
    ASSERT_EQ(r.exit_code, 0) << r.err;
    const nlohmann::json j = nlohmann::json::parse(r.out);
    EXPECT_EQ(j["model_type"], "gpt2");
    EXPECT_EQ(j["rules"]["name"], "replicate");
    EXPECT_EQ(j["rules"]["source"], "builtin");
    ASSERT_EQ(j["tensors"].size(), m.Tensors().size());
    for (const nlohmann::json& t : j["tensors"]) {
      EXPECT_EQ(t["mode"], "replicate") << t.dump();
      EXPECT_TRUE(t["slice"].is_null()) << t.dump();
      EXPECT_EQ(t["shape"], t["full_shape"]) << t.dump();
    }
    EXPECT_EQ(j["bytes"].get<uint64_t>(), c->total_bytes());
    EXPECT_EQ(j["full_bytes"].get<uint64_t>(), c->total_bytes());
  }
  const CommandResult printed = Cli({"--print-rules", "replicate"});
  ASSERT_EQ(printed.exit_code, 0) << printed.err;
  EXPECT_THAT(printed.out, HasSubstr("\"mode\": \"replicate\""));
  // A set for no model_type: a config.json that says "replicate" does not select it.
  nlohmann::json named = m.Config();
  named["model_type"] = "replicate";
  const CommandResult r = Cli({"--model", Make("named", m.Tensors(), named)});
  EXPECT_EQ(r.exit_code, 2) << r.out;
  EXPECT_THAT(r.err, HasSubstr("no built-in shard rule set for model_type \"replicate\""));
}

TEST_F(ShardPlanCliTest, ExitCodes) {
  DenseModel m;
  const std::string dir = Make("llama", m.Tensors(), m.Config());
  // 2: bad rules file, naming the rule.
  const std::string bad = tmp_.Join("bad.json");
  WriteFile(bad, R"({"format": 1, "rules": [{"match": "x", "mode": "replicate", "dims": 0}]})");
  CommandResult r = Cli({"--model", dir, "--shard-rules", bad});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("rule 0 (x): unknown key \"dims\""));
  // 2: a non-optional rule matching nothing.
  WriteFile(bad, R"({"format": 1, "rules": [{"match": ".*", "mode": "replicate"},
                    {"match": "nothing", "mode": "skip"}]})");
  r = Cli({"--model", dir, "--shard-rules", bad});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("rule 1 (nothing)"));
  // 2: an unknown model_type and no --shard-rules.
  nlohmann::json gpt = m.Config();
  gpt["model_type"] = "gpt2";
  const std::string gdir = Make("gpt", m.Tensors(), gpt);
  r = Cli({"--model", gdir});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, AllOf(HasSubstr("\"gpt2\""), HasSubstr("give --shard-rules NAME|FILE"),
                           HasSubstr("--shard-rules replicate")));
  // 2: inconsistent ranks, and a rank past its size.
  r = Cli({"--model", dir, "--tp-size", "2", "--tp-rank", "1", "--ep-size", "2"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("ep rank must be"));
  EXPECT_EQ(Cli({"--model", dir, "--pp-size", "2", "--pp-rank", "2"}).exit_code, 2);
  EXPECT_EQ(Cli({"--tp-size", "2"}).exit_code, 2);  // no --model
  EXPECT_EQ(Cli({"--print-rules", "gpt2"}).exit_code, 2);
  // 5: heads not divisible, naming tensor and rule (o_proj is the first such tensor in the
  // file: the writer orders tensors by name).
  r = Cli({"--model", dir, "--tp-size", "8", "--tp-rank", "0"});
  EXPECT_EQ(r.exit_code, 5);
  EXPECT_THAT(r.err, AllOf(HasSubstr("tensor model.layers.0.self_attn.o_proj.weight"),
                           HasSubstr("rule 3 ("),
                           HasSubstr("num_attention_heads 4 is not "
                                     "divisible by tp 8")));
  // 5: a tensor no rule matches; a bad config.json.
  auto tensors = m.Tensors();
  tensors.push_back({"vision.patch.weight", {4, 4}});
  r = Cli({"--model", Make("extra", tensors, m.Config())});
  EXPECT_EQ(r.exit_code, 5);
  EXPECT_THAT(r.err, HasSubstr("tensor vision.patch.weight matches no rule"));
  nlohmann::json wrong = m.Config();
  wrong["num_attention_heads"] = "4";
  r = Cli({"--model", Make("wrong", m.Tensors(), wrong)});
  EXPECT_EQ(r.exit_code, 5);
  EXPECT_THAT(r.err, HasSubstr("\"num_attention_heads\""));
}

}  // namespace
}  // namespace weightcache::sharding
