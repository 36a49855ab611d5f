"""The committed typed stubs (python/weightcache/_weightcache.pyi) are what nanobind's stubgen
generates from the installed extension: a change to the bindings must update the reference
(python -m nanobind.stubgen -m weightcache._weightcache -o python/weightcache/_weightcache.pyi)."""

from __future__ import annotations

import difflib
import subprocess
import sys
from pathlib import Path

import pytest

import weightcache

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "python" / "weightcache" / "_weightcache.pyi"
# stubgen's output format changes between nanobind releases; the reference was generated with
# this one (scripts/setup-deps.sh pins it for CI).
REFERENCE_NANOBIND = "3.1"


def test_stubs_match_committed_reference(tmp_path):
    nanobind = pytest.importorskip("nanobind")
    if not nanobind.__version__.startswith(REFERENCE_NANOBIND + "."):
        pytest.skip(f"reference stubs are from nanobind {REFERENCE_NANOBIND}.x, "
                    f"this is {nanobind.__version__}")
    out = tmp_path / "_weightcache.pyi"
    subprocess.run([sys.executable, "-m", "nanobind.stubgen", "-q", "-m",
                    "weightcache._weightcache", "-o", str(out)], check=True)
    fresh, committed = out.read_text(), REFERENCE.read_text()
    diff = "".join(difflib.unified_diff(committed.splitlines(True), fresh.splitlines(True),
                                        "committed", "generated"))
    assert fresh == committed, "stubs differ from the committed reference:\n" + diff


def test_installed_package_ships_the_stubs():
    installed = Path(weightcache.__file__).parent
    assert (installed / "_weightcache.pyi").read_text() == REFERENCE.read_text()
    assert (installed / "py.typed").exists()
