"""vLLM loads weightcache with one flag (docs/engines.md, "vLLM").

    vllm serve MODEL --load-format weightcache
    LLM(model=MODEL, load_format="weightcache",
        model_loader_extra_config={"on_mismatch": "error"})   # optional settings

``pip install weightcache`` registers ``register()`` under vLLM's ``vllm.general_plugins``
entry point; vLLM calls it in every process it starts, and it adds the load format
``weightcache`` (``register_model_loader``) backed by ``WeightcacheModelLoader``.

In each worker (one TP/PP rank), the loader:

* builds the model with its tensors on the meta device, computes the rank's identity
  (weightcache.integrations._engine.EngineIdentity: vLLM's version and platform, the
  checkpoint's content identity, dtype, quantization, ranks, the load config that shapes the
  tensors) and attaches the rank's daemon, found by the physical GPU of the worker's device (the
  gpu tier) or on the host tier (a CPU engine);
* **hit**: every parameter and buffer is the daemon's tensor, zero-copy, tied ones as one
  tensor; vLLM's post-processing runs again (only its Python-side part when the cache holds
  post-processed tensors); the model has exactly the tensors, shapes and dtypes the engine
  expects, or the cache is not used;
* **miss** (no daemon, a hung one, a mismatch with ``on_mismatch`` "fallback"): vLLM's default
  loader loads from disk exactly as ``--load-format auto`` would, and the rank's tensors are
  published into a daemon started detached for them, so that the next start is a hit.

One log line per rank says which path was taken and how long it took. Settings
(``--model-loader-extra-config`` JSON, each optional: on_mismatch, on_unusable, wait_timeout,
publish, capture, runtime_dir, namespace, serve_args, load_format) are
weightcache.integrations._engine.SETTINGS, explained in docs/engines.md "Settings"; any other
key is passed to vLLM's default loader (``enable_multithread_load``, ...), which refuses what
it does not know.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any, Dict, List, Optional, Tuple

__all__ = ["register", "LOAD_FORMAT"]

LOAD_FORMAT = "weightcache"

_loader_class: Optional[type] = None
# id(model_config) → (identity, attached state dict) of a get_external_weight_memory call, taken
# by the load_model that follows in the same worker.
_probed: Dict[int, Tuple[Any, Any]] = {}


def register() -> None:
    """vLLM's ``vllm.general_plugins`` entry point: add the ``weightcache`` load format.
    Called once per vLLM process; a second call changes nothing."""
    from vllm.model_executor import model_loader

    registered = getattr(model_loader, "_LOAD_FORMAT_TO_MODEL_LOADER", {})
    if registered.get(LOAD_FORMAT) is _make_loader_class():
        return
    model_loader.register_model_loader(LOAD_FORMAT)(_make_loader_class())


def _platform() -> str:
    from vllm.platforms import current_platform

    return "cuda" if current_platform.is_cuda_alike() else \
        str(current_platform.device_type or "cpu")


def engine_identity(vllm_config: Any, settings: Dict[str, Any], model_dir: str, *,
                    tp_rank: int, pp_rank: int, dp_rank: int,
                    device_index: Optional[int] = None) -> Any:
    """The identity of one rank's tensors (weightcache.integrations._engine.EngineIdentity):
    the one rule, for the worker's load (its ranks from vLLM's process groups) and for
    ``launch-args`` (rank 0 of a config made from ``vllm serve``'s flags; the layout tag does
    not depend on the rank)."""
    import vllm

    from . import _engine

    model_config = vllm_config.model_config
    quant_cfg = getattr(model_config.hf_config, "quantization_config", None)
    parallel = vllm_config.parallel_config
    tp_size = parallel.tensor_parallel_size
    ep_size = (tp_size * parallel.data_parallel_size
               if getattr(parallel, "enable_expert_parallel", False) else 1)
    lora = getattr(vllm_config, "lora_config", None)
    return _engine.EngineIdentity(
        engine="vllm", engine_version=vllm.__version__, platform=_platform(),
        model_dir=model_dir,
        model_id=os.path.basename(os.path.normpath(model_config.model)) or "model",
        checkpoint=_engine.checkpoint_identity(model_dir),
        dtype=str(model_config.dtype).replace("torch.", ""),
        revision=model_config.revision or "",
        quantization=model_config.quantization or "",
        quantization_config=json.dumps(quant_cfg, sort_keys=True, default=str)
        if quant_cfg else "",
        tp_size=tp_size, tp_rank=tp_rank,
        pp_size=parallel.pipeline_parallel_size, pp_rank=pp_rank,
        ep_size=ep_size, ep_rank=(dp_rank * tp_size + tp_rank) if ep_size > 1 else 0,
        dp_size=parallel.data_parallel_size, capture=settings["capture"],
        load_config={
            "architectures": list(getattr(model_config, "architectures", None) or []),
            "hf_overrides": getattr(model_config, "hf_overrides", None),
            "lora": None if lora is None else {
                "max_lora_rank": getattr(lora, "max_lora_rank", None),
                "max_loras": getattr(lora, "max_loras", None)},
            "disk_load_format": settings["load_format"],
        },
        runtime_dir=settings["runtime_dir"], namespace=settings["namespace"],
        device_index=device_index)


def _make_loader_class() -> type:
    global _loader_class
    if _loader_class is not None:
        return _loader_class

    import torch
    from vllm.distributed import get_dp_group, get_pp_group, get_tensor_model_parallel_rank
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
    from vllm.model_executor.model_loader.utils import (initialize_model,
                                                        process_weights_after_loading)
    from vllm.platforms import current_platform
    from vllm.utils.torch_utils import set_default_torch_dtype

    from weightcache.errors import WeightcacheError

    from . import _engine

    # Under vLLM's logger, so the lines go where (and as) the engine's own go.
    log = logging.getLogger("vllm.weightcache")
    try:
        from vllm.model_executor.utils import weights_already_processed
    except ImportError:  # a vLLM without pre-processed reloads: "loaded" capture only
        weights_already_processed = None

    class WeightcacheModelLoader(DefaultModelLoader):
        """vLLM's default loader, with the rank's weights from (and into) weightcache."""

        def __init__(self, load_config: Any) -> None:
            extra = dict(load_config.model_loader_extra_config or {})
            self.settings, rest = _engine.parse_settings(extra, LOAD_FORMAT)
            inner = dataclasses.replace(load_config, load_format=self.settings["load_format"],
                                        model_loader_extra_config=rest)
            super().__init__(inner)
            self._publish_identity: Optional[_engine.EngineIdentity] = None
            self._published_note = ""

        # -- identity ------------------------------------------------------------------
        def _platform(self) -> str:
            return _platform()

        def _capture(self, model: Any) -> str:
            """Where this start's tensors are taken (docs/engines.md "Capture"): after vLLM's
            post-processing where every layer's quant method can take processed tensors back
            (weights_already_processed) and the platform keeps them as tensors; otherwise
            before it. On CPU the post-processing moves the linear weights into oneDNN
            handles, which are no tensors, so it is always "loaded" there."""
            capture = self.settings["capture"]
            if capture == "auto":
                capture = "loaded"
                if self._platform() == "cuda" and weights_already_processed is not None and all(
                        getattr(getattr(m, "quant_method", None),
                                "supports_pre_processed_weights", True)
                        for m in model.modules()):
                    capture = "processed"
            if capture == "processed" and weights_already_processed is None:
                raise ValueError(f"load format {LOAD_FORMAT}: capture='processed' needs a "
                                 f"vLLM with weights_already_processed (0.31 or later)")
            return capture

        def _identity(self, vllm_config: Any, model_config: Any) -> "_engine.EngineIdentity":
            pp = get_pp_group()
            return engine_identity(
                vllm_config, self.settings, self._model_dir(model_config),
                tp_rank=get_tensor_model_parallel_rank(), pp_rank=pp.rank_in_group,
                dp_rank=get_dp_group().rank_in_group,
                device_index=torch.cuda.current_device() if self._platform() == "cuda"
                else None)

        def _model_dir(self, model_config: Any) -> str:
            if os.path.isdir(model_config.model):
                return os.path.abspath(model_config.model)
            # A hub id: where vLLM's own download put it (the same files a disk load reads).
            from vllm.model_executor.model_loader.weight_utils import download_weights_from_hf

            return download_weights_from_hf(model_config.model, self.load_config.download_dir,
                                            ["*.safetensors"], model_config.revision)

        def _build_on_meta(self, vllm_config: Any, model_config: Any, prefix: str) -> Any:
            with set_default_torch_dtype(model_config.dtype):
                with torch.device("meta"):
                    return initialize_model(vllm_config=vllm_config, model_config=model_config,
                                            prefix=prefix)

        # -- vLLM's loader interface -----------------------------------------------------
        def get_external_weight_memory(self, vllm_config: Any) -> int:
            # The gpu tier's attached weights are memory the engine uses but torch did not
            # allocate: the KV cache is sized with them counted, as a disk load's would be.
            # The host tier holds no device memory (a CPU engine sizes its KV cache by
            # VLLM_CPU_KVCACHE_SPACE).
            if not current_platform.is_cuda_alike():
                return 0
            model_config = vllm_config.model_config
            try:
                identity = self._identity(vllm_config, model_config)
                sd, _ = _engine.attach_tensors(identity, wait_timeout=0.0,
                                               on_mismatch="fallback")
            except (WeightcacheError, ValueError, OSError) as e:
                log.warning("weightcache: cannot ask the daemon for its size (%s); counting "
                            "no external weights", e)
                return 0
            if sd is None:
                return 0
            # vLLM asks this on a loader of its own before it loads: the identity (a CLI call)
            # and the attachment are kept for this process's load_model, not made twice.
            _probed[id(model_config)] = (identity, sd)
            return int(sd.attachment.total_bytes)

        def load_model(self, vllm_config: Any, model_config: Any, prefix: str = "") -> Any:
            timer = _engine.Timer()
            probed = _probed.pop(id(model_config), None)
            if probed is not None:  # get_external_weight_memory attached it already
                (identity, sd), why = probed, None
            else:
                identity = self._identity(vllm_config, model_config)
                # on_mismatch="error" (strict): the MismatchError goes to the engine as it is.
                sd, why = _engine.attach_tensors(identity,
                                                 wait_timeout=self.settings["wait_timeout"],
                                                 on_mismatch=self.settings["on_mismatch"])
            if sd is not None:
                try:
                    model = self._from_cache(sd, identity, model_config, vllm_config, prefix)
                    log.info("%s", _engine.Outcome("hit", timer.seconds(),
                                                   _engine.hit_detail(sd)).line("vllm", identity))
                    return model
                except _engine.UnusableCache as e:
                    if self.settings["on_unusable"] == "error":
                        raise
                    why = _engine.Miss("unusable", f"the cache does not fit this model: {e}")
                    del sd
            publish, self._published_note = _engine.publish_decision(self.settings, why)
            self._publish_identity = identity if publish else None
            model = super().load_model(vllm_config=vllm_config, model_config=model_config,
                                       prefix=prefix)
            if self._publish_identity is not None:  # "processed": after the post-processing
                self._published_note = self._publish(model, identity)
                self._publish_identity = None
            log.info("%s", _engine.Outcome(why.kind, timer.seconds(),
                                 f"{why.reason}; loaded from disk; {self._published_note}").line(
                                     "vllm", identity))
            return model

        def load_weights(self, model: Any, model_config: Any) -> None:
            super().load_weights(model, model_config)
            identity = self._publish_identity
            if identity is not None and self._capture(model) == "loaded":
                # After vLLM's weight loading (sharded, fused as the model's load_weights
                # makes them), before its post-processing, which every hit runs again.
                self._published_note = self._publish(model, identity)
                self._publish_identity = None

        def _publish(self, model: Any, identity: "_engine.EngineIdentity") -> str:
            return _engine.publish_noted(model, identity, log, capture=self._capture(model),
                                         serve_args=self.settings["serve_args"])

        def _from_cache(self, sd: Any, identity: "_engine.EngineIdentity", model_config: Any,
                        vllm_config: Any, prefix: str) -> Any:
            device = vllm_config.device_config.device if self.load_config.device is None \
                else self.load_config.device
            target_device = torch.device(device)
            model = self._build_on_meta(vllm_config, model_config, prefix)
            capture = self._capture(model)
            cached = _engine.metadata_extra(sd).get("capture")
            try:
                if cached != capture:
                    raise _engine.UnusableCache(f"the cache holds tensors captured {cached!r}, "
                                                f"this start captures {capture!r}")
                with set_default_torch_dtype(model_config.dtype):
                    _engine.apply_tensors(model, sd, allow_new=capture == "processed")
            except _engine.UnusableCache:
                _forget_layers(model, vllm_config)
                raise
            with set_default_torch_dtype(model_config.dtype):
                if capture == "processed":
                    with weights_already_processed():
                        process_weights_after_loading(model, model_config, target_device)
                else:
                    process_weights_after_loading(model, model_config, target_device)
            # The attachment (the mapping) lives as long as the model.
            model.weightcache_attachment = sd.attachment
            return model.eval()

    def _forget_layers(model: Any, vllm_config: Any) -> None:
        """vLLM registers every attention layer by name when a model is built (the static
        forward context) and refuses a second layer of a name: before the disk load builds the
        model again, the layers of the meta model that did not fit the cache are let go."""
        context = getattr(vllm_config.compilation_config, "static_forward_context", None)
        if not isinstance(context, dict):
            return
        mine = {id(m) for m in model.modules()}
        for name in [n for n, layer in context.items() if id(layer) in mine]:
            del context[name]

    _loader_class = WeightcacheModelLoader
    return _loader_class


def launch_args(engine_argv: List[str]) -> Any:
    """The identity (rank 0's; every rank shares its layout tag) of the job that ``vllm serve
    <engine_argv>`` would start, made from vLLM's own parsing of those flags and its own config
    (no model is loaded, no worker started). ``--model-loader-extra-config`` is read as the
    plugin reads it (runtime_dir, namespace, capture, load_format)."""
    from vllm.engine.arg_utils import EngineArgs

    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:  # older vLLM
        from vllm.utils import FlexibleArgumentParser

    from . import _engine

    parser = FlexibleArgumentParser(prog="vllm serve")
    parser.add_argument("model_tag", nargs="?", help="the model, as vllm serve's first argument")
    parser = EngineArgs.add_cli_args(parser)
    args = parser.parse_args(engine_argv)
    if args.model_tag:
        args.model = args.model_tag
    engine_args = EngineArgs.from_cli_args(args)
    extra = engine_args.model_loader_extra_config or {}
    if isinstance(extra, str):
        extra = json.loads(extra)
    settings, _ = _engine.parse_settings(dict(extra), LOAD_FORMAT)
    vllm_config = engine_args.create_engine_config()
    model_dir = vllm_config.model_config.model
    if not os.path.isdir(model_dir):
        raise ValueError(f"{model_dir} is not a local checkpoint directory (launch-args needs "
                         f"the files the engine will read)")
    return engine_identity(vllm_config, settings, os.path.abspath(model_dir), tp_rank=0,
                           pp_rank=0, dp_rank=0)


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m weightcache.integrations.vllm launch-args [--json] MODEL [vllm serve flags]``:
    the ``weightcache launch`` command that starts this job's daemons before vLLM does
    (docs/engines.md "TP > 1 and the launcher")."""
    from ._engine import launch_args_main

    return launch_args_main("vllm", "vllm serve MODEL", launch_args, argv)


if __name__ == "__main__":
    raise SystemExit(main())
