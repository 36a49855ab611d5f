// Each built-in rule set on a small synthetic checkpoint of its architecture: every tensor
// matched, every rank's slices together cover each tensor exactly (replicated tensors whole
// on every rank), and spot checks of the modes the engines use.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <map>
#include <nlohmann/json.hpp>

#include "checkpoint/checkpoint.h"
#include "sharding/planner.h"
#include "unit/sharding/sharding_fixture.h"

namespace weightcache::sharding {
namespace {

using testing::DenseModel;
using ::testing::HasSubstr;
using testing::S;
using testing::TensorSpec;

struct Held {
  uint32_t rank = 0;
  std::optional<Slice> slice;
  Mode mode = Mode::kReplicate;
  size_t rule = 0;
};

class BuiltinSetsTest : public testing::ShardingFixture {
 protected:
  // Plans every tp rank (ep 1, or ep == tp when `ep`), checks the cover property and
  // returns, per tensor name, what each rank holds.
  std::map<std::string, std::vector<Held>> PlanAll(const std::string& dir, uint32_t tp,
                                                   bool ep = false) {
    std::map<std::string, std::vector<Held>> held;
    Result<checkpoint::Checkpoint> c = checkpoint::Checkpoint::Open(dir);
    EXPECT_TRUE(c.ok()) << c.status().ToString();
    if (!c.ok()) return held;
    Result<ModelConfig> config = ReadModelConfig(dir);
    EXPECT_TRUE(config.ok()) << config.status().ToString();
    Result<RuleSet> rules = SelectRuleSet("", config->model_type);
    EXPECT_TRUE(rules.ok()) << rules.status().ToString();
    if (!rules.ok()) return held;
    for (uint32_t r = 0; r < tp; ++r) {
      Ranks ranks{.tp_size = tp, .tp_rank = r};
      if (ep) {
        ranks.ep_size = tp;
        ranks.ep_rank = r;
      }
      Result<ShardPlan> plan = PlanShard(*c, *rules, *config, ranks);
      EXPECT_TRUE(plan.ok()) << plan.status().ToString();
      if (!plan.ok()) return held;
      for (const PlannedTensor& p : plan->tensors) {
        held[p.tensor->name].push_back({r, p.slice, p.mode, p.rule});
      }
    }
    // Every tensor is held by some rank, and the ranks' slices cover it.
    for (const checkpoint::TensorInfo& t : c->tensors()) {
      auto it = held.find(t.name);
      if (it == held.end()) {
        ADD_FAILURE() << t.name << " is held by no rank";
        continue;
      }
      uint64_t covered = 0;
      uint64_t full = 0;
      bool whole = false;
      for (const Held& h : it->second) {
        if (!h.slice) {
          whole = true;
        } else {
          covered += h.slice->length;
          full = t.shape[h.slice->dim];
        }
      }
      if (whole) {
        for (const Held& h : it->second) EXPECT_FALSE(h.slice) << t.name << " mixes whole/sliced";
        if (it->second.front().mode != Mode::kExpert) {
          EXPECT_EQ(it->second.size(), tp) << t.name << ": whole but not on every rank";
        }
      } else if (it->second.front().mode != Mode::kKvHeads) {
        EXPECT_EQ(covered, full) << t.name;
      }
    }
    return held;
  }
};

std::optional<std::tuple<uint32_t, uint64_t, uint64_t>> S(const Held& h) {
  if (!h.slice) return std::nullopt;
  return std::make_tuple(h.slice->dim, h.slice->offset, h.slice->length);
}

TEST_F(BuiltinSetsTest, LlamaAndMistral) {
  for (const std::string type : {"llama", "mistral"}) {
    DenseModel m;
    m.model_type = type;
    auto held = PlanAll(Make(type, m.Tensors(), m.Config(), 2), 2);
    const auto& q = held["model.layers.1.self_attn.q_proj.weight"];
    ASSERT_EQ(q.size(), 2u);
    EXPECT_EQ(S(q[1]), S(0, 32, 32));
    EXPECT_EQ(q[1].mode, Mode::kSplit);
    EXPECT_EQ(S(held["model.layers.1.self_attn.k_proj.weight"][1]), S(0, 16, 16));
    EXPECT_EQ(held["model.layers.1.self_attn.v_proj.weight"][1].mode, Mode::kKvHeads);
    EXPECT_EQ(S(held["model.layers.1.self_attn.o_proj.weight"][1]), S(1, 32, 32));
    EXPECT_EQ(S(held["model.layers.1.mlp.gate_proj.weight"][1]), S(0, 64, 64));
    EXPECT_EQ(S(held["model.layers.1.mlp.down_proj.weight"][0]), S(1, 0, 64));
    EXPECT_EQ(S(held["model.embed_tokens.weight"][1]), S(0, 128, 128));
    EXPECT_EQ(held["lm_head.weight"][1].mode, Mode::kVocab);
    EXPECT_EQ(held["model.norm.weight"][1].mode, Mode::kReplicate);
  }
}

TEST_F(BuiltinSetsTest, Qwen2BiasesFollowTheirWeights) {
  DenseModel m;
  m.model_type = "qwen2";
  m.qkv_bias = true;
  m.kv_heads = 1;  // tp 4 > 1 kv head: replicated
  auto held = PlanAll(Make("qwen2", m.Tensors(), m.Config()), 4);
  EXPECT_EQ(S(held["model.layers.0.self_attn.q_proj.bias"][2]), S(0, 32, 16));
  EXPECT_EQ(held["model.layers.0.self_attn.k_proj.bias"][3].slice, std::nullopt);
  EXPECT_EQ(held["model.layers.0.self_attn.k_proj.weight"][3].slice, std::nullopt);
}

TEST_F(BuiltinSetsTest, Qwen3QkNormReplicatedAndTiedEmbedding) {
  DenseModel m;
  m.model_type = "qwen3";
  m.qk_norm = true;
  m.tied = true;
  m.lm_head = false;
  auto held = PlanAll(Make("qwen3", m.Tensors(), m.Config()), 2);
  EXPECT_EQ(held["model.layers.0.self_attn.q_norm.weight"].size(), 2u);
  EXPECT_EQ(held["model.layers.0.self_attn.k_norm.weight"][1].mode, Mode::kReplicate);
  EXPECT_EQ(held.count("lm_head.weight"), 0u);
}

TEST_F(BuiltinSetsTest, MixtralExpertsUnderEp) {
  DenseModel m;
  std::vector<TensorSpec> t = m.Head();
  for (auto& x : m.Attention(0)) t.push_back(x);
  t.push_back({"model.layers.0.block_sparse_moe.gate.weight", {4, 64}});
  for (int e = 0; e < 4; ++e) {
    const std::string p = "model.layers.0.block_sparse_moe.experts." + std::to_string(e) + ".";
    t.push_back({p + "w1.weight", {32, 64}});
    t.push_back({p + "w2.weight", {64, 32}});
    t.push_back({p + "w3.weight", {32, 64}});
  }
  for (auto& x : m.Tail()) t.push_back(x);
  nlohmann::json config = m.Config();
  config["model_type"] = "mixtral";
  config["num_hidden_layers"] = 1;
  config["num_local_experts"] = 4;
  auto held = PlanAll(Make("mixtral", t, config), 2, /*ep=*/true);
  const auto& e3 = held["model.layers.0.block_sparse_moe.experts.3.w2.weight"];
  ASSERT_EQ(e3.size(), 1u);
  EXPECT_EQ(e3[0].rank, 1u);
  EXPECT_EQ(e3[0].slice, std::nullopt);
}

TEST_F(BuiltinSetsTest, Qwen3MoeWithADenseLayer) {
  DenseModel m;
  m.qk_norm = true;
  std::vector<TensorSpec> t = m.Head();
  for (int layer = 0; layer < 2; ++layer) {
    for (auto& x : m.Attention(layer)) t.push_back(x);
  }
  for (auto& x : m.DenseMlp(0)) t.push_back(x);  // layer 0 dense (mlp_only_layers)
  t.push_back({"model.layers.1.mlp.gate.weight", {4, 64}});
  for (int e = 0; e < 4; ++e) {
    const std::string p = "model.layers.1.mlp.experts." + std::to_string(e) + ".";
    t.push_back({p + "gate_proj.weight", {32, 64}});
    t.push_back({p + "up_proj.weight", {32, 64}});
    t.push_back({p + "down_proj.weight", {64, 32}});
  }
  for (auto& x : m.Tail()) t.push_back(x);
  nlohmann::json config = m.Config();
  config["model_type"] = "qwen3_moe";
  config["num_experts"] = 4;
  const std::string dir = Make("qwen3_moe", t, config, 3);
  // Experts under TP: every rank holds every expert's half.
  auto tp = PlanAll(dir, 2);
  EXPECT_EQ(S(tp["model.layers.1.mlp.experts.2.up_proj.weight"][1]), S(0, 16, 16));
  EXPECT_EQ(S(tp["model.layers.1.mlp.experts.2.down_proj.weight"][0]), S(1, 0, 16));
  EXPECT_EQ(S(tp["model.layers.0.mlp.gate_proj.weight"][1]), S(0, 64, 64));
  // Under EP: whole experts, two per rank.
  auto ep = PlanAll(dir, 2, /*ep=*/true);
  EXPECT_EQ(ep["model.layers.1.mlp.experts.1.gate_proj.weight"][0].rank, 0u);
  EXPECT_EQ(ep["model.layers.1.mlp.experts.2.gate_proj.weight"][0].rank, 1u);
  EXPECT_EQ(ep["model.layers.1.mlp.gate.weight"].size(), 2u);
}

// DeepSeek-V3 in miniature: 2 heads of qk 128 / v 128, q_lora 128, kv_lora 64, hidden 128,
// fp8 weights with 128x128 block scales, layer 0 dense, layer 1 MoE (2 routed experts, a
// shared one), and an MTP layer 2 (= num_hidden_layers) the main model skips.
std::vector<TensorSpec> DeepseekTensors() {
  std::vector<TensorSpec> t = {{"model.embed_tokens.weight", {256, 128}}};
  auto fp8 = [&](const std::string& name, uint64_t rows, uint64_t cols) {
    t.push_back({name + ".weight", {rows, cols}, "f8_e4m3"});
    t.push_back({name + ".weight_scale_inv", {(rows + 127) / 128, (cols + 127) / 128}, "f32"});
  };
  for (int layer = 0; layer < 3; ++layer) {
    const std::string p = "model.layers." + std::to_string(layer) + ".";
    fp8(p + "self_attn.q_a_proj", 128, 128);
    t.push_back({p + "self_attn.q_a_layernorm.weight", {128}});
    fp8(p + "self_attn.q_b_proj", 256, 128);
    fp8(p + "self_attn.kv_a_proj_with_mqa", 128, 128);
    t.push_back({p + "self_attn.kv_a_layernorm.weight", {64}});
    fp8(p + "self_attn.kv_b_proj", 512, 64);
    fp8(p + "self_attn.o_proj", 128, 256);
    t.push_back({p + "input_layernorm.weight", {128}});
    t.push_back({p + "post_attention_layernorm.weight", {128}});
    if (layer == 0) {
      fp8(p + "mlp.gate_proj", 256, 128);
      fp8(p + "mlp.up_proj", 256, 128);
      fp8(p + "mlp.down_proj", 128, 256);
      continue;
    }
    t.push_back({p + "mlp.gate.weight", {2, 128}});
    t.push_back({p + "mlp.gate.e_score_correction_bias", {2}, "f32"});
    for (const std::string e : {"experts.0.", "experts.1.", "shared_experts."}) {
      fp8(p + "mlp." + e + "gate_proj", 256, 128);
      fp8(p + "mlp." + e + "up_proj", 256, 128);
      fp8(p + "mlp." + e + "down_proj", 128, 256);
    }
    if (layer == 2) {  // the MTP layer's own tensors
      t.push_back({p + "enorm.weight", {128}});
      t.push_back({p + "hnorm.weight", {128}});
      t.push_back({p + "eh_proj.weight", {128, 256}});
      t.push_back({p + "shared_head.norm.weight", {128}});
    }
  }
  t.push_back({"model.norm.weight", {128}});
  t.push_back({"lm_head.weight", {256, 128}});
  return t;
}

TEST_F(BuiltinSetsTest, DeepseekV3BlockScalesExpertsAndMtp) {
  const nlohmann::json config = {
      {"model_type", "deepseek_v3"}, {"num_hidden_layers", 2},     {"num_attention_heads", 2},
      {"n_routed_experts", 2},       {"first_k_dense_replace", 1}, {"vocab_size", 256},
      {"q_lora_rank", 128},          {"kv_lora_rank", 64},         {"tie_word_embeddings", false}};
  const std::string dir = Make("deepseek", DeepseekTensors(), config, 2);
  // The MTP layer (2) is held by no rank; PlanAll would flag it, so plan directly.
  Result<checkpoint::Checkpoint> c = checkpoint::Checkpoint::Open(dir);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  Result<RuleSet> rules = BuiltinRuleSet("deepseek_v3");
  ASSERT_TRUE(rules.ok());
  Result<ModelConfig> mc = ReadModelConfig(dir);
  ASSERT_TRUE(mc.ok());
  std::map<std::string, const PlannedTensor*> r1;
  Result<ShardPlan> plan = PlanShard(*c, *rules, *mc, Ranks{.tp_size = 2, .tp_rank = 1});
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  for (const PlannedTensor& p : plan->tensors) {
    EXPECT_FALSE(p.tensor->name.starts_with("model.layers.2.")) << p.tensor->name;
    r1[p.tensor->name] = &p;
  }
  auto slice = [&](const std::string& name) {
    EXPECT_EQ(r1.count(name), 1u) << name;
    const PlannedTensor* p = r1[name];
    return p == nullptr || !p->slice
               ? std::nullopt
               : std::optional(std::make_tuple(p->slice->dim, p->slice->offset, p->slice->length));
  };
  const std::string a = "model.layers.1.self_attn.";
  EXPECT_EQ(slice(a + "q_b_proj.weight"), S(0, 128, 128));
  EXPECT_EQ(slice(a + "q_b_proj.weight_scale_inv"), S(0, 1, 1));
  EXPECT_EQ(slice(a + "kv_b_proj.weight"), S(0, 256, 256));
  EXPECT_EQ(slice(a + "kv_b_proj.weight_scale_inv"), S(0, 2, 2));
  EXPECT_EQ(slice(a + "o_proj.weight"), S(1, 128, 128));
  EXPECT_EQ(slice(a + "o_proj.weight_scale_inv"), S(1, 1, 1));
  EXPECT_EQ(slice(a + "q_a_proj.weight_scale_inv"), std::nullopt);
  EXPECT_EQ(slice(a + "kv_a_proj_with_mqa.weight"), std::nullopt);
  EXPECT_EQ(slice("model.layers.0.mlp.down_proj.weight_scale_inv"), S(1, 1, 1));
  EXPECT_EQ(slice("model.layers.1.mlp.shared_experts.up_proj.weight_scale_inv"), S(0, 1, 1));
  EXPECT_EQ(slice("model.layers.1.mlp.experts.1.gate_proj.weight"), S(0, 128, 128));
  EXPECT_EQ(slice("model.layers.1.mlp.experts.1.gate_proj.weight_scale_inv"), S(0, 1, 1));
  EXPECT_EQ(slice("model.layers.1.mlp.experts.0.down_proj.weight_scale_inv"), S(1, 1, 1));
  EXPECT_EQ(slice("model.layers.1.mlp.gate.e_score_correction_bias"), std::nullopt);
  EXPECT_EQ(r1["model.layers.1.mlp.experts.0.down_proj.weight_scale_inv"]->mode, Mode::kExpert);

  // Under EP 2 each rank holds one routed expert, whole, scales included.
  Result<ShardPlan> ep =
      PlanShard(*c, *rules, *mc, Ranks{.tp_size = 2, .tp_rank = 0, .ep_size = 2, .ep_rank = 0});
  ASSERT_TRUE(ep.ok()) << ep.status().ToString();
  bool saw0 = false;
  for (const PlannedTensor& p : ep->tensors) {
    EXPECT_FALSE(p.tensor->name.starts_with("model.layers.1.mlp.experts.1.")) << p.tensor->name;
    if (p.tensor->name == "model.layers.1.mlp.experts.0.up_proj.weight_scale_inv") {
      saw0 = true;
      EXPECT_EQ(p.slice, std::nullopt);
    }
  }
  EXPECT_TRUE(saw0);

  // Without num_hidden_layers the MTP layer cannot be told apart.
  nlohmann::json no_layers = config;
  no_layers.erase("num_hidden_layers");
  const std::string nl = Make("deepseek_nl", DeepseekTensors(), no_layers);
  Result<checkpoint::Checkpoint> c2 = checkpoint::Checkpoint::Open(nl);
  ASSERT_TRUE(c2.ok());
  Result<ShardPlan> bad = PlanShard(*c2, *rules, *ReadModelConfig(nl), Ranks{});
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidCheckpoint);
  EXPECT_THAT(bad.status().message(), HasSubstr("needs num_hidden_layers"));
}

}  // namespace
}  // namespace weightcache::sharding
