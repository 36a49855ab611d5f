#include "sharding/builtin_rules.h"

#include <vector>

namespace weightcache::sharding {
namespace {

// Rule fragments shared by several sets, one rule a line. Regular expressions are written
// for JSON (a backslash doubled).

// Input embedding: vocab-parallel, on the first stage (and on the last one too when the
// lm_head is tied to it: stage "embed").
constexpr const char* kEmbed = R"json(
    {"match": "model\\.embed_tokens\\.weight", "mode": "vocab", "stage": "embed"},)json";

// Llama-style attention: QKVParallelLinear (q by heads, k/v by kv heads, biases like their
// weight), RowParallelLinear o_proj.
constexpr const char* kAttention = R"json(
    {"match": "model\\.layers\\.(\\d+)\\.self_attn\\.q_proj\\.(weight|bias)", "mode": "split", "dim": 0, "heads": "num_attention_heads", "stage": "layer"},
    {"match": "model\\.layers\\.(\\d+)\\.self_attn\\.[kv]_proj\\.(weight|bias)", "mode": "kv_heads", "stage": "layer"},
    {"match": "model\\.layers\\.(\\d+)\\.self_attn\\.o_proj\\.weight", "mode": "split", "dim": 1, "heads": "num_attention_heads", "stage": "layer"},
    {"match": "model\\.layers\\.(\\d+)\\.self_attn\\.o_proj\\.bias", "mode": "replicate", "stage": "layer", "optional": true},
    {"match": "model\\.layers\\.(\\d+)\\.self_attn\\.rotary_emb\\.inv_freq", "mode": "skip", "optional": true},)json";

// Qwen3's per-head RMSNorm on q and k.
constexpr const char* kQkNorm = R"json(
    {"match": "model\\.layers\\.(\\d+)\\.self_attn\\.[qk]_norm\\.weight", "mode": "replicate", "stage": "layer", "optional": true},)json";

constexpr const char* kLayerNorms = R"json(
    {"match": "model\\.layers\\.(\\d+)\\.(input_layernorm|post_attention_layernorm)\\.weight", "mode": "replicate", "stage": "layer"},)json";

// MergedColumnParallelLinear gate_up, RowParallelLinear down.
constexpr const char* kDenseMlp = R"json(
    {"match": "model\\.layers\\.(\\d+)\\.mlp\\.(gate_proj|up_proj)\\.weight", "mode": "split", "dim": 0, "stage": "layer"},
    {"match": "model\\.layers\\.(\\d+)\\.mlp\\.down_proj\\.weight", "mode": "split", "dim": 1, "stage": "layer"},)json";

// The same for MoE models where only some layers are dense (Qwen3-MoE mlp_only_layers).
constexpr const char* kOptionalDenseMlp = R"json(
    {"match": "model\\.layers\\.(\\d+)\\.mlp\\.(gate_proj|up_proj)\\.weight", "mode": "split", "dim": 0, "stage": "layer", "optional": true},
    {"match": "model\\.layers\\.(\\d+)\\.mlp\\.down_proj\\.weight", "mode": "split", "dim": 1, "stage": "layer", "optional": true},)json";

// Final norm and (untied) lm_head, on the last stage.
constexpr const char* kTail = R"json(
    {"match": "model\\.norm\\.weight", "mode": "replicate", "stage": "last"},
    {"match": "lm_head\\.weight", "mode": "vocab", "stage": "last", "optional": true})json";

constexpr const char* kMixtralMoe = R"json(
    {"match": "model\\.layers\\.(\\d+)\\.block_sparse_moe\\.gate\\.weight", "mode": "replicate", "stage": "layer"},
    {"match": "model\\.layers\\.(\\d+)\\.block_sparse_moe\\.experts\\.(\\d+)\\.w[13]\\.weight", "mode": "expert", "dim": 0, "stage": "layer"},
    {"match": "model\\.layers\\.(\\d+)\\.block_sparse_moe\\.experts\\.(\\d+)\\.w2\\.weight", "mode": "expert", "dim": 1, "stage": "layer"},)json";

constexpr const char* kQwen3Moe = R"json(
    {"match": "model\\.layers\\.(\\d+)\\.mlp\\.gate\\.weight", "mode": "replicate", "stage": "layer"},
    {"match": "model\\.layers\\.(\\d+)\\.mlp\\.experts\\.(\\d+)\\.(gate_proj|up_proj)\\.weight", "mode": "expert", "dim": 0, "stage": "layer"},
    {"match": "model\\.layers\\.(\\d+)\\.mlp\\.experts\\.(\\d+)\\.down_proj\\.weight", "mode": "expert", "dim": 1, "stage": "layer"},)json";

// DeepSeek-V3: MLA attention, fp8 weights with 128x128 block scales (weight_scale_inv), a
// router with a correction bias, shared experts, dense first layers, and MTP layers past
// num_hidden_layers that the main model does not load (the first rule: a skip rule with
// stage "layer" applies to layer indices >= num_hidden_layers only).
constexpr const char* kDeepseekV3 = R"json(
    {"match": "model\\.layers\\.(\\d+)\\..*", "mode": "skip", "stage": "layer", "optional": true},
    {"match": "model\\.embed_tokens\\.weight", "mode": "vocab", "stage": "embed"},
    {"match": "model\\.layers\\.(\\d+)\\.self_attn\\.kv_a_proj_with_mqa\\.(weight|weight_scale_inv)", "mode": "replicate", "stage": "layer"},
    {"match": "model\\.layers\\.(\\d+)\\.self_attn\\.(q_a_proj\\.weight|q_a_proj\\.weight_scale_inv|q_a_layernorm\\.weight)", "mode": "replicate", "stage": "layer", "optional": true},
    {"match": "model\\.layers\\.(\\d+)\\.self_attn\\.kv_a_layernorm\\.weight", "mode": "replicate", "stage": "layer"},
    {"match": "model\\.layers\\.(\\d+)\\.self_attn\\.(q_b_proj|q_proj|kv_b_proj)\\.weight", "mode": "split", "dim": 0, "heads": "num_attention_heads", "stage": "layer"},
    {"match": "model\\.layers\\.(\\d+)\\.self_attn\\.(q_b_proj|q_proj|kv_b_proj)\\.weight_scale_inv", "mode": "split", "dim": 0, "heads": "num_attention_heads", "block": 128, "stage": "layer", "optional": true},
    {"match": "model\\.layers\\.(\\d+)\\.self_attn\\.o_proj\\.weight", "mode": "split", "dim": 1, "heads": "num_attention_heads", "stage": "layer"},
    {"match": "model\\.layers\\.(\\d+)\\.self_attn\\.o_proj\\.weight_scale_inv", "mode": "split", "dim": 1, "heads": "num_attention_heads", "block": 128, "stage": "layer", "optional": true},
    {"match": "model\\.layers\\.(\\d+)\\.(input_layernorm|post_attention_layernorm)\\.weight", "mode": "replicate", "stage": "layer"},
    {"match": "model\\.layers\\.(\\d+)\\.mlp\\.gate\\.(weight|e_score_correction_bias)", "mode": "replicate", "stage": "layer"},
    {"match": "model\\.layers\\.(\\d+)\\.mlp\\.experts\\.(\\d+)\\.(gate_proj|up_proj)\\.weight", "mode": "expert", "dim": 0, "stage": "layer"},
    {"match": "model\\.layers\\.(\\d+)\\.mlp\\.experts\\.(\\d+)\\.(gate_proj|up_proj)\\.weight_scale_inv", "mode": "expert", "dim": 0, "block": 128, "stage": "layer", "optional": true},
    {"match": "model\\.layers\\.(\\d+)\\.mlp\\.experts\\.(\\d+)\\.down_proj\\.weight", "mode": "expert", "dim": 1, "stage": "layer"},
    {"match": "model\\.layers\\.(\\d+)\\.mlp\\.experts\\.(\\d+)\\.down_proj\\.weight_scale_inv", "mode": "expert", "dim": 1, "block": 128, "stage": "layer", "optional": true},
    {"match": "model\\.layers\\.(\\d+)\\.mlp\\.(shared_experts\\.)?(gate_proj|up_proj)\\.weight", "mode": "split", "dim": 0, "stage": "layer"},
    {"match": "model\\.layers\\.(\\d+)\\.mlp\\.(shared_experts\\.)?(gate_proj|up_proj)\\.weight_scale_inv", "mode": "split", "dim": 0, "block": 128, "stage": "layer", "optional": true},
    {"match": "model\\.layers\\.(\\d+)\\.mlp\\.(shared_experts\\.)?down_proj\\.weight", "mode": "split", "dim": 1, "stage": "layer"},
    {"match": "model\\.layers\\.(\\d+)\\.mlp\\.(shared_experts\\.)?down_proj\\.weight_scale_inv", "mode": "split", "dim": 1, "block": 128, "stage": "layer", "optional": true},)json";

// Every tensor whole on every rank and stage: for an engine that shards by itself (or not at
// all) a checkpoint whose model_type has no set here, one cache per rank.
constexpr const char* kReplicateAll = R"json(
    {"match": ".*", "mode": "replicate", "stage": "all"})json";

std::string Document(std::string_view name, std::initializer_list<const char*> fragments) {
  std::string text = "{\n  \"format\": 1,\n  \"name\": \"" + std::string(name) +
                     "\",\n  \"pp_partition\": \"vllm\",\n  \"rules\": [";
  for (const char* f : fragments) text += f;
  text += "\n  ]\n}\n";
  return text;
}

std::vector<BuiltinRuleSetEntry> Build() {
  std::vector<BuiltinRuleSetEntry> sets;
  for (std::string_view dense : {"llama", "mistral", "qwen2"}) {
    sets.push_back({dense, Document(dense, {kEmbed, kAttention, kLayerNorms, kDenseMlp, kTail})});
  }
  sets.push_back(
      {"qwen3", Document("qwen3", {kEmbed, kAttention, kQkNorm, kLayerNorms, kDenseMlp, kTail})});
  sets.push_back(
      {"mixtral", Document("mixtral", {kEmbed, kAttention, kLayerNorms, kMixtralMoe, kTail})});
  sets.push_back({"qwen3_moe", Document("qwen3_moe", {kEmbed, kAttention, kQkNorm, kLayerNorms,
                                                      kQwen3Moe, kOptionalDenseMlp, kTail})});
  sets.push_back({"deepseek_v3", Document("deepseek_v3", {kDeepseekV3, kTail})});
  sets.push_back({"replicate", Document("replicate", {kReplicateAll}), BuiltinKind::kGeneric,
                  "every tensor whole on every rank"});
  return sets;
}

}  // namespace

std::span<const BuiltinRuleSetEntry> BuiltinRuleSets() {
  static const std::vector<BuiltinRuleSetEntry> kSets = Build();
  return kSets;
}

}  // namespace weightcache::sharding
