#!/usr/bin/env python3
"""A real model through weightcache on a GPU (run by scripts/gpu-python.sh on the device).

  make      --out DIR              a small Llama (random weights, bf16, ~330 MB) saved with
                                   save_pretrained as sharded safetensors
  reference --model DIR --out F    transformers loads DIR from disk onto cuda:0 and generates
                                   32 tokens greedily; token ids → F
  attach    --model DIR --reference F --runtime-dir R
                                   builds the model on the meta device, loads the weights with
                                   weightcache.load_state_dict (gpu tier, the daemon, assign=True:
                                   no copies), generates 32 tokens greedily, requires the same ids
                                   as the reference, and checks that the client's GPU memory holds
                                   no second copy of the weights. One JSON line of measurements.

Weights not in the checkpoint: rotary inv_freq (a non-persistent buffer) is recomputed on the
GPU by re-creating the rotary module; tied embeddings are re-tied (model.tie_weights()).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

PROMPT = [1, 306, 4966, 263, 931, 29892, 727, 471, 263, 2217, 5807, 297]
NEW_TOKENS = 32


def config():
    from transformers import LlamaConfig

    # ~165 M parameters: 330 MB in bf16, several shards at max_shard_size=100MB.
    return LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                       num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=8,
                       max_position_embeddings=2048, tie_word_embeddings=False)


def dtype_kw(torch):
    """transformers >= 4.56 spells the load dtype `dtype`; older releases `torch_dtype`."""
    import transformers

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return {"dtype" if (major, minor) >= (4, 56) else "torch_dtype": torch.bfloat16}


def generate(model, torch):
    ids = torch.tensor([PROMPT], device="cuda:0")
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                             min_new_tokens=NEW_TOKENS, do_sample=False, num_beams=1,
                             pad_token_id=0)
    return out[0, len(PROMPT):].tolist()


def cmd_make(args):
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(config()).to(torch.bfloat16)
    model.save_pretrained(args.out, max_shard_size="100MB", safe_serialization=True)
    n = sum(p.numel() for p in model.parameters())
    print(json.dumps({"made": args.out, "parameters": n, "bytes": n * 2}))


def cmd_reference(args):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model, **dtype_kw(torch))
    model = model.to("cuda:0").eval()
    tokens = generate(model, torch)
    with open(args.out, "w") as f:
        json.dump(tokens, f)
    print(json.dumps({"reference_tokens": tokens}))


def materialize_buffers(model, cfg, device):
    """Buffers left on the meta device (not in the checkpoint): re-create their module on the
    GPU. Only rotary embeddings are expected; anything else is an error, named."""
    for name, module in list(model.named_modules()):
        if not any(b.is_meta for b in module.buffers(recurse=False)):
            continue
        if "Rotary" not in type(module).__name__:
            raise RuntimeError(f"{name} ({type(module).__name__}) has a buffer that is not in "
                               "the checkpoint")
        fresh = type(module)(config=cfg, device=device)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, fresh)


def check_interop(att, params, torch):
    """CuPy and JAX read the same GPU tensor through DLPack (where installed): bytes equal to
    torch's view of it; CuPy must also be zero-copy."""
    name = next(n for n in params if n in att and att[n].dtype == "BF16")
    want = params[name].detach().view(torch.uint8).flatten().cpu().numpy().tobytes()
    out = {}
    try:
        import cupy
    except ImportError:
        out["cupy"] = "absent"
    else:
        try:
            x = cupy.from_dlpack(att[name].raw())
            same_ptr = x.data.ptr == att[name].data_ptr
            out["cupy"] = "ok" if same_ptr and cupy.asnumpy(x).tobytes() == want else (
                f"bytes or address differ (zero-copy: {same_ptr})")
        except Exception as e:  # reported, not raised: the other checks still run
            out["cupy"] = f"{type(e).__name__}: {e}"
    try:
        import jax.dlpack
        import numpy as np
    except ImportError:
        out["jax"] = "absent"
    else:
        try:
            y = jax.dlpack.from_dlpack(att[name])
            got = np.asarray(y).tobytes()
            out["jax"] = "ok" if (str(y.dtype) == "bfloat16" and got == want) else (
                f"dtype {y.dtype} or bytes differ")
        except Exception as e:
            out["jax"] = f"{type(e).__name__}: {e}"
    return out


def cmd_attach(args):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    import weightcache

    torch.cuda.init()
    torch.cuda.set_device(0)
    torch.zeros(1, device="cuda:0")  # the CUDA context, before measuring
    free_before, total = torch.cuda.mem_get_info(0)
    torch.cuda.reset_peak_memory_stats(0)
    allocated_before = torch.cuda.memory_allocated(0)

    cfg = AutoConfig.from_pretrained(args.model)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, **dtype_kw(torch))
    t0 = time.perf_counter()
    sd = weightcache.load_state_dict(args.model, device="cuda:0", on_missing="error",
                                     runtime_dir=args.runtime_dir)
    load_ms = (time.perf_counter() - t0) * 1000
    att = sd.attachment
    assert att.source == "daemon" and att.tier == "gpu", att.source_reason
    result = model.load_state_dict(sd, assign=True, strict=False)
    if result.unexpected_keys or result.missing_keys:
        missing = [k for k in result.missing_keys if not k.endswith("lm_head.weight")]
        if result.unexpected_keys or missing or not cfg.tie_word_embeddings:
            raise RuntimeError(f"state_dict keys: missing {result.missing_keys}, unexpected "
                               f"{result.unexpected_keys}")
    model.tie_weights()
    materialize_buffers(model, cfg, torch.device("cuda:0"))
    model.eval()

    # Zero-copy: the parameters are the daemon's memory, not copies of it.
    params = dict(model.named_parameters())
    for name in list(sd)[:8]:
        assert params[name].data_ptr() == att[name].data_ptr, f"{name} was copied"
        assert params[name].dtype == torch.bfloat16
    for name, p in model.named_parameters():
        assert p.device == torch.device("cuda:0") and not p.is_meta, name

    interop = check_interop(att, params, torch)
    tokens = generate(model, torch)
    reference = json.load(open(args.reference))
    peak = torch.cuda.max_memory_allocated(0) - allocated_before
    free_after, _ = torch.cuda.mem_get_info(0)
    weights = att.total_bytes
    report = {
        "tokens_equal": tokens == reference, "tokens": tokens, "reference": reference,
        "tensors": len(att), "weight_bytes": weights, "load_state_dict_ms": round(load_ms, 2),
        "attach_ms": round(att.attach_ms, 3), "daemon_pid": att.daemon_pid,
        "device_uuid": att.device_uuid, "interop": interop,
        "torch_peak_allocated_bytes": peak,
        "torch_peak_over_weights": round(peak / weights, 4),
        "device_used_delta_bytes": free_before - free_after,
        "device_used_delta_over_weights": round((free_before - free_after) / weights, 4),
    }
    print(json.dumps(report))
    failures = []
    # A library that imports the tensor but sees other bytes fails the check; one that cannot
    # import it at all (e.g. a CPU-only JAX) is reported in the JSON line only.
    failures += [f"{lib}: {why}" for lib, why in interop.items() if "differ" in why]
    if tokens != reference:
        failures.append("generated tokens differ from the disk-loaded model's")
    # torch's allocator never holds the weights: its peak is activations + KV cache only.
    if peak >= 0.5 * weights:
        failures.append(f"torch peak allocation {peak} B is not far below the weights "
                        f"({weights} B): a second copy?")
    # Device-wide: importing the daemon's arena maps the same physical memory.
    if free_before - free_after >= 0.5 * weights:
        failures.append(f"device memory in use grew by {free_before - free_after} B while "
                        f"attaching {weights} B of weights: a second copy?")
    if failures:
        print("FAIL: " + "; ".join(failures), file=sys.stderr)
        sys.exit(1)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("--out", required=True)
    r = sub.add_parser("reference")
    r.add_argument("--model", required=True)
    r.add_argument("--out", required=True)
    a = sub.add_parser("attach")
    a.add_argument("--model", required=True)
    a.add_argument("--reference", required=True)
    a.add_argument("--runtime-dir", required=True)
    args = p.parse_args()
    {"make": cmd_make, "reference": cmd_reference, "attach": cmd_attach}[args.cmd](args)


if __name__ == "__main__":
    main()
