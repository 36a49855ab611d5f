#!/usr/bin/env bash
# The GPU tier in one call, from a BARE device machine (nvcc, cmake, ninja, gcc, python3; no
# Debian -dev packages, no network). Builds weightcache against the header-only / static deps
# carried in .deps/usr (scripts/stage-device-deps.sh), with the CUDA kernels for sm_90, runs
# `ctest -L gpu`, then every unit test, then the benchmarks in bench/.
#
#   scripts/gpu-suite.sh                       # from the repository root; logs under $OUT
#
# Writes (few files, the device tool brings back at most 8):
#   $OUT/build.log     configure + build output
#   $OUT/tests.log     ctest output (gpu tier, then unit tier)
#   $OUT/bench.jsonl   one JSON line per benchmark measurement
#   $OUT/summary.txt   GPUs, driver, pass/fail counts, skipped gpu tests, bench errors
# Knobs: OUT (default ./gpu-out), BUILD_DIR (build-gpu), DEPS (.deps/usr), JOBS (nproc),
#        TARGETS (build only these, for a dry run), SKIP_BENCH=1.
# Exit status: non-zero if the build or any test fails. Budget: well under 8 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
OUT=${OUT:-$root/gpu-out}
build=${BUILD_DIR:-build-gpu}
deps=${DEPS:-$root/.deps/usr}
jobs=${JOBS:-$(nproc)}
mkdir -p "$OUT"
summary=$OUT/summary.txt
: >"$summary"
start=$(date +%s)
export PATH="$PATH:/usr/local/cuda/bin"
say() { echo "$*" | tee -a "$summary"; }

say "== weightcache gpu suite, $(date -u +%FT%TZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
if command -v nvidia-smi >/dev/null; then
  nvidia-smi -L 2>&1 | tee -a "$summary"
  say "driver version: $(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>&1 | head -1)"
else
  say "nvidia-smi: not found (gpu tests will skip)"
fi
say "nvcc: $(nvcc --version 2>/dev/null | grep -o 'release [0-9.]*' || echo 'not found')"
say "CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-<unset>}"

# ---- configure + build -----------------------------------------------------------------------
if [[ ! -d $deps/include ]]; then
  say "FAIL: $deps is missing: run scripts/stage-device-deps.sh here and carry .deps"
  exit 1
fi
arch=x86_64-linux-gnu
build_ok=1
{
  # Debian multiarch: OpenSSL's configuration.h lives under include/<arch>; the CMake package
  # files of GTest under lib/<arch>/cmake. Everything is named explicitly so the result does
  # not depend on whether this host's CMake knows the multiarch layout.
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_PREFIX_PATH="$deps" \
    -DCMAKE_CXX_FLAGS="-isystem $deps/include/$arch" \
    -DOPENSSL_ROOT_DIR="$deps" -DOPENSSL_USE_STATIC_LIBS=ON \
    -DOPENSSL_INCLUDE_DIR="$deps/include" \
    -DOPENSSL_CRYPTO_LIBRARY="$deps/lib/$arch/libcrypto.a" \
    -DOPENSSL_SSL_LIBRARY="$deps/lib/$arch/libssl.a" \
    -DGTest_DIR="$deps/lib/$arch/cmake/GTest" \
    -Dnlohmann_json_DIR="$deps/share/cmake/nlohmann_json" \
    -DCLI11_DIR="$deps/share/cmake/CLI11" \
    -DXXHASH_INCLUDE_DIR="$deps/include" \
    -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DWEIGHTCACHE_BUILD_KERNELS=ON -DWEIGHTCACHE_BUILD_TESTS=ON -DWEIGHTCACHE_BUILD_BENCH=ON &&
    if [[ -n ${TARGETS:-} ]]; then
      # shellcheck disable=SC2086
      cmake --build "$build" -j "$jobs" --target $TARGETS
    else
      cmake --build "$build" -j "$jobs"
    fi
} >"$OUT/build.log" 2>&1 || build_ok=0
if ((build_ok)); then
  say "build: ok ($(($(date +%s) - start)) s)"
else
  say "build: FAILED — last lines of build.log:"
  grep -E "error|Error|FAILED" "$OUT/build.log" | head -20 | tee -a "$summary"
  tail -n 15 "$OUT/build.log" | tee -a "$summary"
  exit 1
fi

# ---- tests -----------------------------------------------------------------------------------
tests_ok=1
run_ctest() {  # label [extra ctest args]
  local label=$1 log
  shift
  log=$(mktemp)
  echo "==== ctest -L $label $*" >>"$OUT/tests.log"
  ctest --test-dir "$build" -L "$label" --output-on-failure --timeout 300 -j "$jobs" "$@" \
    >"$log" 2>&1
  local rc=$?
  cat "$log" >>"$OUT/tests.log"
  local line
  line=$(grep -E "tests passed|No tests were found" "$log" | tail -1)
  say "tests [$label]: ${line:-no result line (rc $rc)}"
  if grep -q "The following tests did not run" "$log"; then
    local skipped
    skipped=$(sed -n '/The following tests did not run/,/^$/p' "$log" | grep -c "Skipped")
    say "  skipped [$label]: $skipped (see tests.log for the reasons)"
  fi
  if ((rc != 0)); then
    tests_ok=0
    grep -E "\(Failed\)|\(Timeout\)|\(SEGFAULT\)|\(Subprocess aborted\)|\(Not Run\)" "$log" |
      sed 's/^/  FAILED /' | tee -a "$summary"
  fi
  rm -f "$log"
}
: >"$OUT/tests.log"
# Verbose for the gpu tier (few tests): the log then shows every skip reason and the
# properties the tests record (e.g. what a VMM fd looks like to fstat). Serial: the tests
# share the GPUs and spawn processes of their own.
run_ctest gpu -V -j 1
reason=$(grep -E "^[0-9]+: .*Skipped$" -A1 "$OUT/tests.log" | grep -vE "Skipped$|^--" | head -1)
[[ -n $reason ]] && say "  first gpu skip reason: ${reason#*: }"
run_ctest unit

# ---- benchmarks ------------------------------------------------------------------------------
: >"$OUT/bench.jsonl"
if [[ -z ${SKIP_BENCH:-} ]]; then
  for bench in "$build"/bench/*_bench; do
    [[ -x $bench ]] || continue
    name=$(basename "$bench")
    t0=$(date +%s)
    if timeout 240 "$bench" >>"$OUT/bench.jsonl" 2>>"$OUT/tests.log"; then
      say "bench $name: ok ($(($(date +%s) - t0)) s)"
    else
      say "bench $name: FAILED (rc $?, stderr in tests.log)"
    fi
  done
  if grep -q '"error"' "$OUT/bench.jsonl"; then
    say "bench errors:"
    grep '"error"' "$OUT/bench.jsonl" | head -5 | tee -a "$summary"
  fi
  # The headline numbers, one line per measurement.
  python3 - "$OUT/bench.jsonl" <<'PY' | tee -a "$summary" || true
import json, sys
for line in open(sys.argv[1]):
    try:
        j = json.loads(line)
    except ValueError:
        continue
    keys = [k for k in ("kind", "tensors", "allocations", "import_ms_median", "open_ms",
                        "open_us_per_handle", "cuinit_ms", "primary_ctx_ms", "create_export_ms",
                        "skipped", "error") if k in j]
    print("  " + j.get("bench", "?") + ": " + ", ".join(f"{k}={j[k]}" for k in keys))
PY
fi

elapsed=$(($(date +%s) - start))
if ((tests_ok)); then
  say "== gpu suite: PASS in ${elapsed} s (logs in $OUT)"
  exit 0
fi
say "== gpu suite: FAIL in ${elapsed} s (logs in $OUT)"
exit 1
