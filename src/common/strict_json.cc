#include "common/strict_json.h"

#include <functional>
#include <set>
#include <vector>

namespace weightcache {
namespace {

using nlohmann::json;

// Records the first duplicate key of any object, at any depth, and whether the document nests
// deeper than allowed: a value below that depth is discarded at once, so the tree stays
// shallow while the parse finishes.
struct Check {
  int max_depth;
  std::vector<std::set<std::string, std::less<>>> open;  // the keys of each object being parsed
  std::string duplicate;
  bool too_deep = false;

  bool operator()(int depth, json::parse_event_t event, json& parsed) {
    if (depth > max_depth) {
      too_deep = true;
      return false;
    }
    if (event == json::parse_event_t::object_start) {
      open.emplace_back();
    } else if (event == json::parse_event_t::object_end) {
      if (!open.empty()) open.pop_back();
    } else if (event == json::parse_event_t::key && !open.empty() && parsed.is_string() &&
               !open.back().insert(parsed.get<std::string>()).second && duplicate.empty()) {
      duplicate = parsed.get<std::string>();
    }
    return true;
  }
};

}  // namespace

std::string ParseStrictJson(std::string_view text, nlohmann::json& out, StrictJsonLimits limits) {
  out = json();
  if (text.size() > limits.max_bytes) {
    return "JSON of " + std::to_string(text.size()) + " bytes, over the limit of " +
           std::to_string(limits.max_bytes);
  }
  Check check{.max_depth = limits.max_depth, .open = {}, .duplicate = {}};
  json parsed = json::parse(text, std::ref(check), /*allow_exceptions=*/false);
  if (check.too_deep) {
    return "JSON nested deeper than " + std::to_string(limits.max_depth) + " levels";
  }
  if (parsed.is_discarded()) return std::string(kNotValidJson);
  if (!check.duplicate.empty()) return "duplicate key \"" + check.duplicate.substr(0, 64) + "\"";
  out = std::move(parsed);
  return "";
}

}  // namespace weightcache
