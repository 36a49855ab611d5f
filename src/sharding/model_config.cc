#include "sharding/model_config.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <nlohmann/json.hpp>

#include "common/strict_json.h"
#include "os/read_file.h"

namespace weightcache::sharding {
namespace {

using nlohmann::json;

// Keys whose type is checked strictly: a config.json where one of them has another type is
// refused rather than half-used.
constexpr std::string_view kIntegerKeys[] = {
    "num_attention_heads", "num_key_value_heads", "num_hidden_layers", "vocab_size",
    "num_local_experts",   "num_experts",         "n_routed_experts",  "first_k_dense_replace",
};

}  // namespace

std::optional<uint64_t> ModelConfig::Integer(std::string_view key) const {
  auto it = integers.find(key);
  if (it == integers.end()) return std::nullopt;
  return it->second;
}

std::optional<uint64_t> ModelConfig::NumKvHeads() const {
  if (auto v = Integer("num_key_value_heads")) return v;
  return Integer("num_attention_heads");
}

std::optional<uint64_t> ModelConfig::NumExperts(std::string* key) const {
  for (std::string_view k : {"num_local_experts", "num_experts", "n_routed_experts"}) {
    if (auto v = Integer(k)) {
      if (key != nullptr) *key = std::string(k);
      return v;
    }
  }
  return std::nullopt;
}

Result<ModelConfig> ParseModelConfig(std::string_view text, const std::string& path) {
  json doc;
  if (std::string error = ParseStrictJson(text, doc); !error.empty()) {
    return InvalidCheckpoint(path + ": " + error);
  }
  if (!doc.is_object()) return InvalidCheckpoint(path + ": not a JSON object");
  ModelConfig config;
  config.path = path;
  if (auto it = doc.find("model_type"); it != doc.end()) {
    if (!it->is_string()) return InvalidCheckpoint(path + ": \"model_type\" must be a string");
    config.model_type = it->get<std::string>();
  }
  if (auto it = doc.find("tie_word_embeddings"); it != doc.end()) {
    if (!it->is_boolean()) {
      return InvalidCheckpoint(path + ": \"tie_word_embeddings\" must be true or false");
    }
    config.tie_word_embeddings = it->get<bool>();
  }
  for (std::string_view key : kIntegerKeys) {
    auto it = doc.find(std::string(key));
    if (it == doc.end() || it->is_null()) continue;  // null: "not set", as transformers writes
    if (!it->is_number_unsigned()) {
      return InvalidCheckpoint(path + ": \"" + std::string(key) + "\" is " + it->dump() +
                               ", not a non-negative integer");
    }
  }
  for (const auto& [key, value] : doc.items()) {
    if (value.is_number_unsigned()) config.integers.emplace(key, value.get<uint64_t>());
  }
  return config;
}

Result<ModelConfig> ReadModelConfig(const std::string& model) {
  struct stat st {};
  std::string dir = model;
  if (::stat(model.c_str(), &st) == 0 && !S_ISDIR(st.st_mode)) {
    const size_t slash = model.rfind('/');
    dir = slash == std::string::npos ? "." : model.substr(0, slash);
  }
  const std::string path = dir + "/" + std::string(kConfigFileName);
  struct stat cst {};
  if (::lstat(path.c_str(), &cst) != 0 && errno == ENOENT) return ModelConfig{};
  WEIGHTCACHE_ASSIGN_OR_RETURN(
      std::string text, os::ReadSmallFile(path, kMaxConfigBytes, StatusCode::kInvalidCheckpoint));
  return ParseModelConfig(text, path);
}

}  // namespace weightcache::sharding
