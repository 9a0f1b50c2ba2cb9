"""The store: KV blocks on disk or tmpfs under the runtime's keys (`kvx_store_*`, ABI
1.4), as `Store` and the `StoreRequest` its puts and gets return, the slot handles
(ABI 1.5) an owner hands to a data-only process, and the shared tier under a store
(`SharedTier`, ABI 1.7). A get never loads
bytes that were not put under the key asked for: a key loads exactly, or is a miss with
its reason. Handles follow the engine's rules: any thread may use them and any thread may
close them, and a request keeps the layout it moves from or into alive until it ends."""

from __future__ import annotations

import asyncio
import ctypes
import os
import struct
import threading
import time
from dataclasses import dataclass, fields
from itertools import accumulate, islice
from typing import Any, Iterable, List, Optional, Sequence, Tuple, Union

from . import _native as n
from .buffers import block_ids
from .engine import Engine, Layout, LayoutConfig, _check, _layer_range, event_handle
from .errors import Error, InvalidArgument, Shutdown, Timeout, error_for
from .fdwait import await_done
from .handles import Handle, in_callback
from .slots import Reservation, SlotHandle, handle_array, need_slots

Key = Union[bytes, bytearray, memoryview, str]

#: The longest single C wait of `StoreRequest.wait`: how long a release on another
#: thread may wait for it. Completion still ends the wait at once.
_WAIT_STEP = 0.05


@dataclass(frozen=True)
class StoreStats:
    """A store's counters (`kvx_store_counters`): what it holds and has done since it was
    opened."""

    entries: int
    capacity: int
    hits: int
    misses: int
    evictions: int
    integrity_failures: int
    puts: int
    dedups: int
    removes: int
    bytes: int
    #: The shared tier's counters (ABI 1.7; all 0 without one). A key a get loads from
    #: the shared tier counts in `hits` too; one it misses there counts in `misses` once.
    #: Blocks read from the shared tier and checked.
    shared_hits: int = 0
    #: Shared-tier reads that found no object.
    shared_misses: int = 0
    #: Shared-tier objects that failed a check (damaged, cut short, of another namespace
    #: or key): each a miss.
    shared_integrity_failures: int = 0
    #: Shared-tier calls whose caller stopped waiting at the tier's `timeout`.
    shared_timeouts: int = 0
    #: Shared-tier calls that failed (the backend's error).
    shared_errors: int = 0
    #: Objects published to the shared tier.
    shared_puts: int = 0
    #: Objects not written: more were waiting than `pending_puts`, or the write failed.
    shared_puts_dropped: int = 0
    #: Calls made to the shared tier's backend (existence checks, reads, writes).
    shared_requests: int = 0


@dataclass(frozen=True)
class SharedTier:
    """A shared tier under a store (`kvx_shared_config`, ABI 1.7): KV blocks shared by any
    number of processes on any number of hosts, one object per block, verified on every
    read. Make one with `SharedTier.dir` or `SharedTier.s3` and open a store over it,
    `Store(..., shared=tier)`: a get loads what the local store misses from it (a damaged,
    foreign or late object is a miss), and puts publish to it.

    `write="behind"` (the default): a put's keys report once the local store holds them,
    and their objects are written after, dropped (counted) past `pending_puts` waiting;
    `"through"`: once their objects are published too. `timeout` (seconds) bounds how long
    a lookup or get waits for the tier; past it its keys are misses. `admit=True` also puts
    a block a get loads from the tier into the local store. `threads` run the backend's
    calls (1 to 256)."""

    #: "dir" or "s3".
    kind: str
    #: "dir": the shared directory (made where missing; this process must be able to
    #: write in it).
    path: Union[str, bytes, "os.PathLike[str]"] = ""
    #: "dir": past this many bytes of objects, writers evict the least recently used;
    #: 0: unbounded.
    capacity_bytes: int = 0
    #: "s3": the bucket, and a prefix for every object's name.
    bucket: str = ""
    prefix: str = ""
    #: "s3": `http(s)://host:port` and the region; "": AWS_ENDPOINT_URL / AWS_REGION,
    #: AWS_DEFAULT_REGION (else us-east-1). Credentials come from the standard AWS
    #: environment variables and files.
    endpoint: str = ""
    region: str = ""
    write: str = "behind"
    timeout: float = 5.0
    admit: bool = True
    threads: int = 16
    pending_puts: int = 1024

    @classmethod
    def dir(cls, path: Union[str, bytes, "os.PathLike[str]"], capacity_bytes: int = 0, **tuning: Any) -> "SharedTier":
        """A directory many processes (or hosts, over NFS, Lustre, CephFS) open at once."""
        return cls("dir", path=path, capacity_bytes=capacity_bytes, **tuning)

    @classmethod
    def s3(cls, bucket: str, prefix: str = "", endpoint: str = "", region: str = "", **tuning: Any) -> "SharedTier":
        """An S3-compatible bucket, objects under `prefix`."""
        return cls("s3", bucket=bucket, prefix=prefix, endpoint=endpoint, region=region, **tuning)

    def _c(self) -> n.SharedConfigC:
        """The C struct (it keeps the bytes its strings point into alive)."""
        kinds = {"dir": n.SHARED_DIR, "s3": n.SHARED_S3}
        if self.kind not in kinds:
            raise InvalidArgument(f"SharedTier kind={self.kind!r}; make one with SharedTier.dir(path) or SharedTier.s3(bucket)")
        if self.write not in ("behind", "through"):
            raise InvalidArgument(f"SharedTier write={self.write!r}; expected 'behind' or 'through'")
        for name in ("capacity_bytes", "threads", "pending_puts"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0 or v > (0xFFFFFFFF if name != "capacity_bytes" else 2**64 - 1):
                raise InvalidArgument(f"SharedTier {name}={v!r}; expected a non-negative int")
        if self.threads == 0 or self.pending_puts == 0:
            raise InvalidArgument("SharedTier threads and pending_puts are at least 1")
        if not isinstance(self.timeout, (int, float)) or isinstance(self.timeout, bool) or not 0 < self.timeout <= 0xFFFFFFFF / 1000:
            raise InvalidArgument(f"SharedTier timeout={self.timeout!r}; expected seconds, more than 0")
        path = os.fsencode(self.path)
        strings = [getattr(self, f) for f in ("endpoint", "region", "bucket", "prefix")]
        for name, v in zip(("path", "endpoint", "region", "bucket", "prefix"), [path] + strings):
            if not isinstance(v, (str, bytes)) or ("\0" if isinstance(v, str) else b"\0") in v:
                raise InvalidArgument(f"SharedTier {name}={v!r}; expected a str without NUL")
        c = n.SharedConfigC()
        n.lib.kvx_shared_config_init(ctypes.byref(c))
        c.kind = kinds[self.kind]
        c.path = path
        c.endpoint, c.region, c.bucket, c.prefix = (v.encode() for v in strings)
        c.capacity_bytes = self.capacity_bytes
        c.threads = self.threads
        c.timeout_ms = max(1, round(self.timeout * 1000))
        c.flags = (n.SHARED_WRITE_THROUGH if self.write == "through" else 0) | (0 if self.admit else n.SHARED_NO_ADMIT)
        c.pending_puts = self.pending_puts
        return c


class _Keys:
    """A call's keys as a `kvx_key` array over their bytes, kept alive for the call. A str
    key is its UTF-8 bytes; their lengths are checked by the library (1 to 64 bytes).
    The keys are joined into one buffer and the array is packed from (pointer, length)
    pairs in one go: a job of hundreds of keys costs its submitter microseconds, not a
    millisecond of per-key ctypes calls. One key (a runtime's tier looks its keys up one
    at a time) skips the joining: its array is packed from its own bytes."""

    def __init__(self, keys: Iterable[Key]):
        if isinstance(keys, (bytes, bytearray, memoryview, str)):
            raise InvalidArgument("keys must be a sequence of keys, not one key; wrap a single key in a list")
        bs = [k if type(k) is bytes else _key_bytes(i, k) for i, k in enumerate(keys)]
        self.n = len(bs)
        self._buf = bs[0] if self.n == 1 else b"".join(bs)
        # A length past uint32 would wrap: saturated, so the library refuses it.
        if self.n == 1:
            packed = struct.pack("@PI0P", ctypes.cast(self._buf, ctypes.c_void_p).value or 0, min(len(self._buf), 0xFFFFFFFF))
            self.array = _ONE_KEY.from_buffer_copy(packed)
            return
        lens = [min(len(b), 0xFFFFFFFF) for b in bs]
        pairs: List[int] = [0] * (2 * self.n)
        pairs[0::2] = islice(accumulate(lens, initial=ctypes.cast(self._buf, ctypes.c_void_p).value or 0), self.n)
        pairs[1::2] = lens
        # Native alignment: "0P" pads each (pointer, uint32) to kvx_key's size.
        packed = struct.pack("@" + "PI0P" * self.n, *pairs)
        self.array = (n.KeyC * max(self.n, 1)).from_buffer_copy(packed.ljust(ctypes.sizeof(n.KeyC) * max(self.n, 1), b"\0"))


_ONE_KEY = n.KeyC * 1


def _key_bytes(i: int, k: Any) -> bytes:
    if isinstance(k, str):
        return k.encode()
    if isinstance(k, (bytes, bytearray, memoryview)):
        return bytes(k)
    raise InvalidArgument(f"keys[{i}] is a {type(k).__name__}; a key is bytes (or a str, as UTF-8)")


def _store_closed() -> Error:
    return Shutdown("the store is closed", 12)


def _request_released() -> Error:
    return InvalidArgument("the store request is released", 2)


def _close_store(h: int) -> None:
    n.lib.kvx_store_close(h)


def _release_request(h: int) -> None:
    n.lib.kvx_store_request_release(h)


def _options(layers: Any, num_layers: int, critical: bool = False, wait_event: Any = None) -> n.TransferOptionsC:
    o = n.TransferOptionsC()
    n.lib.kvx_transfer_options_init(ctypes.byref(o))
    o.layer_begin, o.layer_end = _layer_range(layers, num_layers)
    if critical:
        o.flags |= n.XFER_CRITICAL
    if wait_event is not None:
        o.wait_event = event_handle(wait_event)
    return o


class Store:
    """A store in `directory`, opened (or made, with `create`) on `engine` for blocks of
    `config`'s geometry (its `kind` and `num_blocks` are ignored), holding at most
    `capacity_blocks` blocks in `shards` data files. `namespace` (at most 256 bytes)
    fingerprints what makes equal keys differ (model, dtype, layout, rank…). `durable`
    syncs every put and removal before it reports success; `buffered` uses the page
    cache (a tmpfs tier); `verify_on_open` checks every entry's seal on open. Reopening
    with another geometry, capacity, shard count or namespace raises `Incompatible`; a
    store another process (or this one) has open raises `Busy` naming its pid.
    `data_only=True` opens a store another process owns, to move the slots its owner hands
    out (`read_slots`, `write_slots`); its other calls raise `InvalidArgument`.
    `shared=SharedTier.dir(path)` (or `.s3(bucket)`) opens it over a shared tier (ABI 1.7)
    whose blocks other processes and hosts put and get too; each open may name another,
    or none. Close it with `close()` or a `with` block; close it before its engine."""

    def __init__(
        self,
        engine: Engine,
        directory: Union[str, "os.PathLike[str]"],
        config: LayoutConfig,
        capacity_blocks: int,
        namespace: Union[bytes, str] = b"",
        create: bool = True,
        durable: bool = False,
        buffered: bool = False,
        verify_on_open: bool = False,
        shards: int = 1,
        data_only: bool = False,
        shared: Optional[SharedTier] = None,
    ):
        n.need_minor(4, "the store")
        if data_only:
            need_slots()
        if shared is not None:
            n.need_minor(7, "a shared tier")
            if not isinstance(shared, SharedTier):
                raise InvalidArgument(f"shared is a {type(shared).__name__}; pass a kvxfer.SharedTier")
        if isinstance(namespace, str):
            namespace = namespace.encode()
        if not isinstance(namespace, (bytes, bytearray)):
            raise InvalidArgument(f"namespace is a {type(namespace).__name__}; expected bytes or str")
        for name, v in (("capacity_blocks", capacity_blocks), ("shards", shards)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise InvalidArgument(f"{name}={v!r}; expected a non-negative int")
        if shards > 0xFFFFFFFF:
            raise InvalidArgument(f"shards={shards}; at most capacity_blocks data files")
        self.engine = engine
        self.config = config
        self.namespace = bytes(namespace)
        #: The shared tier under the store, or None: where there is one, `lookup` also
        #: answers for the shared tier, and `lease` alone tells the local entries.
        self.shared = shared
        block = config._c()
        c = n.StoreConfigC()
        n.lib.kvx_store_config_init(ctypes.byref(c))
        c.flags = (
            (n.STORE_CREATE if create else 0)
            | (n.STORE_DURABLE if durable else 0)
            | (n.STORE_BUFFERED if buffered else 0)
            | (n.STORE_VERIFY_ON_OPEN if verify_on_open else 0)
            | (n.STORE_DATA_ONLY if data_only else 0)
        )
        c.block = ctypes.pointer(block)
        c.capacity_blocks = capacity_blocks
        ns = ctypes.create_string_buffer(self.namespace, len(self.namespace))
        c.namespace_bytes = ctypes.cast(ns, ctypes.c_void_p).value if self.namespace else None
        c.namespace_len = min(len(self.namespace), 0xFFFFFFFF)
        c.shards = shards
        if shared is not None:
            c.shared = ctypes.pointer(shared._c())
        out = ctypes.c_void_p()
        with engine._gate as eh:
            _check(n.lib.kvx_store_open(eh, os.fsencode(directory), ctypes.byref(c), ctypes.byref(out)))
        self._gate = Handle(out.value, _close_store, _store_closed)
        #: Requests released before they were seen to end, with the layout each moves:
        #: kept until they end (looked at on each put and get) or the store is closed.
        self._unfinished: List[Tuple[Handle, Layout]] = []
        # Reentrant: a collection during a sweep may release another request here.
        self._unfinished_lock = threading.RLock()
        #: Set (under `_unfinished_lock`) once the close has waited for every request.
        self._closed = False

    # -- lifetime ---------------------------------------------------------------
    def close(self) -> None:
        """Waits for the puts and gets in flight and closes the store (the directory is
        free for the next open). Idempotent and safe from any thread: calls other
        threads are making return first, later ones raise `Shutdown`. From a completion
        callback it returns at once and a thread of the binding closes it."""
        if not in_callback():
            self._close()
        elif self._gate.shut():
            threading.Thread(target=self._close, name="kvxfer-store-close").start()

    def _close(self) -> None:
        self._gate.close()
        # The close waited for every put and get: the layouts they kept may go.
        with self._unfinished_lock:
            self._closed = True
            ended, self._unfinished = self._unfinished, []
        for gate, _ in ended:
            gate.close_deferred()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            if hasattr(self, "_gate"):
                self.close()
        except Exception:
            pass

    # -- index ------------------------------------------------------------------
    def lookup(self, keys: Sequence[Key], lease: bool = False) -> Tuple[List[bool], int]:
        """Which keys the store holds, and how many leading keys it holds (a prefix's
        hits). Reads no block. `lease=True` leases each hit, so it is neither evicted nor
        reused until a get of it or `release_leases`."""
        k = _Keys(keys)
        present = (ctypes.c_uint8 * max(k.n, 1))()
        leading = ctypes.c_size_t()
        flags = n.LOOKUP_LEASE if lease else 0
        with self.engine._gate, self._gate as h:
            _check(n.lib.kvx_store_lookup(h, k.array, k.n, flags, present, ctypes.byref(leading)))
        return [bool(present[i]) for i in range(k.n)], leading.value

    def release_leases(self, keys: Sequence[Key]) -> None:
        """Gives back the oldest lease taken by key (`lookup(lease=True)`, `lease_slots`)
        of each key (a key without one is skipped). Such leases belong to the key: any get
        of it spends one. Several holders of one key use `lease` instead."""
        k = _Keys(keys)
        with self.engine._gate, self._gate as h:
            _check(n.lib.kvx_store_release_leases(h, k.array, k.n))

    def lease(self, keys: Sequence[Key]) -> Tuple[List[Optional[int]], int]:
        """Leases each hit for the caller alone: the lease's token (an int) for each hit,
        None for a miss, and how many leading keys the store holds. A leased hit stays
        loadable until `release(tokens)`; no get, and no other caller's release, spends
        it. To load it, `get` the key, then release the lease (ABI 1.6)."""
        n.need_minor(6, "lease tokens")
        k = _Keys(keys)
        tokens = (ctypes.c_uint64 * max(k.n, 1))()
        leading = ctypes.c_size_t()
        with self.engine._gate, self._gate as h:
            _check(n.lib.kvx_store_lease(h, k.array, k.n, tokens, ctypes.byref(leading)))
        return [tokens[i] or None for i in range(k.n)], leading.value

    def release(self, leases: Sequence[Optional[int]]) -> None:
        """Gives back leases from `lease` (None is skipped). All or none: a lease not held
        (given back already, or listed twice) raises `InvalidArgument` and gives back
        nothing."""
        n.need_minor(6, "lease tokens")
        tokens = [t for t in leases if t is not None]
        array = (ctypes.c_uint64 * max(len(tokens), 1))(*tokens)
        with self.engine._gate, self._gate as h:
            _check(n.lib.kvx_store_release(h, array, len(tokens)))

    def remove(self, keys: Sequence[Key]) -> List[Optional[Error]]:
        """Removes each key: None once its removal is recorded (it never comes back), or
        `NotFound` for a key not held. A leased key, or one a get is loading, leaves the
        index at once; its slot is reused only after those end."""
        k = _Keys(keys)
        statuses = (ctypes.c_uint32 * max(k.n, 1))()
        with self.engine._gate, self._gate as h:
            _check(n.lib.kvx_store_remove(h, k.array, k.n, statuses))
        return [None if statuses[i] == n.OK else error_for(statuses[i], "the store does not hold this key") for i in range(k.n)]

    def stats(self) -> StoreStats:
        c = n.StoreCountersC()
        c.struct_size = ctypes.sizeof(c)
        with self.engine._gate, self._gate as h:
            _check(n.lib.kvx_store_stats(h, ctypes.byref(c)))
        return StoreStats(*(getattr(c, f.name) for f in fields(StoreStats)))

    # -- slot handles (owner) ------------------------------------------------------
    def lease_slots(self, keys: Sequence[Key]) -> List[Optional[SlotHandle]]:
        """As `lookup(keys, lease=True)`, for a data-only process: the handle to read each
        hit (`read_slots`), None for a miss. Each hit stays leased until `release_leases`."""
        need_slots()
        k = _Keys(keys)
        handles = (n.SlotHandleC * max(k.n, 1))()
        present = (ctypes.c_uint8 * max(k.n, 1))()
        with self.engine._gate, self._gate as h:
            _check(n.lib.kvx_store_lease_slots(h, k.array, k.n, handles, present))
        return [SlotHandle._from_c(handles[i]) if present[i] else None for i in range(k.n)]

    def reserve_slots(self, keys: Sequence[Key]) -> List[Reservation]:
        """Reserves a slot for each key not held, as a put would, for a data-only process
        to write (`write_slots`); then `commit_slots` (or `abort_slots`) the handles."""
        need_slots()
        k = _Keys(keys)
        handles = (n.SlotHandleC * max(k.n, 1))()
        kinds = (ctypes.c_uint32 * max(k.n, 1))()
        with self.engine._gate, self._gate as h:
            _check(n.lib.kvx_store_reserve_slots(h, k.array, k.n, handles, kinds))
        return [
            Reservation(kinds[i], SlotHandle._from_c(handles[i]) if kinds[i] == Reservation.WRITE else None) for i in range(k.n)
        ]

    def commit_slots(self, handles: Sequence[SlotHandle]) -> List[Optional[Error]]:
        """Makes the written slots of `handles` entries. Per handle: None once committed;
        `IntegrityError` for a block not completely written through this handle (its
        write did not finish, or another write of the slot landed on it); `InvalidArgument`
        for a handle this open did not reserve (already committed or aborted, or from an
        earlier open); `Cancelled` for a key removed meanwhile. A durable store syncs the
        blocks' data files before their records, whatever the data process opened."""
        need_slots()
        array, count = handle_array(handles)
        statuses = (ctypes.c_uint32 * max(count, 1))()
        with self.engine._gate, self._gate as h:
            _check(n.lib.kvx_store_commit_slots(h, array, count, statuses))
        why = "the slot was not committed"
        return [None if statuses[i] == n.OK else error_for(statuses[i], f"handle {i}: {why}") for i in range(count)]

    def abort_slots(self, handles: Sequence[SlotHandle]) -> None:
        """Gives the reserved slots of `handles` back unwritten (a handle not reserved is
        skipped)."""
        need_slots()
        array, count = handle_array(handles)
        with self.engine._gate, self._gate as h:
            _check(n.lib.kvx_store_abort_slots(h, array, count))

    # -- slot handles (data) -------------------------------------------------------
    def read_slots(
        self, handles: Sequence[SlotHandle], dst: Layout, dst_ids: Any, critical: bool = False, wait_event: Any = None
    ) -> "StoreRequest":
        """Loads the slot of read handle `handles[i]` into block `dst_ids[i]` of `dst`,
        asynchronously (`critical` and `wait_event` as `Engine.submit`'s). Per key (`results()`): None once loaded and checked,
        `IntegrityError` where the slot no longer holds the entry the handle names or its
        block fails a check, else the transfer's error."""
        need_slots()
        array, count = handle_array(handles)
        p, ids, owner = block_ids(dst_ids, "dst_ids")
        if ids != count:
            raise InvalidArgument(f"{count} handles but {ids} destination ids; give one block per handle")
        o = _options(None, dst.config.num_layers, critical, wait_event)
        return self._submit(
            dst, count, lambda h, lh, out: n.lib.kvx_store_read_slots(h, array, count, lh, p, ctypes.byref(o), out), owner
        )

    def write_slots(self, src: Layout, src_ids: Any, handles: Sequence[SlotHandle], wait_event: Any = None) -> "StoreRequest":
        """Writes block `src_ids[i]` of `src` to the slot of write handle `handles[i]`,
        asynchronously (`wait_event` as `Engine.submit`'s); whole blocks, each handle once. The owner then commits (or
        aborts) the handles. Per key: None once written, else the transfer's error."""
        need_slots()
        array, count = handle_array(handles)
        p, ids, owner = block_ids(src_ids, "src_ids")
        if ids != count:
            raise InvalidArgument(f"{count} handles but {ids} source ids; give one block per handle")
        o = _options(None, src.config.num_layers, wait_event=wait_event)
        return self._submit(
            src, count, lambda h, lh, out: n.lib.kvx_store_write_slots(h, lh, p, array, count, ctypes.byref(o), out), owner
        )

    # -- data -------------------------------------------------------------------
    def put(self, src: Layout, src_ids: Any, keys: Sequence[Key]) -> "StoreRequest":
        """Stores block `src_ids[i]` of `src` under `keys[i]`, asynchronously; whole
        blocks only. Per key (`results()`): None once stored (also for a key held
        already: nothing is written), `Busy` when the store is full of held entries,
        `Cancelled` when it was removed meanwhile, else the transfer's error."""
        k = _Keys(keys)
        p, count, owner = block_ids(src_ids, "src_ids")
        if count != k.n:
            raise InvalidArgument(f"{k.n} keys but {count} source ids; give one block per key")
        o = _options(None, src.config.num_layers)
        return self._submit(src, k.n, lambda h, lh, out: n.lib.kvx_store_put(h, lh, p, k.array, k.n, ctypes.byref(o), out), owner)

    def get(self, keys: Sequence[Key], dst: Layout, dst_ids: Any, layers: Any = None, critical: bool = False) -> "StoreRequest":
        """Loads the block of `keys[i]` into block `dst_ids[i]` of `dst`, asynchronously
        (`layers` and `critical` as `Engine.submit`'s). Per key (`results()`): None once loaded and
        checked, `NotFound` for a key not held, `IntegrityError` for a block that failed
        a check (a miss: its entry is dropped, the other keys still load), else the
        transfer's error. `wait()` raises the first key's failure."""
        k = _Keys(keys)
        p, count, owner = block_ids(dst_ids, "dst_ids")
        if count != k.n:
            raise InvalidArgument(f"{k.n} keys but {count} destination ids; give one block per key")
        o = _options(layers, dst.config.num_layers, critical)
        return self._submit(dst, k.n, lambda h, lh, out: n.lib.kvx_store_get(h, k.array, k.n, lh, p, ctypes.byref(o), out), owner)

    def _submit(self, layout: Layout, count: int, call: Any, owner: Any) -> "StoreRequest":
        out = ctypes.c_void_p()
        with self.engine._gate, self._gate as h, layout._gate as lh:
            self._sweep()
            _check(call(h, lh, ctypes.byref(out)))
        del owner
        return StoreRequest(self, out.value, count, layout)

    def _sweep(self) -> None:
        """Releases the released requests that ended (in order, up to one still running)."""
        ended = []
        with self._unfinished_lock:
            while self._unfinished:
                gate = self._unfinished[0][0]
                with gate as rh:
                    status = n.lib.kvx_store_request_poll(rh)
                if status == n.PENDING:
                    break
                ended.append(self._unfinished.pop(0))
        for gate, _ in ended:
            gate.close_deferred()


class StoreRequest:
    """A store put, get, slot read or slot write: one result per key. `wait()` raises
    the failure of the first key (by index) that failed, so a caller that only waits never
    counts a miss as loaded; `results()` gives each key's. `await request` waits on the engine's
    completion fd (no thread of its own).
    It keeps the layout it moves from or into (and the arrays behind it) alive until it
    ends, also once released."""

    def __init__(self, store: Store, handle: int, num_keys: int, layout: Layout):
        self.store = store
        self._gate = Handle(handle, _release_request, _request_released)
        self._n = num_keys
        self._keep: Optional[Layout] = layout
        self._released = False
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self._n

    def wait(self, timeout: Optional[float] = None) -> None:
        """Waits up to `timeout` seconds (None: forever) for every key; raises `Timeout`
        if keys are still pending, else the first failed key's error (its message names
        the key). Inside a completion callback of the store's engine it raises
        `InvalidArgument` unless `timeout` is 0: the callback may hold the thread the
        request needs."""
        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        while True:
            left = _WAIT_STEP if deadline is None else max(0.0, deadline - time.monotonic())
            with self._gate as h:
                st = n.lib.kvx_store_request_wait(h, int(min(left, _WAIT_STEP) * 1e9))
                if st != 10:  # KVX_ERR_TIMEOUT: this step's
                    why = n.last_error()
                    # The request's status, or PENDING: the wait's may be its own, such as
                    # a wait refused inside a callback.
                    final = n.lib.kvx_store_request_poll(h)
                    if final != n.PENDING:
                        self._ended()
                    if st == n.OK:
                        return
                    if st == final:
                        m = n.lib.kvx_store_request_error(h)
                        why = m.decode("utf-8", "replace") if m else why
                    raise error_for(st, why)
            if deadline is not None and left <= _WAIT_STEP:
                raise Timeout(f"the store request did not complete within {timeout} s", 10)

    def done(self) -> bool:
        """Whether every key has its result; never raises for a failed key."""
        with self._gate as h:
            status = n.lib.kvx_store_request_poll(h)
        if status == n.PENDING:
            return False
        self._ended()
        return True

    def key_status(self, i: int) -> int:
        """Key `i`'s C status: 0 (`KVX_OK`), 1 (`KVX_PENDING`) or its `KVX_ERR_*` code."""
        st = ctypes.c_uint32()
        with self._gate as h:
            _check(n.lib.kvx_store_request_key_status(h, i, ctypes.byref(st)))
        return st.value

    def results(self, timeout: Optional[float] = None) -> List[Optional[Error]]:
        """Waits (as `wait`, without raising a key's failure) and returns each key's
        result: None where it succeeded, else its error (`NotFound`, `IntegrityError`,
        `Busy`…) with the reason."""
        try:
            self.wait(timeout)
        except Timeout:
            raise
        except Error:
            pass
        out: List[Optional[Error]] = []
        with self._gate as h:
            # The request's status is OK only when every key's is.
            if n.lib.kvx_store_request_poll(h) == n.OK:
                return [None] * self._n
            for i in range(self._n):
                st = ctypes.c_uint32()
                _check(n.lib.kvx_store_request_key_status(h, i, ctypes.byref(st)))
                if st.value == n.OK:
                    out.append(None)
                else:
                    m = n.lib.kvx_store_request_key_error(h, i)
                    out.append(error_for(st.value, f"key {i}: {m.decode('utf-8', 'replace') if m else ''}"))
        return out

    def __await__(self):  # type: ignore[no-untyped-def]
        return await_done(
            self.store.engine._fd_waiters,
            self.done,
            lambda: self.wait(0),
            lambda: asyncio.get_running_loop().run_in_executor(None, self.wait),
        )

    def _ended(self) -> None:
        """Seen to end: the layout may go."""
        with self._lock:
            self._keep = None

    def release(self) -> None:
        """Drops the handle; the put or get still completes (the store keeps the layout
        until it does). Safe from any thread: a call another thread is making on the
        request returns first, later ones raise `InvalidArgument`."""
        with self._lock:
            if self._released:
                return
            self._released = True
            keep, self._keep = self._keep, None
        if keep is not None:
            with self.store._unfinished_lock:
                # Unless the store is closed: its close waited for every request.
                if not self.store._closed:
                    self.store._unfinished.append((self._gate, keep))
                    return
        self._gate.close_deferred()

    close = release

    def __enter__(self) -> "StoreRequest":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:
            pass
