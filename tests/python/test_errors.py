"""docs/design.md "Failure semantics" at the Python edge: each failure is its own exception
carrying the socket path, the device UUID and (mismatch) every differing field with both
values — handed over by the client as data (AttachDiagnostics), never read back out of the
message."""

from __future__ import annotations

import glob
import json
import os

import pytest

import weightcache
from weightcache.errors import from_status


def replicate_all_rules(directory) -> str:
    """Shard rules that hold every tensor whole: the ranks here differ as config fields (the
    test checkpoint has no config.json, and a sharded job needs its rules)."""
    path = os.path.join(str(directory), "replicate-all.json")
    with open(path, "w") as f:
        json.dump({"format": 1, "rules": [{"match": ".*", "mode": "replicate"}]}, f)
    return path


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


def _only_socket(runtime_dir):
    # The daemon's socket; its keeper's (<stem>.keeper.sock, docs/keeper.md) sits beside it.
    sockets = [s for s in glob.glob(os.path.join(runtime_dir, "default", "host", "*.sock"))
               if not s.endswith(".keeper.sock")]
    assert len(sockets) == 1, sockets
    return sockets[0]


def test_mismatch_names_each_field(checkpoint, runtime_dir, serve, tmp_path):
    model_dir, _ = checkpoint
    rules = replicate_all_rules(tmp_path)
    d = serve(model_dir, "--revision", "r1", "--tp-size", "2", "--tp-rank", "1",
              "--shard-rules", rules,
              identity=dict(revision="r1", tp_size=2, tp_rank=1, shard_rules=rules))
    with pytest.raises(weightcache.MismatchError) as info:
        weightcache.attach(model_dir, tier="host", runtime_dir=runtime_dir, revision="r2",
                           tp_size=2, tp_rank=0, shard_rules=rules)
    e = info.value
    assert e.code == "mismatch" and e.exit_code == 4
    # Canonical field order; string values decoded, numbers in decimal.
    assert e.fields == [("revision", "r1", "r2"), ("tp_rank", "1", "0")]
    assert e.field_names == ["revision", "tp_rank"]
    assert e.device_uuid == "host"
    # Our own (absent) socket; the daemon that differs is another cache of the model (the
    # sibling scan), named as data and in the message.
    assert e.socket_path.startswith(os.path.join(runtime_dir, "default", "host") + "/")
    assert e.daemon_socket == _only_socket(runtime_dir) != e.socket_path
    assert e.daemon_pid == d.proc.pid
    assert "holds a different config" in str(e)
    assert f"at {e.daemon_socket} (pid {d.proc.pid})" in str(e)
    assert 'revision: ours="r2" theirs="r1"; tp_rank: ours=0 theirs=1' in str(e)


# Values an engine may well use (a revision is free text) that a reader of the message cannot
# take apart reliably: quotes, commas, '=', ';', parentheses, spaces — and a model id that
# itself reads like a field difference, which the message prints unquoted.
MODEL_ID = "m: ours=1 theirs=2"
DAEMON_REVISION = 'r1 "beta", a=b; (c)'
CLIENT_REVISION = "r2, x=\"y\" theirs=z"


def test_mismatch_fields_are_data_not_parsed_text(checkpoint, runtime_dir, serve, tmp_path):
    model_dir, _ = checkpoint
    rules = replicate_all_rules(tmp_path)
    d = serve(model_dir, "--model-id", MODEL_ID, "--revision", DAEMON_REVISION, "--tp-size",
              "2", "--tp-rank", "1", "--shard-rules", rules,
              identity=dict(model_id=MODEL_ID, revision=DAEMON_REVISION, tp_size=2, tp_rank=1,
                            shard_rules=rules))
    ours = dict(tier="host", runtime_dir=runtime_dir, model_id=MODEL_ID,
                revision=CLIENT_REVISION, tp_size=2, tp_rank=0, shard_rules=rules)
    # Through the sibling scan (our exact socket is absent) ...
    with pytest.raises(weightcache.MismatchError) as info:
        weightcache.attach(model_dir, **ours)
    e = info.value
    expected = [("revision", DAEMON_REVISION, CLIENT_REVISION), ("tp_rank", "1", "0")]
    assert e.fields == expected
    assert e.field_names == ["revision", "tp_rank"]
    assert e.daemon_socket == _only_socket(runtime_dir) and e.daemon_pid == d.proc.pid
    # The message shows the same values, strings JSON-quoted.
    assert (f"revision: ours={json.dumps(CLIENT_REVISION)} "
            f"theirs={json.dumps(DAEMON_REVISION)}; tp_rank: ours=0 theirs=1") in str(e)
    assert f'model "{MODEL_ID}"' in str(e)

    # ... and from the daemon itself (an explicit socket: no scan).
    with pytest.raises(weightcache.MismatchError) as info:
        weightcache.attach(model_dir, socket=e.daemon_socket, **ours)
    direct = info.value
    assert direct.fields == expected
    assert direct.socket_path == direct.daemon_socket == e.daemon_socket
    assert direct.daemon_pid == d.proc.pid
    assert f"daemon at {direct.socket_path} (pid {d.proc.pid}) holds a different config" in str(
        direct)


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


def test_from_status_takes_the_fields_as_given():
    # A message that reads like differences is not parsed: the fields are what the client
    # handed over (here none), and the other statuses carry none.
    e = from_status("config mismatch", "x: ours=1 theirs=2", "/r/a.sock", "host",
                    fields=[("tp_rank", "1", "0")], daemon_socket="/r/b.sock", daemon_pid=7)
    assert isinstance(e, weightcache.MismatchError)
    assert e.fields == [("tp_rank", "1", "0")] and e.field_names == ["tp_rank"]
    assert (e.socket_path, e.daemon_socket, e.daemon_pid) == ("/r/a.sock", "/r/b.sock", 7)
    bare = from_status("config mismatch", "x: ours=1 theirs=2")
    assert bare.fields == [] and bare.daemon_socket is None and bare.daemon_pid is None
    assert type(from_status("no daemon", "no daemon at /r/a.sock")) is weightcache.NoDaemonError
