#!/usr/bin/env python3
"""Write a real safetensors checkpoint for tests, with the real `safetensors` library.

Used by every test tier (unit, integration, gpu, python). Content is deterministic from
--seed. Examples:

  make_checkpoint.py --out DIR --tensors 8 --dtypes bf16,f32 --seed 1
  make_checkpoint.py --out DIR --tensors 40 --dtypes all --shards 3 --manifest m.json
  make_checkpoint.py --out DIR --spec tensors.json --shards 2

--spec FILE names the tensors instead: a JSON list of {"name", "shape", "dtype"} (dtype as
for --dtypes, e.g. "bf16"), written in that order (split into --shards shards in order).

One shard writes DIR/model.safetensors. K > 1 shards write model-0000i-of-0000K.safetensors
plus model.safetensors.index.json, the layout transformers' save_pretrained produces.

Files are written by safetensors.serialize_file (the Rust writer) for every dtype its Python
binding accepts. The two MXFP6 dtypes (f6_e2m3, f6_e3m2) exist in the format and the reader
but the binding cannot write them; a shard holding them is laid out here exactly as the Rust
writer lays files out and is then verified by reading it back with safetensors.deserialize.

stdout: one JSON object {"files", "index", "shards", "tensors", "total_bytes", "writer"}.
--manifest FILE: per tensor {dtype, shape, nbytes, file, sha256}, computed by reading the
written files back with safetensors.deserialize (the reference reader), for tests to compare
against the bytes they read themselves.
"""

import argparse
import hashlib
import json
import os
import struct
import sys

try:
    import numpy as np
    import safetensors
except ImportError as e:  # tests look for this message to skip
    print(f"make_checkpoint: python safetensors/numpy unavailable: {e}", file=sys.stderr)
    sys.exit(77)

# CLI name -> (header dtype, bits per element, TensorSpec dtype name or None if unwritable).
DTYPES = {
    "bool": ("BOOL", 8, "bool"),
    "u8": ("U8", 8, "uint8"),
    "i8": ("I8", 8, "int8"),
    "i16": ("I16", 16, "int16"),
    "u16": ("U16", 16, "uint16"),
    "i32": ("I32", 32, "int32"),
    "u32": ("U32", 32, "uint32"),
    "i64": ("I64", 64, "int64"),
    "u64": ("U64", 64, "uint64"),
    "f16": ("F16", 16, "float16"),
    "bf16": ("BF16", 16, "bfloat16"),
    "f32": ("F32", 32, "float32"),
    "f64": ("F64", 64, "float64"),
    "c64": ("C64", 64, "complex64"),
    "f8_e4m3": ("F8_E4M3", 8, "float8_e4m3fn"),
    "f8_e4m3fnuz": ("F8_E4M3FNUZ", 8, "float8_e4m3fnuz"),
    "f8_e5m2": ("F8_E5M2", 8, "float8_e5m2"),
    "f8_e5m2fnuz": ("F8_E5M2FNUZ", 8, "float8_e5m2fnuz"),
    "f8_e8m0": ("F8_E8M0", 8, "float8_e8m0fnu"),
    "f4": ("F4", 4, "float4_e2m1fn_x2"),
    "f6_e2m3": ("F6_E2M3", 6, None),
    "f6_e3m2": ("F6_E3M2", 6, None),
}
# The reference writer orders tensors by descending dtype alignment (its enum order), then
# name; reproduced for the hand-laid F6 shards.
ENUM_ORDER = ["BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0",
              "F8_E4M3FNUZ", "F8_E5M2FNUZ", "I16", "U16", "F16", "BF16", "I32", "U32", "F32",
              "C64", "F64", "I64", "U64"]


def tensor_bytes(rng, header_dtype, n):
    """Deterministic, finite (no NaN/Inf) little-endian bytes for n elements."""
    if header_dtype in ("F16", "F32", "F64"):
        np_t = {"F16": np.float16, "F32": np.float32, "F64": np.float64}[header_dtype]
        return rng.standard_normal(n).astype(np_t).astype(np_t().dtype.newbyteorder("<")).tobytes()
    if header_dtype == "C64":
        v = rng.standard_normal(n).astype(np.float32) + 1j * rng.standard_normal(n).astype(np.float32)
        return v.astype("<c8").tobytes()
    if header_dtype == "BF16":
        f = rng.standard_normal(n).astype("<f4")
        return (f.view("<u4") >> 16).astype("<u2").tobytes()
    if header_dtype == "BOOL":
        return rng.integers(0, 2, n, dtype=np.uint8).tobytes()
    bits = {v[0]: v[1] for v in DTYPES.values()}[header_dtype]
    nbytes = n * bits // 8
    if header_dtype in ("I16", "U16", "I32", "U32", "I64", "U64", "U8", "I8", "F4",
                        "F6_E2M3", "F6_E3M2"):
        return rng.integers(0, 256, nbytes, dtype=np.uint8).tobytes()
    b = rng.integers(0, 256, nbytes, dtype=np.uint8)
    if header_dtype == "F8_E4M3":  # NaN: S.1111.111
        b[(b & 0x7F) == 0x7F] ^= 1
    elif header_dtype == "F8_E5M2":  # Inf/NaN: exponent 11111
        b[(b & 0x7C) == 0x7C] &= 0xFB
    elif header_dtype in ("F8_E4M3FNUZ", "F8_E5M2FNUZ"):  # NaN: 0x80
        b[b == 0x80] = 0
    elif header_dtype == "F8_E8M0":  # NaN: 0xFF
        b[b == 0xFF] = 0x7F
    return b.tobytes()


def make_shape(rng, n):
    """A 1-D or 2-D shape with exactly n elements."""
    if n > 1 and rng.integers(0, 2) == 1:
        divisors = [d for d in range(2, min(n, 64) + 1) if n % d == 0]
        if divisors:
            d = int(divisors[int(rng.integers(0, len(divisors)))])
            return [int(n // d), d]
    return [int(n)]


def write_manual(path, tensors, metadata):
    """Lay a file out as the Rust writer does (see ENUM_ORDER), for dtypes it cannot take."""
    order = sorted(tensors, key=lambda t: (-ENUM_ORDER.index(t["dtype"]), t["name"]))
    header, offset = {}, 0
    if metadata:
        header["__metadata__"] = metadata
    for t in order:
        header[t["name"]] = {"dtype": t["dtype"], "shape": t["shape"],
                             "data_offsets": [offset, offset + len(t["data"])]}
        offset += len(t["data"])
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for t in order:
            f.write(t["data"])
    with open(path, "rb") as f:  # the reference reader must accept what we laid out
        safetensors.deserialize(f.read())


def write_shard(path, tensors, metadata):
    if any(DTYPES[t["cli"]][2] is None for t in tensors):
        write_manual(path, tensors, metadata)
        return "manual+verified"
    keep = []
    specs = {}
    for t in tensors:
        buf = np.frombuffer(t["data"], dtype=np.uint8).copy()
        keep.append(buf)
        shape = list(t["shape"])
        if t["dtype"] == "F4":  # the binding takes the packed storage shape and doubles it
            shape[-1] //= 2
        specs[t["name"]] = safetensors.TensorSpec(dtype=DTYPES[t["cli"]][2], shape=shape,
                                                  data_ptr=buf.ctypes.data, data_len=buf.nbytes)
    safetensors.serialize_file(specs, path, metadata=metadata or None)
    del keep
    return "safetensors.serialize_file"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="output directory (created)")
    p.add_argument("--tensors", type=int, default=4)
    p.add_argument("--dtypes", default="bf16",
                   help="comma list of " + ",".join(DTYPES) + " or 'all'; round-robin")
    p.add_argument("--shards", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-elems", type=int, default=1)
    p.add_argument("--max-elems", type=int, default=1024)
    p.add_argument("--metadata", action="append", default=[], metavar="K=V",
                   help="__metadata__ entry (repeatable); default format=pt")
    p.add_argument("--manifest", help="write per-tensor sha256 JSON here")
    p.add_argument("--spec", help="JSON file: a list of {name, shape, dtype} to write")
    a = p.parse_args()

    dtypes = list(DTYPES) if a.dtypes == "all" else [d.strip().lower() for d in a.dtypes.split(",")]
    for d in dtypes:
        if d not in DTYPES:
            p.error(f"unknown dtype {d!r}; known: {','.join(DTYPES)}")
    spec = None
    if a.spec:
        with open(a.spec) as f:
            spec = json.load(f)
        if not isinstance(spec, list) or not spec:
            p.error("--spec wants a non-empty JSON list of {name, shape, dtype}")
        for t in spec:
            if set(t) != {"name", "shape", "dtype"} or t["dtype"].lower() not in DTYPES:
                p.error(f"--spec entry {t!r}: want exactly name, shape, dtype (one of {','.join(DTYPES)})")
        a.tensors = len(spec)
    if a.tensors < 1 or a.shards < 1 or a.shards > a.tensors:
        p.error("need 1 <= --shards <= --tensors")
    if a.min_elems < 0 or a.max_elems < a.min_elems:
        p.error("need 0 <= --min-elems <= --max-elems")
    metadata = {}
    for kv in a.metadata:
        if "=" not in kv:
            p.error(f"--metadata wants K=V, got {kv!r}")
        k, v = kv.split("=", 1)
        metadata[k] = v
    if not a.metadata:
        metadata = {"format": "pt"}

    rng = np.random.Generator(np.random.PCG64(a.seed))
    tensors = []
    for t in spec or []:
        cli = t["dtype"].lower()
        header_dtype, bits, _ = DTYPES[cli]
        n = int(np.prod(t["shape"], dtype=np.int64)) if t["shape"] else 1
        if n * bits % 8:
            p.error(f"--spec tensor {t['name']}: {n} elements of {cli} are not whole bytes")
        tensors.append({"name": t["name"], "cli": cli, "dtype": header_dtype,
                        "shape": [int(d) for d in t["shape"]],
                        "data": tensor_bytes(rng, header_dtype, n)})
    for i in range(0 if spec else a.tensors):
        cli = dtypes[i % len(dtypes)]
        header_dtype, bits, _ = DTYPES[cli]
        n = int(rng.integers(a.min_elems, a.max_elems + 1))
        per_byte_group = 8 // int(np.gcd(bits, 8))  # elements per whole number of bytes
        n = (n + per_byte_group - 1) // per_byte_group * per_byte_group
        tensors.append({"name": f"model.layers.{i}.{cli}.weight", "cli": cli,
                        "dtype": header_dtype, "shape": make_shape(rng, n),
                        "data": tensor_bytes(rng, header_dtype, n)})

    os.makedirs(a.out, exist_ok=True)
    files, writers, weight_map = [], set(), {}
    per_shard = [tensors[i * len(tensors) // a.shards:(i + 1) * len(tensors) // a.shards]
                 for i in range(a.shards)]
    for s, group in enumerate(per_shard):
        name = ("model.safetensors" if a.shards == 1
                else f"model-{s + 1:05d}-of-{a.shards:05d}.safetensors")
        writers.add(write_shard(os.path.join(a.out, name), group, metadata))
        files.append(name)
        for t in group:
            weight_map[t["name"]] = name
    total = sum(len(t["data"]) for t in tensors)
    index = None
    if a.shards > 1:
        index = "model.safetensors.index.json"
        with open(os.path.join(a.out, index), "w") as f:
            json.dump({"metadata": {"total_size": total},
                       "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)

    if a.manifest:
        manifest = {}
        for name in files:
            with open(os.path.join(a.out, name), "rb") as f:
                for tname, view in safetensors.deserialize(f.read()):
                    data = bytes(view["data"])
                    manifest[tname] = {"dtype": view["dtype"], "shape": list(view["shape"]),
                                       "nbytes": len(data), "file": name,
                                       "sha256": hashlib.sha256(data).hexdigest()}
        with open(a.manifest, "w") as f:
            json.dump({"metadata": metadata, "tensors": manifest}, f, indent=1, sort_keys=True)

    print(json.dumps({"files": files, "index": index, "shards": a.shards,
                      "tensors": len(tensors), "total_bytes": total,
                      "writer": sorted(writers)}))


if __name__ == "__main__":
    main()
