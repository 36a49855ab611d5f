#include "sharding/strict_json.h"

#include <functional>
#include <set>
#include <vector>

namespace weightcache::sharding {
namespace {

using nlohmann::json;

// Records the first duplicate key of any object, at any depth.
struct DuplicateKeyCheck {
  std::vector<std::set<std::string>> open;  // the keys of each object being parsed
  std::string duplicate;
  bool operator()(int /*depth*/, json::parse_event_t event, json& parsed) {
    if (event == json::parse_event_t::object_start) {
      open.emplace_back();
    } else if (event == json::parse_event_t::object_end) {
      if (!open.empty()) open.pop_back();
    } else if (event == json::parse_event_t::key) {
      if (!open.empty() && !open.back().insert(parsed.get<std::string>()).second &&
          duplicate.empty()) {
        duplicate = parsed.get<std::string>();
      }
    }
    return true;
  }
};

}  // namespace

std::string ParseStrictJson(std::string_view text, nlohmann::json& out) {
  DuplicateKeyCheck dup;
  out = json::parse(text, std::ref(dup), /*allow_exceptions=*/false);
  if (out.is_discarded()) return "not valid JSON";
  if (!dup.duplicate.empty()) return "duplicate key \"" + dup.duplicate + "\"";
  return "";
}

}  // namespace weightcache::sharding
