#!/usr/bin/env bash
# clang-tidy (.clang-tidy at the root) over the project's own sources: src/, tools/,
# python/src/, and through them the headers of include/weightcache/. Any finding fails (exit 1).
#   scripts/tidy.sh                     # every source; build-tidy/ holds the compile commands
#   scripts/tidy.sh src/identity tools  # only sources under these folders
#   BUILD_DIR=...  JOBS=N  are honoured.
# Only a configure is needed, no build: no project source includes a generated header (the one
# generated source, the embedded checksum fatbin, is data and is not linted). The CUDA kernel
# (src/cuda/kernels/*.cu) is compiled by nvcc, has no compile command and is not linted.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
export PATH="$PATH:/usr/local/cuda/bin"
build=${BUILD_DIR:-build-tidy}
jobs=${JOBS:-$(nproc)}

if ! command -v clang-tidy >/dev/null; then
  echo "tidy: apt-get install clang-tidy"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends clang-tidy >/dev/null
fi

start=$(date +%s)
# The Python extension is configured too, so that python/src/ has compile commands.
mkdir -p "$build"
cmake -S . -B "$build" -G Ninja -DCMAKE_EXPORT_COMPILE_COMMANDS=ON -DWEIGHTCACHE_BUILD_PYTHON=ON \
  >"$build/tidy-configure.log" 2>&1 || { cat "$build/tidy-configure.log"; exit 1; }

dirs=("$@")
((${#dirs[@]})) || dirs=(src tools python/src)
mapfile -t files < <(python3 - "$build/compile_commands.json" "$root" "${dirs[@]}" <<'EOF'
import json, os, sys
db, root, dirs = sys.argv[1], sys.argv[2], sys.argv[3:]
prefixes = tuple(os.path.join(root, d.rstrip("/")) + "/" for d in dirs)
files = {os.path.normpath(os.path.join(e["directory"], e["file"])) for e in json.load(open(db))}
print("\n".join(sorted(f for f in files if f.startswith(prefixes))))
EOF
)
if ((${#files[@]} == 0)); then
  echo "tidy: no sources under ${dirs[*]} in $build/compile_commands.json" >&2
  exit 1
fi
# Clang's thread-safety analysis (common/mutex.h annotations) runs as part of the lint:
# --extra-arg below adds -Wthread-safety, so a guarded member touched without its mutex is a
# finding. First prove the analysis is live: a known violation must fail to compile.
if clang++ -std=c++20 -fsyntax-only -Wthread-safety -Werror -I"$root/src" \
     "$root/tests/static/thread_safety_violation.cc" >/dev/null 2>&1; then
  echo "tidy: tests/static/thread_safety_violation.cc compiled: the thread-safety analysis" \
    "is not working" >&2
  exit 1
fi
echo "tidy: $(clang-tidy --version | grep -o 'version [0-9.]*'), ${#files[@]} files, $jobs jobs"

# One clang-tidy per file, its output printed in one piece when it has findings. .clang-tidy
# makes every warning an error (WarningsAsErrors); a "warning:" in the output also fails, so a
# clang-tidy that ignores that setting cannot pass silently.
lint_one() {
  local out rc=0
  out=$(clang-tidy -p "$TIDY_BUILD" --quiet --extra-arg=-Wthread-safety \
          --header-filter="^$TIDY_ROOT/(src|tools|include/weightcache|python/src)/" "$1" 2>&1) ||
    rc=$?
  if ((rc != 0)) || grep -qE '(warning|error):' <<<"$out"; then
    printf '== %s\n%s\n' "${1#"$TIDY_ROOT"/}" "$out"
    return 1
  fi
}
export -f lint_one
export TIDY_BUILD=$build TIDY_ROOT=$root
status=0
printf '%s\n' "${files[@]}" | xargs -P "$jobs" -I{} bash -c 'lint_one "$1"' _ {} || status=1
elapsed=$(($(date +%s) - start))
if ((status != 0)); then
  echo "tidy: FAILED (findings above; fix them, or see .clang-tidy for why a check is off) " \
    "in ${elapsed} s" >&2
  exit 1
fi
echo "tidy: clean in ${elapsed} s"
