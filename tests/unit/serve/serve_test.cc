// serve::Prepare (src/serve/serve.h): every refusal that needs no lock comes from it, with its
// flag named, before anything starts; a plan it accepts holds the resolved identity and has
// taken no lock and made no socket. And the fleet's options (serve/registration.h), whose rules
// Prepare applies: refused by name in a build with the fleet, refused as "not built" without.
#include "serve/serve.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include "os/lock_file.h"
#include "serve/registration.h"
#include "support/test_env.h"

namespace weightcache::serve {
namespace {

using ::testing::HasSubstr;

class PrepareTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto made = weightcache::testing::WriteCheckpoint(tmp_.Join("model"), {"--tensors", "3"});
    if (made.exit_code == 77) GTEST_SKIP() << made.err;
    ASSERT_EQ(made.exit_code, 0) << made.err;
    options_.identity.model_dir = tmp_.Join("model");
    options_.identity.model_id = "tiny";
    options_.identity.tier = Tier::kHost;
    options_.identity.runtime_dir = tmp_.Join("run");
  }

  static void ExpectRefused(const ServeOptions& options, StatusCode code,
                            const std::string& message) {
    Result<Plan> plan = Prepare(options);
    ASSERT_FALSE(plan.ok()) << "expected: " << message;
    EXPECT_EQ(plan.status().code(), code) << plan.status().ToString();
    EXPECT_THAT(plan.status().message(), HasSubstr(message));
  }

  weightcache::testing::TempDir tmp_;
  ServeOptions options_;
};

TEST_F(PrepareTest, AcceptsAHostCacheAndTakesNoLockAndMakesNoSocket) {
  Result<Plan> plan = Prepare(options_);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  const identity::ResolvedIdentity& id = plan->identity();
  EXPECT_EQ(id.config.model_id, "tiny");
  EXPECT_EQ(id.config.tier, Tier::kHost);
  EXPECT_EQ(id.paths.runtime_dir, tmp_.Join("run"));
  EXPECT_FALSE(std::filesystem::exists(id.paths.socket)) << id.paths.socket;
  EXPECT_FALSE(os::IsLockHeld(id.paths.lock)) << id.paths.lock;
}

TEST_F(PrepareTest, AGpuTierNeedsItsDeviceNamed) {
  options_.identity.tier = Tier::kGpu;
  ExpectRefused(options_, StatusCode::kInvalidArgument, "--tier gpu needs --device N|UUID");
}

TEST_F(PrepareTest, ABadSeedSourceIsRefusedByName) {
  options_.seed_from = "peer.sock";
  ExpectRefused(options_, StatusCode::kInvalidArgument,
                "--seed-from: \"peer.sock\" is neither \"auto\" nor an absolute socket path");
}

TEST_F(PrepareTest, ReplaceIsOnlyForAPublishedSource) {
  options_.replace = true;
  ExpectRefused(options_, StatusCode::kInvalidArgument, "--replace needs --source published:<tag>");
}

TEST_F(PrepareTest, AMissingCheckpointIsTheIdentitysError) {
  options_.identity.model_dir = tmp_.Join("absent");
  Result<Plan> plan = Prepare(options_);
  ASSERT_FALSE(plan.ok());
  EXPECT_THAT(plan.status().message(), HasSubstr(tmp_.Join("absent")));
}

// The fleet's rules, as Prepare applies them (Registration::Create) and launch before it starts
// any daemon (CheckFleetOptions): by name with the fleet, "not built" without.
TEST_F(PrepareTest, FleetOptionsAreRefusedByTheirRulesOrAsNotBuilt) {
  options_.fleet.fill_serve = "127.0.0.1:0";
  if (FleetBuilt()) {
    ExpectRefused(options_, StatusCode::kInvalidArgument,
                  "--fill-serve needs --fill-allow (the peers that may fill from it)");
  } else {
    ExpectRefused(options_, StatusCode::kUnavailable,
                  "--fill-serve 127.0.0.1:0: this build has no fleet support (it needs libcurl "
                  "and UCX");
  }
  EXPECT_EQ(CheckFleetOptions(options_.fleet).code(),
            FleetBuilt() ? StatusCode::kInvalidArgument : StatusCode::kUnavailable);
  EXPECT_TRUE(CheckFleetOptions(FleetOptions()).ok()) << "no fleet option is no refusal";
}

}  // namespace
}  // namespace weightcache::serve
