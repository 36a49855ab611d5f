// The daemon's tier is its config's (DaemonOptions has no second tier field to disagree with
// it): a host-tier config creates a daemon that publishes its socket at once.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>

#include "daemon/daemon.h"
#include "support/test_env.h"

namespace weightcache::daemon {
namespace {

using ::weightcache::testing::TempDir;

DaemonOptions OptionsFor(const std::string& runtime_dir, Tier tier) {
  DaemonOptions o;
  o.config.model_id = "tiny";
  o.config.checkpoint_fingerprint = std::string(64, 'a');
  o.config.checkpoint_files = std::string(64, 'b');
  o.config.tier = tier;
  identity::PathOptions paths;
  paths.runtime_dir_flag = runtime_dir;
  paths.env = identity::MapEnv({});
  o.paths = identity::ResolveCachePaths(o.config, "host", paths).value();
  o.model_path = "/nonexistent/model";
  return o;
}

TEST(DaemonTierTest, HostConfigPublishesTheSocket) {
  TempDir dir;
  const DaemonOptions options = OptionsFor(dir.Join("rt"), Tier::kHost);
  auto d = Daemon::Create(options);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_TRUE(std::filesystem::is_socket(options.paths.socket));
  d->reset();
  EXPECT_FALSE(std::filesystem::exists(options.paths.socket));
}

}  // namespace
}  // namespace weightcache::daemon
