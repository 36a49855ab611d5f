#!/usr/bin/env python3
"""An engine-style restart with weightcache.

Start 1 runs with no daemon: weightcache loads the checkpoint from disk (the fallback), as an
engine does today. Then `weightcache serve` loads it once and keeps it resident. Start 2 — a
fresh process, as a restarted engine is — attaches to the daemon instead of reading the disk.
Both times are printed.

    python examples/engine_restart.py                       # demo checkpoint, host tier
    python examples/engine_restart.py --model /models/qwen --tier gpu --device 0

Needs the package (`pip install .`, which also installs the `weightcache` CLI) and, for the
demo checkpoint, numpy + safetensors.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def engine_start(args: argparse.Namespace) -> None:
    """One engine start: attach (or fall back) and touch every tensor's metadata."""
    import weightcache

    t0 = time.perf_counter()
    att = weightcache.attach(args.model, tier=args.tier, device=args.device,
                             runtime_dir=args.runtime_dir)
    tensors = att.tensors()
    wall_ms = (time.perf_counter() - t0) * 1000
    print(json.dumps({"source": att.source, "reason": att.source_reason, "wall_ms": wall_ms,
                      "attach_ms": att.attach_ms, "tensors": len(tensors),
                      "bytes": att.total_bytes}))


def write_demo_checkpoint(path: str, megabytes: int) -> None:
    import numpy as np
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    per = max(1, megabytes * (1 << 20) // 64 // 4)  # 64 float32 tensors
    os.makedirs(path, exist_ok=True)
    save_file({f"model.layers.{i}.weight": rng.standard_normal(per, dtype=np.float32)
               for i in range(64)}, os.path.join(path, "model.safetensors"))


def run_start(args: argparse.Namespace, label: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--engine", "--model", args.model,
           "--tier", args.tier, "--runtime-dir", args.runtime_dir]
    if args.device is not None:
        cmd += ["--device", args.device]
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    print(f"{label}: {result['source']:8s} {result['wall_ms']:9.1f} ms  "
          f"({result['tensors']} tensors, {result['bytes'] / 1e6:.1f} MB; {result['reason']})",
          flush=True)
    return result


def wait_ready(args: argparse.Namespace, serve: subprocess.Popen, timeout: float) -> None:
    import weightcache

    deadline = time.monotonic() + timeout
    while True:
        if serve.poll() is not None:
            sys.exit(f"weightcache serve exited with {serve.returncode}")
        try:
            weightcache.attach(args.model, tier=args.tier, device=args.device,
                               runtime_dir=args.runtime_dir, on_missing="error",
                               wait_timeout=timeout)
            return
        except weightcache.NoDaemonError:
            if time.monotonic() > deadline:
                sys.exit("the daemon did not become ready in time")
            time.sleep(0.05)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="checkpoint dir (default: a demo checkpoint)")
    p.add_argument("--tier", choices=["host", "gpu"], default="host")
    p.add_argument("--device", help="GPU index or UUID (gpu tier)")
    p.add_argument("--runtime-dir", help="weightcache runtime dir (default: a private temp dir)")
    p.add_argument("--demo-mb", type=int, default=256, help="size of the demo checkpoint")
    p.add_argument("--engine", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.engine:
        engine_start(args)
        return

    import weightcache

    with tempfile.TemporaryDirectory(prefix="wc-example-") as tmp:
        if args.runtime_dir is None:
            args.runtime_dir = os.path.join(tmp, "run")
            os.makedirs(args.runtime_dir, mode=0o700)
        if args.model is None:
            args.model = os.path.join(tmp, "demo-model")
            write_demo_checkpoint(args.model, args.demo_mb)
        first = run_start(args, "start 1 (no daemon)")

        serve_cmd = [weightcache.cli_path(), "serve", "--model", args.model, "--tier", args.tier,
                     "--runtime-dir", args.runtime_dir]
        if args.device is not None:
            serve_cmd += ["--device", args.device]
        serve = subprocess.Popen(serve_cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_ready(args, serve, timeout=600)
            second = run_start(args, "start 2 (daemon)   ")
        finally:
            serve.terminate()
            serve.wait(timeout=60)
    speedup = first["wall_ms"] / max(second["wall_ms"], 1e-3)
    print(f"restart: {first['wall_ms']:.1f} ms from disk -> {second['wall_ms']:.1f} ms attached "
          f"({speedup:.0f}x)")


if __name__ == "__main__":
    main()
