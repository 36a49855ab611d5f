#!/usr/bin/env python3
"""detach_restart_bench — restart after kill -9 as an engine's supervisor sees it (issue 39,
section 2): `weightcache serve --detach` timed from its spawn until it exits 0 (the daemon
serves), on a cache whose keeper holds the memory, beside the restarted daemon's own ready line
("… s since serve started"). What lies between the two is process start-up and the launcher's
readiness probing, which docs/benchmarks.md "Restart as the supervisor sees it" breaks down.

Any tier: `--tier host` needs no GPU (the checkpoint is written by tests/tools/make_checkpoint.py);
`--tier gpu --device UUID` on the device machine.

  detach_restart_bench.py --cli PATH [--tier host|gpu] [--device UUID] [--reps 5]
                          [--tensors 292] [--tensor-bytes 524288] [--work DIR]

Output: one JSON object per restart, then a summary object and one `result:` line. Exits 1
only when a step fails (a restart that is not an adoption is a failure).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SINCE_START = re.compile(r"ready: adopted .* \(([0-9.e-]+) s since serve started\)")


MAKE_CHECKPOINT = Path(__file__).resolve().parent.parent / "tests" / "tools" / "make_checkpoint.py"


def make_checkpoint(work: Path, tensors: int, tensor_bytes: int) -> Path:
    """tests/tools/make_checkpoint.py: `tensors` f16 tensors of `tensor_bytes` each, 4 shards."""
    out = work / "model"
    spec = work / "model.spec.json"
    spec.write_text(json.dumps([{"name": f"model.layers.{i}.weight",
                                 "shape": [tensor_bytes // 2], "dtype": "f16"}
                                for i in range(tensors)]))
    subprocess.run([sys.executable, str(MAKE_CHECKPOINT), "--out", str(out), "--spec", str(spec),
                    "--shards", "4", "--seed", "7"], check=True, stdout=subprocess.DEVNULL)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cli", required=True)
    ap.add_argument("--tier", choices=("host", "gpu"), default="host")
    ap.add_argument("--device", help="gpu tier: the GPU's UUID")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tensors", type=int, default=292)
    ap.add_argument("--tensor-bytes", type=int, default=512 << 10)
    ap.add_argument("--work", type=Path)
    args = ap.parse_args()
    if args.tier == "gpu" and not args.device:
        ap.error("--tier gpu needs --device UUID")

    with tempfile.TemporaryDirectory(prefix="wc-restart-", dir=args.work) as work:
        model = make_checkpoint(Path(work), args.tensors, args.tensor_bytes)
        runtime = Path(work) / "run"
        time.sleep(1.1)  # past the racy window: the files' identity is cached from here on
        runtime.mkdir(mode=0o700)
        serve = [args.cli, "serve", "--model", str(model), "--tier", args.tier,
                 "--runtime-dir", str(runtime), "--detach", "--json"]
        if args.device:
            serve += ["--device", args.device]

        def start(*extra: str):
            t0 = time.monotonic()
            done = subprocess.run([*serve, *extra], capture_output=True, text=True, check=False)
            seconds = time.monotonic() - t0
            if done.returncode != 0:
                sys.exit(f"detach_restart_bench: serve exited {done.returncode}: "
                         f"{done.stderr.strip()[-1500:]}")
            (daemon,) = json.loads(done.stdout)["daemons"]
            return seconds, daemon

        rows = []
        try:
            _, daemon = start()  # the load; its keeper then holds the memory
            for verify in ("sample", "behind"):
                for rep in range(args.reps):
                    os.kill(daemon["pid"], signal.SIGKILL)
                    while Path(f"/proc/{daemon['pid']}").exists():
                        time.sleep(0.001)
                    seconds, daemon = start("--adopt-verify", verify)
                    ready = SINCE_START.findall(Path(daemon["log"]).read_text(errors="replace"))
                    if not ready:
                        sys.exit("detach_restart_bench: the restart did not adopt (no "
                                 f"'ready: adopted' line in {daemon['log']})")
                    row = {"bench": "detach_restart", "tier": args.tier, "adopt_verify": verify,
                           "rep": rep, "spawn_to_serving_ms": seconds * 1000,
                           "daemon_since_start_ms": float(ready[-1]) * 1000}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
        finally:
            subprocess.run([args.cli, "stop", "--all", "--runtime-dir", str(runtime)],
                           capture_output=True, check=False)

    summary = {"bench": "detach_restart", "summary": True, "tier": args.tier,
               "tensors": args.tensors, "bytes": args.tensors * args.tensor_bytes}
    parts = []
    for verify in ("sample", "behind"):
        mine = [r for r in rows if r["adopt_verify"] == verify]
        spawn = statistics.median(r["spawn_to_serving_ms"] for r in mine)
        daemon = statistics.median(r["daemon_since_start_ms"] for r in mine)
        summary[verify] = {"spawn_to_serving_ms_median": spawn,
                           "daemon_since_start_ms_median": daemon}
        parts.append(f"{verify}: spawn to serving {spawn:.1f} ms (the daemon's own ready line "
                     f"{daemon:.1f} ms since serve started)")
    print(json.dumps(summary))
    print(f"result: {args.tier} tier, {args.tensors} tensors, restart after kill -9, medians of "
          f"{args.reps}: " + "; ".join(parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
