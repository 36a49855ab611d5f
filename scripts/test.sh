#!/usr/bin/env bash
# Build weightcache and run every test tier that needs no GPU (unit, integration, the SDK
# consumers, python).
#   scripts/test.sh                                         # build/ , all CPU tiers
#   BUILD_DIR=build-asan SANITIZE=address,undefined scripts/test.sh
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build.sh
build=${BUILD_DIR:-build}
ctest --test-dir "$build" -LE gpu --output-on-failure -j "${JOBS:-$(nproc)}" --timeout 300
# The SDK (docs/sdk.md): install this build dir into a temporary prefix, build the C
# (pkg-config) and C++ (find_package) consumers against it, run them and the ctypes smoke test
# against a daemon of the installed CLI. Not under sanitizers (the consumers would need them).
if [[ -z ${SANITIZE:-} ]]; then
  BUILD_DIR=$build scripts/sdk-check.sh
fi
# The Python tier: build + install the package (its own build dir, build-python/), then pytest.
# Once per CI run: the sanitizer pass (SANITIZE set) skips it — the extension is not built
# with sanitizers.
if [[ -z ${SANITIZE:-} ]]; then
  if ! python3 -m pip install --disable-pip-version-check --no-build-isolation . \
      >"$build/pip-install.log" 2>&1; then
    tail -n 40 "$build/pip-install.log"
    echo "test.sh: pip install . failed (log: $build/pip-install.log)" >&2
    exit 1
  fi
  python3 -m pytest -q -rs tests/python
fi
