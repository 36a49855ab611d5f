"""Tiny causal LMs for the engine tier (tests/engines): random weights, a byte-level BPE
tokenizer trained here with `tokenizers`, saved with transformers' save_pretrained (real
safetensors files). Nothing is downloaded."""

from __future__ import annotations

import os
from typing import Any

_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "weights stay resident in memory so engines restart in milliseconds",
    "a daemon serves tensors over a unix socket to every engine process",
    "one two three four five six seven eight nine ten",
] * 50


def _tokenizer(path: str) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=256, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", pad_token="</s>")
    fast.save_pretrained(path)
    return fast


def make(path: str, arch: str = "llama", *, seed: int = 0, dtype: str = "bfloat16",
         tie: bool = False) -> str:
    """A tiny `arch` ("llama" or "qwen2") checkpoint at `path` (created); returns `path`."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    os.makedirs(path, exist_ok=True)
    tok = _tokenizer(path)
    common = dict(vocab_size=len(tok), hidden_size=256, intermediate_size=512,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=256, tie_word_embeddings=tie,
                  bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                  pad_token_id=tok.pad_token_id, dtype=dtype)
    config = LlamaConfig(**common) if arch == "llama" else Qwen2Config(**common)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)  # larger than the default init: tokens depend on the weights
    model.save_pretrained(path, safe_serialization=True)
    return path


if __name__ == "__main__":
    import sys

    make(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "llama")
