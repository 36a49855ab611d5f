"""Starting a daemon from the publisher (docs/python.md "Publishing"): publish(..., spawn=True)
runs `weightcache serve --source published:<tag> --detach`, publishes into it, and leaves this
process with no child and no new fd; a daemon that fails to start raises the exception of its
exit code."""

from __future__ import annotations

import os
import subprocess

import numpy as np
import pytest

import weightcache
from weightcache.spawn import serve_detached

SOURCE = "published:py-spawn-v1"
MODEL_ID = "py-spawned"


def _fds():
    return sorted(os.listdir("/proc/self/fd"))


def _no_children():
    try:
        os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return True
    return False


@pytest.fixture
def stop_all(runtime_dir):
    yield runtime_dir
    subprocess.run([weightcache.cli_path(), "stop", "--all", "--runtime-dir", runtime_dir,
                    "--timeout", "30"], check=False, capture_output=True)


def test_publish_spawns_the_daemon_then_a_second_publish_finds_it(stop_all):
    runtime_dir = stop_all
    rng = np.random.default_rng(3)
    tensors = {"qkv_proj.weight": rng.standard_normal((48, 16), dtype=np.float32),
               "gate_up_proj.weight": rng.standard_normal((32, 16)).astype(np.float16)}
    fds = _fds()
    count = weightcache.publish(tensors, source=SOURCE, tier="host", model_id=MODEL_ID,
                                runtime_dir=runtime_dir, spawn=True)
    assert count == 2
    assert _no_children()
    assert _fds() == fds

    att = weightcache.attach("unused", tier="host", source=SOURCE, model_id=MODEL_ID,
                             runtime_dir=runtime_dir, on_missing="error", wait_timeout=10)
    assert att.source == "daemon"
    for name, want in tensors.items():
        np.testing.assert_array_equal(weightcache.numpy_views(att)[name], want)
    # The daemon serves now: spawn finds it (exit 7 is "use that one"), and the ready cache
    # refuses a second publish with its own error, not a spawn failure.
    with pytest.raises(weightcache.AlreadyServedError, match="already ready"):
        weightcache.publish(tensors, source=SOURCE, tier="host", model_id=MODEL_ID,
                            runtime_dir=runtime_dir, spawn=True)
    assert _no_children()


def test_serve_detached_reports_the_socket_and_pid_of_an_awaiting_daemon(stop_all):
    info = serve_detached(source=SOURCE, tier="host",
                          identity={"model_id": MODEL_ID, "runtime_dir": stop_all})
    assert info is not None and info["state"] == "ready"
    assert info["socket"].startswith(stop_all)
    assert os.path.exists(f"/proc/{info['pid']}")
    with pytest.raises(weightcache.DaemonTimeoutError, match="awaiting its publisher"):
        weightcache.attach("unused", tier="host", source=SOURCE, model_id=MODEL_ID,
                           runtime_dir=stop_all, on_missing="error", wait_timeout=0.05)
    assert serve_detached(source=SOURCE, tier="host",
                          identity={"model_id": MODEL_ID, "runtime_dir": stop_all}) is None


def test_a_daemon_that_fails_to_start_raises_its_exit_codes_exception(stop_all, checkpoint):
    model_dir, _ = checkpoint
    fds = _fds()
    with pytest.raises(weightcache.OutOfMemoryError, match="memory budget") as e:
        serve_detached(source="disk", tier="host", identity={"runtime_dir": stop_all},
                       extra_args=["--model", str(model_dir), "--memory-budget", "1K",
                                   "--failed-linger", "0", "--no-keeper"])
    assert e.value.exit_code == 8
    assert _no_children()
    assert _fds() == fds


def test_a_bad_identity_is_refused_before_anything_starts(stop_all):
    with pytest.raises(weightcache.InvalidArgumentError, match="no model id") as e:
        weightcache.publish({"w": np.zeros(4, np.float32)}, source=SOURCE, tier="host",
                            runtime_dir=stop_all, spawn=True)
    assert e.value.exit_code == 2
