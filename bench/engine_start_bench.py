"""Engine start to first token: vLLM (CPU, host tier) loading from disk against a weightcache hit,
in one run (docs/benchmarks.md "Engine plugins"). Fresh processes (tests/engines/run_engine.py),
the page cache warm for both (the disk start runs first, twice), one checkpoint made here:

    build-engines/venv/bin/python bench/engine_start_bench.py [--layers 8 --hidden 1024]

Prints one JSON line: each start's process-start → engine-ready and → first-token seconds, the
plugin's own load line, and the medians' ratios (hit / disk).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make(path: str, layers: int, hidden: int) -> None:
    sys.path.insert(0, os.path.join(ROOT, "tests", "engines"))
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    import tiny_models

    tok = tiny_models._tokenizer(path)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=hidden * 3,
                         num_hidden_layers=layers, num_attention_heads=hidden // 64,
                         num_key_value_heads=hidden // 128, max_position_embeddings=256,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         dtype="bfloat16")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)


def start(model: str, fmt: str, env: dict) -> dict:
    done = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "engines", "run_engine.py"),
                           "--engine", "vllm", "--model", model, "--load-format", fmt],
                          env=env, capture_output=True, text=True, check=True)
    result = json.loads(next(ln for ln in done.stdout.splitlines()
                             if ln.startswith("RESULT "))[len("RESULT "):])
    line = re.findall(r"weightcache: vllm \S+ \S+ \w+ tier: (.*)", done.stdout + done.stderr)
    return {"format": fmt, "ready_s": round(result["ready_s"], 3),
            "first_token_s": round(result["first_token_s"], 3),
            "plugin": line[-1][:160] if line else "", "tokens": result["tokens"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="wcbench.")
    model = os.path.join(work, "model")
    make(model, args.layers, args.hidden)
    runtime = os.path.join(work, "run")
    os.mkdir(runtime, 0o700)
    env = dict(os.environ, WEIGHTCACHE_RUNTIME_DIR=runtime)
    runs = [start(model, "safetensors", env) for _ in range(args.repeat)]
    runs.append(start(model, "weightcache", env))  # the miss: disk load + publish
    runs += [start(model, "weightcache", env) for _ in range(args.repeat)]
    cli = os.path.join(os.path.dirname(sys.executable), "weightcache")
    subprocess.run([cli, "stop", "--all", "--runtime-dir", runtime], capture_output=True)
    disk = [r for r in runs if r["format"] == "safetensors"]
    hits = runs[-args.repeat:]
    assert all(r["tokens"] == disk[0]["tokens"] for r in runs), "tokens differ"
    bytes_ = sum(os.path.getsize(os.path.join(model, f)) for f in os.listdir(model)
                 if f.endswith(".safetensors"))
    med = lambda rs, k: statistics.median(r[k] for r in rs)  # noqa: E731
    out = {"checkpoint_bytes": bytes_, "layers": args.layers, "hidden": args.hidden,
           "cpus": os.cpu_count(),
           "disk_ready_s": med(disk, "ready_s"), "hit_ready_s": med(hits, "ready_s"),
           "disk_first_token_s": med(disk, "first_token_s"),
           "hit_first_token_s": med(hits, "first_token_s"),
           "runs": [{k: v for k, v in r.items() if k != "tokens"} for r in runs]}
    out["first_token_ratio_hit_over_disk"] = round(out["hit_first_token_s"] /
                                                   out["disk_first_token_s"], 3)
    out["ready_ratio_hit_over_disk"] = round(out["hit_ready_s"] / out["disk_ready_s"], 3)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
