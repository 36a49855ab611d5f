"""The built wheel, installed into a fresh venv (python -m venv, nothing else in it), works on
its own: the `weightcache` CLI it puts in the venv's bin/ serves a host-tier checkpoint written
by the real safetensors library, attaches to it with --verify and stops it; the venv's Python
imports the package from the venv and reads the daemon's bytes through the API.

scripts/test.sh builds the wheel once (python -m build --wheel) and passes its path in
WEIGHTCACHE_WHEEL; the same wheel is what the rest of this tier runs against."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import make_checkpoint

WHEEL = os.environ.get("WEIGHTCACHE_WHEEL")

pytestmark = pytest.mark.skipif(
    not WHEEL, reason="WEIGHTCACHE_WHEEL (the built wheel's path) is unset: scripts/test.sh sets it")

# Runs inside the venv: attach to the daemon only (no fallback), print each tensor's SHA-256
# of raw() — the bytes in the daemon's memory — and where the package was imported from.
ATTACH_SCRIPT = r"""
import hashlib, json, sys
import weightcache
att = weightcache.attach(sys.argv[1], tier="host", runtime_dir=sys.argv[2], on_missing="error",
                         wait_timeout=60)
out = {"file": weightcache.__file__, "cli": weightcache.cli_path(), "source": att.source,
       "sha256": {t.name: hashlib.sha256(memoryview(t.raw()).tobytes()).hexdigest()
                  for t in att.tensors()}}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    """A fresh venv with the wheel installed and nothing else (no index, no dependencies)."""
    root = tmp_path_factory.mktemp("venv") / "env"
    subprocess.run([sys.executable, "-m", "venv", str(root)], check=True)
    py = root / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "--no-index", "--no-deps", "-q",
                    "--disable-pip-version-check", WHEEL], check=True)
    return root


def run(args, cwd, **kw):
    return subprocess.run([str(a) for a in args], cwd=cwd, capture_output=True, text=True, **kw)


def test_cli_help_from_the_venv(venv, tmp_path):
    r = run([venv / "bin" / "weightcache", "--help"], tmp_path)
    assert r.returncode == 0, r.stderr
    for command in ("serve", "attach", "stop", "ls", "verify"):
        assert command in r.stdout


def test_serve_attach_stop_and_the_python_api_from_the_venv(venv, tmp_path, runtime_dir):
    manifest = make_checkpoint(tmp_path / "tiny", tensors=24, dtypes="all", shards=2, seed=5)
    runtime = Path(runtime_dir)
    wc = venv / "bin" / "weightcache"
    ident = ["--model", tmp_path / "tiny", "--tier", "host", "--runtime-dir", runtime]
    paths = run([wc, "paths", *ident, "--json"], tmp_path)
    assert paths.returncode == 0, paths.stderr
    socket = Path(json.loads(paths.stdout)["socket"])

    log = open(tmp_path / "serve.log", "wb")
    daemon = subprocess.Popen([str(a) for a in (wc, "serve", *ident)], cwd=tmp_path,
                              stdout=log, stderr=subprocess.STDOUT)
    try:
        # The socket appears once the daemon holds its lock; attach --wait then waits for ready.
        deadline = time.monotonic() + 60
        while not socket.exists():
            assert daemon.poll() is None, (tmp_path / "serve.log").read_text()
            assert time.monotonic() < deadline, "no socket: " + (tmp_path / "serve.log").read_text()
            time.sleep(0.05)
        att = run([wc, "attach", *ident, "--wait", "60", "--on-missing", "error", "--verify"],
                  tmp_path)
        assert att.returncode == 0, att.stdout + att.stderr

        api = run([venv / "bin" / "python", "-c", ATTACH_SCRIPT, tmp_path / "tiny", runtime],
                  tmp_path)
        assert api.returncode == 0, api.stderr
        got = json.loads(api.stdout)
        # The venv's own copy of the package and of the CLI, not the source tree's or the
        # outer environment's.
        assert Path(got["file"]).resolve().is_relative_to(venv.resolve()), got["file"]
        assert Path(got["cli"]).resolve() == wc.resolve()
        assert got["source"] == "daemon"
        assert got["sha256"] == {name: t["sha256"] for name, t in manifest.items()}

        stop = run([wc, "stop", *ident], tmp_path)
        assert stop.returncode == 0, stop.stdout + stop.stderr
        assert daemon.wait(timeout=60) == 0, (tmp_path / "serve.log").read_text()
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait()
        log.close()

