#!/usr/bin/env bash
# The host-only build (docs/building.md): the CLI configured and built with the CUDA toolkit
# hidden (WEIGHTCACHE_GPU=OFF, find_package(CUDAToolkit) disabled), then used: it serves a
# host-tier checkpoint written by the safetensors library, attaches with --verify and stops it,
# and the gpu tier answers the clear "gpu tier not built" error with the exit code of
# kUnavailable. Without the fleet too (WEIGHTCACHE_FLEET=OFF: a machine without libcurl and UCX,
# such as the GPU machine), `serve --registry` is refused naming what the build lacked.
# Builds only the CLI target, in ${BUILD_DIR:-build-hostonly}, as the demo does
# (a unity Release build, docs/building.md): so CI also fails on two file-local helpers of one
# library with the same name, which only a unity build notices. .ci/run runs it.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${BUILD_DIR:-build-hostonly}
mkdir -p "$build"
launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
cmake -S . -B "$build" -G Ninja -DWEIGHTCACHE_GPU=OFF -DCMAKE_DISABLE_FIND_PACKAGE_CUDAToolkit=ON \
      -DWEIGHTCACHE_FLEET=OFF \
      -DWEIGHTCACHE_BUILD_TESTS=OFF -DWEIGHTCACHE_BUILD_BENCH=OFF -DWEIGHTCACHE_BUILD_KERNELS=OFF \
      -DCMAKE_BUILD_TYPE=Release -DCMAKE_UNITY_BUILD=ON -DCMAKE_UNITY_BUILD_BATCH_SIZE=8 \
      "${launcher[@]}" >"$build/configure.log" 2>&1 ||
  { cat "$build/configure.log"; exit 1; }
fail() { echo "host-only: FAIL: $*" >&2; exit 1; }
# The configure output names what the gpu tier needs.
grep -qF "CUDA toolkit headers (cuda.h" <<<"$(grep -F "gpu tier OFF" "$build/configure.log")" ||
  { cat "$build/configure.log"; fail "configure did not say what the gpu tier needs"; }
cmake --build "$build" -j "${JOBS:-$(nproc)}" --target weightcache
# Nothing was compiled against the toolkit: no compile command names a CUDA include dir.
if grep -E -- '-I[^ ]*cuda[^ ]*/include|isystem [^ ]*cuda[^ ]*/include' \
     "$build/compile_commands.json" | grep -v no_toolkit >/dev/null; then
  fail "a compile command includes the CUDA toolkit"
fi
wc=$build/tools/weightcache

work=$(mktemp -d /tmp/wc-hostonly.XXXXXX)
daemon_pid=
cleanup() {
  if [[ -n $daemon_pid ]]; then kill "$daemon_pid" 2>/dev/null || true; wait "$daemon_pid" || true; fi
  rm -rf "$work"
}
trap cleanup EXIT
python3 tests/tools/make_checkpoint.py --out "$work/model" --tensors 16 --shards 2 \
  --dtypes bf16,f32,i8 --seed 3 >/dev/null
ident=(--model "$work/model" --runtime-dir "$work/run")

"$wc" serve "${ident[@]}" --tier host >"$work/serve.log" 2>&1 &
daemon_pid=$!
socket=$("$wc" paths "${ident[@]}" --tier host --json |
         python3 -c 'import json,sys; print(json.load(sys.stdin)["socket"])')
for _ in $(seq 600); do
  [[ -S $socket ]] && break
  kill -0 "$daemon_pid" 2>/dev/null || { cat "$work/serve.log"; fail "serve --tier host exited"; }
  sleep 0.1
done
"$wc" attach "${ident[@]}" --tier host --wait 60 --on-missing error --verify ||
  { cat "$work/serve.log"; fail "attach --verify on the host tier"; }
"$wc" stop "${ident[@]}" --tier host || fail "stop"
wait "$daemon_pid" || { cat "$work/serve.log"; fail "serve --tier host did not exit 0"; }
daemon_pid=

# The gpu tier: the daemon refuses to start, naming what the build lacked (kUnavailable: exit 1).
rc=0
"$wc" serve "${ident[@]}" --tier gpu --device 0 >"$work/gpu.log" 2>&1 || rc=$?
cat "$work/gpu.log"
[[ $rc == 1 ]] || fail "serve --tier gpu exited $rc, expected 1"
grep -qF "gpu tier not built: this build had no CUDA toolkit headers (cuda.h)" "$work/gpu.log" ||
  fail "serve --tier gpu did not name the missing gpu tier"

# The fleet: `serve --registry` is refused before anything starts, naming what the build lacked.
rc=0
"$wc" serve "${ident[@]}" --tier host --registry etcd://127.0.0.1:2379 >"$work/fleet.log" 2>&1 ||
  rc=$?
cat "$work/fleet.log"
[[ $rc == 1 ]] || fail "serve --registry exited $rc, expected 1"
grep -qF "this build has no fleet support (it needs libcurl and UCX" "$work/fleet.log" ||
  fail "serve --registry did not name the missing fleet support"
rc=0
"$wc" serve "${ident[@]}" --tier host --fill-from registry >"$work/fill.log" 2>&1 || rc=$?
cat "$work/fill.log"
[[ $rc == 1 ]] || fail "serve --fill-from exited $rc, expected 1"
grep -qF "fill-from registry: this build has no fleet support" "$work/fill.log" ||
  fail "serve --fill-from did not name the missing fleet support"
rc=0
"$wc" launch "${ident[@]}" --tier host --registry etcd://127.0.0.1:2379 >"$work/launch.log" 2>&1 ||
  rc=$?
cat "$work/launch.log"
[[ $rc == 1 ]] || fail "launch --registry exited $rc, expected 1"
grep -qF "registry etcd://127.0.0.1:2379: this build has no fleet support" "$work/launch.log" ||
  fail "launch --registry did not name the missing fleet support"
echo "host-only: OK (host tier served, attached with --verify and stopped; gpu tier and" \
     "fleet refused)"
