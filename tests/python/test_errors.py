"""SPEC §4 at the Python edge: each failure is its own exception carrying the socket path,
the device UUID and (mismatch) every differing field with both values."""

from __future__ import annotations

import os

import pytest

import weightcache
from weightcache.errors import parse_mismatch_fields


def test_missing_daemon_raises_no_daemon_error(checkpoint, runtime_dir):
    model_dir, _ = checkpoint
    with pytest.raises(weightcache.NoDaemonError) as info:
        weightcache.attach(model_dir, tier="host", runtime_dir=runtime_dir, on_missing="error")
    e = info.value
    assert e.code == "no_daemon" and e.exit_code == 3
    assert e.device_uuid == "host"
    assert e.socket_path.startswith(os.path.join(runtime_dir, "default", "host") + "/")
    assert e.socket_path.endswith(".sock")
    assert f"no daemon at {e.socket_path}" in str(e)
    assert "(on_missing=error)" in str(e)
    assert isinstance(e, weightcache.WeightcacheError)


def test_missing_daemon_falls_back_by_default(checkpoint, runtime_dir):
    model_dir, manifest = checkpoint
    att = weightcache.attach(model_dir, tier="host", runtime_dir=runtime_dir)
    assert att.source == "fallback" and not att.daemon_alive and att.daemon_pid == 0
    assert att.source_reason.startswith(f"no daemon at {att.socket_path}")
    assert len(att) == len(manifest)


def test_mismatch_names_each_field(checkpoint, runtime_dir, serve):
    model_dir, _ = checkpoint
    serve(model_dir, "--revision", "r1", "--tp-size", "2", "--tp-rank", "1",
          identity=dict(revision="r1", tp_size=2, tp_rank=1))
    with pytest.raises(weightcache.MismatchError) as info:
        weightcache.attach(model_dir, tier="host", runtime_dir=runtime_dir, revision="r2",
                           tp_size=2, tp_rank=0)
    e = info.value
    assert e.code == "mismatch" and e.exit_code == 4
    assert sorted(e.fields) == [("revision", "r1", "r2"), ("tp_rank", "1", "0")]
    assert e.field_names == ["revision", "tp_rank"] or e.field_names == ["tp_rank", "revision"]
    assert e.device_uuid == "host"
    # Our own (absent) socket; the message names the daemon's socket that differs.
    assert e.socket_path.startswith(os.path.join(runtime_dir, "default", "host") + "/")
    assert "holds a different config" in str(e)


def test_mismatch_fallback_is_explicit(checkpoint, runtime_dir, serve):
    model_dir, _ = checkpoint
    serve(model_dir, "--revision", "r1", identity=dict(revision="r1"))
    att = weightcache.attach(model_dir, tier="host", runtime_dir=runtime_dir, revision="r2",
                             on_mismatch="fallback")
    assert att.source == "fallback"
    assert att.source_reason.startswith("mismatch ignored (on_mismatch=fallback)")
    assert "revision" in att.source_reason


def test_invalid_checkpoint(tmp_path, runtime_dir):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "model.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(weightcache.InvalidCheckpointError) as info:
        weightcache.attach(bad, tier="host", runtime_dir=runtime_dir)
    assert info.value.code == "invalid_checkpoint" and info.value.exit_code == 5
    assert isinstance(info.value, ValueError)
    assert "model.safetensors" in str(info.value)


def test_bad_options(checkpoint, runtime_dir):
    model_dir, _ = checkpoint
    with pytest.raises(ValueError, match='tier must be "gpu" or "host", not "tpu"'):
        weightcache.attach(model_dir, tier="tpu")
    with pytest.raises(ValueError, match='on_missing must be "fallback" or "error"'):
        weightcache.attach(model_dir, tier="host", on_missing="maybe")
    with pytest.raises(TypeError, match="unexpected keyword argument 'tp_szie'"):
        weightcache.attach(model_dir, tier="host", tp_szie=2)
    with pytest.raises(weightcache.InvalidArgumentError) as info:
        weightcache.attach(model_dir, tier="host", runtime_dir=runtime_dir, tp_size=2,
                           tp_rank=2)
    assert info.value.code == "invalid_argument"
    assert "tp_rank" in str(info.value)


def test_parse_mismatch_fields_decodes_json_strings():
    msg = ('daemon at /r/x.sock (pid 7) holds a different config (model_id, revision, tp_rank): '
           'model_id: ours="a; b" theirs="c \\"d\\"" ; revision: ours="" theirs="v2"; '
           'tp_rank: ours=0 theirs=1')
    assert parse_mismatch_fields(msg) == [("model_id", 'c "d"', "a; b"), ("revision", "v2", ""),
                                          ("tp_rank", "1", "0")]
    # The client's manifest tier check spells its values bare.
    assert parse_mismatch_fields("serves the host tier (tier: ours=gpu theirs=host)") == [
        ("tier", "host", "gpu")]
