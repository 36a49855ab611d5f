"""Issue 12, a sharded job through the launcher (host tier): `weightcache launch --tp 2 --pp 2`
of a synthetic Llama starts one daemon per rank on its own GPU (a 4-GPU device inventory), each
holding only that rank's slices. An engine process of each rank finds its daemon by the device
it runs on (CUDA_VISIBLE_DEVICES and the index it was given, never by its rank) and gets what
the independent NumPy reference (reference.py) says that rank holds; the daemons' byte counts
are their plans' held bytes, together less than four whole copies. A rank that attaches with
another rank's device is told which field differs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess

import numpy as np
import pytest

import weightcache

from . import reference as ref
from . import synthetic


def gpu_uuid(i: int) -> str:
    return f"GPU-{0xabc000 + i:08x}-0000-4000-8000-{i:012x}"


@pytest.fixture
def job(tmp_path, runtime_dir):
    model = synthetic.write_model("llama", tmp_path / "llama")
    inventory = tmp_path / "inventory.json"
    inventory.write_text(json.dumps([
        {"index": i, "uuid": gpu_uuid(i), "name": "Fake H200", "memory_bytes": 150_000_000_000}
        for i in range(4)]))
    out = subprocess.run(
        [weightcache.cli_path(), "launch", "--model", str(model), "--tier", "host", "--tp", "2",
         "--pp", "2", "--runtime-dir", runtime_dir, "--device-inventory", str(inventory),
         "--ready-timeout", "60", "--stop-grace", "3", "--json"],
        capture_output=True, text=True, timeout=120,
        env={k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"})
    assert out.returncode == 0, out.stdout + out.stderr
    summary = json.loads(out.stdout)
    yield model, inventory, summary
    for d in summary["daemons"]:
        try:
            os.kill(d["pid"], signal.SIGTERM)
        except ProcessLookupError:
            pass


def held_bytes(model, r: ref.Ranks) -> int:
    return sum(ref.slice_nbytes(t, s) for t, s in ref.plan_rank(model, r))


def test_each_rank_finds_its_daemon_by_device_and_gets_its_slices(job, runtime_dir):
    model, inventory, summary = job
    ckpt = ref.read_checkpoint(model)
    daemons = summary["daemons"]
    assert len(daemons) == 4
    per_rank = {}
    for i, d in enumerate(daemons):
        r = ref.Ranks(tp_size=2, tp_rank=i % 2, pp_size=2, pp_rank=i // 2)
        assert (d["tp_rank"], d["pp_rank"]) == (r.tp_rank, r.pp_rank)
        assert d["device_uuid"] == gpu_uuid(i)
        assert d["state"] == "ready"
        # Each daemon holds only its rank's bytes.
        assert d["bytes_total"] == held_bytes(model, r), (r, d)

        att = weightcache.attach(
            str(model), tier="host", device=i, device_inventory=str(inventory),
            runtime_dir=runtime_dir, on_missing="error", tp_size=2, tp_rank=r.tp_rank,
            pp_size=2, pp_rank=r.pp_rank)
        assert att.source == "daemon"
        assert att.daemon_pid == d["pid"]
        expected = ref.expected_rank_tensors(model, r)
        got = {}
        for t in att.tensors():
            raw = np.asarray(t.raw())
            array = raw.view(ckpt._array(t.name).dtype).reshape(t.shape)
            s = None if t.slice is None else ref.Slice(t.slice[0], t.slice[1], t.slice[2])
            got[t.name] = (s, array)
        assert sorted(got) == sorted(expected), r
        planned = dict((t.name, s) for t, s in ref.plan_rank(model, r))
        for name, array in expected.items():
            assert got[name][0] == planned[name], (r, name)
            assert got[name][1].tobytes() == array.tobytes(), (r, name)
        per_rank[r] = got
        del att
    ref.assert_rebuilds(ckpt, per_rank)
    # A quarter of the weights each (plus the replicated norms), not four whole copies: every
    # daemon under a third of the checkpoint, all four together within 5% of one copy.
    for d in daemons:
        assert d["bytes_total"] < ckpt.full_bytes / 3, d
    total = sum(d["bytes_total"] for d in daemons)
    assert ckpt.full_bytes <= total < 1.05 * ckpt.full_bytes

def test_a_rank_on_another_ranks_device_is_told_the_rank_differs(job, runtime_dir):
    model, inventory, summary = job
    # Rank (tp 0, pp 0) runs on GPU 1, whose daemon serves rank (tp 1, pp 0).
    with pytest.raises(weightcache.MismatchError) as info:
        weightcache.attach(str(model), tier="host", device=1, device_inventory=str(inventory),
                           runtime_dir=runtime_dir, on_missing="error", tp_size=2, tp_rank=0,
                           pp_size=2, pp_rank=0)
    assert "tp_rank" in info.value.field_names
    assert info.value.daemon_pid == summary["daemons"][1]["pid"]
