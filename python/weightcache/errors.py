"""The exceptions of weightcache: the C++ client's Status codes (SPEC §4, §5) at the Python edge.

Every exception derives from WeightcacheError and carries what the operator needs to act on
it without parsing text:

* ``code`` — the status code in snake case ("mismatch", "no_daemon", "timeout", ...);
* ``socket_path`` — the socket discovery looked at (None if the identity did not resolve);
* ``device_uuid`` — the GPU UUID the identity resolved to, or "host";
* ``MismatchError.fields`` — each differing CacheConfig field as (field, daemon, client);
  ``daemon_socket`` and ``daemon_pid`` — the daemon that holds the other config.

Everything is handed over by the client as data (weightcache::AttachDiagnostics); nothing
here reads it back out of the message.

The exit codes of the CLI (SPEC §5) are on ``exit_code``.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

__all__ = [
    "WeightcacheError",
    "MismatchError",
    "NoDaemonError",
    "DaemonTimeoutError",
    "InvalidCheckpointError",
    "InvalidArgumentError",
    "PermissionDeniedError",
    "ProtocolError",
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
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
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

    exit_code = 4

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

    exit_code = 3


class DaemonTimeoutError(WeightcacheError, TimeoutError):
    """The daemon was still loading when the wait timeout passed (on_missing="error")."""

    exit_code = 6


class InvalidCheckpointError(WeightcacheError, ValueError):
    """The model dir is not a valid safetensors checkpoint (the message names file and rule)."""

    exit_code = 5


class InvalidArgumentError(WeightcacheError, ValueError):
    """A bad option: rank out of range, unknown device, a path over the sun_path limit, ..."""


class PermissionDeniedError(WeightcacheError, PermissionError):
    """A socket or runtime dir owned by another user, or a peer of another uid."""


class ProtocolError(WeightcacheError):
    """The socket answered with something that is not the weightcache protocol."""


# StatusCodeName (src/common/status.cc) → (code, class).
_BY_STATUS = {
    "invalid argument": ("invalid_argument", InvalidArgumentError),
    "not found": ("not_found", WeightcacheError),
    "permission denied": ("permission_denied", PermissionDeniedError),
    "invalid checkpoint": ("invalid_checkpoint", InvalidCheckpointError),
    "no daemon": ("no_daemon", NoDaemonError),
    "config mismatch": ("mismatch", MismatchError),
    "timeout": ("timeout", DaemonTimeoutError),
    "already served": ("already_served", WeightcacheError),
    "protocol error": ("protocol", ProtocolError),
    "i/o error": ("io", WeightcacheError),
    "cuda error": ("cuda", WeightcacheError),
    "unavailable": ("unavailable", WeightcacheError),
    "out of memory": ("out_of_memory", WeightcacheError),
    "internal error": ("internal", WeightcacheError),
}


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
    code, cls = _BY_STATUS.get(status_name, (status_name.replace(" ", "_"), WeightcacheError))
    kw = dict(code=code, socket_path=socket_path, device_uuid=device_uuid, errno=errno)
    if cls is MismatchError:
        return MismatchError(message, fields=fields or [], daemon_socket=daemon_socket,
                             daemon_pid=daemon_pid, **kw)
    return cls(message, **kw)
