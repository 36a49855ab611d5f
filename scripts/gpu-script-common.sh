# Sourced by the scripts of real daemons and the CLI that gpu-suite.sh runs and test.sh
# rehearses (scripts/gpu-fill.sh, scripts/gpu-seed.sh): their shared start.
#
#   gpu_script_init NAME LOG   from the repository root: OUT (./gpu-out), build (BUILD_DIR,
#                              default build-gpu), wc (its CLI), log ($OUT/LOG, emptied),
#                              failures=0; `say` appends a line to $OUT/summary.txt as well,
#                              `fail` says "NAME: FAIL: …" and counts it
#   dry_run_tier N             tier (gpu) and write_args (shard_bench's: none); with
#                              DRY_RUN=host, the rehearsal's: tier host, a small checkpoint and
#                              a device inventory of N fake GPUs, exported as
#                              WEIGHTCACHE_DEVICE_INVENTORY (its file is $inventory, removed by
#                              the caller's cleanup); returns 0 for a rehearsal
# shellcheck shell=bash

gpu_script_init() {
  script_name=$1
  OUT=${OUT:-$PWD/gpu-out}
  build=${BUILD_DIR:-build-gpu}
  # shellcheck disable=SC2034  # wc and log: for the sourcing script
  wc=$PWD/$build/tools/weightcache
  mkdir -p "$OUT"
  log=$OUT/$2
  : >"$log"
  failures=0
}

say() { echo "$*" | tee -a "$OUT/summary.txt"; }

fail() {
  say "$script_name: FAIL: $*"
  failures=$((failures + 1))
}

# shellcheck disable=SC2034  # tier and write_args: for the sourcing script
dry_run_tier() {
  tier=gpu
  write_args=()
  [[ ${DRY_RUN:-} == host ]] || return 1
  tier=host
  write_args=(--layers 2 --vocab 1024)
  inventory=$(mktemp "/tmp/wc-$script_name-inventory-XXXXXX.json")
  python3 -c '
import json, sys
json.dump([{"index": i, "uuid": "GPU-00000000-0000-0000-0000-%012d" % i, "name": "Fake H200",
            "memory_bytes": 150 * 10**9} for i in range(int(sys.argv[2]))], open(sys.argv[1], "w"))' \
    "$inventory" "$1"
  export WEIGHTCACHE_DEVICE_INVENTORY=$inventory
}
