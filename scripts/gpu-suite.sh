#!/usr/bin/env bash
# The GPU tier in one call, from a BARE device machine (nvcc, cmake, ninja, gcc, python3; no
# Debian -dev packages, no network). Builds weightcache against the header-only / static deps
# carried in .deps/usr (scripts/stage-device-deps.sh), with the CUDA kernels for sm_90, runs
# `ctest -L gpu` (VMM arena, checksum kernel, upload pipeline, the gpu tier end to end with
# real daemons and clients, TP2 launch), then the unit, integration and adversarial tiers, then
# the benchmarks in bench/.
# Tests that need two GPUs skip with the reason on a one-GPU machine (the summary says how
# many GPUs the run had).
#
#   scripts/gpu-suite.sh                       # from the repository root; logs under $OUT
#   SUITE=quick scripts/gpu-suite.sh           # build + gpu tests only (no unit tier, no benches)
#
# Writes (few files, the device tool brings back at most 8):
#   $OUT/build.log     configure + build output
#   $OUT/tests.log     ctest output (gpu tier, then unit tier)
#   $OUT/bench.jsonl   one JSON line per benchmark measurement
#   $OUT/bench.log     the benchmarks' stderr (progress, errors)
#   $OUT/summary.txt   GPUs, driver, pass/fail counts, skipped tests, every bench's headline
#                      numbers (attach ms per tensor count, load GB/s and ratios, overhead, RSS,
#                      the sharded load's times, ratio and per-rank memory vs bound)
# Knobs: OUT (default ./gpu-out), BUILD_DIR (build-gpu), DEPS (.deps/usr), JOBS (nproc),
#        TARGETS (build only these, for a dry run), SKIP_BENCH=1, SUITE=full|quick,
#        SKIP_CPU_TIERS=1 (full without the unit, integration and adversarial tiers),
#        SKIP_GPU_TESTS=1 (no gpu tier either: benches only, e.g. with TARGETS=load_bench),
#        BENCHES (only these benches, e.g. "shard_bench gpu_attach_bench"; default all; "gpu_budget"
#        names scripts/gpu-budget.sh, three 16 GB caches under a 40 GB budget; "load_matrix",
#        run only when named, load_bench from /dev/shm at 16 and 64 GiB in 1 and 4 files, in
#        the daemon's shape and its variants: ~5 minutes and 64 GiB of /dev/shm; "load_uring",
#        run only when named, the same with the readers' runs through io_uring; "pagecache",
#        scripts/gpu-pagecache.sh (serve beside InstantTensor, 16 GB, page cache warm, and the
#        pipeline's shape over the same files; ~3 minutes; needs .deps/it); "demote_settle",
#        run only when named, demote_bench's host-pinned path with and without a pause between
#        repetitions; "demote_staging", run only when named, the staged demotion with 1 to
#        16 MiB staging buffers; "gpu_fill", scripts/gpu-fill.sh (two daemons, one fills its
#        16 GB gpu-tier cache from the other over UCX's CUDA support; needs the staged
#        libucx-cu13 wheel); "gpu_seed", scripts/gpu-seed.sh (two GPUs: GPU 1's 16 GB cache
#        seeded from GPU 0's; skipped with one GPU); "budget_fresh_warm", run only when named, demote_bench's host
#        write passes alone, then gpu-budget.sh twice (fresh host memory, then reused); "rss_64", run
#        only when named, gpu_attach_bench's daemon at 64 GiB and 291 tensors: its VmHWM),
#        BENCH_WORK (scratch for the benches' checkpoints; default a temp dir, removed).
# Exit status: non-zero if the build or any test fails, or a benchmark fails or times out.
# Budget: under 9 minutes on 1 x H200 (build ~2, tests ~2, benches ~5; each bench has its own
# timeout so one stuck bench cannot eat the budget).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
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

# The commit under test. The device machine gets a copy of the working tree whose .git (if
# any) is not this checkout's, so `git rev-parse` there can name an old commit. The caller
# passes it: WEIGHTCACHE_COMMIT=$(git rev-parse --short HEAD) (plus "+dirty" for uncommitted
# changes); a `git archive` snapshot has it stamped in scripts/archive-commit
# (.gitattributes export-subst). Otherwise "unknown", never a guess.
commit=${WEIGHTCACHE_COMMIT:-$(cat scripts/archive-commit 2>/dev/null)}
if [[ -z $commit || $commit == *Format* ]]; then
  commit=unknown
fi
say "== weightcache gpu suite, $(date -u +%FT%TZ), commit $commit"
if command -v nvidia-smi >/dev/null; then
  nvidia-smi -L 2>&1 | tee -a "$summary"
  say "driver version: $(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>&1 | head -1)"
else
  say "nvidia-smi: not found (gpu tests will skip)"
fi
say "nvcc: $(nvcc --version 2>/dev/null | grep -o 'release [0-9.]*' || echo 'not found')"
say "CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-<unset>}"
suite=${SUITE:-full}
case $suite in
  full | quick) ;;
  *)
    say "FAIL: SUITE=$suite (want full or quick)"
    exit 2
    ;;
esac
gpus=0
command -v nvidia-smi >/dev/null && gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
say "suite: $suite, GPUs: $gpus$( ((gpus < 2)) && echo ' (the two-GPU tests will skip)')"

# ---- configure + build -----------------------------------------------------------------------
if [[ ! -d $deps/include ]]; then
  say "FAIL: $deps is missing: run scripts/stage-device-deps.sh here and carry .deps"
  exit 1
fi
arch=x86_64-linux-gnu
build_ok=1
# The fleet's transport with CUDA (issue 19's gpu-tier fill): Debian's UCX has no CUDA
# transports, so the device build takes the UCX that stage-device-deps.sh staged: built from
# source into .deps/ucx-cuda (with pidfd_getfd, which cuda_ipc needs to map another
# process's VMM memory), else PyPI's libucx-cu13 wheel (.deps/wheels; built without it,
# docs/fleet.md), unpacked under the build dir.
# Either way its pkg-config files are pointed at it, its libraries found at run time through
# the build's RPATH and LD_LIBRARY_PATH (the daemons the scripts start inherit it), and
# WEIGHTCACHE_UCX_PREFIX tells gpu-fill.sh where its ucx_perftest is (not UCX_*: UCX warns
# about every UCX_* variable it does not know). Without one the fleet is built against
# whatever UCX this machine has, or not at all (configure says which).
ucx_prefix=
ucx_wheel=$(find "$root/.deps/wheels" -name "libucx_cu13-*.whl" 2>/dev/null | head -1)
if [[ -d $root/.deps/ucx-cuda/lib ]]; then
  ucx_prefix=$root/.deps/ucx-cuda
  ucx_what="UCX built from source (.deps/ucx-cuda)"
elif [[ -n $ucx_wheel ]]; then
  ucx_dir=$root/$build/ucx
  mkdir -p "$build"
  if [[ ! -d $ucx_dir/libucx/lib ]]; then
    rm -rf "$ucx_dir" && python3 -m zipfile -e "$ucx_wheel" "$ucx_dir" >/dev/null
  fi
  ucx_prefix=$ucx_dir/libucx
  ucx_what=$(basename "$ucx_wheel")
fi
if [[ -n $ucx_prefix ]]; then
  sed -i "s|^prefix *=.*|prefix = $ucx_prefix|" "$ucx_prefix"/lib/pkgconfig/*.pc
  chmod +x "$ucx_prefix"/bin/* 2>/dev/null
  export PKG_CONFIG_PATH=$ucx_prefix/lib/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}
  export LD_LIBRARY_PATH=$ucx_prefix/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export WEIGHTCACHE_UCX_PREFIX=$ucx_prefix
  say "ucx: $ucx_what, $("$ucx_prefix"/bin/ucx_info -v 2>&1 | grep -o 'version: [0-9.]*' | head -1) (CUDA transports) for the fleet"
fi
{
  # Debian multiarch: headers under include/<arch> (e.g. Nettle's); the CMake package
  # files of GTest under lib/<arch>/cmake. Everything is named explicitly so the result does
  # not depend on whether this host's CMake knows the multiarch layout.
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_PREFIX_PATH="$deps" \
    -DCMAKE_CXX_FLAGS="-isystem $deps/include/$arch" \
    -DNETTLE_INCLUDE_DIR="$deps/include" -DNETTLE_LIBRARY="$deps/lib/$arch/libnettle.a" \
    -DGTest_DIR="$deps/lib/$arch/cmake/GTest" \
    -Dnlohmann_json_DIR="$deps/share/cmake/nlohmann_json" \
    -DCLI11_DIR="$deps/share/cmake/CLI11" \
    -DXXHASH_INCLUDE_DIR="$deps/include" \
    -DWEIGHTCACHE_IO_URING=ON -DLIBURING_INCLUDE_DIR="$deps/include" \
    -DLIBURING_LIBRARY="$deps/lib/$arch/liburing.a" \
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

# ---- tests ----------------------------------------------------------------------------------
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
    sed -n '/The following tests did not run/,/^$/p' "$log" | grep "Skipped" |
      sed 's/^[[:space:]]*/  skipped /' | tee -a "$summary"
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
if [[ -z ${SKIP_GPU_TESTS:-} ]]; then
  run_ctest gpu -V -j 1
  reason=$(grep -E "^[0-9]+: .*Skipped$" -A1 "$OUT/tests.log" | grep -vE "Skipped$|^--" | head -1)
  [[ -n $reason ]] && say "  first gpu skip reason: ${reason#*: }"
else
  say "tests [gpu]: skipped (SKIP_GPU_TESTS)"
fi
if [[ $suite == full && -z ${SKIP_CPU_TIERS:-} ]]; then
  run_ctest unit
  # The CPU tiers again on this machine's cores and kernel: real daemons, launches and hostile
  # clients, whose timing differs from CI's 2 cores.
  run_ctest integration
  run_ctest adversarial
fi

# ---- benchmarks ------------------------------------------------------------------------------
# Each bench runs with explicit arguments and its own timeout (seconds); stdout (JSON lines)
# goes to bench.jsonl, stderr to bench.log.
: >"$OUT/bench.jsonl"
: >"$OUT/bench.log"
bench_ok=1
if [[ $suite == full && -z ${SKIP_BENCH:-} ]]; then
  work=${BENCH_WORK:-$(mktemp -d "${TMPDIR:-/tmp}/wc-bench-XXXXXX")}
  mkdir -p "$work"
  run_bench() {  # timeout name args... (skipped unless BENCHES is empty or names it)
    if [[ -n ${BENCHES:-} && " $BENCHES " != *" $2 "* ]]; then
      return
    fi
    run_bench_exe "$@"
  }
  run_bench_exe() {  # timeout name args... (whatever BENCHES says)
    local limit=$1 name=$2
    shift 2
    local exe="$build/bench/$name" t0 rc
    if [[ ! -x $exe ]]; then
      say "bench $name: not built"
      bench_ok=0
      return
    fi
    t0=$(date +%s)
    echo "==== $name $*" >>"$OUT/bench.log"
    timeout --kill-after=10 "$limit" "$exe" "$@" >>"$OUT/bench.jsonl" 2>>"$OUT/bench.log"
    rc=$?
    if ((rc == 0)); then
      say "bench $name: ok ($(($(date +%s) - t0)) s)"
    elif ((rc == 124 || rc == 137)); then
      say "bench $name: TIMED OUT after ${limit} s (partial output kept)"
      bench_ok=0
    else
      say "bench $name: FAILED (rc $rc, stderr in bench.log)"
      bench_ok=0
    fi
  }
  # Issue 14: tmpfs → GPU, 16 and 64 GiB, 1 and 4 files (only when BENCHES names it). Each
  # variant: 3 warm runs, the read pass alone and beside an H2D copy loop, pinned H2D.
  if [[ " ${BENCHES:-} " == *" load_matrix "* ]]; then
    shm=$(mktemp -d /dev/shm/wc-load-XXXXXX)
    variants=(
      "--threads 16 --buffers 32 --streams 4 --device-checksum"  # the daemon's (serve default)
      "--threads 8 --buffers 16 --streams 4 --device-checksum"   # shard_bench's daemons
      "--threads 16 --buffers 32 --buffer-mib 64 --streams 4 --device-checksum"
      "--threads 16 --buffers 32 --streams 4 --no-checksum"
      "--mapped --threads 16 --streams 4"
    )
    for gib in 16 64; do
      for files in 1 4; do
        rm -rf "${shm:?}"/*
        for v in "${variants[@]}"; do
          # shellcheck disable=SC2086  # a variant is a list of flags
          run_bench_exe 120 load_bench "$shm" --gib "$gib" --files "$files" \
            --warm-only --reps 3 $v
        done
      done
    done
    rm -rf "$shm"
  fi
  # Issue 14 part 1's io_uring variant: the daemon's staged path with its readers' runs read
  # through io_uring (load_bench --io-uring, os/uring_read.h) next to the daemon's preads, from
  # /dev/shm at 16 GiB in 1 and 4 files and 64 GiB in 1 (only when BENCHES names "load_uring").
  if [[ " ${BENCHES:-} " == *" load_uring "* ]]; then
    shm=$(mktemp -d /dev/shm/wc-uring-XXXXXX)
    base="--buffers 32 --streams 4 --device-checksum"
    variants=(
      "--threads 16 $base"                                            # the daemon's (pread)
      "--threads 16 $base --io-uring"                                 # 4 MiB pieces, 8 in flight, io-wq
      "--threads 16 $base --io-uring --uring-inline"                  # tried in the reader first
      "--threads 4 $base --io-uring --uring-depth 8"                  # 4 readers, 32 pieces at once
      "--threads 8 $base --io-uring --uring-depth 16 --uring-piece-mib 2"
      "--threads 16 $base --buffer-mib 64 --io-uring --uring-depth 4 --uring-piece-mib 16"
    )
    for shape in "16 1" "16 4" "64 1"; do
      read -r gib files <<<"$shape"
      rm -rf "${shm:?}"/*
      for v in "${variants[@]}"; do
        # shellcheck disable=SC2086  # a variant is a list of flags
        run_bench_exe 150 load_bench "$shm" --gib "$gib" --files "$files" --warm-only --reps 3 $v
      done
    done
    rm -rf "$shm"
  fi
  # Issue 14 part 6: the daemon's peak host memory (VmHWM) loading a 64 GiB checkpoint from
  # /dev/shm, against the same figure at 16 GiB below (only when BENCHES names "rss_64").
  if [[ " ${BENCHES:-} " == *" rss_64 "* ]]; then
    run_bench_exe 300 gpu_attach_bench --work "$work/gpu64" --gib 64 --counts 291 --iters 5
  fi
  run_bench 120 load_bench "$work/load" --gib 4
  # The same files, warm, through the mapped path (the copy engine reading the page cache).
  run_bench 60 load_bench "$work/load" --gib 4 --warm-only --mapped
  rm -rf "$work/load"
  # Issue 16: demotion to host RAM and promotion back of a 16 GiB arena vs pinned H2D.
  run_bench 180 demote_bench --gib 16 --reps 3 --strategy both
  # Whether a demotion right after an unpinned host copy is released pays for it: the
  # host-pinned path alone, back to back and then with 3 s between repetitions (only when
  # BENCHES names "demote_settle").
  if [[ " ${BENCHES:-} " == *" demote_settle "* ]]; then
    run_bench_exe 120 demote_bench --gib 16 --reps 3 --strategy kept
    run_bench_exe 120 demote_bench --gib 16 --reps 3 --strategy kept --settle-ms 3000
    run_bench_exe 120 demote_bench --gib 16 --reps 2 --strategy staged --settle-ms 3000
    # A daemon's 16 GB cache is one allocation (the bench's default is 8 of 2 GiB).
    run_bench_exe 120 demote_bench --gib 16 --alloc-gib 16 --reps 2 --strategy staged
  fi
  # The staged demotion with smaller staging buffers: whether the CPU's reads of what the DMA
  # just wrote come from the last-level cache when a worker's two buffers are small (only when
  # BENCHES names "demote_staging").
  if [[ " ${BENCHES:-} " == *" demote_staging "* ]]; then
    for mib in 1 2 4 16; do
      run_bench_exe 120 demote_bench --gib 16 --alloc-gib 16 --reps 2 --strategy staged \
        --staging-mib "$mib"
    done
  fi
  run_bench 120 attach_bench --gib 16 --reps 5
  run_bench 100 host_attach_bench "$work/host" --iters 50 --threads 8 --load-mib 1024
  rm -rf "$work/host"
  # 16 GiB checkpoints of 10 / 1,000 / 10,000 tensors, one at a time (deleted after use).
  run_bench 300 gpu_attach_bench --work "$work/gpu" --gib 16 --counts 10,1000,10000 --iters 20
  # Issue 12: a Llama-3-8B-shaped checkpoint (16 GB) loaded whole by one daemon vs by 4 TP
  # rank daemons on the same GPU; each rank's GPU memory against its bound (docs/benchmarks.md).
  run_bench 240 shard_bench --work "$work/shard" --reps 3
  # Issue 15: the same checkpoint; after kill -9, the restarted daemon's time to ready on the
  # memory its keeper held; the unavailable window of `weightcache upgrade` under 8 clients
  # attaching in a loop (docs/benchmarks.md). Twice: the restart checking every tensor before
  # `ready` (full), and ready first with every tensor checked right after (behind).
  run_bench 180 restart_bench --work "$work/restart" --reps 3 --clients 8
  run_bench 180 restart_bench --work "$work/restart-behind" --reps 3 --clients 8 \
    --adopt-verify behind
  [[ -z ${BENCH_WORK:-} ]] && rm -rf "$work"
  # One of the scripts of real daemons and the CLI (scripts/gpu-*.sh), with its own timeout,
  # its log under $OUT and its headline lines appended to summary.txt by itself.
  run_script() {  # label timeout log script [VAR=value...]
    local label=$1 limit=$2 script_log=$3 script=$4 t0
    shift 4
    t0=$(date +%s)
    if env OUT="$OUT" BUILD_DIR="$build" "$@" timeout --kill-after=10 "$limit" "$script"; then
      say "bench $label: ok ($(($(date +%s) - t0)) s)"
    else
      say "bench $label: FAILED ($script_log)"
      bench_ok=0
    fi
  }
  # Whether the daemons' demotions pay for host memory touched for the first time (a VM whose
  # memory is backed as it is first used): the host write passes alone on this fresh machine
  # (the first takes new memory, the next ones reuse it), then gpu-budget.sh twice, its second
  # run on memory the first one used (only when BENCHES names "budget_fresh_warm").
  if [[ " ${BENCHES:-} " == *" budget_fresh_warm "* ]]; then
    run_bench_exe 60 demote_bench --host-write-only --gib 16 --host-write-passes 3
    for run in fresh warm; do
      run_script "gpu_budget ($run)" 240 "budget-$run.log" scripts/gpu-budget.sh \
        LABEL="budget-$run"
    done
    run_bench_exe 60 demote_bench --host-write-only --gib 16 --host-write-passes 2
  fi
  # Issue 19 on one GPU: a 16 GB gpu-tier cache filled from another daemon's device memory
  # over UCX's CUDA support, against D2D and the page-cache load of the same run
  # (scripts/gpu-fill.sh; its lines in summary.txt start with "fill:"). BENCHES names it
  # "gpu_fill"; it needs the fleet built with a CUDA-enabled UCX (staged, above).
  if [[ -z ${BENCHES:-} || " $BENCHES " == *" gpu_fill "* ]]; then
    if [[ -z $ucx_prefix ]]; then
      say "bench gpu_fill: skipped (no CUDA-enabled UCX staged: scripts/stage-device-deps.sh)"
    else
      run_script gpu_fill 300 fill.log scripts/gpu-fill.sh
    fi
  fi
  # Issue 18 on two GPUs: GPU 1's cache seeded from GPU 0's over NVLink, whole and TP=2 rank
  # for rank, against P2P, the page-cache and the disk load of the same run
  # (scripts/gpu-seed.sh; its lines in summary.txt start with "seed:"; with one GPU it says
  # "skipped"). BENCHES names it "gpu_seed".
  if [[ -z ${BENCHES:-} || " $BENCHES " == *" gpu_seed "* ]]; then
    run_script gpu_seed 300 seed.log scripts/gpu-seed.sh
  fi
  # Issue 39 sections 1 and 2: page cache to GPU beside InstantTensor on the same checkpoint,
  # the restart after kill -9, and the pipeline's shape over the same files
  # (scripts/gpu-pagecache.sh; its lines in summary.txt start with "pagecache:"). BENCHES
  # names it "pagecache"; it needs the InstantTensor wheel staged in .deps/it.
  if [[ -z ${BENCHES:-} || " $BENCHES " == *" pagecache "* ]]; then
    run_script pagecache 420 pagecache.log scripts/gpu-pagecache.sh
  fi
  # Issue 16 at full size: three 16 GB caches under a 40 GB gpu budget, demotion, promotion
  # and a verified attach, with real daemons and the CLI (scripts/gpu-budget.sh; its lines in
  # summary.txt start with "budget:"). BENCHES names it "gpu_budget".
  if [[ -z ${BENCHES:-} || " $BENCHES " == *" gpu_budget "* ]]; then
    run_script gpu_budget 240 budget.log scripts/gpu-budget.sh
  fi

  if grep -q '"error"' "$OUT/bench.jsonl"; then
    say "bench errors:"
    grep '"error"' "$OUT/bench.jsonl" | head -5 | tee -a "$summary"
  fi
  # The headline numbers of every bench, one line per measurement (docs/benchmarks.md).
  python3 - "$OUT/bench.jsonl" <<'PY' | tee -a "$summary" || true
import json, sys

def fmt(v):
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)

def mib(v):
    return None if v is None else f"{v / 2**20:.1f} MiB"

def pick(j, *path):
    for p in path:
        if not isinstance(j, dict) or p not in j:
            return None
        j = j[p]
    return j

def top(j, *path, n=4):
    # "[libcuda.so.1 60.1 MiB, [anon] 30.2 MiB, ...]": the mappings with the most Rss.
    maps = pick(j, *path)
    if not isinstance(maps, list):
        return None
    return "[" + ", ".join(f"{m['name'].rsplit('/', 1)[-1]} {mib(m['rss'])}"
                           for m in maps[:n]) + "]"

def memory(j, where):
    # RSS and the kernel's anon/file/shmem split of one ProcMemory snapshot (bench/proc_memory.h).
    st = pick(j, *where, "status") or {}
    return [("rss_" + where[-1], mib(st.get("VmRSS"))), ("anon", mib(st.get("RssAnon"))),
            ("file", mib(st.get("RssFile"))), ("shmem", mib(st.get("RssShmem"))),
            ("top", top(j, *where, "top_mappings"))]

for line in open(sys.argv[1]):
    try:
        j = json.loads(line)
    except ValueError:
        continue
    b = j.get("bench", "?")
    extra = None
    if "skipped" in j or "error" in j or "client_error" in j:
        items = [("kind", j.get("kind")), ("phase", j.get("phase")),
                 ("tensors", j.get("tensors")),
                 ("skipped", j.get("skipped")), ("error", j.get("error")),
                 ("client_error", j.get("client_error"))]
    elif b == "load_bench":
        items = [("kind", j.get("kind")), ("cache", j.get("cache")), ("path", j.get("path")),
                 ("files", j.get("files")), ("bytes", j.get("bytes")),
                 ("threads", j.get("reader_threads")), ("buffers", j.get("staging_buffers")),
                 ("buffer_mib", j.get("staging_buffer_mib")), ("streams", j.get("copy_streams")),
                 ("checksums", j.get("checksums")), ("rep", j.get("rep")),
                 ("read_gb_per_s", j.get("read_gb_per_s")), ("h2d_gb_per_s", j.get("h2d_gb_per_s")),
                 ("gb_per_s", j.get("gb_per_s")), ("limit_gb_per_s", j.get("limit_gb_per_s")),
                 ("ratio", j.get("ratio")), ("target_ratio", j.get("target_ratio")),
                 ("matches_pipeline", j.get("matches_pipeline"))]
    elif b == "attach":
        items = [("kind", j.get("kind")), ("tensors", j.get("tensors")),
                 ("allocations", j.get("allocations")),
                 ("import_ms_median", j.get("import_ms_median")),
                 ("open_ms", j.get("open_ms")), ("open_us_per_handle", j.get("open_us_per_handle")),
                 ("cuinit_ms", j.get("cuinit_ms")), ("primary_ctx_ms", j.get("primary_ctx_ms")),
                 ("create_export_ms", j.get("create_export_ms"))]
    elif b == "host_attach":
        items = [("tensors", j.get("tensors")),
                 ("attach_ms", pick(j, "fingerprint_given", "median_ms")),
                 ("attach_ms_fingerprint_computed", pick(j, "fingerprint_computed", "median_ms"))]
    elif b == "host_load":
        items = [("file_read_gbps", j.get("file_read_gbps")),
                 ("daemon_load_gbps", j.get("daemon_load_gbps")), ("ratio", j.get("ratio"))]
    elif b == "host_memory":
        items = [("bytes", j.get("bytes")),
                 ("load_rss_released", mib(pick(j, "load_memory", "released", "rss"))),
                 ("system_shmem_growth", mib(j.get("system_shmem_growth_bytes")))]
        items += memory(j, ("steady",))
    elif b == "gpu_attach":
        items = [("tensors", j.get("tensors")),
                 ("attach_ms", pick(j, "attach_ms", "median")),
                 ("attach_ms_p90", pick(j, "attach_ms", "p90")),
                 ("attach_ms_fingerprint_computed",
                  pick(j, "attach_ms_fingerprint_computed", "median")),
                 ("cuinit_ms", j.get("cuinit_ms")), ("primary_ctx_ms", j.get("primary_ctx_ms")),
                 ("gb_per_s", j.get("gb_per_s")), ("pipeline_gb_per_s", j.get("pipeline_gb_per_s")),
                 ("overhead", mib(j.get("overhead_bytes"))),
                 ("overhead_vs_weights", j.get("overhead_vs_weights")),
                 ("rss", mib(j.get("rss_bytes"))), ("hwm", mib(j.get("hwm_bytes"))),
                 ("verify_ok", j.get("verify_ok"))]
        # The daemon's host memory, second line: its own log (with the pipeline, after freeing
        # it, after malloc_trim), then at ready and in steady state with the breakdown.
        mem = [("load_rss_pipeline", mib(pick(j, "load_memory", "pipeline", "rss"))),
               ("load_rss_pipeline_freed", mib(pick(j, "load_memory", "pipeline_freed", "rss"))),
               ("load_rss_released", mib(pick(j, "load_memory", "released", "rss"))),
               ("rss_at_ready", mib(pick(j, "memory", "at_ready", "status", "VmRSS")))]
        mem += memory(j, ("memory", "steady"))
        mem.append(("threads", pick(j, "memory", "steady", "status", "Threads")))
        extra = "  gpu_attach memory: " + ", ".join(f"{k}={fmt(v)}" for k, v in mem if v is not None)
    elif b == "shard_load":
        # The phases' details stay in bench.jsonl; the result line has the headline.
        if j.get("phase") != "result":
            continue
        items = [("tp", j.get("tp")), ("whole_median_s", j.get("whole_ready_s_median")),
                 ("tp_median_s", j.get("tp_all_ready_s_median")),
                 ("ratio", j.get("all_ready_over_whole")), ("bound", j.get("time_bound")),
                 ("within_time_bound", j.get("within_time_bound")),
                 ("file_read_gb_per_s", j.get("file_read_gb_per_s")),
                 ("whole_load_gb_per_s", j.get("whole_load_gb_per_s"))]
        ranks = j.get("ranks") or []
        extra = ("  shard_load memory (used/bound): " +
                 ", ".join(f"rank {r.get('rank')} {mib(r.get('used_bytes'))}"
                           f"/{mib(r.get('bound_bytes'))}" for r in ranks) +
                 f", within_memory_bound={j.get('within_memory_bound')}")
    elif b == "restart":
        # The phases' details (each restart's ready line, each upgrade's windows) stay in
        # bench.jsonl; the floor and result lines are the headline.
        if j.get("phase") == "floor":
            items = [("context_process_median_ms", j.get("median_ms"))]
        elif j.get("phase") == "result":
            items = [("bytes", j.get("bytes")), ("adopt_verify", j.get("adopt_verify")),
                     ("restart_ready_ms", j.get("restart_ready_ms")),
                     ("within_ready_target", j.get("within_ready_target")),
                     ("upgrade_window_ms", j.get("upgrade_window_ms")),
                     ("within_window_target", j.get("within_window_target"))]
        else:
            continue
    else:
        items = list(j.items())[:8]
    print("  " + b + ": " + ", ".join(f"{k}={fmt(v)}" for k, v in items if v is not None))
    if extra:
        print(extra)
PY
fi

elapsed=$(($(date +%s) - start))
if ((tests_ok && bench_ok)); then
  say "== gpu suite ($suite, $gpus GPUs): PASS in ${elapsed} s (logs in $OUT)"
  exit 0
fi
say "== gpu suite ($suite, $gpus GPUs): FAIL in ${elapsed} s (tests ok: $tests_ok, benches ok: $bench_ok; logs in $OUT)"
exit 1
