"""Issue 12 §2-4, host tier: a rank's daemon serves only its slice. For every built-in rule
set (synthetic checkpoints, synthetic.py) and a few jobs (TP 2, PP 2, and TP 2 x EP 2 for the
MoE sets), one real `weightcache serve --tier host` daemon per rank; each is attached through
the Python API with the same ranks, and what it serves is checked against the independent
NumPy reference (reference.py): the held tensor names, shapes, bytes and slices, the ranks
together rebuilding every tensor, and the disk fallback (no daemon) giving the same. A changed
config.json is another cache: a mismatch naming shard_rules_digest.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

import weightcache

from . import reference as ref
from . import synthetic

MOE = {"mixtral", "qwen3_moe", "deepseek_v3"}


def jobs(model_type: str) -> list:
    out = [(2, 1, 1), (1, 2, 1)]
    if model_type in MOE:
        out.append((2, 1, 2))
    return out


def identity_of(r: ref.Ranks) -> dict:
    return dict(tp_size=r.tp_size, tp_rank=r.tp_rank, pp_size=r.pp_size, pp_rank=r.pp_rank,
                ep_size=r.ep_size, ep_rank=r.ep_rank)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("synthetic")
    return {m: synthetic.write_model(m, root / m) for m in synthetic.MODEL_TYPES}


def held(att, ckpt: ref.Checkpoint) -> dict:
    """{name: (reference Slice | None, raw array)} of an attachment, checking each slice's
    full length against the checkpoint."""
    out = {}
    for t in att.tensors():
        full = ckpt.by_name[t.name]
        raw = np.asarray(t.raw())
        assert raw.nbytes == t.nbytes, t.name
        array = raw.view(ckpt._array(t.name).dtype).reshape(t.shape)
        s = None
        if t.slice is not None:
            dim, offset, length, full_length = t.slice
            assert full_length == full.shape[dim], t.name
            assert length == t.shape[dim], t.name
            s = ref.Slice(dim, offset, length)
        out[t.name] = (s, array)
    return out


def check_rank(got: dict, model_dir, r: ref.Ranks) -> None:
    planned = {t.name: s for t, s in ref.plan_rank(model_dir, r)}
    expected = ref.expected_rank_tensors(model_dir, r)
    assert sorted(got) == sorted(expected), r
    for name, array in expected.items():
        s, piece = got[name]
        assert s == planned[name], (r, name)
        assert piece.shape == array.shape, (r, name)
        assert piece.tobytes() == array.tobytes(), (r, name)


@pytest.mark.parametrize("model_type", synthetic.MODEL_TYPES)
def test_each_rank_serves_its_slices(model_type, models, serve, runtime_dir, empty_runtime_dir):
    model = models[model_type]
    ckpt = ref.read_checkpoint(model)
    for tp, pp, ep in jobs(model_type):
        ranks = ref.job_ranks(tp, pp, ep)
        try:
            ref.plan_rank(model, ranks[0])
        except ref.PlanError:
            continue  # a job the engines refuse (test_shard_plan.py checks the refusal)
        per_rank = {}
        for r in ranks:
            identity = identity_of(r)
            d = serve(model, *r.cli_args(), identity=identity)
            att = weightcache.attach(str(model), tier="host", runtime_dir=runtime_dir,
                                     on_missing="error", **identity)
            assert att.source == "daemon"
            got = held(att, ckpt)
            check_rank(got, model, r)
            per_rank[r] = got

            # The disk fallback by the same rules: the same names, slices and bytes.
            fb = weightcache.attach(str(model), tier="host", runtime_dir=empty_runtime_dir,
                                    **identity)
            assert fb.source == "fallback"
            from_disk = held(fb, ckpt)
            assert sorted(from_disk) == sorted(got)
            for name, (s, piece) in got.items():
                assert from_disk[name][0] == s, name
                assert from_disk[name][1].tobytes() == piece.tobytes(), name
            del att, fb
            d.close()
        ref.assert_rebuilds(ckpt, per_rank)


def test_changed_config_json_is_a_shard_rules_digest_mismatch(models, serve, runtime_dir,
                                                              tmp_path):
    model = tmp_path / "llama"
    shutil.copytree(models["llama"], model)
    r = ref.Ranks(tp_size=2, tp_rank=1)
    serve(model, *r.cli_args(), identity=identity_of(r))
    config = json.loads((model / "config.json").read_text())
    config["num_key_value_heads"] = config["num_attention_heads"]
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(weightcache.MismatchError) as info:
        weightcache.attach(str(model), tier="host", runtime_dir=runtime_dir, on_missing="error",
                           **identity_of(r))
    assert info.value.field_names == ["shard_rules_digest"]
