// Demotion to host RAM and promotion back on a real GPU (`serve --demote host`,
// docs/budget.md): two gpu-tier caches under a gpu budget that fits one. The second's
// admission demotes the first (its GPU memory freed, state `demoted`, tier host, still
// serving); an attach to the first promotes it back — evicting (demoting) the second to make
// room — and `attach --verify` finds every tensor's checksum intact: the bytes are equal.
// Skips (with the reason) without a GPU.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <nlohmann/json.hpp>
#include <string>

#include "gpu/gpu_e2e_support.h"
#include "support/child_process.h"
#include "support/test_env.h"

namespace weightcache::testing {
namespace {

using ::testing::HasSubstr;

TEST(GpuDemoteTest, DemotedCacheIsPromotedBackByAnAttachWithEveryChecksumIntact) {
  const GpuSetup& gpus = ProbeGpus();
  if (!gpus.skip_reason.empty()) GTEST_SKIP() << gpus.skip_reason;
  TempDir dir;
  auto a_model = MakeModel(dir.Join("a"), 12, 2, 9, 1 << 20);
  ASSERT_TRUE(a_model.ok()) << a_model.status().ToString();
  auto b_model = MakeModel(dir.Join("b"), 12, 2, 10, 1 << 20);
  ASSERT_TRUE(b_model.ok()) << b_model.status().ToString();
  const std::string runtime = dir.Join("run");
  const std::string uuid = gpus.uuids[0];
  // Either fits alone, both do not.
  const std::string budget = std::to_string(a_model->total_bytes + b_model->total_bytes - 1);
  const auto serve = [&](const TestModel& m, const std::string& id) {
    return std::vector<std::string>{"--model",       m.dir,      "--model-id",  id,
                                    "--tier",        "gpu",      "--device",    uuid,
                                    "--runtime-dir", runtime,    "--no-keeper", "--gpu-budget",
                                    budget,          "--demote", "host"};
  };

  auto a = Daemon::Start(serve(*a_model, "demote-a"), {}, dir.Join("a.log"));
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  protocol::StatusReply status;
  auto sa = (*a)->WaitReady(runtime, "default", uuid, &status);
  ASSERT_TRUE(sa.ok()) << sa.status().ToString();

  auto b = Daemon::Start(serve(*b_model, "demote-b"), {}, dir.Join("b.log"));
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  auto sb = (*b)->WaitReady(runtime, "default", uuid, &status);
  ASSERT_TRUE(sb.ok()) << sb.status().ToString() << (*a)->Log();

  // a gave its GPU memory back by demotion: it still serves, from host RAM.
  auto demoted = StatusOf(*sa);
  ASSERT_TRUE(demoted.ok()) << demoted.status().ToString() << (*a)->Log();
  EXPECT_EQ(demoted->state, protocol::CacheState::kDemoted) << (*a)->Log();
  EXPECT_EQ(demoted->tier, Tier::kHost);
  EXPECT_THAT((*a)->Log(), HasSubstr("demoted to host RAM in"));

  const CommandResult attach =
      RunCommand({CliPath(), "attach", "--model", a_model->dir, "--model-id", "demote-a", "--tier",
                  "gpu", "--device", uuid, "--runtime-dir", runtime, "--on-missing", "error",
                  "--wait", "120", "--verify", "--json"});
  ASSERT_EQ(attach.exit_code, 0) << attach.out << attach.err << (*a)->Log();
  const auto attached = nlohmann::json::parse(attach.out);
  EXPECT_EQ(attached["source"], "daemon") << attach.out;
  EXPECT_THAT(attached["reason"].get<std::string>(), HasSubstr("promoted from host RAM in"));
  EXPECT_THAT((*a)->Log(), HasSubstr("promoted back to the GPU in"));

  auto promoted = StatusOf(*sa);
  ASSERT_TRUE(promoted.ok()) << promoted.status().ToString();
  EXPECT_EQ(promoted->state, protocol::CacheState::kReady);
  EXPECT_EQ(promoted->tier, Tier::kGpu);
  // a's readmission made room by demoting b, the idle one.
  auto b_now = StatusOf(*sb);
  ASSERT_TRUE(b_now.ok()) << b_now.status().ToString() << (*b)->Log();
  EXPECT_EQ(b_now->state, protocol::CacheState::kDemoted) << (*b)->Log();

  for (auto* d : {b->get(), a->get()}) {
    auto code = d->Terminate();
    ASSERT_TRUE(code.ok()) << code.status().ToString();
    EXPECT_EQ(*code, 0) << d->Log();
  }
}

}  // namespace
}  // namespace weightcache::testing
