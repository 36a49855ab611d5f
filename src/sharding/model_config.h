// The fields of a checkpoint's config.json that the sharding rules need.
//
// Contract: config.json is untrusted input. ReadModelConfig bounds its size
// (kMaxConfigBytes), refuses duplicate keys and checks the type of every field it knows
// (integers non-negative and exact, tie_word_embeddings a boolean, model_type a string);
// each failure is kInvalidCheckpoint naming the file and the key. Fields the file lacks are
// simply absent: a rule that needs one reports it when it is used. Other top-level integer
// values are kept too, so that a rule's "heads" may name any config key. Pure, thread-safe.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>

#include "weightcache/status.h"

namespace weightcache::sharding {

inline constexpr uint64_t kMaxConfigBytes = 4 << 20;
inline constexpr std::string_view kConfigFileName = "config.json";

struct ModelConfig {
  std::string path;        // where it was read from ("" when there was no config.json)
  std::string model_type;  // "" when absent
  bool tie_word_embeddings = false;
  // Every top-level non-negative integer value, by key (num_attention_heads, vocab_size...).
  std::map<std::string, uint64_t, std::less<>> integers;

  std::optional<uint64_t> Integer(std::string_view key) const;
  // num_key_value_heads, else num_attention_heads (as vLLM and transformers default it).
  std::optional<uint64_t> NumKvHeads() const;
  // num_local_experts (mixtral) | num_experts (qwen3_moe) | n_routed_experts (deepseek_v3);
  // the key found is stored in `key`.
  std::optional<uint64_t> NumExperts(std::string* key = nullptr) const;
};

// Parses config.json text; `path` names it in errors.
Result<ModelConfig> ParseModelConfig(std::string_view text, const std::string& path);

// The config.json of a model: `model` is a checkpoint directory or a .safetensors file (its
// directory is used). No config.json: an empty ModelConfig (path ""), not an error.
Result<ModelConfig> ReadModelConfig(const std::string& model);

}  // namespace weightcache::sharding
