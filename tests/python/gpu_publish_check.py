#!/usr/bin/env python3
"""Publishing post-processed weights to the gpu tier (issue 13), on a GPU; run by
scripts/gpu-python.sh, which prints its PASS/FAIL line.

  publish --runtime-dir R --tag T --out F
      a small random-weight Llama (transformers, bf16, cuda:0) post-processed as an engine
      would: q/k/v fused into `qkv_proj`, gate/up into `gate_up_proj`, the MLP weights (gate_up,
      down) converted to fp8 e4m3 with per-tensor scales; published with weightcache.publish
      (tier="gpu") to the `serve --tier gpu --source published:T` daemon of R; the logits of
      the post-processed forward below (over the publisher's own tensors) → F
  attach --runtime-dir R --tag T --reference F
      a fresh process: weightcache.load_state_dict of published:T (gpu tier, the daemon), the
      same forward over the attached tensors; logits must be bit-identical to F, and every
      tensor's data_ptr must be the attachment's own address for it (no copy)
  big --runtime-dir R --tag T [--gib 16]
      publishes GIB GiB of random bf16 device tensors (16 tensors) and prints one JSON line:
      the publish's wall time, the time of the same bytes copied device to device by torch,
      and their difference (the publish beyond the copy)

Every command prints one JSON line; a failed check raises (exit 1).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

PROMPT = [1, 306, 4966, 263, 931, 29892, 727, 471, 263, 2217, 5807, 297]
MODEL_ID = "llama-fused-fp8"


def config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1408,
                       num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                       max_position_embeddings=2048, tie_word_embeddings=False)


def to_fp8(torch, w):
    """Per-tensor scaled fp8 e4m3: (fp8 weight, float32 scale of one element)."""
    amax = w.abs().max().float().clamp(min=1e-12)
    scale = (amax / 448.0).reshape(1)
    return (w.float() / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), scale


def post_process(model, torch):
    """The engine's layout: fused qkv and gate_up, fp8 MLP weights with scales, contiguous."""
    sd = model.state_dict()
    cfg = model.config
    out = {"embed_tokens": sd["model.embed_tokens.weight"], "norm": sd["model.norm.weight"],
           "lm_head": sd["lm_head.weight"]}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        out[f"{i}.input_layernorm"] = sd[p + "input_layernorm.weight"]
        out[f"{i}.post_attention_layernorm"] = sd[p + "post_attention_layernorm.weight"]
        out[f"{i}.qkv_proj"] = torch.cat([sd[p + "self_attn.q_proj.weight"],
                                          sd[p + "self_attn.k_proj.weight"],
                                          sd[p + "self_attn.v_proj.weight"]], dim=0)
        out[f"{i}.o_proj"] = sd[p + "self_attn.o_proj.weight"]
        gate_up = torch.cat([sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]], dim=0)
        out[f"{i}.gate_up_proj"], out[f"{i}.gate_up_proj.scale"] = to_fp8(torch, gate_up)
        out[f"{i}.down_proj"], out[f"{i}.down_proj.scale"] = to_fp8(torch,
                                                                  sd[p + "mlp.down_proj.weight"])
    return {k: v.contiguous() for k, v in out.items()}


def forward(w, torch):
    """Llama over the post-processed tensors (fp8 dequantized with its scale); float32 logits
    of the prompt on the CPU."""
    import torch.nn.functional as F

    cfg = config()
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    hd = cfg.hidden_size // heads
    ids = torch.tensor(PROMPT, device="cuda:0")
    n = ids.numel()
    pos = torch.arange(n, device="cuda:0", dtype=torch.float32)
    # transformers 5 keeps it in rope_parameters; older releases as an attribute.
    theta = getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"]
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, device="cuda:0").float() / hd))
    freqs = torch.outer(pos, inv)
    cos = torch.cat([freqs, freqs], -1).cos().to(torch.bfloat16)
    sin = torch.cat([freqs, freqs], -1).sin().to(torch.bfloat16)

    def rms(x, g):
        v = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(v + cfg.rms_norm_eps)).to(torch.bfloat16) * g

    def rope(x):
        x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    def deq(name):
        return (w[name].float() * w[name + ".scale"]).to(torch.bfloat16)

    with torch.no_grad():
        x = w["embed_tokens"][ids]
        for i in range(cfg.num_hidden_layers):
            h = rms(x, w[f"{i}.input_layernorm"])
            qkv = h @ w[f"{i}.qkv_proj"].t()
            q, k, v = qkv.split([heads * hd, kv_heads * hd, kv_heads * hd], -1)
            q = rope(q.view(n, heads, hd).transpose(0, 1))
            k = rope(k.view(n, kv_heads, hd).transpose(0, 1))
            v = v.view(n, kv_heads, hd).transpose(0, 1)
            k = k.repeat_interleave(heads // kv_heads, 0)
            v = v.repeat_interleave(heads // kv_heads, 0)
            a = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True)[0]
            x = x + a.transpose(0, 1).reshape(n, heads * hd) @ w[f"{i}.o_proj"].t()
            h = rms(x, w[f"{i}.post_attention_layernorm"])
            gate, up = (h @ deq(f"{i}.gate_up_proj").t()).chunk(2, -1)
            x = x + (F.silu(gate) * up) @ deq(f"{i}.down_proj").t()
        logits = rms(x, w["norm"]) @ w["lm_head"].t()
    return logits.float().cpu()


def identity(args):
    return dict(source=f"published:{args.tag}", model_id=MODEL_ID, runtime_dir=args.runtime_dir)


def cmd_publish(args):
    import torch
    import weightcache
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(config()).to(torch.bfloat16).to("cuda:0")
    w = post_process(model, torch)
    del model
    start = time.perf_counter()
    n = weightcache.publish(w, tier="gpu", device=0, metadata=b"gpu_publish_check fp8",
                            **identity(args))
    seconds = time.perf_counter() - start
    logits = forward(w, torch)
    torch.save(logits, args.out)
    nbytes = sum(t.numel() * t.element_size() for t in w.values())
    print(json.dumps({"published": n, "bytes": nbytes, "publish_s": round(seconds, 4),
                      "fp8_tensors": sum(t.dtype == torch.float8_e4m3fn for t in w.values())}))


def cmd_attach(args):
    import torch
    import weightcache

    sd = weightcache.load_state_dict("unused", device="cuda:0", on_missing="error",
                                     **identity(args))
    att = sd.attachment
    if att.source != "daemon":
        raise SystemExit(f"attached from {att.source}, not the daemon")
    copied = [name for name, t in sd.items() if t.data_ptr() != att[name].data_ptr]
    if copied:
        raise SystemExit(f"{len(copied)} tensors are not the daemon's memory: {copied[:5]}")
    if bytes(att.metadata) != b"gpu_publish_check fp8":
        raise SystemExit(f"metadata {att.metadata!r}")
    logits = forward(sd, torch)
    reference = torch.load(args.reference)
    if not torch.equal(logits, reference):
        diff = (logits - reference).abs().max().item()
        raise SystemExit(f"logits differ from the publisher's (max abs diff {diff})")
    print(json.dumps({"attached": len(sd), "logits_equal": True, "zero_copy": True,
                      "fp8": str(sd["0.gate_up_proj"].dtype)}))


def cmd_big(args):
    import torch
    import weightcache

    gib = args.gib
    per = (gib << 30) // 16 // 2  # bf16 elements per tensor
    torch.manual_seed(1)
    w = {f"big.{i}": torch.randn(per, device="cuda:0", dtype=torch.bfloat16) for i in range(16)}
    torch.cuda.synchronize()
    # The same bytes copied device to device by torch: the copy's own time on this GPU.
    dst = torch.empty(per, device="cuda:0", dtype=torch.bfloat16)
    start = time.perf_counter()
    for t in w.values():
        dst.copy_(t)
    torch.cuda.synchronize()
    copy_s = time.perf_counter() - start
    del dst
    start = time.perf_counter()
    weightcache.publish(w, tier="gpu", device=0, timeout=600.0, **identity(args))
    publish_s = time.perf_counter() - start
    nbytes = 16 * per * 2
    print(json.dumps({"bytes": nbytes, "publish_s": round(publish_s, 4),
                      "torch_copy_s": round(copy_s, 4),
                      "torch_copy_gb_per_s": round(nbytes / copy_s / 1e9, 1),
                      "publish_gb_per_s": round(nbytes / publish_s / 1e9, 1),
                      "beyond_copy_ms": round((publish_s - copy_s) * 1000, 1)}))


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("publish", "attach", "big"):
        p = sub.add_parser(name)
        p.add_argument("--runtime-dir", required=True)
        p.add_argument("--tag", required=True)
        if name == "publish":
            p.add_argument("--out", required=True)
        if name == "attach":
            p.add_argument("--reference", required=True)
        if name == "big":
            p.add_argument("--gib", type=int, default=16)
    args = ap.parse_args()
    {"publish": cmd_publish, "attach": cmd_attach, "big": cmd_big}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
