"""The verified fingerprint cache (issue 14 part 4) through the real client: an attach that
names only the model dir reuses the fingerprint stored in <runtime dir>/fingerprints while every
file stats the same, and computes it afresh after any change (content rewritten with its mtime
put back, a shard replaced by rename, a file added to the listing). Entries that are corrupt,
group-writable or another user's are ignored; an unusable cache dir only makes it slower.

A poisoned entry (a valid entry whose fingerprint was replaced and re-signed) shows whether an
entry was trusted: a fallback attach loads the checkpoint and refuses a fingerprint that does
not match its headers (InvalidArgumentError naming checkpoint_fingerprint)."""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from pathlib import Path

import pytest

import weightcache

from conftest import make_checkpoint

RACY_WINDOW_S = 1.0  # identity::kRacyWindowNs: younger files are never cached


@pytest.fixture
def model(tmp_path):
    """A fresh two-shard checkpoint, aged past the racy window so that it can be cached."""
    out = tmp_path / "model"
    make_checkpoint(out, tensors=12, dtypes="bf16,f32", shards=2)
    time.sleep(RACY_WINDOW_S + 0.2)  # not an assertion: files younger than this are not cached
    return out


def attach(model_dir, runtime_dir):
    return weightcache.attach(model_dir, tier="host", runtime_dir=runtime_dir)


def cache_dir(runtime_dir) -> Path:
    return Path(runtime_dir) / "fingerprints"


def entry(runtime_dir) -> Path:
    entries = list(cache_dir(runtime_dir).iterdir())
    assert len(entries) == 1, entries
    return entries[0]


def poison(runtime_dir, mode=0o600):
    """Re-signs the entry with another fingerprint (the format: SHA-256 hex line, JSON body)."""
    path = entry(runtime_dir)
    body = path.read_text().split("\n", 1)[1]
    fingerprint = body.split('"fingerprint":"')[1][:64]
    body = body.replace(fingerprint, "a" * 64)
    path.unlink()
    path.write_text(hashlib.sha256(body.encode()).hexdigest() + "\n" + body)
    os.chmod(path, mode)


def assert_poison_trusted(model_dir, runtime_dir):
    with pytest.raises(weightcache.InvalidArgumentError, match="checkpoint_fingerprint a{64}"):
        attach(model_dir, runtime_dir)


def test_a_hit_reuses_the_entry_and_matches_the_computed_identity(model, runtime_dir):
    first = attach(model, runtime_dir)
    path = entry(runtime_dir)
    assert (path.stat().st_mode & 0o777) == 0o600
    assert (cache_dir(runtime_dir).stat().st_mode & 0o777) == 0o700
    inode = path.stat().st_ino
    second = attach(model, runtime_dir)
    assert second.config_digest == first.config_digest
    assert path.stat().st_ino == inode, "a hit must not rewrite the entry"
    fingerprint = path.read_text().split('"fingerprint":"')[1][:64]
    given = weightcache.attach(model, tier="host", runtime_dir=runtime_dir,
                               checkpoint_fingerprint=fingerprint)
    assert given.config_digest == first.config_digest
    poison(runtime_dir)
    assert_poison_trusted(model, runtime_dir)


def test_content_rewritten_with_its_mtime_put_back_is_a_miss(model, runtime_dir):
    before = attach(model, runtime_dir).config_digest
    poison(runtime_dir)
    shard = sorted(model.glob("*.safetensors"))[0]
    st = shard.stat()
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x5A
    shard.write_bytes(bytes(data))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))  # touch -d: ctime still moves
    assert shard.stat().st_mtime_ns == st.st_mtime_ns and shard.stat().st_size == st.st_size
    after = attach(model, runtime_dir)
    assert after.config_digest != before


def test_a_shard_replaced_by_rename_is_a_miss(model, runtime_dir):
    before = attach(model, runtime_dir).config_digest
    poison(runtime_dir)
    shard = sorted(model.glob("*.safetensors"))[1]
    shutil.copyfile(shard, str(shard) + ".new")
    os.rename(str(shard) + ".new", shard)
    assert attach(model, runtime_dir).config_digest != before


def test_a_file_added_to_the_listing_is_a_miss(model, runtime_dir):
    before = attach(model, runtime_dir).config_digest
    poison(runtime_dir)
    (model / "stray.safetensors").write_bytes(b"x")  # beside an index: not part of the model
    assert attach(model, runtime_dir).config_digest == before


def test_corrupt_and_truncated_entries_are_ignored_and_rewritten(model, runtime_dir):
    attach(model, runtime_dir)
    path = entry(runtime_dir)
    good = path.read_bytes()
    for bad in (good[: len(good) // 2], b"garbage", b"", good[:80] + b"#" + good[81:]):
        path.write_bytes(bad)
        attach(model, runtime_dir)
        assert path.read_bytes() == good


def test_a_group_writable_entry_is_ignored(model, runtime_dir):
    attach(model, runtime_dir)
    poison(runtime_dir, mode=0o620)
    assert attach(model, runtime_dir).source == "fallback"
    assert (entry(runtime_dir).stat().st_mode & 0o777) == 0o600, "rewritten"


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_an_entry_owned_by_another_user_is_ignored(model, runtime_dir):
    attach(model, runtime_dir)
    poison(runtime_dir)
    os.chown(entry(runtime_dir), 65534, 65534)
    assert attach(model, runtime_dir).source == "fallback"


def test_an_unusable_cache_dir_still_attaches(model, runtime_dir):
    cache_dir(runtime_dir).write_text("a file where the cache dir would be")
    first = attach(model, runtime_dir)
    second = attach(model, runtime_dir)
    assert first.config_digest == second.config_digest
    assert cache_dir(runtime_dir).read_text() == "a file where the cache dir would be"


def test_nothing_is_written_next_to_the_checkpoint(model, runtime_dir):
    before = sorted(os.listdir(model))
    attach(model, runtime_dir)
    attach(model, runtime_dir)
    assert sorted(os.listdir(model)) == before
