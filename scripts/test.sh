#!/usr/bin/env bash
# Build weightcache and run every test tier that needs no GPU (unit, integration, python).
#   scripts/test.sh                                         # build/ , all CPU tiers
#   BUILD_DIR=build-asan SANITIZE=address,undefined scripts/test.sh
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build.sh
build=${BUILD_DIR:-build}
ctest --test-dir "$build" -LE gpu --output-on-failure -j "${JOBS:-$(nproc)}" --timeout 300
