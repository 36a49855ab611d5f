// The one strict reader of untrusted JSON: socket frames, rules files, config.json, the budget
// ledger, registry entries, device inventories. nlohmann keeps the last of duplicate keys
// silently, so a document with two values for one key is ambiguous (two texts that differ
// only in which comes last would read alike); and destroying or printing a value recurses, so
// nesting is capped while the parse runs. Pure, thread-safe.
#pragma once

#include <cstddef>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

namespace weightcache {

struct StrictJsonLimits {
  int max_depth = 64;                   // levels of objects and arrays
  size_t max_bytes = size_t{64} << 20;  // the text's size
};

// What ParseStrictJson says of text that does not parse.
inline constexpr std::string_view kNotValidJson = "not valid JSON";

// Parses `text` into `out`. Returns "" on success, else what is wrong, for the caller to put
// in its own error: kNotValidJson, "duplicate key \"name\"", "JSON nested deeper than 16
// levels", "JSON of 70000000 bytes, over the limit of 67108864".
std::string ParseStrictJson(std::string_view text, nlohmann::json& out,
                            StrictJsonLimits limits = {});

}  // namespace weightcache
