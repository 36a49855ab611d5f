"""The engine plugins' gpu-tier path on a real GPU (scripts/gpu-python.sh step 3g; issue 40):
vLLM does not fit the device machine, so the plugins' own engine-independent core
(weightcache.integrations._engine) is driven here by a transformers "engine" whose load is
post-processed the way engines do (q/k/v fused into one qkv projection, gate/up fused and
repacked), with tied embeddings:

1. ``disk``: a fresh process loads the checkpoint from disk to cuda:0, post-processes it, takes
   the prompt's logits and 24 greedy tokens (the reference), and publishes the processed
   module's parameters and buffers into the rank's gpu-tier daemon (started detached);
2. ``hit``: a fresh process builds the model on the meta device, makes the same structure,
   attaches every tensor zero-copy (attach_tensors + apply_tensors), and must give logits
   bit-identical to the reference (torch.equal) and the same tokens; the tied embedding and
   lm_head must be one tensor; the time to attach and apply is reported;
3. ``kill``: a fresh process attaches, generates half the tokens, kill -9s the daemon, and
   generates the rest: the tokens must equal the reference (the mapping outlives the daemon).

Prints one JSON line per step; exits 1 on any failure.

    python gpu_engine_check.py --work DIR --cli PATH/weightcache
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

PROMPT = [1, 17, 42, 99, 7, 130, 5, 64]
# cuda:0 on the device machine; DEVICE=cpu rehearses the same steps on the host tier.
DEVICE = os.environ.get("DEVICE", "cuda:0")
NEW_TOKENS = 24


def make(model_dir: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=512, hidden_size=512, intermediate_size=1024,
                         num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=256, tie_word_embeddings=True,
                         dtype="bfloat16")
    torch.manual_seed(5)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    model.save_pretrained(model_dir, safe_serialization=True)


def fuse(model, torch, on_meta: bool) -> None:
    """The engine's post-processing: q/k/v → qkv_proj (one weight), gate/up → gate_up_proj
    (one weight, repacked), forward passes rewired to use them. On the meta device it makes
    the same structure and computes nothing."""
    nn = torch.nn
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        q, k, v = attn.q_proj, attn.k_proj, attn.v_proj
        qkv = nn.Linear(q.in_features, q.out_features + k.out_features + v.out_features,
                        bias=False, device="meta" if on_meta else q.weight.device,
                        dtype=q.weight.dtype)
        if not on_meta:
            with torch.no_grad():
                qkv.weight.copy_(torch.cat([q.weight, k.weight, v.weight], 0))
        sizes = (q.out_features, k.out_features, v.out_features)
        attn.qkv_proj = qkv
        del attn.q_proj, attn.k_proj, attn.v_proj

        class Split(nn.Module):
            def __init__(self, index: int) -> None:
                super().__init__()
                self.index = index

            def forward(self, x, _attn=attn, _sizes=sizes):
                cached = getattr(_attn, "_qkv_cache", None)
                if self.index == 0 or cached is None or cached[0] is not x:
                    cached = (x, _attn.qkv_proj(x).split(_sizes, dim=-1))
                    _attn._qkv_cache = cached
                return cached[1][self.index]

        attn.q_proj, attn.k_proj, attn.v_proj = Split(0), Split(1), Split(2)
        g, u = mlp.gate_proj, mlp.up_proj
        gate_up = nn.Linear(g.in_features, 2 * g.out_features, bias=False,
                            device="meta" if on_meta else g.weight.device, dtype=g.weight.dtype)
        if not on_meta:
            with torch.no_grad():  # repacked: gate and up rows interleaved in blocks of 64
                w = torch.stack([g.weight.view(-1, 64, g.in_features),
                                 u.weight.view(-1, 64, g.in_features)], 1)
                gate_up.weight.copy_(w.reshape(2 * g.out_features, g.in_features))
        mlp.gate_up_proj = gate_up
        del mlp.gate_proj, mlp.up_proj
        inter = g.out_features

        def mlp_forward(x, _mlp=mlp, _inter=inter):
            y = _mlp.gate_up_proj(x).view(*x.shape[:-1], _inter // 64, 2, 64)
            gate, up = y[..., 0, :].reshape(*x.shape[:-1], _inter), \
                y[..., 1, :].reshape(*x.shape[:-1], _inter)
            return _mlp.down_proj(_mlp.act_fn(gate) * up)

        mlp.forward = mlp_forward


def identity(model_dir: str, runtime_dir: str):
    import torch
    import transformers

    from weightcache.integrations import _engine

    return _engine.EngineIdentity(
        engine="transformers-fused", engine_version=transformers.__version__,
        platform="cpu" if DEVICE == "cpu" else "cuda",
        model_dir=model_dir, model_id="tiny-fused", dtype="bfloat16",
        checkpoint=_engine.checkpoint_identity(model_dir), capture="processed",
        load_config={"post_process": "qkv+gate_up/64"}, runtime_dir=runtime_dir,
        device_index=None if DEVICE == "cpu" else torch.cuda.current_device())


def run(model, torch):
    ids = torch.tensor([PROMPT], device=DEVICE)
    with torch.no_grad():
        logits = model(ids).logits.float()
        tokens = list(PROMPT)
        for _ in range(NEW_TOKENS):
            out = model(torch.tensor([tokens], device=DEVICE)).logits[0, -1]
            tokens.append(int(out.argmax()))
    return logits, tokens[len(PROMPT):]


def generate(model, torch, tokens, count):
    with torch.no_grad():
        for _ in range(count):
            out = model(torch.tensor([tokens], device=DEVICE)).logits[0, -1]
            tokens.append(int(out.argmax()))
    return tokens


def cmd_disk(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from weightcache.integrations import _engine

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).to(DEVICE)
    model.eval()
    fuse(model, torch, on_meta=False)
    logits, tokens = run(model, torch)
    torch.save({"logits": logits.cpu(), "tokens": tokens}, args.reference)
    ident = identity(args.model, args.runtime_dir)
    t0 = time.perf_counter()
    count = _engine.publish_module(model, ident, extra={"capture": "processed"})
    return {"step": "disk", "published": count, "publish_s": time.perf_counter() - t0,
            "tokens": tokens}


def attach_model(args, torch):
    from transformers import AutoConfig, AutoModelForCausalLM

    from weightcache.integrations import _engine

    config = AutoConfig.from_pretrained(args.model)
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    fuse(model, torch, on_meta=True)
    built = time.perf_counter()
    sd, miss = _engine.attach_tensors(identity(args.model, args.runtime_dir), wait_timeout=30)
    if sd is None:
        raise SystemExit(f"no cache to attach: {miss.kind}: {miss.reason}")
    _engine.apply_tensors(model, sd, allow_new=False)
    done = time.perf_counter()
    model.eval()
    model.weightcache_attachment = sd.attachment
    return model, sd, {"build_meta_ms": (built - t0) * 1e3,
                       "attach_apply_ms": (done - built) * 1e3,
                       "attach_ms": sd.attachment.attach_ms, "tensors": len(sd),
                       "bytes": sd.attachment.total_bytes}


def cmd_hit(args) -> dict:
    import torch

    ref = torch.load(args.reference)
    free_before = torch.cuda.mem_get_info()[0] if DEVICE != "cpu" else 0
    model, sd, timing = attach_model(args, torch)
    # Rotary inv_freq is a non-persistent buffer made at init: on meta it was attached too.
    logits, tokens = run(model, torch)
    emb, head = model.model.embed_tokens.weight, model.lm_head.weight
    result = {"step": "hit", **timing,
              "logits_bit_identical": bool(torch.equal(logits.cpu(), ref["logits"])),
              "tokens_equal": tokens == ref["tokens"],
              "tied_one_tensor": emb is head,
              "on_device": all(p.device.type == torch.device(DEVICE).type
                               for p in model.parameters()),
              # Device memory this process took for the model: the weights are the daemon's.
              "torch_allocated_bytes": torch.cuda.memory_allocated() if DEVICE != "cpu" else 0,
              "free_drop_bytes": (free_before - torch.cuda.mem_get_info()[0])
              if DEVICE != "cpu" else 0}
    result["ok"] = (result["logits_bit_identical"] and result["tokens_equal"] and
                    result["tied_one_tensor"] and result["on_device"])
    return result


def cmd_kill(args) -> dict:
    import torch

    ref = torch.load(args.reference)
    model, sd, _ = attach_model(args, torch)
    pid = sd.attachment.daemon_pid
    tokens = generate(model, torch, list(PROMPT), NEW_TOKENS // 2)
    os.kill(pid, signal.SIGKILL)
    for _ in range(200):
        if not sd.attachment.daemon_alive:
            break
        time.sleep(0.01)
    tokens = generate(model, torch, tokens, NEW_TOKENS - NEW_TOKENS // 2)
    result = {"step": "kill", "daemon_pid": pid,
              "daemon_seen_gone": not sd.attachment.daemon_alive,
              "tokens_equal": tokens[len(PROMPT):] == ref["tokens"]}
    result["ok"] = result["tokens_equal"] and result["daemon_seen_gone"]
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("step", choices=("all", "disk", "hit", "kill"))
    parser.add_argument("--work", required=True)
    parser.add_argument("--model")
    parser.add_argument("--reference")
    parser.add_argument("--runtime-dir")
    args = parser.parse_args()
    args.model = args.model or os.path.join(args.work, "tiny-fused")
    args.reference = args.reference or os.path.join(args.work, "reference.pt")
    args.runtime_dir = args.runtime_dir or os.path.join(args.work, "run")
    if args.step != "all":
        result = {"disk": cmd_disk, "hit": cmd_hit, "kill": cmd_kill}[args.step](args)
        print(json.dumps(result), flush=True)
        return 0 if result.get("ok", True) else 1
    os.makedirs(args.runtime_dir, mode=0o700, exist_ok=True)
    make(args.model)
    failed = False
    for step in ("disk", "hit", "kill"):
        done = subprocess.run([sys.executable, __file__, step, "--work", args.work],
                              capture_output=True, text=True, check=False)
        lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
        print(lines[-1] if lines else json.dumps({"step": step, "ok": False,
                                                  "stderr": done.stderr[-3000:]}), flush=True)
        if done.returncode != 0:
            sys.stderr.write(done.stderr[-3000:])
            failed = True
            break
    subprocess.run([os.environ.get("WEIGHTCACHE_CLI", "weightcache"), "stop", "--all",
                    "--runtime-dir", args.runtime_dir], capture_output=True, check=False)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
