"""Publishing an engine's own tensors into a `weightcache serve --source published:<tag>` daemon
(docs/publish.md, docs/python.md).

    weightcache.publish({"qkv_proj.weight": qkv, ...}, source="published:engine-v1",
                        model_id="llama-fused", tier="host", metadata=b"engine 1.0")
    weightcache.publish_state_dict(model.state_dict(), source=..., model_id=..., tier=...)

publish() copies every tensor into the daemon's arena (one region each); publish_state_dict()
publishes tied tensors (one storage under several names: same address, dtype, shape and
strides) once, the other names as aliases of the first, so that every attach maps all of them
onto the one region.

Tiers: the host tier copies from host arrays (NumPy, CPU torch tensors); the gpu tier copies
into the daemon's VMM arena on its GPU from CUDA tensors (torch, CuPy: any device, by DLPack's
device pointer) or from host arrays (a CPU tensor is allowed: the copy reads host memory). A
gpu-tier publish must run in a process whose device (``device=``) is the daemon's GPU.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from ._weightcache import AttachOptions
from ._weightcache import _publish
from .spawn import serve_detached

# The identity keywords publish() accepts: attach()'s, less the attach policies.
_PUBLISH_KEYS = (
    "model_id", "revision", "dtype", "quantization", "quantization_config", "tp_size", "tp_rank",
    "pp_size", "pp_rank", "ep_size", "ep_rank", "dp_size", "shard_rules", "layout_tag",
    "namespace", "runtime_dir", "socket", "device_inventory",
)

# Array dtype names (NumPy's dtype.name; torch's str(dtype) without "torch.") → safetensors.
_SAFETENSORS_DTYPES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8",
    "uint64": "U64", "uint32": "U32", "uint16": "U16", "uint8": "U8", "bool": "BOOL",
}


def _dtype_name(name: str, tensor: Any) -> str:
    dtype = getattr(tensor, "dtype", None)
    key = str(dtype)  # NumPy: "float32"; torch: "torch.bfloat16"
    key = key[len("torch."):] if key.startswith("torch.") else key
    spelled = _SAFETENSORS_DTYPES.get(key)
    if spelled is None:
        raise TypeError(f"tensor {name!r}: dtype {dtype} has no safetensors spelling "
                        f"(supported: {', '.join(sorted(_SAFETENSORS_DTYPES))})")
    return spelled


def _options(tier: str, device: Any, source: str, identity: Dict[str, Any],
             caller: str) -> AttachOptions:
    options = AttachOptions()
    options.tier = tier
    options.source = source
    if device is not None:
        options.device = str(device)
    for key, value in identity.items():
        if key not in _PUBLISH_KEYS:
            raise TypeError(f"{caller}() got an unexpected keyword argument {key!r}")
        if value is None:
            continue
        setattr(options, key, os.fspath(value) if isinstance(value, os.PathLike) else value)
    return options


def _metadata_bytes(metadata: Any) -> bytes:
    if metadata is None:
        return b""
    if isinstance(metadata, str):
        return metadata.encode()
    return bytes(metadata)


def _run(entries: List[Tuple[str, Any, str, str]], tier: str, device: Any, source: str,
         metadata: Any, timeout: float, identity: Dict[str, Any], caller: str,
         spawn: Union[bool, Sequence[str]] = False) -> int:
    options = _options(tier, device, source, identity, caller)
    if spawn is not False:
        # `serve --detach` first (spawn.py); a daemon already serving the identity is used.
        serve_detached(source=source, tier=tier, device=device, identity=identity,
                       extra_args=() if spawn is True else tuple(spawn))
    _synchronize_producers(entries)
    return _publish(options, entries, _metadata_bytes(metadata), float(timeout))


def _synchronize_producers(entries: List[Tuple[str, Any, str, str]]) -> None:
    """The copies run on the driver's legacy default stream: torch's pending work on the CUDA
    tensors' devices (a non-blocking stream of its own may still be writing them) is waited
    for first."""
    devices = set()
    for _, t, _, _ in entries:
        device = getattr(t, "device", None)
        if getattr(device, "type", None) == "cuda":
            devices.add(device)
    if devices:
        import torch  # only reached with torch CUDA tensors, so torch is there
        for device in devices:
            torch.cuda.synchronize(device)


def publish(
    tensors: Mapping[str, Any],
    *,
    source: str,
    tier: str = "gpu",
    device: Any = None,
    metadata: Optional[Any] = None,
    timeout: float = 60.0,
    spawn: Union[bool, Sequence[str]] = False,
    **identity: Any,
) -> int:
    """Publish `tensors` (name → contiguous array: NumPy or CPU torch for the host tier; CUDA
    tensors, or host arrays, for the gpu tier) into the daemon
    started with ``serve --source <source>`` for this identity; returns the tensor count.

    source: "published:<tag>". metadata: bytes (or str) served to every attaching client as
    ``Attachment.metadata``, at most 64 KiB. timeout: seconds for each exchange with the daemon
    (the commit's check reads every byte). identity: attach()'s identity keywords (model_id,
    revision, tp_size, tp_rank, ..., runtime_dir, namespace, socket). Every tensor gets a region
    of its own (publish_state_dict publishes tied tensors once). spawn: True (or a list of
    extra `serve` flags, e.g. ["--replace"]) starts the daemon first with ``weightcache serve
    ... --detach`` (weightcache.spawn), unless one already serves this identity.

    Raises ValueError for a non-contiguous tensor or one outside the memory the tier copies
    from (naming it),
    TypeError for an unsupported dtype, and the weightcache.errors exception of a refusal
    (NoDaemonError, AlreadyServedError, UnavailableError, InvalidArgumentError, ...).
    """
    entries = [(name, t, _dtype_name(name, t), "") for name, t in tensors.items()]
    return _run(entries, tier, device, source, metadata, timeout, identity, "publish", spawn)


def _storage_key(tensor: Any) -> Optional[Tuple[Any, ...]]:
    """(address, dtype, shape, strides) of an array, or None when its address is unknown."""
    if hasattr(tensor, "data_ptr"):  # torch
        return (tensor.data_ptr(), str(tensor.dtype), tuple(tensor.shape), tuple(tensor.stride()))
    interface = getattr(tensor, "__array_interface__", None) or getattr(
        tensor, "__cuda_array_interface__", None)
    if interface is None:
        return None
    return (interface["data"][0], str(tensor.dtype), tuple(tensor.shape),
            tuple(getattr(tensor, "strides", ()) or ()))


def publish_state_dict(
    state_dict: Mapping[str, Any],
    *,
    source: str,
    tier: str = "gpu",
    device: Any = None,
    metadata: Optional[Any] = None,
    timeout: float = 60.0,
    spawn: Union[bool, Sequence[str]] = False,
    **identity: Any,
) -> int:
    """publish() for a model's state dict: tied or shared tensors (the same memory at the same
    address, dtype, shape and strides: ``lm_head.weight is embed_tokens.weight``) are published
    once, under the first name in the dict's order, and every other name is an alias of it —
    an attach returns tensors that share that one region. Tensors that only overlap (views at
    other offsets or shapes) are published as copies of their own. Returns the name count.
    spawn: as publish().
    """
    first: Dict[Tuple[Any, ...], str] = {}
    entries = []
    for name, t in state_dict.items():
        dtype = _dtype_name(name, t)
        key = _storage_key(t)
        alias_of = ""
        if key is not None and int(key[0]) != 0:
            alias_of = first.setdefault(key, name)
            if alias_of == name:
                alias_of = ""
        entries.append((name, t, dtype, alias_of))
    return _run(entries, tier, device, source, metadata, timeout, identity, "publish_state_dict",
                spawn)
