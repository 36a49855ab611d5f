#!/usr/bin/env python3
"""write_big_checkpoint — a checkpoint too large to build in memory, for the 64 GB rows of
bench/pagecache_bench.py (issue 39: page cache to GPU at 64 GB in 1 and 4 files).

Llama-70B-like tensor names and shapes (2-byte F16 elements), as many layers as fill --gib, written by the
real `safetensors` library (`safetensors.numpy.save_file`), one file at a time. The tensors
are zero-filled numpy arrays: calloc'd, so their untouched pages cost no memory while the
library writes them, and a 64 GB file can be written on a machine whose RAM must also hold
the 64 GB of page cache (or tmpfs) it lands in. /dev/shm on a 128 GiB machine is 64 GiB
(68.7 GB): 64 GB fits. Load benchmarks read the bytes whatever they
are; nothing here compresses.

  write_big_checkpoint.py --out /dev/shm/ckpt --gb 64 --files 4

stdout: one JSON object {"files", "tensors", "bytes"}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
from safetensors.numpy import save_file

HIDDEN, INTER, KV = 8192, 28672, 1024  # Llama-3-70B's widths
LAYER = [("self_attn.q_proj.weight", (HIDDEN, HIDDEN)), ("self_attn.k_proj.weight", (KV, HIDDEN)),
         ("self_attn.v_proj.weight", (KV, HIDDEN)), ("self_attn.o_proj.weight", (HIDDEN, HIDDEN)),
         ("mlp.gate_proj.weight", (INTER, HIDDEN)), ("mlp.up_proj.weight", (INTER, HIDDEN)),
         ("mlp.down_proj.weight", (HIDDEN, INTER)), ("input_layernorm.weight", (HIDDEN,)),
         ("post_attention_layernorm.weight", (HIDDEN,))]


def nbytes(shape) -> int:
    return int(np.prod(shape)) * 2


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--gb", type=float, required=True,
                    help="size in GB (10^9 bytes): whole layers up to it, never past it")
    ap.add_argument("--files", type=int, default=1)
    args = ap.parse_args()
    budget = int(args.gb * 1e9)
    per_layer = sum(nbytes(shape) for _, shape in LAYER)
    layers = budget // per_layer
    if layers < args.files:
        sys.exit(f"write_big_checkpoint: {args.gb} GB holds {layers} layers of "
                 f"{per_layer} bytes, fewer than --files {args.files}")
    tensors = [(f"model.layers.{i}.{name}", shape) for i in range(layers) for name, shape in LAYER]
    total = layers * per_layer
    os.makedirs(args.out, exist_ok=True)
    per_file = (len(tensors) + args.files - 1) // args.files
    names, weight_map = [], {}
    for i in range(args.files):
        part = tensors[i * per_file:(i + 1) * per_file]
        if not part:
            break
        name = (f"model-{i + 1:05d}-of-{args.files:05d}.safetensors" if args.files > 1
                else "model.safetensors")
        # F16: numpy has no bfloat16; the same two bytes an element and the same load path.
        save_file({n: np.zeros(shape, dtype=np.float16) for n, shape in part},
                  os.path.join(args.out, name))
        names.append(name)
        weight_map.update({n: name for n, _ in part})
    if len(names) > 1:  # the index transformers' save_pretrained writes beside the shards
        with open(os.path.join(args.out, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    print(json.dumps({"files": names, "tensors": len(tensors), "bytes": total}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
