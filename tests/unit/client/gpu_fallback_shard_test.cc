// The client's gpu-tier disk fallback of a sharded identity (LoadGpuFallback with a plan) over
// the fake driver, whose cuMemAlloc memory is host memory: for TP=2 ranks 0 and 1 of a Llama
// checkpoint written by the safetensors library, the device buffer holds only the rank's held
// bytes, each tensor equal to the slice cut from the file by shape arithmetic, with its held
// shape, its slice and the checksum of its held bytes. A small staging buffer splits pieces
// of strided slices across flushes.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <string>

#include "checkpoint/checkpoint.h"
#include "client/fallback_loader.h"
#include "common/checksum.h"
#include "sharding/model_config.h"
#include "sharding/planner.h"
#include "sharding/rules.h"
#include "unit/cuda/fake_driver.h"
#include "unit/sharding/sharding_fixture.h"

namespace weightcache::client {
namespace {

using cuda::testing::FakeDriver;

class GpuFallbackShardTest : public sharding::testing::ShardingFixture {};

TEST_F(GpuFallbackShardTest, Tp2FallbackUploadsOnlyEachRanksSlices) {
  const sharding::testing::DenseModel model;
  const std::string dir = Make("llama", model.Tensors(), model.Config(), 2);
  auto opened = sharding::testing::OpenWithBuiltinRules(dir);
  ASSERT_TRUE(opened.ok()) << opened.status().ToString();
  const checkpoint::Checkpoint* ckpt = &opened->ckpt;
  const sharding::ModelConfig* config = &opened->config;
  const sharding::RuleSet* rules = &opened->rules;

  for (uint32_t rank : {0u, 1u}) {
    SCOPED_TRACE("tp rank " + std::to_string(rank));
    auto plan = sharding::PlanShard(*ckpt, *rules, *config, {.tp_size = 2, .tp_rank = rank});
    ASSERT_TRUE(plan.ok()) << plan.status().ToString();
    FakeDriver fake;
    {
      auto loaded = LoadGpuFallback(fake.api(), 0, *ckpt, 2, &*plan, 3000);
      ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
      EXPECT_LT(loaded->buffer.size(), ckpt->total_bytes() * 6 / 10) << "about half is held";
      ASSERT_EQ(loaded->tensors.size(), plan->tensors.size());
      size_t sliced = 0;
      for (const sharding::PlannedTensor& p : plan->tensors) {
        SCOPED_TRACE(p.tensor->name);
        const Tensor* t = loaded->tensors.Find(p.tensor->name);
        ASSERT_NE(t, nullptr);
        EXPECT_EQ(t->nbytes, p.bytes);
        EXPECT_TRUE(std::equal(p.shape.begin(), p.shape.end(), t->shape.begin(), t->shape.end()));
        std::string expected;
        if (p.slice) {
          ++sliced;
          ASSERT_TRUE(t->slice.has_value());
          EXPECT_EQ(*t->slice, (TensorSlice{p.slice->dim, p.slice->offset, p.slice->length,
                                            p.tensor->shape[p.slice->dim]}));
          expected = sharding::testing::SliceOf(*ckpt, *p.tensor, p.slice->dim, p.slice->offset,
                                                p.slice->length);
        } else {
          EXPECT_FALSE(t->slice.has_value());
          expected = sharding::testing::SliceOf(*ckpt, *p.tensor, 0, 0,
                                                p.tensor->shape.empty() ? 0 : p.tensor->shape[0]);
        }
        ASSERT_EQ(expected.size(), t->nbytes);
        // The fake's device memory is host memory.
        EXPECT_TRUE(std::string(static_cast<const char*>(t->host_ptr()), t->nbytes) == expected)
            << "the device bytes differ from the file's slice";
        EXPECT_EQ(t->checksum, TensorChecksum(expected.data(), expected.size()));
      }
      EXPECT_GE(sliced, 10u);
    }
    EXPECT_EQ(fake.live_device_allocs(), 0);
    EXPECT_EQ(fake.live_host_buffers(), 0);
    EXPECT_EQ(fake.live_host_registrations(), 0);
    EXPECT_EQ(fake.total_context_refs(), 0);
    EXPECT_EQ(fake.violations(), 0);
  }
}

}  // namespace
}  // namespace weightcache::client
