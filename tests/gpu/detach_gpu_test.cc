// `weightcache serve --tier gpu --detach` on a real GPU (docs/daemon.md "Detached"): it exits
// 0 only once its daemon has loaded the checkpoint into VMM memory and answers `ready`; a
// client process then attaches on the gpu tier and verifies every tensor; `stop` ends the
// daemon; the test process is left with no child. Skips (with the reason) without a GPU.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <nlohmann/json.hpp>
#include <string>

#include "gpu/gpu_e2e_support.h"
#include "support/child_process.h"
#include "support/test_env.h"

namespace weightcache::testing {
namespace {

using ::testing::HasSubstr;

TEST(GpuDetachTest, DetachReturnsOnceTheGpuCacheIsReadyAndAClientVerifiesIt) {
  const GpuSetup& gpus = ProbeGpus();
  if (!gpus.skip_reason.empty()) GTEST_SKIP() << gpus.skip_reason;
  TempDir dir;
  auto model = MakeModel(dir.Join("model"), 12, 2, 9, 1 << 18);
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  const std::string runtime = dir.Join("run");
  const std::string uuid = gpus.uuids[0];

  const CommandResult r = RunCommand(
      {CliPath(), "serve", "--model", model->dir, "--model-id", "detach-gpu", "--tier", "gpu",
       "--device", uuid, "--runtime-dir", runtime, "--no-keeper", "--detach", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const auto out = nlohmann::json::parse(r.out);
  const std::string socket = out["daemons"][0]["socket"];
  EXPECT_THAT(socket, HasSubstr(uuid));
  // Ready means loaded: the detached daemon already serves the whole cache.
  auto status = QueryStatus(socket);
  ASSERT_TRUE(status.ok()) << status.status().ToString();
  EXPECT_EQ(status->state, protocol::CacheState::kReady);
  EXPECT_EQ(status->bytes_done, status->bytes_total);

  const CommandResult attach = RunCommand(
      {CliPath(), "attach", "--model", model->dir, "--model-id", "detach-gpu", "--tier", "gpu",
       "--device", uuid, "--runtime-dir", runtime, "--on-missing", "error", "--verify", "--json"});
  EXPECT_EQ(attach.exit_code, 0) << attach.out << attach.err;
  const auto attached = nlohmann::json::parse(attach.out);
  EXPECT_EQ(attached["source"], "daemon") << attach.out;

  const CommandResult stop = RunCommand({CliPath(), "stop", "--socket", socket, "--timeout", "60"});
  EXPECT_EQ(stop.exit_code, 0) << stop.err;
  siginfo_t info{};
  EXPECT_NE(::waitid(P_ALL, 0, &info, WEXITED | WNOHANG | WNOWAIT), 0);  // no child left
}

}  // namespace
}  // namespace weightcache::testing
