// A sharded host-tier daemon (issue 12 §2-3) through the real binary and the C++ client: rank
// 1 of `serve --tp-size 2` holds only its slices (a dim-0 slice, a dim-1 slice gathered from
// strided rows, a replicated tensor), each naming its slice; the fallback loads the same; a
// split the rules cannot make is refused with exit 5 naming the tensor and the rule; the
// built-in set `replicate` serves a model_type without rules, every tensor whole.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "integration/daemon_process.h"
#include "support/test_env.h"
#include "unit/sharding/sharding_fixture.h"
#include "weightcache/client.h"

namespace weightcache::sharding {
namespace {

using ::testing::HasSubstr;
using weightcache::testing::CliPath;
using weightcache::testing::ServeProcess;
using weightcache::testing::WaitForState;
using weightcache::testing::WriteFile;

constexpr const char* kRules = R"({"format": 1, "rules": [
    {"match": "a", "mode": "split", "dim": 0},
    {"match": "b", "mode": "split", "dim": 1},
    {"match": "c", "mode": "replicate"}]})";

class ShardServeTest : public testing::ShardingFixture {
 protected:
  void SetUp() override {
    ShardingFixture::SetUp();
    if (IsSkipped()) return;
    rules_ = tmp_.Join("rules.json");
    WriteFile(rules_, kRules);
    runtime_ = tmp_.Join("rt");
  }

  std::vector<std::string> Identity(const std::string& model) const {
    return {"--model",   model, "--tier",    "host", "--runtime-dir", runtime_,
            "--tp-size", "2",   "--tp-rank", "1",    "--shard-rules", rules_};
  }
  AttachOptions Options(const std::string& model) const {
    AttachOptions o;
    o.identity.model_dir = model;
    o.identity.tier = Tier::kHost;
    o.identity.runtime_dir = runtime_;
    o.identity.tp_size = 2;
    o.identity.tp_rank = 1;
    o.identity.shard_rules = rules_;
    o.wait_timeout = std::chrono::seconds(30);
    return o;
  }

  std::string rules_;
  std::string runtime_;
};

// The elements [r0, r1) x [c0, c1) of a row-major float matrix of `cols` columns.
std::vector<float> Block(const std::vector<float>& full, size_t cols, size_t r0, size_t r1,
                         size_t c0, size_t c1) {
  std::vector<float> out;
  for (size_t r = r0; r < r1; ++r) {
    for (size_t c = c0; c < c1; ++c) out.push_back(full[r * cols + c]);
  }
  return out;
}

std::vector<float> Floats(const Tensor& t) {
  std::vector<float> out(t.nbytes / sizeof(float));
  std::memcpy(out.data(), t.host_ptr(), t.nbytes);
  return out;
}

// Checks rank 1's table: a = rows [2, 4) of 4, b = columns [3, 6) of 6, c whole.
void ExpectRankOne(const Attachment& att, const checkpoint::Checkpoint& ckpt) {
  auto full = [&](const std::string& name) {
    const checkpoint::TensorInfo* info = ckpt.Find(name);
    EXPECT_NE(info, nullptr) << name;
    std::vector<float> out(info->nbytes / sizeof(float));
    EXPECT_TRUE(checkpoint::ReadTensor(ckpt, *info, out.data()).ok());
    return out;
  };
  ASSERT_EQ(att.tensors().size(), 3u);
  const Tensor* a = att.Find("a");
  const Tensor* b = att.Find("b");
  const Tensor* c = att.Find("c");
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(std::vector<int64_t>(a->shape.begin(), a->shape.end()), (std::vector<int64_t>{2, 6}));
  EXPECT_EQ(a->slice, (TensorSlice{0, 2, 2, 4}));
  EXPECT_EQ(Floats(*a), Block(full("a"), 6, 2, 4, 0, 6));
  EXPECT_EQ(std::vector<int64_t>(b->shape.begin(), b->shape.end()), (std::vector<int64_t>{4, 3}));
  EXPECT_EQ(std::vector<int64_t>(b->strides.begin(), b->strides.end()),
            (std::vector<int64_t>{3, 1}));
  EXPECT_EQ(b->slice, (TensorSlice{1, 3, 3, 6}));
  EXPECT_EQ(Floats(*b), Block(full("b"), 6, 0, 4, 3, 6));
  EXPECT_EQ(c->slice, std::nullopt);
  EXPECT_EQ(Floats(*c), full("c"));
}

TEST_F(ShardServeTest, RankOneServesItsSlicesAndTheFallbackLoadsTheSame) {
  const std::string model =
      Make("m", {{"a", {4, 6}, "f32"}, {"b", {4, 6}, "f32"}, {"c", {5}, "f32"}}, nullptr);
  auto ckpt = checkpoint::Checkpoint::Open(model);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status().ToString();

  // No daemon: the fallback loads rank 1's slices from disk.
  auto fallback = Attachment::Attach(Options(model));
  ASSERT_TRUE(fallback.ok()) << fallback.status().ToString();
  EXPECT_EQ(fallback->source(), AttachSource::kFallback);
  ExpectRankOne(*fallback, *ckpt);

  auto serve = ServeProcess::Start(Identity(model), tmp_.Join("serve.log"));
  ASSERT_NE(serve, nullptr);
  auto socket = WaitForState(*serve, runtime_, protocol::CacheState::kReady);
  ASSERT_TRUE(socket.ok()) << socket.status().ToString() << serve->Log();
  auto att = Attachment::Attach(Options(model));
  ASSERT_TRUE(att.ok()) << att.status().ToString();
  EXPECT_EQ(att->source(), AttachSource::kDaemon) << att->source_reason();
  ExpectRankOne(*att, *ckpt);
  // The held bytes: 12 + 12 + 5 floats.
  EXPECT_EQ(att->total_bytes(), 29 * sizeof(float));

  // `ls --json` marks the cache sharded.
  auto ls =
      weightcache::testing::RunCommand({CliPath(), "ls", "--json", "--runtime-dir", runtime_});
  ASSERT_EQ(ls.exit_code, 0) << ls.err;
  const nlohmann::json rows = nlohmann::json::parse(ls.out)["caches"];
  ASSERT_EQ(rows.size(), 1u);
  EXPECT_EQ(rows[0]["sharded"], true);
  EXPECT_EQ(rows[0]["tensors"], 3);
  EXPECT_EQ(rows[0]["config"]["tp_rank"], 1);
}

TEST_F(ShardServeTest, AnUndividableSplitExits5NamingTheTensorAndTheRule) {
  const std::string model =
      Make("odd", {{"a", {4, 6}, "f32"}, {"b", {4, 5}, "f32"}, {"c", {5}, "f32"}}, nullptr);
  auto serve = ServeProcess::Start(Identity(model), tmp_.Join("odd.log"));
  ASSERT_NE(serve, nullptr);
  EXPECT_EQ(serve->WaitExit(std::chrono::seconds(30)), 5) << serve->Log();
  EXPECT_THAT(serve->Log(), HasSubstr("tensor b (rule 1 (b))"));
}

// Issue 39 §4: a TP rank of an architecture without built-in rules. With no --shard-rules the
// serve exits 2 and names `replicate`; with `--shard-rules replicate` each rank holds every
// tensor whole, from the daemon and from the fallback alike.
TEST_F(ShardServeTest, ReplicateServesEveryTensorWholeForAModelTypeWithoutRules) {
  const std::string model = Make("gpt", {{"a", {4, 6}, "f32"}, {"b", {4, 5}, "f32"}},
                                 nlohmann::json{{"model_type", "gpt2"}});
  auto ckpt = checkpoint::Checkpoint::Open(model);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status().ToString();
  std::vector<std::string> args = {"--model", model,       "--tier", "host",      "--runtime-dir",
                                   runtime_,  "--tp-size", "2",      "--tp-rank", "0"};
  auto refused = ServeProcess::Start(args, tmp_.Join("refused.log"));
  ASSERT_NE(refused, nullptr);
  EXPECT_EQ(refused->WaitExit(std::chrono::seconds(30)), 2) << refused->Log();
  EXPECT_THAT(refused->Log(), HasSubstr("no built-in shard rule set for model_type \"gpt2\""));
  EXPECT_THAT(refused->Log(), HasSubstr("give --shard-rules NAME|FILE (--shard-rules replicate"));

  const auto expect_whole = [&](const Attachment& att) {
    ASSERT_EQ(att.tensors().size(), 2u);
    EXPECT_EQ(att.total_bytes(), ckpt->total_bytes());
    for (const char* name : {"a", "b"}) {
      const Tensor* t = att.Find(name);
      ASSERT_NE(t, nullptr) << name;
      EXPECT_EQ(t->slice, std::nullopt) << name;
      const checkpoint::TensorInfo* info = ckpt->Find(name);
      ASSERT_NE(info, nullptr) << name;
      std::vector<float> full(info->nbytes / sizeof(float));
      ASSERT_TRUE(checkpoint::ReadTensor(*ckpt, *info, full.data()).ok());
      EXPECT_EQ(Floats(*t), full) << name;
    }
  };
  AttachOptions o = Options(model);
  o.identity.shard_rules = "replicate";
  // Rank 1, no daemon: the fallback loads the whole checkpoint by the same rule set.
  auto fallback = Attachment::Attach(o);
  ASSERT_TRUE(fallback.ok()) << fallback.status().ToString();
  EXPECT_EQ(fallback->source(), AttachSource::kFallback);
  expect_whole(*fallback);

  // Rank 0 served with --shard-rules replicate: its daemon holds every tensor whole.
  args.insert(args.end(), {"--shard-rules", "replicate"});
  auto serve = ServeProcess::Start(args, tmp_.Join("replicate.log"));
  ASSERT_NE(serve, nullptr);
  ASSERT_TRUE(WaitForState(*serve, runtime_, protocol::CacheState::kReady).ok()) << serve->Log();
  o.identity.tp_rank = 0;
  auto att = Attachment::Attach(o);
  ASSERT_TRUE(att.ok()) << att.status().ToString();
  EXPECT_EQ(att->source(), AttachSource::kDaemon) << att->source_reason();
  expect_whole(*att);
}

// The gpu tier loads a rank's slices too (tests/gpu/shard_gpu_test.cc on a GPU): a sharded
// gpu-tier serve is no longer refused but plans and starts its load, which fails here only
// for want of the device (no driver on a CPU machine; the inventory's made-up UUID on a GPU
// one).
TEST_F(ShardServeTest, ShardedGpuTierServeStartsItsLoad) {
  const std::string model =
      Make("g", {{"a", {4, 6}, "f32"}, {"b", {4, 6}, "f32"}, {"c", {5}, "f32"}}, nullptr);
  std::vector<std::string> args = Identity(model);
  args[3] = "gpu";
  const std::string inventory = tmp_.Join("inventory.json");
  WriteFile(inventory, R"([{"index":0,"uuid":"GPU-11111111-2222-3333-4444-555555555555",)"
                       R"("name":"Fake","memory_bytes":1000000000}])");
  args.insert(args.end(),
              {"--device", "0", "--device-inventory", inventory, "--failed-linger", "0"});
  auto serve = ServeProcess::Start(args, tmp_.Join("gpu.log"));
  ASSERT_NE(serve, nullptr);
  const std::optional<int> code = serve->WaitExit(std::chrono::seconds(60));
  ASSERT_TRUE(code.has_value()) << serve->Log();
  EXPECT_NE(*code, 0) << serve->Log();
  EXPECT_THAT(serve->Log(), HasSubstr("serving g tp 1/2 pp 0/1 ep 0/1, tier gpu, device "
                                      "GPU-11111111-2222-3333-4444-555555555555"));
  EXPECT_THAT(serve->Log(), HasSubstr("load failed: "));
  EXPECT_THAT(serve->Log(), ::testing::Not(HasSubstr("not implemented")));
}

}  // namespace
}  // namespace weightcache::sharding
