"""weightcache.integrations.transformers (docs/python.md "transformers"), host tier, CPU torch:
a tiny random Llama saved with save_pretrained; start 1 loads it, fuses q/k/v and gate/up
(examples/transformers_publish.py) and publishes (spawning the daemon); start 2 attaches,
builds the fused structure on meta and assigns the attached tensors: the same logits, bit for
bit, from parameters that are the daemon's memory."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import weightcache  # noqa: E402
from weightcache.integrations import transformers as wct  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import transformers_publish as example  # noqa: E402

TAG = "py-fused-qkv-v1"


@pytest.fixture
def daemons(runtime_dir):
    yield runtime_dir
    subprocess.run([weightcache.cli_path(), "stop", "--all", "--runtime-dir", runtime_dir,
                    "--timeout", "30"], check=False, capture_output=True)


@pytest.fixture
def tiny_llama(tmp_path):
    return example.write_tiny_llama(str(tmp_path / "tiny-llama"))


def _load(model_dir, runtime_dir, **kw):
    return wct.load(model_dir, post_process=example.fuse, build=example.fuse_structure,
                    publish_tag=TAG, device="cpu", runtime_dir=runtime_dir, **kw)


def test_first_start_publishes_second_attaches_with_identical_logits(tiny_llama, daemons):
    ids = torch.tensor([[1, 7, 42, 3, 99, 5]])
    first = _load(tiny_llama, daemons)
    assert not hasattr(first, "weightcache_attachment")
    assert "model.layers.0.self_attn.qkv_proj.weight" in first.state_dict()
    assert "model.layers.0.self_attn.q_proj.weight" not in first.state_dict()
    with torch.no_grad():
        want = first(ids).logits

    second = _load(tiny_llama, daemons)
    att = second.weightcache_attachment
    assert att.source == "daemon"
    assert att.tier == "host"
    with torch.no_grad():
        got = second(ids).logits
    assert torch.equal(got, want)
    # Zero copy: every parameter is the daemon's tensor, at its address.
    params = dict(second.named_parameters())
    assert set(params) == set(att.names())
    for name, p in params.items():
        assert p.data_ptr() == att[name].data_ptr, name
    meta = json.loads(att.metadata)
    assert meta["format"] == wct.METADATA_FORMAT
    assert meta["model_class"] == "AutoModelForCausalLM"


def test_published_tensors_of_another_config_are_a_mismatch_naming_the_field(tiny_llama,
                                                                             daemons, tmp_path):
    _load(tiny_llama, daemons)
    other = tmp_path / "other" / "tiny-llama"
    shutil.copytree(tiny_llama, other)
    config = json.loads((other / "config.json").read_text())
    config["rms_norm_eps"] = 1e-3
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(weightcache.MismatchError, match="config.rms_norm_eps") as e:
        _load(other, daemons)
    assert ("config.rms_norm_eps", "1e-06", "0.001") in e.value.fields


def test_no_daemon_and_no_checkpoint_is_a_clear_error(daemons, tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        _load(str(tmp_path), daemons)


def test_tied_embeddings_are_published_once_and_attached_shared(tmp_path, daemons):
    model_dir = example.write_tiny_llama(str(tmp_path / "tied-llama"), tie_word_embeddings=True)
    ids = torch.tensor([[4, 8, 15, 16, 23, 42]])
    first = _load(model_dir, daemons)
    assert first.lm_head.weight.data_ptr() == first.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        want = first(ids).logits
    second = _load(model_dir, daemons)
    att = second.weightcache_attachment
    # One region under both names: the attach maps them onto the same bytes.
    assert att["lm_head.weight"].data_ptr == att["model.embed_tokens.weight"].data_ptr
    assert second.lm_head.weight.data_ptr() == second.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        assert torch.equal(second(ids).logits, want)


def test_the_example_prints_the_same_logits_from_both_starts(daemons):
    example_py = Path(example.__file__)
    out = subprocess.run([sys.executable, str(example_py), "--demo", "--tag", "py-example-v1",
                          "--runtime-dir", daemons], check=True, stdout=subprocess.PIPE,
                         text=True, timeout=300).stdout
    lines = [ln for ln in out.splitlines() if ln.startswith("start ")]
    assert len(lines) == 2, out
    assert "loaded, fused and published as published:py-example-v1" in lines[0]
    assert "attached published:py-example-v1" in lines[1]
    assert lines[0].split("logits")[1] == lines[1].split("logits")[1]


def test_a_published_model_starts_without_its_checkpoint(tiny_llama, daemons, tmp_path):
    ids = torch.tensor([[2, 3, 5, 7, 11]])
    first = _load(tiny_llama, daemons)
    with torch.no_grad():
        want = first(ids).logits
    # The checkpoint is gone: the config comes from the published cache's metadata.
    shutil.rmtree(tiny_llama)
    second = _load(tiny_llama, daemons)
    with torch.no_grad():
        assert torch.equal(second(ids).logits, want)


def test_no_daemon_and_no_checkpoint_names_both(daemons, tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError) as e:
        _load(str(missing), daemons, model_id="no-such-model")
    assert str(missing) in str(e.value)
    assert f"no daemon serves published:{TAG} for model_id 'no-such-model'" in str(e.value)
