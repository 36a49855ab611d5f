"""Small synthetic checkpoints, one per built-in sharding rule set, for the rank-sharding tests.

Each model has its architecture's real tensor names (Hugging Face checkpoint layout) and shape
ratios (attention heads vs KV heads, head_dim, intermediate sizes, a vocabulary that is not a
multiple of 64, routed/shared experts, MLA ranks, fp8 128x128 block scales), and a layer count
that does not divide PP=2. Files are written by the real `safetensors` library
(`safetensors.serialize_file`, the Rust writer; the binding writes BF16 and F8_E4M3 from raw
bytes, which NumPy alone cannot). Content is deterministic: the bytes of every tensor come from
a generator seeded by the model name and the tensor name.

    write_model("llama", out_dir) -> out_dir (config.json + *.safetensors [+ index])

Sizes stay below ~3 MB per model.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import numpy as np
import safetensors

# Header dtype -> (TensorSpec dtype name, bytes per element).
_DTYPES = {
    "BF16": ("bfloat16", 2),
    "F16": ("float16", 2),
    "F32": ("float32", 4),
    "F8_E4M3": ("float8_e4m3fn", 1),
}

# The seven built-in rule sets (issue 12) and the synthetic model of each.
MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "deepseek_v3")

# config.json of each synthetic model. Comments give what each choice exercises.
CONFIGS = {
    # GQA 8:2 (tp 4 and 8 replicate KV heads); untied lm_head; vocab 1000 (padded 1024);
    # 3 layers over 2 shards (index.json).
    "llama": dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=64,
                  num_attention_heads=8, num_key_value_heads=2, intermediate_size=128,
                  num_hidden_layers=3, vocab_size=1000, tie_word_embeddings=False,
                  rms_norm_eps=1e-5),
    # MHA (kv heads = heads = 4; tp 8 refused: 4 % 8 != 0); tied embeddings without lm_head
    # (the embedding is held by the first and the last stage); vocab 130 (padded 192: at tp 4
    # and 8 the last ranks hold fewer rows than the per-rank size, or none).
    "mistral": dict(model_type="mistral", architectures=["MistralForCausalLM"],
                    hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                    head_dim=16, intermediate_size=96, num_hidden_layers=3, vocab_size=130,
                    tie_word_embeddings=True, sliding_window=4096, rms_norm_eps=1e-5),
    # q/k/v biases; 6 heads (tp 4 and 8 refused: 6 % tp != 0), 2 KV heads; tied, no lm_head
    # (Qwen2-0.5B style); 5 layers.
    "qwen2": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=96,
                  num_attention_heads=6, num_key_value_heads=2, intermediate_size=192,
                  num_hidden_layers=5, vocab_size=1000, tie_word_embeddings=True,
                  rms_norm_eps=1e-6),
    # q_norm/k_norm; explicit head_dim 16 with heads*head_dim (128) != hidden (64); GQA 8:4
    # (tp 8 replicates each KV head twice); untied lm_head.
    "qwen3": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_size=64,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=16,
                  intermediate_size=128, num_hidden_layers=3, vocab_size=1000,
                  tie_word_embeddings=False, rms_norm_eps=1e-6),
    # 4 local experts w1/w2/w3, block_sparse_moe.gate router.
    "mixtral": dict(model_type="mixtral", architectures=["MixtralForCausalLM"],
                    hidden_size=64, num_attention_heads=8, num_key_value_heads=2,
                    intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
                    num_hidden_layers=3, vocab_size=1000, tie_word_embeddings=False,
                    rms_norm_eps=1e-5),
    # 8 experts gate/up/down_proj, mlp.gate router, q_norm/k_norm, head_dim 16.
    "qwen3_moe": dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"],
                      hidden_size=64, num_attention_heads=8, num_key_value_heads=4,
                      head_dim=16, intermediate_size=128, moe_intermediate_size=32,
                      num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1,
                      mlp_only_layers=[], num_hidden_layers=3, vocab_size=1000,
                      tie_word_embeddings=False, rms_norm_eps=1e-6),
    # MLA (q_lora/kv_lora ranks, nope/rope/v head dims in DeepSeek-V3's 128/64/128 ratio),
    # fp8 weights with 128x128 float32 block scales, 1 dense layer then MoE layers with a
    # shared expert, 4 routed experts, and one MTP layer (index 3 = num_hidden_layers) that
    # vLLM's main model does not load. Per-rank parts are whole 128-blocks for q_b_proj
    # (8 heads * 192 rows) up to tp 4, for the dense MLP and the shared experts (512 =
    # 2 * 256) up to tp 4, for the routed experts (256) up to moe_tp 2: tp 8, and tp 4 with
    # ep 1, are refused on block alignment.
    "deepseek_v3": dict(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"],
                        hidden_size=128, num_attention_heads=8, num_key_value_heads=8,
                        q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=128,
                        qk_rope_head_dim=64, v_head_dim=128, intermediate_size=512,
                        moe_intermediate_size=256, n_routed_experts=4, n_shared_experts=2,
                        num_experts_per_tok=2, first_k_dense_replace=1, moe_layer_freq=1,
                        num_hidden_layers=3, num_nextn_predict_layers=1, vocab_size=1000,
                        tie_word_embeddings=False, rms_norm_eps=1e-6,
                        quantization_config=dict(quant_method="fp8", fmt="e4m3",
                                                 activation_scheme="dynamic",
                                                 weight_block_size=[128, 128])),
}

# The (model, tp, ep) jobs the engines refuse on these configs (any PP), worked out by hand.
REFUSED = {
    ("mistral", 8, 1): "num_attention_heads 4 % tp 8",
    ("qwen2", 4, 1): "num_attention_heads 6 % tp 4",
    ("qwen2", 8, 1): "num_attention_heads 6 % tp 8",
    ("deepseek_v3", 4, 1): "routed experts 256 rows / moe_tp 4 = 64: not whole 128-blocks",
    ("deepseek_v3", 8, 1): "dense MLP 512 / tp 8 = 64: not whole 128-blocks",
    ("deepseek_v3", 8, 2): "dense MLP 512 / tp 8 = 64: not whole 128-blocks",
    ("deepseek_v3", 8, 4): "dense MLP 512 / tp 8 = 64: not whole 128-blocks",
}

# How many shard files each model is written as (several: index.json with a weight_map).
SHARDS = {"llama": 2, "mixtral": 2, "deepseek_v3": 3}

FP8_BLOCK = 128


def _head_dim(c: dict) -> int:
    return c.get("head_dim", c["hidden_size"] // c["num_attention_heads"])


def _llama_attention(c: dict, p: str, *, bias: bool, qk_norm: bool) -> list:
    h, hd = c["hidden_size"], _head_dim(c)
    nq, nkv = c["num_attention_heads"], c["num_key_value_heads"]
    t = [(f"{p}.self_attn.q_proj.weight", "BF16", [nq * hd, h]),
         (f"{p}.self_attn.k_proj.weight", "BF16", [nkv * hd, h]),
         (f"{p}.self_attn.v_proj.weight", "BF16", [nkv * hd, h]),
         (f"{p}.self_attn.o_proj.weight", "BF16", [h, nq * hd])]
    if bias:
        t += [(f"{p}.self_attn.q_proj.bias", "BF16", [nq * hd]),
              (f"{p}.self_attn.k_proj.bias", "BF16", [nkv * hd]),
              (f"{p}.self_attn.v_proj.bias", "BF16", [nkv * hd])]
    if qk_norm:
        t += [(f"{p}.self_attn.q_norm.weight", "BF16", [hd]),
              (f"{p}.self_attn.k_norm.weight", "BF16", [hd])]
    return t


def _norms(c: dict, p: str) -> list:
    h = c["hidden_size"]
    return [(f"{p}.input_layernorm.weight", "BF16", [h]),
            (f"{p}.post_attention_layernorm.weight", "BF16", [h])]


def _mlp(p: str, h: int, inter: int, dtype: str = "BF16") -> list:
    return [(f"{p}.gate_proj.weight", dtype, [inter, h]),
            (f"{p}.up_proj.weight", dtype, [inter, h]),
            (f"{p}.down_proj.weight", dtype, [h, inter])]


def _embeddings(c: dict, *, lm_head: bool) -> list:
    h, v = c["hidden_size"], c["vocab_size"]
    t = [("model.embed_tokens.weight", "BF16", [v, h]), ("model.norm.weight", "BF16", [h])]
    if lm_head:
        t.append(("lm_head.weight", "BF16", [v, h]))
    return t


def _with_fp8_scales(tensors: list) -> list:
    """Every F8 weight gets its `weight_scale_inv` partner: float32, one per 128x128 block."""
    out = []
    for name, dtype, shape in tensors:
        out.append((name, dtype, shape))
        if dtype == "F8_E4M3":
            blocks = [math.ceil(d / FP8_BLOCK) for d in shape]
            out.append((name + "_scale_inv", "F32", blocks))
    return out


def tensor_specs(model_type: str, config: dict | None = None,
                 lm_head: bool | None = None) -> list:
    """[(name, header dtype, shape)] of the synthetic checkpoint of `model_type`, its shapes
    from `config` (default: CONFIGS[model_type]); an lm_head.weight unless the embeddings are
    tied (or as `lm_head` says)."""
    c = config or CONFIGS[model_type]
    L, h = c["num_hidden_layers"], c["hidden_size"]
    t: list = []
    if model_type in ("llama", "mistral", "qwen2", "qwen3"):
        t += _embeddings(c, lm_head=not c["tie_word_embeddings"] if lm_head is None else lm_head)
        for i in range(L):
            p = f"model.layers.{i}"
            t += _llama_attention(c, p, bias=model_type == "qwen2", qk_norm=model_type == "qwen3")
            t += _mlp(f"{p}.mlp", h, c["intermediate_size"]) + _norms(c, p)
    elif model_type == "mixtral":
        t += _embeddings(c, lm_head=True)
        f = c["intermediate_size"]
        for i in range(L):
            p = f"model.layers.{i}"
            t += _llama_attention(c, p, bias=False, qk_norm=False) + _norms(c, p)
            t.append((f"{p}.block_sparse_moe.gate.weight", "BF16", [c["num_local_experts"], h]))
            for e in range(c["num_local_experts"]):
                q = f"{p}.block_sparse_moe.experts.{e}"
                t += [(f"{q}.w1.weight", "BF16", [f, h]), (f"{q}.w2.weight", "BF16", [h, f]),
                      (f"{q}.w3.weight", "BF16", [f, h])]
    elif model_type == "qwen3_moe":
        t += _embeddings(c, lm_head=True)
        for i in range(L):
            p = f"model.layers.{i}"
            t += _llama_attention(c, p, bias=False, qk_norm=True) + _norms(c, p)
            if i in c.get("mlp_only_layers", []):  # a dense layer (Qwen3MoeDecoderLayer)
                t += _mlp(f"{p}.mlp", h, c["intermediate_size"])
                continue
            t.append((f"{p}.mlp.gate.weight", "BF16", [c["num_experts"], h]))
            for e in range(c["num_experts"]):
                t += _mlp(f"{p}.mlp.experts.{e}", h, c["moe_intermediate_size"])
    elif model_type == "deepseek_v3":
        t += _embeddings(c, lm_head=True)
        nh, ql, kvl = c["num_attention_heads"], c["q_lora_rank"], c["kv_lora_rank"]
        nope, rope, vd = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
        E = c["n_routed_experts"]
        for i in range(L + c["num_nextn_predict_layers"]):
            p = f"model.layers.{i}"
            layer = [(f"{p}.self_attn.q_a_proj.weight", "F8_E4M3", [ql, h]),
                     (f"{p}.self_attn.q_a_layernorm.weight", "BF16", [ql]),
                     (f"{p}.self_attn.q_b_proj.weight", "F8_E4M3", [nh * (nope + rope), ql]),
                     (f"{p}.self_attn.kv_a_proj_with_mqa.weight", "F8_E4M3", [kvl + rope, h]),
                     (f"{p}.self_attn.kv_a_layernorm.weight", "BF16", [kvl]),
                     (f"{p}.self_attn.kv_b_proj.weight", "F8_E4M3", [nh * (nope + vd), kvl]),
                     (f"{p}.self_attn.o_proj.weight", "F8_E4M3", [h, nh * vd])]
            layer += _norms(c, p)
            if i >= L:  # the MTP layer: its own norms and projection, then a sparse block
                layer += [(f"{p}.enorm.weight", "BF16", [h]), (f"{p}.hnorm.weight", "BF16", [h]),
                          (f"{p}.eh_proj.weight", "BF16", [h, 2 * h]),
                          (f"{p}.shared_head.norm.weight", "BF16", [h])]
            if i < c["first_k_dense_replace"]:
                layer += _mlp(f"{p}.mlp", h, c["intermediate_size"], "F8_E4M3")
            else:
                layer += [(f"{p}.mlp.gate.weight", "BF16", [E, h]),
                          (f"{p}.mlp.gate.e_score_correction_bias", "F32", [E])]
                layer += _mlp(f"{p}.mlp.shared_experts", h,
                              c["moe_intermediate_size"] * c["n_shared_experts"], "F8_E4M3")
                for e in range(E):
                    layer += _mlp(f"{p}.mlp.experts.{e}", h, c["moe_intermediate_size"],
                                  "F8_E4M3")
            t += _with_fp8_scales(layer)
    else:
        raise KeyError(f"no synthetic model for model_type {model_type!r}")
    return t


def tensor_bytes(model_type: str, name: str, dtype: str, shape: list) -> bytes:
    """Deterministic content of one tensor (seeded by model and tensor name)."""
    n = math.prod(shape) * _DTYPES[dtype][1]
    seed = int.from_bytes(hashlib.sha256(f"{model_type}/{name}".encode()).digest()[:8], "little")
    return np.random.default_rng(seed).integers(0, 256, size=n, dtype=np.uint8).tobytes()


def _write_shard(path: Path, tensors: list, model_type: str) -> None:
    keep, specs = [], {}
    for name, dtype, shape in tensors:
        buf = np.frombuffer(tensor_bytes(model_type, name, dtype, shape), dtype=np.uint8).copy()
        keep.append(buf)
        specs[name] = safetensors.TensorSpec(dtype=_DTYPES[dtype][0], shape=shape,
                                             data_ptr=buf.ctypes.data, data_len=buf.nbytes)
    safetensors.serialize_file(specs, str(path), metadata={"format": "pt"})
    del keep


def write_checkpoint(out: Path, model_type: str, config: dict, tensors: list,
                     shards: int = 1) -> Path:
    """Writes `tensors` ([(name, dtype, shape)], contents from tensor_bytes) as `shards` files
    (model.safetensors, or model-0000i-of-0000K.safetensors + model.safetensors.index.json
    split in name order) and config.json into `out`. Returns `out`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if shards == 1:
        _write_shard(out / "model.safetensors", tensors, model_type)
        return out
    per = math.ceil(len(tensors) / shards)
    weight_map, total = {}, 0
    for k in range(shards):
        part = tensors[k * per:(k + 1) * per]
        fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        _write_shard(out / fname, part, model_type)
        for name, dtype, shape in part:
            weight_map[name] = fname
            total += math.prod(shape) * _DTYPES[dtype][1]
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out


# Variants of the models above: (base model_type, config changes, lm_head override).
VARIANTS = {
    # tied in config.json, yet the checkpoint carries lm_head.weight: the embedding stays on
    # the first stage only, lm_head on the last.
    "qwen3-tied-with-lm-head": ("qwen3", {"tie_word_embeddings": True}, True),
    # Qwen3-MoE with a dense layer (mlp_only_layers): its MLP is split like llama's.
    "qwen3_moe-mlp-only-layer": ("qwen3_moe", {"mlp_only_layers": [1]}, None),
    # 7 layers for PP 3 and 4 (vLLM: [2, 3, 2] and [2, 2, 2, 1]).
    "llama-7-layers": ("llama", {"num_hidden_layers": 7}, None),
}


def write_variant(name: str, out: Path) -> Path:
    base, changes, lm_head = VARIANTS[name]
    config = dict(CONFIGS[base], **changes)
    return write_checkpoint(out, base, config, tensor_specs(base, config, lm_head),
                            SHARDS.get(base, 1))


def write_model(model_type: str, out: Path) -> Path:
    """The synthetic checkpoint of one built-in rule set's architecture, written into `out`."""
    return write_checkpoint(out, model_type, CONFIGS[model_type], tensor_specs(model_type),
                            SHARDS.get(model_type, 1))


if __name__ == "__main__":
    import sys

    root = Path(sys.argv[1] if len(sys.argv) > 1 else "synthetic-models")
    for m in MODEL_TYPES:
        d = write_model(m, root / m)
        size = sum(f.stat().st_size for f in d.iterdir())
        print(f"{m}: {d} ({size} bytes)")
