"""kvxfer as LMCache's L2 storage: `KvxferConnector`, a client for LMCache's
`native_plugin` L2 adapter (LMCache's multi-process mode), backed by kvxfer stores on
disk or tmpfs. LMCache loads it by module path, without a fork::

    --l2-adapter '{"type": "native_plugin", "module_path": "kvxfer.lmcache",
                   "class_name": "KvxferConnector",
                   "adapter_params": {"root_dir": "/mnt/nvme/lmcache", "capacity_bytes": 500000000000}}'

LMCache wraps it in its `NativeConnectorL2Adapter`, which hands it batches of keys
(strings naming model, KV rank, object group and chunk hash) with one memoryview per
object of its L1 memory, and waits on `event_fd()` for `drain_completions()`. Each
memoryview is registered once as a kvxfer host layout (cached by address) and moves to or
from its store as one block. `import kvxfer.lmcache` needs no LMCache; the connector
checks the installed version (`SUPPORTED_LMCACHE`) when LMCache makes it. See
docs/lmcache.md."""

from __future__ import annotations

import ctypes
import logging
import os
import re
import threading
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .engine import Engine, Layout
from .errors import Error, InvalidArgument, Shutdown
from .store import Store, StoreRequest
from .tier import check_version, chunk_layout, engine_settings, namespace_of, store_key

log = logging.getLogger("kvxfer.lmcache")

#: The LMCache versions whose native-plugin interface this module implements.
SUPPORTED_LMCACHE = ("0.5.6",)

#: Part of every namespace: a change to how this module lays objects out changes it.
_FORMAT = "kvxfer.lmcache 1"


def check_lmcache_version() -> str:
    """The installed LMCache's version; raises `Unsupported` naming the supported ones when
    it is another (or when LMCache is not installed)."""
    return check_version("kvxfer.lmcache", "lmcache", "LMCache", SUPPORTED_LMCACHE, "native_plugin L2 interface")


class _Span:
    """A range of the caller's host memory, as `Engine.register` takes it (bytes)."""

    def __init__(self, addr: int, nbytes: int):
        self.__array_interface__ = {"data": (addr, False), "shape": (nbytes,), "typestr": "|u1", "version": 3}


@dataclass
class _Batch:
    """One submitted batch: the store request of each key, or its result already."""

    requests: List[Tuple[int, StoreRequest]] = field(default_factory=list)
    #: Per key: None while its request runs, else (succeeded, why not).
    results: List[Optional[Tuple[bool, str]]] = field(default_factory=list)
    #: An exists or a delete: it succeeds whatever its per-key answers (LMCache reads
    #: them only from a batch that succeeded); a set or a get succeeds if every key did.
    query: bool = False

    def done(self) -> bool:
        return all(r.done() for _, r in self.requests)

    def completion(self, future_id: int) -> Tuple[int, bool, str, List[bool]]:
        for i, r in self.requests:
            err = r.results(0)[0]
            self.results[i] = (err is None, "" if err is None else str(err))
            r.release()
        self.requests = []
        bools = [bool(r and r[0]) for r in self.results]
        if self.query:
            return future_id, True, "", bools
        why = next((r[1] for r in self.results if r is not None and not r[0]), "")
        return future_id, all(bools), why, bools


class KvxferConnector:
    """LMCache's `native_plugin` L2 client over kvxfer stores in `root_dir`.

    `adapter_params` are this constructor's arguments: `root_dir`; `capacity_bytes` (or
    `capacity_gb`) per object size; `model`, `dtype`, `world_size`, `chunk_size` and
    `namespace` (free text, such as a weights revision): what LMCache's keys do not say
    about the bytes they name, mirrored from LMCache's own settings and fingerprinted into
    the stores' namespace (the keys carry the model name and KV rank); `durable`,
    `buffered` (tmpfs or page-cache I/O), `verify_on_open`, `shards`; `engine`: kvxfer
    engine settings (`io_backend`, `io_threads`, …; the device defaults to the emulated
    one, since the objects are in host memory).

    Objects of each size (full chunks, and each size of partial chunk) get a store of
    their own, `<root_dir>/<fingerprint>_<object bytes>`, opened on the first object of
    that size or, if it exists, when the connector starts (so a restart finds what was
    stored). A key is a miss alone: not held, or failing a check (its entry is dropped)."""

    def __init__(
        self,
        root_dir: str,
        capacity_bytes: Optional[int] = None,
        capacity_gb: Optional[float] = None,
        model: str = "",
        dtype: str = "",
        world_size: int = 0,
        chunk_size: int = 0,
        namespace: str = "",
        durable: bool = False,
        buffered: bool = False,
        verify_on_open: bool = False,
        shards: int = 1,
        engine: Optional[Dict[str, Any]] = None,
    ):
        check_lmcache_version()
        if (capacity_bytes is None) == (capacity_gb is None):
            raise InvalidArgument("the kvxfer L2 adapter needs one of capacity_bytes or capacity_gb in its adapter_params")
        gib = float(capacity_gb or 0)
        self._capacity = int(capacity_bytes) if capacity_bytes is not None else int(gib * (1 << 30))
        if self._capacity <= 0:
            raise InvalidArgument(f"the kvxfer L2 adapter's capacity is {self._capacity} bytes; give a positive capacity_bytes")
        self._fields = {
            "format": _FORMAT,
            "model": model,
            "dtype": dtype,
            "world_size": world_size,
            "chunk_size": chunk_size,
            "extra": namespace,
        }
        self._options = {"durable": durable, "buffered": buffered, "verify_on_open": verify_on_open, "shards": shards}
        self.root_dir = os.fspath(root_dir)
        #: The directory name's fingerprint: a configuration of its own gets stores of its own.
        self._prefix = namespace_of("lmcache", self._fields).split(b" ")[1][:16].decode()
        os.makedirs(self.root_dir, exist_ok=True)
        settings = engine_settings(engine, buffered)
        self._engine = Engine(device=settings.pop("device", "emulated"), **settings)
        self._fd = self._engine.completion_fd()
        self._lock = threading.Lock()
        self._stores: Dict[int, Store] = {}
        #: Host layouts over LMCache's objects, by (address, bytes): registered once.
        self._layouts: Dict[Tuple[int, int], Layout] = {}
        self._batches: Dict[int, _Batch] = {}
        self._next_id = 1
        self._closed = False
        found = re.compile(re.escape(self._prefix) + r"_(\d+)$")
        for name in sorted(os.listdir(self.root_dir)):
            m = found.match(name)
            if m:
                self._store(int(m.group(1)))
        log.info("kvxfer L2 adapter: %s, %d object sizes held", self.root_dir, len(self._stores))

    # -- LMCache's native client interface ----------------------------------------
    def event_fd(self) -> int:
        """The kvxfer engine's completion fd: readable once a batch may have completed."""
        return self._fd

    def submit_batch_set(self, keys: Sequence[str], memoryviews: Sequence[memoryview]) -> int:
        """Stores each object under its key; completes with one result per key."""
        return self._submit(keys, memoryviews, load=False)

    def submit_batch_get(self, keys: Sequence[str], memoryviews: Sequence[memoryview]) -> int:
        """Loads each key's object into its memoryview; a key not held, or whose block
        fails a check, is False alone."""
        return self._submit(keys, memoryviews, load=True)

    def submit_batch_exists(self, keys: Sequence[str]) -> int:
        """Whether each key is held, in a store of any object size."""
        skeys = [self._key(k) for k in keys]
        held = [False] * len(skeys)
        with self._lock:
            stores = list(self._stores.values())
        for s in stores:
            present, _ = s.lookup(skeys)
            held = [a or b for a, b in zip(held, present)]
        return self._finished(_Batch(results=[(h, "") for h in held], query=True))

    def submit_batch_delete(self, keys: Sequence[str]) -> int:
        """Removes each key from every store; True where one held it."""
        skeys = [self._key(k) for k in keys]
        removed = [False] * len(skeys)
        with self._lock:
            stores = list(self._stores.values())
        for s in stores:
            removed = [a or e is None for a, e in zip(removed, s.remove(skeys))]
        return self._finished(_Batch(results=[(r, "") for r in removed], query=True))

    def drain_completions(self) -> List[Tuple[int, bool, str, List[bool]]]:
        """Reads the fd (which resets it), then the batches that completed:
        `(future_id, every key succeeded, the first failure's reason, per-key results)`.
        A request that ends after the read makes the fd readable again."""
        try:
            os.read(self._fd, 8)
        except BlockingIOError:
            pass
        with self._lock:
            ended = [(fid, b) for fid, b in self._batches.items() if b.done()]
            for fid, _ in ended:
                del self._batches[fid]
        return [b.completion(fid) for fid, b in ended]

    def close(self) -> None:
        """Waits for the batches in flight, then closes the stores and the engine."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            stores, self._stores = list(self._stores.values()), {}
            layouts, self._layouts = list(self._layouts.values()), {}
        for s in stores:
            s.close()
        for layout in layouts:
            layout.close()
        self._engine.close()

    # -- inside -------------------------------------------------------------------
    @staticmethod
    def _key(key: str) -> bytes:
        return store_key(key.encode() if isinstance(key, str) else bytes(key))

    def _submit(self, keys: Sequence[str], views: Sequence[memoryview], load: bool) -> int:
        if len(keys) != len(views):
            raise InvalidArgument(f"{len(keys)} keys but {len(views)} memoryviews; give one object per key")
        batch = _Batch(results=[None] * len(keys))
        for i, (key, view) in enumerate(zip(keys, views)):
            try:
                layout, size = self._layout(view)
                store = self._store(size)
                k = [self._key(key)]
                batch.requests.append((i, store.get(k, layout, [0], critical=True) if load else store.put(layout, [0], k)))
            except Error as e:
                batch.results[i] = (False, str(e))
        with self._lock:
            fid = self._new_id()
            self._batches[fid] = batch
        # A request that ended before the batch was listed (a get of keys not held ends
        # inside the call) may have had its wake-up drained already: give it another.
        if batch.done():
            self._signal()
        return fid

    def _finished(self, batch: _Batch) -> int:
        """A batch answered at once: listed for the next drain, and the fd made readable."""
        with self._lock:
            fid = self._new_id()
            self._batches[fid] = batch
        self._signal()
        return fid

    def _new_id(self) -> int:
        fid, self._next_id = self._next_id, self._next_id + 1
        return fid

    def _signal(self) -> None:
        """Makes the fd readable for a batch that ended without a kvxfer request. The
        engine is this connector's own, so its fd carries this connector's batches only."""
        os.write(self._fd, (1).to_bytes(8, "little"))

    def _layout(self, view: memoryview) -> Tuple[Layout, int]:
        """The host layout over `view`'s bytes (one block), registered on first use."""
        view = memoryview(view)
        if not view.contiguous or view.readonly:
            raise InvalidArgument("an object's memoryview must be contiguous and writable")
        size = view.nbytes
        if size == 0:
            raise InvalidArgument("an object of 0 bytes")
        addr = ctypes.addressof(ctypes.c_char.from_buffer(view.cast("B")))
        with self._lock:
            layout = self._layouts.get((addr, size))
            if layout is None:
                layout = self._engine.register(_Span(addr, size), chunk_layout(1, size))
                self._layouts[(addr, size)] = layout
        return layout, size

    def _store(self, size: int) -> Store:
        """The store of objects of `size` bytes, opened (or made) on first use."""
        with self._lock:
            if self._closed:
                raise Shutdown("the kvxfer L2 adapter is closed", 12)
            s = self._stores.get(size)
            if s is None:
                s = Store(
                    self._engine,
                    os.path.join(self.root_dir, f"{self._prefix}_{size}"),
                    chunk_layout(1, size),
                    capacity_blocks=max(1, self._capacity // size),
                    namespace=namespace_of("lmcache", {**self._fields, "object_bytes": size}),
                    **self._options,
                )
                self._stores[size] = s
        return s


__all__: Sequence[str] = ["KvxferConnector", "SUPPORTED_LMCACHE", "check_lmcache_version"]
