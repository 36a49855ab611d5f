"""Starting a daemon from Python: ``weightcache serve ... --detach`` (docs/daemon.md,
"Detached"), the one way a process starts a daemon it does not supervise.

    info = weightcache.spawn.serve_detached(source="published:engine-v1", tier="host",
                                            model_id="llama-fused")
    # {"socket": ..., "pid": ..., "log": ..., "state": "ready"}, or None: already served

``publish(..., spawn=True)`` calls it before publishing. The CLI does the spawning and the
readiness polling (the launcher's); this module only writes its command line and maps its
exit to the exceptions of weightcache.errors. ``serve --detach`` has exited (and is reaped)
when this returns; the daemon is not our child, and holds none of our fds or pipes.
"""

from __future__ import annotations

import json
import os
import subprocess
from typing import Any, Dict, Mapping, Optional, Sequence

from . import errors


def _flag(key: str) -> str:
    # The identity keywords are IdentityOptions' fields; their CLI flags are the same names in
    # kebab case (tools/identity_flags.cc: model_id → --model-id, runtime_dir → --runtime-dir).
    return "--" + key.replace("_", "-")


def serve_args(*, source: str, tier: str, device: Any = None,
               identity: Mapping[str, Any]) -> list:
    """The identity flags of `weightcache serve` for these keywords (publish()'s)."""
    args = ["--source", source, "--tier", tier]
    if device is not None:
        args += ["--device", str(device)]
    for key, value in identity.items():
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (str, int, os.PathLike)):
            raise TypeError(f"identity keyword {key}={value!r}: a str, int or path is expected")
        args += [_flag(key), os.fspath(value) if isinstance(value, os.PathLike) else str(value)]
    return args


def serve_detached(*, source: str, tier: str = "gpu", device: Any = None,
                   identity: Optional[Mapping[str, Any]] = None,
                   extra_args: Sequence[str] = (), ready_timeout: float = 600.0,
                   cli: Optional[str] = None) -> Optional[Dict[str, Any]]:
    """Run ``weightcache serve <identity flags> <extra_args> --detach --json``.

    Returns the daemon's {"socket", "pid", "log", "state"} once it serves (``awaiting`` its
    publisher, for a published source), or None when a daemon already serves this identity
    (exit 7: it is the one to use). Raises the weightcache.errors exception of any other
    failure (its ``exit_code`` the CLI's), its message the CLI's error line.
    """
    if cli is None:
        from . import cli_path

        cli = cli_path()
    argv = [cli, "serve", *serve_args(source=source, tier=tier, device=device,
                                      identity=dict(identity or {})),
            *extra_args, "--ready-timeout", repr(float(ready_timeout)), "--detach", "--json"]
    done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          check=False)
    try:
        summary = json.loads(done.stdout) if done.stdout.strip() else {}
    except json.JSONDecodeError:
        summary = {}
    if done.returncode == 0 and summary.get("daemons"):
        d = summary["daemons"][0]
        return {"socket": d["socket"], "pid": d["pid"], "log": d["log"], "state": d["state"]}
    if done.returncode == errors.AlreadyServedError.exit_code:
        return None
    lines = [ln for ln in done.stderr.splitlines() if ln.startswith("weightcache serve: ")]
    message = lines[-1] if lines else (done.stderr.strip() or f"exit code {done.returncode}")
    status = summary.get("status")
    if status is None:  # a usage error (CLI11's) prints no summary
        status = "invalid argument" if done.returncode == 2 else "internal error"
    error = errors.from_status(status, f"{' '.join(argv[:2])} --detach: {message}")
    error.exit_code = done.returncode
    raise error
