#!/usr/bin/env bash
# The main job, end to end on any Linux machine (no GPU needed): install what is missing,
# build, write a small real checkpoint with the Python safetensors library, serve it from a
# host-tier daemon, attach to it as an engine would (with content verification), list it,
# and stop it. With a GPU:  TIER=gpu DEVICE=0 scripts/demo.sh
set -euo pipefail
cd "$(dirname "$0")/.."
tier=${TIER:-host}
# Only the CLI (no tests, no benchmarks), in its own build dir; the GPU checksum kernel only
# for the gpu tier (`attach --verify` checks gpu memory with it). scripts/test.sh builds the rest.
# A first run is mostly compiling: a unity Release build (no debug info, each target's files
# compiled 8 at a time) needs about half the CPU time of the default one (docs/building.md).
build=${BUILD_DIR:-build-demo}
kernels=OFF
[[ $tier == gpu ]] && kernels=ON
BUILD_DIR=$build BUILD_TESTS=OFF BUILD_BENCH=OFF BUILD_KERNELS=$kernels TARGETS=weightcache \
  BUILD_TYPE=${BUILD_TYPE:-Release} UNITY=${UNITY:-ON} scripts/build.sh
wc=$build/tools/weightcache
device_flags=()
[[ -n ${DEVICE:-} ]] && device_flags=(--device "$DEVICE")

work=$(mktemp -d)
runtime=$work/run
daemon_pid=
cleanup() {
  [[ -n $daemon_pid ]] && kill "$daemon_pid" 2>/dev/null && wait "$daemon_pid" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT

echo "== 1. a small sharded checkpoint, written by the safetensors library"
python3 tests/tools/make_checkpoint.py --out "$work/tiny-llm" --tensors 48 --shards 2 \
  --dtypes bf16,f32,f16,i8 --min-elems 1000 --max-elems 200000 --seed 7
# sed, not head: it reads to the end, so inspect never dies of SIGPIPE under pipefail.
"$wc" inspect "$work/tiny-llm" | sed -n 1,8p

ident=(--model "$work/tiny-llm" --tier "$tier" "${device_flags[@]}" --runtime-dir "$runtime")
echo "== 2. serve it (daemon in the background; log in $work/serve.log)"
"$wc" serve "${ident[@]}" >"$work/serve.log" 2>&1 &
daemon_pid=$!

# The socket appears as soon as the daemon holds its lock (before it loads); wait for that.
socket=$("$wc" paths "${ident[@]}" --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["socket"])')
for _ in $(seq 100); do
  [[ -S $socket ]] && break
  kill -0 "$daemon_pid" 2>/dev/null || { cat "$work/serve.log"; exit 1; }
  sleep 0.1
done

echo "== 3. attach as an engine would, waiting for ready, verifying every tensor's checksum"
"$wc" attach "${ident[@]}" --wait 60 --on-missing error --verify

echo "== 4. list the caches on this host"
"$wc" ls --runtime-dir "$runtime"

echo "== 5. stop the daemon"
"$wc" stop "${ident[@]}"
wait "$daemon_pid" || true
daemon_pid=
echo "== daemon log"
cat "$work/serve.log"
