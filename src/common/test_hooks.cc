#include "common/test_hooks.h"

#include <cstdlib>

// Set by CMake for this file only (src/common/CMakeLists.txt, option WEIGHTCACHE_TEST_HOOKS):
// 1 in the test builds, 0 in a release build. Missing means a release build.
#ifndef WEIGHTCACHE_TEST_HOOKS
#define WEIGHTCACHE_TEST_HOOKS 0
#endif

namespace weightcache {

std::string_view TestHookName(TestHook hook) {
  switch (hook) {
    case TestHook::kLoadedFifo:
      return "WEIGHTCACHE_TEST_LOADED_FIFO";
    case TestHook::kSeedPauseFifo:
      return "WEIGHTCACHE_TEST_SEED_PAUSE_FIFO";
    case TestHook::kFillPoison:
      return "WEIGHTCACHE_TEST_FILL_POISON";
    case TestHook::kFillStripeBytes:
      return "WEIGHTCACHE_TEST_FILL_STRIPE_BYTES";
    case TestHook::kFillPauseFifo:
      return "WEIGHTCACHE_TEST_FILL_PAUSE_FIFO";
  }
  return "WEIGHTCACHE_TEST_UNKNOWN";
}

bool TestHooksBuilt() { return WEIGHTCACHE_TEST_HOOKS != 0; }

std::optional<std::string> TestHookValue(TestHook hook) {
  if constexpr (WEIGHTCACHE_TEST_HOOKS == 0) {
    (void)hook;
    return std::nullopt;
  } else {
    const char* value = std::getenv(std::string(TestHookName(hook)).c_str());
    if (value == nullptr || *value == '\0') return std::nullopt;
    return std::string(value);
  }
}

}  // namespace weightcache
