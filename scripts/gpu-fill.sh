#!/usr/bin/env bash
# The gpu tier's fleet fill (issue 19) on one GPU, with real daemons and the CLI: two daemons
# with separate runtime dirs on the same device emulate two nodes. Node A serves a 16 GB cache
# (the Llama-3-8B shape that bench/shard_bench writes, with random bytes: every tensor its own,
# so that a copy that missed or misplaced one fails the checks) with `--fill-serve`; node B starts with
# `--fill-from A`, pulls A's device memory over UCX's CUDA support into its own VMM arena,
# checks it (every tensor's checksum by the GPU kernel, each file's SHA-256 against its content
# anchor — the checkpoint is a plain directory, so both daemons get it pinned with
# --fill-content-sha256 from sha256sum — and a sample of its own checkpoint) and is ready
# without reading the checkpoint's tensor data. Measured against the device-to-device copy of the same
# run (torch, 16 GiB) and against B loading the same checkpoint from the page cache.
#
#   1. the D2D limit: torch copies 16 GiB on the device, best of 3;
#   2. A loads and serves (`--fill-serve 127.0.0.1:0 --fill-allow 127.0.0.1`);
#   3. B fills from A, once per UCX transport set in UCX_VARIANTS (default: UCX's own choice,
#      which the fill narrows to "^tcp,cma"; then without cuda_ipc; then tcp+cuda_copy, which
#      the fill refuses since issue 39, so B loads from disk), each followed by
#      `attach --verify` on B and B's stop;
#   3b. B seeded from A's socket instead (`--seed-from`, issue 18's one-GPU form: a D2D copy
#      through the device's own copy engines, checked like a fill), verified;
#   4. B again without --fill-from: the disk (page cache) load of the same run;
#   5. ucx_perftest (the staged UCX's, when present): UCX's own ucp_get rate from CUDA memory
#      (cudaMalloc'ed) between two processes, 64 MiB messages, with cuda_ipc's get zcopy on as
#      the fill turns it on — the transport's ceiling here.
#
# Checks (each FAIL counted; exit 1 if any): A ready and serving; B ready for every variant;
# the first variant filled from A ("filled from 1 source(s)"); every attach verified every
# tensor from B's daemon.
#
#   scripts/gpu-fill.sh        # after scripts/gpu-suite.sh built build-gpu (fleet ON)
#
# Writes $OUT/fill.log (every command and its output, then the daemons' logs); appends its
# headline lines, each starting with "fill:", to $OUT/summary.txt.
# Knobs: OUT (./gpu-out), BUILD_DIR (build-gpu), WORK (the checkpoint's dir; default on
# /dev/shm when it has 20 GB free), UCX_VARIANTS (space-separated UCX_TLS values; "default"
# leaves UCX_TLS unset), UCX_PERFTEST (its path; default under WEIGHTCACHE_UCX_PREFIX, which
# gpu-suite.sh sets),
# DRY_RUN=host (no GPU: the same steps on the host tier over a fake GPU (a device inventory)
# and a small checkpoint, over the host tier's TCP protocol (no UCX: "default tcp" only shows
# that UCX_TLS does not matter to it), without the D2D limit: a
# rehearsal of this script's own logic on a CPU machine, e.g. BUILD_DIR=build).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
# shellcheck source=scripts/gpu-script-common.sh
. scripts/gpu-script-common.sh
gpu_script_init fill fill.log

default_variants="default ^cuda_ipc,tcp,cma tcp,cuda_copy"
if dry_run_tier 1; then
  default_variants="default tcp"
  say "fill: DRY_RUN=host: the host tier over a fake GPU, a small checkpoint, no D2D limit"
fi

if [[ -z ${WORK:-} ]]; then
  if (($(df --output=avail -B1 /dev/shm | tail -1) > 20000000000)); then
    WORK=$(mktemp -d /dev/shm/wc-fill-XXXXXX)
  else
    WORK=$(mktemp -d "${TMPDIR:-/tmp}/wc-fill-XXXXXX")
  fi
fi
run_a=$(mktemp -d /tmp/wcfill-a-XXXXXX)
run_b=$(mktemp -d /tmp/wcfill-b-XXXXXX)
cleanup() {
  "$wc" stop --all --runtime-dir "$run_a" >>"$log" 2>&1
  "$wc" stop --all --runtime-dir "$run_b" >>"$log" 2>&1
  for f in "$run_a"/serve-a.log "$run_b"/serve-b-*.log; do
    [[ -f $f ]] || continue
    echo "==== $(basename "$f")" >>"$log"
    cat "$f" >>"$log"
  done
  rm -rf "$WORK" "$run_a" "$run_b" "${inventory:-}"
}
trap cleanup EXIT

# The help is read whole first: `serve --help | grep -q` under pipefail fails whenever grep exits
# before the CLI has written everything (SIGPIPE), which it did on CI. A build without the fleet
# still lists --fill-from, marked "not in this build" (tools/registry_flags.cc).
serve_help=$("$wc" serve --help 2>/dev/null) || serve_help=""
if [[ $serve_help != *--fill-from* || $serve_help == *"not in this build"* ]]; then
  fail "$wc has no fleet support (built without UCX or libcurl: see build.log)"
  exit 1
fi
model=$WORK/model
echo "== writing the 16 GB checkpoint" >>"$log"
if ! "$build/bench/shard_bench" --write-only "$model" --content random "${write_args[@]}" \
  >>"$log" 2>&1; then
  fail "writing the checkpoint (shard_bench --write-only) failed"
  exit 1
fi
bytes=$(du -sb "$model" | cut -f1)
# The content anchor (docs/fleet.md "The content anchor"): a plain directory records none, and
# --fill-trust content (the default) fills nothing without one.
sums=$WORK/model.sha256
t0=$(date +%s%3N)
if ! sha256sum "$model"/*.safetensors >"$sums" 2>>"$log"; then
  fail "sha256sum of the checkpoint failed"
  exit 1
fi
say "fill: sha256sum of the checkpoint (the pinned anchor) in $(($(date +%s%3N) - t0)) ms"

# 1. The device's own copy rate, the limit a fill on one GPU is measured against.
[[ $tier == gpu ]] && d2d=$(python3 - <<'PY' 2>>"$log"
import torch
n = 16 << 30
a = torch.empty(n, dtype=torch.uint8, device="cuda")
b = torch.empty_like(a)
best = 0.0
for _ in range(3):
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record(); b.copy_(a); e.record(); e.synchronize()
    best = max(best, n / 1e9 / (s.elapsed_time(e) / 1e3))
print(f"{best:.1f}")
PY
)
say "fill: D2D (torch, 16 GiB, best of 3): ${d2d:-?} GB/s"

ms_now() { date +%s%3N; }
identity=(--model "$model" --tier "$tier" --device 0)

# 2. Node A.
echo "== serve A --fill-serve" >>"$log"
t0=$(ms_now)
a_json=$("$wc" serve "${identity[@]}" --runtime-dir "$run_a" --fill-serve 127.0.0.1:0 \
  --fill-allow 127.0.0.1 --fill-content-sha256 "$sums" --detach --json --log-file "$run_a/serve-a.log" 2>>"$log") ||
  fail "serve A exited $?"
echo "$a_json" >>"$log"
a_socket=$(python3 -c 'import json, sys; print(json.loads(sys.argv[1])["daemons"][0]["socket"])' \
  "$a_json" 2>>"$log")
say "fill: A loaded from disk in $(($(ms_now) - t0)) ms: $(grep -h -o 'ready: .*' "$run_a/serve-a.log" | tail -1)"
endpoint=$(grep -h -o 'serving the arena at [0-9.]*:[0-9]*' "$run_a/serve-a.log" | tail -1 | awk '{print $NF}')
if [[ -z $endpoint ]]; then
  fail "A serves no fill source: $(grep -h 'fill source' "$run_a/serve-a.log" | tail -1)"
  exit 1
fi
say "fill: A serves its device memory at $endpoint"

# 3. Node B, once per transport set.
variants=${UCX_VARIANTS:-$default_variants}
first=1
for v in $variants; do
  blog=$run_b/serve-b-${v//[^a-z0-9_]/_}.log
  echo "== serve B --fill-from $endpoint (UCX_TLS=$v)" >>"$log"
  t0=$(ms_now)
  if [[ $v == default ]]; then
    env -u UCX_TLS "$wc" serve "${identity[@]}" --runtime-dir "$run_b" --fill-from "$endpoint" \
      --fill-content-sha256 "$sums" --detach --json --log-file "$blog" >>"$log" 2>&1
  else
    UCX_TLS=$v "$wc" serve "${identity[@]}" --runtime-dir "$run_b" --fill-from "$endpoint" \
      --fill-content-sha256 "$sums" --detach --json --log-file "$blog" >>"$log" 2>&1
  fi
  rc=$?
  ms=$(($(ms_now) - t0))
  ((rc == 0)) || fail "serve B (UCX_TLS=$v) exited $rc"
  ready=$(grep -h -o 'ready: .*' "$blog" | tail -1)
  filled=$(grep -h -o 'filled from [0-9]* source(s) .*' "$blog" | tail -1)
  why=$(grep -h -o 'fill: .*loading from disk' "$blog" | tail -1)
  say "fill: B (UCX_TLS=$v): serve returned in $ms ms; ${filled:-not filled: ${why:-see fill.log}}"
  say "fill:   $ready"
  setup=$(grep -h -o 'arena fetch: setup .*' "$blog" | tail -1)
  [[ -n $setup ]] && say "fill:   $setup"
  if ((first)) && [[ -z $filled ]]; then
    fail "B did not fill from A with UCX's own transport choice"
  fi
  first=0
  attach=$("$wc" attach "${identity[@]}" --runtime-dir "$run_b" --on-missing error --verify --json \
    --wait 60 2>>"$log")
  echo "$attach" >>"$log"
  python3 - "$attach" <<'PY' >>"$log" 2>&1 || fail "the attach to B (UCX_TLS=$v) did not verify"
import json, sys
a = json.loads(sys.argv[1])
assert a["source"] == "daemon", a["source"]
assert a["verify"]["ok"] is True and a["verify"]["tensors"] == a["tensors"], a["verify"]
PY
  "$wc" stop --all --runtime-dir "$run_b" >>"$log" 2>&1
done

# 3b. Issue 18's one-GPU form: B seeded from A's cache by its socket (`--seed-from`: A's
#     allocations mapped in B's context, copied device to device, checked like a fill).
if [[ -n $a_socket ]]; then
  blog=$run_b/serve-b-seed.log
  t0=$(ms_now)
  "$wc" serve "${identity[@]}" --runtime-dir "$run_b" --seed-from "$a_socket" --detach --json \
    --log-file "$blog" >>"$log" 2>&1 || fail "serve B --seed-from exited $?"
  seeded=$(grep -h -o 'filled from the peer cache .*' "$blog" | tail -1)
  say "fill: B seeded from A's socket (D2D): serve returned in $(($(ms_now) - t0)) ms; ${seeded:-not seeded: $(grep -h -o 'fill: .*loading from disk' "$blog" | tail -1)}"
  say "fill:   $(grep -h -o 'ready: .*' "$blog" | tail -1)"
  [[ -n $seeded ]] || fail "B was not seeded from A's socket"
  attach=$("$wc" attach "${identity[@]}" --runtime-dir "$run_b" --on-missing error --verify --json \
    --wait 60 2>>"$log")
  echo "$attach" >>"$log"
  python3 -c 'import json, sys; a = json.loads(sys.argv[1]); assert a["source"] == "daemon" and a["verify"]["ok"] is True' \
    "$attach" >>"$log" 2>&1 || fail "the attach to the seeded B did not verify"
  "$wc" stop --all --runtime-dir "$run_b" >>"$log" 2>&1
else
  fail "no socket for A in serve --json's output"
fi

# 4. The disk (page cache) load of the same checkpoint on B, for comparison.
blog=$run_b/serve-b-disk.log
t0=$(ms_now)
"$wc" serve "${identity[@]}" --runtime-dir "$run_b" --detach --json --log-file "$blog" >>"$log" 2>&1 ||
  fail "serve B from disk exited $?"
say "fill: B from the page cache: serve returned in $(($(ms_now) - t0)) ms; $(grep -h -o 'ready: .*' "$blog" | tail -1)"
"$wc" stop --all --runtime-dir "$run_b" >>"$log" 2>&1

# 5. UCX's own rate: ucp_get from CUDA memory, two processes, 64 MiB, with the get zcopy that
#    fleet::ucx::CreateContext turns on (UCX leaves it off without NVLink).
perftest=${UCX_PERFTEST:-${WEIGHTCACHE_UCX_PREFIX:-$build/ucx/libucx}/bin/ucx_perftest}
if [[ -x $perftest ]]; then
  for v in default "^cuda_ipc"; do
    envs=(UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y)
    [[ $v != default ]] && envs+=(UCX_TLS="$v")
    echo "== ucx_perftest ucp_get cuda (UCX_TLS=$v)" >>"$log"
    env "${envs[@]}" timeout 60 "$perftest" -p 13337 >>"$log" 2>&1 &
    server=$!
    sleep 1
    env "${envs[@]}" timeout 60 "$perftest" 127.0.0.1 -p 13337 -t ucp_get -m cuda,cuda \
      -s 67108864 -n 64 -w 4 >"$WORK/perftest.out" 2>&1
    cat "$WORK/perftest.out" >>"$log"
    line=$(grep -E '^Final:|^ +[0-9]+ ' "$WORK/perftest.out" | tail -1)
    wait "$server" 2>/dev/null
    say "fill: ucx_perftest ucp_get cuda→cuda 64 MiB (UCX_TLS=$v): ${line:-no result (fill.log)}"
  done
fi

say "fill: checkpoint $bytes bytes"
if ((failures == 0)); then
  say "fill: PASS (B filled from A's memory over UCX, and seeded from A's socket; each verified)"
fi
((failures == 0))
