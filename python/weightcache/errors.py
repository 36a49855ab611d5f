"""The exceptions of weightcache: the C++ client's Status codes at the Python edge.

The contract: docs/design.md "Failure semantics", "Exit codes".

Every exception derives from WeightcacheError and carries what the operator needs to act on
it without parsing text:

* ``code`` — the status code in snake case ("mismatch", "no_daemon", "timeout", ...);
* ``socket_path`` — the socket discovery looked at (None if the identity did not resolve);
* ``device_uuid`` — the GPU UUID the identity resolved to, or "host";
* ``MismatchError.fields`` — each differing CacheConfig field as (field, daemon, client);
  ``daemon_socket`` and ``daemon_pid`` — the daemon that holds the other config.

Everything is handed over by the client as data (weightcache::AttachDiagnostics); nothing
here reads it back out of the message.

``exit_code`` is the CLI's exit code for the same failure (docs/design.md "Exit codes"), for
every code.

Which class, ``code`` and ``exit_code`` a status code gets is decided by one table in the C++
library (``weightcache::kStatusCodeTable``, weightcache/status.h), which the extension hands
over (``_weightcache.status_codes()``); this module only defines the classes it names.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple, Type

from . import _weightcache

__all__ = [
    "WeightcacheError",
    "MismatchError",
    "NoDaemonError",
    "DaemonTimeoutError",
    "InvalidCheckpointError",
    "InvalidArgumentError",
    "PermissionDeniedError",
    "ProtocolError",
    "AlreadyServedError",
    "UnavailableError",
    "OutOfMemoryError",
    "from_status",
]


class WeightcacheError(Exception):
    """Base class. ``str(e)`` is the client's message, with its context (path, pid, tensor)."""

    exit_code = 1

    def __init__(
        self,
        message: str,
        *,
        code: str = "internal",
        socket_path: Optional[str] = None,
        device_uuid: Optional[str] = None,
        errno: int = 0,
        exit_code: Optional[int] = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        if exit_code is not None:
            self.exit_code = exit_code
        self.socket_path = socket_path
        self.device_uuid = device_uuid
        self.errno = errno

    def __str__(self) -> str:
        return self.message


class MismatchError(WeightcacheError):
    """A daemon on this device holds a different config of this model (on_mismatch="error").

    ``fields``: one (field, daemon_value, client_value) per differing CacheConfig field, in the
    canonical field order; string values are decoded (no JSON quotes), numbers in decimal.
    ``daemon_socket``: the socket of the daemon that holds the other config — ``socket_path``
    itself, or another cache of this model found when ``socket_path`` is absent;
    ``daemon_pid``: its pid (None when unknown).
    """

    def __init__(
        self,
        message: str,
        *,
        fields: Sequence[Tuple[str, str, str]],
        daemon_socket: Optional[str] = None,
        daemon_pid: Optional[int] = None,
        **kw,
    ) -> None:
        super().__init__(message, **kw)
        self.fields: List[Tuple[str, str, str]] = [(f, d, c) for f, d, c in fields]
        self.daemon_socket = daemon_socket
        self.daemon_pid = daemon_pid

    @property
    def field_names(self) -> List[str]:
        return [f for f, _, _ in self.fields]


class NoDaemonError(WeightcacheError):
    """No live daemon serves this identity (on_missing="error")."""


class DaemonTimeoutError(WeightcacheError, TimeoutError):
    """The daemon was still loading, or did not answer at all (hung), when the attach's deadline
    (``wait_timeout``) passed (on_missing="error")."""


class InvalidCheckpointError(WeightcacheError, ValueError):
    """The model dir is not a valid safetensors checkpoint (the message names file and rule), or
    the daemon's load failed on one (on_missing="error")."""


class InvalidArgumentError(WeightcacheError, ValueError):
    """A bad option: rank out of range, unknown device, a path over the sun_path limit, ..."""


class PermissionDeniedError(WeightcacheError, PermissionError):
    """A socket or runtime dir owned by another user, or a peer of another uid."""


class ProtocolError(WeightcacheError):
    """The socket answered with something that is not the weightcache protocol."""


class AlreadyServedError(WeightcacheError):
    """Another daemon holds this identity's lock (the message names its pid)."""


class UnavailableError(WeightcacheError):
    """A facility this host lacks: the NVIDIA driver for the gpu tier, a GPU."""


class OutOfMemoryError(WeightcacheError):
    """No room under the device's memory budget (e.g. the daemon's load failed on it)."""


# The C++ table, one row per status code: (value, name, code, exit_code, class name). ``name``
# is what the extension passes to from_status (StatusCodeName, Status::ToString's prefix).
_TABLE: List[Tuple[int, str, str, int, str]] = [tuple(row) for row in _weightcache.status_codes()]
_BY_STATUS: Dict[str, Tuple[str, int, Type[WeightcacheError]]] = {
    name: (code, exit_code, globals()[cls]) for _, name, code, exit_code, cls in _TABLE if cls
}
# A class that stands for exactly one code carries that code's exit code as its default too.
for _code, _exit_code, _cls in _BY_STATUS.values():
    if _cls is not WeightcacheError:
        _cls.exit_code = _exit_code
del _code, _exit_code, _cls


def from_status(
    status_name: str,
    message: str,
    socket_path: Optional[str] = None,
    device_uuid: Optional[str] = None,
    errno: int = 0,
    *,
    fields: Optional[Sequence[Tuple[str, str, str]]] = None,
    daemon_socket: Optional[str] = None,
    daemon_pid: Optional[int] = None,
) -> WeightcacheError:
    """The exception for a failed C++ Status (called by the extension with the client's
    AttachDiagnostics: ``fields``, ``daemon_socket`` and ``daemon_pid`` for a mismatch)."""
    code, exit_code, cls = _BY_STATUS.get(
        status_name, (status_name.replace(" ", "_"), WeightcacheError.exit_code, WeightcacheError))
    kw = dict(code=code, socket_path=socket_path, device_uuid=device_uuid, errno=errno,
              exit_code=exit_code)
    if cls is MismatchError:
        return MismatchError(message, fields=fields or [], daemon_socket=daemon_socket,
                             daemon_pid=daemon_pid, **kw)
    return cls(message, **kw)
