"""The wheel is a release build (issue 39 §13): the WEIGHTCACHE_TEST_* test hooks are compiled
out of it (pyproject.toml sets WEIGHTCACHE_TEST_HOOKS=OFF; src/common/test_hooks.h). A daemon of
the installed CLI started with WEIGHTCACHE_TEST_LOADED_FIFO naming a FIFO gets ready without
ever opening it, where a build with the hooks holds its loader on that FIFO."""

import errno
import os
import subprocess
import time

import pytest

import weightcache


def test_the_wheels_cli_ignores_the_test_hooks(checkpoint, runtime_dir, tmp_path):
    model_dir, _ = checkpoint
    fifo = tmp_path / "loaded.fifo"
    os.mkfifo(fifo)
    env = dict(os.environ, WEIGHTCACHE_TEST_LOADED_FIFO=str(fifo))
    log_path = tmp_path / "serve.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [weightcache.cli_path(), "serve", "--model", str(model_dir), "--tier", "host",
             "--runtime-dir", runtime_dir, "--no-keeper"],
            env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            while True:
                assert proc.poll() is None, log_path.read_text(errors="replace")
                # A loader that honours the hook holds the FIFO's read end: a non-blocking open
                # of the write end then succeeds (ENXIO while nobody reads it).
                try:
                    fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
                except OSError as err:
                    assert err.errno == errno.ENXIO, err
                else:
                    os.close(fd)
                    pytest.fail("the daemon opened WEIGHTCACHE_TEST_LOADED_FIFO: this build "
                                "honours the test hooks")
                try:
                    a = weightcache.attach(str(model_dir), tier="host", runtime_dir=runtime_dir,
                                           on_missing="error", wait_timeout=0)
                except (weightcache.NoDaemonError, weightcache.DaemonTimeoutError):
                    time.sleep(0.05)
                    continue
                assert a.source == "daemon"
                break
        finally:
            proc.kill()
            proc.wait(timeout=30)
