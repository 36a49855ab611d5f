// Strict JSON parsing for the sharding inputs (rules files, config.json): nlohmann keeps the
// last of duplicate keys silently, and a document with two values for one key is ambiguous,
// so it is refused. Pure, thread-safe.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

namespace weightcache::sharding {

// Parses `text` into `out`. Returns "" on success, else what is wrong ("not valid JSON",
// "duplicate key \"name\"").
std::string ParseStrictJson(std::string_view text, nlohmann::json& out);

}  // namespace weightcache::sharding
