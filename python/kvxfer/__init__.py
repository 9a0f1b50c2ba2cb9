"""kvxfer: move LLM KV-cache blocks between GPU memory, host memory and disk.

A binding over kvxfer's C ABI (the bundled `libkvxfer.so`, or `KVX_LIBRARY`)::

    import kvxfer, numpy as np
    cfg = kvxfer.LayoutConfig(num_blocks=64, num_layers=4, outer_dim=2, page_size=16,
                              inner_dim=1024, dtype_bytes=2)
    with kvxfer.Engine(device="auto") as e:
        host = e.host_layout(cfg)
        disk = e.disk_layout(cfg, "/tmp/kv.bin")
        e.submit(host, [0, 1], disk, [5, 6]).wait()
        with kvxfer.Store(e, "/tmp/kv-store", cfg, capacity_blocks=1024, namespace=b"model tp0") as s:
            s.put(host, [0, 1], [b"hash-a", b"hash-b"]).wait()
"""

from . import _native
from .engine import Engine, EngineConfig, Layout, LayoutConfig, Request, Stats
from .errors import (
    Busy,
    Cancelled,
    CudaError,
    Error,
    Incompatible,
    IntegrityError,
    InternalError,
    InvalidArgument,
    IOError,
    NoDevice,
    NoMemory,
    NotFound,
    OutOfRange,
    RemoteError,
    Shutdown,
    Timeout,
    Unsupported,
    VersionError,
)
from .slots import Reservation, SlotHandle
from .store import SharedTier, Store, StoreRequest, StoreStats

# The crate's version, as the loaded library reports it ("kvxfer 1.4.0 abi 1.4 ...").
__version__ = _native.lib.kvx_version_string().decode().split()[1]
library_path: str = _native.library_path


def version() -> str:
    """The library's version string (kvxfer, ABI and CUDA driver seen)."""
    return _native.lib.kvx_version_string().decode()


__all__ = [
    "Engine", "EngineConfig", "Layout", "LayoutConfig", "Request", "Stats", "version", "library_path",
    "Error", "InvalidArgument", "OutOfRange", "Incompatible", "Unsupported", "NoDevice", "CudaError", "IOError",
    "NoMemory", "Timeout", "Cancelled", "Shutdown", "Busy", "IntegrityError", "VersionError", "InternalError",
    "RemoteError", "NotFound", "Store", "StoreRequest", "StoreStats", "SlotHandle", "Reservation", "SharedTier",
]
