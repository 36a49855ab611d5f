// Test hooks: the environment variables (WEIGHTCACHE_TEST_*) through which the integration
// tests make a real `weightcache` process pause or misbehave at one point (a loader held on a
// FIFO, a fill source that serves a flipped byte). They are a test seam, not a feature.
//
// Contract:
//  * This is the only place that reads them: production code asks TestHookValue(hook), never
//    getenv, and names a hook only through TestHookName (scripts/check-test-hooks.sh).
//  * They exist only in builds configured with WEIGHTCACHE_TEST_HOOKS=ON (the test builds of
//    scripts/build.sh and CI, the default when the tests are built). A release build
//    (WEIGHTCACHE_TEST_HOOKS=OFF: the Python wheel, the container image, any build without
//    tests) compiles them out: TestHookValue is always "not set" and no variable is read.
//  * Thread-safety: as getenv (safe while nothing calls setenv concurrently).
#pragma once

#include <optional>
#include <string>
#include <string_view>

namespace weightcache {

enum class TestHook {
  // A FIFO the daemon's loader opens and reads to EOF once every byte is read, before it
  // re-checks the files (src/daemon/daemon_loader.cc).
  kLoadedFifo,
  // A FIFO `serve --seed-from` opens and reads to EOF once it holds the peer's fds, before it
  // copies (src/serve/seed_fill.cc).
  kSeedPauseFifo,
  // "1" on a fill source: allocation 0 is served with its first byte flipped, from a copy
  // (src/serve/registration.cc).
  kFillPoison,
  // N on a filler: stripes of N bytes, one read in flight (src/serve/registration.cc).
  kFillStripeBytes,
  // A FIFO a filler opens and reads to EOF after its first stripe (src/serve/registration.cc).
  kFillPauseFifo,
};

// The variable of `hook` (WEIGHTCACHE_TEST_LOADED_FIFO, …), also for the log lines that say
// which hook acted.
std::string_view TestHookName(TestHook hook);

// Whether this build honours the hooks (WEIGHTCACHE_TEST_HOOKS).
bool TestHooksBuilt();

// The hook's value: std::nullopt when it is unset or empty, and always in a build without the
// hooks, which then reads no environment variable at all.
std::optional<std::string> TestHookValue(TestHook hook);

}  // namespace weightcache
