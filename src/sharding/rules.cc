#include "sharding/rules.h"

#include <algorithm>
#include <cctype>
#include <nlohmann/json.hpp>
#include <utility>

#include "common/hash.h"
#include "common/strict_json.h"
#include "os/read_file.h"
#include "sharding/builtin_rules.h"
#include "sharding/model_config.h"

namespace weightcache::sharding {
namespace {

using nlohmann::json;

// Largest dim a rule may name: a checkpoint tensor has at most 8 (checkpoint/limits.h).
constexpr uint64_t kMaxDim = 7;

Result<Mode> ParseMode(std::string_view s) {
  if (auto mode = ParseIn(kModeNames, s)) return *mode;
  return InvalidArgument("unknown mode \"" + std::string(s) + "\" (" + NamesIn(kModeNames) + ")");
}

Result<Stage> ParseStage(std::string_view s) {
  if (auto stage = ParseIn(kStageNames, s)) return *stage;
  return InvalidArgument("unknown stage \"" + std::string(s) + "\" (" + NamesIn(kStageNames) + ")");
}

// What every full match of `p` must hold (Rule::required_literals and the fields after it):
// the literal runs outside any group, class or quantifier, split where anything else
// appears; the run the pattern starts with and the one it ends with. Nothing when the
// pattern has an alternation at the top level. A conservative subset is fine: this only
// decides whether the regex is worth running.
void FindLiterals(std::string_view p, Rule& rule) {
  std::vector<std::string> out;
  std::string prefix;
  std::string run;
  int depth = 0;
  bool at_start = true;  // nothing but literal characters so far
  bool group1 = false;
  auto flush = [&] {
    if (at_start) prefix = run;
    at_start = false;
    if (run.size() >= 2) out.push_back(run);
    run.clear();
  };
  auto quantified = [&](size_t next) {
    return next < p.size() &&
           (p[next] == '?' || p[next] == '*' || p[next] == '+' || p[next] == '{');
  };
  auto plain = [](char c) {
    return std::string_view("\\^$.|?*+()[]{}").find(c) == std::string_view::npos;
  };
  for (size_t i = 0; i < p.size(); ++i) {
    const char c = p[i];
    if (c == '\\') {
      if (i + 1 >= p.size()) return;
      const char n = p[++i];
      const bool literal = std::isalnum(static_cast<unsigned char>(n)) == 0;
      if (depth == 0 && literal && !quantified(i + 1)) {
        run += n;
      } else if (depth == 0) {
        flush();
      }
      continue;
    }
    if (c == '[') {  // a class: skip it (a ']' first in the class is a member)
      if (depth == 0) flush();
      size_t j = i + 1;
      if (j < p.size() && p[j] == '^') ++j;
      if (j < p.size() && p[j] == ']') ++j;
      for (; j < p.size() && p[j] != ']'; ++j) {
        if (p[j] == '\\') ++j;
      }
      i = j;
      continue;
    }
    if (c == '(') {
      if (depth == 0 && at_start && p.substr(i, 5) == "(\\d+)") {
        // The digit run is all of group 1 when a literal non-digit follows it.
        const size_t j = i + 5;
        if (j + 1 < p.size() && p[j] == '\\') {
          group1 = std::isalnum(static_cast<unsigned char>(p[j + 1])) == 0 && !quantified(j + 2);
        } else if (j < p.size()) {
          group1 = plain(p[j]) && std::isdigit(static_cast<unsigned char>(p[j])) == 0 &&
                   !quantified(j + 1);
        }
      }
      if (depth == 0) flush();
      ++depth;
      continue;
    }
    if (c == ')') {
      if (--depth < 0) return;
      continue;
    }
    if (c == '|') {
      if (depth == 0) return;
      continue;
    }
    if (depth > 0) continue;
    if (c == '{') {
      flush();
      while (i < p.size() && p[i] != '}') ++i;
      continue;
    }
    if (!plain(c)) {  // . ^ $ ? * +
      flush();
      continue;
    }
    if (quantified(i + 1)) {
      flush();
    } else {
      run += c;
    }
  }
  if (depth != 0) return;
  // The run still open ends the pattern: every match ends with it.
  std::string suffix = run;
  const bool whole = at_start;  // the pattern is one literal
  flush();
  rule.required_literals = std::move(out);
  rule.literal_prefix = std::move(prefix);
  rule.literal_suffix = whole ? std::string() : std::move(suffix);
  rule.group1_follows_prefix = group1;
}

Status CheckKeys(const json& obj, std::initializer_list<std::string_view> known,
                 const std::string& where) {
  for (const auto& [key, value] : obj.items()) {
    if (std::find(known.begin(), known.end(), key) == known.end()) {
      std::string list;
      for (std::string_view k : known) list += (list.empty() ? "" : ", ") + std::string(k);
      return InvalidArgument(where + ": unknown key \"" + key + "\" (known: " + list + ")");
    }
  }
  return Status::Ok();
}

Result<Rule> ParseRule(const json& j, size_t index) {
  Rule rule;
  rule.index = index;
  std::string where = "rule " + std::to_string(index);
  if (!j.is_object()) return InvalidArgument(where + ": not a JSON object");
  if (auto it = j.find("match"); it != j.end() && it->is_string()) {
    rule.match = it->get<std::string>();
    where = rule.Describe();
  }
  WEIGHTCACHE_RETURN_IF_ERROR(
      CheckKeys(j, {"match", "mode", "dim", "heads", "block", "stage", "optional"}, where));
  auto bad = [&](const std::string& what) { return InvalidArgument(where + ": " + what); };

  const auto match = j.find("match");
  if (match == j.end()) return bad("no \"match\"");
  if (!match->is_string() || rule.match.empty()) {
    return bad("\"match\" must be a non-empty string");
  }
  try {
    rule.regex = std::regex(rule.match, std::regex::ECMAScript | std::regex::optimize);
  } catch (const std::regex_error& e) {
    return bad(std::string("\"match\" is not a valid regular expression: ") + e.what());
  }
  FindLiterals(rule.match, rule);

  const auto mode = j.find("mode");
  if (mode == j.end()) return bad("no \"mode\"");
  if (!mode->is_string()) return bad("\"mode\" must be a string");
  Result<Mode> m = ParseMode(mode->get<std::string>());
  if (!m.ok()) return bad(m.status().message());
  rule.mode = *m;

  if (auto it = j.find("dim"); it != j.end()) {
    if (!it->is_number_unsigned() || it->get<uint64_t>() > kMaxDim) {
      return bad("\"dim\" must be an integer from 0 to " + std::to_string(kMaxDim));
    }
    rule.dim = static_cast<uint32_t>(it->get<uint64_t>());
  }
  if (auto it = j.find("heads"); it != j.end()) {
    if (!it->is_string() || it->get<std::string>().empty()) {
      return bad("\"heads\" must be a config.json key (a non-empty string)");
    }
    rule.heads = it->get<std::string>();
  }
  if (auto it = j.find("block"); it != j.end()) {
    if (!it->is_number_unsigned() || it->get<uint64_t>() == 0) {
      return bad("\"block\" must be a positive integer");
    }
    rule.block = it->get<uint64_t>();
  }
  if (auto it = j.find("stage"); it != j.end()) {
    if (!it->is_string()) return bad("\"stage\" must be a string");
    Result<Stage> s = ParseStage(it->get<std::string>());
    if (!s.ok()) return bad(s.status().message());
    rule.stage = *s;
  }
  if (auto it = j.find("optional"); it != j.end()) {
    if (!it->is_boolean()) return bad("\"optional\" must be true or false");
    rule.optional = it->get<bool>();
  }

  // What each mode takes.
  const std::string mode_name(ModeName(rule.mode));
  switch (rule.mode) {
    case Mode::kSplit:
      if (!rule.dim) return bad("mode split needs \"dim\"");
      break;
    case Mode::kVocab:
    case Mode::kKvHeads:
      if (rule.dim && *rule.dim != 0) return bad("mode " + mode_name + " splits dim 0 only");
      rule.dim = 0;
      break;
    case Mode::kReplicate:
    case Mode::kSkip:
      if (rule.dim) return bad("mode " + mode_name + " takes no \"dim\"");
      break;
    case Mode::kExpert:
      if (rule.regex.mark_count() < 2) {
        return bad("mode expert needs the expert index as capture group 2");
      }
      break;
  }
  if (!rule.heads.empty() && rule.mode != Mode::kSplit) {
    return bad("\"heads\" applies to mode split only");
  }
  if (rule.block != 0 && rule.mode != Mode::kSplit && rule.mode != Mode::kExpert) {
    return bad("\"block\" applies to modes split and expert only");
  }
  if (rule.stage == Stage::kLayer && rule.regex.mark_count() < 1) {
    return bad("stage layer needs the layer index as capture group 1");
  }
  return rule;
}

std::string Basename(const std::string& path) {
  const size_t slash = path.rfind('/');
  std::string base = slash == std::string::npos ? path : path.substr(slash + 1);
  if (base.size() > 5 && base.ends_with(".json")) base.resize(base.size() - 5);
  return base;
}

}  // namespace

std::string_view ModeName(Mode mode) { return NameIn(kModeNames, mode, "?"); }

std::string_view StageName(Stage stage) { return NameIn(kStageNames, stage, "?"); }

std::string Rule::Describe() const { return "rule " + std::to_string(index) + " (" + match + ")"; }

bool Rule::Matches(const std::string& name, std::smatch& groups) const {
  if (!name.starts_with(literal_prefix) || !name.ends_with(literal_suffix)) return false;
  for (const std::string& literal : required_literals) {
    if (name.find(literal) == std::string::npos) return false;
  }
  return std::regex_match(name, groups, regex);
}

Result<RuleSet> ParseRuleSet(std::string_view json_text, RuleSource source,
                             const std::string& origin) {
  json doc;
  if (std::string error = ParseStrictJson(json_text, doc); !error.empty()) {
    return InvalidArgument(origin + ": " + error);
  }
  if (!doc.is_object()) return InvalidArgument(origin + ": not a JSON object");
  WEIGHTCACHE_RETURN_IF_ERROR(CheckKeys(doc, {"format", "name", "pp_partition", "rules"}, origin));

  RuleSet set;
  set.source = source;
  const auto format = doc.find("format");
  if (format == doc.end()) return InvalidArgument(origin + ": no \"format\" (1)");
  if (!format->is_number_unsigned() || format->get<uint64_t>() != 1) {
    return InvalidArgument(origin + ": \"format\" is " + format->dump() +
                           "; this build reads format 1");
  }
  if (auto it = doc.find("name"); it != doc.end()) {
    if (!it->is_string() || it->get<std::string>().empty()) {
      return InvalidArgument(origin + ": \"name\" must be a non-empty string");
    }
    set.name = it->get<std::string>();
  } else {
    set.name = Basename(origin);
  }
  if (auto it = doc.find("pp_partition"); it != doc.end()) {
    if (*it == "vllm") {
      set.pp_partition = PpPartition::kVllm;
    } else if (*it == "sglang") {
      set.pp_partition = PpPartition::kSglang;
    } else {
      return InvalidArgument(origin + ": \"pp_partition\" is " + it->dump() + " (vllm or sglang)");
    }
  }
  const auto rules = doc.find("rules");
  if (rules == doc.end()) return InvalidArgument(origin + ": no \"rules\"");
  if (!rules->is_array() || rules->empty()) {
    return InvalidArgument(origin + ": \"rules\" must be a non-empty array");
  }
  set.rules.reserve(rules->size());
  for (size_t i = 0; i < rules->size(); ++i) {
    Result<Rule> rule = ParseRule((*rules)[i], i);
    if (!rule.ok()) return Status(rule.status()).Context(origin);
    set.rules.push_back(std::move(*rule));
  }
  // Keys sorted (json's object is a std::map: byte order, which for UTF-8 is code point
  // order, as Python sorts), compact, non-ASCII escaped: json.dumps' canonical form.
  set.canonical_json = doc.dump(-1, ' ', /*ensure_ascii=*/true);
  set.digest = Sha256Hex(set.canonical_json);
  return set;
}

Result<RuleSet> LoadRuleSetFile(const std::string& path) {
  Result<std::string> text =
      os::ReadSmallFile(path, kMaxRulesFileBytes, StatusCode::kInvalidArgument);
  if (!text.ok() && text.status().code() != StatusCode::kInvalidArgument) {
    std::string known;
    for (std::string_view n : BuiltinRuleSetNames()) {
      known += (known.empty() ? "" : ", ") + std::string(n);
    }
    return InvalidArgument("--shard-rules " + path + ": not a built-in rule set (" + known +
                           ") and not a readable rules file: " + text.status().message());
  }
  if (!text.ok()) return text.status();
  return ParseRuleSet(*text, RuleSource::kFile, path);
}

std::vector<std::string_view> BuiltinRuleSetNames() {
  std::vector<std::string_view> names;
  for (const BuiltinRuleSetEntry& e : BuiltinRuleSets()) names.push_back(e.name);
  return names;
}

Result<std::string_view> BuiltinRuleSetText(std::string_view name) {
  std::string known;
  for (const BuiltinRuleSetEntry& e : BuiltinRuleSets()) {
    if (e.name == name) return std::string_view(e.text);
    known += (known.empty() ? "" : ", ") + std::string(e.name);
  }
  return InvalidArgument("no built-in shard rule set \"" + std::string(name) +
                         "\" (built-in: " + known + ")");
}

Result<RuleSet> BuiltinRuleSet(std::string_view name) {
  WEIGHTCACHE_ASSIGN_OR_RETURN(std::string_view text, BuiltinRuleSetText(name));
  return ParseRuleSet(text, RuleSource::kBuiltin, "built-in set " + std::string(name));
}

namespace {

// "give --shard-rules NAME|FILE (--shard-rules replicate: every tensor whole on every rank)":
// the generic built-in sets offered where no model's set applies.
std::string GiveShardRules() {
  std::string text = "give --shard-rules NAME|FILE";
  std::string offers;
  for (const BuiltinRuleSetEntry& e : BuiltinRuleSets()) {
    if (e.kind != BuiltinKind::kGeneric) continue;
    offers += (offers.empty() ? "" : "; ") + std::string("--shard-rules ") + std::string(e.name) +
              ": " + std::string(e.summary);
  }
  return offers.empty() ? text : text + " (" + offers + ")";
}

}  // namespace

Result<RuleSet> SelectRuleSet(const std::string& spec, const std::string& model_type) {
  if (!spec.empty()) {
    for (std::string_view n : BuiltinRuleSetNames()) {
      if (n == spec) return BuiltinRuleSet(spec);
    }
    return LoadRuleSetFile(spec);
  }
  if (model_type.empty()) {
    return InvalidArgument(
        "config.json has no model_type, so no built-in shard rule set applies: " +
        GiveShardRules());
  }
  std::string known;
  for (const BuiltinRuleSetEntry& e : BuiltinRuleSets()) {
    if (e.kind != BuiltinKind::kModel) continue;
    if (e.name == model_type) return BuiltinRuleSet(model_type);
    known += (known.empty() ? "" : ", ") + std::string(e.name);
  }
  return InvalidArgument("no built-in shard rule set for model_type \"" + model_type +
                         "\" (built-in: " + known + "): " + GiveShardRules());
}

}  // namespace weightcache::sharding
