"""Hugging Face transformers models over weightcache: load once, post-process once, publish the
result; every later start builds the model straight from the published tensors (docs/python.md,
"transformers").

    from weightcache.integrations import transformers as wct

    model = wct.load("/models/llama", post_process=fuse, build=fuse_structure,
                     publish_tag="fused-v1", device="cpu")

First start (no daemon serves ``published:fused-v1`` for this identity): the checkpoint is
loaded (attached when a ``serve --model`` daemon serves it, else read from disk, into memory
of this process), ``post_process(model)`` runs, and the result's state dict is published
(tied tensors once, ``publish_state_dict``), starting the daemon with ``serve --detach`` when
none runs. Next starts: the model's modules are built with their parameters on the meta device
(``from_config``, then ``build(model)``, the structural part of post_process), and
``load_state_dict(published, assign=True)`` puts the attached tensors in place: no copy, no
post_process, every process on the host sharing one copy.

The contract of the two hooks:

* ``post_process(model)`` changes the model in place (or returns the model to use): it may
  fuse, transpose, quantize, replace modules. Its *structure* must be deterministic: the same
  config gives the same module tree and the same parameter names, shapes and dtypes.
* ``build(model)`` makes the same structural change on a model whose parameters are on the
  meta device, computing nothing: it creates the modules and parameters post_process creates,
  of the same shapes and dtypes, on ``meta``. Not needed when post_process keeps the
  checkpoint's structure (values only).
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import weightcache
from weightcache.errors import DaemonTimeoutError, MismatchError, NoDaemonError

__all__ = ["load", "published_source", "METADATA_FORMAT"]

# What the integration writes as the published cache's metadata: its format, the model class
# and the config the tensors were made from, checked by every start that attaches.
METADATA_FORMAT = "weightcache.integrations.transformers/1"
# The attach keywords the caller may not set: the integration decides them.
_POLICY_KEYS = ("source", "on_missing", "on_mismatch", "checkpoint_fingerprint")


def published_source(tag: str) -> str:
    """The CacheConfig source of a publish tag: ``published:<tag>``."""
    return "published:" + tag


def _config_fields(config: Any) -> Dict[str, Any]:
    """The config as it shapes the model: its dict, less the bookkeeping that changes between
    saves (the path it came from, the library version)."""
    fields = config.to_dict()
    for key in list(fields):
        if key.startswith("_") or key == "transformers_version":
            del fields[key]
    return json.loads(json.dumps(fields, sort_keys=True, default=str))


def _metadata(model_class: str, config: Any) -> bytes:
    return json.dumps({"format": METADATA_FORMAT, "model_class": model_class,
                       "config": _config_fields(config)}, sort_keys=True).encode()


def _check_metadata(raw: bytes, model_class: str, config: Any, source: str,
                    socket_path: Optional[str]) -> None:
    """MismatchError naming every differing field when the published tensors were made for
    another model class or config than the one this start builds."""
    try:
        published = json.loads(bytes(raw).decode())
    except (UnicodeDecodeError, json.JSONDecodeError):
        published = None
    if not isinstance(published, dict) or published.get("format") != METADATA_FORMAT:
        raise MismatchError(
            f"{source} was not published by weightcache.integrations.transformers (its "
            f"metadata is not {METADATA_FORMAT}); publish it with load(..., publish_tag=...)",
            fields=[("metadata.format", str((published or {}).get("format")
                                            if isinstance(published, dict) else None),
                     METADATA_FORMAT)], daemon_socket=socket_path, socket_path=socket_path)
    fields: List[Tuple[str, str, str]] = []
    if published.get("model_class") != model_class:
        fields.append(("model_class", str(published.get("model_class")), model_class))
    theirs = published.get("config") or {}
    ours = _config_fields(config)
    for key in sorted(set(theirs) | set(ours)):
        if theirs.get(key) != ours.get(key):
            fields.append((f"config.{key}", json.dumps(theirs.get(key)),
                           json.dumps(ours.get(key))))
    if fields:
        listed = "; ".join(f"{f}: published {d}, this start {c}" for f, d, c in fields)
        raise MismatchError(
            f"{source} holds tensors of another model than this start builds ({listed}); "
            f"publish under another tag, or restart its daemon with --replace", fields=fields,
            daemon_socket=socket_path, socket_path=socket_path)


def _config_from_metadata(raw: bytes, source: str) -> Any:
    """The transformers config a published cache was made from (its metadata's)."""
    from transformers import AutoConfig

    try:
        published = json.loads(bytes(raw).decode())
        fields = dict(published["config"])
        model_type = fields.pop("model_type")
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError):
        raise ValueError(f"{source}: no checkpoint dir was given and the cache's metadata holds "
                         f"no transformers config ({METADATA_FORMAT}); pass the checkpoint "
                         f"dir") from None
    return AutoConfig.for_model(model_type, **fields)


@contextlib.contextmanager
def _parameters_on_meta(torch: Any) -> Iterator[None]:
    """Modules built inside get their parameters on the meta device (no memory, no init) and
    their buffers as usual: non-persistent buffers (rotary inv_freq) are in no state dict,
    so they must be real."""
    nn = torch.nn
    register = nn.Module.register_parameter

    def register_on_meta(module: Any, name: str, param: Any) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.to("meta"),
                                                    requires_grad=param.requires_grad)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def _model_class(config: Any, model_class: Any) -> Any:
    if model_class is not None:
        return model_class
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM


def _skeleton(model_cls: Any, config: Any, torch_dtype: Any) -> Any:
    import torch

    with _parameters_on_meta(torch):
        kwargs = {} if torch_dtype is None else {"torch_dtype": torch_dtype}
        model = model_cls.from_config(config, **kwargs)
    return model


def _on_meta(model: Any) -> List[str]:
    return [n for n, p in list(model.named_parameters()) + list(model.named_buffers())
            if p.device.type == "meta"]


def _resolve_dir(model_dir_or_id: Any) -> str:
    path = os.fspath(model_dir_or_id)
    if os.path.isdir(path):
        return os.path.abspath(path)
    if os.path.exists(path):
        raise ValueError(f"{path}: a checkpoint directory (config.json and *.safetensors) is "
                         f"expected, not a file")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise FileNotFoundError(f"{path}: no such directory (and huggingface_hub, which would "
                                f"fetch it as a model id, is not installed)") from None
    try:
        return snapshot_download(path, allow_patterns=["*.json", "*.safetensors", "*.model",
                                                       "*.txt"])
    except Exception as e:  # the hub's own errors: offline, no such repo, gated
        raise FileNotFoundError(f"{path}: no such directory, and fetching it as a Hugging Face "
                                f"model id failed: {e}") from e


def load(
    model_dir_or_id: Any,
    *,
    post_process: Optional[Callable[[Any], Any]] = None,
    build: Optional[Callable[[Any], Any]] = None,
    publish_tag: Optional[str] = None,
    tier: Optional[str] = None,
    device: Any = "cpu",
    model_class: Any = None,
    torch_dtype: Any = None,
    wait_timeout: float = 10.0,
    spawn: Any = True,
    **identity: Any,
) -> Any:
    """The model of ``model_dir_or_id`` (a checkpoint dir, or a Hugging Face model id fetched
    with huggingface_hub), post-processed, its weights shared through weightcache.

    publish_tag: the name of the post-processed layout (``published:<tag>``; change it when
    post_process changes). With it, a daemon serving that tag for this identity is attached
    (``build``, no post_process); without one, the post-processed weights are published
    (``spawn``: start the daemon with ``serve --detach`` when none runs; True, False or a list
    of extra serve flags). Without publish_tag: load and post-process only.
    tier / device: as load_state_dict ("cpu" → host tier; "cuda:N" → gpu tier). The host
    tier's attached tensors are read-only: a model built from them is for inference.
    model_class: the transformers class (default AutoModelForCausalLM). torch_dtype: passed to
    from_config / from the checkpoint. wait_timeout: seconds to wait for a daemon that is still
    awaiting its publisher (another start publishing) before loading the checkpoint.
    identity: the identity keywords of attach() (model_id — default the directory's name —,
    revision, tp_size, tp_rank, ..., runtime_dir, namespace).

    Raises MismatchError (its ``fields`` name every difference) when the daemon of this tag
    holds tensors of another config or model class; FileNotFoundError when there is neither a
    daemon nor a checkpoint; the weightcache.errors exception of a refused publish.
    """
    import torch

    for key in _POLICY_KEYS:
        if key in identity:
            raise TypeError(f"load() sets {key} itself; it is not a keyword of load()")
    from transformers import AutoConfig

    name = os.fspath(model_dir_or_id)
    local = os.path.isdir(name)
    identity.setdefault("model_id", os.path.basename(os.path.normpath(name)))
    why = "no publish_tag"

    if publish_tag is not None:
        source = published_source(publish_tag)
        try:
            sd = weightcache.load_state_dict(name, device, tier=tier, source=source,
                                             on_missing="error", wait_timeout=wait_timeout,
                                             **identity)
        except (NoDaemonError, DaemonTimeoutError) as e:
            sd = None  # nobody serves it yet (or its publisher is still at work)
            why = str(e)
        if sd is not None:
            att = sd.attachment
            if local and os.path.isfile(os.path.join(name, "config.json")):
                config = AutoConfig.from_pretrained(name)
            else:
                # No checkpoint here: the published cache carries the config it was made from.
                config = _config_from_metadata(att.metadata, source)
            model_cls = _model_class(config, model_class)
            class_name = getattr(model_cls, "__name__", str(model_cls))
            _check_metadata(att.metadata, class_name, config, source, att.socket_path)
            model = _skeleton(model_cls, config, torch_dtype)
            if build is not None:
                model = build(model) or model
            model.load_state_dict(sd, strict=True, assign=True)
            left = _on_meta(model)
            if left:
                raise ValueError(f"{source}: build(model) left {len(left)} tensors on the meta "
                                 f"device that the published state dict does not hold: "
                                 f"{', '.join(left[:8])}")
            model.eval()
            model.weightcache_attachment = att  # the mapping lives as long as the model
            return model

    try:
        model_dir = _resolve_dir(name)
    except FileNotFoundError as e:
        if publish_tag is None:
            raise
        raise FileNotFoundError(f"{e}; and no daemon serves {published_source(publish_tag)} "
                                f"for model_id {identity['model_id']!r}: {why}") from None
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise FileNotFoundError(f"{model_dir}: no config.json (a transformers checkpoint "
                                f"directory, written by save_pretrained, is expected)")
    config = AutoConfig.from_pretrained(model_dir)
    model_cls = _model_class(config, model_class)
    class_name = getattr(model_cls, "__name__", str(model_cls))

    # The checkpoint: attached when a `serve --model` daemon serves it, else read from disk;
    # copied into this process either way (post_process may change it in place).
    # on_mismatch="fallback": a daemon of this model_id that holds other tensors (the published
    # cache itself, when it awaits its publisher) is no reason not to read the checkpoint.
    sd = weightcache.load_state_dict(model_dir, device, tier=tier, on_missing="fallback",
                                     on_mismatch="fallback",
                                     **{k: v for k, v in identity.items() if k != "model_id"})
    model = _skeleton(model_cls, config, torch_dtype)
    with torch.no_grad():
        owned = {key: t.clone() for key, t in sd.items()}
    del sd
    model.load_state_dict(owned, strict=False, assign=True)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    left = _on_meta(model)
    if left:
        raise ValueError(f"{model_dir}: the checkpoint has no tensor for {len(left)} "
                         f"parameters of {class_name}: {', '.join(left[:8])}")
    model.eval()
    if post_process is not None:
        with torch.no_grad():
            model = post_process(model) or model
    if publish_tag is not None:
        weightcache.publish_state_dict(
            model.state_dict(), source=published_source(publish_tag),
            tier=tier or ("host" if torch.device(device).type == "cpu" else "gpu"),
            device=None if torch.device(device).type == "cpu" else torch.device(device).index,
            metadata=_metadata(class_name, config), spawn=spawn, **identity)
    return model
