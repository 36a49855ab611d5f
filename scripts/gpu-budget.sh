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
#      "promoted back to the GPU in …");
#   5. a fourth cache, d, needs room: c (now the least recently used) demotes and its daemon is
#      killed with SIGKILL in the middle of the copy; d is admitted and ready, the ledger holds
#      a and d, and the device's memory shows c's freed.
#
# Checks (each FAIL is counted; exit 1 if any): every step's exit code; a demoted after step 2
# and b after step 3, from `status --json`; the attach of step 3 verified every tensor and
# came from the daemon (not a disk fallback).
#
#   scripts/gpu-budget.sh      # after scripts/gpu-suite.sh built build-gpu (with benches)
#
# Writes $OUT/$LABEL.log (every command and its output, then the three daemons' logs);
# appends its headline lines, each starting with "$LABEL:", to $OUT/summary.txt.
# Knobs: OUT (./gpu-out), BUILD_DIR (build-gpu), WORK (the checkpoint's dir; default on
# /dev/shm when it has 20 GB free, else a temp dir; removed after), DEMOTE (host-pinned|host),
# SERVE_FLAGS (more flags for every `serve`, e.g. --no-keeper), LABEL (default budget: a
# second run in one call names its own log and lines).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-$PWD/gpu-out}
build=${BUILD_DIR:-build-gpu}
wc=$PWD/$build/tools/weightcache
demote=${DEMOTE:-host-pinned}
mkdir -p "$OUT"
label=${LABEL:-budget}
log=$OUT/$label.log
: >"$log"
say() { echo "${*/#budget:/$label:}" | tee -a "$OUT/summary.txt"; }
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
  for r in a b c d; do
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
  # shellcheck disable=SC2086  # SERVE_FLAGS is a list of flags
  "$wc" serve "${identity[@]}" --revision "$1" --gpu-budget "$budget" --demote "$demote" \
    ${SERVE_FLAGS:-} --detach --json --log-file "$runtime/serve-$1.log" >>"$log" 2>&1
  rc=$?
  echo "serve $1: exit $rc in $(($(ms_now) - t0)) ms" >>"$log"
  ((rc == 0)) || fail "serve --revision $1 exited $rc (its log is at the end of $label.log)"
}
# `status --json`: each cache of the runtime dir as "revision:state" (`cache_state`: gpu or
# host when ready, else the state, e.g. demoted), sorted; then the device's used bytes.
states() {
  "$wc" status --runtime-dir "$runtime" --json 2>>"$log" | tee -a "$log" | python3 -c '
import json, sys
out = []
for d in json.load(sys.stdin)["devices"]:
    for c in d["caches"]:
        # A dead daemon'"'"'s leftover socket has no config (it answers no Status).
        out.append("%s:%s" % (c.get("config", {}).get("revision", "?"),
                              c.get("cache_state", c.get("state", "?"))))
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
# Host memory before the first demotion: a demotion allocates shmem pages, which come from
# free memory or from reclaiming the page cache (the checkpoints' own pages among them).
meminfo() { awk '/^(MemTotal|MemFree|Cached|Shmem):/ {printf "%s %.1f GB  ", $1, $2 * 1024 / 1e9}' /proc/meminfo; }
say "budget: host memory before c's admission: $(meminfo)"
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
say "budget: host memory after a's promotion: $(meminfo)"
say "budget: a promoted: $(rate "$runtime/serve-a.log" "promoted back to the GPU") (the attach waited $attach_ms ms)"
if [[ $demote == host-pinned ]]; then
  # "host copy pinned in N ms (B bytes in S segments): ...", and the promotion's own line.
  pinned=$(grep -h "host copy pinned in" "$runtime/serve-a.log" | tail -1 | sed -E 's/.*(host copy pinned in [0-9]+ ms \([^)]*\)).*/\1/')
  say "budget: a's ${pinned:-host copy was not pinned (see $label.log)}"
  grep -q "promoted back to the GPU.*DMA from the pinned host copy" "$runtime/serve-a.log" ||
    fail "a's promotion did not copy from the pinned host copy"
fi
# 5. kill -9 in the middle of a demotion: a fourth cache, d, needs room; the least recently
#    used idle gpu cache, c (a was attached after it), demotes, and c's daemon is killed with
#    SIGKILL while it copies (on its "demotion: copying" line, after its keeper let go). d's
#    admission must go on (the dead daemon's ledger entry is reclaimed), d becomes ready, the
#    ledger holds a and d on the gpu tier (32.1 GB), and the device's memory shows c's 16 GB
#    freed.
echo "== serve --revision d in the background; kill -9 of c in the middle of its demotion" >>"$log"
c_pid=$("$wc" status --runtime-dir "$runtime" --json 2>>"$log" | python3 -c '
import json, sys
for d in json.load(sys.stdin)["devices"]:
    for c in d["caches"]:
        if c.get("config", {}).get("revision") == "c":
            print(c.get("pid", ""))')
# shellcheck disable=SC2086  # SERVE_FLAGS is a list of flags
"$wc" serve "${identity[@]}" --revision d --gpu-budget "$budget" --demote "$demote" \
  ${SERVE_FLAGS:-} --detach --json --log-file "$runtime/serve-d.log" >>"$log" 2>&1 &
serve_d=$!
killed=0
for _ in $(seq 1 3000); do  # the demotion starts within seconds; a 10 ms poll of c's log
  # Logged once c's keeper has let go (a kill before that leaves the memory to the keeper,
  # which the ledger then counts, and d would rightly wait: not what this step tests).
  if grep -q "demotion: copying" "$runtime/serve-c.log" 2>/dev/null; then
    kill -9 "$c_pid" 2>>"$log" && killed=1
    break
  fi
  sleep 0.01
done
wait "$serve_d"
rc=$?
echo "serve d: exit $rc" >>"$log"
if ((killed == 0)); then
  fail "c never started demoting (pid '${c_pid}'); no kill"
elif grep -q "demoted to host RAM in" "$runtime/serve-c.log"; then
  fail "c's demotion finished before the kill -9 reached it (not a mid-demotion kill)"
else
  ((rc == 0)) || fail "serve --revision d exited $rc after c was killed mid-demotion"
  after_kill=$(states)
  say "budget: after kill -9 of c mid-demotion and d's admission: $after_kill"
  [[ " $after_kill " == *" d:gpu "* && " $after_kill " == *" a:gpu "* ]] ||
    fail "a and d are not both on the gpu after the kill ($after_kill)"
  [[ " $after_kill " == *"(ledger: 32.1 GB used)"* ]] ||
    fail "the ledger does not hold a and d alone ($after_kill)"
  [[ " $after_kill " != *" c:gpu "* && " $after_kill " != *" c:demoted "* ]] ||
    fail "the killed c is still listed as holding memory ($after_kill)"
  used_mib=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -i 0 2>>"$log" | head -1)
  say "budget: device memory used after the kill: ${used_mib:-?} MiB (a and d: 30,630 MiB of weights)"
  if [[ -n $used_mib ]] && ((used_mib > 36000)); then
    fail "the device holds ${used_mib} MiB after the kill: c's 16 GB were not freed"
  fi
fi

if ((failures == 0)); then
  say "budget: PASS (three 16 GB caches under a 40 GB budget, --demote $demote: demote, promote, verify, kill -9 mid-demotion)"
fi
((failures == 0))
