#!/usr/bin/env python3
"""pagecache_bench — page cache to GPU: `weightcache serve --tier gpu` beside InstantTensor on
the same GPU and checkpoint, in the same run, with the machine's limits measured in that run
(issue 39, sections 1 and 2).

What it measures, page cache warm (every file read once first):

- anchors: pinned host-to-device copy (torch, 1 GiB, best of 4) and a threaded read of the
  checkpoint files from the page cache (8 threads, 64 MiB preads into reused buffers);
- InstantTensor: a fresh process makes its CUDA context, then times
  `safe_open(files, framework="pt", device=N, backend=BackendPolicy.BUFFERED)` over every
  tensor (each kept, a synchronize at the end): the load alone, as its own benchmarks report;
- weightcache: `serve --tier gpu --detach` from spawn until it exits 0 (the daemon serves;
  every tensor checksummed on the GPU), as an engine's supervisor sees it; beside it the
  daemon's own ready line (load start to ready). Stopped between repetitions (the keeper's
  memory dropped too);
- restart after kill -9 of a ready daemon (the keeper holds the memory): spawn to serving
  again, with the default --adopt-verify sample and with behind.

The ratio weightcache / InstantTensor is computed on the load rates (bytes over seconds) of
the best repetition of each. A measurement, not a test: the script fails only when a step
fails or the two loaders disagree on the tensor count or bytes.

  pagecache_bench.py --model DIR --cli PATH --device UUID --cuda-index N [--reps 2]
      [--threads 16,8,32] [--no-restarts]

Output: one JSON object per measurement, then a summary object and one `result:` line.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHUNK = 64 << 20
READ_THREADS = 8

INSTANTTENSOR_CHILD = """
import json, sys, time, torch
index = int(sys.argv[1]); files = sys.argv[2:]
t_context = time.monotonic()
torch.cuda.init(); torch.empty(1, device=f"cuda:{index}"); torch.cuda.synchronize()
from instanttensor import BackendPolicy, safe_open
t0 = time.monotonic()
kept, nbytes = {}, 0
with safe_open(files, framework="pt", device=index, backend=BackendPolicy.BUFFERED) as f:
    for name, tensor in f.tensors():
        kept[name] = tensor
        nbytes += tensor.numel() * tensor.element_size()
torch.cuda.synchronize()
seconds = time.monotonic() - t0
print(json.dumps({"tensors": len(kept), "bytes": nbytes, "seconds": seconds,
                  "context_seconds": t0 - t_context}))
"""

READY_LINE = re.compile(r"ready: (\d+) tensors, .* in ([0-9.e-]+) s, ([0-9.]+) GB/s")


def emit(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


def shard_files(model: Path) -> list[str]:
    files = sorted(str(p) for p in model.glob("*.safetensors"))
    if not files:
        sys.exit(f"pagecache_bench: no *.safetensors in {model}")
    return files


def read_rate(files: list[str]) -> float:
    """GB/s of reading every file through the page cache, READ_THREADS at a time."""
    jobs = []
    for path in files:
        size = os.path.getsize(path)
        jobs += [(path, off, min(CHUNK, size - off)) for off in range(0, size, CHUNK)]
    fds = {path: os.open(path, os.O_RDONLY) for path in files}
    buffers = [bytearray(CHUNK) for _ in range(READ_THREADS)]

    def read(i: int) -> int:
        done = 0
        for path, off, length in jobs[i::READ_THREADS]:
            done += os.preadv(fds[path], [memoryview(buffers[i])[:length]], off)
        return done

    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(READ_THREADS) as pool:
        total = sum(pool.map(read, range(READ_THREADS)))
    seconds = time.monotonic() - t0
    for fd in fds.values():
        os.close(fd)
    return total / seconds / 1e9


def pinned_h2d_rate(index: int) -> float:
    import torch

    src = torch.empty(1 << 30, dtype=torch.uint8).pin_memory()
    dst = torch.empty(1 << 30, dtype=torch.uint8, device=f"cuda:{index}")
    best = float("inf")
    for _ in range(4):
        torch.cuda.synchronize()
        t0 = time.monotonic()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.monotonic() - t0)
    del src, dst
    torch.cuda.empty_cache()
    return (1 << 30) / best / 1e9


def instanttensor(files: list[str], index: int) -> dict:
    # INSTANTTENSOR_DEBUG: its backend and its phases, into this bench's log.
    out = subprocess.run([sys.executable, "-c", INSTANTTENSOR_CHILD, str(index), *files],
                         capture_output=True, text=True, check=False,
                         env={**os.environ, "INSTANTTENSOR_DEBUG": "1"})
    print(f"==== InstantTensor\n{out.stderr[-4000:]}", file=sys.stderr, flush=True)
    if out.returncode != 0:
        sys.exit(f"pagecache_bench: the InstantTensor child failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


class Serve:
    def __init__(self, cli: str, model: Path, device: str, runtime: str) -> None:
        self.cli, self.model, self.device, self.runtime = cli, model, device, runtime

    def start(self, *extra: str) -> dict:
        """serve --detach: spawn to exit 0 (serving), the daemon's pid and its ready line."""
        argv = [self.cli, "serve", "--model", str(self.model), "--tier", "gpu", "--device",
                self.device, "--runtime-dir", self.runtime, "--detach", "--json", *extra]
        t0 = time.monotonic()
        out = subprocess.run(argv, capture_output=True, text=True, check=False)
        spawn_to_serving = time.monotonic() - t0
        if out.returncode != 0:
            sys.exit(f"pagecache_bench: {' '.join(argv)} exited {out.returncode}:\n"
                     f"{out.stdout[-2000:]}{out.stderr[-2000:]}")
        (daemon,) = json.loads(out.stdout)["daemons"]
        log = Path(daemon["log"]).read_text(errors="replace")
        ready = READY_LINE.findall(log)
        print(f"==== {' '.join(argv)}\n{log}", file=sys.stderr, flush=True)  # the phases
        return {"spawn_to_serving_s": spawn_to_serving, "pid": daemon["pid"],
                "ready_line": ready[-1] if ready else None,
                "log_tail": log.strip().splitlines()[-6:]}

    def stop(self) -> None:
        subprocess.run([self.cli, "stop", "--runtime-dir", self.runtime, "--all"],
                       capture_output=True, check=True)

    @staticmethod
    def kill9(pid: int) -> None:
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.01)
        sys.exit(f"pagecache_bench: pid {pid} outlived kill -9 by 30 s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--cli", required=True)
    ap.add_argument("--device", required=True, help="the GPU's UUID, for serve --device")
    ap.add_argument("--cuda-index", type=int, default=0, help="the same GPU, for torch")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--no-restarts", action="store_true",
                    help="skip the restarts after kill -9 (a 64 GB run measures the loads only)")
    ap.add_argument("--threads", default="16",
                    help="serve --threads values to measure, comma-separated; the first is the "
                         "one the ratio and the restarts use (default 16, serve's own)")
    args = ap.parse_args()

    files = shard_files(args.model)
    total = sum(os.path.getsize(p) for p in files)
    read_rate(files)  # warms the page cache
    anchors = {"read_gbps": read_rate(files), "pinned_h2d_gbps": pinned_h2d_rate(args.cuda_index)}
    emit({"bench": "pagecache", "anchors": anchors, "files": len(files), "file_bytes": total})

    it_runs = []
    for rep in range(args.reps):
        run = instanttensor(files, args.cuda_index)
        run["gbps"] = run["bytes"] / run["seconds"] / 1e9
        it_runs.append(run)
        emit({"bench": "pagecache", "loader": "instanttensor-buffered", "rep": rep, **run})

    wc_runs, restarts = [], {}
    with tempfile.TemporaryDirectory(prefix="wc-pagecache-") as runtime:
        serve = Serve(args.cli, args.model, args.device, runtime)
        threads = [int(t) for t in args.threads.split(",")]
        for count in threads:
            for rep in range(args.reps):
                run = serve.start("--threads", str(count))
                serve.stop()
                if run["ready_line"] is None:
                    sys.exit(f"pagecache_bench: no ready line in the daemon's log: "
                             f"{run['log_tail']}")
                tensors, ready_s, _ = run["ready_line"]
                run.update(tensors=int(tensors), ready_line_s=float(ready_s), threads=count,
                           gbps=total / run["spawn_to_serving_s"] / 1e9)
                if count == threads[0]:
                    wc_runs.append(run)
                emit({"bench": "pagecache", "loader": "weightcache-serve", "rep": rep,
                      **{k: v for k, v in run.items() if k not in ("pid", "log_tail")}})
        for verify in () if args.no_restarts else ("sample", "behind"):
            first = serve.start()
            serve.kill9(first["pid"])
            again = serve.start("--adopt-verify", verify)
            serve.stop()
            restarts[verify] = {"spawn_to_serving_s": again["spawn_to_serving_s"],
                                "log_tail": again["log_tail"]}
            emit({"bench": "pagecache", "restart_after_kill9": verify, **restarts[verify]})

    best_it = max(it_runs, key=lambda r: r["gbps"])
    best_wc = min(wc_runs, key=lambda r: r["spawn_to_serving_s"])
    if best_it["tensors"] != best_wc["tensors"]:
        sys.exit(f"pagecache_bench: InstantTensor loaded {best_it['tensors']} tensors, "
                 f"weightcache {best_wc['tensors']}")
    wc_spawn_gbps = total / best_wc["spawn_to_serving_s"] / 1e9
    wc_ready_gbps = total / min(r["ready_line_s"] for r in wc_runs) / 1e9
    summary = {
        "bench": "pagecache", "summary": True, "bytes": total, "anchors": anchors,
        "instanttensor_gbps": best_it["gbps"],
        "weightcache_spawn_to_serving_gbps": wc_spawn_gbps,
        "weightcache_ready_line_gbps": wc_ready_gbps,
        "ratio_spawn_to_serving": wc_spawn_gbps / best_it["gbps"],
        "ratio_ready_line": wc_ready_gbps / best_it["gbps"],
        "restart_spawn_to_serving_s": {k: v["spawn_to_serving_s"] for k, v in restarts.items()},
    }
    emit(summary)
    restarted = "; restart after kill -9, spawn to serving: " + ", ".join(
        f"{k} {v['spawn_to_serving_s'] * 1000:.0f} ms" for k, v in restarts.items()) \
        if restarts else ""
    print(f"result: {total / 1e9:.2f} GB in {len(files)} files, page cache warm: InstantTensor "
          f"buffered {best_it['gbps']:.1f} GB/s; weightcache serve spawn to serving "
          f"{wc_spawn_gbps:.1f} GB/s = {summary['ratio_spawn_to_serving']:.2f}x (its ready "
          f"line {wc_ready_gbps:.1f} GB/s = {summary['ratio_ready_line']:.2f}x); anchors: "
          f"pinned H2D {anchors['pinned_h2d_gbps']:.1f} GB/s, page-cache read "
          f"{anchors['read_gbps']:.1f} GB/s{restarted}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
