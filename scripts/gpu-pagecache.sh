#!/usr/bin/env bash
# Page cache → GPU beside InstantTensor (issue 39 sections 1 and 2; docs/benchmarks.md "Page
# cache to GPU"), with the CLI and load_bench of the suite's build:
#
#   1. a fresh process's CUDA start: `weightcache devices --json` (cuInit and the device
#      lookup that every `serve` and every `serve --detach` parent pays), 3 times;
#   2. bench/pagecache_bench.py on a Llama-3-8B-shaped checkpoint (16 GB, 4 files, written by
#      tests/python/gpu_model_check.py make), InstantTensor installed from its carried wheel:
#      anchors, InstantTensor buffered, `serve --detach` spawn to serving at each
#      PAGECACHE_THREADS, the restart after kill -9 with --adopt-verify sample and behind. The
#      daemons log at debug level, so their load's timeline (`gpu tier: timeline ms: …`) is
#      in pagecache.log;
#   3. load_bench over the same files, page cache warm, 3 runs each (the first also makes the
#      staging ring, as every daemon's load does): the daemon's pipeline shape against smaller
#      staging buffers, io_uring reads and the mapped path (PAGECACHE_SWEEP=0 skips it);
#   4. (PAGECACHE_64=1) the same loaders at 64 GB in 1 and in 4 files, from /dev/shm.
#
#   scripts/gpu-pagecache.sh   # after scripts/gpu-suite.sh built build-gpu; BENCHES="pagecache"
#
# Writes $OUT/pagecache.jsonl (every measurement, one JSON object a line) and
# $OUT/pagecache.log (commands, the daemons' logs, InstantTensor's debug lines); appends its
# headline lines, each starting with "pagecache:", to $OUT/summary.txt. A measurement: it
# fails (exit 1) only when a step fails, not when a target is missed.
# Knobs: OUT (./gpu-out), BUILD_DIR (build-gpu), IT_WHEEL (default
# .deps/it/instanttensor-*-cp312-*.whl), PAGECACHE_THREADS (serve --threads values, default
# "16,8,32": the first is serve's default and the one the ratio uses), PAGECACHE_SWEEP,
# WORK (the checkpoint's dir; default a temp dir on the disk, removed), PAGECACHE_64=1 (step 4).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
# shellcheck source=scripts/gpu-script-common.sh
. scripts/gpu-script-common.sh
gpu_script_init pagecache pagecache.log
jsonl=$OUT/pagecache.jsonl
: >"$jsonl"

wheel=${IT_WHEEL:-$(ls .deps/it/instanttensor-*-cp312-*.whl 2>/dev/null | head -n1)}
if [[ -z $wheel ]]; then
  say "pagecache: skipped (no InstantTensor wheel: scripts/stage-device-deps.sh stages it in .deps/it)"
  exit 0
fi
work=${WORK:-$(mktemp -d "${TMPDIR:-/tmp}/wcp-XXXXXX")}
cleanup() { [[ -z ${WORK:-} ]] && rm -rf "$work"; }
trap cleanup EXIT

step() {  # what, command...: logged; a failure is counted
  local what=$1
  shift
  echo "==== $what: $*" >>"$log"
  "$@" >>"$log" 2>&1 || {
    fail "$what (pagecache.log)"
    return 1
  }
}

# 1. cuInit and the device lookup in a fresh process.
for i in 1 2 3; do
  t0=$(date +%s.%N)
  uuid=$("$wc" devices --json 2>>"$log" |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["devices"][0]["uuid"])' 2>>"$log")
  ms=$(python3 -c "import sys; print(round((float(sys.argv[2]) - float(sys.argv[1])) * 1000))" \
    "$t0" "$(date +%s.%N)")
  echo "{\"bench\": \"pagecache\", \"devices_json_ms\": $ms, \"run\": $i}" >>"$jsonl"
  devices_ms+=("$ms")
done
say "pagecache: \`weightcache devices --json\` in a fresh process (cuInit + lookup): ${devices_ms[*]} ms"
if [[ -z ${uuid:-} ]]; then
  fail "no GPU listed by weightcache devices"
  exit 1
fi

# 2. InstantTensor beside serve.
step "install InstantTensor" python3 -m pip install --no-deps --no-index --target "$work/it" "$wheel" &&
  step "make the checkpoint" python3 tests/python/gpu_model_check.py make --shape llama3-8b \
    --out "$work/llama3-8b" || exit 1
echo "==== pagecache_bench" >>"$log"
if PYTHONPATH=$work/it${PYTHONPATH:+:$PYTHONPATH} WEIGHTCACHE_LOG_LEVEL=debug \
  timeout --kill-after=10 300 python3 bench/pagecache_bench.py --model "$work/llama3-8b" \
  --cli "$wc" --device "$uuid" --cuda-index 0 --threads "${PAGECACHE_THREADS:-16,8,32}" \
  >>"$jsonl" 2>>"$log"; then
  say "pagecache: $(grep '^result:' "$jsonl")"
  python3 - "$jsonl" <<'PY' | tee -a "$OUT/summary.txt"
import json, sys
for line in open(sys.argv[1]):
    if not line.startswith("{"):
        continue
    j = json.loads(line)
    if j.get("loader") == "weightcache-serve":
        print(f"pagecache: serve --threads {j['threads']} rep {j['rep']}: spawn to serving "
              f"{j['spawn_to_serving_s']:.3f} s ({j['gbps']:.1f} GB/s), ready line "
              f"{j['ready_line_s']:.3f} s")
    elif j.get("loader") == "instanttensor-buffered":
        print(f"pagecache: InstantTensor rep {j['rep']}: {j['seconds']:.3f} s ({j['gbps']:.1f} "
              f"GB/s), its CUDA context before that {j['context_seconds']:.3f} s")
PY
  grep -h "timeline ms" "$log" | sed 's/^.*timeline ms: /pagecache: daemon timeline ms: /' |
    sort -u | tee -a "$OUT/summary.txt"
  grep -h "Using backend\|Time: total\|Throughput" "$log" | sort -u | sed 's/^/pagecache: IT /' |
    tee -a "$OUT/summary.txt"
else
  fail "pagecache_bench ($(tail -n 3 "$log" | paste -sd' ' | cut -c1-400))"
fi

# 3. The pipeline's shape, over the same files (the checkpoint's *.safetensors only).
if [[ ${PAGECACHE_SWEEP:-1} != 0 ]]; then
  mkdir -p "$work/files"
  ln -sf "$work"/llama3-8b/*.safetensors "$work/files/"
  base="--warm-only --reps 3 --streams 4"
  variants=(
    "--threads 16 --buffers 32 --device-checksum"  # the daemon's: 32 x 32 MiB
    "--threads 16 --buffers 64 --buffer-mib 8 --device-checksum"
    # Small enough that what a reader just wrote may still be in the last-level cache when
    # the copy engine reads it (the staged demotion's limit was its buffers' size).
    "--threads 16 --buffers 64 --buffer-mib 2 --device-checksum"
    "--threads 16 --buffers 128 --buffer-mib 1 --device-checksum"
    "--threads 32 --buffers 64 --buffer-mib 8 --device-checksum"
    "--threads 16 --buffers 32 --device-checksum --io-uring"
    "--mapped --threads 16"
  )
  for v in "${variants[@]}"; do
    echo "==== load_bench $work/files $base $v" >>"$log"
    # shellcheck disable=SC2086  # a variant is a list of flags
    if timeout --kill-after=10 120 "$build/bench/load_bench" "$work/files" $base $v \
      >"$work/lb.jsonl" 2>>"$log"; then
      cat "$work/lb.jsonl" >>"$jsonl"
      python3 - "$work/lb.jsonl" "$v" <<'PY' | tee -a "$OUT/summary.txt"
import json, sys
runs = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
kind = lambda k: [j for j in runs if j.get("kind") == k]
pipe = [f"{j['gb_per_s']:.1f} (staging {j['staging_s'] * 1e3:.0f} ms)" for j in kind("pipeline")]
read = [f"{j['gb_per_s']:.1f}" for j in kind("file_read")]
h2d = [f"{j['gb_per_s']:.1f}" for j in kind("pinned_h2d")]
print(f"pagecache: load_bench {sys.argv[2]}: GB/s per run {', '.join(pipe)}; file read "
      f"{'/'.join(read)}, pinned H2D {'/'.join(h2d)}")
PY
    else
      fail "load_bench $v"
    fi
  done
fi
# 4. 64 GB in 1 and 4 files (issue 39 §1), from /dev/shm: the device's disk cannot hold the
#    files beside the build, and tmpfs pages are page-cache pages. bench/write_big_checkpoint.py
#    writes each layout; one repetition of each loader, serve's default --threads, no restarts.
#    Only with PAGECACHE_64=1 (~4 minutes; /dev/shm needs 64 GB free).
if [[ ${PAGECACHE_64:-0} == 1 ]]; then
  big=$(mktemp -d /dev/shm/wc-pc64-XXXXXX)
  for files in 1 4; do
    rm -rf "${big:?}"/*
    if step "write 64 GB in $files file(s)" python3 bench/write_big_checkpoint.py --out "$big" \
      --gb 64 --files "$files"; then
      echo "==== pagecache_bench 64 GB, $files file(s)" >>"$log"
      if PYTHONPATH=$work/it${PYTHONPATH:+:$PYTHONPATH} timeout --kill-after=10 300 \
        python3 bench/pagecache_bench.py --model "$big" --cli "$wc" --device "$uuid" \
        --cuda-index 0 --threads 16 --reps 1 --no-restarts >"$work/pc64.jsonl" 2>>"$log"; then
        cat "$work/pc64.jsonl" >>"$jsonl"
        say "pagecache 64 GB, $files file(s): $(grep '^result:' "$work/pc64.jsonl")"
      else
        fail "pagecache_bench 64 GB, $files file(s) ($(tail -n 3 "$log" | paste -sd' ' | cut -c1-300))"
      fi
    fi
  done
  rm -rf "$big"
fi
((failures == 0))
