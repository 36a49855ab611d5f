"""weightcache.publish / publish_state_dict on the host tier (docs/publish.md): a real
`weightcache serve --source published:<tag>` process, NumPy tensors published from this
process, attaches through the package."""

from __future__ import annotations

import subprocess
import time

import numpy as np
import pytest

import weightcache

SOURCE = "published:py-engine-v1"
MODEL_ID = "py-fused"


@pytest.fixture
def published(runtime_dir, tmp_path):
    """An awaiting `serve --source published:<tag>` daemon on the host tier."""
    log = open(tmp_path / "serve.log", "wb")
    proc = subprocess.Popen(
        [weightcache.cli_path(), "serve", "--source", SOURCE, "--model-id", MODEL_ID, "--tier",
         "host", "--runtime-dir", runtime_dir], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, (tmp_path / "serve.log").read_text()
        try:
            attach(runtime_dir, wait_timeout=0.05)
            raise AssertionError("a published daemon was ready before any publish")
        except weightcache.DaemonTimeoutError as e:
            assert "awaiting its publisher" in str(e)
            break
        except weightcache.NoDaemonError:
            assert time.monotonic() < deadline, (tmp_path / "serve.log").read_text()
            time.sleep(0.05)
    yield runtime_dir
    proc.kill()
    proc.wait(timeout=30)
    log.close()


def attach(runtime_dir, wait_timeout=10.0):
    # A published identity reads no checkpoint: the model dir is not part of it.
    return weightcache.attach("unused", tier="host", source=SOURCE, model_id=MODEL_ID,
                              runtime_dir=runtime_dir, on_missing="error",
                              wait_timeout=wait_timeout)


def identity(runtime_dir):
    return dict(source=SOURCE, model_id=MODEL_ID, tier="host", runtime_dir=runtime_dir)


def test_published_arrays_and_metadata_reach_the_attach(published):
    rng = np.random.default_rng(7)
    tensors = {
        "layers.0.qkv_proj.weight": rng.standard_normal((96, 64), dtype=np.float32),
        "layers.0.gate_up_proj.weight": rng.standard_normal((128, 64)).astype(np.float16),
        "layers.0.gate_up_proj.scale": np.array(0.5, dtype=np.float32),
        "layers.0.mask": rng.integers(0, 2, (7, 3)).astype(bool),
        "layers.0.codes": rng.integers(-128, 128, (5, 11), dtype=np.int8),
    }
    blob = b"engine 1.0\x00fused qkv"
    count = weightcache.publish(tensors, metadata=blob, **identity(published))
    assert count == 5

    att = attach(published)
    assert att.source == "daemon"
    assert att.metadata == blob
    assert sorted(att.names()) == sorted(tensors)
    for name, want in tensors.items():
        got = att[name].numpy()
        assert got.dtype == want.dtype, name
        assert got.shape == want.shape, name
        np.testing.assert_array_equal(got, want)


def test_publish_state_dict_publishes_a_tied_tensor_once(published):
    rng = np.random.default_rng(8)
    embed = rng.standard_normal((32, 16), dtype=np.float32)
    state_dict = {
        "model.embed_tokens.weight": embed,
        "lm_head.weight": embed,               # tied: the same array
        "model.norm.weight": embed[3],         # a view at another offset: a copy of its own
        "model.copy.weight": embed.copy(),     # equal bytes, other memory: a copy of its own
    }
    assert weightcache.publish_state_dict(state_dict, **identity(published)) == 4

    att = attach(published)
    embed_out = att["model.embed_tokens.weight"].numpy()
    head_out = att["lm_head.weight"].numpy()
    assert np.shares_memory(embed_out, head_out)
    assert embed_out.__array_interface__["data"][0] == head_out.__array_interface__["data"][0]
    assert not np.shares_memory(embed_out, att["model.copy.weight"].numpy())
    assert not np.shares_memory(embed_out, att["model.norm.weight"].numpy())
    np.testing.assert_array_equal(head_out, embed)
    np.testing.assert_array_equal(att["model.norm.weight"].numpy(), embed[3])
    np.testing.assert_array_equal(att["model.copy.weight"].numpy(), embed)
    assert att.metadata == b""


def test_non_contiguous_and_unknown_dtypes_are_refused_naming_the_tensor(published):
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    with pytest.raises(ValueError, match="tensor 'a.t' is not contiguous"):
        weightcache.publish({"ok": a, "a.t": a.T}, **identity(published))
    with pytest.raises(TypeError, match="tensor 'c': dtype complex64 has no safetensors"):
        weightcache.publish({"c": np.zeros(2, dtype=np.complex64)}, **identity(published))
    with pytest.raises(TypeError, match="unexpected keyword argument 'on_missing'"):
        weightcache.publish({"ok": a}, on_missing="error", **identity(published))
    # Nothing was sent: the daemon is still awaiting, and takes the next publish.
    with pytest.raises(weightcache.DaemonTimeoutError, match="awaiting its publisher"):
        attach(published, wait_timeout=0.05)
    weightcache.publish({"ok": a}, **identity(published))
    np.testing.assert_array_equal(attach(published)["ok"].numpy(), a)


def test_a_second_publish_into_a_ready_cache_raises_already_served(published):
    a = np.ones(4, dtype=np.float32)
    weightcache.publish({"a": a}, **identity(published))
    with pytest.raises(weightcache.AlreadyServedError, match="--replace"):
        weightcache.publish({"a": a * 2}, **identity(published))
    np.testing.assert_array_equal(attach(published)["a"].numpy(), a)


def test_publish_without_a_daemon_raises_no_daemon(runtime_dir):
    with pytest.raises(weightcache.NoDaemonError):
        weightcache.publish({"a": np.ones(4, dtype=np.float32)}, timeout=1.0,
                            **identity(runtime_dir))


def test_wait_for_publisher_false_is_absent_at_once_while_nobody_publishes(published):
    # The engine plugins' attach: no wait on a daemon nobody publishes to; the reason says so
    # (a wait of 600 s would have said "still awaiting its publisher after 600000 ms").
    with pytest.raises(weightcache.NoDaemonError, match="awaits its publisher, and none is "
                                                        "publishing"):
        weightcache.attach("unused", tier="host", source=SOURCE, model_id=MODEL_ID,
                           runtime_dir=published, on_missing="error", wait_timeout=600.0,
                           wait_for_publisher=False)
    a = np.arange(6, dtype=np.float32)
    weightcache.publish({"a": a}, **identity(published))
    got = weightcache.attach("unused", tier="host", source=SOURCE, model_id=MODEL_ID,
                             runtime_dir=published, on_missing="error",
                             wait_for_publisher=False)
    np.testing.assert_array_equal(got["a"].numpy(), a)
