"""Attach in O(allocations) from Python (issue 14): names() in one pass, and the bulk views
load_state_dict builds (ViewPlan: a few region exports, one as_strided per run of evenly spaced
tensors), checked here through numpy_views on the host tier against the per-tensor path: the
same names, bytes, dtypes and shapes, the same memory (zero-copy), read-only, and the
attachment kept alive by the views alone."""

from __future__ import annotations

import gc
import hashlib
import json
import subprocess
import sys
import weakref

import numpy as np
import pytest

import weightcache
from weightcache import _view_plan

from conftest import MAKE_CHECKPOINT


def address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


@pytest.fixture(scope="module")
def layered(tmp_path_factory):
    """(model_dir, manifest) of a model-shaped checkpoint: 6 layers of 9 tensors (bf16, f32,
    f16), embeddings and a norm, so that the plan has runs of more than one tensor."""
    out = tmp_path_factory.mktemp("layered") / "llama-ish"
    spec = [{"name": "model.embed_tokens.weight", "shape": [64, 16], "dtype": "bf16"},
            {"name": "model.norm.weight", "shape": [16], "dtype": "f32"},
            {"name": "lm_head.weight", "shape": [64, 16], "dtype": "bf16"}]
    for i in range(6):
        p = f"model.layers.{i}."
        spec += [{"name": p + "input_layernorm.weight", "shape": [16], "dtype": "f32"},
                 {"name": p + "post_attention_layernorm.weight", "shape": [16], "dtype": "f32"},
                 {"name": p + "self_attn.q_proj.weight", "shape": [16, 16], "dtype": "bf16"},
                 {"name": p + "self_attn.k_proj.weight", "shape": [8, 16], "dtype": "bf16"},
                 {"name": p + "self_attn.v_proj.weight", "shape": [8, 16], "dtype": "bf16"},
                 {"name": p + "self_attn.o_proj.weight", "shape": [16, 16], "dtype": "bf16"},
                 {"name": p + "mlp.gate_proj.weight", "shape": [32, 16], "dtype": "f16"},
                 {"name": p + "mlp.up_proj.weight", "shape": [32, 16], "dtype": "f16"},
                 {"name": p + "mlp.down_proj.weight", "shape": [16, 32], "dtype": "f16"},
                 {"name": p + "rotary.scalar", "shape": [], "dtype": "f32"}]
    spec_path = out.parent / "spec.json"
    spec_path.write_text(json.dumps(spec))
    manifest = out.parent / "manifest.json"
    subprocess.run([sys.executable, str(MAKE_CHECKPOINT), "--out", str(out), "--spec",
                    str(spec_path), "--shards", "2", "--seed", "3", "--manifest", str(manifest)],
                   check=True, stdout=subprocess.DEVNULL)
    return out, json.loads(manifest.read_text())["tensors"]


@pytest.fixture(params=["all-dtypes", "layered"])
def model(request, checkpoint, layered):
    return checkpoint if request.param == "all-dtypes" else layered


@pytest.fixture(params=["daemon", "fallback"])
def attachment(request, model, runtime_dir, serve):
    model_dir, _ = model
    if request.param == "daemon":
        serve(model_dir)
    att = weightcache.attach(model_dir, tier="host", runtime_dir=runtime_dir)
    assert att.source == request.param, att.source_reason
    return att


def test_names_are_the_tables_names_in_order(attachment, model):
    _, manifest = model
    names = attachment.names()
    assert names == sorted(manifest)
    assert names == [t.name for t in attachment.tensors()]
    assert names is not attachment.names(), "a fresh list each call"
    assert all(n in attachment and attachment[n].name == n for n in names)


def test_timings_name_the_phases_of_the_attach(attachment):
    t = attachment.timings
    assert set(t) == {"resolve_ms", "discover_ms", "map_ms", "table_ms", "fallback_ms"}
    assert all(isinstance(v, float) and v >= 0 for v in t.values())
    assert (t["fallback_ms"] > 0) == (attachment.source == "fallback")


def test_numpy_views_equal_the_per_tensor_path(attachment, model):
    _, manifest = model
    views = weightcache.numpy_views(attachment)
    assert list(views) == attachment.names()
    for name, view in views.items():
        t = attachment[name]
        assert address(view) == t.data_ptr, f"{name} is not zero-copy"
        assert view.nbytes == t.nbytes
        assert not view.flags.writeable
        assert hashlib.sha256(view.tobytes()).hexdigest() == manifest[name]["sha256"], name
        if t.numpy_native:
            expected = t.numpy()
            assert view.dtype == expected.dtype and view.shape == expected.shape, name
            np.testing.assert_array_equal(view, expected)
        else:
            assert view.dtype == np.uint8 and view.shape == (t.nbytes,), name


def test_the_plan_builds_layers_in_runs(layered, runtime_dir, serve):
    model_dir, manifest = layered
    serve(model_dir)
    att = weightcache.attach(model_dir, tier="host", runtime_dir=runtime_dir)
    regions, runs, names, rest, order = _view_plan(att)
    assert rest == 0
    assert sorted(names) == order == sorted(manifest)
    assert sum(run[3] for run in runs) == len(manifest)
    # Each per-layer name (10 of them) recurs in 6 layers that the daemon's arena lays out
    # evenly within a shard: most of the 63 tensors come in runs of several.
    in_runs = sum(run[3] for run in runs if run[3] > 1)
    assert in_runs >= 40, runs
    assert len(regions) <= 2


def test_views_alone_keep_the_attachment_alive(layered, runtime_dir, serve):
    model_dir, manifest = layered
    serve(model_dir)
    att = weightcache.attach(model_dir, tier="host", runtime_dir=runtime_dir)
    views = weightcache.numpy_views(att)
    ref = weakref.ref(att)
    del att
    gc.collect()
    assert ref() is not None, "the views must hold their attachment"
    name = "model.layers.3.mlp.down_proj.weight"
    one = views[name]
    del views
    gc.collect()
    assert ref() is not None, "one view must hold the attachment"
    assert hashlib.sha256(one.tobytes()).hexdigest() == manifest[name]["sha256"]
    del one
    gc.collect()
    assert ref() is None, "the attachment must go once no view is left"


def test_numpy_views_refuse_the_gpu_tier_by_name(attachment):
    class Gpu:
        tier = "gpu"
    with pytest.raises(TypeError, match="host-tier"):
        weightcache.numpy_views(Gpu())


# ---- load_state_dict's torch tensors (bulk DLPack capsules), where torch is installed ---------

def torch_or_skip():
    return pytest.importorskip("torch", reason="torch is not installed (CI): the device "
                                                "machine runs these tests")


def per_tensor_torch(torch, att):
    return {t.name: weightcache._torch_tensor(torch, t) for t in att.tensors()}


def assert_same_tensors(torch, got, want, manifest):
    assert list(got) == list(want)
    for name, w in want.items():
        g = got[name]
        assert g.dtype == w.dtype and g.shape == w.shape and g.stride() == w.stride(), name
        assert g.data_ptr() == w.data_ptr(), f"{name} is not zero-copy"
        raw = g.contiguous().view(-1).view(torch.uint8) if g.numel() else g.view(torch.uint8)
        assert hashlib.sha256(raw.numpy().tobytes()).hexdigest() == manifest[name]["sha256"], name


def test_load_state_dict_equals_the_per_tensor_path(attachment, model, runtime_dir):
    torch = torch_or_skip()
    model_dir, manifest = model
    sd = weightcache.load_state_dict(model_dir, device="cpu", runtime_dir=runtime_dir)
    assert sd.attachment.source == attachment.source
    assert list(sd) == attachment.names()
    assert_same_tensors(torch, sd, per_tensor_torch(torch, sd.attachment), manifest)


def test_a_refused_import_takes_the_per_tensor_path(layered, runtime_dir, serve, monkeypatch):
    # Fault injection: a torch whose DLPack importer refuses every capsule (as an older torch
    # refuses an fp8 code) must still give every tensor, through the per-tensor path.
    torch = torch_or_skip()
    model_dir, manifest = layered
    serve(model_dir)
    refused = []

    def refuse(capsule):
        refused.append(capsule)
        raise BufferError("this torch cannot import the dtype")

    monkeypatch.setattr(torch._C, "_from_dlpack", refuse)
    sd = weightcache.load_state_dict(model_dir, device="cpu", runtime_dir=runtime_dir)
    monkeypatch.undo()
    assert len(refused) == 3, "one refused import per dtype (bf16, f32, f16)"
    del refused
    assert_same_tensors(torch, sd, per_tensor_torch(torch, sd.attachment), manifest)


def test_torch_tensors_alone_keep_the_attachment_alive(layered, runtime_dir, serve):
    torch = torch_or_skip()
    model_dir, manifest = layered
    serve(model_dir)
    sd = weightcache.load_state_dict(model_dir, device="cpu", runtime_dir=runtime_dir)
    ref = weakref.ref(sd.attachment)
    name = "model.layers.3.mlp.down_proj.weight"
    one = sd[name]
    del sd
    gc.collect()
    assert ref() is not None, "one tensor must hold the attachment"
    raw = one.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    assert hashlib.sha256(raw).hexdigest() == manifest[name]["sha256"]
    del one
    gc.collect()
    assert ref() is None, "the attachment must go once no tensor is left"


def test_unconsumed_capsules_release_the_attachment(layered, runtime_dir, serve):
    model_dir, _ = layered
    serve(model_dir)
    att = weightcache.attach(model_dir, tier="host", runtime_dir=runtime_dir)
    groups, rest, order = weightcache._dlpack_capsules(att)
    assert rest == [] and order == att.names()
    assert sorted(g[0] for g in groups) == ["BF16", "F16", "F32"]
    assert sorted(n for _, names, _ in groups for n in names) == order
    ref = weakref.ref(att)
    del att
    gc.collect()
    assert ref() is not None, "the capsules hold the attachment"
    del groups
    gc.collect()
    assert ref() is None, "dropped capsules release it"
