#!/usr/bin/env python3
"""Writes the seed corpus of frame_fuzzer (corpus/frame_fuzzer/): valid frames of every
message type and a valid attach manifest (names in ascending order), built from the layout in docs/protocol.md (an
independent encoder: if it disagrees with the C++ codec, the seeds stop parsing)."""
import json
import os
import struct
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "corpus", "frame_fuzzer")


def frame(msg_type, payload=b"", fds=0, version=8):
    return b"WCPF" + struct.pack("<HHIIQ", version, msg_type, 0, fds, len(payload)) + payload


def manifest(tier, allocations, tensors, metadata=b""):
    """Protocol version 7: 64-byte records (with the slice: dim + 1 or 0 for a whole tensor,
    offset, full length), shapes and strides in a dims section, names NUL-terminated in the
    string table, dtype names interned. A tensor tuple may end with a slice (dim, offset,
    full_length). The metadata section (version 7) follows the string table."""
    table = b""
    records = b""
    dims = []
    dtypes = {}
    for name, dtype, shape, alloc, offset, nbytes, checksum, *slice in tensors:
        slice_dim, slice_offset, full_length = (slice[0][0] + 1, slice[0][1], slice[0][2]) \
            if slice else (0, 0, 0)
        name_off = len(table)
        table += name.encode() + b"\0"
        if dtype not in dtypes:
            dtypes[dtype] = len(table)
            table += dtype.encode() + b"\0"
        strides = []
        stride = 1
        for d in reversed(shape):
            strides.insert(0, stride)
            stride *= d
        records += struct.pack("<IIIBBBBIIQQQQQ", name_off, len(name), dtypes[dtype], len(dtype),
                               len(shape), slice_dim, 0, alloc, len(dims), offset, nbytes,
                               checksum, slice_offset, full_length)
        dims += list(shape) + strides
    header = b"WCMF" + struct.pack("<B3xIIIIII", tier, len(allocations), len(tensors), len(dims),
                                   len(table), len(metadata), 0)
    return (header + b"".join(struct.pack("<Q", a) for a in allocations) + records +
            b"".join(struct.pack("<q", d) for d in dims) + table + metadata)


def js(obj):
    return json.dumps(obj, separators=(",", ":")).encode()


def main():
    os.makedirs(OUT, exist_ok=True)
    m = manifest(1, [4096, 1024], [("embed.weight", "BF16", [16, 32], 0, 0, 1024, 7),
                                   ("lm_head", "F8_E4M3", [32, 32], 1, 0, 1024, 8,
                                    (0, 32, 64))], metadata=b"engine 1.0")
    seeds = {
        "hello": frame(1, js({"protocol_version": 8, "config": {"model_id": "m", "tp_size": 2},
                              "client_pid": 12, "client_name": "engine"})),
        "hello_reply": frame(2, js({"state": "loading", "bytes_done": 1, "bytes_total": 2,
                                    "failure_reason": "", "failure_code": 0, "match": False,
                                    "config": {"tp_rank": 1},
                                    "differences": [{"field": "tp_rank", "daemon": "1",
                                                     "client": "0"}]})),
        "status": frame(3),
        "status_reply": frame(4, js({"state": "ready", "bytes_done": 5, "bytes_total": 5,
                                     "failure_reason": "", "failure_code": 0, "tier": "gpu",
                                     "device_uuid": "GPU-00000000-0000-0000-0000-000000000000",
                                     "model_id": "m", "tensor_count": 2, "bytes": 5,
                                     "clients": 1, "pid": 9, "config_digest": "ab" * 32,
                                     "origin": "disk"})),
        "attach": frame(5),
        # Since version 2 the manifest travels as a sealed memfd (the first of 1 + 2 fds); the
        # payload only announces its size and the allocation count.
        "attach_reply": frame(6, struct.pack("<QII", len(m), 2, 0), fds=3),
        "manifest": m,
        "stop": frame(7),
        "stop_reply": frame(8, js({"clients": 0})),
        "error": frame(9, js({"code": 6, "message": "config mismatch: tp_rank"})),
        # Version 6: publishing (docs/publish.md).
        # Version 7: alias_of (tied tensors) in the plan, metadata in the manifest.
        "publish_begin": frame(10, js({"tensors": [{"name": "w", "dtype": "BF16",
                                                    "shape": [2, 3], "nbytes": 12,
                                                    "alias_of": ""},
                                                   {"name": "tied", "dtype": "BF16",
                                                    "shape": [2, 3], "nbytes": 12,
                                                    "alias_of": "w"}],
                                       "metadata": "engine 1.0"})),
        "publish_arena": frame(11, struct.pack("<QII", len(m), 2, 0), fds=3),
        "publish_commit": frame(12, js({"checksums": [1, 2]})),
        "publish_committed": frame(13, js({"tensor_count": 2, "bytes": 8192})),
        "two_frames": frame(3) + frame(1, js({"protocol_version": 8, "config": {},
                                              "client_pid": 1, "client_name": ""})),
    }
    for name, data in seeds.items():
        with open(os.path.join(OUT, name), "wb") as f:
            f.write(data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
