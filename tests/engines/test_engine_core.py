"""The plugins' engine-independent core (weightcache.integrations._engine) against a real
daemon on the host tier, for what the tiny engine checkpoints cannot show: a quantized model's
identity. Runs in the engine tier's venv, which has torch."""

from __future__ import annotations

import torch

from weightcache.integrations import _engine

FP8_DYNAMIC = '{"activation_scheme": "dynamic", "quant_method": "fp8"}'
FP8_STATIC = '{"activation_scheme": "static", "quant_method": "fp8"}'


def identity(host, models, quantization_config: str) -> _engine.EngineIdentity:
    model = models["llama"]
    return _engine.EngineIdentity(
        engine="core-test", engine_version="1", platform="cpu", model_dir=model,
        model_id="tiny-llama", checkpoint=_engine.checkpoint_identity(model), dtype="float32",
        quantization="fp8", quantization_config=quantization_config,
        runtime_dir=str(host.runtime_dir))


def test_a_quantized_identity_publishes_attaches_and_tells_configs_apart(host, models):
    # The engines give the method's config as JSON text, not as the file that `weightcache
    # serve --quantization-config` reads: it is told apart by the layout tag.
    torch.manual_seed(0)
    module = torch.nn.Linear(16, 8)
    dynamic = identity(host, models, FP8_DYNAMIC)
    assert _engine.publish_module(module, dynamic) == 2
    sd, why = _engine.attach_tensors(dynamic, wait_timeout=10)
    assert why is None, why
    assert torch.equal(sd["weight"], module.weight) and torch.equal(sd["bias"], module.bias)
    assert sd.attachment.source == "daemon"

    static = identity(host, models, FP8_STATIC)
    assert static.layout_tag != dynamic.layout_tag
    assert static.describe()["quantization_config"] == FP8_STATIC
    other, why = _engine.attach_tensors(static, wait_timeout=10, on_mismatch="fallback")
    assert other is None
    assert why.kind == "mismatch" and "layout_tag" in why.reason, why
