#!/usr/bin/env python3
"""Regenerate corpus/header_fuzzer/: tiny safetensors files, valid ones from the real
`safetensors` writer and hand-made near-misses, as seeds for header_fuzzer."""
import json
import os
import struct

import numpy as np
from safetensors.numpy import save

out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus", "header_fuzzer")
os.makedirs(out, exist_ok=True)


def raw(header, data=b""):
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


def t(dtype, shape, begin, end):
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


seeds = {
    "real_two_tensors": save({"a": np.arange(6, dtype=np.float32).reshape(2, 3),
                              "b": np.ones(4, dtype=np.int8)}, metadata={"format": "pt"}),
    "real_empty": save({}),
    "empty_object": raw(b"{}"),
    "metadata_only": raw({"__metadata__": {"k": "v"}}),
    "subbyte": raw({"f4": t("F4", [4], 0, 2), "f6": t("F6_E2M3", [4], 2, 5)}, b"\0" * 5),
    "zero_size": raw({"z": t("BF16", [0, 3], 0, 0), "u": t("U8", [1], 0, 1)}, b"\0"),
    "gap": raw({"a": t("U8", [1], 0, 1), "b": t("U8", [1], 2, 3)}, b"\0" * 3),
    "overlap": raw({"a": t("U8", [2], 0, 2), "b": t("U8", [2], 1, 3)}, b"\0" * 3),
    "duplicate": raw(b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},'
                     b'"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', b"\0"),
    "unknown_field": raw({"a": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8],
                                "extra": {"x": [1, [2]]}}}, b"\0" * 8),
    "overflow": raw({"a": t("F64", [2**40, 2**40], 0, 8)}, b"\0" * 8),
}
for name, blob in seeds.items():
    with open(os.path.join(out, name), "wb") as f:
        f.write(blob)
print(f"{len(seeds)} seeds in {out}")
