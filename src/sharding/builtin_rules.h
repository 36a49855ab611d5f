// The built-in shard rule sets: JSON text compiled into the binary (docs/sharding.md lists
// them and says which engine layers each rule follows). Parsed by sharding::ParseRuleSet
// like any rules file.
#pragma once

#include <span>
#include <string>
#include <string_view>

namespace weightcache::sharding {

// What picks a set: a model's set is also the default for the config.json model_type of its
// name; a generic one (`replicate`) is given by name only (--shard-rules NAME), and the errors
// that ask for --shard-rules offer it with its summary.
enum class BuiltinKind { kModel, kGeneric };

struct BuiltinRuleSetEntry {
  std::string_view name;  // kModel: the config.json model_type it serves
  std::string text;       // the rules document, format 1
  BuiltinKind kind = BuiltinKind::kModel;
  std::string_view summary = {};  // kGeneric: what it holds, for the errors and the docs
};

// Every built-in set, in listing order. Built once, on first use; thread-safe.
std::span<const BuiltinRuleSetEntry> BuiltinRuleSets();

}  // namespace weightcache::sharding
