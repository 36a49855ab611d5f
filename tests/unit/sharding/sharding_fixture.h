// Test fixture for the sharding planner: small synthetic checkpoints written by
// tests/tools/make_checkpoint.py --spec (the real `safetensors` library) with a config.json,
// in a fresh temp dir, and model builders for the built-in rule sets' architectures.
// Skips when Python's safetensors is missing.
#pragma once

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "sharding/model_config.h"
#include "sharding/rules.h"
#include "support/test_env.h"
#include "unit/checkpoint/checkpoint_fixture.h"
#include "weightcache/status.h"

namespace weightcache::sharding::testing {

// A slice as (dim, offset, length): the tests' expectations compare each planned slice (their
// own S(...) overloads turn a planned tensor into one) with this.
inline std::optional<std::tuple<uint32_t, uint64_t, uint64_t>> S(uint32_t dim, uint64_t offset,
                                                                 uint64_t length) {
  return std::make_tuple(dim, offset, length);
}

// A Status (or the status of a Result) with this code and a message matching `message`.
MATCHER_P2(StatusIs, code, message, "") {
  const Status s = [&] {
    if constexpr (std::is_same_v<std::decay_t<arg_type>, Status>) {
      return arg;
    } else {
      return arg.status();
    }
  }();
  *result_listener << "status is " << s.ToString();
  return s.code() == code && ::testing::ExplainMatchResult(message, s.message(), result_listener);
}

struct TensorSpec {
  std::string name;
  std::vector<uint64_t> shape;
  std::string dtype = "bf16";
};

// The checkpoint fixture's Python probe (skip without safetensors) and temp dir; Make here
// writes tensors from a spec instead of make_checkpoint.py's random set.
class ShardingFixture : public checkpoint::testing::CheckpointFixture {
 protected:
  // Writes the tensors (in this order, split into `shards` files) and, unless it is null,
  // config.json; returns the checkpoint directory.
  std::string Make(const std::string& name, const std::vector<TensorSpec>& tensors,
                   const nlohmann::json& config, int shards = 1) {
    nlohmann::json spec = nlohmann::json::array();
    for (const TensorSpec& t : tensors) {
      spec.push_back({{"name", t.name}, {"shape", t.shape}, {"dtype", t.dtype}});
    }
    const std::string spec_path = tmp_.Join(name + ".spec.json");
    weightcache::testing::WriteFile(spec_path, spec.dump());
    const std::string out = tmp_.Join(name);
    auto r = weightcache::testing::RunCommand(
        {weightcache::testing::PythonExe(),
         weightcache::testing::SourceDir() + "/tests/tools/make_checkpoint.py", "--out", out,
         "--spec", spec_path, "--shards", std::to_string(shards)});
    EXPECT_EQ(r.exit_code, 0) << r.err;
    if (!config.is_null()) weightcache::testing::WriteFile(out + "/config.json", config.dump());
    return out;
  }
};

// A checkpoint with the config.json beside it and the built-in rule set its model_type
// selects: what a daemon of that checkpoint plans with.
struct OpenedModel {
  checkpoint::Checkpoint ckpt;
  ModelConfig config;
  RuleSet rules;
};
inline Result<OpenedModel> OpenWithBuiltinRules(const std::string& dir) {
  WEIGHTCACHE_ASSIGN_OR_RETURN(checkpoint::Checkpoint ckpt, checkpoint::Checkpoint::Open(dir));
  WEIGHTCACHE_ASSIGN_OR_RETURN(ModelConfig config, ReadModelConfig(dir));
  WEIGHTCACHE_ASSIGN_OR_RETURN(RuleSet rules, SelectRuleSet("", config.model_type));
  return OpenedModel{std::move(ckpt), std::move(config), std::move(rules)};
}

// The bytes of `t` that the slice [offset, offset + length) of dim `dim` holds, cut from its
// file bytes by shape arithmetic (independent of the planner's copy geometry): for each index
// of the dims before `dim`, `length` rows of the rest. dim 0, offset 0, length shape[0] (or a
// 0-dim tensor) is the whole tensor.
inline std::string SliceOf(const checkpoint::Checkpoint& ckpt, const checkpoint::TensorInfo& t,
                           uint32_t dim, uint64_t offset, uint64_t length) {
  std::string full(t.nbytes, '\0');
  EXPECT_TRUE(checkpoint::ReadTensor(ckpt, t, full.data()).ok()) << t.name;
  if (t.shape.empty()) return full;
  uint64_t elems = 1;
  for (uint64_t d : t.shape) elems *= d;
  if (elems == 0) return "";
  uint64_t outer = 1, inner = t.nbytes / elems;
  for (uint32_t d = 0; d < dim; ++d) outer *= t.shape[d];
  for (size_t d = dim + 1; d < t.shape.size(); ++d) inner *= t.shape[d];
  std::string out;
  for (uint64_t o = 0; o < outer; ++o) {
    out += full.substr((o * t.shape[dim] + offset) * inner, length * inner);
  }
  return out;
}

// A Llama-family model: `layers` layers, hidden 64, `heads` heads and `kv_heads` kv heads of
// head_dim 16, intermediate 128, vocab `vocab`.
struct DenseModel {
  uint64_t layers = 2;
  uint64_t heads = 4;
  uint64_t kv_heads = 2;
  uint64_t vocab = 256;
  bool qkv_bias = false;
  bool qk_norm = false;
  bool lm_head = true;
  bool tied = false;
  std::string model_type = "llama";

  static constexpr uint64_t kHidden = 64;
  static constexpr uint64_t kHeadDim = 16;
  static constexpr uint64_t kIntermediate = 128;

  std::vector<TensorSpec> Attention(uint64_t i) const {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    std::vector<TensorSpec> t = {
        {p + "self_attn.q_proj.weight", {heads * kHeadDim, kHidden}},
        {p + "self_attn.k_proj.weight", {kv_heads * kHeadDim, kHidden}},
        {p + "self_attn.v_proj.weight", {kv_heads * kHeadDim, kHidden}},
        {p + "self_attn.o_proj.weight", {kHidden, heads * kHeadDim}},
        {p + "input_layernorm.weight", {kHidden}},
        {p + "post_attention_layernorm.weight", {kHidden}},
    };
    if (qkv_bias) {
      t.push_back({p + "self_attn.q_proj.bias", {heads * kHeadDim}});
      t.push_back({p + "self_attn.k_proj.bias", {kv_heads * kHeadDim}});
      t.push_back({p + "self_attn.v_proj.bias", {kv_heads * kHeadDim}});
    }
    if (qk_norm) {
      t.push_back({p + "self_attn.q_norm.weight", {kHeadDim}});
      t.push_back({p + "self_attn.k_norm.weight", {kHeadDim}});
    }
    return t;
  }

  std::vector<TensorSpec> DenseMlp(uint64_t i) const {
    const std::string p = "model.layers." + std::to_string(i) + ".mlp.";
    return {{p + "gate_proj.weight", {kIntermediate, kHidden}},
            {p + "up_proj.weight", {kIntermediate, kHidden}},
            {p + "down_proj.weight", {kHidden, kIntermediate}}};
  }

  std::vector<TensorSpec> Head() const { return {{"model.embed_tokens.weight", {vocab, kHidden}}}; }
  std::vector<TensorSpec> Tail() const {
    std::vector<TensorSpec> t = {{"model.norm.weight", {kHidden}}};
    if (lm_head) t.push_back({"lm_head.weight", {vocab, kHidden}});
    return t;
  }

  std::vector<TensorSpec> Tensors() const {
    std::vector<TensorSpec> t = Head();
    for (uint64_t i = 0; i < layers; ++i) {
      for (auto& x : Attention(i)) t.push_back(x);
      for (auto& x : DenseMlp(i)) t.push_back(x);
    }
    for (auto& x : Tail()) t.push_back(x);
    return t;
  }

  nlohmann::json Config() const {
    return {{"model_type", model_type},     {"num_hidden_layers", layers},
            {"num_attention_heads", heads}, {"num_key_value_heads", kv_heads},
            {"hidden_size", kHidden},       {"vocab_size", vocab},
            {"tie_word_embeddings", tied}};
  }
};

}  // namespace weightcache::sharding::testing
