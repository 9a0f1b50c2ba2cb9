"""kvxfer as LMCache's L2 storage: `KvxferConnector`, a client for LMCache's
`native_plugin` L2 adapter (LMCache's multi-process mode), backed by kvxfer stores on
disk or tmpfs. LMCache loads it by module path, without a fork::

    --l2-adapter '{"type": "native_plugin", "module_path": "kvxfer.lmcache",
                   "class_name": "KvxferConnector",
                   "adapter_params": {"root_dir": "/mnt/nvme/lmcache", "capacity_bytes": 500000000000}}'

LMCache wraps it in its `NativeConnectorL2Adapter`, which hands it batches of keys
(strings naming model, KV rank, object group and chunk hash) with one memoryview per
object of its L1 memory, and waits on `event_fd()` for `drain_completions()`. A
configuration has one store, whose slot is `object_bytes` (a full chunk's object size,
the first object group's where it lists one per group) where that is given, which it
must be over a shared tier, else the size of the first object it stored (a full chunk,
as a rule): an object moves in whole slots straight from
or into its memoryview (registered as a kvxfer host layout, cached by address), and a part shorter than a slot
(a partial chunk) through a slot-sized buffer; the object's length is in each part's key.
`import kvxfer.lmcache` needs no LMCache; the connector checks the installed version
(`SUPPORTED_LMCACHE`) when LMCache makes it. See docs/lmcache.md."""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import logging
import os
import shutil
import threading
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple, Union

from .engine import Engine, Layout
from .errors import Busy, Error, InvalidArgument, NotFound, Shutdown
from .store import Store, StoreRequest
from .tier import check_room, check_version, chunk_layout, engine_settings, log_failures, make_root, namespace_of, open_or_remake, shared_tier, store_key

log = logging.getLogger("kvxfer.lmcache")

#: The LMCache versions whose native-plugin interface this module implements, each tested
#: by `make integration-test`; another is refused unless KVX_LMCACHE_ANY_VERSION=1
#: (docs/lmcache.md says how a release is added). What differs between them, for this
#: module, is kept beside this list. Between 0.5.5 and 0.5.6 nothing this module uses
#: does: the `native_plugin` adapter is the same, and the `NativeConnectorL2Adapter` it
#: wraps the connector in keeps the key format, the memoryviews (an object's own bytes)
#: and the calls; 0.5.6 adds only `pad_buffers_to_alignment`, which `native_plugin`
#: leaves off.
SUPPORTED_LMCACHE = ("0.5.5", "0.5.6")

#: Part of every namespace: a change to how this module lays objects out changes it.
_FORMAT = "kvxfer.lmcache 2"

#: The connector's settings (`adapter_params`).
_SETTINGS = ("root_dir", "capacity_bytes", "capacity_gb", "model", "dtype", "world_size", "chunk_size", "namespace", "durable", "buffered", "verify_on_open", "shards", "engine", "shared", "object_bytes")

#: Host layouts kept registered over LMCache's objects (by address and size); the least
#: recently used one goes past this many.
MAX_LAYOUTS = 1024

#: Written in the store's directory: its slot size and the object sizes it holds.
CONFIG_FILE = "config.json"


def check_lmcache_version() -> str:
    """The installed LMCache's version; raises `Unsupported` naming the supported ones when
    it is another (or when LMCache is not installed)."""
    return check_version("kvxfer.lmcache", "lmcache", "LMCache", SUPPORTED_LMCACHE, "native_plugin L2 interface")


class _Span:
    """A range of the caller's host memory, as `Engine.register` takes it (bytes)."""

    def __init__(self, addr: int, nbytes: int):
        self.__array_interface__ = {"data": (addr, False), "shape": (nbytes,), "typestr": "|u1", "version": 3}


def part_keys(key: bytes, size: int, slot: int) -> List[bytes]:
    """The store keys of an object of `size` bytes under `key`: one per slot it spans,
    each naming the object's length and the part's index, so an object is never loaded
    into one of another size."""
    return [store_key(b"%d:%d:" % (size, i) + key) for i in range(-(-size // slot))]


class _Move:
    """One object's put or get: its store requests, and for a last part shorter than a
    slot the slot-sized buffer it goes through (with, for a get, where it lands)."""

    def __init__(self) -> None:
        self.requests: List[StoreRequest] = []
        self.staging: Optional[Tuple[Layout, Any, Optional[memoryview]]] = None
        #: Once ended: whether it moved (for an exists or a delete, the answer), and why
        #: not.
        self.result: Optional[Tuple[bool, Optional[Exception]]] = None

    def done(self) -> bool:
        return all(r.done() for r in self.requests)

    def finish(self) -> Tuple[bool, Optional[Exception]]:
        """Its result, once it ended: every part moved, or the first failure."""
        if self.result is None:
            why: Optional[Exception] = None
            for r in self.requests:
                why = why or next((e for e in r.results() if e is not None), None)
                r.release()
            if self.staging is not None:
                layout, buf, dst = self.staging
                if why is None and dst is not None:
                    dst[:] = memoryview(buf)[: len(dst)]
                layout.close()
            self.requests, self.staging = [], None
            self.result = (why is None, why)
        return self.result


class _Batch:
    """One submitted batch: a move per key, or its result already. An exists or a delete
    (`query`) succeeds whatever its per-key answers (LMCache reads them only from a batch
    that succeeded); a set or a get succeeds if every key did."""

    def __init__(self, moves: List[_Move], keys: Sequence[str] = (), what: str = "", query: bool = False):
        self.moves = moves
        self.keys = keys
        self.what = what
        self.query = query

    def done(self) -> bool:
        return all(m.done() for m in self.moves)

    def completion(self, future_id: int) -> Tuple[int, bool, str, List[bool]]:
        results = [m.finish() for m in self.moves]
        bools = [ok for ok, _ in results]
        if self.query:
            return future_id, True, "", bools
        errors = [e for _, e in results]
        log_failures(log, f"kvxfer L2 adapter: a {self.what} of {len(self.moves)} objects", self.keys, errors, (NotFound,))
        why = next((e for e in errors if e is not None), None)
        return future_id, all(bools), "" if why is None else str(why), bools


def _object_sizes(object_bytes: Union[int, Sequence[int], None]) -> List[int]:
    """`object_bytes` as a list of full chunks' object sizes, the slot's first; empty
    where not given. A size is a positive whole number, and a list holds at least one."""
    if object_bytes is None:
        return []
    sizes = [object_bytes] if isinstance(object_bytes, int) else object_bytes
    if not isinstance(sizes, (list, tuple)) or not sizes or any(not isinstance(n, int) or isinstance(n, bool) or n <= 0 for n in sizes):
        raise InvalidArgument(
            f"the kvxfer L2 adapter's object_bytes is {object_bytes!r}; give the bytes of one full chunk's object, a positive "
            "whole number, or a list of one per object group (a hybrid model's groups), the first group's first"
        )
    return list(sizes)


def _answered(ok: bool, why: Optional[Exception] = None) -> _Move:
    m = _Move()
    m.result = (ok, why)
    return m


class KvxferConnector:
    """LMCache's `native_plugin` L2 client over a kvxfer store in `root_dir`.

    `adapter_params` are this constructor's arguments: `root_dir`; `capacity_bytes` (or
    `capacity_gb`) of the store; `model`, `dtype`, `world_size`, `chunk_size` and
    `namespace` (free text, such as a weights revision): what LMCache's keys do not say
    about the bytes they name, mirrored from LMCache's own settings and fingerprinted into
    the store's namespace (the keys carry the model name and KV rank); `durable`,
    `buffered` (tmpfs or page-cache I/O), `verify_on_open`, `shards`; `engine`: kvxfer
    engine settings (`io_backend`, `io_threads`, …; the device defaults to the emulated
    one, since the objects are in host memory); `shared`: a shared tier under the store
    (`kvxfer.tier.shared_tier`); `object_bytes`: the size of a full chunk's object (as
    LMCache's L1 holds it), or a list of one per object group for a model whose groups'
    objects differ (a hybrid model's), needed with `shared`. Any other key is refused,
    naming these.

    A configuration has one store, `<root_dir>/<fingerprint>`, and one connector owns
    it: a second one on the same `root_dir` is refused at its start, naming the first's
    pid. With `object_bytes`, the store is opened (or made) at the start with slots of
    its (first) size, and an exists asks for each of its sizes whatever the store has
    held: every server over a shared tier has one slot, so the part keys agree, and one
    that has stored nothing yet finds the others' full chunks of every object group.
    Without it, the store is made on the first object stored, with a slot of that
    object's size, and opened at the start when it exists (so a restart finds what was
    stored).
    Its capacity is preallocated whole when it is made. A key is a miss alone: not held,
    or failing a check (its entry is dropped)."""

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
        shared: Optional[Dict[str, Any]] = None,
        object_bytes: Union[int, Sequence[int], None] = None,
        **unknown: Any,
    ):
        check_lmcache_version()
        if unknown:
            raise InvalidArgument(f"the kvxfer L2 adapter has no adapter_params {', '.join(sorted(unknown))}; its keys are {', '.join(_SETTINGS)}")
        if (capacity_bytes is None) == (capacity_gb is None):
            raise InvalidArgument("the kvxfer L2 adapter needs one of capacity_bytes or capacity_gb in its adapter_params")
        gib = float(capacity_gb or 0)
        self._capacity = int(capacity_bytes) if capacity_bytes is not None else int(gib * (1 << 30))
        if self._capacity <= 0:
            raise InvalidArgument(f"the kvxfer L2 adapter's capacity is {self._capacity} bytes; give a positive capacity_bytes")
        if not isinstance(shards, int) or isinstance(shards, bool) or shards < 1:
            raise InvalidArgument(f"the kvxfer L2 adapter's shards is {shards!r}; give a whole number of data files, at least 1")
        full_sizes = _object_sizes(object_bytes)
        self._fields = {
            "format": _FORMAT,
            "model": model,
            "dtype": dtype,
            "world_size": world_size,
            "chunk_size": chunk_size,
            "extra": namespace,
        }
        if full_sizes:
            # The slot, which cuts objects into parts: servers that share agree on it. One
            # size is fingerprinted as a number, however it is given.
            self._fields["object_bytes"] = full_sizes[0] if len(full_sizes) == 1 else full_sizes
        #: The slot where `object_bytes` is given: the first object group's full chunk.
        self._object_bytes = full_sizes[0] if full_sizes else 0
        #: Every object group's full chunk's size, asked for whatever the store has held.
        self._full_sizes = frozenset(full_sizes)
        self._options = {
            "durable": durable,
            "buffered": buffered,
            "verify_on_open": verify_on_open,
            "shards": shards,
            "shared": shared_tier("the kvxfer L2 adapter", shared),
        }
        if object_bytes is None and self._options["shared"] is not None:
            raise InvalidArgument(
                'the kvxfer L2 adapter over a "shared" tier needs object_bytes in its adapter_params: the bytes of one full '
                "chunk's object (chunk_size × a token's KV bytes on this server's rank: 2 × layers × KV heads × head size × "
                "dtype bytes for most models; a list of one per object group where a hybrid model's groups differ), the same "
                "on every server that shares, so that they cut objects into the same parts and a fresh server knows what to ask for"
            )
        self.root_dir = os.fspath(root_dir)
        self.namespace = namespace_of("lmcache", self._fields)
        #: The store's directory: a configuration of its own gets a store of its own.
        self.directory = os.path.join(self.root_dir, self.namespace.split(b" ")[1][:16].decode())
        make_root(self.root_dir, "the kvxfer L2 adapter")
        check_room(self.root_dir, self._capacity, "the kvxfer L2 adapter")
        self._owner = self._claim()
        self._lock = threading.Lock()
        #: Held while the store is opened or made, which takes its whole capacity (a
        #: long fallocate): never while `_lock` is, so a drain does not wait for it.
        self._open_lock = threading.Lock()
        self._store: Optional[Store] = None
        self._slot = 0
        #: The object sizes the store holds (an exists looks a key up at each).
        self._sizes: Set[int] = set()
        #: Host layouts over LMCache's objects, by (address, bytes), least recently used first.
        self._layouts: "OrderedDict[Tuple[int, int], Layout]" = OrderedDict()
        self._batches: Dict[int, _Batch] = {}
        self._next_id = 1
        self._closed = False
        try:
            settings = engine_settings(engine, buffered)
            self._engine = Engine(device=settings.pop("device", "emulated"), **settings)
            self._fd = self._engine.completion_fd()
            config = self._read_config()
            if config is not None or self._object_bytes:
                self._open(self._object_bytes or config["slot_bytes"], config["sizes"] if config else [])  # type: ignore[index]
        except BaseException:
            self.close()
            raise
        log.info("kvxfer L2 adapter: store %s, %s", self.directory, f"slots of {self._slot} bytes" if self._store else "made on the first object")

    def _claim(self) -> int:
        """Takes `<directory>.owner` (a lock the descriptor holds, with its pid inside),
        or refuses naming the pid that holds it: two LMCache servers on one `root_dir`
        would each want the store."""
        path = self.directory + ".owner"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise Busy(
                f"{self.root_dir} is in use by another kvxfer L2 adapter of this configuration (pid {pid}); "
                "a store has one owner: give each LMCache server its own root_dir",
                13,
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return fd

    def _read_config(self) -> Optional[Dict[str, Any]]:
        try:
            with open(os.path.join(self.directory, CONFIG_FILE)) as f:
                c = json.load(f)
            return {"slot_bytes": int(c["slot_bytes"]), "sizes": [int(n) for n in c["sizes"]]}
        except FileNotFoundError:
            return None
        except (ValueError, KeyError, TypeError) as e:
            log.warning("kvxfer L2 adapter: %s is unreadable (%s); the store is made afresh", os.path.join(self.directory, CONFIG_FILE), e)
            shutil.rmtree(self.directory, ignore_errors=True)
            return None

    def _write_config(self, sizes: Set[int]) -> None:
        """Replaces config.json whole, with `sizes` as the object sizes held: written
        before an object of a new size is, so a restart finds every object stored."""
        path = os.path.join(self.directory, CONFIG_FILE)
        tmp = f"{path}.tmp"
        try:
            with open(tmp, "w") as f:
                json.dump({**self._fields, "slot_bytes": self._slot, "sizes": sorted(sizes)}, f, indent=2, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def _open(self, slot: int, sizes: Sequence[int]) -> None:
        """Opens (or makes) the store of `slot`-byte slots. One made with other settings
        (capacity, shards) is made afresh, with a warning naming what differed."""
        blocks = max(1, self._capacity // slot)
        store = open_or_remake(
            lambda: Store(self._engine, self.directory, chunk_layout(1, slot), capacity_blocks=blocks, namespace=self.namespace, **self._options),
            self.directory,
            "kvxfer L2 adapter",
        )
        self._slot = slot
        # A store made afresh holds no size yet; each `object_bytes` size is always asked for.
        self._sizes = (set(sizes) if store.stats().entries else set()) | self._full_sizes
        self._store = store
        self._write_config(self._sizes)

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
        """Whether each key is held, at any object size the store holds (and at each
        of `object_bytes`, where given)."""
        store, sizes = self._store, sorted(self._sizes)
        held = [False] * len(keys)
        if store is not None and sizes and keys:
            raw = [self._raw(k) for k in keys]
            if self._options["shared"] is None:
                present, _ = store.lookup([part_keys(k, n, self._slot)[0] for k in raw for n in sizes])
                held = [any(present[i * len(sizes) : (i + 1) * len(sizes)]) for i in range(len(keys))]
            else:
                held = self._leading_held(store, raw, sizes)
        return self._finished(_Batch([_answered(h) for h in held], query=True))

    def _leading_held(self, store: Store, raw: List[bytes], sizes: List[int]) -> List[bool]:
        """Which of a prefix's keys a store over a shared tier holds. The shared tier
        answers for the leading keys of a lookup only (a block is held only if those
        before it are), and each size has keys of its own, so each size is looked up
        alone, from the first key not found yet, until no size finds more: full chunks
        then a partial last one are all found. The local store's hits past that are
        exact."""
        held = [False] * len(raw)
        first, grew = 0, True
        while grew and first < len(raw):
            grew = False
            for n in sizes:
                if first == len(raw):
                    break
                present, _ = store.lookup([part_keys(k, n, self._slot)[0] for k in raw[first:]])
                held[first:] = [h or p for h, p in zip(held[first:], present)]
                start = first
                while first < len(raw) and held[first]:
                    first += 1
                grew = grew or first > start
        return held

    def submit_batch_delete(self, keys: Sequence[str]) -> int:
        """Removes each key's parts, at every object size; True where one was held."""
        store, sizes = self._store, sorted(self._sizes)
        removed = [False] * len(keys)
        if store is not None and sizes and keys:
            owners, parts = [], []
            for i, k in enumerate(self._raw(k) for k in keys):
                for n in sizes:
                    ps = part_keys(k, n, self._slot)
                    owners += [i] * len(ps)
                    parts += ps
            for i, err in zip(owners, store.remove(parts)):
                removed[i] = removed[i] or err is None
        return self._finished(_Batch([_answered(r) for r in removed], query=True))

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
        """Waits for the batches in flight, then closes the store and the engine."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            layouts, self._layouts = list(self._layouts.values()), OrderedDict()
        with self._open_lock:
            store, self._store = self._store, None
        if store is not None:
            store.close()
        for layout in layouts:
            layout.close()
        engine = getattr(self, "_engine", None)
        if engine is not None:
            engine.close()
        os.close(self._owner)

    # -- inside -------------------------------------------------------------------
    @staticmethod
    def _raw(key: str) -> bytes:
        return key.encode() if isinstance(key, str) else bytes(key)

    def _submit(self, keys: Sequence[str], views: Sequence[memoryview], load: bool) -> int:
        if len(keys) != len(views):
            raise InvalidArgument(f"{len(keys)} keys but {len(views)} memoryviews; give one object per key")
        moves = []
        for key, view in zip(keys, views):
            try:
                moves.append(self._move(self._raw(key), view, load))
            except (Error, OSError) as e:
                # A full disk or a failed store open fails this object; LMCache serves on.
                moves.append(_answered(False, e))
        batch = _Batch(moves, keys, "get" if load else "set")
        # Listed and looked at under the lock: LMCache's completion thread drains (and
        # releases the requests of) a listed batch that ended, and never while the lock
        # is held, so the batch is whole here.
        with self._lock:
            fid = self._new_id()
            self._batches[fid] = batch
            ended = batch.done()
        # A request that ended before the batch was listed (a get of keys not held ends
        # inside the call) may have had its wake-up drained already: give it another.
        if ended:
            self._signal()
        return fid

    def _move(self, key: bytes, view: memoryview, load: bool) -> _Move:
        """Starts one object's put or get: its whole slots straight from or into its
        memoryview, a shorter last part through a slot-sized buffer."""
        view = memoryview(view)
        if not view.contiguous or view.readonly:
            raise InvalidArgument("an object's memoryview must be contiguous and writable")
        view = view.cast("B")
        size = view.nbytes
        if size == 0:
            raise InvalidArgument("an object of 0 bytes")
        store = self._store_for(size, load)
        if store is None:
            return _answered(False, NotFound("the store does not hold this key (it holds nothing yet)", 18))
        if load and size not in self._sizes:
            return _answered(False, NotFound(f"the store does not hold this key (it holds no object of {size} bytes)", 18))
        slot = self._slot
        keys = part_keys(key, size, slot)
        whole, tail = divmod(size, slot)
        move = _Move()
        try:
            if whole:
                layout = self._layout(view, whole * slot, slot)
                ids = list(range(whole))
                move.requests.append(store.get(keys[:whole], layout, ids, critical=True) if load else store.put(layout, ids, keys[:whole]))
            if tail:
                buf = bytearray(slot)
                if not load:
                    buf[:tail] = view[whole * slot :]
                staging = self._engine.register(_Span(ctypes.addressof(ctypes.c_char.from_buffer(buf)), slot), chunk_layout(1, slot))
                move.staging = (staging, buf, view[whole * slot :] if load else None)
                # The buffer lives as long as the layout over it: the move keeps both.
                move.requests.append(store.get(keys[whole:], staging, [0], critical=True) if load else store.put(staging, [0], keys[whole:]))
        except BaseException:
            move.finish()
            raise
        return move

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

    def _layout(self, view: memoryview, nbytes: int, slot: int) -> Layout:
        """The host layout over the first `nbytes` of `view` (whole slots), registered on
        first use; past `MAX_LAYOUTS` the least recently used one is let go (a request
        still moving through it keeps it until it ends)."""
        addr = ctypes.addressof(ctypes.c_char.from_buffer(view))
        with self._lock:
            if self._closed:
                raise Shutdown("the kvxfer L2 adapter is closed", 12)
            layout = self._layouts.get((addr, nbytes))
            if layout is not None:
                self._layouts.move_to_end((addr, nbytes))
                return layout
            layout = self._engine.register(_Span(addr, nbytes), chunk_layout(nbytes // slot, slot))
            self._layouts[(addr, nbytes)] = layout
            old = self._layouts.popitem(last=False)[1] if len(self._layouts) > MAX_LAYOUTS else None
        if old is not None:
            old.close()
        return layout

    def _store_for(self, size: int, load: bool) -> Optional[Store]:
        """The store: opened at the start where `object_bytes` is given, else made on
        the first object stored with a slot of its size (None before that for a get);
        `size` recorded as a size it holds."""
        store = self._store
        if store is None or (not load and size not in self._sizes):
            with self._open_lock:
                if self._closed:
                    raise Shutdown("the kvxfer L2 adapter is closed", 12)
                if self._store is None:
                    if load:
                        return None
                    self._open(size, [])
                if not load and size not in self._sizes:
                    sizes = self._sizes | {size}
                    self._write_config(sizes)
                    # Replaced, not changed in place: an exists reads it without a lock.
                    self._sizes = sizes
                store = self._store
        return store


__all__: Sequence[str] = ["KvxferConnector", "SUPPORTED_LMCACHE", "check_lmcache_version", "part_keys"]
