// The built-in shard rule sets: JSON text compiled into the binary (docs/sharding.md lists
// them and says which engine layers each rule follows). Parsed by sharding::ParseRuleSet
// like any rules file.
#pragma once

#include <span>
#include <string>
#include <string_view>

namespace weightcache::sharding {

struct BuiltinRuleSetEntry {
  std::string_view name;  // the config.json model_type it serves
  std::string text;       // the rules document, format 1
};

// Every built-in set, in listing order. Built once, on first use; thread-safe.
std::span<const BuiltinRuleSetEntry> BuiltinRuleSets();

}  // namespace weightcache::sharding
