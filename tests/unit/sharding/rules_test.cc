// The rules document (format 1), its digest, the built-in sets and config.json parsing.
#include "sharding/rules.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <nlohmann/json.hpp>
#include <regex>

#include "common/hash.h"
#include "sharding/model_config.h"
#include "support/test_env.h"
#include "unit/sharding/sharding_fixture.h"

namespace weightcache::sharding {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using testing::StatusIs;
using weightcache::testing::PythonExe;
using weightcache::testing::RunCommand;
using weightcache::testing::TempDir;
using weightcache::testing::WriteFile;

// A one-rule document around `rule` (a JSON object text).
std::string Doc(const std::string& rule) {
  return R"({"format": 1, "name": "t", "rules": [)" + rule + "]}";
}

Result<RuleSet> Parse(const std::string& text) {
  return ParseRuleSet(text, RuleSource::kFile, "rules.json");
}

TEST(RulesTest, ParsesEveryKey) {
  Result<RuleSet> set = Parse(R"({"format": 1, "name": "mine", "pp_partition": "sglang", "rules": [
      {"match": "model\\.layers\\.(\\d+)\\.q\\.weight_scale_inv", "mode": "split", "dim": 1,
       "heads": "num_attention_heads", "block": 128, "stage": "layer", "optional": true},
      {"match": "x", "mode": "replicate"}]})");
  ASSERT_TRUE(set.ok()) << set.status().ToString();
  EXPECT_EQ(set->name, "mine");
  EXPECT_EQ(set->pp_partition, PpPartition::kSglang);
  EXPECT_EQ(set->source, RuleSource::kFile);
  ASSERT_EQ(set->rules.size(), 2u);
  const Rule& r = set->rules[0];
  EXPECT_EQ(r.index, 0u);
  EXPECT_EQ(r.mode, Mode::kSplit);
  EXPECT_EQ(r.dim, 1u);
  EXPECT_EQ(r.heads, "num_attention_heads");
  EXPECT_EQ(r.block, 128u);
  EXPECT_EQ(r.stage, Stage::kLayer);
  EXPECT_TRUE(r.optional);
  EXPECT_EQ(set->rules[1].stage, Stage::kAll);  // the default
  EXPECT_FALSE(set->rules[1].optional);
  EXPECT_EQ(Parse(Doc(R"({"match": "x", "mode": "skip"})"))->pp_partition, PpPartition::kVllm);
}

TEST(RulesTest, BadDocumentsAreUsageErrorsNamingTheRule) {
  struct Case {
    std::string text;
    std::string message;
  };
  const std::vector<Case> cases = {
      {Doc(R"({"match": "a\\.b", "mode": "split", "dim": 0, "color": 1})"),
       "rule 0 (a\\.b): unknown key \"color\""},
      {Doc(R"({"mode": "replicate"})"), "rule 0: no \"match\""},
      {Doc(R"({"match": "a"})"), "rule 0 (a): no \"mode\""},
      {Doc(R"({"match": "a(", "mode": "replicate"})"),
       "rule 0 (a(): \"match\" is not a valid regular expression"},
      {Doc(R"({"match": "a", "mode": "shard"})"), "rule 0 (a): unknown mode \"shard\""},
      {Doc(R"({"match": "a", "mode": "split"})"), "rule 0 (a): mode split needs \"dim\""},
      {Doc(R"({"match": "a", "mode": "split", "dim": -1})"), "rule 0 (a): \"dim\" must be"},
      {Doc(R"json({"match": "a(\\d+)", "mode": "expert"})json"),
       "rule 0 (a(\\d+)): mode expert needs the expert index as capture group 2"},
      {Doc(R"({"match": "a", "mode": "replicate", "stage": "layer"})"),
       "rule 0 (a): stage layer needs the layer index as capture group 1"},
      {Doc(R"({"match": "a", "mode": "replicate", "stage": "middle"})"),
       "rule 0 (a): unknown stage \"middle\""},
      {Doc(R"({"match": "a", "mode": "replicate", "optional": 1})"),
       "rule 0 (a): \"optional\" must be true or false"},
      {Doc(R"({"match": "a", "mode": "replicate", "heads": "n"})"),
       "rule 0 (a): \"heads\" applies to mode split only"},
      {Doc(R"({"match": "a", "mode": "split", "dim": 0, "block": 0})"),
       "rule 0 (a): \"block\" must be a positive integer"},
      {Doc(R"({"match": "a", "mode": "replicate", "match": "b"})"), "duplicate key \"match\""},
      {R"({"format": 2, "rules": [{"match": "a", "mode": "skip"}]})", "this build reads format 1"},
      {R"({"format": 1, "rules": [], "extra": 1})", "unknown key \"extra\""},
      {R"({"format": 1, "rules": []})", "\"rules\" must be a non-empty array"},
      {R"({"format": 1, "pp_partition": "megatron", "rules": [{"match": "a", "mode": "skip"}]})",
       "\"pp_partition\" is \"megatron\""},
      {R"({"format": 1, "rules": [{"match": "a", "mode": "skip"}],)", "not valid JSON"},
  };
  for (const Case& c : cases) {
    EXPECT_THAT(Parse(c.text), StatusIs(StatusCode::kInvalidArgument,
                                        AllOf(HasSubstr("rules.json"), HasSubstr(c.message))))
        << c.text;
  }
  // The second rule is named by its index.
  EXPECT_THAT(Parse(R"({"format": 1, "rules": [{"match": "a", "mode": "skip"},
                       {"match": "b", "mode": "nope"}]})"),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("rule 1 (b): unknown mode")));
}

TEST(RulesTest, DigestIsPythonsCanonicalJson) {
  // Keys out of order, whitespace, a non-ASCII name and an escaped quote: the digest is that
  // of json.dumps(obj, sort_keys=True, separators=(",", ":")), computed by Python itself.
  const std::string text =
      "{ \"rules\": [ {\"mode\": \"replicate\", \"match\": \"caf\xc3\xa9\\\\.\\\"x\\\"\"} ],\n"
      "  \"name\": \"r\xc3\xa8gles \xf0\x9f\x98\x80\",  \"format\": 1 }";
  Result<RuleSet> set = Parse(text);
  ASSERT_TRUE(set.ok()) << set.status().ToString();
  TempDir dir;
  WriteFile(dir.Join("rules.json"), text);
  auto py = RunCommand({PythonExe(), "-c",
                        "import hashlib, json, sys\n"
                        "obj = json.load(open(sys.argv[1], encoding='utf-8'))\n"
                        "s = json.dumps(obj, sort_keys=True, separators=(',', ':'))\n"
                        "print(s)\nprint(hashlib.sha256(s.encode()).hexdigest())\n",
                        dir.Join("rules.json")});
  ASSERT_EQ(py.exit_code, 0) << py.err;
  EXPECT_EQ(py.out, set->canonical_json + "\n" + set->digest + "\n");
  EXPECT_EQ(set->digest, Sha256Hex(set->canonical_json));
}

TEST(RulesTest, BuiltinSetsParseAndKeepTheirDigestWhenSavedToAFile) {
  EXPECT_THAT(BuiltinRuleSetNames(), ElementsAre("llama", "mistral", "qwen2", "qwen3", "mixtral",
                                                 "qwen3_moe", "deepseek_v3", "replicate"));
  TempDir dir;
  for (std::string_view name : BuiltinRuleSetNames()) {
    Result<RuleSet> builtin = BuiltinRuleSet(name);
    ASSERT_TRUE(builtin.ok()) << builtin.status().ToString();
    EXPECT_EQ(builtin->name, name);
    EXPECT_EQ(builtin->source, RuleSource::kBuiltin);
    const std::string path = dir.Join(std::string(name) + ".json");
    WriteFile(path, std::string(*BuiltinRuleSetText(name)));
    Result<RuleSet> file = LoadRuleSetFile(path);
    ASSERT_TRUE(file.ok()) << file.status().ToString();
    EXPECT_EQ(file->source, RuleSource::kFile);
    EXPECT_EQ(file->digest, builtin->digest) << name;
    EXPECT_EQ(file->rules.size(), builtin->rules.size());
  }
  EXPECT_NE(BuiltinRuleSet("llama")->digest, BuiltinRuleSet("mistral")->digest);  // the name
  EXPECT_THAT(BuiltinRuleSetText("gpt2"),
              StatusIs(StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("\"gpt2\""), HasSubstr("llama, mistral"))));
}

TEST(RulesTest, SelectRuleSetByModelTypeNameOrFile) {
  EXPECT_EQ(SelectRuleSet("", "qwen3_moe")->name, "qwen3_moe");
  EXPECT_EQ(SelectRuleSet("mixtral", "llama")->name, "mixtral");  // --shard-rules wins
  TempDir dir;
  WriteFile(dir.Join("custom.json"), Doc(R"({"match": ".*", "mode": "replicate"})"));
  Result<RuleSet> file = SelectRuleSet(dir.Join("custom.json"), "gpt2");
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  EXPECT_EQ(file->name, "t");
  EXPECT_EQ(file->source, RuleSource::kFile);
  EXPECT_THAT(SelectRuleSet("", "gpt2"),
              StatusIs(StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("model_type \"gpt2\""), HasSubstr("--shard-rules"))));
  EXPECT_THAT(SelectRuleSet("", ""),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("no model_type")));
  // A rules file given on the command line is usage: missing is kInvalidArgument (exit 2).
  EXPECT_THAT(SelectRuleSet(dir.Join("missing.json"), "llama"),
              StatusIs(StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("missing.json"), HasSubstr("not a readable rules file"))));
  // A FIFO is refused at once, never read (it would block).
  const std::string fifo = dir.Join("fifo.json");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  EXPECT_THAT(SelectRuleSet(fifo, "llama"),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("FIFO")));
  WriteFile(dir.Join("big.json"), std::string(kMaxRulesFileBytes + 1, ' '));
  EXPECT_THAT(
      SelectRuleSet(dir.Join("big.json"), "llama"),
      StatusIs(StatusCode::kInvalidArgument, HasSubstr("-byte limit for this kind of file")));
}

// Issue 39 §4: `replicate`, every tensor whole on every rank, for a checkpoint whose
// model_type has no built-in set; it is given by name only (it serves no model_type), and the
// errors that ask for --shard-rules name it.
TEST(RulesTest, ReplicateIsABuiltinSetByNameThatTheErrorsOffer) {
  Result<RuleSet> replicate = SelectRuleSet("replicate", "gpt2");
  ASSERT_TRUE(replicate.ok()) << replicate.status().ToString();
  EXPECT_EQ(replicate->name, "replicate");
  EXPECT_EQ(replicate->source, RuleSource::kBuiltin);
  ASSERT_EQ(replicate->rules.size(), 1u);
  EXPECT_EQ(replicate->rules[0].mode, Mode::kReplicate);
  EXPECT_EQ(replicate->rules[0].stage, Stage::kAll);
  EXPECT_EQ(SelectRuleSet("replicate", "")->name, "replicate");
  const auto offers_replicate = HasSubstr(
      "give --shard-rules NAME|FILE (--shard-rules replicate: every tensor whole on every rank)");
  EXPECT_THAT(SelectRuleSet("", "gpt2"), StatusIs(StatusCode::kInvalidArgument, offers_replicate));
  EXPECT_THAT(SelectRuleSet("", ""), StatusIs(StatusCode::kInvalidArgument, offers_replicate));
  EXPECT_THAT(SelectRuleSet("", "replicate"),
              StatusIs(StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("no built-in shard rule set for model_type \"replicate\""),
                             offers_replicate)));
}

TEST(RulesTest, LiteralPrefilterAgreesWithTheRegex) {
  // Patterns whose literal pieces are easy to get wrong: quantified characters, escapes,
  // classes, groups, top-level alternation. Matches() must agree with a plain regex_match.
  const std::vector<std::string> patterns = {
      R"(model\.layers\.(\d+)\.self_attn\.q_proj\.(weight|bias))",
      R"(ab?c\.d)",
      R"(ab*cd)",
      R"(x{2}yz)",
      R"(lm_head\.weight|model\.norm\.weight)",
      R"([ab]c\.de)",
      R"(a(bc)?de)",
      R"(a\d+bc)",
      R"(a\\b\.c)",
      R"(a[]]bc)",
      R"(model\.layers\.(\d+)\..*)",
      R"(ab(\d+)\d)",
      R"(a(\d+)c)",
      R"(ab+)",
      R"((ab)*cd)"};
  const std::vector<std::string> names = {"model.layers.3.self_attn.q_proj.weight",
                                          "model.layers.x.self_attn.q_proj.bias",
                                          "ac.d",
                                          "abc.d",
                                          "acd",
                                          "abbbcd",
                                          "xxyz",
                                          "xyz",
                                          "lm_head.weight",
                                          "model.norm.weight",
                                          "bc.de",
                                          "cc.de",
                                          "ade",
                                          "abcde",
                                          "a12bc",
                                          "a\\b.c",
                                          "a]bc",
                                          "abc",
                                          "model.layers.12.x",
                                          "model.layers..x",
                                          "model.layers.7",
                                          "ab12",
                                          "ab1",
                                          "a5c",
                                          "ac",
                                          "abbb",
                                          "ababcd",
                                          "cd"};
  for (size_t i = 0; i < patterns.size(); ++i) {
    nlohmann::json doc = {{"format", 1},
                          {"rules", {{{"match", patterns[i]}, {"mode", "replicate"}}}}};
    Result<RuleSet> set = Parse(doc.dump());
    ASSERT_TRUE(set.ok()) << patterns[i] << ": " << set.status().ToString();
    const std::regex re(patterns[i], std::regex::ECMAScript);
    std::smatch groups;
    for (const std::string& name : names) {
      EXPECT_EQ(set->rules[0].Matches(name, groups), std::regex_match(name, re))
          << patterns[i] << " on " << name;
    }
  }
}

TEST(RulesTest, LiteralFactsOfAPattern) {
  Result<RuleSet> set = Parse(Doc(
      R"json({"match": "model\\.layers\\.(\\d+)\\.mlp\\.experts\\.(\\d+)\\.w[13]\\.weight", "mode": "expert"})json"));
  ASSERT_TRUE(set.ok()) << set.status().ToString();
  const Rule& r = set->rules[0];
  EXPECT_EQ(r.literal_prefix, "model.layers.");
  EXPECT_EQ(r.literal_suffix, ".weight");
  EXPECT_TRUE(r.group1_follows_prefix);
  EXPECT_THAT(r.required_literals, ElementsAre("model.layers.", ".mlp.experts.", ".w", ".weight"));
  // (\d+) followed by a digit class: group 1 is not simply the digit run.
  EXPECT_FALSE(Parse(Doc(R"json({"match": "a(\\d+)\\d", "mode": "skip"})json"))
                   ->rules[0]
                   .group1_follows_prefix);
  // A top-level alternation: nothing is required.
  Result<RuleSet> alt = Parse(Doc(R"({"match": "ab|cd", "mode": "skip"})"));
  ASSERT_TRUE(alt.ok()) << alt.status().ToString();
  EXPECT_EQ(alt->rules[0].literal_prefix, "");
  EXPECT_TRUE(alt->rules[0].required_literals.empty());
}

TEST(ModelConfigTest, ReadsTheFieldsAndRefusesBadTypes) {
  Result<ModelConfig> c = ParseModelConfig(
      R"({"model_type": "qwen3_moe", "num_attention_heads": 32, "num_key_value_heads": null,
          "num_experts": 128, "tie_word_embeddings": true, "rope_theta": 1e6,
          "architectures": ["X"], "hidden_size": 4096})",
      "m/config.json");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->model_type, "qwen3_moe");
  EXPECT_TRUE(c->tie_word_embeddings);
  EXPECT_EQ(c->NumKvHeads(), 32u);  // null: defaults to num_attention_heads
  std::string key;
  EXPECT_EQ(c->NumExperts(&key), 128u);
  EXPECT_EQ(key, "num_experts");
  EXPECT_EQ(c->Integer("hidden_size"), 4096u);
  EXPECT_EQ(c->Integer("rope_theta"), std::nullopt);

  EXPECT_THAT(ParseModelConfig(R"({"num_attention_heads": "32"})", "m/config.json"),
              StatusIs(StatusCode::kInvalidCheckpoint,
                       AllOf(HasSubstr("m/config.json"), HasSubstr("\"num_attention_heads\""))));
  EXPECT_THAT(ParseModelConfig(R"({"num_hidden_layers": -2})", "m/config.json"),
              StatusIs(StatusCode::kInvalidCheckpoint, HasSubstr("\"num_hidden_layers\"")));
  EXPECT_THAT(ParseModelConfig(R"({"vocab_size": 32000.5})", "m/config.json"),
              StatusIs(StatusCode::kInvalidCheckpoint, HasSubstr("\"vocab_size\"")));
  EXPECT_THAT(ParseModelConfig(R"({"model_type": 3})", "m/config.json"),
              StatusIs(StatusCode::kInvalidCheckpoint, HasSubstr("\"model_type\"")));
  EXPECT_THAT(ParseModelConfig(R"({"tie_word_embeddings": "yes"})", "m/config.json"),
              StatusIs(StatusCode::kInvalidCheckpoint, HasSubstr("\"tie_word_embeddings\"")));
  EXPECT_THAT(ParseModelConfig(R"({"vocab_size": 1, "vocab_size": 2})", "m/config.json"),
              StatusIs(StatusCode::kInvalidCheckpoint, HasSubstr("duplicate key \"vocab_size\"")));
  EXPECT_THAT(ParseModelConfig("[1]", "m/config.json"),
              StatusIs(StatusCode::kInvalidCheckpoint, HasSubstr("not a JSON object")));
}

TEST(ModelConfigTest, ReadsConfigJsonBesideTheCheckpoint) {
  TempDir dir;
  EXPECT_EQ(ReadModelConfig(dir.path())->path, "");  // none: empty, not an error
  WriteFile(dir.Join("config.json"), R"({"model_type": "llama"})");
  EXPECT_EQ(ReadModelConfig(dir.path())->model_type, "llama");
  WriteFile(dir.Join("model.safetensors"), "");
  EXPECT_EQ(ReadModelConfig(dir.Join("model.safetensors"))->model_type, "llama");
  WriteFile(dir.Join("config.json"), std::string(kMaxConfigBytes + 1, ' '));
  EXPECT_THAT(
      ReadModelConfig(dir.path()),
      StatusIs(StatusCode::kInvalidCheckpoint,
               AllOf(HasSubstr("config.json"), HasSubstr("-byte limit for this kind of file"))));
}

}  // namespace
}  // namespace weightcache::sharding
