// PlanLaunch against an independent model: enumerate the job's global ranks
// (rank = pp_rank * tp + tp_rank), cut them into nnodes equal consecutive blocks, and number
// each node's block from base in steps of `step`. That is what "TP groups inside a node,
// PP stages across nodes" means; the SGLang-style formula must agree with it everywhere.
#include "launcher/placement.h"

#include <gtest/gtest.h>

#include <optional>
#include <string>
#include <vector>

namespace weightcache::launcher {
namespace {

std::vector<std::string> Uuids(int n) {
  std::vector<std::string> out;
  for (int i = 0; i < n; ++i) {
    char buf[64];
    std::snprintf(buf, sizeof(buf), "GPU-%08x-0000-4000-8000-%012x", 0xa0 + i, i);
    out.push_back(buf);
  }
  return out;
}

struct Expected {
  bool valid_layout = true;
  std::vector<DaemonPlacement> daemons;
  std::optional<long long> first_out_of_range_gpu;
};

Expected Model(int tp, int pp, int nnodes, int node_rank, int base, int step,
               const std::vector<std::string>& uuids) {
  Expected e;
  const int world = tp * pp;
  if (world % nnodes != 0) {
    e.valid_layout = false;
    return e;
  }
  const int per_node = world / nnodes;
  // A node holds whole TP groups, or an equal slice of exactly one TP group.
  if (per_node % tp != 0 && tp % per_node != 0) {
    e.valid_layout = false;
    return e;
  }
  for (int rank = 0; rank < world; ++rank) {
    if (rank / per_node != node_rank) continue;
    const long long gpu = base + static_cast<long long>(rank % per_node) * step;
    if (gpu >= static_cast<long long>(uuids.size())) {
      if (!e.first_out_of_range_gpu) e.first_out_of_range_gpu = gpu;
      continue;
    }
    DaemonPlacement p;
    p.pp_rank = rank / tp;
    p.tp_rank = rank % tp;
    p.local_gpu_id = static_cast<int>(gpu);
    p.device_uuid = uuids[gpu];
    e.daemons.push_back(p);
  }
  return e;
}

TEST(PlanLaunchTest, MatchesRankEnumerationForEveryTopology) {
  const auto uuids = Uuids(8);
  int valid_plans = 0, layout_errors = 0, range_errors = 0;
  for (int nnodes = 1; nnodes <= 2; ++nnodes) {
    for (int tp = 1; tp <= 8; ++tp) {
      for (int pp = 1; pp <= 4; ++pp) {
        for (int node_rank = 0; node_rank < nnodes; ++node_rank) {
          for (int base : {0, 1, 3}) {
            for (int step : {1, 2}) {
              SCOPED_TRACE("tp=" + std::to_string(tp) + " pp=" + std::to_string(pp) + " nnodes=" +
                           std::to_string(nnodes) + " node_rank=" + std::to_string(node_rank) +
                           " base=" + std::to_string(base) + " step=" + std::to_string(step));
              LaunchTopology t;
              t.tp_size = tp;
              t.pp_size = pp;
              t.nnodes = nnodes;
              t.node_rank = node_rank;
              t.base_gpu_id = base;
              t.gpu_id_step = step;
              t.visible_device_uuids = uuids;
              const Expected e = Model(tp, pp, nnodes, node_rank, base, step, uuids);
              auto plan = PlanLaunch(t);
              if (!e.valid_layout) {
                ++layout_errors;
                ASSERT_FALSE(plan.ok());
                EXPECT_EQ(plan.status().code(), StatusCode::kInvalidArgument);
                EXPECT_NE(plan.status().message().find("not divisible across nodes"),
                          std::string::npos)
                    << plan.status().message();
              } else if (e.first_out_of_range_gpu) {
                ++range_errors;
                ASSERT_FALSE(plan.ok());
                EXPECT_EQ(plan.status().code(), StatusCode::kInvalidArgument);
                const std::string want = "GPU id " + std::to_string(*e.first_out_of_range_gpu);
                EXPECT_NE(plan.status().message().find(want), std::string::npos)
                    << plan.status().message();
                EXPECT_NE(plan.status().message().find("8 visible"), std::string::npos)
                    << plan.status().message();
              } else {
                ++valid_plans;
                ASSERT_TRUE(plan.ok()) << plan.status().ToString();
                EXPECT_EQ(*plan, e.daemons);
              }
            }
          }
        }
      }
    }
  }
  // The sweep exercises all three outcomes substantially.
  EXPECT_GT(valid_plans, 100);
  EXPECT_GT(layout_errors, 10);
  EXPECT_GT(range_errors, 100);
}

TEST(PlanLaunchTest, Pp2Tp2Step2UsesEveryOtherGpu) {
  LaunchTopology t;
  t.tp_size = 2;
  t.pp_size = 2;
  t.gpu_id_step = 2;
  t.visible_device_uuids = Uuids(8);
  auto plan = PlanLaunch(t);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  ASSERT_EQ(plan->size(), 4u);
  std::vector<int> gpus;
  for (const auto& p : *plan) gpus.push_back(p.local_gpu_id);
  EXPECT_EQ(gpus, (std::vector<int>{0, 2, 4, 6}));
  EXPECT_EQ((*plan)[3].tp_rank, 1);
  EXPECT_EQ((*plan)[3].pp_rank, 1);
  EXPECT_EQ((*plan)[3].device_uuid, Uuids(8)[6]);
}

// launch --no-gpu: every rank, none on a GPU, and no device needs to be visible.
TEST(PlanLaunchTest, WithoutGpusEveryRankHoldsNoDevice) {
  LaunchTopology t;
  t.tp_size = 2;
  t.pp_size = 2;
  t.ep_size = 2;
  t.without_gpus = true;
  auto plan = PlanLaunch(t);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  ASSERT_EQ(plan->size(), 4u);
  for (size_t i = 0; i < plan->size(); ++i) {
    const DaemonPlacement& p = (*plan)[i];
    EXPECT_EQ(p.tp_rank, static_cast<int>(i % 2));
    EXPECT_EQ(p.pp_rank, static_cast<int>(i / 2));
    EXPECT_EQ(p.ep_rank, p.tp_rank);
    EXPECT_EQ(p.local_gpu_id, -1);
    EXPECT_EQ(p.device_uuid, "");
    EXPECT_EQ(p.GpuLabel(), "no gpu");
  }
  t.without_gpus = false;
  t.visible_device_uuids = Uuids(4);
  EXPECT_EQ(PlanLaunch(t)->at(3).GpuLabel(), "gpu3");
}

TEST(PlanLaunchTest, TpAcrossTwoNodesGivesTheSecondNodeTheUpperRanksFromBase) {
  LaunchTopology t;
  t.tp_size = 4;
  t.nnodes = 2;
  t.node_rank = 1;
  t.base_gpu_id = 4;
  t.visible_device_uuids = Uuids(8);
  auto plan = PlanLaunch(t);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  ASSERT_EQ(plan->size(), 2u);
  EXPECT_EQ((*plan)[0].tp_rank, 2);
  EXPECT_EQ((*plan)[0].local_gpu_id, 4);
  EXPECT_EQ((*plan)[1].tp_rank, 3);
  EXPECT_EQ((*plan)[1].local_gpu_id, 5);
}

TEST(PlanLaunchTest, RanksRangesFollowSglangForPpAcrossNodes) {
  LaunchTopology t;
  t.tp_size = 2;
  t.pp_size = 4;
  t.nnodes = 2;
  t.node_rank = 1;
  t.visible_device_uuids = Uuids(8);
  auto ranges = ComputeNodeRankRanges(t);
  ASSERT_TRUE(ranges.ok());
  EXPECT_EQ(ranges->pp_begin, 2);
  EXPECT_EQ(ranges->pp_end, 4);
  EXPECT_EQ(ranges->tp_begin, 0);
  EXPECT_EQ(ranges->tp_end, 2);
  EXPECT_EQ(ranges->pp_per_node, 2);
  EXPECT_EQ(ranges->tp_per_node, 2);
}

TEST(PlanLaunchTest, LocalIdIndexesTheVisibleListNotThePhysicalOne) {
  // CUDA_VISIBLE_DEVICES=4,5,6,7: local 0 is physical 4.
  const auto physical = Uuids(8);
  LaunchTopology t;
  t.tp_size = 2;
  t.visible_device_uuids.assign(physical.begin() + 4, physical.end());
  auto plan = PlanLaunch(t);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  EXPECT_EQ((*plan)[0].local_gpu_id, 0);
  EXPECT_EQ((*plan)[0].device_uuid, physical[4]);
  EXPECT_EQ((*plan)[1].device_uuid, physical[5]);
}

TEST(PlanLaunchTest, ExpertRankIsTheBlockOfTheTpRank) {
  LaunchTopology t;
  t.tp_size = 8;
  t.ep_size = 2;
  t.visible_device_uuids = Uuids(8);
  auto plan = PlanLaunch(t);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  std::vector<int> ep;
  for (const auto& p : *plan) ep.push_back(p.ep_rank);
  EXPECT_EQ(ep, (std::vector<int>{0, 0, 0, 0, 1, 1, 1, 1}));
}

struct Sizes {
  int tp = 1, pp = 1, ep = 1, nnodes = 1, node_rank = 0, base = 0, step = 1;
};

Status PlanError(const Sizes& z, int visible = 8) {
  LaunchTopology t;
  t.tp_size = z.tp;
  t.pp_size = z.pp;
  t.ep_size = z.ep;
  t.nnodes = z.nnodes;
  t.node_rank = z.node_rank;
  t.base_gpu_id = z.base;
  t.gpu_id_step = z.step;
  t.visible_device_uuids = Uuids(visible);
  return PlanLaunch(t).status();
}

void ExpectError(const Status& s, const std::string& substring) {
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_NE(s.message().find(substring), std::string::npos) << s.ToString();
}

TEST(PlanLaunchTest, Errors) {
  ExpectError(PlanError({.tp = 3, .nnodes = 2}),
              "tp size is not divisible across nodes (tp=3 pp=1 nnodes=2)");
  ExpectError(PlanError({.tp = 2, .pp = 3, .nnodes = 2}),
              "pp size is not divisible across nodes (tp=2 pp=3 nnodes=2)");
  ExpectError(PlanError({.tp = 2, .pp = 2, .nnodes = 3}), "nnodes is not a multiple of pp size");
  ExpectError(PlanError({.tp = 2, .nnodes = 2, .node_rank = 2}),
              "node_rank 2 is out of range: nnodes is 2");
  ExpectError(PlanError({.tp = 2, .nnodes = 2, .node_rank = -1}), "node_rank -1");
  ExpectError(PlanError({.tp = 0}), "parallel sizes must be >= 1");
  ExpectError(PlanError({.tp = 4, .ep = 3}), "ep size 3 does not divide tp size 4");
  ExpectError(PlanError({.tp = 2, .step = 0}), "GPU id step must be >= 1, got 0");
  ExpectError(PlanError({.tp = 2, .base = -1}), "base GPU id must be >= 0, got -1");
  ExpectError(PlanError({.tp = 8, .pp = 2}),
              "GPU id 8 (tp_rank 0, pp_rank 1) is beyond the visible devices: 8 visible");
  ExpectError(PlanError({.tp = 4, .base = 6}),
              "GPU id 8 (tp_rank 2, pp_rank 0) is beyond the visible devices: 8 visible");
  // Nothing visible at all (CUDA_VISIBLE_DEVICES="").
  ExpectError(PlanError({}, 0),
              "GPU id 0 (tp_rank 0, pp_rank 0) is beyond the visible devices: 0 visible");
  // A visible list that names one GPU twice.
  LaunchTopology dup;
  dup.tp_size = 2;
  dup.visible_device_uuids = {Uuids(1)[0], Uuids(1)[0]};
  ExpectError(PlanLaunch(dup).status(), "would serve two ranks of this job");
}

}  // namespace
}  // namespace weightcache::launcher
