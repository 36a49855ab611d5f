#!/usr/bin/env bash
# Build weightcache and run every test tier that needs no GPU (unit, integration, the SDK
# consumers, python).
#   scripts/test.sh                                         # build/ , all CPU tiers
#   BUILD_DIR=build-asan SANITIZE=address,undefined scripts/test.sh
#   UNITY=OFF scripts/test.sh        # one object per source file (faster incremental rebuilds)
set -euo pipefail
cd "$(dirname "$0")/.."
# CMake's unity build (scripts/build.sh UNITY): each target's sources in batches of 8, which
# saves CI minutes on every tree it builds. A source of src/, tools/ or python/src/ that does not
# include what it uses still fails CI: clang-tidy compiles each of them alone (scripts/tidy.sh).
UNITY=${UNITY:-ON} scripts/build.sh
build=${BUILD_DIR:-build}
ctest --test-dir "$build" -LE gpu --output-on-failure -j "${JOBS:-$(nproc)}" --timeout 300
# The SDK (docs/sdk.md): install this build dir into a temporary prefix, build the C
# (pkg-config) and C++ (find_package) consumers against it, run them and the ctypes smoke test
# against a daemon of the installed CLI. Not under sanitizers (the consumers would need them).
if [[ -z ${SANITIZE:-} ]]; then
  BUILD_DIR=$build scripts/sdk-check.sh
  # The GPU scripts of the fleet fill and of seeding (scripts/gpu-fill.sh, gpu-seed.sh)
  # rehearsed on the host tier over fake GPUs: their own steps and checks, so that they do not
  # rot between the device calls that run them.
  for script in gpu-fill gpu-seed; do
    rehearsal=$(mktemp -d)
    if ! DRY_RUN=host BUILD_DIR=$build OUT=$rehearsal "scripts/$script.sh" >/dev/null; then
      cat "$rehearsal"/*.txt "$rehearsal"/*.log >&2
      echo "test.sh: DRY_RUN=host scripts/$script.sh failed" >&2
      exit 1
    fi
    rm -rf "$rehearsal"
  done
fi
# The Python tier: one wheel (python -m build, its own incremental build dir build-python/,
# pyproject.toml), installed here for pytest; tests/python/test_wheel.py installs the same
# wheel into a fresh venv. Once per CI run: the sanitizer pass (SANITIZE set) skips it — the
# extension is not built with sanitizers.
if [[ -z ${SANITIZE:-} ]]; then
  dist=$build/dist
  rm -rf "$dist"
  if ! python3 -m build --wheel --no-isolation --outdir "$dist" . >"$build/wheel-build.log" 2>&1; then
    tail -n 40 "$build/wheel-build.log"
    echo "test.sh: python -m build --wheel failed (log: $build/wheel-build.log)" >&2
    exit 1
  fi
  wheel=$(realpath "$dist"/weightcache-*.whl)
  python3 -m pip install --disable-pip-version-check --no-deps --force-reinstall "$wheel" \
    >"$build/pip-install.log" 2>&1 ||
    { tail -n 40 "$build/pip-install.log"; echo "test.sh: pip install $wheel failed" >&2; exit 1; }
  WEIGHTCACHE_WHEEL=$wheel python3 -m pytest -q -rs tests/python
fi
