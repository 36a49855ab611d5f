#!/usr/bin/env python3
"""A transformers model whose post-processed weights live in a weightcache daemon
(examples/README.md, docs/python.md "transformers").

The post-processing fuses each layer's q/k/v projections into one ``qkv_proj`` and gate/up
into one ``gate_up_proj`` (the layout engines run). Run it twice:

    python3 examples/transformers_publish.py --demo            # a tiny random Llama
    python3 examples/transformers_publish.py --model /models/llama --tag llama-fused-v1

start 1: no daemon serves published:<tag> → load the checkpoint, fuse, publish (starting the
daemon with `weightcache serve --detach`). start 2: attach, build the fused structure on the
meta device, load_state_dict(assign=True): no checkpoint read, no fusion, no copy. Both print
the same logits. `weightcache stop --all` ends the daemon.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
import torch.nn.functional as F
from torch import nn

from weightcache.integrations import transformers as wct


class Rows(nn.Module):
    """q_proj (k_proj, v_proj) as rows [start, stop) of the fused qkv_proj: no parameter of its
    own. (transformers' attention calls the three projections one by one; an engine's own
    attention would call qkv_proj once.) The fused module is kept out of the module tree, so
    the state dict names its weight once, as qkv_proj.weight."""

    def __init__(self, fused: nn.Linear, start: int, stop: int) -> None:
        super().__init__()
        self._fused = [fused]
        self.start, self.stop = start, stop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = self._fused[0]
        bias = None if f.bias is None else f.bias[self.start:self.stop]
        return F.linear(x, f.weight[self.start:self.stop], bias)


class FusedMLP(nn.Module):
    """Llama's MLP with gate and up in one matmul: gate_up_proj = [gate; up]."""

    def __init__(self, mlp: nn.Module, fused: nn.Linear) -> None:
        super().__init__()
        self.gate_up_proj = fused
        self.down_proj = mlp.down_proj
        self.act_fn = mlp.act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act_fn(gate) * up)


def _fused_linear(parts, values: bool) -> nn.Linear:
    w = parts[0].weight
    fused = nn.Linear(w.shape[1], sum(p.weight.shape[0] for p in parts),
                      bias=parts[0].bias is not None, device=w.device, dtype=w.dtype)
    if values:
        fused.weight.copy_(torch.cat([p.weight for p in parts]))
        if fused.bias is not None:
            fused.bias.copy_(torch.cat([p.bias for p in parts]))
    return fused


def _fuse(model: nn.Module, values: bool) -> nn.Module:
    for layer in model.model.layers:
        attn = layer.self_attn
        parts = [attn.q_proj, attn.k_proj, attn.v_proj]
        fused = _fused_linear(parts, values)
        attn.qkv_proj = fused
        start = 0
        for name, part in zip(("q_proj", "k_proj", "v_proj"), parts):
            stop = start + part.weight.shape[0]
            setattr(attn, name, Rows(fused, start, stop))
            start = stop
        layer.mlp = FusedMLP(layer.mlp, _fused_linear([layer.mlp.gate_proj, layer.mlp.up_proj],
                                                      values))
    return model


def fuse(model: nn.Module) -> nn.Module:
    """post_process: the fused structure with the checkpoint's values."""
    return _fuse(model, values=True)


def fuse_structure(model: nn.Module) -> nn.Module:
    """build: the same structure on the meta device, no values (load() assigns them)."""
    return _fuse(model, values=False)


def write_tiny_llama(out: str, seed: int = 0, **overrides) -> str:
    """A random-weight Llama small enough for a test, saved with save_pretrained."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, **overrides)
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a transformers checkpoint dir (or a Hugging Face id)")
    ap.add_argument("--demo", action="store_true", help="write a tiny random Llama and use it")
    ap.add_argument("--tag", default="fused-qkv-v1", help="the publish tag (published:<tag>)")
    ap.add_argument("--runtime-dir", help="the daemons' runtime dir (default: weightcache's)")
    args = ap.parse_args()
    if args.demo:
        args.model = write_tiny_llama(os.path.join(tempfile.gettempdir(), "wc-tiny-llama"))
    if not args.model:
        ap.error("--model or --demo")
    identity = {"runtime_dir": args.runtime_dir} if args.runtime_dir else {}
    ids = torch.tensor([[1, 7, 42, 3, 99]])
    for start in (1, 2):
        began = time.perf_counter()
        model = wct.load(args.model, post_process=fuse, build=fuse_structure,
                         publish_tag=args.tag, device="cpu", **identity)
        took = (time.perf_counter() - began) * 1e3
        att = getattr(model, "weightcache_attachment", None)
        how = (f"attached published:{args.tag} at {att.socket_path}" if att is not None
               else f"loaded, fused and published as published:{args.tag}")
        with torch.no_grad():
            logits = model(ids).logits
        print(f"start {start}: {how} in {took:.1f} ms; logits[0, -1, :4] = "
              f"{logits[0, -1, :4].tolist()}")


if __name__ == "__main__":
    main()
