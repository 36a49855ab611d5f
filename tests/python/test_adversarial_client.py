"""Issue 10 at the Python edge (the C++ half is tests/adversarial/client_adversarial_test.cc).

* Item 9: one table (the C++ library's) decides each status code's exception class and exit
  code; ``exit_code`` agrees with the CLI for every code, and a daemon's failure code reaches
  Python as that code's exception.
* Item 14: an ``on_daemon_gone`` callback that refers to its own Attachment is a reference
  cycle; Python's GC collects it, and with it the client's fds, its watcher thread and its
  connection (the daemon's client count).
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import time

import pytest

import weightcache
from weightcache import _weightcache
from weightcache.errors import from_status

# docs/design.md "Exit codes", written out here rather than read from the table under test:
# key → (exit code, exception class name).
SPEC = {
    "ok": (0, ""),
    "invalid_argument": (2, "InvalidArgumentError"),
    "not_found": (1, "WeightcacheError"),
    "permission_denied": (1, "PermissionDeniedError"),
    "invalid_checkpoint": (5, "InvalidCheckpointError"),
    "no_daemon": (3, "NoDaemonError"),
    "mismatch": (4, "MismatchError"),
    "timeout": (6, "DaemonTimeoutError"),
    "already_served": (7, "AlreadyServedError"),
    "protocol": (1, "ProtocolError"),
    "io": (1, "WeightcacheError"),
    "cuda": (1, "WeightcacheError"),
    "unavailable": (1, "UnavailableError"),
    "out_of_memory": (8, "OutOfMemoryError"),
    "internal": (1, "WeightcacheError"),
}


def test_every_status_code_has_the_clis_exit_code_and_its_class():
    table = _weightcache.status_codes()
    assert [row[2] for row in table] == list(SPEC), "one row per code, in value order"
    for value, name, key, exit_code, cls in table:
        assert (exit_code, cls) == SPEC[key], key
        if value == 0:
            continue
        e = from_status(name, "message")
        assert type(e).__name__ == cls, key
        assert e.code == key
        assert e.exit_code == exit_code == SPEC[key][0], key
        assert type(e).exit_code == exit_code or cls == "WeightcacheError", key
        assert isinstance(e, weightcache.WeightcacheError)


def _ls(runtime_dir):
    out = subprocess.run([weightcache.cli_path(), "ls", "--json", "--runtime-dir", runtime_dir],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out)["caches"]


def test_a_failed_daemon_reaches_python_with_its_code_and_the_clis_exit_code(
        checkpoint, runtime_dir, tmp_path):
    model_dir, _ = checkpoint
    d = subprocess.Popen(
        [weightcache.cli_path(), "serve", "--model", str(model_dir), "--tier", "host",
         "--runtime-dir", runtime_dir, "--memory-budget", "1", "--failed-linger", "60"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not any(c.get("state") == "failed" for c in _ls(runtime_dir)):
            assert d.poll() is None, f"serve exited {d.returncode}"
            assert time.monotonic() < deadline, _ls(runtime_dir)
            time.sleep(0.05)
        with pytest.raises(weightcache.OutOfMemoryError) as info:
            weightcache.attach(model_dir, tier="host", runtime_dir=runtime_dir,
                               on_missing="error")
        e = info.value
        assert e.code == "out_of_memory" and e.exit_code == 8
        assert f"(pid {d.pid}) failed: out of memory: " in str(e)
        cli = subprocess.run([weightcache.cli_path(), "attach", "--model", str(model_dir),
                              "--tier", "host", "--runtime-dir", runtime_dir, "--on-missing",
                              "error"], capture_output=True, text=True)
        assert cli.returncode == e.exit_code, cli.stderr

        att = weightcache.attach(model_dir, tier="host", runtime_dir=runtime_dir)
        assert att.source == "fallback"
        assert f"(pid {d.pid}) failed: out of memory: " in att.source_reason
    finally:
        d.kill()
        d.wait(timeout=30)


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))  # the client's watcher threads are not Python's


def _clients(runtime_dir) -> int:
    (cache,) = _ls(runtime_dir)
    return cache["clients"]


def test_a_callback_that_refers_to_its_attachment_is_collected(checkpoint, runtime_dir, serve):
    model_dir, _ = checkpoint
    serve(model_dir)
    gc.collect()
    fds, threads, clients = _fds(), _threads(), _clients(runtime_dir)

    for _ in range(50):
        att = weightcache.attach(model_dir, tier="host", runtime_dir=runtime_dir)
        assert att.source == "daemon", att.source_reason
        # Refers to its own attachment: att → callback → att. And through a tensor too.
        att.on_daemon_gone(lambda att=att: print("daemon gone", att.daemon_pid))
        tensor = next(iter(att.tensors()))
        att.on_daemon_gone(lambda tensor=tensor: print("daemon gone", tensor.name))
    assert _threads() >= threads + 50
    assert _clients(runtime_dir) == clients + 50
    del att, tensor
    gc.collect()

    assert _fds() == fds
    assert _threads() == threads
    # The daemon learns of each closed connection by itself; wait for it to count them.
    deadline = time.monotonic() + 30
    while _clients(runtime_dir) != clients and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _clients(runtime_dir) == clients
