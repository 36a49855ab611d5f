"""Lifetimes: exported arrays keep the attachment (and its mappings) alive; everything stays
valid after the daemon is killed, and the client is told."""

from __future__ import annotations

import gc
import hashlib
import threading
import weakref

import numpy as np

import weightcache


def sha(a) -> str:
    return hashlib.sha256(np.asarray(a).tobytes()).hexdigest()


def test_tensors_stay_valid_after_the_daemon_is_killed(checkpoint, runtime_dir, serve):
    model_dir, manifest = checkpoint
    daemon = serve(model_dir)
    att = weightcache.attach(model_dir, tier="host", runtime_dir=runtime_dir)
    assert att.source == "daemon" and att.daemon_alive
    gone = threading.Event()
    att.on_daemon_gone(gone.set)
    before = {t.name: np.asarray(t.raw()) for t in att.tensors()}

    daemon.kill()  # SIGKILL: no goodbye on the socket, only EOF
    assert gone.wait(10), "on_daemon_gone never ran"
    assert not att.daemon_alive

    for name, raw in before.items():  # arrays exported before the kill
        assert sha(raw) == manifest[name]["sha256"], name
    for t in att.tensors():  # and exported after it
        assert sha(t.raw()) == manifest[t.name]["sha256"], t.name
    f32 = next(t for t in att.tensors() if t.dtype == "F32")
    np.testing.assert_array_equal(f32.numpy(), np.frombuffer(before[f32.name], "<f4").reshape(
        f32.shape))

    # A callback registered once the daemon is known gone runs at once, on this thread.
    late = []
    att.on_daemon_gone(lambda: late.append(threading.current_thread()))
    assert late == [threading.current_thread()]

    # A fresh client now falls back to disk, with the same bytes.
    again = weightcache.attach(model_dir, tier="host", runtime_dir=runtime_dir)
    assert again.source == "fallback"
    assert sha(again[f32.name].raw()) == manifest[f32.name]["sha256"]


def test_exports_keep_the_attachment_alive(checkpoint, runtime_dir, serve):
    model_dir, manifest = checkpoint
    serve(model_dir)
    att = weightcache.attach(model_dir, tier="host", runtime_dir=runtime_dir)
    name = next(t.name for t in att.tensors() if t.dtype == "F64")
    tensor = att[name]
    array = tensor.numpy()
    raw = np.from_dlpack(att[next(iter(manifest))])
    ref = weakref.ref(att)
    del att
    gc.collect()
    assert ref() is not None, "tensors must hold their attachment"
    del tensor
    gc.collect()
    assert ref() is not None, "a NumPy array must hold the attachment"
    assert sha(array) == manifest[name]["sha256"]
    del array, raw
    gc.collect()
    assert ref() is None, "the attachment must go once nothing exported from it is left"


def test_fallback_never_reports_daemon_gone(checkpoint, runtime_dir):
    model_dir, _ = checkpoint
    att = weightcache.attach(model_dir, tier="host", runtime_dir=runtime_dir)
    called = []
    att.on_daemon_gone(lambda: called.append(1))
    assert att.source == "fallback" and not att.daemon_alive and called == []
