"""The C ABI (include/kvxfer.h) as ctypes: the library, its structs and prototypes.

Nothing here is public; kvxfer's classes wrap it. The struct layouts are checked against
the library's by the package's tests (python/tests/test_kvxfer.py,
test_struct_layouts_match_the_library), so a header change that this file misses fails
there instead of corrupting memory.
"""

from __future__ import annotations

import ctypes
import glob
import os
from ctypes import POINTER, c_char_p, c_int32, c_size_t, c_uint32, c_uint64, c_void_p

ABI_MAJOR = 1
# The oldest minor this package needs (KVX_DISK_MAPPED, kvx_engine_config_get).
ABI_MINOR_NEEDED = 2

OK, PENDING = 0, 1
DEVICE_AUTO, DEVICE_EMULATED = -2, -1
IO_BACKENDS = {"auto": 0, "posix": 1, "uring": 2, "nixl": 3, "gds": 4}
LAYOUT_KINDS = {"contiguous": 0, "layer_block_first": 1, "layer_outer_first": 2}
HOST_PINNED = 1
DISK_CREATE, DISK_KEEP, DISK_BUFFERED, DISK_SYNC, DISK_CHECKSUM, DISK_MAPPED = 1, 2, 4, 8, 16, 32
# The store (ABI 1.4).
STORE_CREATE, STORE_DURABLE, STORE_BUFFERED, STORE_VERIFY_ON_OPEN = 1, 2, 4, 8
LOOKUP_LEASE = 1
# kvx_transfer_options.flags (ABI 1.5).
XFER_CRITICAL = 1
# Slot handles (ABI 1.5).
STORE_DATA_ONLY = 16
RESERVED_WRITE, RESERVED_HELD, RESERVED_IN_FLIGHT, RESERVED_NO_ROOM = 1, 2, 3, 4
# The shared tier (ABI 1.7).
SHARED_DIR, SHARED_S3 = 1, 2
SHARED_WRITE_THROUGH, SHARED_NO_ADMIT = 1, 2


class EngineConfigC(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_uint32),
        ("device", c_int32),
        ("io_threads", c_uint32),
        ("io_backend", c_uint32),
        ("bounce_bytes", c_uint64),
        ("slot_bytes", c_uint64),
        ("max_inflight", c_uint32),
        ("flags", c_uint32),
    ]


class LayoutConfigC(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_uint32),
        ("kind", c_uint32),
        ("num_blocks", c_uint64),
        ("num_layers", c_uint64),
        ("outer_dim", c_uint64),
        ("page_size", c_uint64),
        ("inner_dim", c_uint64),
        ("dtype_bytes", c_uint64),
    ]


COMPLETION_FN = ctypes.CFUNCTYPE(None, c_void_p, c_void_p, c_uint32)


class TransferOptionsC(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_uint32),
        ("layer_begin", c_uint32),
        ("layer_end", c_uint32),
        ("flags", c_uint32),
        ("on_complete", COMPLETION_FN),
        ("user_data", c_void_p),
        ("wait_event", c_void_p),
    ]


class StatsC(ctypes.Structure):
    _fields_ = [("struct_size", c_uint32)] + [
        (name, c_uint64)
        for name in (
            "requests_completed",
            "requests_failed",
            "requests_cancelled",
            "bytes_disk_read",
            "bytes_disk_written",
            "bytes_host_to_device",
            "bytes_device_to_host",
            "disk_read_ns",
            "disk_write_ns",
            "host_copy_ns",
            "device_copy_ns",
            "slot_wait_ns",
            "slots_quarantined",
        )
    ]


class KeyC(ctypes.Structure):
    _fields_ = [("bytes", c_void_p), ("len", c_uint32)]


class SharedConfigC(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_uint32),
        ("kind", c_uint32),
        ("path", c_char_p),
        ("capacity_bytes", c_uint64),
        ("endpoint", c_char_p),
        ("region", c_char_p),
        ("bucket", c_char_p),
        ("prefix", c_char_p),
        ("threads", c_uint32),
        ("timeout_ms", c_uint32),
        ("flags", c_uint32),
        ("pending_puts", c_uint32),
    ]


class StoreConfigC(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_uint32),
        ("flags", c_uint32),
        ("block", POINTER(LayoutConfigC)),
        ("capacity_blocks", c_uint64),
        ("namespace_bytes", c_void_p),
        ("namespace_len", c_uint32),
        ("shards", c_uint32),
        # ABI 1.7.
        ("shared", POINTER(SharedConfigC)),
    ]


class StoreCountersC(ctypes.Structure):
    _fields_ = [("struct_size", c_uint32)] + [
        (name, c_uint64)
        for name in (
            "entries", "capacity", "hits", "misses", "evictions", "integrity_failures", "puts", "dedups", "removes", "bytes",
            # ABI 1.7: the shared tier's (a library before it leaves them 0).
            "shared_hits", "shared_misses", "shared_integrity_failures", "shared_timeouts", "shared_errors", "shared_puts",
            "shared_puts_dropped", "shared_requests",
        )
    ]


class SlotHandleC(ctypes.Structure):
    _fields_ = [
        ("key_digest", ctypes.c_uint8 * 16),
        ("generation", c_uint64),
        ("seal", c_uint64),
        ("epoch", c_uint64),
        ("slot", c_uint32),
        ("key_len", c_uint32),
    ]


def _find_library() -> str:
    """KVX_LIBRARY if set, else the copy installed in this package."""
    # KVXFER_LIBRARY is the older name of KVX_LIBRARY, still read when KVX_LIBRARY is unset.
    name = "KVX_LIBRARY" if os.environ.get("KVX_LIBRARY") else "KVXFER_LIBRARY"
    env = os.environ.get(name)
    if env:
        if not os.path.isfile(env):
            raise ImportError(f"{name}={env} does not exist; point it at a libkvxfer.so or unset it")
        return env
    here = os.path.dirname(os.path.abspath(__file__))
    found = sorted(glob.glob(os.path.join(here, "libkvxfer*.so*")))
    if not found:
        raise ImportError(
            f"no libkvxfer.so in {here}: install the package with `pip install ./python` (which builds it), "
            "or set KVX_LIBRARY to a built libkvxfer.so"
        )
    return found[0]


def _load() -> ctypes.CDLL:
    path = _find_library()
    lib = ctypes.CDLL(path)
    lib.kvx_abi_version.restype = c_uint32
    version = lib.kvx_abi_version()
    major, minor = version >> 16, version & 0xFFFF
    if major != ABI_MAJOR or minor < ABI_MINOR_NEEDED:
        raise ImportError(
            f"{path} has ABI {major}.{minor}; this package needs {ABI_MAJOR}.{ABI_MINOR_NEEDED} or a later {ABI_MAJOR}.x"
        )
    engine_p, layout_p, request_p = c_void_p, c_void_p, c_void_p
    protos = {
        "kvx_version_string": (c_char_p, []),
        "kvx_status_str": (c_char_p, [c_uint32]),
        "kvx_last_error": (c_char_p, []),
        "kvx_engine_config_init": (None, [POINTER(EngineConfigC)]),
        "kvx_engine_create": (c_uint32, [POINTER(EngineConfigC), POINTER(engine_p)]),
        "kvx_engine_destroy": (None, [engine_p]),
        "kvx_engine_device": (c_uint32, [engine_p, POINTER(c_int32)]),
        "kvx_engine_config_get": (c_uint32, [engine_p, POINTER(EngineConfigC)]),
        "kvx_engine_stats": (c_uint32, [engine_p, POINTER(StatsC)]),
        "kvx_layout_config_init": (None, [POINTER(LayoutConfigC)]),
        "kvx_layout_create_device": (c_uint32, [engine_p, POINTER(LayoutConfigC), POINTER(layout_p)]),
        "kvx_layout_create_host": (c_uint32, [engine_p, POINTER(LayoutConfigC), c_uint32, POINTER(layout_p)]),
        "kvx_layout_create_disk": (c_uint32, [engine_p, POINTER(LayoutConfigC), c_char_p, c_uint32, POINTER(layout_p)]),
        "kvx_layout_register_device": (
            c_uint32,
            [engine_p, POINTER(LayoutConfigC), POINTER(c_uint64), c_size_t, POINTER(layout_p)],
        ),
        "kvx_layout_register_host": (
            c_uint32,
            [engine_p, POINTER(LayoutConfigC), POINTER(c_void_p), c_size_t, c_uint32, POINTER(layout_p)],
        ),
        "kvx_layout_block_bytes": (c_uint32, [layout_p, POINTER(c_uint64)]),
        "kvx_layout_base": (c_uint32, [layout_p, c_uint64, POINTER(c_uint64)]),
        "kvx_layout_destroy": (None, [layout_p]),
        "kvx_transfer_options_init": (None, [POINTER(TransferOptionsC)]),
        "kvx_transfer_submit": (
            c_uint32,
            [engine_p, layout_p, c_void_p, layout_p, c_void_p, c_size_t, POINTER(TransferOptionsC), POINTER(request_p)],
        ),
        "kvx_request_wait": (c_uint32, [request_p, c_uint64]),
        "kvx_request_poll": (c_uint32, [request_p]),
        "kvx_request_cancel": (c_uint32, [request_p]),
        "kvx_request_error": (c_char_p, [request_p]),
        "kvx_request_release": (None, [request_p]),
    }
    store_p, store_request_p = c_void_p, c_void_p
    # ABI 1.4: `Store` says so where the library is older.
    store_protos = {
        "kvx_store_config_init": (None, [POINTER(StoreConfigC)]),
        "kvx_store_open": (c_uint32, [engine_p, c_char_p, POINTER(StoreConfigC), POINTER(store_p)]),
        "kvx_store_close": (None, [store_p]),
        "kvx_store_lookup": (c_uint32, [store_p, POINTER(KeyC), c_size_t, c_uint32, c_void_p, POINTER(c_size_t)]),
        "kvx_store_release_leases": (c_uint32, [store_p, POINTER(KeyC), c_size_t]),
        "kvx_store_put": (
            c_uint32,
            [store_p, layout_p, c_void_p, POINTER(KeyC), c_size_t, POINTER(TransferOptionsC), POINTER(store_request_p)],
        ),
        "kvx_store_get": (
            c_uint32,
            [store_p, POINTER(KeyC), c_size_t, layout_p, c_void_p, POINTER(TransferOptionsC), POINTER(store_request_p)],
        ),
        "kvx_store_remove": (c_uint32, [store_p, POINTER(KeyC), c_size_t, POINTER(c_uint32)]),
        "kvx_store_stats": (c_uint32, [store_p, POINTER(StoreCountersC)]),
        "kvx_store_request_wait": (c_uint32, [store_request_p, c_uint64]),
        "kvx_store_request_poll": (c_uint32, [store_request_p]),
        "kvx_store_request_key_status": (c_uint32, [store_request_p, c_size_t, POINTER(c_uint32)]),
        "kvx_store_request_key_error": (c_char_p, [store_request_p, c_size_t]),
        "kvx_store_request_error": (c_char_p, [store_request_p]),
        "kvx_store_request_release": (None, [store_request_p]),
    }
    if minor >= 4:
        protos.update(store_protos)
    handle_p, opts_p = POINTER(SlotHandleC), POINTER(TransferOptionsC)
    # ABI 1.5: the slot calls say so where the library is older.
    slot_protos = {
        "kvx_store_lease_slots": (c_uint32, [store_p, POINTER(KeyC), c_size_t, handle_p, c_void_p]),
        "kvx_store_lease": (c_uint32, [store_p, POINTER(KeyC), c_size_t, c_void_p, POINTER(c_size_t)]),
        "kvx_store_release": (c_uint32, [store_p, c_void_p, c_size_t]),
        "kvx_store_reserve_slots": (c_uint32, [store_p, POINTER(KeyC), c_size_t, handle_p, POINTER(c_uint32)]),
        "kvx_store_commit_slots": (c_uint32, [store_p, handle_p, c_size_t, POINTER(c_uint32)]),
        "kvx_store_abort_slots": (c_uint32, [store_p, handle_p, c_size_t]),
        "kvx_store_read_slots": (c_uint32, [store_p, handle_p, c_size_t, layout_p, c_void_p, opts_p, POINTER(store_request_p)]),
        "kvx_store_write_slots": (c_uint32, [store_p, layout_p, c_void_p, handle_p, c_size_t, opts_p, POINTER(store_request_p)]),
    }
    if minor >= 5:
        protos["kvx_engine_completion_fd"] = (c_uint32, [engine_p, POINTER(c_int32)])
        protos.update(slot_protos)
    # ABI 1.7: `Store(shared=...)` says so where the library is older.
    if minor >= 7:
        protos["kvx_shared_config_init"] = (None, [POINTER(SharedConfigC)])
    for name, (res, args) in protos.items():
        f = getattr(lib, name)
        f.restype, f.argtypes = res, args
    return lib


lib = _load()
library_path = lib._name


def last_error() -> str:
    msg = lib.kvx_last_error()
    return msg.decode("utf-8", "replace") if msg else ""


def need_minor(minor: int, what: str) -> None:
    """Refuses, with `Unsupported`, where the loaded library's ABI predates 1.`minor`,
    the minor that brought `what`."""
    if lib.kvx_abi_version() & 0xFFFF < minor:
        from .errors import Unsupported

        raise Unsupported(f"{library_path} predates {what} (ABI 1.{minor}); use the library this package ships", 5)
