// `weightcache inspect` through the real binary on a real sharded checkpoint.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "checkpoint/checkpoint.h"
#include "unit/checkpoint/checkpoint_fixture.h"
#include "unit/checkpoint/header_builder.h"

namespace weightcache::checkpoint {
namespace {

using ::testing::HasSubstr;
using weightcache::testing::CliPath;
using weightcache::testing::RunCommand;

class InspectTest : public testing::CheckpointFixture {};

TEST_F(InspectTest, ListsAShardedCheckpoint) {
  const std::string dir = Make("ck", {"--tensors", "9", "--dtypes", "bf16,f8_e4m3,f32", "--shards",
                                      "3", "--seed", "4", "--metadata", "format=pt"});
  Result<Checkpoint> c = Checkpoint::Open(dir);
  ASSERT_TRUE(c.ok()) << c.status().ToString();

  auto text = RunCommand({CliPath(), "inspect", dir});
  ASSERT_EQ(text.exit_code, 0) << text.err;
  EXPECT_THAT(text.out, HasSubstr("fingerprint: " + c->fingerprint()));
  EXPECT_THAT(text.out, HasSubstr("shards:      3"));
  EXPECT_THAT(text.out, HasSubstr("format = pt"));
  EXPECT_THAT(text.out, HasSubstr("model.layers.1.f8_e4m3.weight"));
  EXPECT_THAT(text.out, HasSubstr("F8_E4M3"));

  auto js = RunCommand({CliPath(), "inspect", dir, "--json"});
  ASSERT_EQ(js.exit_code, 0) << js.err;
  nlohmann::json j = nlohmann::json::parse(js.out, nullptr, /*allow_exceptions=*/false);
  ASSERT_TRUE(j.is_object()) << js.out;
  EXPECT_EQ(j["fingerprint"], c->fingerprint());
  EXPECT_EQ(j["total_bytes"].get<uint64_t>(), c->total_bytes());
  EXPECT_EQ(j["shards"].size(), 3u);
  EXPECT_EQ(j["metadata"]["format"], "pt");
  ASSERT_EQ(j["tensors"].size(), 9u);
  for (const auto& t : j["tensors"]) {
    const std::string name = t["name"].get<std::string>();
    const auto& e = manifest_["tensors"][name];
    EXPECT_EQ(t["dtype"], e["dtype"]) << name;
    EXPECT_EQ(t["shape"], e["shape"]) << name;
    EXPECT_EQ(t["nbytes"], e["nbytes"]) << name;
    EXPECT_EQ(j["shards"][t["shard"].get<size_t>()]["file_name"], e["file"]) << name;
  }
}

TEST_F(InspectTest, CorruptCheckpointExitsFive) {
  const std::string file = tmp_.Join("bad.safetensors");
  weightcache::testing::WriteFile(file, testing::SafetensorsBytes("{\"t\":{\"dtype\":\"X\"}}"));
  auto r = RunCommand({CliPath(), "inspect", file, "--json"});
  EXPECT_EQ(r.exit_code, 5);
  EXPECT_TRUE(r.out.empty()) << r.out;
  EXPECT_THAT(r.err, HasSubstr("weightcache inspect: invalid checkpoint: " + file +
                               ": tensor 't': unknown dtype \"X\""));
}

TEST_F(InspectTest, MissingPathExitsOneAndUsageErrorsTwo) {
  auto r = RunCommand({CliPath(), "inspect", tmp_.Join("absent")});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("not found: open checkpoint " + tmp_.Join("absent")));
  auto u = RunCommand({CliPath(), "inspect"});
  EXPECT_EQ(u.exit_code, 2);
}

}  // namespace
}  // namespace weightcache::checkpoint
