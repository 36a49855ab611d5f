#include "identity/cache_config.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "common/hash.h"

namespace weightcache::identity {
namespace {

using ::testing::HasSubstr;
using ::testing::SizeIs;

const std::string kFingerprint(64, 'a');
const std::string kQuantSha(64, 'b');
const std::string kShardSha(64, 'c');
const std::string kFiles(64, '9');

CacheConfig BaseConfig() {
  CacheConfig c;
  c.model_id = "Llama-3.1-8B";
  c.revision = "0e9e39f";
  c.checkpoint_fingerprint = kFingerprint;
  c.checkpoint_files = kFiles;
  c.dtype = "bf16";
  c.quantization = "fp8";
  c.quantization_config_sha256 = kQuantSha;
  c.tp_size = 4;
  c.tp_rank = 1;
  c.pp_size = 2;
  c.pp_rank = 1;
  c.ep_size = 2;
  c.ep_rank = 0;
  c.dp_size = 2;
  c.shard_rules_digest = kShardSha;
  c.source = "disk";
  c.layout_tag = "default";
  c.tier = Tier::kGpu;
  return c;
}

// One change per field, each keeping the config valid. The test below checks that this table
// covers exactly CacheConfig::FieldNames(), so a new field cannot be forgotten here.
const std::map<std::string, std::function<void(CacheConfig&)>>& Mutators() {
  static const std::map<std::string, std::function<void(CacheConfig&)>> m = {
      {"format_version", [](CacheConfig& c) { c.format_version = 3; }},
      {"checkpoint_files", [](CacheConfig& c) { c.checkpoint_files = std::string(64, 'f'); }},
      {"model_id", [](CacheConfig& c) { c.model_id = "Llama-3.1-70B"; }},
      {"revision", [](CacheConfig& c) { c.revision = "main"; }},
      {"checkpoint_fingerprint",
       [](CacheConfig& c) { c.checkpoint_fingerprint = std::string(64, 'd'); }},
      {"dtype", [](CacheConfig& c) { c.dtype = "fp16"; }},
      {"quantization", [](CacheConfig& c) { c.quantization = "awq"; }},
      {"quantization_config_sha256",
       [](CacheConfig& c) { c.quantization_config_sha256 = std::string(64, 'e'); }},
      {"tp_size", [](CacheConfig& c) { c.tp_size = 8; }},
      {"tp_rank", [](CacheConfig& c) { c.tp_rank = 3; }},
      {"pp_size", [](CacheConfig& c) { c.pp_size = 4; }},
      {"pp_rank", [](CacheConfig& c) { c.pp_rank = 0; }},
      {"ep_size", [](CacheConfig& c) { c.ep_size = 4; }},
      {"ep_rank", [](CacheConfig& c) { c.ep_rank = 1; }},
      {"dp_size", [](CacheConfig& c) { c.dp_size = 3; }},
      {"shard_rules_digest", [](CacheConfig& c) { c.shard_rules_digest = ""; }},
      {"source", [](CacheConfig& c) { c.source = "published:sglang-0.4"; }},
      {"layout_tag", [](CacheConfig& c) { c.layout_tag = "packed-v2"; }},
      {"tier", [](CacheConfig& c) { c.tier = Tier::kHost; }},
  };
  return m;
}

TEST(CacheConfigTest, FieldListCoversEverySpecFieldAndNoDpRank) {
  std::set<std::string> names(CacheConfig::FieldNames().begin(), CacheConfig::FieldNames().end());
  std::set<std::string> mutated;
  for (const auto& [name, fn] : Mutators()) mutated.insert(name);
  EXPECT_EQ(names, mutated);
  EXPECT_EQ(names.size(), 19u);
  EXPECT_EQ(names.count("dp_rank"), 0u);
  std::set<std::string> json_keys;
  const nlohmann::json json = BaseConfig().ToJson();
  for (const auto& [key, value] : json.items()) json_keys.insert(key);
  EXPECT_EQ(json_keys, names);
}

TEST(CacheConfigTest, ConfigsDifferingInAnyOneFieldDoNotMatchAndTheReportNamesIt) {
  const CacheConfig ours = BaseConfig();
  ASSERT_TRUE(ours.Validate().ok()) << ours.Validate().ToString();
  for (const auto& [field, mutate] : Mutators()) {
    SCOPED_TRACE(field);
    CacheConfig theirs = ours;
    mutate(theirs);
    ASSERT_TRUE(theirs.Validate().ok()) << theirs.Validate().ToString();
    EXPECT_FALSE(ours == theirs);
    EXPECT_NE(ours.Digest(), theirs.Digest());
    EXPECT_NE(ours.ShortDigest(), theirs.ShortDigest());
    std::vector<FieldDiff> diffs = Diff(ours, theirs);
    ASSERT_THAT(diffs, SizeIs(1));
    EXPECT_EQ(diffs[0].field, field);
    EXPECT_EQ(diffs[0].ours, ours.FieldText(field));
    EXPECT_EQ(diffs[0].theirs, theirs.FieldText(field));
    EXPECT_NE(diffs[0].ours, diffs[0].theirs);
    const std::string line = FormatDiffOneLine(diffs);
    const std::string note(FieldNote(field));
    EXPECT_EQ(line, field + ": ours=" + ours.FieldText(field) + " theirs=" +
                        theirs.FieldText(field) + (note.empty() ? "" : " (" + note + ")"));
    EXPECT_EQ(note.empty(), field != "checkpoint_files");
    EXPECT_THAT(FormatDiffMultiLine(diffs), HasSubstr(field));
  }
}

TEST(CacheConfigTest, DiffValuesAreRenderedReadably) {
  CacheConfig theirs = BaseConfig();
  theirs.tp_rank = 3;
  theirs.revision = "main";
  std::vector<FieldDiff> diffs = Diff(BaseConfig(), theirs);
  ASSERT_THAT(diffs, SizeIs(2));
  EXPECT_EQ(diffs[0], (FieldDiff{"revision", "\"0e9e39f\"", "\"main\""}));
  EXPECT_EQ(diffs[1], (FieldDiff{"tp_rank", "1", "3"}));
  EXPECT_EQ(FormatDiffOneLine(diffs),
            "revision: ours=\"0e9e39f\" theirs=\"main\"; tp_rank: ours=1 theirs=3");
  EXPECT_EQ(FormatDiffMultiLine(diffs),
            "  revision  ours=\"0e9e39f\"  theirs=\"main\"\n"
            "  tp_rank   ours=1          theirs=3\n");
  EXPECT_TRUE(Diff(BaseConfig(), BaseConfig()).empty());
}

TEST(CacheConfigTest, CanonicalFormIsSortedCompactJsonAndDigestIsItsSha256) {
  const CacheConfig c = BaseConfig();
  const std::string expected =
      "{\"checkpoint_files\":\"" + kFiles + "\",\"checkpoint_fingerprint\":\"" + kFingerprint +
      "\",\"dp_size\":2,\"dtype\":\"bf16\",\"ep_rank\":0,\"ep_size\":2,\"format_version\":2,"
      "\"layout_tag\":\"default\",\"model_id\":\"Llama-3.1-8B\",\"pp_rank\":1,\"pp_size\":2,"
      "\"quantization\":\"fp8\",\"quantization_config_sha256\":\"" +
      kQuantSha + "\",\"revision\":\"0e9e39f\",\"shard_rules_digest\":\"" + kShardSha +
      "\",\"source\":\"disk\",\"tier\":\"gpu\",\"tp_rank\":1,\"tp_size\":4}";
  EXPECT_EQ(c.Canonical(), expected);
  EXPECT_EQ(c.Digest(), Sha256Hex(expected));
  EXPECT_EQ(c.ShortDigest(), c.Digest().substr(0, 16));
  EXPECT_EQ(BaseConfig().Digest(), c.Digest());  // stable across instances
}

TEST(CacheConfigTest, JsonRoundTrip) {
  Result<CacheConfig> back = CacheConfig::FromJson(BaseConfig().ToJson());
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(*back, BaseConfig());
}

void ExpectFromJsonError(const nlohmann::json& j, const std::string& substring) {
  Result<CacheConfig> r = CacheConfig::FromJson(j);
  ASSERT_FALSE(r.ok()) << j.dump();
  EXPECT_EQ(r.status().code(), StatusCode::kProtocol);
  EXPECT_THAT(r.status().message(), HasSubstr(substring));
}

TEST(CacheConfigTest, FromJsonIsStrict) {
  ExpectFromJsonError(nlohmann::json::array(), "expected a JSON object");
  nlohmann::json extra = BaseConfig().ToJson();
  extra["dp_rank"] = 0;
  ExpectFromJsonError(extra, "unknown field \"dp_rank\"");
  nlohmann::json missing = BaseConfig().ToJson();
  missing.erase("tp_rank");
  ExpectFromJsonError(missing, "missing field \"tp_rank\"");
  nlohmann::json string_size = BaseConfig().ToJson();
  string_size["tp_size"] = "4";
  ExpectFromJsonError(string_size, "field \"tp_size\" must be an unsigned 32-bit integer");
  nlohmann::json negative = BaseConfig().ToJson();
  negative["pp_rank"] = -1;
  ExpectFromJsonError(negative, "field \"pp_rank\" must be an unsigned 32-bit integer");
  nlohmann::json huge = BaseConfig().ToJson();
  huge["dp_size"] = uint64_t{1} << 32;
  ExpectFromJsonError(huge, "field \"dp_size\" must be an unsigned 32-bit integer");
  nlohmann::json number_id = BaseConfig().ToJson();
  number_id["model_id"] = 7;
  ExpectFromJsonError(number_id, "field \"model_id\" must be a string");
  nlohmann::json bad_rank = BaseConfig().ToJson();
  bad_rank["tp_rank"] = 4;
  ExpectFromJsonError(bad_rank, "tp_rank must be < tp_size (4 >= 4)");
}

void ExpectInvalid(const std::function<void(CacheConfig&)>& mutate, const std::string& substring) {
  CacheConfig c = BaseConfig();
  mutate(c);
  Status s = c.Validate();
  ASSERT_FALSE(s.ok()) << "accepted; expected: " << substring;
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr(substring));
}

TEST(CacheConfigTest, ValidateNamesTheOffendingField) {
  ExpectInvalid([](CacheConfig& c) { c.tp_rank = 4; }, "tp_rank must be < tp_size (4 >= 4)");
  ExpectInvalid([](CacheConfig& c) { c.pp_rank = 2; }, "pp_rank must be < pp_size");
  ExpectInvalid([](CacheConfig& c) { c.ep_rank = 5; }, "ep_rank must be < ep_size");
  ExpectInvalid([](CacheConfig& c) { c.dp_size = 0; }, "dp_size must be between 1 and");
  ExpectInvalid([](CacheConfig& c) { c.tp_size = 0; }, "tp_size must be between 1 and");
  ExpectInvalid([](CacheConfig& c) { c.model_id = ""; }, "model_id must not be empty");
  ExpectInvalid([](CacheConfig& c) { c.model_id = "caf\xc3\xa9"; },
                "model_id must be printable ASCII");
  ExpectInvalid([](CacheConfig& c) { c.checkpoint_fingerprint = "abc"; },
                "checkpoint_fingerprint must be 64 lowercase hex");
  ExpectInvalid([](CacheConfig& c) { c.checkpoint_fingerprint = std::string(64, 'A'); },
                "checkpoint_fingerprint must be 64 lowercase hex");
  ExpectInvalid([](CacheConfig& c) { c.source = "published:"; }, "source must be \"disk\"");
  ExpectInvalid([](CacheConfig& c) { c.source = "s3"; }, "source must be \"disk\"");
  ExpectInvalid([](CacheConfig& c) { c.quantization = "none"; },
                "quantization_config_sha256 must be empty when quantization is \"none\"");
  ExpectInvalid([](CacheConfig& c) { c.shard_rules_digest = "xyz"; },
                "shard_rules_digest must be empty or 64 lowercase hex");
  ExpectInvalid([](CacheConfig& c) { c.layout_tag = "a b"; }, "layout_tag must match");
  ExpectInvalid([](CacheConfig& c) { c.format_version = 0; }, "format_version must be >= 1");
  ExpectInvalid([](CacheConfig& c) { c.tier = static_cast<Tier>(7); },
                "tier must be \"gpu\" or \"host\" (got code 7)");
}

// The bug the tier field fixes: a host-tier cache with a GPU affinity and a gpu-tier cache of
// the same weights on that GPU must not share a digest (and so a socket path).
TEST(CacheConfigTest, TierSeparatesHostAndGpuCachesOfTheSameWeights) {
  CacheConfig gpu = BaseConfig();
  CacheConfig host = BaseConfig();
  host.tier = Tier::kHost;
  EXPECT_NE(gpu.ShortDigest(), host.ShortDigest());
  EXPECT_EQ(FormatDiffOneLine(Diff(gpu, host)), "tier: ours=\"gpu\" theirs=\"host\"");
  nlohmann::json wire = host.ToJson();
  EXPECT_EQ(wire["tier"], "host");
  wire["tier"] = "disk";
  ExpectFromJsonError(wire, "tier must be \"gpu\" or \"host\" (got \"disk\")");
  wire["tier"] = "cpu";
  ExpectFromJsonError(wire, "tier must be \"gpu\" or \"host\" (got \"cpu\")");
  wire["tier"] = "";
  ExpectFromJsonError(wire, "tier must be \"gpu\" or \"host\" (got \"\")");
  wire["tier"] = 1;
  ExpectFromJsonError(wire, "field \"tier\" must be a string");
  wire.erase("tier");
  ExpectFromJsonError(wire, "missing field \"tier\"");
}

TEST(QuantizationConfigDigestTest, IndependentOfKeyOrderAndWhitespace) {
  Result<std::string> a = QuantizationConfigDigest(
      R"({"quant_method": "fp8", "activation_scheme": "dynamic",
          "weight_block_size": [128, 128], "extra": {"b": 1, "a": 2}})");
  Result<std::string> b =
      QuantizationConfigDigest(R"({"extra":{"a":2,"b":1},"weight_block_size":[128,128],)"
                               R"("activation_scheme":"dynamic","quant_method":"fp8"})");
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  EXPECT_EQ(*a, *b);
  EXPECT_EQ(*a, Sha256Hex(R"({"activation_scheme":"dynamic","extra":{"a":2,"b":1},)"
                          R"("quant_method":"fp8","weight_block_size":[128,128]})"));
}

TEST(QuantizationConfigDigestTest, DifferentValuesDigestDifferently) {
  const std::string base = *QuantizationConfigDigest(R"({"bits": 4, "group_size": 128})");
  EXPECT_NE(base, *QuantizationConfigDigest(R"({"bits": 8, "group_size": 128})"));
  EXPECT_NE(base, *QuantizationConfigDigest(R"({"bits": 4, "group_size": 64})"));
  EXPECT_NE(base, *QuantizationConfigDigest(R"({"bits": 4.0, "group_size": 128})"));
  EXPECT_NE(base, *QuantizationConfigDigest(R"({"bits": 4, "group_size": 128, "sym": true})"));
  // Array order is significant.
  EXPECT_NE(*QuantizationConfigDigest(R"({"m": [1, 2]})"),
            *QuantizationConfigDigest(R"({"m": [2, 1]})"));
}

TEST(QuantizationConfigDigestTest, RejectsBadInput) {
  Result<std::string> dup = QuantizationConfigDigest(R"({"bits": 4, "x": {"a": 1, "a": 2}})");
  ASSERT_FALSE(dup.ok());
  EXPECT_EQ(dup.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(dup.status().message(), HasSubstr("duplicate key \"a\""));
  Result<std::string> bad = QuantizationConfigDigest("{\"bits\": ");
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(bad.status().message(), HasSubstr("quantization config: not valid JSON"));
  Result<std::string> list = QuantizationConfigDigest("[1, 2]");
  ASSERT_FALSE(list.ok());
  EXPECT_THAT(list.status().message(), HasSubstr("expected a JSON object"));
  // Sibling objects may reuse a key.
  EXPECT_TRUE(QuantizationConfigDigest(R"({"x": {"a": 1}, "y": {"a": 1}})").ok());
}

}  // namespace
}  // namespace weightcache::identity
