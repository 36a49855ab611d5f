"""Tensors of the host tier, from a daemon and from the fallback: values equal what the
safetensors library reads (every dtype NumPy has), bytes equal for the rest, DLPack dtypes
and devices as documented (bf16 and fp8 preserved), read-only memory."""

from __future__ import annotations

import ctypes
import hashlib

import numpy as np
import pytest
from safetensors import safe_open

import weightcache

# safetensors dtype → (DLPack code, bits); docs/python.md has the same table.
DLPACK = {
    "BOOL": (6, 8), "U8": (1, 8), "I8": (0, 8), "U16": (1, 16), "I16": (0, 16),
    "U32": (1, 32), "I32": (0, 32), "U64": (1, 64), "I64": (0, 64), "F16": (2, 16),
    "F32": (2, 32), "F64": (2, 64), "C64": (5, 64), "BF16": (4, 16), "F8_E4M3": (10, 8),
    "F8_E5M2": (12, 8), "F8_E4M3FNUZ": (11, 8), "F8_E5M2FNUZ": (13, 8), "F8_E8M0": (14, 8),
}
NOT_NATIVE = {"F4", "F6_E2M3", "F6_E3M2"}  # sub-byte: exported as bytes only


def reference_arrays(model_dir, manifest):
    """What the safetensors library reads, for every tensor whose dtype NumPy has."""
    out = {}
    for name, m in manifest.items():
        with safe_open(str(model_dir / m["file"]), framework="np") as f:
            try:
                out[name] = f.get_tensor(name)
            except Exception:  # bf16, fp8, f4, f6: NumPy has no such dtype
                continue
    return out


@pytest.fixture(params=["daemon", "fallback"])
def attachment(request, checkpoint, runtime_dir, serve):
    model_dir, _ = checkpoint
    if request.param == "daemon":
        daemon = serve(model_dir)
        att = weightcache.attach(model_dir, tier="host", runtime_dir=runtime_dir)
        assert att.source == "daemon", att.source_reason
        assert att.daemon_pid == daemon.proc.pid
    else:
        att = weightcache.attach(model_dir, tier="host", runtime_dir=runtime_dir)
        assert att.source == "fallback"
        assert "no daemon" in att.source_reason
    return att


def test_table_matches_checkpoint(attachment, checkpoint):
    _, manifest = checkpoint
    assert attachment.tier == "host"
    assert attachment.device_uuid == "host"
    assert attachment.cuda_device == -1
    assert attachment.names() == sorted(manifest)
    assert len(attachment) == len(manifest)
    assert attachment.total_bytes == sum(m["nbytes"] for m in manifest.values())
    for t in attachment.tensors():
        m = manifest[t.name]
        assert (t.dtype, list(t.shape), t.nbytes) == (m["dtype"], m["shape"], m["nbytes"])
        assert t.device == (1, 0)
        assert t.__dlpack_device__() == (1, 0)
        assert t.name in attachment and attachment[t.name].data_ptr == t.data_ptr
    with pytest.raises(KeyError, match="no.such.tensor"):
        attachment["no.such.tensor"]


def test_values_equal_safetensors_for_numpy_dtypes(attachment, checkpoint):
    model_dir, manifest = checkpoint
    ref = reference_arrays(model_dir, manifest)
    numpy_dtypes = {manifest[n]["dtype"] for n in ref}
    assert numpy_dtypes == {"BOOL", "U8", "I8", "U16", "I16", "U32", "I32", "U64", "I64",
                            "F16", "F32", "F64", "C64"}
    for name, expected in ref.items():
        t = attachment[name]
        assert t.numpy_native
        a = t.numpy()
        assert a.dtype == expected.dtype and a.shape == expected.shape, name
        np.testing.assert_array_equal(a, expected, err_msg=name)
        # The same through the DLPack protocol.
        b = np.from_dlpack(t)
        assert b.dtype == expected.dtype
        np.testing.assert_array_equal(b, expected, err_msg=name)


def test_raw_bytes_equal_reference_for_every_dtype(attachment, checkpoint):
    _, manifest = checkpoint
    assert {m["dtype"] for m in manifest.values()} >= {"BF16", "F8_E4M3", "F8_E5M2", "F4",
                                                        "F6_E2M3"}
    for t in attachment.tensors():
        raw = np.asarray(t.raw())
        assert raw.dtype == np.uint8 and raw.shape == (t.nbytes,)
        assert hashlib.sha256(raw.tobytes()).hexdigest() == manifest[t.name]["sha256"], t.name


def test_non_numpy_dtypes_say_what_to_use(attachment):
    bf16 = next(t for t in attachment.tensors() if t.dtype == "BF16")
    assert not bf16.numpy_native
    with pytest.raises(TypeError, match=r"has dtype BF16, which NumPy does not represent; use "
                                        r"raw\(\)"):
        bf16.numpy()
    f6 = next(t for t in attachment.tensors() if t.dtype == "F6_E2M3")
    assert not f6.dlpack_native
    with pytest.raises(TypeError, match="no DLPack type of whole bytes per element"):
        f6.__dlpack__()


def test_host_memory_is_read_only(attachment):
    t = next(t for t in attachment.tensors() if t.dtype == "F32")
    a = t.numpy()
    assert not a.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        a[0] = 1.0
    raw = np.asarray(t.raw())
    assert not raw.flags.writeable
    assert not np.from_dlpack(t).flags.writeable


# ---- the DLPack capsule itself: what torch / CuPy / JAX receive ----------------------------------

class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32),
                ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p),
                ("flags", ctypes.c_uint64), ("dl_tensor", DLTensor)]


def read_capsule(capsule, name=b"dltensor_versioned"):
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype = ctypes.c_void_p
    get.argtypes = [ctypes.py_object, ctypes.c_char_p]
    return DLManagedTensorVersioned.from_address(get(capsule, name))


def test_dlpack_preserves_bf16_and_fp8(attachment):
    seen = set()
    for t in attachment.tensors():
        if t.dtype in NOT_NATIVE:
            continue
        capsule = t.__dlpack__(max_version=(1, 0))
        mt = read_capsule(capsule)
        dl = mt.dl_tensor
        assert (dl.dtype.code, dl.dtype.bits, dl.dtype.lanes) == (*DLPACK[t.dtype], 1), t.dtype
        assert (dl.device.device_type, dl.device.device_id) == (1, 0)
        assert dl.data == (t.data_ptr or None) and dl.byte_offset == 0
        assert [dl.shape[i] for i in range(dl.ndim)] == list(t.shape)
        assert mt.flags & 1, "host tier exports must carry DLPACK_FLAG_BITMASK_READ_ONLY"
        seen.add(t.dtype)
    assert {"BF16", "F8_E4M3", "F8_E5M2", "F8_E8M0"} <= seen


def test_dlpack_arguments(attachment):
    t = next(t for t in attachment.tensors() if t.dtype == "F32")
    with pytest.raises(BufferError, match="copy=True is not supported"):
        t.__dlpack__(copy=True)
    with pytest.raises(BufferError, match="unsupported dl_device"):
        t.__dlpack__(dl_device=(2, 0))
    legacy = t.__dlpack__()  # no max_version: the pre-1.0 capsule
    get = ctypes.pythonapi.PyCapsule_IsValid
    get.restype = ctypes.c_int
    get.argtypes = [ctypes.py_object, ctypes.c_char_p]
    assert get(legacy, b"dltensor") == 1


# ---- torch, where it is installed (the GPU machine; CI has no torch) -----------------------------

def test_torch_host_tier(attachment, checkpoint, runtime_dir):
    torch = pytest.importorskip("torch", reason="torch is not installed (CI): the device "
                                                "machine runs this test")
    model_dir, manifest = checkpoint
    expected = {}
    for name, m in manifest.items():
        with safe_open(str(model_dir / m["file"]), framework="pt") as f:
            try:
                expected[name] = f.get_tensor(name)
            except Exception:  # F6: torch has no such dtype
                continue
    assert {"BF16", "F8_E4M3", "F8_E5M2"} <= {manifest[n]["dtype"] for n in expected}
    sd = weightcache.load_state_dict(model_dir, device="cpu", runtime_dir=runtime_dir)
    assert sd.attachment.source == attachment.source
    for name, want in expected.items():
        got = sd[name]
        assert got.dtype == want.dtype, name
        if manifest[name]["dtype"] != "F4":  # packed x2: libraries differ on the shape
            assert got.shape == want.shape, name
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), name
    for t in attachment.tensors():
        if t.dtype in ("BF16", "F16", "F32", "I64"):
            x = torch.from_dlpack(t)
            assert x.data_ptr() == t.data_ptr  # zero-copy


def test_copy_on_write_host_mapping_writes_stay_in_this_process(checkpoint, runtime_dir,
                                                                serve):
    """host_mapping="copy_on_write" (an engine whose post-processing writes a tensor in place):
    the write lands in this process's own copy of the page; the daemon's cache, and every
    other client, still read the checkpoint's bytes."""
    model_dir, manifest = checkpoint
    serve(model_dir)
    name = next(n for n, m in manifest.items() if m["dtype"] == "F32" and m["nbytes"] >= 8)
    cow = weightcache.attach(model_dir, tier="host", runtime_dir=runtime_dir,
                             host_mapping="copy_on_write")
    assert cow.source == "daemon", cow.source_reason
    a = cow[name].numpy()
    original = a.copy()
    assert a.flags.writeable
    a[...] = 12345.0
    assert (cow[name].numpy() == 12345.0).all()  # this process sees its write
    plain = weightcache.attach(model_dir, tier="host", runtime_dir=runtime_dir)
    assert not plain[name].numpy().flags.writeable
    np.testing.assert_array_equal(plain[name].numpy(), original)  # the cache does not
    again = weightcache.attach(model_dir, tier="host", runtime_dir=runtime_dir,
                               host_mapping="copy_on_write")
    np.testing.assert_array_equal(again[name].numpy(), original)
    with pytest.raises(ValueError, match='host_mapping must be "read_only" or '
                                         '"copy_on_write", not "private"'):
        weightcache.attach(model_dir, tier="host", runtime_dir=runtime_dir,
                           host_mapping="private")
