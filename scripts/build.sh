#!/usr/bin/env bash
# Configure and build weightcache into ${BUILD_DIR:-build}. Installs missing deps first.
#   SANITIZE=address,undefined  BUILD_KERNELS=OFF  BUILD_BENCH=OFF  BUILD_TESTS=OFF
#   BUILD_GPU_TESTS=OFF (no tests/gpu)  JOBS=N
#   BUILD_TYPE=Release (default RelWithDebInfo)  UNITY=ON (CMake's unity build: each target's
#   sources compiled in batches of 8, so nlohmann/json and CLI11 are parsed and instantiated
#   once per batch instead of once per file)
#   TARGETS="weightcache ..." (default: everything)  are honoured.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PATH:/usr/local/cuda/bin"
scripts/setup-deps.sh
build=${BUILD_DIR:-build}
cmake -S . -B "$build" -G Ninja -DWEIGHTCACHE_SANITIZE="${SANITIZE:-}" \
      -DCMAKE_BUILD_TYPE="${BUILD_TYPE:-RelWithDebInfo}" \
      -DCMAKE_UNITY_BUILD="${UNITY:-OFF}" -DCMAKE_UNITY_BUILD_BATCH_SIZE=8 \
      -DWEIGHTCACHE_BUILD_KERNELS="${BUILD_KERNELS:-ON}" \
      -DWEIGHTCACHE_BUILD_BENCH="${BUILD_BENCH:-ON}" \
      -DWEIGHTCACHE_BUILD_TESTS="${BUILD_TESTS:-ON}" \
      -DWEIGHTCACHE_BUILD_GPU_TESTS="${BUILD_GPU_TESTS:-ON}" >/dev/null
targets=()
for t in ${TARGETS:-}; do targets+=(--target "$t"); done
cmake --build "$build" -j "${JOBS:-$(nproc)}" "${targets[@]}"
