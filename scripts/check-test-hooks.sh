#!/usr/bin/env bash
# Issue 39 §13: the test hooks (WEIGHTCACHE_TEST_* environment variables) are a test seam, read
# in one place and compiled out of release builds (src/common/test_hooks.h). This checks, with
# grep only:
#  1. no source of src/, tools/ or python/ names a hook in a string literal or reads one from
#     the environment, except src/common/test_hooks.cc: production code asks TestHookValue();
#  2. the release builds turn them off: pyproject.toml (the wheel, which the container image
#     installs) sets WEIGHTCACHE_TEST_HOOKS = "OFF", and CMake's default follows
#     WEIGHTCACHE_BUILD_TESTS (ON for the test builds, OFF for a build without tests).
# tests/unit/common/test_hooks_test.cc proves that a build with the hooks off ignores them.
# Exit 1 naming every offence. Run by ctest (static_test_hooks) and .ci/run.
set -euo pipefail
cd "$(dirname "$0")/.."
fail=0
offend() {
  echo "check-test-hooks: $*" >&2
  fail=1
}

# 1. One reader. A quoted name, or an environment read of one (getenv, os.environ), outside it.
pattern='"WEIGHTCACHE_TEST_|getenv\([^)]*WEIGHTCACHE_TEST_|environ[^\n]*WEIGHTCACHE_TEST_'
while IFS= read -r hit; do
  [[ -z $hit ]] && continue
  case $hit in src/common/test_hooks.cc:*) continue ;; esac
  offend "$hit: a test hook read outside src/common/test_hooks.cc (use TestHookValue)"
done < <(grep -rnE --include='*.cc' --include='*.h' --include='*.c' --include='*.py' \
           "$pattern" src tools python || true)

# 2. Off in release builds.
grep -qE '^WEIGHTCACHE_TEST_HOOKS = "OFF"' pyproject.toml ||
  offend 'pyproject.toml: [tool.scikit-build.cmake.define] must set WEIGHTCACHE_TEST_HOOKS = "OFF"'
grep -qE 'option\(WEIGHTCACHE_TEST_HOOKS .*\$\{WEIGHTCACHE_BUILD_TESTS\}\)' CMakeLists.txt ||
  offend 'CMakeLists.txt: option(WEIGHTCACHE_TEST_HOOKS ... ${WEIGHTCACHE_BUILD_TESTS}) missing'

if ((fail)); then exit 1; fi
echo "check-test-hooks: ok"
