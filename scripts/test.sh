#!/usr/bin/env bash
# Build weightcache and run every test tier that needs no GPU (unit, integration, python).
#   scripts/test.sh                 # Release-ish build in build/
#   BUILD_DIR=build-asan SANITIZE=address,undefined scripts/test.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PATH:/usr/local/cuda/bin"
scripts/setup-deps.sh
build=${BUILD_DIR:-build}
jobs=${JOBS:-$(nproc)}
cmake -S . -B "$build" -G Ninja -DWEIGHTCACHE_SANITIZE="${SANITIZE:-}" \
      -DWEIGHTCACHE_BUILD_KERNELS="${BUILD_KERNELS:-ON}" >/dev/null
cmake --build "$build" -j "$jobs"
ctest --test-dir "$build" -LE gpu --output-on-failure -j "$jobs" --timeout 300
