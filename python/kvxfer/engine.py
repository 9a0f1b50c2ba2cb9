"""Engine, Layout and Request: the C ABI's handles as Python objects with context
managers; every failed call raises the `kvxfer.Error` subclass of its status. Any
thread may use them, and any thread may close one while others use it: their calls
then raise (`Shutdown` for a closed engine) instead of reaching freed memory."""

from __future__ import annotations

import asyncio
import collections
import ctypes
import functools
import logging
import operator
import os
import threading
import time
from dataclasses import dataclass, fields
from typing import Any, Callable, Dict, Iterable, Optional, Sequence, Tuple, Union

from . import _native as n
from .buffers import Buffer, block_ids, describe
from .errors import Error, InvalidArgument, OutOfRange, RemoteError, Shutdown, Timeout, error_for
from .fdwait import FdWaiters, await_done
from .handles import Handle, enter_callback, in_callback, leave_callback

log = logging.getLogger("kvxfer")

Layers = Union[None, int, Tuple[int, int], range, slice]
OnComplete = Callable[["Request", Optional[Error]], None]

#: The longest single C wait of `Request.wait`: how long a close on another thread may
#: wait for it. Completion still ends the wait at once.
_WAIT_STEP = 0.05


def _check(status: int) -> None:
    if status != n.OK:
        raise error_for(status, n.last_error())



def event_handle(wait_event: Any) -> int:
    """The `CUevent` of `wait_event` (a recorded `torch.cuda.Event`, or a `CUevent` as int)."""
    ev = getattr(wait_event, "cuda_event", wait_event)
    if not isinstance(ev, int) or ev == 0:
        raise InvalidArgument("wait_event must be a recorded torch.cuda.Event or a non-NULL CUevent")
    return ev

@dataclass(frozen=True)
class LayoutConfig:
    """A layout's block geometry, as `kvx_layout_config`: a block holds `num_layers` ×
    `outer_dim` (2 for K and V) × `page_size` tokens × `inner_dim` elements of
    `dtype_bytes` bytes."""

    num_blocks: int
    num_layers: int
    outer_dim: int
    page_size: int
    inner_dim: int
    dtype_bytes: int
    kind: str = "contiguous"

    def _c(self) -> n.LayoutConfigC:
        if self.kind not in n.LAYOUT_KINDS:
            raise InvalidArgument(f"layout kind {self.kind!r}; expected one of {', '.join(n.LAYOUT_KINDS)}")
        c = n.LayoutConfigC()
        n.lib.kvx_layout_config_init(ctypes.byref(c))
        c.kind = n.LAYOUT_KINDS[self.kind]
        for f in ("num_blocks", "num_layers", "outer_dim", "page_size", "inner_dim", "dtype_bytes"):
            v = getattr(self, f)
            if not isinstance(v, int) or v < 0:
                raise InvalidArgument(f"LayoutConfig.{f} = {v!r}; expected a non-negative int")
            setattr(c, f, v)
        return c

    @property
    def block_bytes(self) -> int:
        return self.num_layers * self.outer_dim * self.page_size * self.inner_dim * self.dtype_bytes

    @property
    def bases(self) -> int:
        """Allocations the layout spans: one if contiguous, one per layer otherwise."""
        return 1 if self.kind == "contiguous" else self.num_layers

    @property
    def base_bytes(self) -> int:
        return self.num_blocks * self.block_bytes // self.bases


@dataclass(frozen=True)
class EngineConfig:
    """The settings an engine runs with (`kvx_engine_config_get`): defaults filled in,
    automatic choices resolved."""

    device: int
    io_threads: int
    io_backend: str
    bounce_bytes: int
    slot_bytes: int
    max_inflight: int


@dataclass(frozen=True)
class Stats:
    """An engine's counters (`kvx_stats`)."""

    requests_completed: int
    requests_failed: int
    requests_cancelled: int
    bytes_disk_read: int
    bytes_disk_written: int
    bytes_host_to_device: int
    bytes_device_to_host: int
    disk_read_ns: int
    disk_write_ns: int
    host_copy_ns: int
    device_copy_ns: int
    slot_wait_ns: int
    slots_quarantined: int


# Completion callbacks in flight, by key: the C callback gets the key as user_data.
_callbacks: Dict[int, Tuple["Request", OnComplete]] = {}
_callbacks_lock = threading.Lock()
_next_key = 1


def _trampoline(user_data: int, handle: int, status: int) -> None:
    # All of it counts as the callback, the references it lets go of included: the
    # last one to a request, and through it to its engine, may go here.
    enter_callback()
    try:
        _complete(user_data, handle, status)
    finally:
        leave_callback()


def _complete(user_data: int, handle: int, status: int) -> None:
    with _callbacks_lock:
        entry = _callbacks.pop(user_data or 0, None)
    if entry is None:
        return
    req, fn = entry
    # The callback may run before submit has returned: the request takes its handle
    # from here then, since the callback uses it (done(), wait(), release()).
    req._gate.adopt(handle)
    req._ended(status)
    try:
        err = None
        if status != n.OK:
            m = n.lib.kvx_request_error(handle)
            err = error_for(status, m.decode("utf-8", "replace") if m else "")
        fn(req, err)
    except BaseException:  # a callback must not unwind into kvxfer's thread
        log.exception("kvxfer: a completion callback raised")


_TRAMPOLINE = n.COMPLETION_FN(_trampoline)


class _Unfinished:
    """Requests released before they were seen to end, each with the layouts it uses: a
    transfer needs its layouts' memory (a registered array) until it ends, though its
    Request may go first. Looked at oldest first on each submit, and all dropped once
    the engine is destroyed, which waits for every request of it. Also the layouts of
    requests that ended with `RemoteError`, until then: a remote transfer that timed
    out cannot be stopped, so the peer may still write their memory."""

    def __init__(self) -> None:
        # Reentrant: a collection during a sweep may release another request here.
        self._lock = threading.RLock()
        self._queue: "collections.deque[Tuple[Handle, Tuple[Layout, Layout]]]" = collections.deque()
        self._remote_failed: "list[Tuple[Layout, Layout]]" = []
        self._engine_destroyed = False

    def add(self, gate: Handle, keep: Tuple["Layout", "Layout"]) -> bool:
        """False once the engine is destroyed: the request has ended then."""
        with self._lock:
            if self._engine_destroyed:
                return False
            self._queue.append((gate, keep))
            return True

    def keep_until_destroyed(self, keep: Tuple["Layout", "Layout"]) -> None:
        """Keeps the layouts of a request that ended with `RemoteError` until the engine
        is destroyed (at once dropped if it is)."""
        with self._lock:
            if not self._engine_destroyed:
                self._remote_failed.append(keep)

    def sweep(self) -> None:
        """Releases those that ended, up to the oldest one still running. The caller
        holds the engine's handle."""
        # Taken off under the lock, released and dropped outside it: releasing and
        # dropping may finalize objects, whose own release must not wait for this lock
        # while another thread holding what they need waits for it too.
        ended = []
        with self._lock:
            while self._queue:
                gate, _ = self._queue[0]
                with gate as h:
                    status = n.lib.kvx_request_poll(h)
                if status == n.PENDING:
                    break
                ended.append(self._queue.popleft())
                if status == RemoteError.status:
                    self._remote_failed.append(ended[-1][1])
        for gate, _ in ended:
            gate.close_deferred()

    def engine_destroyed(self) -> None:
        with self._lock:
            self._engine_destroyed = True
            ended, self._queue = self._queue, collections.deque()
            remote_failed, self._remote_failed = self._remote_failed, []
        for gate, _ in ended:
            gate.close_deferred()
        # The layouts go here, outside the lock.
        del ended, remote_failed


def _destroy_engine(unfinished: _Unfinished, h: int) -> None:
    n.lib.kvx_engine_destroy(h)
    # Off the engine's own threads (see Engine.close) the destroy returns once every
    # request has ended, so the layouts they kept may go now; those of requests that
    # ended with RemoteError too, since no peer writes through a destroyed engine.
    unfinished.engine_destroyed()


def _destroy_layout(h: int) -> None:
    n.lib.kvx_layout_destroy(h)


def _release_request(h: int) -> None:
    n.lib.kvx_request_release(h)


def _engine_closed() -> Error:
    return Shutdown("the engine is closed", 12)


def _layout_closed() -> Error:
    return InvalidArgument("the layout is closed", 2)


def _request_released() -> Error:
    return InvalidArgument("the request is released", 2)


#: The handle of every released request: closed, nothing to free.
_RELEASED = Handle(None, _release_request, _request_released)
_RELEASED.shut()
#: Serialises the swap of a request's fields in `Request.release`, which hands a running
#: request's handle on; reentrant, since a collection inside it may release another
#: request. Held for nothing that takes another lock.
_releasing = threading.RLock()


class _Owned:
    """A C handle owned by this object (`handles.Handle`): freed once, by close(),
    `with` or collection, and never while another thread's call uses it."""

    _gate: Handle

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self):  # type: ignore[no-untyped-def]
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


class Engine(_Owned):
    """A kvxfer engine on a device: `"auto"` (GPU 0 if there is one, else emulated),
    `"emulated"`, or a CUDA ordinal. Keyword settings as `kvx_engine_config`:
    `io_threads`, `io_backend` (`"auto"`, `"posix"`, `"uring"`, `"nixl"`, `"gds"`),
    `bounce_bytes`, `slot_bytes`, `max_inflight`; 0 means the default."""

    def __init__(self, device: Union[str, int] = "auto", **config: Any):
        c = n.EngineConfigC()
        n.lib.kvx_engine_config_init(ctypes.byref(c))
        if device == "auto":
            c.device = n.DEVICE_AUTO
        elif device == "emulated":
            c.device = n.DEVICE_EMULATED
        elif isinstance(device, int) and not isinstance(device, bool) and device >= 0:
            c.device = device
        else:
            raise InvalidArgument(f"device={device!r}; expected 'auto', 'emulated' or a CUDA ordinal")
        for key, value in config.items():
            if key == "io_backend":
                if value not in n.IO_BACKENDS:
                    raise InvalidArgument(f"io_backend={value!r}; expected one of {', '.join(n.IO_BACKENDS)}")
                c.io_backend = n.IO_BACKENDS[value]
            elif key in ("io_threads", "bounce_bytes", "slot_bytes", "max_inflight"):
                if not isinstance(value, int) or value < 0:
                    raise InvalidArgument(f"{key}={value!r}; expected a non-negative int")
                setattr(c, key, value)
            else:
                raise InvalidArgument(f"unknown engine setting {key!r}; known: io_threads, io_backend, bounce_bytes, slot_bytes, max_inflight")
        h = ctypes.c_void_p()
        _check(n.lib.kvx_engine_create(ctypes.byref(c), ctypes.byref(h)))
        self._unfinished = _Unfinished()
        #: Held by every call on the engine and on its layouts and requests: the C
        #: contract allows none of them once the engine is destroyed.
        self._gate = Handle(h.value, functools.partial(_destroy_engine, self._unfinished), _engine_closed)
        #: Coroutines awaiting this engine's requests, woken by its completion fd.
        self._fd_waiters = FdWaiters(self.completion_fd)

    # -- lifetime ---------------------------------------------------------------
    def close(self) -> None:
        """Cancels requests not started, waits for the others and frees the engine.
        Calls that other threads are making through it (or its layouts and requests)
        return first; from then on they raise `Shutdown`. Idempotent, and safe from
        any thread. From a completion callback it returns at once (the destroy waits
        for kvxfer's threads, the callback's among them): calls raise `Shutdown` from
        then on, and a thread of the binding frees the engine."""
        if hasattr(self, "_fd_waiters"):
            self._fd_waiters.engine_closing()
        if not in_callback():
            self._gate.close()
        elif self._gate.shut():
            threading.Thread(target=self._gate.close, name="kvxfer-engine-close").start()

    # -- facts ------------------------------------------------------------------
    @property
    def device(self) -> int:
        """The CUDA ordinal the engine drives, or -1 for the emulated device."""
        d = ctypes.c_int32()
        with self._gate as h:
            _check(n.lib.kvx_engine_device(h, ctypes.byref(d)))
        return d.value

    def config(self) -> EngineConfig:
        c = n.EngineConfigC()
        c.struct_size = ctypes.sizeof(c)
        with self._gate as h:
            _check(n.lib.kvx_engine_config_get(h, ctypes.byref(c)))
        backend = {v: k for k, v in n.IO_BACKENDS.items()}.get(c.io_backend, str(c.io_backend))
        return EngineConfig(c.device, c.io_threads, backend, c.bounce_bytes, c.slot_bytes, c.max_inflight)

    def completion_fd(self) -> int:
        """The engine's completion fd (ABI 1.5): an eventfd, readable once a request of
        the engine (a transfer, a store request) has ended since it was last read. Read
        8 bytes to reset it, then poll the requests (`done()`); a request that ends after
        the read makes it readable again. The first call makes it (ends before it are not
        counted). The engine owns it and closes it on `close()`: do not close it, and take
        it off your selector first. `await request` uses it."""
        n.need_minor(5, "the completion fd")
        fd = ctypes.c_int32()
        with self._gate as h:
            _check(n.lib.kvx_engine_completion_fd(h, ctypes.byref(fd)))
        return fd.value

    def stats(self) -> Stats:
        s = n.StatsC()
        s.struct_size = ctypes.sizeof(s)
        with self._gate as h:
            _check(n.lib.kvx_engine_stats(h, ctypes.byref(s)))
        return Stats(*(getattr(s, f.name) for f in fields(Stats)))

    # -- layouts ----------------------------------------------------------------
    def _layout(self, make: Callable[[int, ctypes.c_void_p], int], config: LayoutConfig, keep: Tuple[Any, ...] = ()) -> "Layout":
        out = ctypes.c_void_p()
        with self._gate as h:
            _check(make(h, out))
        return Layout(self, out.value, config, keep)

    def device_layout(self, config: LayoutConfig) -> "Layout":
        """Device memory kvxfer allocates and frees."""
        c = config._c()
        return self._layout(lambda h, out: n.lib.kvx_layout_create_device(h, ctypes.byref(c), ctypes.byref(out)), config)

    def host_layout(self, config: LayoutConfig, pinned: bool = True) -> "Layout":
        """Host memory kvxfer allocates (page-locked unless `pinned=False`)."""
        c = config._c()
        flags = n.HOST_PINNED if pinned else 0
        return self._layout(lambda h, out: n.lib.kvx_layout_create_host(h, ctypes.byref(c), flags, ctypes.byref(out)), config)

    def disk_layout(
        self,
        config: LayoutConfig,
        path: Union[str, "os.PathLike[str]"],
        create: bool = True,
        checksum: bool = False,
        keep: bool = False,
        buffered: bool = False,
        sync: bool = False,
        mapped: bool = False,
    ) -> "Layout":
        """A layout in the file at `path`, always contiguous (`config.kind` is ignored).
        `create` makes the file (a file already at `path` is replaced, or truncated in
        place where it cannot be: docs/storage.md) and removes it when the last request
        using it ends, unless `keep`."""
        c = config._c()
        flags = (
            (n.DISK_CREATE if create else 0)
            | (n.DISK_KEEP if keep else 0)
            | (n.DISK_BUFFERED if buffered else 0)
            | (n.DISK_SYNC if sync else 0)
            | (n.DISK_CHECKSUM if checksum else 0)
            | (n.DISK_MAPPED if mapped else 0)
        )
        p = os.fsencode(path)
        return self._layout(lambda h, out: n.lib.kvx_layout_create_disk(h, ctypes.byref(c), p, flags, ctypes.byref(out)), config)

    def register(self, arrays: Union[Any, Sequence[Any]], config: LayoutConfig) -> "Layout":
        """A layout over the caller's memory: one array for a contiguous layout, one per
        layer otherwise (vLLM's per-layer `[2, num_blocks, block_size, heads, head_dim]`
        list). CUDA tensors become a device layout (on this engine's device), host
        arrays and CPU tensors a host layout (pinned when the tensors are). Each array
        is checked: contiguous, element size `dtype_bytes`, at least the layout's bytes
        per allocation. The layout keeps the arrays alive, and a request keeps its
        layouts until it ends, so an array stays while a transfer uses it even when the
        caller has dropped both the array and the layout."""
        items = list(arrays) if isinstance(arrays, (list, tuple)) else [arrays]
        if len(items) != config.bases:
            raise InvalidArgument(
                f"a {config.kind} layout spans {config.bases} allocation(s) (one per layer unless contiguous); got {len(items)} array(s)"
            )
        bufs = [describe(a, f"array {i}") for i, a in enumerate(items)]
        for b in bufs:
            if b.itemsize != config.dtype_bytes:
                raise InvalidArgument(f"{b.what} has {b.itemsize}-byte elements but dtype_bytes is {config.dtype_bytes}")
            if b.nbytes < config.base_bytes:
                raise InvalidArgument(f"{b.what} is {b.nbytes} bytes; the layout needs {config.base_bytes} per allocation")
        on_device = {b.device is not None for b in bufs}
        if len(on_device) != 1:
            raise InvalidArgument("the arrays mix device and host memory; a layout is one or the other")
        c = config._c()
        if bufs[0].device is not None:
            mine = self.device
            wrong = [b for b in bufs if b.device != mine]
            if wrong:
                raise InvalidArgument(f"{wrong[0].what} is on CUDA device {wrong[0].device}, but this engine drives {mine if mine >= 0 else 'the emulated device'}")
            bases = (ctypes.c_uint64 * len(bufs))(*(b.addr for b in bufs))
            return self._layout(
                lambda h, out: n.lib.kvx_layout_register_device(h, ctypes.byref(c), bases, len(bufs), ctypes.byref(out)),
                config,
                tuple(items),
            )
        pinned = all(b.pinned for b in bufs)
        hb = (ctypes.c_void_p * len(bufs))(*(b.addr for b in bufs))
        flags = n.HOST_PINNED if pinned else 0
        return self._layout(
            lambda h, out: n.lib.kvx_layout_register_host(h, ctypes.byref(c), hb, len(bufs), flags, ctypes.byref(out)),
            config,
            tuple(items),
        )

    # -- transfers --------------------------------------------------------------
    def submit(
        self,
        src: "Layout",
        src_ids: Any,
        dst: "Layout",
        dst_ids: Any,
        layers: Layers = None,
        on_complete: Optional[OnComplete] = None,
        wait_event: Any = None,
        critical: bool = False,
    ) -> "Request":
        """Moves blocks `src_ids[i]` of `src` to `dst_ids[i]` of `dst`, asynchronously.
        `layers`: all (None), one layer, a `(begin, end)` pair, a range or a slice; an
        empty range or a negative layer is `InvalidArgument` (a slice's negative bounds
        count from the end, as in Python).
        `on_complete(request, error_or_None)` runs once on a kvxfer thread when it ends.
        `wait_event`: a `torch.cuda.Event` (or a `CUevent` as int) the copies wait for.
        `critical`: latency-critical (a request waits for these blocks, e.g. an onboard
        before its first token): served ahead of transfers without it at every stage
        they share, while those keep one turn in four (`KVX_XFER_CRITICAL`)."""
        sp, sn, sk = block_ids(src_ids, "src_ids")
        dp, dn, dk = block_ids(dst_ids, "dst_ids")
        if sn != dn:
            raise InvalidArgument(f"{sn} source ids but {dn} destination ids")
        o = n.TransferOptionsC()
        n.lib.kvx_transfer_options_init(ctypes.byref(o))
        o.layer_begin, o.layer_end = _layer_range(layers, src.config.num_layers)
        if critical:
            o.flags |= n.XFER_CRITICAL
        if wait_event is not None:
            o.wait_event = event_handle(wait_event)
        req = Request(self)
        # Submitted from a coroutine: completion is handed to that event loop through
        # call_soon_threadsafe, so `await request` needs no thread of its own.
        try:
            loop: Optional[asyncio.AbstractEventLoop] = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is not None:
            req._future = loop.create_future()
            user = on_complete

            def on_complete(r: "Request", err: Optional[Error], _loop=loop, _fut=req._future, _user=user) -> None:
                # Settled even when the caller's callback raises, or `await request`
                # would never return; the raise is logged first, so whoever awaits the
                # request finds the log already written.
                try:
                    if _user is not None:
                        _user(r, err)
                except BaseException:
                    log.exception("kvxfer: a completion callback raised")
                _loop.call_soon_threadsafe(_settle, _fut, err)

        # Closed handles raise here, before a callback is registered that would never run.
        with self._gate as eh, src._gate as sh, dst._gate as dh:
            self._unfinished.sweep()
            key = 0
            if on_complete is not None:
                global _next_key
                with _callbacks_lock:
                    key, _next_key = _next_key, _next_key + 1
                    _callbacks[key] = (req, on_complete)
                o.on_complete, o.user_data = _TRAMPOLINE, key
            out = ctypes.c_void_p()
            # Before the call: the callback may run (and let go of them) before it returns.
            req._keep = (src, dst)
            st = n.lib.kvx_transfer_submit(eh, sh, sp, dh, dp, sn, ctypes.byref(o), ctypes.byref(out))
            if st != n.OK:
                req._keep = None
                with _callbacks_lock:
                    _callbacks.pop(key, None)
                raise error_for(st, n.last_error())
        req._gate.adopt(out.value)
        return req


def _layer_range(layers: Layers, num_layers: int) -> Tuple[int, int]:
    """`[begin, end)` for the C options; (0, 0) only for None, since the C side reads
    `layer_end` 0 as every layer. An empty range or a negative layer would reach C as
    "every layer" or wrap in the uint32 fields, so both are refused here."""
    if layers is None:
        return 0, 0
    if isinstance(layers, bool):
        raise InvalidArgument(f"layers={layers!r}; expected None, an int, (begin, end), a range or a slice")
    if isinstance(layers, int):
        begin, end = layers, layers + 1
    elif isinstance(layers, range):
        if layers.step != 1:
            raise InvalidArgument("layers must be consecutive (step 1)")
        begin, end = layers.start, layers.stop
    elif isinstance(layers, slice):
        # Python's meaning: negative bounds count from the last layer.
        begin, end, step = layers.indices(num_layers)
        if step != 1:
            raise InvalidArgument("layers must be consecutive (step 1)")
    elif isinstance(layers, tuple) and len(layers) == 2:
        try:
            begin, end = operator.index(layers[0]), operator.index(layers[1])
        except TypeError:
            raise InvalidArgument(f"layers={layers!r}; (begin, end) must be two ints") from None
    else:
        raise InvalidArgument(f"layers={layers!r}; expected None, an int, (begin, end), a range or a slice")
    if begin < 0 or end < 0:
        raise InvalidArgument(f"layers={layers!r} has a negative layer; layers count from 0 (a slice may count from the end)")
    if end > num_layers:
        raise OutOfRange(f"layer_end {end} is past the layout's {num_layers} layers", 3)
    if begin >= end:
        raise InvalidArgument(f"layers={layers!r} is empty (layer range [{begin}, {end})); a transfer moves at least one layer")
    return begin, end


def _settle(fut: "asyncio.Future[None]", err: Optional[Error]) -> None:
    if not fut.done():
        fut.set_exception(err) if err is not None else fut.set_result(None)


class Layout(_Owned):
    """Block geometry plus the memory or file holding it. `close()` (or the context
    manager) drops it; requests using it keep it (and the arrays it was registered
    over) alive until they end."""

    def __init__(self, engine: Engine, handle: int, config: LayoutConfig, keep: Tuple[Any, ...] = ()):
        self.engine = engine
        self.config = config
        self._gate = Handle(handle, _destroy_layout, _layout_closed)
        self._keep = keep

    @property
    def block_bytes(self) -> int:
        v = ctypes.c_uint64()
        with self._gate as h, self.engine._gate:
            _check(n.lib.kvx_layout_block_bytes(h, ctypes.byref(v)))
        return v.value

    def base(self, layer: int = 0) -> int:
        """The address of one allocation (layer 0 for a contiguous layout)."""
        v = ctypes.c_uint64()
        with self._gate as h, self.engine._gate:
            _check(n.lib.kvx_layout_base(h, layer, ctypes.byref(v)))
        return v.value

    def close(self) -> None:
        """Drops the caller's reference; requests using the layout keep it until they
        end. Safe from any thread: a call another thread is making with the layout
        returns first, and later ones raise `InvalidArgument`."""
        self._gate.close_deferred()


class Request(_Owned):
    """A submitted transfer. `wait()` raises the failure. `await request` works in
    asyncio: a request submitted inside a running loop is settled on that loop from
    kvxfer's thread (`call_soon_threadsafe`); one submitted elsewhere is woken by the
    engine's completion fd (`Engine.completion_fd`). It keeps its source and destination layouts alive until it
    ends, also once released or collected (the engine holds them until then)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        #: The handle comes from submit or from the request's own callback, whichever
        #: comes first; once released it is never taken again.
        self._gate = Handle(None, _release_request, _request_released)
        #: The layouts the transfer uses (and so the arrays behind them), until it is
        #: seen to end: wait, done, its callback, or the engine's `_Unfinished`.
        self._keep: Optional[Tuple[Layout, Layout]] = None
        #: Set when submitted inside a running event loop: settled on that loop.
        self._future: "Optional[asyncio.Future[None]]" = None

    def wait(self, timeout: Optional[float] = None) -> None:
        """Waits up to `timeout` seconds (None: forever); raises `kvxfer.Timeout` if it
        is still running, or the request's failure."""
        # In steps, each a C call of its own, so that closing the engine or releasing
        # the request from another thread waits at most one step for this call.
        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        while True:
            left = _WAIT_STEP if deadline is None else max(0.0, deadline - time.monotonic())
            with self.engine._gate, self._gate as h:
                st = n.lib.kvx_request_wait(h, int(min(left, _WAIT_STEP) * 1e9))
                if st == n.OK:
                    self._ended(st)
                    return
                why = n.last_error()
                # The final status, or PENDING: the wait's status may be its own, such
                # as KVX_ERR_TIMEOUT for a step, or a wait refused inside a callback.
                final = n.lib.kvx_request_poll(h)
                if final != n.PENDING:
                    self._ended(final)
                if st == final:
                    m = n.lib.kvx_request_error(h)
                    raise error_for(st, m.decode("utf-8", "replace") if m else why)
                if st != 10:
                    raise error_for(st, why)
            if deadline is not None and left <= _WAIT_STEP:
                raise Timeout(f"the request did not complete within {timeout} s", 10)

    def done(self) -> bool:
        """Whether it ended (successfully or not); never raises for a failed request."""
        with self.engine._gate, self._gate as h:
            status = n.lib.kvx_request_poll(h)
        if status == n.PENDING:
            return False
        self._ended(status)
        return True

    def cancel(self) -> None:
        """Skips what has not started; `wait()` then raises `kvxfer.Cancelled`."""
        with self.engine._gate, self._gate as h:
            _check(n.lib.kvx_request_cancel(h))

    def __await__(self):
        if self._future is not None and self._future.get_loop() is asyncio.get_running_loop():
            return self._future.__await__()
        # Submitted outside this loop: woken by the engine's completion fd.
        return await_done(
            self.engine._fd_waiters, self.done, lambda: self.wait(0), lambda: asyncio.get_running_loop().run_in_executor(None, self.wait)
        )

    def release(self) -> None:
        """Drops the handle; a running transfer still completes. Safe from any thread
        (a call another thread is making on the request returns first, later ones raise
        `InvalidArgument`) and from its own completion callback, also before `submit`
        has returned."""
        # Only the fields are swapped under the lock, and the engine is told outside it:
        # a thread sweeping the engine's released requests holds the engine's lock, and
        # a collection there may release a request, which takes this one.
        with _releasing:
            gate, keep, self._keep = self._gate, self._keep, None
            if keep is not None:
                self._gate = _RELEASED
        # Not seen to end: the engine keeps the handle and the layouts until it has.
        if keep is not None and self.engine._unfinished.add(gate, keep):
            return
        # The shared handle of released requests has nothing to free.
        if gate is not _RELEASED:
            gate.close_deferred()

    def _ended(self, status: int) -> None:
        """Seen to end with `status`: the layouts may go, unless a remote transfer may
        still write them."""
        keep, self._keep = self._keep, None
        if keep is not None and status == RemoteError.status:
            self.engine._unfinished.keep_until_destroyed(keep)

    close = release
