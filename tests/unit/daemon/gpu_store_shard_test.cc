// A sharded gpu-tier load (LoadGpuStore with a shard plan) over the fake driver, with its VMM
// memory backed (FakeDriver::BackVmmMemory) so that what the upload pipeline copied can be
// read back: for TP=2 ranks 0 and 1 of a Llama checkpoint written by the safetensors library,
// the arena holds only the rank's held bytes, and every tensor's bytes at its manifest place
// equal the slice cut from the file by shape arithmetic (not by the planner's geometry).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "checkpoint/arena_plan.h"
#include "checkpoint/checkpoint.h"
#include "common/checksum.h"
#include "daemon/weight_store.h"
#include "identity/resolve.h"
#include "os/memfd.h"
#include "protocol/manifest.h"
#include "sharding/builtin_rules.h"
#include "sharding/model_config.h"
#include "sharding/planner.h"
#include "sharding/rules.h"
#include "support/test_env.h"
#include "unit/cuda/fake_driver.h"
#include "unit/sharding/sharding_fixture.h"

namespace weightcache::daemon {
namespace {

using cuda::testing::FakeDriver;

constexpr uint64_t kGranularity = 4096;  // small, so the arena's size follows the held bytes

class GpuStoreShardTest : public sharding::testing::ShardingFixture {};

TEST_F(GpuStoreShardTest, ATp2LoadPlacesOnlyEachRanksHeldBytes) {
  const sharding::testing::DenseModel model;
  const std::string dir = Make("llama", model.Tensors(), model.Config(), 2);
  auto opened = sharding::testing::OpenWithBuiltinRules(dir);
  ASSERT_TRUE(opened.ok()) << opened.status().ToString();
  const checkpoint::Checkpoint* ckpt = &opened->ckpt;
  const sharding::ModelConfig* config = &opened->config;
  const sharding::RuleSet* rules = &opened->rules;
  std::vector<uint64_t> full_sizes;
  for (const auto& t : ckpt->tensors()) full_sizes.push_back(t.nbytes);
  const uint64_t full_arena = checkpoint::PlanArena(full_sizes, kGranularity).total_bytes;

  std::map<std::string, std::string> rank0_bytes;  // of the tensors rank 0 holds a slice of
  for (uint32_t rank : {0u, 1u}) {
    SCOPED_TRACE("tp rank " + std::to_string(rank));
    auto plan = sharding::PlanShard(*ckpt, *rules, *config, {.tp_size = 2, .tp_rank = rank});
    ASSERT_TRUE(plan.ok()) << plan.status().ToString();
    ASSERT_LT(plan->bytes, ckpt->total_bytes());

    FakeDriver fake(kGranularity);
    fake.BackVmmMemory();
    identity::Env env = identity::Env::Default();
    env.load_driver = [&fake]() -> Result<const cuda::DriverApi*> { return fake.api(); };
    env.lookup = identity::MapEnv({});
    IdentityOptions identity;
    identity.model_dir = dir;
    identity.tier = Tier::kGpu;
    identity.device = "1";
    identity.runtime_dir = tmp_.Join("run");
    auto id = identity::ResolveIdentity(identity, env);
    ASSERT_TRUE(id.ok()) << id.status().ToString();

    LoadOptions options;
    options.threads = 2;
    options.device = *id->device;
    options.driver = fake.api();
    options.cache_name = "weightcache:test";
    options.shard_plan = &*plan;
    std::vector<std::pair<uint64_t, uint64_t>> progress;
    LoadControl control;
    control.progress = [&](uint64_t done, uint64_t total) { progress.emplace_back(done, total); };
    std::string memory;
    auto store = LoadGpuStore(*ckpt, options, control, &memory);
    ASSERT_TRUE(store.ok()) << store.status().ToString();
    ASSERT_FALSE(progress.empty());
    EXPECT_EQ(progress.back(), std::make_pair(plan->bytes, plan->bytes));

    const StoreSummary& summary = store->summary();
    EXPECT_EQ(summary.tensor_count, plan->tensors.size());
    EXPECT_EQ(summary.tensor_bytes, plan->bytes);
    std::vector<uint64_t> held_sizes;
    for (const auto& p : plan->tensors) held_sizes.push_back(p.bytes);
    EXPECT_EQ(summary.resident_bytes, checkpoint::PlanArena(held_sizes, kGranularity).total_bytes);
    EXPECT_LT(summary.resident_bytes, full_arena);

    auto region = os::MapReadOnly(summary.manifest.fd.get(), summary.manifest.size);
    ASSERT_TRUE(region.ok()) << region.status().ToString();
    auto manifest = protocol::Manifest::DecodeMapped(std::move(region).value());
    ASSERT_TRUE(manifest.ok()) << manifest.status().ToString();
    EXPECT_EQ(manifest->tier(), Tier::kGpu);
    const std::vector<int> fds = store->fds();
    ASSERT_EQ(fds.size(), manifest->allocation_sizes().size());
    ASSERT_EQ(manifest->tensor_count(), plan->tensors.size());
    size_t sliced = 0;
    for (size_t i = 0; i < manifest->tensor_count(); ++i) {
      const protocol::TensorEntry e = manifest->tensor(i);
      const std::string name(e.name);
      SCOPED_TRACE(name);
      const checkpoint::TensorInfo& t = *ckpt->Find(name);
      const sharding::PlannedTensor* p = nullptr;
      for (const auto& q : plan->tensors) {
        if (q.tensor == &t) p = &q;
      }
      ASSERT_NE(p, nullptr) << "a tensor the plan does not hold is in the manifest";
      EXPECT_EQ(e.nbytes, p->bytes);
      EXPECT_TRUE(std::equal(p->shape.begin(), p->shape.end(), e.dims().begin(), e.dims().end()));
      std::string expected;
      if (e.slice) {
        ++sliced;
        EXPECT_EQ(e.slice->full_length, t.shape[e.slice->dim]);
        expected = sharding::testing::SliceOf(*ckpt, t, e.slice->dim, e.slice->offset,
                                              e.shape[e.slice->dim]);
        if (rank == 0) rank0_bytes[name] = expected;
        if (rank == 1) {
          EXPECT_NE(expected, rank0_bytes[name]) << "both ranks hold the same slice";
        }
      } else {
        expected = sharding::testing::SliceOf(*ckpt, t, 0, 0, t.shape.empty() ? 0 : t.shape[0]);
      }
      ASSERT_EQ(expected.size(), e.nbytes);
      EXPECT_TRUE(fake.ExportedBytes(fds[e.allocation], e.offset, e.nbytes) == expected)
          << "the device bytes differ from the file's slice";
      EXPECT_EQ(e.checksum, TensorChecksum(expected.data(), expected.size()));
    }
    // Column splits (o_proj, down_proj: dim 1) and row splits (q/k/v, gate/up: dim 0).
    EXPECT_GE(sliced, 10u);
    EXPECT_EQ(fake.violations(), 0) << ::testing::PrintToString(fake.violation_log());
  }
}

}  // namespace
}  // namespace weightcache::daemon
