"""The NumPy sharding reference (reference.py) against itself and against values worked out by
hand from the engines' formulas. Needs no weightcache CLI: it runs on every tier, before and
after the planner lands, so the reference that test_shard_plan.py trusts is itself tested."""

from __future__ import annotations

import numpy as np
import pytest

from . import reference as ref
from . import synthetic

TP_SIZES = (1, 2, 4, 8)
EP_SIZES = (1, 2, 4)
MOE = tuple(ref.EXPERT_COUNT_KEY)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("shard-ref-models")
    return {m: synthetic.write_model(m, root / m) for m in synthetic.MODEL_TYPES}


def test_synthetic_checkpoints(models):
    """Real names and dtypes, a vocab not a multiple of 64, several shards with an index,
    fp8 weights with float32 128-block scales, small."""
    for m, d in models.items():
        ckpt = ref.read_checkpoint(d)
        assert ckpt.model_type == m
        assert ckpt.config["vocab_size"] % 64 != 0
        assert ckpt.config["num_hidden_layers"] % 2 == 1
        assert ckpt.full_bytes < 5 << 20
        assert "model.embed_tokens.weight" in ckpt.by_name
        for t in ckpt.tensors:
            assert ref.placement(ckpt, t.name) is not None, t.name
    assert len({t.file for t in ref.read_checkpoint(models["deepseek_v3"]).tensors}) == 3
    ds = ref.read_checkpoint(models["deepseek_v3"])
    w = ds.by_name["model.layers.1.self_attn.kv_b_proj.weight"]
    s = ds.by_name["model.layers.1.self_attn.kv_b_proj.weight_scale_inv"]
    assert (w.dtype, s.dtype) == ("F8_E4M3", "F32")
    assert s.shape == tuple(-(-d // 128) for d in w.shape)
    assert "lm_head.weight" not in ref.read_checkpoint(models["qwen2"]).by_name  # tied


REFUSED = synthetic.REFUSED


@pytest.mark.parametrize("model", synthetic.MODEL_TYPES)
def test_refusals_by_hand(models, model):
    for tp in TP_SIZES:
        for ep in EP_SIZES if model in MOE else (1,):
            for ranks in ref.job_ranks(tp, 2, ep):
                try:
                    ref.plan_rank(models[model], ranks)
                    refused = False
                except ref.PlanError:
                    refused = True
                assert refused == ((model, tp, ep) in REFUSED), ranks


def check_rebuild(model_dir, tp: int, pp: int, ep: int, partition: str) -> None:
    """The reference's pieces over every rank of the job rebuild each loaded tensor, each
    layer lives on exactly one PP stage, first/last/embed tensors on their stages, and skipped
    (MTP) tensors on no rank."""
    ckpt = ref.read_checkpoint(model_dir)
    seen = {t.name: np.zeros(t.shape, dtype=bool) for t in ckpt.tensors}
    stages = {t.name: set() for t in ckpt.tensors}
    for ranks in ref.job_ranks(tp, pp, ep):
        for t, s in ref.plan_rank(model_dir, ranks, partition):
            index = [slice(None)] * len(t.shape)
            if s is not None:
                assert 0 <= s.offset and s.offset + s.length <= t.shape[s.dim]
                index[s.dim] = slice(s.offset, s.offset + s.length)
            seen[t.name][tuple(index)] = True
            stages[t.name].add(ranks.pp_rank)
    layers_per_stage = [0] * pp
    for t in ckpt.tensors:
        p = ref.placement(ckpt, t.name)
        if p.mode == "skip":
            assert not seen[t.name].any(), t.name
            continue
        assert seen[t.name].all(), (t.name, tp, pp, ep)
        want = {"embed": {0, pp - 1}, "first": {0}, "last": {pp - 1}}.get(p.stage)
        if want is not None:
            assert stages[t.name] == want, (t.name, stages[t.name])
        elif p.stage == "layer":
            assert len(stages[t.name]) == 1, (t.name, stages[t.name])
            if t.name.endswith(".input_layernorm.weight"):
                layers_per_stage[stages[t.name].pop()] += 1
    L = ckpt.config["num_hidden_layers"]
    assert layers_per_stage == [len(ref.pp_layers(L, r, pp, partition)) for r in range(pp)]


@pytest.mark.parametrize("model", synthetic.MODEL_TYPES)
@pytest.mark.parametrize("partition", ["vllm", "sglang"])
def test_ranks_rebuild_every_tensor(models, model, partition):
    for tp in TP_SIZES:
        for pp in (1, 2):
            for ep in EP_SIZES if model in MOE else (1,):
                if (model, tp, ep) not in REFUSED:
                    check_rebuild(models[model], tp, pp, ep, partition)


@pytest.mark.parametrize("variant", synthetic.VARIANTS)
def test_variants_rebuild(tmp_path, variant):
    model_dir = synthetic.write_variant(variant, tmp_path / variant)
    for tp, pp, ep in ((1, 1, 1), (2, 2, 1), (2, 3, 1), (4, 4, 1)):
        check_rebuild(model_dir, tp, pp, ep, "vllm")
    if variant == "llama-7-layers":  # vLLM get_pp_indices: the remainder skips the last stage
        assert [len(ref.pp_layers(7, r, 4, "vllm")) for r in range(4)] == [2, 2, 2, 1]
    if variant == "qwen3_moe-mlp-only-layer":
        plan = {t.name: s for t, s in ref.plan_rank(model_dir, ref.Ranks(tp_size=2, tp_rank=1))}
        assert plan["model.layers.1.mlp.gate_proj.weight"] == ref.Slice(0, 64, 64)
        assert "model.layers.1.mlp.gate.weight" not in plan


def test_hand_computed(models):
    """Spot values worked out from the engines' formulas, not by the reference's code."""
    llama = models["llama"]  # 8 heads, 2 kv heads, head_dim 8, vocab 1000 (padded 1024)
    plan = {t.name: s for t, s in ref.plan_rank(llama, ref.Ranks(tp_size=8, tp_rank=5))}
    # QKVParallelLinear: tp 8 > 2 kv heads: 4 replicas, rank 5 loads head 5 // 4 = 1.
    assert plan["model.layers.0.self_attn.k_proj.weight"] == ref.Slice(0, 8, 8)
    assert plan["model.layers.0.self_attn.q_proj.weight"] == ref.Slice(0, 40, 8)
    assert plan["model.layers.0.self_attn.o_proj.weight"] == ref.Slice(1, 40, 8)
    assert plan["model.layers.0.input_layernorm.weight"] is None
    # vocab: 1024 / 8 = 128 per rank; rank 5 rows [640, 768).
    assert plan["model.embed_tokens.weight"] == ref.Slice(0, 640, 128)
    assert plan["model.layers.2.mlp.down_proj.weight"] == ref.Slice(1, 80, 16)
    plan = {t.name: s for t, s in ref.plan_rank(llama, ref.Ranks(tp_size=8, tp_rank=7))}
    assert plan["lm_head.weight"] == ref.Slice(0, 896, 104)  # [896, min(1024, 1000))
    mistral = models["mistral"]  # vocab 130 -> 192, tp 4: 48 per rank, rank 3 holds none
    plan = {t.name: s for t, s in ref.plan_rank(mistral, ref.Ranks(tp_size=4, tp_rank=2))}
    assert plan["model.embed_tokens.weight"] == ref.Slice(0, 96, 34)
    plan = {t.name: s for t, s in ref.plan_rank(mistral, ref.Ranks(tp_size=4, tp_rank=3))}
    assert plan["model.embed_tokens.weight"] == ref.Slice(0, 130, 0)
    # mistral is tied without lm_head: pp 2 holds the embedding on both stages.
    for pp_rank in (0, 1):
        names = [t.name for t, _ in ref.plan_rank(mistral, ref.Ranks(pp_size=2, pp_rank=pp_rank))]
        assert "model.embed_tokens.weight" in names
    # PP: vLLM gives 5 layers over pp 2 as [3, 2], SGLang [2, 3]; 7 over 3: [2,3,2] / [2,2,3].
    assert ref.pp_layers(5, 0, 2, "vllm") == range(0, 3)
    assert ref.pp_layers(5, 1, 2, "sglang") == range(2, 5)
    assert [len(ref.pp_layers(7, r, 3, "vllm")) for r in range(3)] == [2, 3, 2]
    assert [len(ref.pp_layers(7, r, 3, "sglang")) for r in range(3)] == [2, 2, 3]
    qwen2 = models["qwen2"]
    names = [t.name for t, _ in ref.plan_rank(qwen2, ref.Ranks(pp_size=2, pp_rank=1))]
    assert "model.layers.2.input_layernorm.weight" not in names
    assert "model.layers.3.input_layernorm.weight" in names
    # mixtral, 4 experts, tp 2 ep 4 (EP = TP x DP): ep_rank 3 holds expert 3 whole.
    plan = ref.plan_rank(models["mixtral"], ref.Ranks(2, 1, 1, 0, 4, 3))
    assert [(t.name, s) for t, s in plan if ".experts." in t.name and ".layers.0." in t.name] \
        == [(f"model.layers.0.block_sparse_moe.experts.3.{w}.weight", None)
            for w in ("w1", "w2", "w3")]
    # mixtral tp 4 ep 2: moe_tp 2, tp_rank 3 -> ep_rank 1 (experts 2, 3), moe_tp_rank 1.
    plan = {t.name: s for t, s in ref.plan_rank(models["mixtral"], ref.Ranks(4, 3, 1, 0, 2, 1))}
    assert plan["model.layers.1.block_sparse_moe.experts.2.w1.weight"] == ref.Slice(0, 32, 32)
    assert plan["model.layers.1.block_sparse_moe.experts.2.w2.weight"] == ref.Slice(1, 32, 32)
    assert "model.layers.1.block_sparse_moe.experts.1.w1.weight" not in plan
    # deepseek_v3 tp 2: q_b_proj 1536 rows -> rank 1 rows [768, 1536), scale blocks [6, 12).
    plan = {t.name: s for t, s in ref.plan_rank(models["deepseek_v3"], ref.Ranks(2, 1))}
    assert plan["model.layers.1.self_attn.q_b_proj.weight"] == ref.Slice(0, 768, 768)
    assert plan["model.layers.1.self_attn.q_b_proj.weight_scale_inv"] == ref.Slice(0, 6, 6)
    assert plan["model.layers.1.self_attn.o_proj.weight_scale_inv"] == ref.Slice(1, 4, 4)
    assert plan["model.layers.1.mlp.experts.0.down_proj.weight_scale_inv"] == ref.Slice(1, 1, 1)
    assert plan["model.layers.0.self_attn.q_a_proj.weight_scale_inv"] is None
    assert plan["model.layers.1.mlp.gate.e_score_correction_bias"] is None
    assert not any(n.startswith("model.layers.3.") for n in plan)  # MTP layer


def test_errors(models):
    with pytest.raises(ref.RankError):
        ref.plan_rank(models["llama"], ref.Ranks(tp_size=2, tp_rank=2))
    with pytest.raises(ref.RankError):
        ref.plan_rank(models["mixtral"], ref.Ranks(tp_size=2, tp_rank=1, ep_size=4, ep_rank=2))
    err = pytest.raises(ref.PlanError, ref.plan_rank, models["qwen2"], ref.Ranks(tp_size=4))
    assert "model.layers.0.self_attn.q_proj.weight" in err.value.tensors
    assert "model.layers.0.self_attn.k_proj.weight" not in err.value.tensors  # 2 kv | 4


def test_expected_rank_tensors(models):
    got = ref.expected_rank_tensors(models["llama"], ref.Ranks(tp_size=2, tp_rank=1))
    full = ref.read_checkpoint(models["llama"]).array("model.layers.1.mlp.up_proj.weight")
    assert np.array_equal(got["model.layers.1.mlp.up_proj.weight"], full[64:])
    assert got["model.layers.1.mlp.up_proj.weight"].dtype == np.dtype("<u2")  # BF16 bits


def test_canonical_digest():
    # sha256 of '{"a":1,"b":[2,"x"]}'
    import hashlib

    want = hashlib.sha256(b'{"a":1,"b":[2,"x"]}').hexdigest()
    assert ref.canonical_digest({"b": [2, "x"], "a": 1}) == want
