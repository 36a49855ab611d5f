#!/usr/bin/env bash
# Build every libFuzzer target of tests/fuzz (<name>_fuzzer.cc) with clang, ASan and UBSan,
# and run each for FUZZ_SECONDS (default 30) on a scratch copy of its seed corpus
# (tests/fuzz/corpus/<name>/, plus tests/fuzz/<name>.dict when present). Exits non-zero on
# the first crash, leak or sanitizer report; the reproducer is left in $BUILD_DIR/artifacts.
#   scripts/fuzz.sh                      # all targets, 30 s each
#   FUZZ_SECONDS=600 scripts/fuzz.sh header_fuzzer
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PATH:/usr/local/cuda/bin"
build=${BUILD_DIR:-build-fuzz}
seconds=${FUZZ_SECONDS:-30}
jobs=${JOBS:-2}

if (($#)); then
  targets=("$@")
else
  targets=()
  for src in tests/fuzz/*_fuzzer.cc; do
    [[ -e "$src" ]] && targets+=("$(basename "$src" .cc)")
  done
fi
((${#targets[@]})) || { echo "fuzz: no *_fuzzer.cc in tests/fuzz" >&2; exit 1; }

# The libraries get the sanitizers and libFuzzer's coverage instrumentation too
# (fuzzer-no-link), or the fuzzer would be blind inside the code under test. Only the fuzz
# targets (and what they link) are built, so nothing else in the tree needs clang.
CC=clang CXX=clang++ cmake -S . -B "$build" -G Ninja \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DWEIGHTCACHE_FUZZ=ON \
  -DWEIGHTCACHE_SANITIZE=address,undefined \
  -DCMAKE_C_FLAGS=-fsanitize=fuzzer-no-link -DCMAKE_CXX_FLAGS=-fsanitize=fuzzer-no-link \
  -DWEIGHTCACHE_BUILD_KERNELS=OFF -DWEIGHTCACHE_BUILD_BENCH=OFF >/dev/null
cmake --build "$build" -j "$jobs" --target "${targets[@]}"

mkdir -p "$build/artifacts"
for t in "${targets[@]}"; do
  corpus="$build/corpus/$t"
  mkdir -p "$corpus"
  if [[ -d "tests/fuzz/corpus/$t" ]]; then cp -n "tests/fuzz/corpus/$t"/* "$corpus"/ 2>/dev/null || true; fi
  args=(-max_total_time="$seconds" -print_final_stats=1 -artifact_prefix="$build/artifacts/$t-")
  [[ -f "tests/fuzz/$t.dict" ]] && args+=(-dict="tests/fuzz/$t.dict")
  echo "fuzz: $t for ${seconds}s"
  bin=$(find "$build" -type f -name "$t" -perm -u+x | head -n1)
  [[ -n "$bin" ]] || { echo "fuzz: built binary $t not found under $build" >&2; exit 1; }
  if ! "$bin" "${args[@]}" "$corpus"; then
    echo "fuzz: $t FAILED; reproducer(s) in $build/artifacts/" >&2
    exit 1
  fi
done
echo "fuzz: ${#targets[@]} target(s) ran ${seconds}s each without a finding"
