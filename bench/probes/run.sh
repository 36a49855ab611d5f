#!/usr/bin/env bash
# The probes of bench/probes/ on the device machine, one JSON line each, into $OUT/probes.jsonl
# (and the host facts they depend on into $OUT/probes.txt). Read by docs/benchmarks.md.
#
#   OUT=... bench/probes/run.sh [GiB=16]
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
gib=${1:-16}
bin=$(mktemp -d)
log=$OUT/probes.jsonl
facts=$OUT/probes.txt
{
  echo "kernel: $(uname -r)"
  echo "cores: $(nproc)"
  for f in /sys/kernel/mm/transparent_hugepage/enabled /sys/kernel/mm/transparent_hugepage/shmem_enabled; do
    echo "$f: $(cat "$f" 2>&1)"
  done
  grep -E 'HugePages_(Total|Free)|Hugepagesize' /proc/meminfo
  nvidia-smi --query-gpu=persistence_mode,name --format=csv,noheader 2>&1
} >"$facts"
g++ -O2 -std=c++20 -pthread bench/probes/shmem_probe.cc -o "$bin/shmem_probe" &&
  g++ -O2 -std=c++20 -I/usr/local/cuda/include bench/probes/ctx_probe.cc \
    -L/usr/local/cuda/lib64/stubs -lcuda -o "$bin/ctx_probe" || exit 1
: >"$log"
ctx() {  # condition
  for _ in 1 2 3; do
    local t0 t1
    t0=$(date +%s%N)
    "$bin/ctx_probe" time | sed "s/}\$/, \"condition\": \"$1\", \"process_ms\": PROCESS}/" >"$bin/line"
    t1=$(date +%s%N)
    sed "s/PROCESS/$(((t1 - t0) / 1000000))/" "$bin/line" >>"$log"
  done
}
held() {  # hold-dev | hold-ctx, settle seconds: the cost while another process holds that
  "$bin/ctx_probe" "$1" >>"$log" &
  local holder=$!
  sleep "$2"
  ctx "${1#hold-}_held"
  kill "$holder"
  wait "$holder" 2>/dev/null
}
ctx alone
held hold-dev 0.5
held hold-ctx 2
"$bin/shmem_probe" "$gib" >>"$log"
rm -rf "$bin"
cat "$facts"
cat "$log"
