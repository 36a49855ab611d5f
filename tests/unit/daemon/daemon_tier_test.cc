// The daemon's tier and its identity's tier must agree: Daemon::Create refuses a mismatch
// before it creates a directory, takes a lock or publishes a socket.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>

#include "daemon/daemon.h"
#include "support/test_env.h"

namespace weightcache::daemon {
namespace {

using ::testing::HasSubstr;
using ::weightcache::testing::TempDir;

DaemonOptions OptionsFor(const std::string& runtime_dir, const std::string& config_tier,
                         protocol::Tier tier) {
  DaemonOptions o;
  o.config.model_id = "tiny";
  o.config.checkpoint_fingerprint = std::string(64, 'a');
  o.config.checkpoint_files = std::string(64, 'b');
  o.config.tier = config_tier;
  identity::PathOptions paths;
  paths.runtime_dir_flag = runtime_dir;
  paths.env = identity::MapEnv({});
  o.paths = identity::ResolveCachePaths(o.config, "host", paths).value();
  o.model_path = "/nonexistent/model";
  o.tier = tier;
  return o;
}

TEST(DaemonTierTest, ConfigTierOtherThanTheLoadedTierIsRefusedBeforeAnythingIsCreated) {
  TempDir dir;
  const std::string runtime = dir.Join("rt");
  auto d = Daemon::Create(OptionsFor(runtime, "gpu", protocol::Tier::kHost));
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(d.status().message(),
              HasSubstr("the config names the gpu tier but the daemon would load the host tier"));
  EXPECT_FALSE(std::filesystem::exists(runtime));

  auto e = Daemon::Create(OptionsFor(runtime, "host", protocol::Tier::kGpu));
  ASSERT_FALSE(e.ok());
  EXPECT_THAT(e.status().message(), HasSubstr("config names the host tier"));
  EXPECT_FALSE(std::filesystem::exists(runtime));
}

TEST(DaemonTierTest, MatchingTierPublishesTheSocket) {
  TempDir dir;
  const DaemonOptions options = OptionsFor(dir.Join("rt"), "host", protocol::Tier::kHost);
  auto d = Daemon::Create(options);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_TRUE(std::filesystem::is_socket(options.paths.socket));
  d->reset();
  EXPECT_FALSE(std::filesystem::exists(options.paths.socket));
}

}  // namespace
}  // namespace weightcache::daemon
