// The test hooks (common/test_hooks.h, issue 39 §13), built twice: into common_test, with the
// hooks as this build configures them (WEIGHTCACHE_TEST_HOOKS, ON in the test builds), and into
// common_test_hooks_off_test, compiled from the same test_hooks.cc with the hooks off as a
// release build compiles it. WEIGHTCACHE_EXPECT_TEST_HOOKS says which of the two this is. With
// the hooks off, a variable that is set is still "not set": a release build ignores them.
#include "common/test_hooks.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <optional>
#include <string>

namespace weightcache {
namespace {

constexpr TestHook kEveryHook[] = {TestHook::kLoadedFifo, TestHook::kSeedPauseFifo,
                                   TestHook::kFillPoison, TestHook::kFillStripeBytes,
                                   TestHook::kFillPauseFifo};

class TestHooksTest : public ::testing::Test {
 protected:
  void TearDown() override {
    for (TestHook hook : kEveryHook) ::unsetenv(std::string(TestHookName(hook)).c_str());
  }
  static void Set(TestHook hook, const char* value) {
    ASSERT_EQ(::setenv(std::string(TestHookName(hook)).c_str(), value, 1), 0);
  }
};

TEST_F(TestHooksTest, TheBuildHasTheHooksItWasConfiguredWith) {
  EXPECT_EQ(TestHooksBuilt(), WEIGHTCACHE_EXPECT_TEST_HOOKS != 0);
}

TEST_F(TestHooksTest, EveryHookHasItsVariable) {
  EXPECT_EQ(TestHookName(TestHook::kLoadedFifo), "WEIGHTCACHE_TEST_LOADED_FIFO");
  EXPECT_EQ(TestHookName(TestHook::kSeedPauseFifo), "WEIGHTCACHE_TEST_SEED_PAUSE_FIFO");
  EXPECT_EQ(TestHookName(TestHook::kFillPoison), "WEIGHTCACHE_TEST_FILL_POISON");
  EXPECT_EQ(TestHookName(TestHook::kFillStripeBytes), "WEIGHTCACHE_TEST_FILL_STRIPE_BYTES");
  EXPECT_EQ(TestHookName(TestHook::kFillPauseFifo), "WEIGHTCACHE_TEST_FILL_PAUSE_FIFO");
}

TEST_F(TestHooksTest, ASetHookIsHonouredOnlyWhereTheHooksAreBuilt) {
  for (TestHook hook : kEveryHook) {
    SCOPED_TRACE(std::string(TestHookName(hook)));
    EXPECT_EQ(TestHookValue(hook), std::nullopt);  // unset
    Set(hook, "");
    EXPECT_EQ(TestHookValue(hook), std::nullopt);  // empty is unset
    Set(hook, "/tmp/some.fifo");
    if (WEIGHTCACHE_EXPECT_TEST_HOOKS != 0) {
      EXPECT_EQ(TestHookValue(hook), "/tmp/some.fifo");
    } else {
      EXPECT_EQ(TestHookValue(hook), std::nullopt);  // a release build ignores it
    }
  }
}

}  // namespace
}  // namespace weightcache
