"""The engine-independent core of the engine plugins (vLLM, SGLang; docs/engines.md).

An engine plugin does three things with it, in the worker process that owns one rank:

* ``EngineIdentity`` — what the cached tensors are right for: the engine and its version, the
  platform, the checkpoint's content identity on this host, the load-relevant config (dtype,
  quantization and its config, the ranks, anything else that changes the tensors) and the
  capture point. It becomes a published cache's CacheConfig: source
  ``published:<engine>-<version>-<platform>``, the CacheConfig fields for what has one, and a
  ``layout_tag`` digest of the rest (docs/engines.md "Identity").
* ``publish_module(module, identity)`` — after the engine's own load (miss): every parameter
  and buffer of the module, tied tensors once, into this rank's daemon, started detached when
  none runs. What cannot be published (a zero-element tensor) is recorded in the metadata and
  made again on a hit.
* ``attach_tensors(identity)`` + ``apply_tensors(module, attached)`` — on a later start (hit):
  the module was built with its tensors on the meta device; every one of them is replaced by
  the attached tensor of its name (zero-copy), tied names get one tensor object, and anything
  the module expects that the cache does not hold, or holds with another shape or dtype, is an
  ``UnusableCache`` error naming it — never a half-attached model.

Nothing here imports an engine: the plugins (weightcache.integrations.vllm, .sglang) and the
GPU proof (tests/gpu/engine_core_gpu.py) drive it with their own module builders.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import subprocess
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import weightcache
from weightcache.errors import DaemonTimeoutError, MismatchError, NoDaemonError

__all__ = [
    "METADATA_FORMAT",
    "SETTINGS",
    "parse_settings",
    "EngineIdentity",
    "UnusableCache",
    "Outcome",
    "Miss",
    "checkpoint_identity",
    "module_tensors",
    "publish_module",
    "attach_tensors",
    "apply_tensors",
]

METADATA_FORMAT = "weightcache.integrations.engine/1"
_TAG_CHARS = re.compile(r"[^A-Za-z0-9._-]+")


# The plugins' settings (vLLM's --model-loader-extra-config, SGLang's likewise), with their
# defaults: docs/engines.md "Settings". Any other key belongs to the engine's own loader.
SETTINGS: Dict[str, Any] = {
    "on_mismatch": "fallback", "on_unusable": "fallback", "wait_timeout": 30.0,
    "publish": True, "capture": "auto", "runtime_dir": None, "namespace": None,
    "serve_args": (), "load_format": "auto",
}
_CHOICES = {"on_mismatch": ("fallback", "error"), "on_unusable": ("fallback", "error"),
            "capture": ("auto", "loaded", "processed")}


def parse_settings(extra: Mapping[str, Any],
                   load_format: str) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """(the plugin's settings, the rest for the engine's own loader), each value checked:
    ValueError naming the key, the value and what is expected."""
    ours = dict(SETTINGS)
    rest: Dict[str, Any] = {}
    for key, value in extra.items():
        if key not in SETTINGS:
            rest[key] = value
            continue
        where = f"load format {load_format}: {key}={value!r}"
        if key in _CHOICES and value not in _CHOICES[key]:
            raise ValueError(f"{where}: one of {', '.join(map(repr, _CHOICES[key]))} is "
                             f"expected")
        if key == "wait_timeout":
            try:
                value = float(value)
            except (TypeError, ValueError):
                value = float("nan")
            if not 0 <= value < float("inf"):
                raise ValueError(f"{where}: seconds (a finite number >= 0) are expected")
        if key == "publish" and not isinstance(value, bool):
            raise ValueError(f"{where}: true or false is expected")
        if key == "serve_args" and (isinstance(value, str) or
                                    not all(isinstance(a, str) for a in value)):
            raise ValueError(f"{where}: a list of strings is expected")
        if key in ("runtime_dir", "namespace", "load_format") and value is not None and \
                not isinstance(value, str):
            raise ValueError(f"{where}: a string is expected")
        ours[key] = value
    return ours, rest


class UnusableCache(Exception):
    """The attached cache does not fit the module this start built (a tensor missing, extra, or
    of another shape or dtype): the plugin loads from disk instead, or raises when strict."""


def _tag(text: str) -> str:
    return _TAG_CHARS.sub("-", text).strip("-") or "unknown"


def checkpoint_identity(model_dir: str, cli: Optional[str] = None) -> Dict[str, str]:
    """The checkpoint's content identity on this host, without reading tensor data: its
    fingerprint (every shard's name, size and header) and its files digest (every shard's
    stat identity: a file rewritten in place is another checkpoint), as ``weightcache
    inspect`` computes them (the one home of that rule: checkpoint::Checkpoint)."""
    if cli is None:
        cli = weightcache.cli_path()
    done = subprocess.run([cli, "inspect", os.fspath(model_dir), "--json"],
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        from weightcache import errors

        message = done.stderr.strip().splitlines()[-1:] or [f"exit code {done.returncode}"]
        error = errors.InvalidCheckpointError(f"{model_dir}: {message[0]}")
        error.exit_code = done.returncode
        raise error
    info = json.loads(done.stdout)
    return {"fingerprint": info["fingerprint"], "files_digest": info["files_digest"]}


@dataclasses.dataclass
class EngineIdentity:
    """What a rank's cached tensors are right for. Two starts share a cache only when every
    field is equal (the daemon's CacheConfig and the metadata are both checked)."""

    engine: str  # "vllm", "sglang", "transformers"
    engine_version: str
    platform: str  # "cpu" | "cuda"
    model_dir: str
    model_id: str
    checkpoint: Mapping[str, str]  # checkpoint_identity()
    dtype: str = ""
    revision: str = ""
    quantization: str = ""
    quantization_config: str = ""  # canonical JSON, or ""
    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    ep_size: int = 1
    ep_rank: int = 0
    dp_size: int = 1
    # "loaded": the tensors after the engine's weight loading, before its post-processing
    # (which runs again on a hit); "processed": after it (re-run on a hit only for its
    # Python-side state, as the engine's own cache does). docs/engines.md "Capture".
    capture: str = "loaded"
    # The rest of what shapes the tensors (JSON-able): LoRA layout, overrides, ...
    load_config: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    # Where the daemons live (None: the library's default, WEIGHTCACHE_RUNTIME_DIR applies).
    runtime_dir: Optional[str] = None
    namespace: Optional[str] = None
    # The GPU the rank runs on (a CUDA index into the devices this process sees), for the gpu
    # tier; None on the host tier.
    device_index: Optional[int] = None

    @property
    def tier(self) -> str:
        return "gpu" if self.platform == "cuda" else "host"

    @property
    def source(self) -> str:
        return f"published:{_tag(self.engine)}-{_tag(self.engine_version)}-{_tag(self.platform)}"

    def _layout_fields(self) -> Dict[str, Any]:
        # The quantization method's config is the engine's (JSON text), not a file: it is
        # told apart through the layout tag, while the CacheConfig's own quantization config
        # (a file's digest, for `weightcache serve --quantization-config FILE`) stays empty.
        fields = {"capture": self.capture, "checkpoint": dict(self.checkpoint),
                  "load_config": json.loads(json.dumps(self.load_config, sort_keys=True,
                                                       default=str))}
        if self.quantization_config:
            fields["quantization_config"] = self.quantization_config
        return fields

    @property
    def layout_tag(self) -> str:
        blob = json.dumps(self._layout_fields(), sort_keys=True, separators=(",", ":"))
        return "engine-" + hashlib.sha256(blob.encode()).hexdigest()[:24]

    def identity_keywords(self) -> Dict[str, Any]:
        """attach()'s and publish()'s identity keywords."""
        out: Dict[str, Any] = {
            "model_id": self.model_id, "revision": self.revision or None,
            "dtype": self.dtype or None, "quantization": self.quantization or None,
            "tp_size": self.tp_size, "tp_rank": self.tp_rank, "pp_size": self.pp_size,
            "pp_rank": self.pp_rank, "ep_size": self.ep_size, "ep_rank": self.ep_rank,
            "dp_size": self.dp_size, "layout_tag": self.layout_tag,
            "runtime_dir": self.runtime_dir, "namespace": self.namespace,
        }
        return {k: v for k, v in out.items() if v is not None}

    def launch_command(self, cli: str = "weightcache") -> List[str]:
        """`weightcache launch` of this identity's daemons, every rank of the job, before the
        engine starts (publish-await: each daemon awaits its publisher, and the engine's first
        start publishes into it; docs/engines.md "TP > 1 and the launcher")."""
        if self.ep_size > self.tp_size:
            raise ValueError(f"expert parallelism over {self.ep_size} ranks spans data-parallel "
                             f"replicas, whose ranks `weightcache launch` does not place "
                             f"(its EP ranks divide the {self.tp_size} TP ranks)")
        argv = [cli, "launch", "--source", self.source, "--model-id", self.model_id,
                "--tier", self.tier, "--layout-tag", self.layout_tag,
                "--tp-size", str(self.tp_size), "--pp-size", str(self.pp_size)]
        if self.tier == "host":
            argv.append("--no-gpu")  # a CPU engine looks for its caches without a device
        optional = (("--revision", self.revision), ("--dtype", self.dtype),
                    ("--quantization", self.quantization),
                    ("--ep-size", str(self.ep_size) if self.ep_size > 1 else ""),
                    ("--dp-size", str(self.dp_size) if self.dp_size > 1 else ""),
                    ("--runtime-dir", self.runtime_dir or ""),
                    ("--namespace", self.namespace or ""))
        for flag, value in optional:
            if value:
                argv += [flag, value]
        return argv

    def describe(self) -> Dict[str, Any]:
        """Every field, as the metadata records it (and a mismatch is reported from)."""
        fields = dataclasses.asdict(self)
        for key in ("runtime_dir", "namespace", "device_index", "model_dir"):
            fields.pop(key)
        fields["load_config"] = self._layout_fields()["load_config"]
        return fields

    def rank_label(self) -> str:
        return f"tp{self.tp_rank}/{self.tp_size} pp{self.pp_rank}/{self.pp_size}"


@dataclasses.dataclass
class Outcome:
    """What a plugin's load did, for its one log line."""

    path: str  # "hit" | "miss" | "awaiting" | "timeout" | "mismatch" | "unusable"
    seconds: float
    detail: str = ""

    def line(self, engine: str, identity: EngineIdentity) -> str:
        return (f"weightcache: {engine} {identity.rank_label()} {identity.tier} tier: "
                f"{self.path}: {self.detail} ({self.seconds:.3f} s)")


def module_tensors(module: Any) -> Tuple[Dict[str, Any], List[str], Dict[str, Any]]:
    """(tensors, buffer names, empty tensors) of a module: every parameter and buffer under
    every name it is reachable by (tied names included, so that a hit ties them again),
    contiguous and on one device. Zero-element tensors are returned apart ({name: (kind,
    shape, dtype)}): there are no bytes to publish."""
    tensors: Dict[str, Any] = {}
    empties: Dict[str, Any] = {}
    buffers: List[str] = []
    named = [(n, p, "param") for n, p in module.named_parameters(remove_duplicate=False)]
    named += [(n, b, "buffer") for n, b in module.named_buffers(remove_duplicate=False)]
    for name, t, kind in named:
        if t is None:
            continue
        if t.device.type == "meta":
            raise UnusableCache(f"{name} is still on the meta device after the engine's load")
        if kind == "buffer":
            buffers.append(name)
        if t.numel() == 0:
            empties[name] = [kind, list(t.shape), str(t.dtype).replace("torch.", "")]
            continue
        tensors[name] = t.detach() if t.is_contiguous() else t.detach().contiguous()
    return tensors, buffers, empties


def _metadata(identity: EngineIdentity, buffers: Sequence[str],
              empties: Mapping[str, Any], extra: Mapping[str, Any]) -> bytes:
    return json.dumps({"format": METADATA_FORMAT, "identity": identity.describe(),
                       "buffers": sorted(buffers), "empty": dict(empties),
                       "extra": dict(extra)}, sort_keys=True).encode()


def publish_module(module: Any, identity: EngineIdentity, *, extra: Mapping[str, Any] = (),
                   serve_args: Sequence[str] = (), timeout: float = 600.0) -> int:
    """Publish every tensor of `module` (module_tensors) into this identity's daemon, starting
    it with ``serve --detach`` when none runs; returns the names published. Raises the
    weightcache.errors exception of a refusal (the plugin logs it and serves on)."""
    tensors, buffers, empties = module_tensors(module)
    if identity.tier == "host":
        tensors = {n: (t if t.device.type == "cpu" else t.to("cpu")) for n, t in tensors.items()}
    metadata = _metadata(identity, buffers, empties, dict(extra))
    if len(metadata) > (64 << 10):
        # The daemon's limit for the metadata blob: a model with tens of thousands of buffers.
        raise ValueError(f"the publish metadata is {len(metadata)} bytes (at most 65536)")
    from weightcache import publish_state_dict

    return publish_state_dict(
        tensors, source=identity.source, tier=identity.tier,
        device=identity.device_index if identity.tier == "gpu" else None, metadata=metadata,
        timeout=timeout, spawn=list(serve_args) if serve_args else True,
        **identity.identity_keywords())


# The client's reasons for a daemon awaiting its publisher (docs/client.md): one that nobody
# publishes to (a `weightcache launch` of the published source, or the daemon of a start that
# died before its commit), and a wait that ended while another start was publishing.
UNPUBLISHED = "awaits its publisher, and none is publishing"
AWAITING = "still awaiting its publisher"


@dataclasses.dataclass
class Miss:
    """Why attach_tensors found nothing to attach."""

    kind: str  # "miss" (no daemon, a stale one), "awaiting" (awaiting its publisher, none
    #            publishing, or one past the wait), "timeout" (loading or hung past the wait),
    #            "mismatch" (on_mismatch="fallback")
    reason: str

    @property
    def may_publish(self) -> bool:
        # A daemon that is loading, or holds the identity's lock but did not answer (hung), is
        # not published to: the publish would wait on it too.
        return self.kind != "timeout"


def publish_decision(settings: Mapping[str, Any], miss: Miss) -> Tuple[bool, str]:
    """(publish after this miss?, the log's note when not)."""
    if not settings["publish"]:
        return False, "not published (publish: false)"
    if not miss.may_publish:
        return False, "not published (its daemon did not answer)"
    return True, ""


def hit_detail(sd: Any) -> str:
    """The hit's part of the plugin's log line."""
    att = sd.attachment
    return (f"attached {len(sd)} tensors ({att.total_bytes} bytes) from {att.socket_path} in "
            f"{att.attach_ms:.1f} ms")


def publish_noted(module: Any, identity: EngineIdentity, log: Any, *, capture: str,
                  serve_args: Sequence[str] = ()) -> str:
    """publish_module, for a plugin after its disk load: the log's note of what happened. A
    refusal is logged as a warning and the engine serves on from its own copy."""
    from weightcache.errors import WeightcacheError

    timer = Timer()
    try:
        count = publish_module(module, identity, extra={"capture": capture},
                               serve_args=serve_args)
    except (WeightcacheError, ValueError, TypeError, OSError, UnusableCache) as e:
        log.warning("weightcache: publishing %s failed (%s); the engine serves on from its own "
                    "copy", identity.source, e)
        return f"not published: {e}"
    return f"published {count} tensors to {identity.source} in {timer.seconds():.3f} s"


def attach_tensors(identity: EngineIdentity, *, wait_timeout: float,
                   on_mismatch: str = "error") -> Tuple[Optional[Any], Optional[Miss]]:
    """(state dict, None): the attached tensors of this identity's daemon; or (None, Miss) when
    no daemon serves it (none, stale, awaiting a publisher with none publishing to it (at once:
    this start publishes), still awaiting one after `wait_timeout`, hung).
    A daemon of the same model holding other tensors raises MismatchError naming every
    differing field (on_mismatch="fallback": (None, Miss("mismatch", ...))); a cache whose
    metadata was not written by this module for this identity raises MismatchError too."""
    import torch

    device = (torch.device("cuda", identity.device_index) if identity.tier == "gpu"
              else torch.device("cpu"))
    try:
        sd = weightcache.load_state_dict(
            identity.model_dir, device, tier=identity.tier, source=identity.source,
            on_missing="error", on_mismatch="error", wait_timeout=float(wait_timeout),
            wait_for_publisher=False,
            # An engine's post-processing may write a few tensors in place (vLLM fills its
            # attention layers' KV-cache scales): a write copies that page into this process,
            # never into the cache (docs/engines.md "Shared, copy-on-write").
            host_mapping="copy_on_write" if identity.tier == "host" else None,
            **identity.identity_keywords())
    except NoDaemonError as e:
        return None, Miss("awaiting" if UNPUBLISHED in str(e) else "miss", str(e))
    except DaemonTimeoutError as e:
        # Awaiting its publisher all the wait long: the start that spawned it died before
        # its publish was committed (the daemon takes the next publisher), or is still
        # publishing (the daemon refuses a second publisher: this engine serves on).
        return None, Miss("awaiting" if AWAITING in str(e) else "timeout", str(e))
    except MismatchError as e:
        if on_mismatch == "fallback":
            return None, Miss("mismatch", str(e))
        raise
    try:
        _check_metadata(sd.attachment, identity)
    except MismatchError as e:
        if on_mismatch == "fallback":
            return None, Miss("mismatch", str(e))
        raise
    return sd, None


def _check_metadata(att: Any, identity: EngineIdentity) -> None:
    try:
        meta = json.loads(bytes(att.metadata).decode())
    except (UnicodeDecodeError, json.JSONDecodeError):
        meta = None
    ours = identity.describe()
    theirs = meta.get("identity") if isinstance(meta, dict) else None
    if not isinstance(meta, dict) or meta.get("format") != METADATA_FORMAT or \
            not isinstance(theirs, dict):
        raise MismatchError(
            f"{identity.source}: the cache at {att.socket_path} was not published by a "
            f"weightcache engine plugin (its metadata is not {METADATA_FORMAT})",
            fields=[("metadata.format", str(meta.get("format") if isinstance(meta, dict)
                                            else None), METADATA_FORMAT)],
            daemon_socket=att.socket_path, socket_path=att.socket_path)
    fields = [(k, json.dumps(theirs.get(k), sort_keys=True), json.dumps(ours[k], sort_keys=True))
              for k in sorted(ours) if theirs.get(k) != ours[k]]
    if fields:
        listed = "; ".join(f"{f}: cache {a}, this start {b}" for f, a, b in fields)
        raise MismatchError(f"{identity.source}: the cache at {att.socket_path} holds tensors "
                            f"for another start ({listed})", fields=fields,
                            daemon_socket=att.socket_path, socket_path=att.socket_path)


def _metadata_of(sd: Any) -> Dict[str, Any]:
    return json.loads(bytes(sd.attachment.metadata).decode())


def metadata_extra(sd: Any) -> Dict[str, Any]:
    """The `extra` a publisher gave publish_module (attach_tensors checked the format)."""
    return dict(_metadata_of(sd).get("extra") or {})


def apply_tensors(module: Any, sd: Any, *, allow_new: bool = False) -> int:
    """Put every attached tensor of `sd` into `module` (built on the meta device) under its
    name, as a parameter or a buffer as the publisher had it, tied names as one object; make
    the recorded zero-element tensors again. Raises UnusableCache naming what does not fit:
    a name the module does not have (unless `allow_new`: a capture after post-processing may
    hold tensors the freshly built module lacks), a shape or dtype other than the module's,
    or a tensor the module expects that the cache does not hold. Returns the names applied."""
    import torch

    meta = _metadata_of(sd)
    buffers = set(meta.get("buffers", ()))
    modules = dict(module.named_modules(remove_duplicate=False))
    expected: Dict[str, Any] = {}
    for name, t in list(module.named_parameters(remove_duplicate=False)) + \
            list(module.named_buffers(remove_duplicate=False)):
        if t is not None:
            expected[name] = t
    problems: List[str] = []
    for name, t in sd.items():
        want = expected.get(name)
        if want is None and not allow_new:
            problems.append(f"{name}: in the cache, not in the model")
        elif want is not None and (tuple(want.shape) != tuple(t.shape) or want.dtype != t.dtype):
            problems.append(f"{name}: cache {tuple(t.shape)} {t.dtype}, model "
                            f"{tuple(want.shape)} {want.dtype}")
    empties = meta.get("empty", {})
    missing = [n for n in expected if n not in sd and n not in empties]
    problems += [f"{n}: expected by the model, not in the cache" for n in missing]
    if problems:
        more = f" (and {len(problems) - 8} more)" if len(problems) > 8 else ""
        raise UnusableCache("; ".join(problems[:8]) + more)

    made: Dict[Tuple[Any, ...], Any] = {}

    def put(name: str, tensor: Any, kind: str) -> None:
        owner_name, _, leaf = name.rpartition(".")
        owner = modules.get(owner_name)
        if owner is None:
            raise UnusableCache(f"{name}: no module {owner_name!r} in the model")
        owner._parameters.pop(leaf, None)
        owner._buffers.pop(leaf, None)
        if kind == "param":
            owner.register_parameter(leaf, tensor)
        else:
            owner.register_buffer(leaf, tensor)

    for name, t in sd.items():
        kind = "buffer" if name in buffers else "param"
        # Tied names share one region, so one (address, dtype, shape, strides): one object.
        key = (kind, t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()))
        obj = made.get(key)
        if obj is None:
            obj = torch.nn.Parameter(t, requires_grad=False) if kind == "param" else t
            made[key] = obj
        put(name, obj, kind)
    device = next(iter(sd.values())).device if len(sd) else torch.device("cpu")
    for name, (kind, shape, dtype) in empties.items():
        t = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
        put(name, torch.nn.Parameter(t, requires_grad=False) if kind == "param" else t, kind)
    return len(sd) + len(empties)


def launch_args_main(engine: str, engine_command: str,
                     identity_of: Callable[[List[str]], EngineIdentity],
                     argv: Optional[Sequence[str]] = None) -> int:
    """``python -m weightcache.integrations.<engine> launch-args [--json] FLAGS``: prints the
    `weightcache launch` of the job that `engine_command FLAGS` would start (identity_of: the
    plugin's identity of rank 0, from the engine's own parsing of FLAGS). Exit 2 when the
    engine refuses the flags or the model is no local checkpoint."""
    import argparse
    import shlex
    import sys

    parser = argparse.ArgumentParser(
        prog=f"python -m weightcache.integrations.{engine}",
        description=f"Tools of weightcache's {engine} plugin (docs/engines.md).")
    sub = parser.add_subparsers(dest="command", required=True)
    cmd = sub.add_parser(
        "launch-args",
        help=f"print the `weightcache launch` command of the daemons a `--load-format "
             f"weightcache` start of this {engine} job looks for",
        description=f"Print the `weightcache launch` command that starts, before {engine} "
                    f"does, one daemon per rank of the job `{engine_command} FLAGS` would run, "
                    f"each awaiting its publisher: the engine's first start publishes into "
                    f"them, and every later start attaches. Give the same FLAGS as to "
                    f"{engine_command} (--load-format weightcache is implied). Add launch's "
                    f"own flags (--supervise, --gpu-budget, ...) to what it prints.")
    cmd.add_argument("--json", action="store_true",
                     help='print {"argv": [...], "identity": {...}} instead (first, before FLAGS)')
    cmd.add_argument("FLAGS", nargs="*", help=f"{engine_command}'s flags, passed on as they are")
    words = list(sys.argv[1:] if argv is None else argv)
    # FLAGS are the engine's, which argparse must not read as ours: only the command, --json
    # and --help go through the parser.
    if not words or words[0] != "launch-args" or words[1:2] in (["-h"], ["--help"]):
        parser.parse_args(words[:2])
    flags = words[1:]
    as_json = flags[:1] == ["--json"]
    if as_json:
        flags = flags[1:]
    try:
        identity = identity_of(flags)
        launch = identity.launch_command()
    except (ValueError, OSError) as e:
        print(f"launch-args: {e}", file=sys.stderr)
        return 2
    if as_json:
        print(json.dumps({"argv": launch, "identity": identity.describe()}, sort_keys=True))
    else:
        print(shlex.join(launch))
    return 0


class Timer:
    """Seconds since it was made (time.perf_counter)."""

    def __init__(self) -> None:
        self.start = time.perf_counter()

    def seconds(self) -> float:
        return time.perf_counter() - self.start
