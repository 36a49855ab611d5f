"""One engine start, as a user runs it: a fresh process builds a real vLLM or SGLang engine on
CPU, generates greedily and prints one JSON line (``RESULT {...}``) with the token ids, their
logprobs and the time from the start of the process to the engine being ready and to the first
token. tests/engines/ runs it once per start, so that every start is a process restart.

    python run_engine.py --engine vllm --model DIR --load-format weightcache \
        [--dtype bfloat16] [--extra '{"wait_timeout": 2}']
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

START = time.perf_counter()
PROMPTS = ["the quick brown", "a daemon serves"]
MAX_TOKENS = 12


def run_vllm(args: argparse.Namespace) -> dict:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams

    kwargs = {"model_loader_extra_config": json.loads(args.extra)} if args.extra else {}
    llm = LLM(model=args.model, load_format=args.load_format, dtype=args.dtype,
              max_model_len=128, enforce_eager=True, seed=0, **kwargs)
    ready = time.perf_counter() - START
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                logprobs=1))
    first = time.perf_counter() - START
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [[lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
                for o in outs]
    return {"tokens": tokens, "logprobs": logprobs, "text": [o.outputs[0].text for o in outs],
            "ready_s": ready, "first_token_s": first}


def run_sglang(args: argparse.Namespace) -> dict:
    import sglang

    kwargs = {}
    if args.extra:
        kwargs["model_loader_extra_config"] = args.extra
    engine = sglang.Engine(model_path=args.model, load_format=args.load_format,
                           dtype=args.dtype, device="cpu", attention_backend="torch_native",
                           sampling_backend="pytorch", disable_cuda_graph=True,
                           mem_fraction_static=0.3, context_length=128, random_seed=0,
                           log_level="info", **kwargs)
    try:
        ready = time.perf_counter() - START
        outs = engine.generate(PROMPTS, {"temperature": 0, "max_new_tokens": MAX_TOKENS},
                               return_logprob=True)
        first = time.perf_counter() - START
        tokens = [list(o["output_ids"]) for o in outs]
        logprobs = [[lp[0] for lp in o["meta_info"]["output_token_logprobs"]] for o in outs]
    finally:
        engine.shutdown()
    return {"tokens": tokens, "logprobs": logprobs, "text": [o["text"] for o in outs],
            "ready_s": ready, "first_token_s": first}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--engine", choices=("vllm", "sglang"), required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--load-format", required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--extra", default="")
    args = parser.parse_args()
    result = run_vllm(args) if args.engine == "vllm" else run_sglang(args)
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
