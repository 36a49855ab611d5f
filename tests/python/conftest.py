"""Fixtures of the Python tier: real checkpoints (tests/tools/make_checkpoint.py, written by the
real safetensors library), real `weightcache serve --tier host` daemons in a private runtime
dir, and the installed package (`pip install .`). No GPU needed."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

import weightcache

ROOT = Path(__file__).resolve().parents[2]
MAKE_CHECKPOINT = ROOT / "tests" / "tools" / "make_checkpoint.py"


def import_tool(module: str):
    """A module a test needs beyond the package (prometheus_client): the test skips without it,
    unless WEIGHTCACHE_REQUIRE_TOOLS is set (.ci/run sets it: CI installs them), where a missing
    one is an error, as for the C++ tests (tests/support/test_env.h ToolsRequired)."""
    if os.environ.get("WEIGHTCACHE_REQUIRE_TOOLS") is not None:
        import importlib
        return importlib.import_module(module)
    return pytest.importorskip(module)


def make_checkpoint(out: Path, *, tensors: int = 30, dtypes: str = "all", shards: int = 2,
                    seed: int = 1) -> dict:
    """Writes a checkpoint into `out`; returns its manifest (per tensor dtype, shape, nbytes,
    file and the SHA-256 of the bytes the reference reader returns)."""
    manifest = out.parent / (out.name + ".manifest.json")
    subprocess.run([sys.executable, str(MAKE_CHECKPOINT), "--out", str(out), "--tensors",
                    str(tensors), "--dtypes", dtypes, "--shards", str(shards), "--seed",
                    str(seed), "--manifest", str(manifest)], check=True,
                   stdout=subprocess.DEVNULL)
    return json.loads(manifest.read_text())["tensors"]


def _private_dir(prefix: str):
    # Short and private: socket paths must stay under sun_path's 107 bytes, and the runtime
    # dir must be 0700 and ours (docs/design.md "Paths") — pytest's tmp_path can be long.
    d = tempfile.mkdtemp(prefix=prefix)
    os.chmod(d, 0o700)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def runtime_dir():
    yield from _private_dir("wcpy-")


@pytest.fixture
def empty_runtime_dir():
    """A second runtime dir where no daemon runs: an attach there loads from disk."""
    yield from _private_dir("wcpy-none-")


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """(model_dir, manifest) of every safetensors dtype, two shards."""
    out = tmp_path_factory.mktemp("ckpt") / "tiny-all-dtypes"
    manifest = make_checkpoint(out)
    return out, manifest


class Daemon:
    """A `weightcache serve` process; killed (SIGKILL) at teardown if still running."""

    def __init__(self, model_dir, runtime_dir, log_path, args=()):
        self.model_dir = str(model_dir)
        self.runtime_dir = runtime_dir
        self.log_path = log_path
        self.log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [weightcache.cli_path(), "serve", "--model", self.model_dir, "--tier", "host",
             "--runtime-dir", runtime_dir, *args],
            stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout=60.0, **identity):
        """Polls like an engine would: attach with on_missing="error" until it succeeds."""
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"serve exited {self.proc.returncode}: {self.log_text()}")
            try:
                weightcache.attach(self.model_dir, tier="host", runtime_dir=self.runtime_dir,
                                   on_missing="error", wait_timeout=timeout, **identity)
                return
            except weightcache.NoDaemonError:
                if time.monotonic() > deadline:
                    raise AssertionError(f"daemon never ready: {self.log_text()}")
                time.sleep(0.05)

    def kill(self, sig=signal.SIGKILL):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        self.proc.wait(timeout=30)

    def log_text(self) -> str:
        self.log.flush()
        return Path(self.log_path).read_text(errors="replace")

    def close(self):
        self.kill()
        self.log.close()


@pytest.fixture
def serve(runtime_dir, tmp_path):
    """serve(model_dir, *args) → a ready Daemon on the host tier in `runtime_dir`."""
    daemons = []

    def start(model_dir, *args, identity=None):
        d = Daemon(model_dir, runtime_dir, tmp_path / f"serve{len(daemons)}.log", args)
        daemons.append(d)
        d.wait_ready(**(identity or {}))
        return d

    yield start
    for d in daemons:
        d.close()
