// PlanShard on real checkpoints: every mode's slice and copy geometry, pipeline partitions,
// vocab padding, kv-head replication, experts under TP and EP, block scales, and every
// refusal of the contract with the tensor and rule it names.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>

#include "checkpoint/checkpoint.h"
#include "sharding/planner.h"
#include "support/test_env.h"
#include "unit/sharding/sharding_fixture.h"

namespace weightcache::sharding {
namespace {

using ::testing::AllOf;
using testing::DenseModel;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using testing::S;
using testing::StatusIs;
using testing::TensorSpec;
using weightcache::testing::PythonExe;
using weightcache::testing::RunCommand;
using weightcache::testing::WriteFile;

Ranks Tp(uint32_t size, uint32_t rank) { return Ranks{.tp_size = size, .tp_rank = rank}; }
Ranks Pp(uint32_t size, uint32_t rank) { return Ranks{.pp_size = size, .pp_rank = rank}; }

class PlanTest : public testing::ShardingFixture {
 protected:
  // Plans `dir` under `rules_json` (a rules document) or, when empty, the built-in set of
  // its config.json's model_type. The checkpoint stays open for the plan's pointers.
  Result<ShardPlan> Plan(const std::string& dir, const Ranks& ranks,
                         const std::string& rules_json = "") {
    Result<checkpoint::Checkpoint> c = checkpoint::Checkpoint::Open(dir);
    if (!c.ok()) return c.status();
    checkpoints_.push_back(std::make_unique<checkpoint::Checkpoint>(std::move(*c)));
    WEIGHTCACHE_ASSIGN_OR_RETURN(ModelConfig config, ReadModelConfig(dir));
    Result<RuleSet> rules = rules_json.empty()
                                ? SelectRuleSet("", config.model_type)
                                : ParseRuleSet(rules_json, RuleSource::kFile, "test rules");
    if (!rules.ok()) return rules.status();
    rules_.push_back(std::make_unique<RuleSet>(std::move(*rules)));
    return PlanShard(*checkpoints_.back(), *rules_.back(), config, ranks);
  }

  static const PlannedTensor* Find(const ShardPlan& plan, const std::string& name) {
    for (const PlannedTensor& p : plan.tensors) {
      if (p.tensor->name == name) return &p;
    }
    return nullptr;
  }
  static std::set<std::string> Names(const ShardPlan& plan) {
    std::set<std::string> names;
    for (const PlannedTensor& p : plan.tensors) names.insert(p.tensor->name);
    return names;
  }

  std::vector<std::unique_ptr<checkpoint::Checkpoint>> checkpoints_;
  std::vector<std::unique_ptr<RuleSet>> rules_;
};

std::string Rules(const std::string& rules, const std::string& extra = "") {
  return R"({"format": 1, "name": "test")" + extra + R"(, "rules": [)" + rules + "]}";
}

// The slice as a tuple, for compact expectations.
std::optional<std::tuple<uint32_t, uint64_t, uint64_t>> S(const PlannedTensor* p) {
  if (p == nullptr || !p->slice) return std::nullopt;
  return std::make_tuple(p->slice->dim, p->slice->offset, p->slice->length);
}

TEST_F(PlanTest, CopyGeometryPicksExactlyTheSliceBytes) {
  const std::string dir = Make("geo",
                               {{"w0", {8, 6}, "f16"},
                                {"w1", {4, 8}, "f32"},
                                {"w2", {2, 4, 6}, "f16"},
                                {"w3", {4, 4}, "f32"}},
                               nullptr, 2);
  const std::string rules = Rules(R"({"match": "w[02]", "mode": "split", "dim": 0},
      {"match": "w1", "mode": "split", "dim": 1}, {"match": "w3", "mode": "replicate"})");
  // w2 split along dim 1 by a second rule set: a 3-D strided case.
  Result<ShardPlan> plan = Plan(dir, Tp(2, 1), rules);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  const PlannedTensor* w0 = Find(*plan, "w0");
  ASSERT_NE(w0, nullptr);
  EXPECT_EQ(S(w0), S(0, 4, 4));
  EXPECT_THAT(w0->shape, ElementsAre(4, 6));
  EXPECT_EQ(w0->copy.rows, 1u);
  EXPECT_EQ(w0->copy.row_bytes, 48u);
  EXPECT_EQ(w0->copy.source_offset, 48u);
  const PlannedTensor* w1 = Find(*plan, "w1");
  EXPECT_EQ(S(w1), S(1, 4, 4));
  EXPECT_EQ(w1->copy.rows, 4u);
  EXPECT_EQ(w1->copy.row_bytes, 16u);
  EXPECT_EQ(w1->copy.source_pitch, 32u);
  EXPECT_EQ(w1->copy.source_offset, 16u);
  EXPECT_EQ(Find(*plan, "w3")->slice, std::nullopt);
  EXPECT_EQ(Find(*plan, "w3")->copy.row_bytes, 64u);
  EXPECT_EQ(plan->bytes, 48u + 64u + 48u + 64u);
  EXPECT_EQ(plan->full_bytes, 96u + 128u + 96u + 64u);

  Result<ShardPlan> strided = Plan(
      dir, Tp(2, 1),
      Rules(R"({"match": "w2", "mode": "split", "dim": 1}, {"match": "w.", "mode": "replicate"})"));
  ASSERT_TRUE(strided.ok()) << strided.status().ToString();
  const PlannedTensor* w2 = Find(*strided, "w2");
  EXPECT_EQ(S(w2), S(1, 2, 2));
  EXPECT_THAT(w2->shape, ElementsAre(2, 2, 6));
  EXPECT_EQ(w2->copy.rows, 2u);
  EXPECT_EQ(w2->copy.row_bytes, 24u);
  EXPECT_EQ(w2->copy.source_pitch, 48u);
  EXPECT_EQ(w2->copy.source_offset, 24u);

  // The bytes the geometry selects are numpy's slice of the tensor, read back by the
  // reference reader.
  for (const auto* p : {w0, w1, w2}) {
    const checkpoint::TensorInfo& t = *p->tensor;
    std::string whole(t.nbytes, '\0');
    ASSERT_TRUE(checkpoint::ReadTensor(*checkpoints_.front(), t, whole.data()).ok());
    std::string mine;
    for (uint64_t r = 0; r < p->copy.rows; ++r) {
      mine += whole.substr(p->copy.source_offset + r * p->copy.source_pitch, p->copy.row_bytes);
    }
    const std::string index = p->slice->dim == 0 ? "[" : "[:,";
    auto py = RunCommand({PythonExe(), "-c",
                          "import sys, safetensors.numpy as s\n"
                          "from safetensors import safe_open\n"
                          "import glob\n"
                          "for f in glob.glob(sys.argv[1] + '/*.safetensors'):\n"
                          "  d = s.load_file(f)\n"
                          "  if sys.argv[2] in d:\n"
                          "    a = d[sys.argv[2]]\n"
                          "    sys.stdout.write(eval('a' + sys.argv[3]).tobytes().hex())\n",
                          dir, t.name,
                          index + std::to_string(p->slice->offset) + ":" +
                              std::to_string(p->slice->offset + p->slice->length) + "]"});
    ASSERT_EQ(py.exit_code, 0) << py.err;
    std::string hex;
    for (unsigned char ch : mine) {
      static constexpr char kDigits[] = "0123456789abcdef";
      hex += kDigits[ch >> 4];
      hex += kDigits[ch & 15];
    }
    EXPECT_EQ(hex, py.out) << t.name;
  }
}

TEST_F(PlanTest, VocabPadsTo64AndMayLeaveARankFewerOrNoRows) {
  const std::string rules = Rules(R"({"match": ".*", "mode": "vocab"})");
  const std::string v100 = Make("v100", {{"e", {100, 8}}}, nullptr);
  // padded 128, 32 rows per rank: rank 3 holds rows 96..100.
  Result<ShardPlan> p = Plan(v100, Tp(4, 3), rules);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(S(Find(*p, "e")), S(0, 96, 4));
  EXPECT_EQ(Find(*p, "e")->mode, Mode::kVocab);
  EXPECT_EQ(S(Find(*Plan(v100, Tp(4, 0), rules), "e")), S(0, 0, 32));

  // V=70: padded 128, rank 2 holds 64..70, rank 3 none: listed with 0 rows at offset 70.
  const std::string v70 = Make("v70", {{"e", {70, 8}}}, nullptr);
  EXPECT_EQ(S(Find(*Plan(v70, Tp(4, 2), rules), "e")), S(0, 64, 6));
  Result<ShardPlan> empty = Plan(v70, Tp(4, 3), rules);
  ASSERT_TRUE(empty.ok()) << empty.status().ToString();
  const PlannedTensor* e = Find(*empty, "e");
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(S(e), S(0, 70, 0));
  EXPECT_THAT(e->shape, ElementsAre(0, 8));
  EXPECT_EQ(e->bytes, 0u);

  // 200 pads to 256, which 3 ranks cannot share.
  const std::string v200 = Make("v200", {{"e", {200, 8}}}, nullptr);
  EXPECT_THAT(Plan(v200, Tp(3, 0), rules),
              StatusIs(StatusCode::kInvalidCheckpoint,
                       AllOf(HasSubstr("tensor e (rule 0 (.*))"),
                             HasSubstr("padded vocabulary 256"), HasSubstr("tp 3"))));
}

TEST_F(PlanTest, KvHeadsSplitOrReplicateAsQkvParallelLinear) {
  const std::string rules = Rules(R"({"match": ".*", "mode": "kv_heads"})");
  auto model = [&](const std::string& name, uint64_t kv, uint64_t heads) {
    return Make(name, {{"k.weight", {kv * 16, 8}}, {"k.bias", {kv * 16}}},
                {{"num_attention_heads", heads}, {"num_key_value_heads", kv}});
  };
  const std::string kv2 = model("kv2", 2, 8);
  // tp 4 > 2 kv heads: ranks 0,1 hold head 0, ranks 2,3 head 1 (num_kv_head_replicas 2).
  for (uint32_t r = 0; r < 4; ++r) {
    Result<ShardPlan> p = Plan(kv2, Tp(4, r), rules);
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    EXPECT_EQ(S(Find(*p, "k.weight")), S(0, r / 2 * 16, 16)) << r;
    EXPECT_EQ(S(Find(*p, "k.bias")), S(0, r / 2 * 16, 16)) << r;
  }
  // tp 2 < 4 kv heads: rank 1 holds heads 2 and 3.
  EXPECT_EQ(S(Find(*Plan(model("kv4", 4, 8), Tp(2, 1), rules), "k.weight")), S(0, 32, 32));
  // 8 ranks, 4 kv heads: rank 5 holds head 2.
  EXPECT_EQ(S(Find(*Plan(model("kv4b", 4, 8), Tp(8, 5), rules), "k.weight")), S(0, 32, 16));
  // One kv head (MQA): every rank holds all of it.
  EXPECT_EQ(Find(*Plan(model("kv1", 1, 8), Tp(4, 3), rules), "k.weight")->slice, std::nullopt);
  EXPECT_THAT(Plan(kv2, Tp(3, 0), rules),
              StatusIs(StatusCode::kInvalidCheckpoint,
                       AllOf(HasSubstr("tensor k.bias (rule 0 (.*))"),
                             HasSubstr("tp 3 is neither a divisor nor a multiple of 2 kv heads"))));
  EXPECT_THAT(
      Plan(model("kv6", 6, 12), Tp(4, 0), rules),
      StatusIs(StatusCode::kInvalidCheckpoint, HasSubstr("6 kv heads are not divisible by tp 4")));
  // Without num_key_value_heads, num_attention_heads is the kv head count.
  const std::string mha = Make("mha", {{"k.weight", {64, 8}}}, {{"num_attention_heads", 4}});
  EXPECT_EQ(S(Find(*Plan(mha, Tp(2, 1), rules), "k.weight")), S(0, 32, 32));
  const std::string none = Make("none", {{"k.weight", {64, 8}}}, nullptr);
  EXPECT_THAT(Plan(none, Tp(2, 1), rules),
              StatusIs(StatusCode::kInvalidCheckpoint, HasSubstr("num_key_value_heads")));
}

TEST(PpLayerRangeTest, VllmAndSglangPartitions) {
  auto all = [](PpPartition p, uint64_t layers, uint32_t pp) {
    std::vector<std::pair<uint64_t, uint64_t>> out;
    for (uint32_t r = 0; r < pp; ++r) {
      LayerRange l = PpLayerRange(p, layers, r, pp);
      out.emplace_back(l.start, l.end);
    }
    return out;
  };
  using P = std::pair<uint64_t, uint64_t>;
  // vLLM: the remainder goes to partitions[-2], [-3], ...: 10 over 4 is 2,3,3,2.
  EXPECT_THAT(all(PpPartition::kVllm, 10, 4), ElementsAre(P{0, 2}, P{2, 5}, P{5, 8}, P{8, 10}));
  EXPECT_THAT(all(PpPartition::kVllm, 7, 4), ElementsAre(P{0, 2}, P{2, 4}, P{4, 6}, P{6, 7}));
  EXPECT_THAT(all(PpPartition::kVllm, 5, 2), ElementsAre(P{0, 3}, P{3, 5}));
  EXPECT_THAT(all(PpPartition::kVllm, 8, 4), ElementsAre(P{0, 2}, P{2, 4}, P{4, 6}, P{6, 8}));
  // SGLang: the last `remainder` partitions get one more: 10 over 4 is 2,2,3,3.
  EXPECT_THAT(all(PpPartition::kSglang, 10, 4), ElementsAre(P{0, 2}, P{2, 4}, P{4, 7}, P{7, 10}));
  EXPECT_THAT(all(PpPartition::kSglang, 7, 4), ElementsAre(P{0, 1}, P{1, 3}, P{3, 5}, P{5, 7}));
  EXPECT_THAT(all(PpPartition::kSglang, 5, 2), ElementsAre(P{0, 2}, P{2, 5}));
  EXPECT_THAT(all(PpPartition::kSglang, 8, 4), ElementsAre(P{0, 2}, P{2, 4}, P{4, 6}, P{6, 8}));
}

TEST_F(PlanTest, PipelineStagesHoldTheirLayersEmbeddingsAndHead) {
  DenseModel m;
  m.layers = 5;
  const std::string dir = Make("pp", m.Tensors(), m.Config(), 2);
  auto layers_of = [&](const ShardPlan& plan) {
    std::set<std::string> layers;
    for (const PlannedTensor& p : plan.tensors) {
      const std::string& n = p.tensor->name;
      if (n.starts_with("model.layers.")) layers.insert(n.substr(13, n.find('.', 13) - 13));
    }
    return layers;
  };
  Result<ShardPlan> s0 = Plan(dir, Pp(2, 0));
  Result<ShardPlan> s1 = Plan(dir, Pp(2, 1));
  ASSERT_TRUE(s0.ok() && s1.ok()) << s0.status().ToString() << s1.status().ToString();
  EXPECT_THAT(layers_of(*s0), ElementsAre("0", "1", "2"));  // vLLM: 3, 2
  EXPECT_THAT(layers_of(*s1), ElementsAre("3", "4"));
  EXPECT_NE(Find(*s0, "model.embed_tokens.weight"), nullptr);
  EXPECT_EQ(Find(*s1, "model.embed_tokens.weight"), nullptr);
  EXPECT_EQ(Find(*s0, "model.norm.weight"), nullptr);
  EXPECT_NE(Find(*s1, "model.norm.weight"), nullptr);
  EXPECT_NE(Find(*s1, "lm_head.weight"), nullptr);
  EXPECT_EQ(s0->full_bytes, s1->full_bytes);
  EXPECT_EQ(s0->bytes + s1->bytes, s0->full_bytes);  // pp alone: every byte exactly once

  // The same model under SGLang's partition (2, 3): the llama set with pp_partition sglang.
  std::string text(*BuiltinRuleSetText("llama"));
  text.replace(text.find("\"vllm\""), 6, "\"sglang\"");
  EXPECT_THAT(layers_of(*Plan(dir, Pp(2, 0), text)), ElementsAre("0", "1"));
  EXPECT_THAT(layers_of(*Plan(dir, Pp(2, 1), text)), ElementsAre("2", "3", "4"));

  // Tied embeddings and no lm_head: the last stage holds the input embedding too.
  DenseModel tied = m;
  tied.tied = true;
  tied.lm_head = false;
  const std::string tdir = Make("tied", tied.Tensors(), tied.Config());
  EXPECT_NE(Find(*Plan(tdir, Pp(2, 0)), "model.embed_tokens.weight"), nullptr);
  EXPECT_NE(Find(*Plan(tdir, Pp(2, 1)), "model.embed_tokens.weight"), nullptr);
  EXPECT_NE(Find(*Plan(tdir, Pp(1, 0)), "model.embed_tokens.weight"), nullptr);
  // Tied but with an lm_head in the checkpoint: the lm_head serves the last stage.
  DenseModel tied_head = tied;
  tied_head.lm_head = true;
  const std::string thdir = Make("tied_head", tied_head.Tensors(), tied_head.Config());
  EXPECT_EQ(Find(*Plan(thdir, Pp(2, 1)), "model.embed_tokens.weight"), nullptr);
  EXPECT_NE(Find(*Plan(thdir, Pp(2, 1)), "lm_head.weight"), nullptr);

  // Placing layers needs num_hidden_layers; a layer past it is refused.
  nlohmann::json no_layers = m.Config();
  no_layers.erase("num_hidden_layers");
  const std::string nl = Make("nolayers", m.Tensors(), no_layers);
  EXPECT_THAT(Plan(nl, Pp(2, 0)),
              StatusIs(StatusCode::kInvalidCheckpoint,
                       AllOf(HasSubstr("model.layers.0."), HasSubstr("needs num_hidden_layers"))));
  EXPECT_TRUE(Plan(nl, Pp(1, 0)).ok());
  nlohmann::json fewer = m.Config();
  fewer["num_hidden_layers"] = 4;
  const std::string fl = Make("fewer", m.Tensors(), fewer);
  EXPECT_THAT(Plan(fl, Pp(1, 0)),
              StatusIs(StatusCode::kInvalidCheckpoint,
                       AllOf(HasSubstr("tensor model.layers.4."),
                             HasSubstr("layer 4 is past num_hidden_layers 4"))));
}

// A Mixtral-style model: one layer, `experts` experts with w1/w3 [32, 16] and w2 [16, 32].
std::vector<TensorSpec> Moe(uint64_t experts, const std::vector<std::string>& extra_ids = {}) {
  DenseModel m;
  std::vector<TensorSpec> t = m.Head();
  for (auto& x : m.Attention(0)) t.push_back(x);
  t.push_back({"model.layers.0.block_sparse_moe.gate.weight", {experts, 64}});
  std::vector<std::string> ids;
  for (uint64_t e = 0; e < experts; ++e) ids.push_back(std::to_string(e));
  for (const auto& id : extra_ids) ids.push_back(id);
  for (const std::string& e : ids) {
    const std::string p = "model.layers.0.block_sparse_moe.experts." + e + ".";
    t.push_back({p + "w1.weight", {32, 64}});
    t.push_back({p + "w3.weight", {32, 64}});
    t.push_back({p + "w2.weight", {64, 32}});
  }
  for (auto& x : m.Tail()) t.push_back(x);
  return t;
}

nlohmann::json MoeConfig(uint64_t experts) {
  DenseModel m;
  m.model_type = "mixtral";
  m.layers = 1;
  nlohmann::json c = m.Config();
  c["num_local_experts"] = experts;
  return c;
}

TEST_F(PlanTest, ExpertsUnderTpAndEp) {
  const std::string dir = Make("moe", Moe(4), MoeConfig(4));
  const std::string w1 = "model.layers.0.block_sparse_moe.experts.";
  auto experts_held = [&](const ShardPlan& plan) {
    std::set<std::string> held;
    for (const PlannedTensor& p : plan.tensors) {
      const std::string& n = p.tensor->name;
      if (n.starts_with(w1)) held.insert(n.substr(w1.size(), 1));
    }
    return held;
  };
  // TP 2, EP 1: every rank holds every expert, split inside (moe_tp 2).
  Result<ShardPlan> tp = Plan(dir, Tp(2, 1));
  ASSERT_TRUE(tp.ok()) << tp.status().ToString();
  EXPECT_THAT(experts_held(*tp), ElementsAre("0", "1", "2", "3"));
  EXPECT_EQ(S(Find(*tp, w1 + "3.w1.weight")), S(0, 16, 16));
  EXPECT_EQ(S(Find(*tp, w1 + "3.w2.weight")), S(1, 16, 16));
  EXPECT_EQ(Find(*tp, w1 + "3.w2.weight")->mode, Mode::kExpert);
  EXPECT_EQ(Find(*tp, "model.layers.0.block_sparse_moe.gate.weight")->slice, std::nullopt);
  // TP 2, EP 2 (SGLang moe_tp 1): ep rank 1 holds experts 2 and 3, whole.
  Result<ShardPlan> ep = Plan(dir, Ranks{.tp_size = 2, .tp_rank = 1, .ep_size = 2, .ep_rank = 1});
  ASSERT_TRUE(ep.ok()) << ep.status().ToString();
  EXPECT_THAT(experts_held(*ep), ElementsAre("2", "3"));
  EXPECT_EQ(Find(*ep, w1 + "2.w1.weight")->slice, std::nullopt);
  // EP 2 over TP 1 (vLLM's EP = TP x DP).
  EXPECT_THAT(experts_held(*Plan(dir, Ranks{.ep_size = 2, .ep_rank = 1})), ElementsAre("2", "3"));
  // TP 4, EP 2: moe_tp 2; tp rank 3 is ep rank 1, moe_tp rank 1.
  Result<ShardPlan> mixed =
      Plan(dir, Ranks{.tp_size = 4, .tp_rank = 3, .ep_size = 2, .ep_rank = 1});
  ASSERT_TRUE(mixed.ok()) << mixed.status().ToString();
  EXPECT_THAT(experts_held(*mixed), ElementsAre("2", "3"));
  EXPECT_EQ(S(Find(*mixed, w1 + "2.w3.weight")), S(0, 16, 16));
  EXPECT_EQ(S(Find(*mixed, w1 + "2.w2.weight")), S(1, 16, 16));

  // 3 experts cannot be shared by 2 EP ranks.
  const std::string three = Make("moe3", Moe(3), MoeConfig(3));
  EXPECT_THAT(Plan(three, Ranks{.ep_size = 2, .ep_rank = 0}),
              StatusIs(StatusCode::kInvalidCheckpoint,
                       AllOf(HasSubstr("tensor " + w1 + "0.w1.weight (rule "),
                             HasSubstr("num_local_experts 3 is not divisible by ep 2"))));
  // An expert index past the count.
  const std::string past = Make("past", Moe(4, {"4"}), MoeConfig(4));
  EXPECT_THAT(Plan(past, Tp(1, 0)),
              StatusIs(StatusCode::kInvalidCheckpoint,
                       AllOf(HasSubstr("tensor " + w1 + "4.w1.weight"),
                             HasSubstr("expert 4 is not below num_local_experts 4"))));
  // Two tensors claiming one expert slot ("01" and "1").
  const std::string dup = Make("dup", Moe(4, {"01"}), MoeConfig(4));
  EXPECT_THAT(Plan(dup, Tp(1, 0)), StatusIs(StatusCode::kInvalidCheckpoint,
                                            AllOf(HasSubstr("tensor " + w1 + "01.w1.weight"),
                                                  HasSubstr("already claims expert 1"))));
  // No expert count in config.json.
  nlohmann::json no_count = MoeConfig(4);
  no_count.erase("num_local_experts");
  EXPECT_THAT(Plan(Make("nocount", Moe(4), no_count), Tp(1, 0)),
              StatusIs(StatusCode::kInvalidCheckpoint, HasSubstr("n_routed_experts")));
}

TEST(ValidateRanksTest, RankConsistency) {
  EXPECT_TRUE(ValidateRanks(Ranks{}).ok());
  EXPECT_TRUE(ValidateRanks(Ranks{.tp_size = 4, .tp_rank = 3, .ep_size = 2, .ep_rank = 1}).ok());
  EXPECT_TRUE(ValidateRanks(Ranks{.tp_size = 2, .tp_rank = 1, .ep_size = 4, .ep_rank = 3}).ok());
  EXPECT_THAT(
      ValidateRanks(Ranks{.tp_size = 2, .tp_rank = 2}),
      StatusIs(StatusCode::kInvalidArgument, HasSubstr("tp rank 2 is not below tp size 2")));
  EXPECT_THAT(ValidateRanks(Ranks{.pp_size = 0}),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("at least 1")));
  EXPECT_THAT(ValidateRanks(Ranks{.pp_size = 2, .pp_rank = 2}),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("pp rank 2")));
  EXPECT_THAT(
      ValidateRanks(Ranks{.tp_size = 2, .tp_rank = 1, .ep_size = 2, .ep_rank = 0}),
      StatusIs(StatusCode::kInvalidArgument, HasSubstr("ep rank must be tp rank / (tp/ep) = 1")));
  EXPECT_THAT(ValidateRanks(Ranks{.tp_size = 4, .tp_rank = 0, .ep_size = 3, .ep_rank = 0}),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("ep size must divide tp size")));
  EXPECT_THAT(
      ValidateRanks(Ranks{.tp_size = 2, .tp_rank = 1, .ep_size = 4, .ep_rank = 2}),
      StatusIs(StatusCode::kInvalidArgument, HasSubstr("ep rank % tp size must equal tp rank")));
  EXPECT_TRUE(ValidateRanks(Ranks{.tp_size = 2, .tp_rank = 0, .ep_size = 6, .ep_rank = 0}).ok());
  EXPECT_THAT(ValidateRanks(Ranks{.tp_size = 4, .tp_rank = 0, .ep_size = 6, .ep_rank = 0}),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("tp size must divide ep size")));
}

TEST_F(PlanTest, BlockScalesSplitWithTheirWeightInBlocks) {
  const std::string rules = Rules(R"(
      {"match": "r\\.weight(_scale_inv)?", "mode": "replicate", "optional": true},
      {"match": "(\\w+)\\.weight", "mode": "split", "dim": 0},
      {"match": "(\\w+)\\.weight_scale_inv", "mode": "split", "dim": 0, "block": 128})");
  const std::string dir = Make("fp8",
                               {{"a.weight", {512, 256}, "f8_e4m3"},
                                {"a.weight_scale_inv", {4, 2}, "f32"},
                                {"r.weight", {256, 256}, "f8_e4m3"},
                                {"r.weight_scale_inv", {2, 2}, "f32"}},
                               nullptr);
  Result<ShardPlan> p = Plan(dir, Tp(2, 1), rules);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(S(Find(*p, "a.weight")), S(0, 256, 256));
  EXPECT_EQ(S(Find(*p, "a.weight_scale_inv")), S(0, 2, 2));
  EXPECT_EQ(Find(*p, "a.weight_scale_inv")->copy.source_offset, 2u * 2 * 4);
  EXPECT_EQ(Find(*p, "r.weight_scale_inv")->slice, std::nullopt);  // a replicated weight's
  // tp 4: 128 rows per rank, one scale row each.
  EXPECT_EQ(S(Find(*Plan(dir, Tp(4, 3), rules), "a.weight_scale_inv")), S(0, 3, 1));

  // 384 rows over 2 ranks: 192 rows each, not a whole number of 128-row blocks. The engines
  // refuse the job (vLLM validate_fp8_block_shape), so every rank refuses it, rank 0 included.
  const std::string odd = Make(
      "odd", {{"b.weight", {384, 128}, "f8_e4m3"}, {"b.weight_scale_inv", {3, 1}, "f32"}}, nullptr);
  for (int rank : {0, 1}) {
    EXPECT_THAT(Plan(odd, Tp(2, rank), rules),
                StatusIs(StatusCode::kInvalidCheckpoint,
                         AllOf(HasSubstr("tensor b.weight_scale_inv (rule 2"),
                               HasSubstr("per-rank slice is 192 rows along dim 0, not a "
                                         "multiple of the block 128"))))
        << "rank " << rank;
  }
  // A scale whose weight is missing, and one with too few blocks.
  const std::string orphan = Make("orphan", {{"c.weight_scale_inv", {2, 1}, "f32"}}, nullptr);
  EXPECT_THAT(Plan(orphan, Tp(2, 0), rules),
              StatusIs(StatusCode::kInvalidCheckpoint,
                       HasSubstr("its weight c.weight is not in the checkpoint")));
  const std::string small =
      Make("small", {{"d.weight", {512, 128}, "f8_e4m3"}, {"d.weight_scale_inv", {2, 1}, "f32"}},
           nullptr);
  EXPECT_THAT(Plan(small, Tp(2, 1), rules),
              StatusIs(StatusCode::kInvalidCheckpoint, HasSubstr("needs blocks up to 4")));
}

TEST_F(PlanTest, RefusalsNameTheTensorAndTheRule) {
  DenseModel m;
  std::vector<TensorSpec> tensors = m.Tensors();
  tensors.push_back({"model.extra.bias", {4}});
  EXPECT_THAT(Plan(Make("extra", tensors, m.Config()), Tp(1, 0)),
              StatusIs(StatusCode::kInvalidCheckpoint,
                       HasSubstr("tensor model.extra.bias matches no rule of shard rule set "
                                 "\"llama\"")));
  // A non-optional rule that matches nothing is a rules problem: exit 2.
  std::vector<TensorSpec> no_norm;
  for (const TensorSpec& t : m.Tensors()) {
    if (t.name != "model.norm.weight") no_norm.push_back(t);
  }
  EXPECT_THAT(
      Plan(Make("nonorm", no_norm, m.Config()), Tp(1, 0)),
      StatusIs(StatusCode::kInvalidArgument,
               AllOf(HasSubstr("rule 9 (model\\.norm\\.weight)"), HasSubstr("matches no tensor"))));
  // 4 heads over 8 ranks: the heads must divide (o_proj is the first such tensor in the
  // file: the writer orders tensors by name).
  const std::string dense = Make("dense", m.Tensors(), m.Config());
  EXPECT_THAT(Plan(dense, Tp(8, 0)),
              StatusIs(StatusCode::kInvalidCheckpoint,
                       AllOf(HasSubstr("tensor model.layers.0.self_attn.o_proj.weight (rule 3 "),
                             HasSubstr("num_attention_heads 4 is not divisible by tp 8"))));
  const std::string six = Make("six", {{"w", {6, 4}}}, nullptr);
  EXPECT_THAT(Plan(six, Tp(4, 0), Rules(R"({"match": "w", "mode": "split", "dim": 0})")),
              StatusIs(StatusCode::kInvalidCheckpoint,
                       AllOf(HasSubstr("tensor w (rule 0 (w))"),
                             HasSubstr("dim 0 of shape [6, 4] is not divisible by tp 4"))));
  EXPECT_THAT(Plan(six, Tp(2, 0), Rules(R"({"match": "w", "mode": "split", "dim": 2})")),
              StatusIs(StatusCode::kInvalidCheckpoint, HasSubstr("splits dim 2 but the tensor")));
  EXPECT_THAT(Plan(six, Tp(2, 0),
                   Rules(R"({"match": "w", "mode": "split", "dim": 0, "heads": "n_heads"})")),
              StatusIs(StatusCode::kInvalidCheckpoint, HasSubstr("needs \"n_heads\" in config")));
  EXPECT_THAT(
      Plan(six, Ranks{.tp_size = 2, .tp_rank = 5}, Rules(R"({"match": "w", "mode": "skip"})")),
      StatusIs(StatusCode::kInvalidArgument, HasSubstr("tp rank 5")));
}

}  // namespace
}  // namespace weightcache::sharding
