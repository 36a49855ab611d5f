// Sharding rules (issue 12 §1): which slice of each checkpoint tensor a tensor-, pipeline- and
// expert-parallel rank holds, as a declarative JSON document (docs/sharding.md is the
// reference for the format and its semantics).
//
// Contract:
//  * ParseRuleSet validates a rules document completely before it is used: format 1, known
//    keys only, no duplicate keys, every regular expression compiles (ECMAScript, matched
//    against the whole tensor name), every mode and stage known, the capture groups a mode
//    needs present. A failure is kInvalidArgument (CLI exit 2) naming the rule by index and
//    match string.
//  * The digest is the SHA-256 hex of the document's canonical JSON: the document as given,
//    keys sorted, no whitespace, non-ASCII escaped as \uXXXX (what Python's
//    json.dumps(obj, sort_keys=True, separators=(",", ":")) writes). A built-in set and its
//    --print-rules text saved to a file have the same digest.
//  * Built-in sets are JSON text compiled into the binary and parsed by the same function.
//  * A RuleSet is immutable after parsing; its const methods are thread-safe.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <regex>
#include <string>
#include <string_view>
#include <vector>

#include "weightcache/enum_names.h"
#include "weightcache/status.h"

namespace weightcache::sharding {

enum class Mode : uint8_t { kSplit, kReplicate, kVocab, kKvHeads, kExpert, kSkip };
inline constexpr std::array<EnumName<Mode>, 6> kModeNames{{
    {Mode::kSplit, "split"},
    {Mode::kReplicate, "replicate"},
    {Mode::kVocab, "vocab"},
    {Mode::kKvHeads, "kv_heads"},
    {Mode::kExpert, "expert"},
    {Mode::kSkip, "skip"},
}};
static_assert(IsDenseEnumTable(kModeNames));
enum class Stage : uint8_t { kAll, kLayer, kFirst, kLast, kEmbed };
inline constexpr std::array<EnumName<Stage>, 5> kStageNames{{
    {Stage::kAll, "all"},
    {Stage::kLayer, "layer"},
    {Stage::kFirst, "first"},
    {Stage::kLast, "last"},
    {Stage::kEmbed, "embed"},
}};
static_assert(IsDenseEnumTable(kStageNames));
// How layers are assigned to pipeline stages: vLLM's or SGLang's get_pp_indices.
enum class PpPartition : uint8_t { kVllm, kSglang };
// Where a rule set came from (the plan's "rules.source").
enum class RuleSource : uint8_t { kBuiltin, kFile };

std::string_view ModeName(Mode mode);
std::string_view StageName(Stage stage);

// One rule of a set. `regex` is compiled once, at parse.
struct Rule {
  size_t index = 0;   // position in the set ("rule 3")
  std::string match;  // the pattern as written
  Mode mode = Mode::kReplicate;
  std::optional<uint32_t> dim;  // split dim (split, vocab = 0); inside an expert (expert)
  std::string heads;            // config.json key whose value must be divisible by tp ("" none)
  uint64_t block = 0;           // > 0: a block-quantization scale, split with its weight
  Stage stage = Stage::kAll;
  bool optional = false;
  std::regex regex;
  // What every matching name must hold, found in `match` at parse, so that most names are
  // refused without running the regex: literal pieces it contains, the literal it starts
  // with and the one it ends with. All empty when the pattern has a top-level alternation.
  std::vector<std::string> required_literals;
  std::string literal_prefix;
  std::string literal_suffix;
  // The pattern is literal_prefix, then (\d+), then a literal non-digit: capture group 1 is
  // the whole digit run after the prefix, readable without the regex.
  bool group1_follows_prefix = false;

  // "rule 3 (model\.norm\.weight)": how errors name a rule.
  std::string Describe() const;
  // True when `name` matches the whole pattern; fills `groups` with the capture groups.
  bool Matches(const std::string& name, std::smatch& groups) const;
};

struct RuleSet {
  std::string name;
  RuleSource source = RuleSource::kFile;
  PpPartition pp_partition = PpPartition::kVllm;
  std::vector<Rule> rules;
  std::string canonical_json;  // see the contract above
  std::string digest;          // SHA-256 hex of canonical_json
};

// Bound on a rules file.
inline constexpr uint64_t kMaxRulesFileBytes = 1 << 20;

// Parses a rules document. `origin` names it in errors (a path, or "built-in set llama").
Result<RuleSet> ParseRuleSet(std::string_view json_text, RuleSource source,
                             const std::string& origin);

// Reads and parses a rules file (bounded by kMaxRulesFileBytes). The file is one the user
// named (--shard-rules): a missing or unreadable one is kInvalidArgument like a malformed one
// (a usage error, exit 2), naming the path and the built-in sets it is not either.
Result<RuleSet> LoadRuleSetFile(const std::string& path);

// The names of the built-in sets, in listing order.
std::vector<std::string_view> BuiltinRuleSetNames();
// The JSON text of a built-in set; kInvalidArgument naming the known sets for another name.
Result<std::string_view> BuiltinRuleSetText(std::string_view name);
// The parsed built-in set.
Result<RuleSet> BuiltinRuleSet(std::string_view name);

// The rule set for a checkpoint: `spec` (a built-in name, else a rules file path) when not
// empty, otherwise the built-in model set for config.json's model_type (a generic set such as
// `replicate` is never picked by model_type). kInvalidArgument when `spec` is empty and
// model_type is empty or has no built-in set ("give --shard-rules NAME|FILE", offering the
// generic sets: "--shard-rules replicate: every tensor whole on every rank"), and for a `spec`
// that is neither a built-in name nor a readable rules file.
Result<RuleSet> SelectRuleSet(const std::string& spec, const std::string& model_type);

}  // namespace weightcache::sharding
