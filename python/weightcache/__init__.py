"""weightcache: attach to LLM weights kept resident by a `weightcache serve` daemon.

    import weightcache
    att = weightcache.attach("/models/llama", tier="gpu", device=0, tp_size=2, tp_rank=1)
    w = torch.from_dlpack(att["model.embed_tokens.weight"])       # zero-copy, bf16 kept

    sd = weightcache.load_state_dict("/models/llama", device="cuda:0")
    model.load_state_dict(sd, assign=True)

No daemon → the weights are loaded from disk (``att.source == "fallback"``), unless
``on_missing="error"``; a daemon holding a different config → MismatchError naming each
field. Tensors, and every array exported from them, keep the attachment (and so the mapped
memory) alive; they stay valid after the daemon dies. docs/python.md has the details.
"""

from __future__ import annotations

import gc
import os
import sys
import warnings
from typing import TYPE_CHECKING, Any, Dict, Optional, Union

from . import errors
from ._weightcache import Attachment, AttachOptions, Tensor, dtype_names
from ._weightcache import _dlpack_capsules, _view_plan
from ._weightcache import attach as _attach
from .errors import (
    AlreadyServedError,
    DaemonTimeoutError,
    InvalidArgumentError,
    InvalidCheckpointError,
    MismatchError,
    NoDaemonError,
    OutOfMemoryError,
    PermissionDeniedError,
    ProtocolError,
    UnavailableError,
    WeightcacheError,
)

if TYPE_CHECKING:
    import torch

    from ._publishing import publish, publish_state_dict

__all__ = [
    "Attachment",
    "AttachOptions",
    "Tensor",
    "StateDict",
    "attach",
    "load_state_dict",
    "numpy_views",
    "publish",
    "publish_state_dict",
    "cli_path",
    "dtype_names",
    "errors",
    "WeightcacheError",
    "MismatchError",
    "NoDaemonError",
    "DaemonTimeoutError",
    "InvalidCheckpointError",
    "InvalidArgumentError",
    "PermissionDeniedError",
    "ProtocolError",
    "AlreadyServedError",
    "UnavailableError",
    "OutOfMemoryError",
]

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # publish() and publish_state_dict() (and the subprocess machinery they start daemons with)
    # are imported on first use: an engine that only attaches does not pay for them in its
    # `import weightcache` (part of a restart's time to weights, docs/benchmarks.md).
    if name in ("publish", "publish_state_dict"):
        from . import _publishing

        globals().update(publish=_publishing.publish,
                         publish_state_dict=_publishing.publish_state_dict)
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list:
    return sorted(set(globals()) | {"publish", "publish_state_dict"})

# The identity keywords attach() and load_state_dict() accept: AttachOptions' fields.
_IDENTITY_KEYS = (
    "model_id", "revision", "dtype", "quantization", "quantization_config", "tp_size", "tp_rank",
    "pp_size", "pp_rank", "ep_size", "ep_rank", "dp_size", "shard_rules", "layout_tag", "source",
    "checkpoint_fingerprint", "namespace", "runtime_dir", "socket", "device_inventory",
    "on_missing", "on_mismatch", "wait_timeout", "wait_for_publisher", "fallback_threads",
    "host_mapping",
)


def attach(
    model_dir: Union[str, os.PathLike],
    *,
    tier: str = "gpu",
    device: Union[int, str, None] = None,
    **identity: Any,
) -> Attachment:
    """Attach to the daemon serving this identity, or load from disk when there is none.

    model_dir: the checkpoint (dir or .safetensors file) — its fingerprint is part of the
    identity and it is the fallback's source. tier: "gpu" or "host". device: a CUDA index into
    the devices this process sees (CUDA_VISIBLE_DEVICES applies) or a GPU UUID (prefix); None:
    gpu tier → the current CUDA device, host tier → no GPU affinity. identity: the other
    CacheConfig and policy fields (tp_size, tp_rank, ..., revision, on_missing="fallback" |
    "error", on_mismatch="error" | "fallback", wait_timeout=seconds, runtime_dir, namespace,
    socket, ...), as `weightcache attach` takes them.

    Raises MismatchError, NoDaemonError, DaemonTimeoutError, InvalidCheckpointError, ...
    (weightcache.errors), each carrying socket_path and device_uuid.
    """
    options = AttachOptions()
    options.model_dir = os.fspath(model_dir)
    options.tier = tier
    if device is not None:
        options.device = str(device)
    for key, value in identity.items():
        if key not in _IDENTITY_KEYS:
            raise TypeError(f"attach() got an unexpected keyword argument {key!r}")
        if value is None:
            continue
        setattr(options, key, os.fspath(value) if isinstance(value, os.PathLike) else value)
    return _attach(options)


class StateDict(dict):
    """A plain ``dict[str, torch.Tensor]`` that also holds its Attachment (``.attachment``)."""

    attachment: Attachment


# safetensors dtype → torch dtype attribute name. F6_* has no torch dtype: bytes (uint8).
_TORCH_DTYPES = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "U16": "uint16", "I16": "int16",
    "U32": "uint32", "I32": "int32", "U64": "uint64", "I64": "int64", "F16": "float16",
    "BF16": "bfloat16", "F32": "float32", "F64": "float64", "C64": "complex64",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz", "F8_E8M0": "float8_e8m0fnu", "F4": "float4_e2m1fn_x2",
}


def _from_bytes(torch: Any, raw: "torch.Tensor", t: Tensor) -> "torch.Tensor":
    """View a uint8[nbytes] tensor as t's dtype and shape (no copy)."""
    name = _TORCH_DTYPES.get(t.dtype)
    dtype = getattr(torch, name, None) if name else None
    if dtype is None:
        return raw  # F6_*, or a torch without this dtype: the bytes, documented
    shape = list(t.shape)
    if t.dtype == "F4":  # torch packs two E2M1 values per element (…_x2)
        if not shape or shape[-1] % 2:
            return raw
        shape[-1] //= 2
    if t.nbytes == 0:
        return torch.empty(shape, dtype=dtype, device=raw.device)
    return raw.view(dtype).view(shape)


def _torch_tensor(torch: Any, t: Tensor) -> "torch.Tensor":
    if t.device[0] == 1:
        # Host tier: through NumPy's buffer view, which keeps the memory read-only-aware;
        # torch warns once that it cannot mark tensors read-only — they are (PROT_READ).
        import numpy as np

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.from_numpy(np.asarray(t.raw()))
        return _from_bytes(torch, raw, t)
    if t.dlpack_native:
        try:
            return torch.from_dlpack(t)
        except (BufferError, RuntimeError, TypeError):
            pass  # a dtype this torch cannot import (e.g. an fp8 code): through the bytes
    return _from_bytes(torch, torch.from_dlpack(t.raw()), t)


def load_state_dict(
    model_dir: Union[str, os.PathLike],
    device: Union[str, "torch.device", int] = "cuda:0",
    *,
    tier: Optional[str] = None,
    gpu: Union[int, str, None] = None,
    **identity: Any,
) -> StateDict:
    """A state_dict of torch tensors over the cache, ready for
    ``model.load_state_dict(sd, assign=True)`` (assign=True keeps them zero-copy).

    device: "cuda:N" (gpu tier on CUDA device N, zero-copy) or "cpu" (host tier, zero-copy,
    read-only tensors). tier: override, e.g. tier="host" with device="cuda:0" attaches the
    host tier and copies each tensor to the GPU (the staging use). gpu: the GPU the host tier's
    cache is keyed by (its device affinity), when the daemon was started with --device.
    identity: as attach(). Tensors keep the attachment alive (``sd.attachment``).
    """
    import torch  # not a dependency of the package: only this helper needs it

    dev = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if dev.type not in ("cuda", "cpu"):
        raise ValueError(f"device must be cuda[:N] or cpu, not {dev}")
    if tier is None:
        tier = "gpu" if dev.type == "cuda" else "host"
    if tier == "gpu":
        if dev.type != "cuda":
            raise ValueError("tier='gpu' needs a cuda device")
        where: Union[int, str, None] = dev.index
    else:
        where = gpu
    att = attach(model_dir, tier=tier, device=where, **identity)
    sd = StateDict()
    sd.attachment = att
    if dev.type == "cuda" and att.tier == "host":
        # Host tier staged to a GPU: the one copy per tensor, asked for.
        sd.update((name, x.to(dev)) for name, x in _torch_views(torch, att, {}).items())
    else:
        _torch_views(torch, att, sd)
    return sd


def _torch_views(torch: Any, att: Attachment,
                 out: Dict[str, Any]) -> Dict[str, "torch.Tensor"]:
    """Every tensor of `att` as a torch tensor, into the empty dict `out` in name order (and
    returned), built in bulk: one DLPack
    capsule per tensor made in one native call (bulk_bindings.cc, DlpackCapsules), imported by
    torch's C++ DLPack importer with one ``map`` per dtype — no Python-level call per tensor.
    Each tensor is its own zero-copy storage over the attachment's memory and holds the
    Attachment. A dtype this torch cannot import, and what no capsule can express (F4, F6,
    zero-byte tensors), take the per-tensor path."""
    groups, rest, order = _dlpack_capsules(att)
    # torch.from_dlpack's capsule branch ends in torch._C._from_dlpack; calling that directly
    # skips a Python frame per tensor.
    import_capsule = getattr(torch._C, "_from_dlpack", None) or torch.utils.dlpack.from_dlpack
    # 10,000 new tensor objects would run the cyclic GC's young-generation pass ~14 times over
    # the growing list (a third of the time, measured); they form no cycles.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        built: Dict[str, Any] = {}
        for dtype_name, names, capsules in groups:
            try:
                tensors = list(map(import_capsule, capsules))
            except (BufferError, RuntimeError, TypeError, ValueError):
                # A DLPack code this torch refuses (e.g. an fp8 code in an older torch): its
                # tensors through their bytes and Tensor.view(dtype), the same memory.
                tensors = [_torch_tensor(torch, att[n]) for n in names]
            if len(groups) == 1 and not rest:
                out.update(zip(names, tensors))  # one dtype: already in name order
                return out
            built.update(zip(names, tensors))
        for name in rest:
            built[name] = _torch_tensor(torch, att[name])
        out.update(zip(order, map(built.__getitem__, order)))
        return out
    finally:
        if gc_was_enabled:
            gc.enable()


# safetensors dtype → NumPy dtype, for numpy_views (the rest are bytes: raw()).
_NUMPY_DTYPES = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "U16": "<u2", "I16": "<i2", "U32": "<u4",
    "I32": "<i4", "U64": "<u8", "I64": "<i8", "F16": "<f2", "F32": "<f4", "F64": "<f8",
    "C64": "<c8",
}


def numpy_views(att: Attachment) -> Dict[str, Any]:
    """Every tensor of a host-tier Attachment as a read-only NumPy view, in name order, built
    in bulk like load_state_dict's torch tensors (one array per memory region, one
    ``as_strided`` per run of same-shaped, evenly spaced tensors). Dtypes NumPy lacks (BF16,
    FP8, F4, F6) come as their bytes, uint8[nbytes] (``raw()``). Each view keeps `att` alive."""
    import numpy as np

    if att.tier != "host":
        raise TypeError("numpy_views needs a host-tier Attachment (gpu memory: load_state_dict)")
    regions, runs, names, rest, order = _view_plan(att)
    bases = [np.asarray(r) for r in regions]
    as_strided = np.lib.stride_tricks.as_strided
    typed: Dict[Any, Any] = {}
    arrays: list = []
    for region, dtype_name, itemsize, count, shape, strides, offset, delta in runs:
        if dtype_name in _NUMPY_DTYPES:
            key = (region, dtype_name)
            src = typed.get(key)
            if src is None:
                u8 = bases[region]
                src = typed[key] = u8[: u8.size - u8.size % itemsize].view(
                    _NUMPY_DTYPES[dtype_name])
            unit = itemsize
            byte_strides = tuple(s * itemsize for s in strides)
        else:  # no NumPy dtype: the bytes, uint8[nbytes], as raw() gives them
            src, unit = bases[region], 1
            nbytes = itemsize
            for dim in shape:
                nbytes *= dim
            shape, byte_strides = (nbytes,), (1,)
        if count == 1 or not shape:
            # A slice and a reshape are C calls; as_strided is Python code, dearer for one
            # tensor (and iterating a 1-D array would give scalars, not views).
            numel = 1
            for dim in shape:
                numel *= dim
            for k in range(count):
                at = (offset + k * delta) // unit
                arrays.append(src[at:at + numel].reshape(shape))
        else:
            arrays.extend(as_strided(src[offset // unit:], (count,) + shape,
                                     (delta,) + byte_strides))
    for name in names[len(names) - rest:]:
        t = att[name]
        arrays.append(t.numpy() if t.numpy_native else np.asarray(t.raw()))
    built = dict(zip(names, arrays))
    return dict(zip(order, map(built.__getitem__, order)))


def cli_path() -> str:
    """The `weightcache` CLI: $WEIGHTCACHE_CLI, else the one `pip install .` put in this
    environment's scripts dir, else the first on PATH."""
    import shutil
    import sysconfig

    env = os.environ.get("WEIGHTCACHE_CLI")
    if env:
        return env
    candidates = [os.path.join(sysconfig.get_path("scripts"), "weightcache"),
                  os.path.join(os.path.dirname(sys.executable), "weightcache")]
    for c in candidates:
        if os.access(c, os.X_OK):
            return c
    found = shutil.which("weightcache")
    if found:
        return found
    raise FileNotFoundError(
        "the weightcache CLI is not installed here (pip install . installs it; or set "
        "WEIGHTCACHE_CLI)")
