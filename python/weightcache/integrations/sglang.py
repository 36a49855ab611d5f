"""SGLang loads weightcache with one flag (docs/engines.md, "SGLang").

    python -m sglang.launch_server --model-path MODEL --load-format weightcache
    sglang.Engine(model_path=MODEL, load_format="weightcache")

``pip install weightcache`` registers ``register()`` under SGLang's ``sglang.srt.plugins``
entry point; SGLang calls it in each of its processes (main, scheduler, detokenizer). It adds
``weightcache`` to the ``--load-format`` choices and, through SGLang's hook registry, lets
``LoadConfig`` turn that name into ``WeightcacheModelLoader``: SGLang's ``get_model_loader``
dispatches a loader class given as the load format (``sglang.Engine(load_format=
WeightcacheModelLoader)`` works too, without the name).

The loader is SGLang's default loader with the rank's weights from (and into) weightcache, as
weightcache.integrations.vllm is vLLM's: on a hit the model is built on the meta device and
every parameter and buffer is the daemon's tensor (host tier: mapped copy-on-write; gpu tier:
zero-copy device memory), then SGLang's post-processing runs; on a miss SGLang's default loader
reads the disk and the rank's tensors, as its weight loading left them, are published for the
next start. Settings come from ``model_loader_extra_config`` (docs/engines.md "Settings").
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any, Dict, List, Optional

__all__ = ["register", "LOAD_FORMAT", "loader_class"]

LOAD_FORMAT = "weightcache"

_loader_class: Optional[type] = None


def register() -> None:
    """SGLang's ``sglang.srt.plugins`` entry point. Idempotent."""
    from sglang.srt.arg_groups import choices
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if LOAD_FORMAT not in choices.LOAD_FORMAT_CHOICES:
        choices.add_load_format_choices([LOAD_FORMAT])
    HookRegistry.register("sglang.srt.configs.load_config.LoadConfig._verify_load_format",
                          _verify_load_format, HookType.AROUND)


def _verify_load_format(original: Any, self: Any, *args: Any, **kwargs: Any) -> Any:
    """LoadConfig's check of its load format, which knows only SGLang's own names: ours
    becomes the loader class, which SGLang's get_model_loader instantiates."""
    if isinstance(self.load_format, str) and self.load_format.lower() == LOAD_FORMAT:
        self.load_format = loader_class()
        return None
    return original(self, *args, **kwargs)


def engine_identity(model_config: Any, settings: Dict[str, Any], *, platform: str, tp_size: int,
                    tp_rank: int, pp_size: int, pp_rank: int,
                    device_index: Optional[int] = None) -> Any:
    """The identity of one rank's tensors: the one rule, for the scheduler's load (its ranks
    from SGLang's process groups) and for ``launch-args`` (rank 0 of a config made from
    ``sglang.launch_server``'s flags; the layout tag does not depend on the rank)."""
    import sglang

    from . import _engine

    model_dir = os.path.abspath(model_config.model_path)
    if not os.path.isdir(model_dir):
        raise ValueError(f"load format {LOAD_FORMAT}: {model_config.model_path} is not a local "
                         f"checkpoint directory")
    hf = model_config.hf_config
    quant_cfg = getattr(hf, "quantization_config", None)
    return _engine.EngineIdentity(
        engine="sglang", engine_version=sglang.__version__, platform=platform,
        model_dir=model_dir, model_id=os.path.basename(os.path.normpath(model_dir)) or "model",
        checkpoint=_engine.checkpoint_identity(model_dir),
        dtype=str(model_config.dtype).replace("torch.", ""),
        revision=getattr(model_config, "revision", None) or "",
        quantization=getattr(model_config, "quantization", None) or "",
        quantization_config=json.dumps(quant_cfg, sort_keys=True, default=str)
        if quant_cfg else "",
        tp_size=tp_size, tp_rank=tp_rank, pp_size=pp_size, pp_rank=pp_rank, capture="loaded",
        load_config={"architectures": list(getattr(hf, "architectures", None) or []),
                     "disk_load_format": settings["load_format"]},
        runtime_dir=settings["runtime_dir"], namespace=settings["namespace"],
        device_index=device_index)


def loader_class() -> type:
    """WeightcacheModelLoader (SGLang is imported on the first call)."""
    global _loader_class
    if _loader_class is not None:
        return _loader_class

    import torch
    from sglang.srt.configs.load_config import LoadFormat
    from sglang.srt.distributed.parallel_state import (
        get_pp_group, get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size)
    from sglang.srt.model_loader import loader as sgl_loader
    from sglang.srt.model_loader.utils import set_default_torch_dtype

    from . import _engine

    log = logging.getLogger("sglang.weightcache")  # under SGLang's logger, like its own lines

    class WeightcacheModelLoader(sgl_loader.DefaultModelLoader):
        """SGLang's default loader, with the rank's weights from (and into) weightcache."""

        def __init__(self, load_config: Any) -> None:
            extra = load_config.model_loader_extra_config or {}
            if isinstance(extra, str):
                extra = json.loads(extra)
            self.settings, rest = _engine.parse_settings(dict(extra), LOAD_FORMAT)
            if self.settings["capture"] == "processed":
                raise ValueError(f"load format {LOAD_FORMAT}: SGLang has no reload of "
                                 f"post-processed weights; capture 'loaded' (or 'auto') only")
            inner = dataclasses.replace(load_config, model_loader_extra_config=rest)
            inner.load_format = LoadFormat(self.settings["load_format"])
            super().__init__(inner)
            self._publish_identity: Optional[_engine.EngineIdentity] = None
            self._published_note = ""

        def _identity(self, model_config: Any, device: torch.device) -> "_engine.EngineIdentity":
            platform = "cuda" if device.type == "cuda" else device.type
            pp = get_pp_group()
            return engine_identity(
                model_config, self.settings, platform=platform,
                tp_size=get_tensor_model_parallel_world_size(),
                tp_rank=get_tensor_model_parallel_rank(), pp_size=pp.world_size,
                pp_rank=pp.rank_in_group,
                device_index=(device.index if device.index is not None
                              else torch.cuda.current_device()) if platform == "cuda" else None)

        def load_model(self, *, model_config: Any, device_config: Any) -> Any:
            timer = _engine.Timer()
            target_device = torch.device(device_config.device)
            identity = self._identity(model_config, target_device)
            sd, why = _engine.attach_tensors(identity,
                                             wait_timeout=self.settings["wait_timeout"],
                                             on_mismatch=self.settings["on_mismatch"])
            if sd is not None:
                try:
                    model = self._from_cache(sd, model_config, target_device)
                    log.info("%s", _engine.Outcome("hit", timer.seconds(),
                                                   _engine.hit_detail(sd)).line("sglang",
                                                                                identity))
                    return model
                except _engine.UnusableCache as e:
                    if self.settings["on_unusable"] == "error":
                        raise
                    why = _engine.Miss("unusable", f"the cache does not fit this model: {e}")
                    del sd
            publish, self._published_note = _engine.publish_decision(self.settings, why)
            self._publish_identity = identity if publish else None
            model = super().load_model(model_config=model_config, device_config=device_config)
            detail = f"{why.reason}; loaded from disk; {self._published_note}"
            log.info("%s", _engine.Outcome(why.kind, timer.seconds(), detail).line("sglang",
                                                                                  identity))
            return model

        # DefaultModelLoader.load_model calls self.load_weights_and_postprocess: the tensors
        # are published between SGLang's weight loading and its post-processing.
        def load_weights_and_postprocess(self, model: Any, weights: Any,
                                         target_device: Any) -> None:
            sgl_loader.DefaultModelLoader.load_weights_only(model, weights, target_device)
            identity, self._publish_identity = self._publish_identity, None
            if identity is not None:
                self._published_note = self._publish(model, identity)
            sgl_loader.DefaultModelLoader.postprocess_weights(model, target_device)

        def _publish(self, model: Any, identity: "_engine.EngineIdentity") -> str:
            return _engine.publish_noted(model, identity, log, capture="loaded",
                                         serve_args=self.settings["serve_args"])

        def _from_cache(self, sd: Any, model_config: Any, target_device: Any) -> Any:
            if _engine.metadata_extra(sd).get("capture") != "loaded":
                raise _engine.UnusableCache("the cache was not captured after SGLang's weight "
                                            "loading")
            quant_config = sgl_loader._get_quantization_config(model_config, self.load_config)
            with set_default_torch_dtype(model_config.dtype):
                with torch.device("meta"):
                    model = sgl_loader._initialize_model(model_config, self.load_config,
                                                         quant_config)
                _engine.apply_tensors(model, sd)
                sgl_loader.DefaultModelLoader.postprocess_weights(model, target_device)
            model.weightcache_attachment = sd.attachment  # the mapping lives with the model
            return model.eval()

    _loader_class = WeightcacheModelLoader
    return _loader_class


def launch_args(server_argv: List[str]) -> Any:
    """The identity (rank 0's; every rank shares its layout tag) of the job that
    ``python -m sglang.launch_server <server_argv>`` would start, from SGLang's own parsing of
    those flags and its own model config (no model is loaded, no scheduler started)."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.server_args import prepare_server_args

    from . import _engine

    server_args = prepare_server_args(list(server_argv))
    extra = server_args.model_loader_extra_config or {}
    if isinstance(extra, str):
        extra = json.loads(extra) if extra.strip() else {}
    settings, _ = _engine.parse_settings(dict(extra), LOAD_FORMAT)
    model_config = ModelConfig.from_server_args(server_args)
    device = str(server_args.device or "cuda")
    return engine_identity(model_config, settings,
                           platform="cuda" if device.startswith("cuda") else device,
                           tp_size=server_args.tp_size, tp_rank=0,
                           pp_size=server_args.pp_size, pp_rank=0)


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m weightcache.integrations.sglang launch-args [--json] --model-path MODEL
    [launch_server flags]``: the ``weightcache launch`` command that starts this job's daemons
    before SGLang does (docs/engines.md "TP > 1 and the launcher")."""
    from ._engine import launch_args_main

    return launch_args_main("sglang", "python -m sglang.launch_server", launch_args, argv)


if __name__ == "__main__":
    raise SystemExit(main())
