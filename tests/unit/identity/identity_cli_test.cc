// `weightcache paths` and `weightcache devices`, run as real processes against an inventory
// file modelling an 8-GPU host.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "common/hash.h"
#include "identity/cache_config.h"
#include "support/test_env.h"
#include "unit/identity/test_devices.h"

namespace weightcache::identity {
namespace {

using ::testing::HasSubstr;
using testing::InventoryJson;
using testing::TestUuid;
using ::weightcache::testing::CliPath;
using ::weightcache::testing::CommandResult;
using ::weightcache::testing::RunCommand;
using ::weightcache::testing::TempDir;
using ::weightcache::testing::WriteFile;

// A one-tensor safetensors file: 8-byte little-endian header length, JSON header, data.
void WriteTinyCheckpoint(const std::string& path) {
  std::string header = R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  header.append((8 - header.size() % 8) % 8, ' ');
  std::string file(8, '\0');
  uint64_t len = header.size();
  std::memcpy(file.data(), &len, 8);  // x86-64 and aarch64 are little-endian
  file += header;
  file.append(8, '\x01');
  WriteFile(path, file);
}

class IdentityCliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    model_dir_ = tmp_.Join("Tiny-Model");
    std::filesystem::create_directories(model_dir_);
    WriteTinyCheckpoint(model_dir_ + "/model.safetensors");
    inventory_ = tmp_.Join("inventory.json");
    WriteFile(inventory_, InventoryJson(8));
    // A sharded job needs rules; the tiny checkpoint's one tensor is replicated.
    rules_ = tmp_.Join("rules.json");
    WriteFile(rules_, kRules);
  }
  static constexpr const char* kRules =
      R"({"format": 1, "rules": [{"match": "w", "mode": "replicate"}]})";

  CommandResult Paths(std::vector<std::string> extra, const std::string& cvd = "0,1,2,3,4,5,6,7") {
    std::vector<std::string> argv = {CliPath(),  "paths",         "--json",
                                     "--model",  model_dir_,      "--device-inventory",
                                     inventory_, "--runtime-dir", tmp_.Join("rt")};
    argv.insert(argv.end(), extra.begin(), extra.end());
    return RunCommand(argv, {"CUDA_VISIBLE_DEVICES=" + cvd, "WEIGHTCACHE_SOCKET="});
  }

  TempDir tmp_;
  std::string model_dir_;
  std::string inventory_;
  std::string rules_;
};

TEST_F(IdentityCliTest, PathsJsonResolvesLocalDeviceFiveToItsUuid) {
  CommandResult r =
      Paths({"--device", "5", "--tp-size", "2", "--tp-rank", "1", "--shard-rules", rules_});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["device_key"], TestUuid(5));
  EXPECT_EQ(j["device"]["index"], 5);
  EXPECT_EQ(j["device"]["uuid"], TestUuid(5));
  EXPECT_EQ(j["runtime_dir"], tmp_.Join("rt"));
  EXPECT_EQ(j["runtime_dir_origin"], "--runtime-dir");
  EXPECT_EQ(j["namespace"], "default");
  EXPECT_EQ(j["config"]["model_id"], "Tiny-Model");
  EXPECT_EQ(j["config"]["tp_size"], 2);
  EXPECT_EQ(j["config"]["tp_rank"], 1);
  Result<CacheConfig> config = CacheConfig::FromJson(j["config"]);
  ASSERT_TRUE(config.ok()) << config.status().ToString();
  EXPECT_EQ(j["digest"], config->Digest());
  EXPECT_EQ(j["canonical_config"], config->Canonical());
  const std::string dir = tmp_.Join("rt") + "/default/" + TestUuid(5);
  EXPECT_EQ(j["socket"], dir + "/" + config->ShortDigest() + ".sock");
  EXPECT_EQ(j["lock"], dir + "/" + config->ShortDigest() + ".lock");
  // Resolution only: nothing was created.
  EXPECT_FALSE(std::filesystem::exists(tmp_.Join("rt")));
}

TEST_F(IdentityCliTest, PathsHonoursCudaVisibleDevices) {
  CommandResult r = Paths({"--device", "1"}, "5,3");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["device_key"], TestUuid(3));
  EXPECT_EQ(j["device"]["index"], 1);
}

TEST_F(IdentityCliTest, SameRankOnDifferentGpusGivesDifferentSockets) {
  CommandResult a =
      Paths({"--device", "2", "--tp-size", "2", "--tp-rank", "0", "--shard-rules", rules_});
  CommandResult b =
      Paths({"--device", "6", "--tp-size", "2", "--tp-rank", "0", "--shard-rules", rules_});
  ASSERT_EQ(a.exit_code, 0) << a.err;
  ASSERT_EQ(b.exit_code, 0) << b.err;
  nlohmann::json ja = nlohmann::json::parse(a.out), jb = nlohmann::json::parse(b.out);
  EXPECT_EQ(ja["digest"], jb["digest"]);
  EXPECT_NE(ja["socket"], jb["socket"]);
  EXPECT_NE(ja["lock"], jb["lock"]);
}

// shard_rules_digest: "" unsharded; sharded, the SHA-256 of the canonical JSON of the rules
// document and the config.json values the planner reads (written out here by hand), so a
// changed config.json (its head counts decide the slices) is another cache.
TEST_F(IdentityCliTest, ShardRulesDigestCoversTheRulesAndConfigJson) {
  CommandResult unsharded = Paths({"--tier", "host"});
  ASSERT_EQ(unsharded.exit_code, 0) << unsharded.err;
  EXPECT_EQ(nlohmann::json::parse(unsharded.out)["config"]["shard_rules_digest"], "");

  WriteFile(model_dir_ + "/config.json",
            R"({"model_type": "tiny", "num_attention_heads": 4, "hidden_act": "silu",
                "rope_theta": 10000.0, "tie_word_embeddings": false})");
  CommandResult a = Paths({"--tier", "host", "--tp-size", "2", "--shard-rules", rules_});
  ASSERT_EQ(a.exit_code, 0) << a.err;
  nlohmann::json ja = nlohmann::json::parse(a.out);
  EXPECT_EQ(ja["config"]["shard_rules_digest"],
            Sha256Hex(R"({"model_config":{"integers":{"num_attention_heads":4},)"
                      R"("model_type":"tiny","tie_word_embeddings":false},)"
                      R"("rules":{"format":1,"rules":[{"match":"w","mode":"replicate"}]}})"));
  // --shard-rules alone makes a job sharded; the digest does not depend on the ranks.
  CommandResult rules_only = Paths({"--tier", "host", "--shard-rules", rules_});
  ASSERT_EQ(rules_only.exit_code, 0) << rules_only.err;
  EXPECT_EQ(nlohmann::json::parse(rules_only.out)["config"]["shard_rules_digest"],
            ja["config"]["shard_rules_digest"]);

  WriteFile(model_dir_ + "/config.json", R"({"model_type": "tiny", "num_attention_heads": 8})");
  CommandResult b = Paths({"--tier", "host", "--tp-size", "2", "--shard-rules", rules_});
  ASSERT_EQ(b.exit_code, 0) << b.err;
  nlohmann::json jb = nlohmann::json::parse(b.out);
  EXPECT_NE(jb["config"]["shard_rules_digest"], ja["config"]["shard_rules_digest"]);
  EXPECT_NE(jb["socket"], ja["socket"]);
}

TEST_F(IdentityCliTest, AShardedJobWithoutRulesOrWithBadRanksIsAUsageError) {
  CommandResult no_config = Paths({"--tier", "host", "--tp-size", "2"});
  EXPECT_EQ(no_config.exit_code, 2);
  EXPECT_THAT(no_config.err, HasSubstr("config.json has no model_type"));

  WriteFile(model_dir_ + "/config.json", R"({"model_type": "gpt2"})");
  CommandResult unknown = Paths({"--tier", "host", "--pp-size", "2"});
  EXPECT_EQ(unknown.exit_code, 2);
  EXPECT_THAT(unknown.err, HasSubstr("no built-in shard rule set for model_type \"gpt2\" "
                                     "(built-in: llama, "));

  CommandResult ranks = Paths({"--tier", "host", "--tp-size", "2", "--ep-size", "2", "--tp-rank",
                               "1", "--ep-rank", "0", "--shard-rules", rules_});
  EXPECT_EQ(ranks.exit_code, 2);
  EXPECT_THAT(ranks.err,
              HasSubstr("ep rank must be tp rank / (tp/ep) = 1 (tp 2 rank 1, ep 2 rank 0)"));
}

TEST_F(IdentityCliTest, PathsHostTierUsesTheHostKey) {
  CommandResult r = Paths({"--tier", "host"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["device_key"], "host");
  EXPECT_TRUE(j["device"].is_null());
  EXPECT_EQ(j["config"]["tier"], "host");
}

// A host-tier cache with a GPU affinity and a gpu-tier cache of the same weights on the same
// GPU are different caches: the tier is a CacheConfig field, so they get different sockets.
TEST_F(IdentityCliTest, HostAndGpuTiersOnOneGpuGetDifferentSockets) {
  CommandResult gpu = Paths({"--device", "3"});
  CommandResult host = Paths({"--device", "3", "--tier", "host"});
  ASSERT_EQ(gpu.exit_code, 0) << gpu.err;
  ASSERT_EQ(host.exit_code, 0) << host.err;
  nlohmann::json jg = nlohmann::json::parse(gpu.out), jh = nlohmann::json::parse(host.out);
  EXPECT_EQ(jg["config"]["tier"], "gpu");
  EXPECT_EQ(jh["config"]["tier"], "host");
  EXPECT_EQ(jg["device_key"], TestUuid(3));
  EXPECT_EQ(jh["device_key"], TestUuid(3));
  EXPECT_NE(jg["digest"], jh["digest"]);
  EXPECT_NE(jg["socket"], jh["socket"]);
  EXPECT_NE(jg["lock"], jh["lock"]);
}

TEST_F(IdentityCliTest, PathsErrorsAreUsageErrorsWithTheReason) {
  CommandResult no_device = Paths({});
  EXPECT_EQ(no_device.exit_code, 2);
  EXPECT_THAT(no_device.err, HasSubstr("--tier gpu needs --device N|UUID"));

  // The tier is taken by name only (not as the enum's integer).
  CommandResult numeric_tier = Paths({"--device", "0", "--tier", "1"});
  EXPECT_EQ(numeric_tier.exit_code, 2);
  EXPECT_THAT(numeric_tier.err, HasSubstr("--tier: 1 not in {gpu,host}"));

  CommandResult tmpl = Paths({"--device", "0", "--socket", tmp_.Join("{tp_rank}.sock")});
  EXPECT_EQ(tmpl.exit_code, 2);
  EXPECT_THAT(tmpl.err, HasSubstr("lacks {device_uuid}"));

  CommandResult hidden = Paths({"--device", "8"});
  EXPECT_NE(hidden.exit_code, 0);
  EXPECT_THAT(hidden.err, HasSubstr("device \"8\" is not a visible local index (8 visible)"));

  CommandResult long_namespace = Paths({"--device", "0", "--namespace", std::string(60, 'n')});
  EXPECT_EQ(long_namespace.exit_code, 2);
  EXPECT_THAT(long_namespace.err, HasSubstr("over the 107-byte sun_path limit"));
}

TEST_F(IdentityCliTest, DevicesJsonListsVisibleDevicesAndTheSource) {
  CommandResult r = RunCommand({CliPath(), "devices", "--json", "--device-inventory", inventory_},
                               {"CUDA_VISIBLE_DEVICES=5,3"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["source"], "inventory-file");
  EXPECT_EQ(j["source_detail"], inventory_);
  EXPECT_EQ(j["cuda_visible_devices"], "5,3");
  ASSERT_EQ(j["devices"].size(), 2u);
  EXPECT_EQ(j["devices"][0]["index"], 0);
  EXPECT_EQ(j["devices"][0]["uuid"], TestUuid(5));
  EXPECT_EQ(j["devices"][0]["memory_bytes"], 150754820096u);
  EXPECT_EQ(j["devices"][1]["uuid"], TestUuid(3));
}

TEST_F(IdentityCliTest, DevicesReportsWhereCudaVisibleDevicesEndedTheList) {
  CommandResult r = RunCommand({CliPath(), "devices", "--json", "--device-inventory", inventory_},
                               {"CUDA_VISIBLE_DEVICES=0,2,-1,1"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  nlohmann::json j = nlohmann::json::parse(r.out);
  ASSERT_EQ(j["devices"].size(), 2u);
  EXPECT_EQ(j["devices"][1]["uuid"], TestUuid(2));
  ASSERT_EQ(j["notes"].size(), 1u);
  EXPECT_THAT(j["notes"][0].get<std::string>(), HasSubstr("entry 2 \"-1\""));
}

TEST_F(IdentityCliTest, DevicesRejectsABadInventory) {
  WriteFile(tmp_.Join("bad.json"), "[{\"index\": 0}]");
  CommandResult r = RunCommand({CliPath(), "devices", "--device-inventory", tmp_.Join("bad.json")});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("entry 0: missing field \"uuid\""));
}

}  // namespace
}  // namespace weightcache::identity
