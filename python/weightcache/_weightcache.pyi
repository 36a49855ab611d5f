"""
The C++ weightcache client, bound with nanobind (use the weightcache package).
"""

from collections.abc import Callable


class AttachOptions:
    """
    Every field of weightcache::AttachOptions (include/weightcache/client.h); weightcache.attach() fills it from keyword arguments.
    """

    def __init__(self) -> None: ...

    @property
    def model_dir(self) -> str: ...

    @model_dir.setter
    def model_dir(self, arg: str, /) -> None: ...

    @property
    def model_id(self) -> str: ...

    @model_id.setter
    def model_id(self, arg: str, /) -> None: ...

    @property
    def revision(self) -> str: ...

    @revision.setter
    def revision(self, arg: str, /) -> None: ...

    @property
    def dtype(self) -> str: ...

    @dtype.setter
    def dtype(self, arg: str, /) -> None: ...

    @property
    def quantization(self) -> str: ...

    @quantization.setter
    def quantization(self, arg: str, /) -> None: ...

    @property
    def quantization_config(self) -> str: ...

    @quantization_config.setter
    def quantization_config(self, arg: str, /) -> None: ...

    @property
    def tp_size(self) -> int: ...

    @tp_size.setter
    def tp_size(self, arg: int, /) -> None: ...

    @property
    def tp_rank(self) -> int: ...

    @tp_rank.setter
    def tp_rank(self, arg: int, /) -> None: ...

    @property
    def pp_size(self) -> int: ...

    @pp_size.setter
    def pp_size(self, arg: int, /) -> None: ...

    @property
    def pp_rank(self) -> int: ...

    @pp_rank.setter
    def pp_rank(self, arg: int, /) -> None: ...

    @property
    def ep_size(self) -> int: ...

    @ep_size.setter
    def ep_size(self, arg: int, /) -> None: ...

    @property
    def ep_rank(self) -> int: ...

    @ep_rank.setter
    def ep_rank(self, arg: int, /) -> None: ...

    @property
    def dp_size(self) -> int: ...

    @dp_size.setter
    def dp_size(self, arg: int, /) -> None: ...

    @property
    def shard_rules(self) -> str: ...

    @shard_rules.setter
    def shard_rules(self, arg: str, /) -> None: ...

    @property
    def layout_tag(self) -> str: ...

    @layout_tag.setter
    def layout_tag(self, arg: str, /) -> None: ...

    @property
    def source(self) -> str: ...

    @source.setter
    def source(self, arg: str, /) -> None: ...

    @property
    def checkpoint_fingerprint(self) -> str: ...

    @checkpoint_fingerprint.setter
    def checkpoint_fingerprint(self, arg: str, /) -> None: ...

    @property
    def tier(self) -> str: ...

    @tier.setter
    def tier(self, arg: str, /) -> None: ...

    @property
    def device(self) -> str: ...

    @device.setter
    def device(self, arg: str, /) -> None: ...

    @property
    def namespace(self) -> str: ...

    @namespace.setter
    def namespace(self, arg: str, /) -> None: ...

    @property
    def runtime_dir(self) -> str: ...

    @runtime_dir.setter
    def runtime_dir(self, arg: str, /) -> None: ...

    @property
    def socket(self) -> str: ...

    @socket.setter
    def socket(self, arg: str, /) -> None: ...

    @property
    def device_inventory(self) -> str: ...

    @device_inventory.setter
    def device_inventory(self, arg: str, /) -> None: ...

    @property
    def on_missing(self) -> str: ...

    @on_missing.setter
    def on_missing(self, arg: str, /) -> None: ...

    @property
    def on_mismatch(self) -> str: ...

    @on_mismatch.setter
    def on_mismatch(self, arg: str, /) -> None: ...

    @property
    def wait_timeout(self) -> float:
        """
        The attach's deadline in seconds (default 60): waiting for a daemon that reports `loading`, and every exchange with a daemon; one that does not answer by then is treated as absent.
        """

    @wait_timeout.setter
    def wait_timeout(self, arg: float, /) -> None: ...

    @property
    def wait_for_publisher(self) -> bool:
        """
        A published cache awaiting its publisher with no publication in progress: True (default) waits for one within wait_timeout; False treats it as absent at once, for a caller that publishes after its own load (docs/engines.md).
        """

    @wait_for_publisher.setter
    def wait_for_publisher(self, arg: bool, /) -> None: ...

    @property
    def fallback_threads(self) -> int: ...

    @fallback_threads.setter
    def fallback_threads(self, arg: int, /) -> None: ...

    @property
    def host_mapping(self) -> str:
        """
        The host tier's mapping: "read_only" (a write faults) or "copy_on_write" (a write copies its page into this process only; the cache is never changed).
        """

    @host_mapping.setter
    def host_mapping(self, arg: str, /) -> None: ...

class Tensor:
    """
    One tensor of an Attachment: metadata plus zero-copy DLPack export. Keeps its Attachment alive.
    """

    @property
    def name(self) -> str: ...

    @property
    def dtype(self) -> str:
        """The safetensors spelling: "BF16", "F8_E4M3", ..."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def nbytes(self) -> int: ...

    @property
    def data_ptr(self) -> int:
        """Host address (host tier) or CUdeviceptr (gpu tier)."""

    @property
    def checksum(self) -> int:
        """Content checksum (docs/integrity.md)."""

    @property
    def slice(self) -> tuple[int, int, int, int] | None:
        """
        Which slice of the full checkpoint tensor this is, for a sharded cache: (dim, offset, length, full_length), elements [offset, offset + length) along dim; None for a whole tensor.
        """

    @property
    def device(self) -> tuple[int, int]:
        """
        The DLPack device: (1, 0) for the host tier, (2, cuda ordinal) for the gpu tier.
        """

    @property
    def attachment(self) -> Attachment:
        """The owning Attachment."""

    @property
    def dlpack_native(self) -> bool:
        """False for F4/F6 tensors, which export only their bytes (raw())."""

    @property
    def numpy_native(self) -> bool:
        """True when NumPy has this dtype (numpy() works on the host tier)."""

    def __dlpack__(self, *, stream: object = None, max_version: tuple[int, int] | None = None, dl_device: tuple[int, int] | None = None, copy: bool | None = None) -> object:
        """
        DLPack export (stream, max_version, dl_device, copy as the array API defines them; copy=True is refused: this is a view).
        """

    def __dlpack_device__(self) -> tuple[int, int]: ...

    def raw(self) -> object:
        """
        The tensor's bytes as a uint8[nbytes] array (DLPack and buffer protocol), zero-copy.
        """

    def numpy(self) -> object:
        """
        A NumPy view (host tier, NumPy dtypes only): read-only, or writable where the attach mapped a daemon's cache copy-on-write (host_mapping).
        """

    def __repr__(self) -> str: ...

class Attachment:
    """
    Weights mapped from a daemon, or loaded from disk (fallback). The memory lives as long as this object or any tensor exported from it.
    """

    @property
    def tier(self) -> str: ...

    @property
    def source(self) -> str: ...

    @property
    def source_reason(self) -> str: ...

    @property
    def socket_path(self) -> str: ...

    @property
    def device_uuid(self) -> str:
        """The GPU UUID, or "host"."""

    @property
    def cuda_device(self) -> int:
        """CUDA ordinal of the device (gpu tier), -1 for the host tier."""

    @property
    def config_digest(self) -> str: ...

    @property
    def daemon_pid(self) -> int: ...

    @property
    def metadata(self) -> bytes:
        """
        The metadata blob the publisher of a published cache sent (bytes; b"" otherwise).
        """

    @property
    def attach_ms(self) -> float:
        """
        Wall time of the attach (discovery, handshake, mapping or fallback load).
        """

    @property
    def timings(self) -> dict[str, float]:
        """
        Where attach_ms went (AttachTimings, docs/client.md): resolve_ms (the identity: options, devices, the checkpoint fingerprint), discover_ms, map_ms, table_ms, fallback_ms.
        """

    @property
    def total_bytes(self) -> int: ...

    @property
    def daemon_alive(self) -> bool:
        """
        False for a fallback, and once the daemon's end of the connection closed.
        """

    def on_daemon_gone(self, callback: Callable[[], None]) -> None:
        """
        Run callback() once when the daemon goes away (on the client's watcher thread). Never runs for a fallback attachment.
        """

    def names(self) -> list[str]:
        """Every tensor's name, sorted, built in one pass (no Tensor objects)."""

    def tensors(self) -> list[Tensor]:
        """Every tensor, sorted by name."""

    def __len__(self) -> int: ...

    def __contains__(self, arg: str, /) -> bool: ...

    def __getitem__(self, arg: str, /) -> Tensor: ...

def attach(options: AttachOptions) -> Attachment:
    """
    Attach as AttachOptions say; raises a weightcache.errors exception on failure.
    """

def dtype_names() -> list[str]:
    """Every safetensors dtype this module knows."""

def status_codes() -> list[tuple[int, str, str, int, str]]:
    """
    One row per status code: (value, name, code, exit_code, python_class), from the C++ table that also decides the CLI's exit codes (weightcache.errors reads it).
    """
