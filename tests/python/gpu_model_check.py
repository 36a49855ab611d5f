#!/usr/bin/env python3
"""A real model through weightcache on a GPU (run by scripts/gpu-python.sh on the device).

  make      --out DIR [--shape S]  a Llama with random weights in bf16, saved with
                                   save_pretrained as sharded safetensors: `small` (~330 MB, the
                                   default) or `llama3-8b` (Llama-3-8B's shape: 291 tensors,
                                   16.06 GB in 4 shards)
  reference --model DIR --out F    transformers loads DIR from disk onto cuda:0 and generates
                                   32 tokens greedily; token ids → F
  attach    --model DIR --reference F --runtime-dir R
                                   builds the model on the meta device, loads the weights with
                                   weightcache.load_state_dict (gpu tier, the daemon, assign=True:
                                   no copies), generates 32 tokens greedily, requires the same ids
                                   and prompt logits as the reference, and checks that the
                                   client's GPU memory holds no second copy of the weights. One
                                   JSON line of measurements.
  shard-attach --model DIR --reference F --runtime-dir R --tp N
                                   (issue 12) N rank daemons (--tp-size N) serve DIR on this GPU:
                                   attaches each rank (gpu tier), checks that each holds only
                                   its slices (fewer bytes than the whole), that the disk
                                   fallback of each rank gives the same bytes, reassembles the
                                   full state dict from the slices (Tensor.slice: dim, offset,
                                   length), requires every tensor equal to the checkpoint's, then
                                   builds the model from it: tokens and logits equal to disk.
  keeper --model DIR --reference F --runtime-dir R --cli PATH --device UUID
                                   (issue 15) starts `serve --tier gpu --adopt-verify full`;
                                   engine A (this process) attaches and generates; the daemon is
                                   killed with SIGKILL while A holds its tensors; a new `serve`
                                   must re-adopt the kept memory ("ready: adopted", every
                                   tensor checksummed by the GPU kernel) reading no more than the
                                   headers (/proc/PID/io rchar); A generates again, and engine B
                                   (a fresh process: `attach` above) attaches to the adopted
                                   cache; both must give the reference's tokens and logits.
                                   --adopt-verify behind: ready first, then every tensor
                                   checksummed on the GPU (the "verified behind ready" line).
                                   --upgrade: then `weightcache upgrade` while A is attached; the
                                   restarted daemon exits 0, A and a fresh engine C must give the
                                   reference's output. One JSON line: the restart's time to
                                   ready, bytes read, the handover time.
  budget --model DIR --other-model DIR2 --reference F --runtime-dir R --cli PATH --device UUID
                                   (issue 16) two `serve --gpu-budget B --demote host-pinned` caches,
                                   B = 1.5 x one checkpoint: the second's admission demotes the
                                   first to host RAM (`ls`: demoted, host); an engine attaching
                                   to the first promotes it back (the second is demoted to make
                                   room) and must give the reference's tokens and logits.
  seed --model DIR --reference F --runtime-dir R --cli PATH --device0 UUID --device1 UUID
                                   (issue 18, two GPUs) `serve` on device0, then `serve
                                   --seed-from auto` on device1, which must copy device0's
                                   cache (its log: "filled from the peer cache of <device0>")
                                   instead of reading the disk; an engine started with
                                   CUDA_VISIBLE_DEVICES=<device1> (its cuda:0 is device1, whose
                                   daemon it finds by that UUID) attaches to the seeded cache and
                                   must give the reference's tokens and logits.

Weights not in the checkpoint: rotary inv_freq (a non-persistent buffer) is recomputed on the
GPU by re-creating the rotary module; tied embeddings are re-tied (model.tie_weights()).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

PROMPT = [1, 306, 4966, 263, 931, 29892, 727, 471, 263, 2217, 5807, 297]
NEW_TOKENS = 32


# The shapes `make` writes: (LlamaConfig arguments, max_shard_size).
SHAPES = {
    # ~165 M parameters: 330 MB in bf16, several shards at max_shard_size=100MB.
    "small": (dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                   num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=8,
                   max_position_embeddings=2048, tie_word_embeddings=False), "100MB"),
    # Llama-3-8B's shape: 8.03 B parameters, 291 tensors, 16.06 GB in bf16, 4 shards.
    "llama3-8b": (dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       max_position_embeddings=8192, rope_theta=500000.0,
                       tie_word_embeddings=False), "5GB"),
}


def config(shape: str = "small"):
    from transformers import LlamaConfig

    return LlamaConfig(**SHAPES[shape][0])


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
    if args.shape == "small":
        model = LlamaForCausalLM(config()).to(torch.bfloat16)
    else:  # 8 B parameters: initialized on the GPU in bf16 (the CPU would take minutes)
        torch.set_default_dtype(torch.bfloat16)
        with torch.device("cuda:0"):
            model = LlamaForCausalLM(config(args.shape))
    model.save_pretrained(args.out, max_shard_size=SHAPES[args.shape][1], safe_serialization=True)
    n = sum(p.numel() for p in model.parameters())
    print(json.dumps({"made": args.out, "parameters": n, "bytes": n * 2}))


def prompt_logits(model, torch):
    """The logits of one forward over the prompt (float32 on the CPU, for torch.equal)."""
    ids = torch.tensor([PROMPT], device="cuda:0")
    with torch.no_grad():
        return model(ids).logits.float().cpu()


def logits_path(reference: str) -> str:
    return reference + ".logits.pt"


def cmd_reference(args):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model, **dtype_kw(torch))
    model = model.to("cuda:0").eval()
    tokens = generate(model, torch)
    torch.save(prompt_logits(model, torch), logits_path(args.out))
    with open(args.out, "w") as f:
        json.dump(tokens, f)
    print(json.dumps({"reference_tokens": tokens}))


def compare_to_reference(model, reference: str, torch) -> tuple[list, dict]:
    """Generates from `model` and compares with the disk-loaded reference: (failures, report)."""
    tokens = generate(model, torch)
    logits = prompt_logits(model, torch)
    want_tokens = json.load(open(reference))
    want_logits = torch.load(logits_path(reference))
    failures = []
    if tokens != want_tokens:
        failures.append("generated tokens differ from the disk-loaded model's")
    logits_equal = bool(torch.equal(logits, want_logits))
    if not logits_equal:
        diff = (logits - want_logits).abs().max().item()
        failures.append(f"prompt logits differ from the disk-loaded model's (max |diff| {diff})")
    return failures, {"tokens_equal": tokens == want_tokens, "logits_equal": logits_equal,
                      "tokens": tokens, "reference": want_tokens}


def build_model(state_dict, model_dir: str, torch):
    """The model built on the meta device with `state_dict` assigned (no copies), tied, its
    non-checkpoint buffers re-created on the GPU."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, **dtype_kw(torch))
    result = model.load_state_dict(state_dict, assign=True, strict=False)
    if result.unexpected_keys or result.missing_keys:
        missing = [k for k in result.missing_keys if not k.endswith("lm_head.weight")]
        if result.unexpected_keys or missing or not cfg.tie_word_embeddings:
            raise RuntimeError(f"state_dict keys: missing {result.missing_keys}, unexpected "
                               f"{result.unexpected_keys}")
    model.tie_weights()
    materialize_buffers(model, cfg, torch.device("cuda:0"))
    return model.eval()


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

    import weightcache

    torch.cuda.init()
    torch.cuda.set_device(0)
    torch.zeros(1, device="cuda:0")  # the CUDA context, before measuring
    free_before, total = torch.cuda.mem_get_info(0)
    torch.cuda.reset_peak_memory_stats(0)
    allocated_before = torch.cuda.memory_allocated(0)

    t0 = time.perf_counter()
    sd = weightcache.load_state_dict(args.model, device="cuda:0", on_missing="error",
                                     runtime_dir=args.runtime_dir)
    load_ms = (time.perf_counter() - t0) * 1000
    att = sd.attachment
    assert att.source == "daemon" and att.tier == "gpu", att.source_reason
    # load_state_dict's bulk DLPack capsules give, for every tensor, what the per-tensor path
    # (one DLPack export of the Tensor) gives: address, dtype, shape, strides, device.
    assert list(sd) == att.names()
    for name, got in sd.items():
        want = weightcache._torch_tensor(torch, att[name])
        assert (got.data_ptr(), got.dtype, got.shape, got.stride(), got.device) == (
            want.data_ptr(), want.dtype, want.shape, want.stride(), want.device), name
    model = build_model(sd, args.model, torch)

    # Zero-copy: the parameters are the daemon's memory, not copies of it.
    params = dict(model.named_parameters())
    for name in list(sd)[:8]:
        assert params[name].data_ptr() == att[name].data_ptr, f"{name} was copied"
        assert params[name].dtype == torch.bfloat16
    for name, p in model.named_parameters():
        assert p.device == torch.device("cuda:0") and not p.is_meta, name

    interop = check_interop(att, params, torch)
    failures, compared = compare_to_reference(model, args.reference, torch)
    peak = torch.cuda.max_memory_allocated(0) - allocated_before
    free_after, _ = torch.cuda.mem_get_info(0)
    weights = att.total_bytes
    report = {
        **compared, "tensors": len(att), "weight_bytes": weights, "load_state_dict_ms": round(load_ms, 2),
        "attach_ms": round(att.attach_ms, 3), "daemon_pid": att.daemon_pid,
        "device_uuid": att.device_uuid, "interop": interop,
        "torch_peak_allocated_bytes": peak,
        "torch_peak_over_weights": round(peak / weights, 4),
        "device_used_delta_bytes": free_before - free_after,
        "device_used_delta_over_weights": round((free_before - free_after) / weights, 4),
    }
    print(json.dumps(report))
    # A library that imports the tensor but sees other bytes fails the check; one that cannot
    # import it at all (e.g. a CPU-only JAX) is reported in the JSON line only.
    failures += [f"{lib}: {why}" for lib, why in interop.items() if "differ" in why]
    # torch's allocator never holds the weights: its peak is activations + KV cache only.
    if peak >= 0.5 * weights:
        failures.append(f"torch peak allocation {peak} B is not far below the weights "
                        f"({weights} B): a second copy?")
    # Device-wide: importing the daemon's arena maps the same physical memory.
    if free_before - free_after >= 0.5 * weights:
        failures.append(f"device memory in use grew by {free_before - free_after} B while "
                        f"attaching {weights} B of weights: a second copy?")
    exit_on(failures)


def reassemble(name: str, pieces: list, torch):
    """The full tensor from the ranks' pieces [(slice | None, tensor)]: whole on every rank →
    all equal, that one; else pieces ordered by offset must tile [0, full_length) along their
    dim, pieces at the same offset (kv heads replicated when tp > heads) equal."""
    if all(s is None for s, _ in pieces):
        first = pieces[0][1]
        for _, t in pieces[1:]:
            if not torch.equal(t.view(torch.uint8), first.view(torch.uint8)):
                raise AssertionError(f"{name}: replicated on every rank but the bytes differ")
        return first
    if any(s is None for s, _ in pieces):
        raise AssertionError(f"{name}: whole on some ranks, sliced on others")
    dims = {s[0] for s, _ in pieces}
    if len(dims) != 1:
        raise AssertionError(f"{name}: sliced along different dims {sorted(dims)}")
    dim = dims.pop()
    by_offset: dict = {}
    for s, t in pieces:
        _, offset, length, full_length = s
        if offset in by_offset:
            if not torch.equal(by_offset[offset][1].view(torch.uint8), t.view(torch.uint8)):
                raise AssertionError(f"{name}: two ranks hold offset {offset} with other bytes")
            continue
        by_offset[offset] = (length, t)
    at = 0
    parts = []
    for offset in sorted(by_offset):
        length, t = by_offset[offset]
        if offset != at:
            raise AssertionError(f"{name}: slices leave a gap or overlap at {at} (next {offset})")
        parts.append(t)
        at += length
    if at != full_length:
        raise AssertionError(f"{name}: slices cover {at} of {full_length} along dim {dim}")
    return torch.cat(parts, dim=dim).contiguous()


def cmd_shard_attach(args):
    import tempfile

    import torch
    from safetensors.torch import load_file

    import weightcache

    torch.cuda.init()
    torch.cuda.set_device(0)
    disk = {}
    for f in sorted(os.listdir(args.model)):
        if f.endswith(".safetensors"):
            disk.update(load_file(os.path.join(args.model, f), device="cuda:0"))
    whole_bytes = sum(t.numel() * t.element_size() for t in disk.values())
    failures = []
    pieces: dict = {}
    ranks = []
    empty_runtime = tempfile.mkdtemp()  # no daemon there: the disk fallback
    for rank in range(args.tp):
        ids = dict(tp_size=args.tp, tp_rank=rank)
        t0 = time.perf_counter()
        sd = weightcache.load_state_dict(args.model, device="cuda:0", on_missing="error",
                                         wait_timeout=120, runtime_dir=args.runtime_dir, **ids)
        load_ms = (time.perf_counter() - t0) * 1000
        att = sd.attachment
        assert att.source == "daemon" and att.tier == "gpu", att.source_reason
        held = att.total_bytes
        if held >= whole_bytes:
            failures.append(f"rank {rank} holds {held} B, not less than the whole {whole_bytes} B")
        for t in att.tensors():
            pieces.setdefault(t.name, []).append((t.slice, sd[t.name]))
        # The disk fallback of this rank, with the same rules, gives the same bytes.
        fb = weightcache.load_state_dict(args.model, device="cuda:0", on_missing="fallback",
                                         runtime_dir=empty_runtime, **ids)
        assert fb.attachment.source == "fallback", fb.attachment.source_reason
        differ = [n for n in sd if fb[n].shape != sd[n].shape
                  or not torch.equal(fb[n].view(torch.uint8), sd[n].view(torch.uint8))]
        if sorted(fb) != sorted(sd) or differ:
            failures.append(f"rank {rank}: the disk fallback differs from the daemon "
                            f"({len(differ)} tensors, e.g. {differ[:3]})")
        del fb
        ranks.append({"rank": rank, "tensors": len(att), "held_bytes": held,
                      "held_over_whole": round(held / whole_bytes, 4),
                      "load_state_dict_ms": round(load_ms, 2)})
    full = {}
    for name, ps in pieces.items():
        if len(ps) != args.tp:
            failures.append(f"{name}: held by {len(ps)} of {args.tp} ranks")
            continue
        full[name] = reassemble(name, ps, torch)
    if sorted(full) != sorted(disk):
        failures.append(f"reassembled names differ from the checkpoint's: missing "
                        f"{sorted(set(disk) - set(full))[:5]}, extra {sorted(set(full) - set(disk))[:5]}")
    differ = [n for n in disk if n in full and (full[n].shape != disk[n].shape or not torch.equal(
        full[n].view(torch.uint8), disk[n].view(torch.uint8)))]
    if differ:
        failures.append(f"{len(differ)} reassembled tensors differ from the checkpoint's, e.g. "
                        f"{differ[:3]}")
    del disk
    model = build_model(full, args.model, torch)
    compare_failures, compared = compare_to_reference(model, args.reference, torch)
    failures += compare_failures
    report = {"tp": args.tp, **compared, "tensors": len(full), "whole_bytes": whole_bytes,
              "ranks": ranks, "reassembled_differ": len(differ)}
    print(json.dumps({"shard_check": report}))
    exit_on(failures)


def wait_for(predicate, timeout: float, what: str, interval: float = 0.01):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(interval)


def read_chars(pid: int) -> int:
    for line in open(f"/proc/{pid}/io"):
        key, value = line.split(":")
        if key == "rchar":
            return int(value)
    raise RuntimeError(f"no rchar in /proc/{pid}/io")


def read_text(path: str) -> str:
    with open(path) as f:
        return f.read()


def line_with(text: str, needle: str) -> str:
    return next((line for line in text.splitlines() if needle in line), "")


def gone(pid: int) -> bool:
    """True once `pid` exited (a zombie counts: not our child, nobody here reaps it)."""
    try:
        return read_text(f"/proc/{pid}/stat").rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def exit_on(failures: list) -> None:
    """Exits 1 naming every failure, if any."""
    if failures:
        print("FAIL: " + "; ".join(failures), file=sys.stderr)
        sys.exit(1)


def stop(procs: list) -> None:
    """SIGTERM to every process still running, then waits for it."""
    for p in procs:
        if p is not None and p.poll() is None:
            p.terminate()
            p.wait()


# A restarted daemon that re-adopts reads the checkpoint's headers (for the identity) and
# nothing else: far below this, whatever the checkpoint's size (restart_bench: 157 KB at 16 GB).
ADOPT_READ_BOUND = 16 << 20


def cmd_keeper(args):
    import glob
    import re
    import signal
    import subprocess

    import torch

    import weightcache

    serve = [args.cli, "serve", "--model", args.model, "--tier", "gpu", "--device", args.device,
             "--runtime-dir", args.runtime_dir, "--adopt-verify", args.adopt_verify]
    logs = [os.path.join(args.runtime_dir, f"serve-{i}.log") for i in (1, 2)]
    socket_glob = os.path.join(args.runtime_dir, "default", args.device, "*.sock")
    first = subprocess.Popen(serve, stdout=open(logs[0], "w"), stderr=subprocess.STDOUT)
    second = None
    successor_pid = None

    def engine(daemon_pid: int, label: str, failures: list) -> dict:
        """A fresh process (`attach` above) on the cache: the reference's output, no copy."""
        run = subprocess.run([sys.executable, __file__, "attach", "--model", args.model,
                              "--reference", args.reference, "--runtime-dir", args.runtime_dir],
                             capture_output=True, text=True)
        if run.returncode != 0:
            failures.append(f"engine {label} failed: {run.stderr[-2000:]}")
        out = json.loads(run.stdout.strip().splitlines()[-1]) if run.stdout.strip() else {}
        if out.get("daemon_pid") not in (None, daemon_pid):
            failures.append(f"engine {label} attached to pid {out.get('daemon_pid')}, not "
                            f"{daemon_pid}")
        return {k: out.get(k) for k in ("tokens_equal", "logits_equal", "daemon_pid",
                                        "load_state_dict_ms")}

    def equal(report: dict) -> dict:
        return {k: report[k] for k in ("tokens_equal", "logits_equal")}

    try:
        wait_for(lambda: glob.glob(socket_glob) or first.poll() is not None, 30,
                 "the daemon published no socket in 30 s")
        torch.cuda.set_device(0)
        sd = weightcache.load_state_dict(args.model, device="cuda:0", on_missing="error",
                                         runtime_dir=args.runtime_dir, wait_timeout=300)
        att = sd.attachment
        assert att.source == "daemon" and att.daemon_pid == first.pid, att.source_reason
        tensors = len(att)
        engine_a = build_model(sd, args.model, torch)
        failures, before = compare_to_reference(engine_a, args.reference, torch)

        # kill -9 while engine A holds the daemon's memory (its tensors stay valid), then the
        # same `serve` again: it must re-adopt the kept memory without reading the weights.
        first.send_signal(signal.SIGKILL)
        first.wait()
        spawned = time.monotonic()
        second = subprocess.Popen(serve, stdout=open(logs[1], "w"), stderr=subprocess.STDOUT)
        wait_for(lambda: "ready:" in read_text(logs[1]) or second.poll() is not None, 60,
                 "the restarted daemon is not ready after 60 s", interval=0.001)
        ready_observed_ms = (time.monotonic() - spawned) * 1000
        ready = line_with(read_text(logs[1]), "ready:")
        since_start = re.search(r"\(([0-9.e-]+) s since serve started\)", ready)
        verified = ""
        if "ready: adopted" not in ready:
            failures.append(f"the restarted daemon did not adopt: {read_text(logs[1])}")
        elif args.adopt_verify == "full":
            if f"checksums of all {tensors} tensors" not in ready:
                failures.append(f"the restarted daemon did not verify every tensor: {ready}")
        else:  # behind: ready first, then the GPU checksum kernel over every tensor
            if "behind ready" not in ready:
                failures.append(f"the ready line does not say the checks come behind: {ready}")
            wait_for(lambda: "verif" in read_text(logs[1]).split(ready, 1)[-1]
                     or second.poll() is not None, 60,
                     "the adopted memory was not verified within 60 s of ready")
            verified = line_with(read_text(logs[1]), "verified behind ready")
            if f"checksums of all {tensors} tensors match" not in verified:
                failures.append(f"the memory was not verified behind ready: "
                                f"{read_text(logs[1])[-2000:]}")
        rchar = read_chars(second.pid)
        if rchar >= ADOPT_READ_BOUND:
            failures.append(f"the restarted daemon read {rchar} B (bound {ADOPT_READ_BOUND})")

        # Engine A, still holding the killed daemon's memory, and engine B, a fresh process
        # attached to the adopted cache: both give the reference's output.
        a_failures, after = compare_to_reference(engine_a, args.reference, torch)
        failures += [f"engine A after the restart: {f}" for f in a_failures]
        engine_b = engine(second.pid, "B", failures)
        report = {
            "tensors": tensors, "weight_bytes": att.total_bytes,
            "adopt_verify": args.adopt_verify,
            "engine_a_before": equal(before), "engine_a_after": equal(after),
            "engine_b": engine_b, "ready_line": ready, "verified_line": verified,
            "restart_ready_since_serve_started_s":
                float(since_start.group(1)) if since_start else None,
            "restart_spawn_to_ready_line_ms": round(ready_observed_ms, 1),
            "restarted_read_chars": rchar}

        if args.upgrade:
            # The upgrade handoff while engine A is attached: the successor serves the same
            # memory, the restarted daemon exits, A and a fresh engine C give the reference.
            sockets = glob.glob(socket_glob)
            up = subprocess.run([args.cli, "upgrade", "--socket", sockets[0], "--json"],
                                capture_output=True, text=True, timeout=120)
            if up.returncode != 0:
                failures.append(f"upgrade exited {up.returncode}: {up.stderr[-2000:]}")
            else:
                handed = json.loads(up.stdout.strip().splitlines()[-1])
                successor_pid = handed["successor_pid"]
                second.wait(timeout=60)
                u_failures, after_upgrade = compare_to_reference(engine_a, args.reference, torch)
                failures += [f"engine A after the upgrade: {f}" for f in u_failures]
                report["upgrade"] = {
                    "successor_pid": successor_pid, "handover_us": handed["handover_us"],
                    "old_daemon_exit": second.returncode,
                    "engine_a_after": equal(after_upgrade),
                    "engine_c": engine(successor_pid, "C", failures)}
                if second.returncode != 0:
                    failures.append(f"the upgraded daemon exited {second.returncode}")
        print(json.dumps({"keeper_check": report}))
        exit_on(failures)
    finally:
        stop([first, second])  # a deliberate stop: the keeper drops the memory
        if successor_pid is not None and not gone(successor_pid):
            os.kill(successor_pid, signal.SIGTERM)
            wait_for(lambda: gone(successor_pid), 60, "the successor did not stop in 60 s")


def cache_rows(cli: str, runtime_dir: str) -> list:
    """`weightcache ls --json`'s rows (state, tier, model_id, bytes, clients...)."""
    import subprocess

    out = subprocess.run([cli, "ls", "--json", "--runtime-dir", runtime_dir],
                         capture_output=True, text=True, check=True).stdout
    data = json.loads(out)
    return data.get("caches", data) if isinstance(data, dict) else data


def cache_row(cli: str, runtime_dir: str, model_id: str) -> dict:
    for row in cache_rows(cli, runtime_dir):
        if row.get("model_id") == model_id:
            return row
    return {}


def cmd_budget(args):
    """Two caches under a gpu budget that fits one (`serve --gpu-budget --demote host`): the
    second's admission demotes the first to host RAM; an engine attaching to the first promotes
    it back (demoting the second) and generates what the disk-loaded model generates."""
    import glob
    import subprocess

    weights = sum(os.path.getsize(f) for f in glob.glob(os.path.join(args.model, "*.safetensors")))
    # Either cache fits, both do not (each holds about the checkpoint's bytes).
    budget = str(int(weights * 1.5))
    procs = []
    failures = []

    # The default model id (the directory's name) is what the engine's load_state_dict asks for.
    ids = {"a": os.path.basename(os.path.normpath(args.model)),
           "b": os.path.basename(os.path.normpath(args.other_model))}
    if ids["a"] == ids["b"]:
        raise ValueError("--model and --other-model need directories of different names")

    def serve(model_dir: str, model_id: str, log: str):
        cmd = [args.cli, "serve", "--model", model_dir, "--tier", "gpu",
               "--device", args.device, "--runtime-dir", args.runtime_dir, "--gpu-budget", budget,
               "--demote", args.demote, "--no-keeper"]
        p = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT)
        procs.append(p)
        wait_for(lambda: "ready:" in open(log).read() or p.poll() is not None, 120,
                 f"{model_id}: not ready after 120 s")
        if p.poll() is not None:
            raise RuntimeError(f"{model_id} exited {p.returncode}: {open(log).read()[-2000:]}")
        return p

    def engine(model_dir: str) -> dict:
        r = subprocess.run([sys.executable, __file__, "attach", "--model", model_dir,
                            "--reference", args.reference, "--runtime-dir", args.runtime_dir],
                           capture_output=True, text=True)
        if r.returncode != 0:
            failures.append(f"engine on {model_dir} failed: {r.stderr[-2000:]}")
        lines = r.stdout.strip().splitlines()
        return json.loads(lines[-1]) if lines else {}

    logs = {m: os.path.join(args.runtime_dir, f"serve-{m}.log") for m in ("a", "b")}
    try:
        a = serve(args.model, ids["a"], logs["a"])
        first = engine(args.model)
        b = serve(args.other_model, ids["b"], logs["b"])
        row_a = cache_row(args.cli, args.runtime_dir, ids["a"])
        if row_a.get("state") != "demoted" or row_a.get("tier") != "host":
            failures.append(f"after b's admission a is {row_a}, not demoted to host")
        t0 = time.perf_counter()
        promoted = engine(args.model)  # the attach that promotes a (and demotes b)
        promote_s = time.perf_counter() - t0
        row_a = cache_row(args.cli, args.runtime_dir, ids["a"])
        row_b = cache_row(args.cli, args.runtime_dir, ids["b"])
        if row_a.get("state") != "ready" or row_a.get("tier") != "gpu":
            failures.append(f"after the engine's attach a is {row_a}, not ready on the gpu")
        if row_b.get("state") != "demoted":
            failures.append(f"b was not demoted to make room for a's promotion: {row_b}")
        lines = [line for m in ("a", "b") for line in open(logs[m]).read().splitlines()
                 if "demoted to host RAM" in line or "promoted" in line]
        for name, r in (("first", first), ("promoted", promoted)):
            if not (r.get("tokens_equal") and r.get("logits_equal")):
                failures.append(f"{name} engine: tokens/logits differ from the disk-loaded model")
        pinned_promotion = any("promoted back to the GPU" in line and "pinned host copy" in line
                               for line in open(logs["a"]).read().splitlines())
        if args.demote == "host-pinned" and not pinned_promotion:
            failures.append("--demote host-pinned: a's promotion did not copy from the pinned "
                            "host copy")
        if promoted.get("daemon_pid") != a.pid:
            failures.append(f"the promoted engine attached to pid {promoted.get('daemon_pid')}, "
                            f"not a's daemon {a.pid}")
        print(json.dumps({"budget_check": {
            "weight_bytes": weights, "gpu_budget": int(budget), "demote": args.demote,
            "first": {k: first.get(k) for k in ("tokens_equal", "logits_equal")},
            "promoted": {k: promoted.get(k) for k in ("tokens_equal", "logits_equal",
                                                      "load_state_dict_ms")},
            "engine_process_s_with_promotion": round(promote_s, 3),
            "moves": lines}}))
    finally:
        stop(procs)
    exit_on(failures)


def cmd_seed(args):
    """GPU 1's cache seeded from GPU 0's; an engine on GPU 1 generates from the seeded memory."""
    import subprocess

    procs = []
    failures = []

    def serve(device: str, log: str, *extra: str):
        cmd = [args.cli, "serve", "--model", args.model, "--tier", "gpu", "--device", device,
               "--runtime-dir", args.runtime_dir, "--no-keeper", *extra]
        p = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT)
        procs.append(p)
        wait_for(lambda: "ready:" in read_text(log) or p.poll() is not None, 120,
                 f"serve on {device}: not ready after 120 s")
        if p.poll() is not None:
            raise RuntimeError(f"serve on {device} exited {p.returncode}: {read_text(log)[-2000:]}")
        return p

    logs = {d: os.path.join(args.runtime_dir, f"serve-{d}.log") for d in ("gpu0", "gpu1")}
    try:
        serve(args.device0, logs["gpu0"])
        t0 = time.perf_counter()
        b = serve(args.device1, logs["gpu1"], "--seed-from", "auto")
        seed_serve_s = time.perf_counter() - t0
        seeded = line_with(read_text(logs["gpu1"]), "filled from the peer cache of " + args.device0)
        if not seeded:
            failures.append("the cache on device1 was not seeded from device0: "
                            + read_text(logs["gpu1"])[-1500:])
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=args.device1)
        r = subprocess.run([sys.executable, __file__, "attach", "--model", args.model,
                            "--reference", args.reference, "--runtime-dir", args.runtime_dir],
                           capture_output=True, text=True, env=env)
        lines = r.stdout.strip().splitlines()
        engine = json.loads(lines[-1]) if lines else {}
        if r.returncode != 0:
            failures.append(f"the engine on device1 failed: {r.stderr[-2000:]}")
        if not (engine.get("tokens_equal") and engine.get("logits_equal")):
            failures.append("the engine on device1: tokens/logits differ from the disk-loaded "
                            "model")
        if engine.get("device_uuid") != args.device1:
            failures.append(f"the engine attached on {engine.get('device_uuid')}, not device1")
        if engine.get("daemon_pid") != b.pid:
            failures.append(f"the engine attached to pid {engine.get('daemon_pid')}, not the "
                            f"seeded daemon {b.pid}")
        print(json.dumps({"seed_check": {
            "device0": args.device0, "device1": args.device1,
            "seeded": seeded.split("filled from ", 1)[-1],
            "seed_serve_s": round(seed_serve_s, 3),
            "engine": {k: engine.get(k) for k in ("tokens_equal", "logits_equal",
                                                  "load_state_dict_ms", "device_uuid")}}}))
    finally:
        stop(procs)
    exit_on(failures)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("--out", required=True)
    m.add_argument("--shape", choices=sorted(SHAPES), default="small")
    r = sub.add_parser("reference")
    r.add_argument("--model", required=True)
    r.add_argument("--out", required=True)
    a = sub.add_parser("attach")
    a.add_argument("--model", required=True)
    a.add_argument("--reference", required=True)
    a.add_argument("--runtime-dir", required=True)
    sa = sub.add_parser("shard-attach")
    sa.add_argument("--model", required=True)
    sa.add_argument("--reference", required=True)
    sa.add_argument("--runtime-dir", required=True)
    sa.add_argument("--tp", type=int, required=True)
    k = sub.add_parser("keeper")
    k.add_argument("--model", required=True)
    k.add_argument("--reference", required=True)
    k.add_argument("--runtime-dir", required=True)
    k.add_argument("--cli", required=True)
    k.add_argument("--device", required=True)
    k.add_argument("--adopt-verify", choices=("full", "behind"), default="full")
    k.add_argument("--upgrade", action="store_true",
                   help="then hand the cache to a successor with `weightcache upgrade` while "
                        "engine A is attached; A and a fresh engine C must give the reference")
    bu = sub.add_parser("budget")
    bu.add_argument("--model", required=True)
    bu.add_argument("--other-model", required=True)
    bu.add_argument("--reference", required=True)
    bu.add_argument("--runtime-dir", required=True)
    bu.add_argument("--cli", required=True)
    bu.add_argument("--device", required=True)
    bu.add_argument("--demote", choices=("host", "host-pinned"), default="host-pinned",
                    help="serve's --demote for both caches (host-pinned: the promotion must "
                         "copy from the pinned host copy)")
    se = sub.add_parser("seed")
    se.add_argument("--model", required=True)
    se.add_argument("--reference", required=True)
    se.add_argument("--runtime-dir", required=True)
    se.add_argument("--cli", required=True)
    se.add_argument("--device0", required=True, help="the UUID of the GPU that serves first")
    se.add_argument("--device1", required=True, help="the UUID of the GPU seeded from it")
    args = p.parse_args()
    {"make": cmd_make, "budget": cmd_budget, "seed": cmd_seed, "reference": cmd_reference, "attach": cmd_attach,
     "shard-attach": cmd_shard_attach, "keeper": cmd_keeper}[args.cmd](args)


if __name__ == "__main__":
    main()
