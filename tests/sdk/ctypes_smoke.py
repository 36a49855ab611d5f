#!/usr/bin/env python3
"""The SDK's C ABI from Python through ctypes alone (no extension module): scripts/sdk-check.sh.

  ctypes_smoke.py LIBWEIGHTCACHE_SO MODEL_DIR RUNTIME_DIR EMPTY_RUNTIME_DIR

Loads the installed libweightcache.so.<ABI>, attaches to the host-tier daemon serving
MODEL_DIR (tests/sdk/make_sdk_checkpoint.py's checkpoint) and checks the bytes of two tensors
against the formulas they were written with; then attaches with on_missing=error under a
runtime dir that no daemon uses and checks the exact error (WC_NO_DAEMON, "no_daemon").
The structs mirror include/weightcache/c_api.h field by field.
"""

import ctypes
import struct
import sys

WC_OK = 0
WC_NO_DAEMON = 5
WC_TIER_HOST = 1
WC_ON_MISSING_ERROR = 1
WC_SOURCE_DAEMON = 0


class WcError(ctypes.Structure):
    _fields_ = [("code", ctypes.c_int), ("message", ctypes.c_char * 1024)]


class WcAttachOptions(ctypes.Structure):
    _fields_ = [
        ("model_dir", ctypes.c_char_p),
        ("model_id", ctypes.c_char_p),
        ("revision", ctypes.c_char_p),
        ("dtype", ctypes.c_char_p),
        ("quantization", ctypes.c_char_p),
        ("quantization_config", ctypes.c_char_p),
        ("tp_size", ctypes.c_int32),
        ("tp_rank", ctypes.c_int32),
        ("pp_size", ctypes.c_int32),
        ("pp_rank", ctypes.c_int32),
        ("ep_size", ctypes.c_int32),
        ("ep_rank", ctypes.c_int32),
        ("dp_size", ctypes.c_int32),
        ("layout_tag", ctypes.c_char_p),
        ("source", ctypes.c_char_p),
        ("tier", ctypes.c_int),
        ("device", ctypes.c_char_p),
        ("namespace_name", ctypes.c_char_p),
        ("runtime_dir", ctypes.c_char_p),
        ("socket", ctypes.c_char_p),
        ("device_inventory", ctypes.c_char_p),
        ("on_missing", ctypes.c_int),
        ("on_mismatch", ctypes.c_int),
        ("wait_timeout_ms", ctypes.c_int64),
        ("fallback_threads", ctypes.c_int32),
        ("shard_rules", ctypes.c_char_p),
    ]


class WcTensor(ctypes.Structure):
    _fields_ = [
        ("name", ctypes.c_char_p),
        ("dtype", ctypes.c_char_p),
        ("ndim", ctypes.c_int32),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("data", ctypes.c_uint64),
        ("nbytes", ctypes.c_uint64),
        ("checksum", ctypes.c_uint64),
        ("slice_dim", ctypes.c_int32),
        ("slice_offset", ctypes.c_uint64),
        ("slice_length", ctypes.c_uint64),
        ("slice_full_length", ctypes.c_uint64),
    ]


def load(path):
    lib = ctypes.CDLL(path)
    lib.wc_attach_options_init.argtypes = [ctypes.POINTER(WcAttachOptions)]
    lib.wc_attach_options_init.restype = None
    lib.wc_attach.argtypes = [ctypes.POINTER(WcAttachOptions), ctypes.POINTER(ctypes.c_void_p),
                              ctypes.POINTER(WcError)]
    lib.wc_attach.restype = ctypes.c_int
    lib.wc_attachment_free.argtypes = [ctypes.c_void_p]
    lib.wc_attachment_free.restype = None
    lib.wc_attachment_tensor_count.argtypes = [ctypes.c_void_p]
    lib.wc_attachment_tensor_count.restype = ctypes.c_size_t
    lib.wc_attachment_find.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.POINTER(WcTensor),
                                       ctypes.POINTER(WcError)]
    lib.wc_attachment_find.restype = ctypes.c_int
    lib.wc_attachment_source.argtypes = [ctypes.c_void_p]
    lib.wc_attachment_source.restype = ctypes.c_int
    lib.wc_attachment_daemon_pid.argtypes = [ctypes.c_void_p]
    lib.wc_attachment_daemon_pid.restype = ctypes.c_int32
    lib.wc_status_code_name.argtypes = [ctypes.c_int]
    lib.wc_status_code_name.restype = ctypes.c_char_p
    return lib


def options(lib, model_dir, runtime_dir):
    opts = WcAttachOptions()
    lib.wc_attach_options_init(ctypes.byref(opts))
    opts.model_dir = model_dir.encode()
    opts.runtime_dir = runtime_dir.encode()
    opts.tier = WC_TIER_HOST
    opts.on_missing = WC_ON_MISSING_ERROR
    opts.wait_timeout_ms = 60000
    return opts


def check(condition, what):
    if not condition:
        sys.exit(f"ctypes_smoke: {what}")


def tensor_bytes(lib, attachment, name, dtype, shape):
    tensor, err = WcTensor(), WcError()
    rc = lib.wc_attachment_find(attachment, name.encode(), ctypes.byref(tensor), ctypes.byref(err))
    check(rc == WC_OK, f"{name}: {lib.wc_status_code_name(rc)}: {err.message.decode()}")
    check(tensor.dtype.decode() == dtype, f"{name}: dtype {tensor.dtype}")
    check([tensor.shape[d] for d in range(tensor.ndim)] == shape, f"{name}: shape")
    return ctypes.string_at(tensor.data, tensor.nbytes)


def main():
    if len(sys.argv) != 5:
        sys.exit(__doc__)
    lib_path, model_dir, runtime_dir, empty_runtime_dir = sys.argv[1:]
    lib = load(lib_path)

    attachment, err = ctypes.c_void_p(), WcError()
    opts = options(lib, model_dir, runtime_dir)
    rc = lib.wc_attach(ctypes.byref(opts), ctypes.byref(attachment), ctypes.byref(err))
    check(rc == WC_OK, f"wc_attach: {lib.wc_status_code_name(rc)}: {err.message.decode()}")
    try:
        check(lib.wc_attachment_source(attachment) == WC_SOURCE_DAEMON, "not from the daemon")
        check(lib.wc_attachment_tensor_count(attachment) == 4, "not 4 tensors")
        embed = struct.unpack("<32f", tensor_bytes(lib, attachment, "embed.weight", "F32", [4, 8]))
        check(list(embed) == [i * 0.25 - 3.0 for i in range(32)], f"embed.weight: {embed}")
        bias = struct.unpack("<10i", tensor_bytes(lib, attachment, "layers.0.mlp.bias", "I32", [10]))
        check(list(bias) == [1000 * i - 7 for i in range(10)], f"layers.0.mlp.bias: {bias}")
        pid = lib.wc_attachment_daemon_pid(attachment)
        check(pid > 0, f"daemon pid {pid}")
    finally:
        lib.wc_attachment_free(attachment)

    # No daemon under this runtime dir and on_missing=error: the exact code, by name too.
    missing, err = ctypes.c_void_p(), WcError()
    opts = options(lib, model_dir, empty_runtime_dir)
    opts.wait_timeout_ms = 0
    rc = lib.wc_attach(ctypes.byref(opts), ctypes.byref(missing), ctypes.byref(err))
    check(rc == WC_NO_DAEMON and err.code == WC_NO_DAEMON, f"no daemon: rc {rc}, {err.message}")
    check(lib.wc_status_code_name(rc) == b"no_daemon", f"name {lib.wc_status_code_name(rc)}")
    check(not missing, "an attachment despite the error")
    print(f"ctypes_smoke: 2 tensors match (daemon pid {pid}); no daemon -> no_daemon: "
          f"{err.message.decode()}")


if __name__ == "__main__":
    main()
