#!/usr/bin/env bash
# Many models on one GPU (issue 16), at full size, with real daemons and the CLI: three caches
# of a 16 GB checkpoint (the Llama-3-8B shape that bench/shard_bench writes; three identities
# of one checkpoint, by --revision a, b and c) on one device under a gpu budget of 40 GB
# (decimal), every one `serve --demote $DEMOTE` (default host-pinned: the host copy pinned
# behind the demotion, so that the promotion is DMA alone; DEMOTE=host for the staged copies):
#
#   1. a and b load (32.1 GB of 40), each attached once (the LRU order is then a, b; c is
#      attached once too when it is ready);
#   2. c needs room: its admission evicts the least recently used idle cache, a, which demotes
#      to host RAM (state `demoted`, tier host in `status`), and c loads;
#   3. an attach to a (`weightcache attach --verify`: every tensor's checksum recomputed over
#      the mapped memory) promotes it back, which needs room in turn: b, now the least
#      recently used idle cache, demotes;
#   4. `status --json` after each step; the demotions' and the promotion's copy rates from the
#      daemons' own log lines ("demoted to host RAM in … (copy: N bytes in S s (G GB/s))",
#      "promoted back to the GPU in …").
#
# Checks (each FAIL is counted; exit 1 if any): every step's exit code; a demoted after step 2
# and b after step 3, from `status --json`; the attach of step 3 verified every tensor and
# came from the daemon (not a disk fallback).
#
#   scripts/gpu-budget.sh      # after scripts/gpu-suite.sh built build-gpu (with benches)
#
# Writes $OUT/budget.log (every command and its output, then the three daemons' logs);
# appends its headline lines to $OUT/summary.txt.
# Knobs: OUT (./gpu-out), BUILD_DIR (build-gpu), WORK (the checkpoint's dir; default on
# /dev/shm when it has 20 GB free, else a temp dir; removed after), DEMOTE (host-pinned|host).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-$PWD/gpu-out}
build=${BUILD_DIR:-build-gpu}
wc=$PWD/$build/tools/weightcache
demote=${DEMOTE:-host-pinned}
mkdir -p "$OUT"
log=$OUT/budget.log
: >"$log"
say() { echo "$*" | tee -a "$OUT/summary.txt"; }
failures=0
fail() {
  say "budget: FAIL: $*"
  failures=$((failures + 1))
}

if [[ -z ${WORK:-} ]]; then
  if (($(df --output=avail -B1 /dev/shm | tail -1) > 20000000000)); then
    WORK=$(mktemp -d /dev/shm/wc-budget-XXXXXX)
  else
    WORK=$(mktemp -d "${TMPDIR:-/tmp}/wc-budget-XXXXXX")
  fi
fi
runtime=$(mktemp -d /tmp/wcbud-XXXXXX)
cleanup() {
  "$wc" stop --all --runtime-dir "$runtime" >>"$log" 2>&1
  for r in a b c; do
    echo "==== the daemon of revision $r: its log" >>"$log"
    cat "$runtime/serve-$r.log" >>"$log" 2>/dev/null
  done
  rm -rf "$WORK" "$runtime"
}
trap cleanup EXIT

model=$WORK/model
echo "== writing the 16 GB checkpoint" >>"$log"
if ! "$build/bench/shard_bench" --write-only "$model" >>"$log" 2>&1; then
  fail "writing the checkpoint (shard_bench --write-only) failed"
  exit 1
fi
identity=(--model "$model" --tier gpu --device 0 --runtime-dir "$runtime")
budget=40000000000

ms_now() { date +%s%3N; }
serve() {  # revision
  local t0 rc
  t0=$(ms_now)
  echo "== serve --revision $1" >>"$log"
  "$wc" serve "${identity[@]}" --revision "$1" --gpu-budget "$budget" --demote "$demote" \
    --detach --json --log-file "$runtime/serve-$1.log" >>"$log" 2>&1
  rc=$?
  echo "serve $1: exit $rc in $(($(ms_now) - t0)) ms" >>"$log"
  ((rc == 0)) || fail "serve --revision $1 exited $rc (its log is at the end of budget.log)"
}
# `status --json`: each cache of the runtime dir as "revision:state" (`cache_state`: gpu or
# host when ready, else the state, e.g. demoted), sorted; then the device's used bytes.
states() {
  "$wc" status --runtime-dir "$runtime" --json 2>>"$log" | tee -a "$log" | python3 -c '
import json, sys
out = []
for d in json.load(sys.stdin)["devices"]:
    for c in d["caches"]:
        out.append("%s:%s" % (c["config"]["revision"], c["cache_state"]))
    if d.get("used_bytes") is not None:
        out.append("(ledger: %.1f GB used)" % (d["used_bytes"] / 1e9))
print(" ".join(sorted(out)))'
}

touch_cache() {  # revision: an attach and its detach, which make it the most recently used
  "$wc" attach "${identity[@]}" --revision "$1" --on-missing error --json --wait 60 >>"$log" 2>&1 ||
    fail "attach --revision $1 exited $?"
}
# Each cache attached once right after its load, so that the LRU order is a, b, c (caches
# never attached would be ordered by their socket paths).
serve a
touch_cache a
serve b
touch_cache b
serve c
touch_cache c
after_c=$(states)
say "budget: after c's admission: $after_c"
[[ " $after_c " == *" a:demoted "* ]] || fail "a is not demoted after c's admission ($after_c)"

echo "== attach --revision a --verify" >>"$log"
t0=$(ms_now)
attach_json=$("$wc" attach "${identity[@]}" --revision a --on-missing error --verify --json \
  --wait 300 2>>"$log")
rc=$?
attach_ms=$(($(ms_now) - t0))
echo "$attach_json" >>"$log"
((rc == 0)) || fail "attach --revision a exited $rc"
after_attach=$(states)
say "budget: after the attach to a: $after_attach"
[[ " $after_attach " == *" b:demoted "* ]] || fail "b is not demoted after a's promotion ($after_attach)"
python3 - "$attach_json" <<'PY' >>"$log" 2>&1 || fail "the attach to a did not verify from the daemon"
import json, sys
a = json.loads(sys.argv[1])
print("attach:", {k: a.get(k) for k in ("source", "reason", "tensors", "bytes", "attach_ms", "verify")})
assert a["source"] == "daemon", a["source"]
assert a["verify"]["ok"] is True and a["verify"]["tensors"] == a["tensors"], a["verify"]
PY

rate() {  # daemon log, "demoted to host RAM" or "promoted back to the GPU"
  grep -h "$2 in" "$1" 2>/dev/null | tail -1 | sed -E 's/.* in ([0-9]+) ms \(copy: ([0-9]+) bytes in ([0-9.]+) s \(([0-9.]+) GB\/s\).*/\1 ms, \2 bytes, copy \4 GB\/s/'
}
say "budget: a demoted: $(rate "$runtime/serve-a.log" "demoted to host RAM")"
say "budget: b demoted: $(rate "$runtime/serve-b.log" "demoted to host RAM")"
say "budget: a promoted: $(rate "$runtime/serve-a.log" "promoted back to the GPU") (the attach waited $attach_ms ms)"
if [[ $demote == host-pinned ]]; then
  # "host copy pinned in N ms (B bytes in S segments): ...", and the promotion's own line.
  pinned=$(grep -h "host copy pinned in" "$runtime/serve-a.log" | tail -1 | sed -E 's/.*(host copy pinned in [0-9]+ ms \([^)]*\)).*/\1/')
  say "budget: a's ${pinned:-host copy was not pinned (see budget.log)}"
  grep -q "promoted back to the GPU.*DMA from the pinned host copy" "$runtime/serve-a.log" ||
    fail "a's promotion did not copy from the pinned host copy"
fi
if ((failures == 0)); then
  say "budget: PASS (three 16 GB caches under a 40 GB budget, --demote $demote: demote, promote, verify)"
fi
((failures == 0))
