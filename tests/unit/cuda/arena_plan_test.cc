#include "checkpoint/arena_plan.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "support/test_env.h"

namespace weightcache::checkpoint {
namespace {

using testing::kGiB;
using testing::kMiB;
constexpr uint64_t kGranularity = 2 * kMiB;

// Every placement aligned, inside its allocation, and no two non-empty tensors overlap.
void ExpectConsistent(const ArenaPlan& plan, const std::vector<uint64_t>& tensors) {
  ASSERT_EQ(plan.placements.size(), tensors.size());
  uint64_t total = 0;
  for (uint64_t bytes : plan.allocation_bytes) {
    EXPECT_GT(bytes, 0u);
    EXPECT_EQ(bytes % kGranularity, 0u);
    total += bytes;
  }
  EXPECT_EQ(plan.total_bytes, total);
  std::vector<uint64_t> end_of_last(plan.allocation_bytes.size(), 0);
  for (size_t i = 0; i < tensors.size(); ++i) {
    const TensorPlacement& p = plan.placements[i];
    SCOPED_TRACE("tensor " + std::to_string(i));
    EXPECT_EQ(p.bytes, tensors[i]);
    ASSERT_LT(p.allocation, plan.allocation_bytes.size());
    EXPECT_EQ(p.offset % kTensorAlignment, 0u);
    EXPECT_LE(p.offset + p.bytes, plan.allocation_bytes[p.allocation]);
    // Placed in order: each tensor starts at or after the end of the previous one in the same
    // allocation, and allocation indices never go back.
    if (i > 0) {
      EXPECT_GE(p.allocation, plan.placements[i - 1].allocation);
    }
    EXPECT_GE(p.offset, end_of_last[p.allocation]);
    end_of_last[p.allocation] = p.offset + p.bytes;
  }
}

TEST(ArenaPlanTest, PacksSmallTensorsIntoOneAllocationWith256ByteAlignment) {
  std::vector<uint64_t> tensors = {1, 1000, 256, 257, 4096};
  ArenaPlan plan = PlanArena(tensors, kGranularity, kGiB);
  ExpectConsistent(plan, tensors);
  ASSERT_EQ(plan.allocation_bytes, std::vector<uint64_t>{kGranularity});
  std::vector<uint64_t> offsets;
  for (const TensorPlacement& p : plan.placements) offsets.push_back(p.offset);
  EXPECT_EQ(offsets, (std::vector<uint64_t>{0, 256, 1280, 1536, 2048}));
}

TEST(ArenaPlanTest, StartsANewAllocationWhenTheNextTensorWouldOverflow) {
  std::vector<uint64_t> tensors = {3 * kMiB, 3 * kMiB, 3 * kMiB};
  ArenaPlan plan = PlanArena(tensors, kGranularity, 8 * kMiB);
  ExpectConsistent(plan, tensors);
  EXPECT_EQ(plan.allocation_bytes, (std::vector<uint64_t>{6 * kMiB, 4 * kMiB}));
  EXPECT_EQ(plan.placements[0], (TensorPlacement{0, 0, 3 * kMiB}));
  EXPECT_EQ(plan.placements[1], (TensorPlacement{0, 3 * kMiB, 3 * kMiB}));
  EXPECT_EQ(plan.placements[2], (TensorPlacement{1, 0, 3 * kMiB}));
  EXPECT_EQ(plan.total_bytes, 10 * kMiB);
}

TEST(ArenaPlanTest, ATensorLargerThanTheMaximumGetsItsOwnAllocation) {
  std::vector<uint64_t> tensors = {kMiB, 9 * kMiB, kMiB};
  ArenaPlan plan = PlanArena(tensors, kGranularity, 4 * kMiB);
  ExpectConsistent(plan, tensors);
  EXPECT_EQ(plan.allocation_bytes, (std::vector<uint64_t>{2 * kMiB, 10 * kMiB, 2 * kMiB}));
  EXPECT_EQ(plan.placements[1], (TensorPlacement{1, 0, 9 * kMiB}));
  EXPECT_EQ(plan.placements[2], (TensorPlacement{2, 0, kMiB}));
}

TEST(ArenaPlanTest, AllocationCountIsFlatInTensorCount) {
  // 16 GiB as 10, 1,000 and 10,000 tensors: the attach cost is per allocation, so the plan
  // must not grow with the tensor count.
  for (uint64_t count : {uint64_t{10}, uint64_t{1000}, uint64_t{10000}}) {
    SCOPED_TRACE(count);
    std::vector<uint64_t> tensors(count, 16 * kGiB / count);
    ArenaPlan plan = PlanArena(tensors, kGranularity, kDefaultMaxAllocationBytes);
    ExpectConsistent(plan, tensors);
    // 16 GiB of tensors plus their alignment padding: just over one 16 GiB allocation.
    EXPECT_EQ(plan.allocation_bytes.size(), 2u);
    const uint64_t payload = count * tensors[0];
    ASSERT_GE(plan.total_bytes, payload);
    // Waste: at most one granule per allocation plus the alignment padding of each tensor.
    EXPECT_LE(plan.total_bytes - payload,
              plan.allocation_bytes.size() * kGranularity + count * kTensorAlignment);
  }
}

TEST(ArenaPlanTest, ZeroByteTensorsGetAlignedPlacementsInARealAllocation) {
  std::vector<uint64_t> tensors = {0, 0};
  ArenaPlan plan = PlanArena(tensors, kGranularity, kGiB);
  ExpectConsistent(plan, tensors);
  EXPECT_EQ(plan.allocation_bytes, std::vector<uint64_t>{kGranularity});
}

TEST(ArenaPlanTest, NoTensorsMeansNoAllocations) {
  ArenaPlan plan = PlanArena({}, kGranularity, kGiB);
  EXPECT_TRUE(plan.allocation_bytes.empty());
  EXPECT_TRUE(plan.placements.empty());
  EXPECT_EQ(plan.total_bytes, 0u);
}

TEST(ArenaPlanTest, ZeroMaximumMeansTheDefault) {
  std::vector<uint64_t> tensors = {3 * kGiB, 3 * kGiB};
  EXPECT_EQ(PlanArena(tensors, kGranularity, 0).allocation_bytes,
            PlanArena(tensors, kGranularity, kDefaultMaxAllocationBytes).allocation_bytes);
}

TEST(ArenaPlanTest, GranularitySmallerThanTensorAlignmentStillAlignsAllocations) {
  std::vector<uint64_t> tensors = {10, 10};
  ArenaPlan plan = PlanArena(tensors, 64, kGiB);
  EXPECT_EQ(plan.allocation_bytes, std::vector<uint64_t>{512});
  EXPECT_EQ(plan.placements[1].offset, 256u);
}

}  // namespace
}  // namespace weightcache::checkpoint
