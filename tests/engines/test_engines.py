"""vLLM and SGLang, real engines on CPU, loading through `--load-format weightcache` (the
plugins of weightcache.integrations): tokens equal to the engine's own disk load, a hit the
second time by the daemon's own counters, and the failure semantics (a daemon killed between
starts, a change of dtype, a hung daemon, strict mode). docs/engines.md."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from conftest import cli, daemon_pids, kill9, outcome

ENGINES = ["vllm", "sglang"]


def same_generation(a, b, *, exact: bool = True) -> None:
    """The same tokens, and the same logprobs: bit for bit, or (exact=False) to 1e-4.

    exact=False is for float32 on SGLang's CPU backend only: two of its disk loads of one
    checkpoint gave logprobs 2e-6 apart in CI (its float32 GEMMs are not bit-reproducible
    from one process to the next), while the tokens matched."""
    assert a["tokens"] == b["tokens"]
    if exact:
        assert a["logprobs"] == b["logprobs"]
        return
    for row_a, row_b in zip(a["logprobs"], b["logprobs"], strict=True):
        assert row_a == pytest.approx(row_b, rel=0, abs=1e-4)


def only_cache(host):
    caches = host.caches()
    assert len(caches) == 1, caches
    return caches[0]


def hits_of(host, digest: str) -> int:
    for device in host.status()["devices"]:
        for cache in device["caches"]:
            if cache["digest"].startswith(digest[:16]):
                return int(cache["hits"])
    raise AssertionError(f"no cache {digest} in weightcache status")


@pytest.mark.parametrize("engine,model", [("vllm", "llama"), ("vllm", "qwen2"),
                                          ("sglang", "llama")])
def test_first_start_publishes_and_the_second_attaches_with_the_disk_loads_tokens(
        host, models, engine, model):
    disk, _ = host.start(engine, models[model], "safetensors")
    assert host.caches() == []  # the engine's own load format touches no daemon

    miss, log = host.start(engine, models[model], "weightcache")
    (line,) = outcome(log, engine)
    assert line.startswith("miss: no daemon at "), line
    assert "; loaded from disk; published " in line and "published:" in line, line
    same_generation(miss, disk)
    cache = only_cache(host)
    assert cache["state"] == "ready" and cache["tier"] == "host"
    assert cache["config"]["source"].startswith(f"published:{engine}-"), cache
    assert hits_of(host, cache["digest"]) == 0

    hit, log = host.start(engine, models[model], "weightcache")
    (line,) = outcome(log, engine)
    assert line.startswith("hit: attached "), line
    assert "loaded from disk" not in log.split("hit: attached ")[0][-2000:]
    same_generation(hit, disk)
    # The daemon's own counter, not the plugin's word.
    assert hits_of(host, cache["digest"]) == 1
    assert only_cache(host)["pid"] == cache["pid"]


@pytest.mark.parametrize("engine", ENGINES)
def test_a_daemon_killed_between_starts_means_a_disk_load_and_a_new_daemon(host, models,
                                                                            engine):
    first, _ = host.start(engine, models["llama"], "weightcache")
    (old,) = daemon_pids(host)
    kill9([old])
    time.sleep(0.2)
    again, log = host.start(engine, models["llama"], "weightcache")
    (line,) = outcome(log, engine)
    assert line.startswith("miss: "), line  # the stale socket is no daemon
    assert "published " in line, line
    same_generation(again, first)
    (new,) = daemon_pids(host)
    assert new != old


@pytest.mark.parametrize("engine", ENGINES)
def test_another_dtype_is_a_mismatch_naming_dtype_never_the_other_dtypes_tensors(
        host, models, engine):
    host.start(engine, models["llama"], "weightcache", dtype="bfloat16")
    f32, log = host.start(engine, models["llama"], "weightcache", dtype="float32")
    (line,) = outcome(log, engine)
    assert line.startswith("mismatch: "), line
    assert "dtype" in line and "bfloat16" in line and "float32" in line, line
    assert "; loaded from disk; published " in line, line
    # The float32 start published a cache of its own; the bfloat16 one is untouched.
    dtypes = sorted(c["config"]["dtype"] for c in host.caches())
    assert dtypes == ["bfloat16", "float32"], host.caches()
    disk32, _ = host.start(engine, models["llama"], "safetensors", dtype="float32")
    same_generation(f32, disk32, exact=engine != "sglang")


def test_a_start_killed_before_its_publish_leaves_a_daemon_the_next_start_publishes_to(
        host, models, tmp_path):
    # The fault: the engine's `weightcache serve --detach` (the real CLI) returns with its
    # daemon awaiting the publish, and the engine process that ran it is killed right there.
    then_kill = tmp_path / "weightcache-then-kill-9"
    then_kill.write_text(f"""#!/bin/sh
"{cli()}" "$@"
rc=$?
if [ "$1" = serve ]; then kill -9 $PPID; fi
exit $rc
""")
    then_kill.chmod(0o755)
    killed, log = host.start("vllm", models["llama"], "weightcache", expect_ok=False,
                             env={"WEIGHTCACHE_CLI": str(then_kill)})
    assert killed is None, log[-3000:]
    (cache,) = host.caches()
    assert cache["state"] == "awaiting", cache

    # The next start sees that nobody publishes to it: no wait (the default 30 s would say
    # "still awaiting its publisher after 30000 ms"), a disk load, and it is the next publisher.
    again, log = host.start("vllm", models["llama"], "weightcache")
    (line,) = outcome(log, "vllm")
    assert line.startswith("awaiting: ") and "awaits its publisher, and none is publishing" in \
        line, line
    assert "; loaded from disk; published " in line, line
    (cache,) = host.caches()
    assert cache["state"] == "ready", cache

    hit, log = host.start("vllm", models["llama"], "weightcache")
    (line,) = outcome(log, "vllm")
    assert line.startswith("hit: "), line
    same_generation(hit, again)


# The flags of run_engine.py's engines, as each engine's own command line takes them.
SERVE_FLAGS = {
    "vllm": lambda model: [model, "--dtype", "bfloat16", "--max-model-len", "128",
                           "--enforce-eager"],
    "sglang": lambda model: ["--model-path", model, "--dtype", "bfloat16", "--device", "cpu",
                             "--attention-backend", "torch_native", "--sampling-backend",
                             "pytorch", "--disable-cuda-graph", "--mem-fraction-static", "0.3",
                             "--context-length", "128"],
}


@pytest.mark.parametrize("engine", ENGINES)
def test_launch_pre_starts_the_daemons_the_first_start_publishes_into(host, models, engine):
    """`python -m weightcache.integrations.<engine> launch-args` prints the `weightcache
    launch` of the job's daemons from the engine's own config; launch returns once they await
    their publisher; the engine's first start publishes into them at once, the next one
    attaches."""
    flags = SERVE_FLAGS[engine](models["llama"])
    env = dict(host.env, VLLM_CPU_KVCACHE_SPACE="1")
    done = subprocess.run([sys.executable, "-m", f"weightcache.integrations.{engine}",
                           "launch-args", "--json", *flags], env=env, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    printed = json.loads(done.stdout.strip().splitlines()[-1])
    argv = printed["argv"]
    assert argv[:2] == ["weightcache", "launch"], argv
    assert printed["identity"]["dtype"] == "bfloat16", printed
    launched = subprocess.run([cli(), *argv[1:], "--json"], env=host.env,
                              stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=120, check=False)
    assert launched.returncode == 0, launched.stderr
    (cache,) = host.caches()
    assert cache["state"] == "awaiting", cache

    first, log = host.start(engine, models["llama"], "weightcache")
    (line,) = outcome(log, engine)
    assert line.startswith("awaiting: ") and "awaits its publisher, and none is publishing" in \
        line, line
    assert "; loaded from disk; published " in line, line
    (after,) = host.caches()
    assert after["state"] == "ready" and after["pid"] == cache["pid"], (cache, after)

    hit, log = host.start(engine, models["llama"], "weightcache")
    (line,) = outcome(log, engine)
    assert line.startswith("hit: "), line
    same_generation(hit, first)
    disk, _ = host.start(engine, models["llama"], "safetensors")
    same_generation(hit, disk)


@pytest.mark.parametrize("engine", ENGINES)
def test_launch_args_refuses_a_model_that_is_no_local_checkpoint(host, tmp_path, engine):
    flags = SERVE_FLAGS[engine](str(tmp_path / "no-such-model"))
    done = subprocess.run([sys.executable, "-m", f"weightcache.integrations.{engine}",
                           "launch-args", *flags], env=host.env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "launch-args: " in done.stderr and "no-such-model" in done.stderr, done.stderr[-3000:]


def test_strict_mismatch_stops_the_engine_with_the_fields(host, models):
    host.start("vllm", models["llama"], "weightcache", dtype="bfloat16")
    _, log = host.start("vllm", models["llama"], "weightcache", dtype="float32",
                        extra={"on_mismatch": "error"}, expect_ok=False)
    assert "MismatchError" in log, log[-3000:]
    assert "dtype" in log
    assert len(host.caches()) == 1  # nothing published


@pytest.mark.parametrize("engine", ENGINES)
def test_a_hung_daemon_costs_the_wait_then_a_disk_load(host, models, engine):
    first, _ = host.start(engine, models["llama"], "weightcache")
    (pid,) = daemon_pids(host)
    os.kill(pid, signal.SIGSTOP)
    try:
        hung, log = host.start(engine, models["llama"], "weightcache",
                               extra={"wait_timeout": 2})
    finally:
        os.kill(pid, signal.SIGCONT)
    (line,) = outcome(log, engine)
    assert line.startswith("timeout: "), line
    assert "loaded from disk; not published (its daemon did not answer)" in line, line
    seconds = float(line.rsplit("(", 1)[1].rstrip(" s)"))
    assert seconds < 60, line  # bounded by the wait, not by the hung daemon
    same_generation(hung, first)


def test_bad_settings_are_refused_by_name(host, models):
    _, log = host.start("vllm", models["llama"], "weightcache",
                        extra={"wait_timeout": "soon"}, expect_ok=False)
    assert "wait_timeout='soon'" in log and "seconds" in log
    _, log = host.start("vllm", models["llama"], "weightcache",
                        extra={"no_such_setting": 1}, expect_ok=False)
    assert "no_such_setting" in log  # vLLM's default loader refuses what neither knows


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve_and_complete(host, argv, url, body, ready_url, timeout=600):
    proc = subprocess.Popen(argv, env=host.env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"the server exited {proc.returncode}:\n"
                                     f"{proc.stdout.read()[-6000:]}")
            try:
                with urllib.request.urlopen(ready_url, timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the server never became ready"
            time.sleep(1)
        request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as r:
            answer = json.loads(r.read())
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            out, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
    return answer, out


def test_vllm_serve_load_format_weightcache(host, models):
    """`vllm serve MODEL --load-format weightcache`, the command line a user types."""
    first, _ = host.start("vllm", models["llama"], "weightcache")  # publishes
    port = _free_port()
    vllm = os.path.join(os.path.dirname(sys.executable), "vllm")
    argv = [vllm, "serve", models["llama"], "--load-format", "weightcache", "--dtype",
            "bfloat16", "--max-model-len", "128", "--enforce-eager", "--host", "127.0.0.1",
            "--port", str(port)]
    host.env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    answer, log = _serve_and_complete(
        host, argv, f"http://127.0.0.1:{port}/v1/completions",
        {"model": models["llama"], "prompt": "the quick brown", "max_tokens": 12,
         "temperature": 0}, f"http://127.0.0.1:{port}/health")
    (line,) = outcome(log, "vllm")
    assert line.startswith("hit: attached "), line
    assert answer["choices"][0]["text"] == first["text"][0]


def test_sglang_launch_server_load_format_weightcache(host, models):
    """`python -m sglang.launch_server --load-format weightcache`."""
    first, _ = host.start("sglang", models["llama"], "weightcache")  # publishes
    port = _free_port()
    argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", models["llama"],
            "--load-format", "weightcache", "--dtype", "bfloat16", "--device", "cpu",
            "--attention-backend", "torch_native", "--sampling-backend", "pytorch",
            "--disable-cuda-graph", "--mem-fraction-static", "0.3", "--context-length", "128",
            "--host", "127.0.0.1", "--port", str(port)]
    answer, log = _serve_and_complete(
        host, argv, f"http://127.0.0.1:{port}/generate",
        {"text": "the quick brown", "sampling_params": {"temperature": 0,
                                                        "max_new_tokens": 12}},
        f"http://127.0.0.1:{port}/health")
    (line,) = outcome(log, "sglang")
    assert line.startswith("hit: attached "), line
    assert answer["text"] == first["text"][0]
