"""examples/engine_restart.py runs as documented: start 1 falls back to disk, start 2 attaches."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "engine_restart.py"


def test_engine_restart_example():
    out = subprocess.run([sys.executable, str(EXAMPLE), "--demo-mb", "8"], check=True,
                         stdout=subprocess.PIPE, text=True, timeout=300).stdout
    assert re.search(r"^start 1 \(no daemon\): fallback +[0-9.]+ ms", out, re.M), out
    assert re.search(r"^start 2 \(daemon\) +: daemon +[0-9.]+ ms .*attached to daemon at ", out,
                     re.M), out
    assert re.search(r"^restart: [0-9.]+ ms from disk -> [0-9.]+ ms attached", out, re.M), out
