"""Engine, Layout and Request: the C ABI's handles as Python objects with context
managers; every failed call raises the `kvxfer.Error` subclass of its status."""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import threading
from dataclasses import dataclass, fields
from typing import Any, Callable, Dict, Iterable, Optional, Sequence, Tuple, Union

from . import _native as n
from .buffers import Buffer, block_ids, describe
from .errors import Error, InvalidArgument, Shutdown, Timeout, error_for

log = logging.getLogger("kvxfer")

Layers = Union[None, int, Tuple[int, int], range, slice]
OnComplete = Callable[["Request", Optional[Error]], None]


def _check(status: int) -> None:
    if status != n.OK:
        raise error_for(status, n.last_error())


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
    with _callbacks_lock:
        entry = _callbacks.pop(user_data or 0, None)
    if entry is None:
        return
    req, fn = entry
    # The callback may run before submit has returned and set the handle; the callback
    # uses the request (done(), wait()) through it.
    if req._h is None and req._submitting:
        req._h = handle
    try:
        err = None
        if status != n.OK:
            m = n.lib.kvx_request_error(handle)
            err = error_for(status, m.decode("utf-8", "replace") if m else "")
        fn(req, err)
    except BaseException:  # a callback must not unwind into kvxfer's thread
        log.exception("kvxfer: a completion callback raised")


_TRAMPOLINE = n.COMPLETION_FN(_trampoline)


class _Owned:
    """A C handle owned by this object: dropped once, by close(), `with` or collection."""

    _h: Optional[int]

    def _drop(self, free: Callable[[int], None]) -> None:
        h, self._h = self._h, None
        if h:
            free(h)

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
        self._h: Optional[int] = h.value
        self._lock = threading.Lock()

    # -- lifetime ---------------------------------------------------------------
    def close(self) -> None:
        """Cancels requests not started, waits for the others and frees the engine.
        Layouts and requests of it raise `Shutdown` afterwards. Idempotent."""
        with self._lock:
            self._drop(n.lib.kvx_engine_destroy)

    def _handle(self) -> int:
        h = self._h
        if not h:
            raise Shutdown("the engine is closed", 12)
        return h

    # -- facts ------------------------------------------------------------------
    @property
    def device(self) -> int:
        """The CUDA ordinal the engine drives, or -1 for the emulated device."""
        d = ctypes.c_int32()
        _check(n.lib.kvx_engine_device(self._handle(), ctypes.byref(d)))
        return d.value

    def config(self) -> EngineConfig:
        c = n.EngineConfigC()
        c.struct_size = ctypes.sizeof(c)
        _check(n.lib.kvx_engine_config_get(self._handle(), ctypes.byref(c)))
        backend = {v: k for k, v in n.IO_BACKENDS.items()}.get(c.io_backend, str(c.io_backend))
        return EngineConfig(c.device, c.io_threads, backend, c.bounce_bytes, c.slot_bytes, c.max_inflight)

    def stats(self) -> Stats:
        s = n.StatsC()
        s.struct_size = ctypes.sizeof(s)
        _check(n.lib.kvx_engine_stats(self._handle(), ctypes.byref(s)))
        return Stats(*(getattr(s, f.name) for f in fields(Stats)))

    # -- layouts ----------------------------------------------------------------
    def _layout(self, make: Callable[[ctypes.c_void_p], int], config: LayoutConfig, keep: Tuple[Any, ...] = ()) -> "Layout":
        out = ctypes.c_void_p()
        _check(make(out))
        return Layout(self, out.value, config, keep)

    def device_layout(self, config: LayoutConfig) -> "Layout":
        """Device memory kvxfer allocates and frees."""
        c = config._c()
        return self._layout(lambda out: n.lib.kvx_layout_create_device(self._handle(), ctypes.byref(c), ctypes.byref(out)), config)

    def host_layout(self, config: LayoutConfig, pinned: bool = True) -> "Layout":
        """Host memory kvxfer allocates (page-locked unless `pinned=False`)."""
        c = config._c()
        flags = n.HOST_PINNED if pinned else 0
        return self._layout(lambda out: n.lib.kvx_layout_create_host(self._handle(), ctypes.byref(c), flags, ctypes.byref(out)), config)

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
        `create` makes (truncates) the file and removes it on close unless `keep`."""
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
        return self._layout(lambda out: n.lib.kvx_layout_create_disk(self._handle(), ctypes.byref(c), p, flags, ctypes.byref(out)), config)

    def register(self, arrays: Union[Any, Sequence[Any]], config: LayoutConfig) -> "Layout":
        """A layout over the caller's memory: one array for a contiguous layout, one per
        layer otherwise (vLLM's per-layer `[2, num_blocks, block_size, heads, head_dim]`
        list). CUDA tensors become a device layout (on this engine's device), host
        arrays and CPU tensors a host layout (pinned when the tensors are). Each array
        is checked: contiguous, element size `dtype_bytes`, at least the layout's bytes
        per allocation. The arrays are kept alive as long as the layout."""
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
                lambda out: n.lib.kvx_layout_register_device(self._handle(), ctypes.byref(c), bases, len(bufs), ctypes.byref(out)),
                config,
                tuple(items),
            )
        pinned = all(b.pinned for b in bufs)
        hb = (ctypes.c_void_p * len(bufs))(*(b.addr for b in bufs))
        flags = n.HOST_PINNED if pinned else 0
        return self._layout(
            lambda out: n.lib.kvx_layout_register_host(self._handle(), ctypes.byref(c), hb, len(bufs), flags, ctypes.byref(out)),
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
    ) -> "Request":
        """Moves blocks `src_ids[i]` of `src` to `dst_ids[i]` of `dst`, asynchronously.
        `layers`: all (None), one layer, a `(begin, end)` pair, a range or a slice.
        `on_complete(request, error_or_None)` runs once on a kvxfer thread when it ends.
        `wait_event`: a `torch.cuda.Event` (or a `CUevent` as int) the copies wait for."""
        sp, sn, sk = block_ids(src_ids, "src_ids")
        dp, dn, dk = block_ids(dst_ids, "dst_ids")
        if sn != dn:
            raise InvalidArgument(f"{sn} source ids but {dn} destination ids")
        o = n.TransferOptionsC()
        n.lib.kvx_transfer_options_init(ctypes.byref(o))
        o.layer_begin, o.layer_end = _layer_range(layers, src.config.num_layers)
        if wait_event is not None:
            ev = getattr(wait_event, "cuda_event", wait_event)
            if not isinstance(ev, int) or ev == 0:
                raise InvalidArgument("wait_event must be a recorded torch.cuda.Event or a non-NULL CUevent")
            o.wait_event = ev
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
                if _user is not None:
                    _user(r, err)
                _loop.call_soon_threadsafe(_settle, _fut, err)

        # Closed handles raise here, before a callback is registered that would never run.
        eh, sh, dh = self._handle(), src._handle(), dst._handle()
        key = 0
        if on_complete is not None:
            global _next_key
            with _callbacks_lock:
                key, _next_key = _next_key, _next_key + 1
                _callbacks[key] = (req, on_complete)
            o.on_complete, o.user_data = _TRAMPOLINE, key
        out = ctypes.c_void_p()
        req._submitting = True
        st = n.lib.kvx_transfer_submit(eh, sh, sp, dh, dp, sn, ctypes.byref(o), ctypes.byref(out))
        req._submitting = False
        if st != n.OK:
            with _callbacks_lock:
                _callbacks.pop(key, None)
            raise error_for(st, n.last_error())
        req._h = out.value
        return req


def _layer_range(layers: Layers, num_layers: int) -> Tuple[int, int]:
    if layers is None:
        return 0, 0
    if isinstance(layers, int) and not isinstance(layers, bool):
        return layers, layers + 1
    if isinstance(layers, range):
        if layers.step != 1:
            raise InvalidArgument("layers must be consecutive (step 1)")
        return layers.start, layers.stop
    if isinstance(layers, slice):
        start, stop, step = layers.indices(num_layers)
        if step != 1:
            raise InvalidArgument("layers must be consecutive (step 1)")
        return start, stop
    if isinstance(layers, tuple) and len(layers) == 2:
        return int(layers[0]), int(layers[1])
    raise InvalidArgument(f"layers={layers!r}; expected None, an int, (begin, end), a range or a slice")


def _settle(fut: "asyncio.Future[None]", err: Optional[Error]) -> None:
    if not fut.done():
        fut.set_exception(err) if err is not None else fut.set_result(None)


class Layout(_Owned):
    """Block geometry plus the memory or file holding it. `close()` (or the context
    manager) drops it; requests using it keep it alive until they end."""

    def __init__(self, engine: Engine, handle: int, config: LayoutConfig, keep: Tuple[Any, ...] = ()):
        self.engine = engine
        self.config = config
        self._h: Optional[int] = handle
        self._keep = keep

    def _handle(self) -> int:
        if not self._h:
            raise InvalidArgument("the layout is closed", 2)
        self.engine._handle()
        return self._h

    @property
    def block_bytes(self) -> int:
        v = ctypes.c_uint64()
        _check(n.lib.kvx_layout_block_bytes(self._handle(), ctypes.byref(v)))
        return v.value

    def base(self, layer: int = 0) -> int:
        """The address of one allocation (layer 0 for a contiguous layout)."""
        v = ctypes.c_uint64()
        _check(n.lib.kvx_layout_base(self._handle(), layer, ctypes.byref(v)))
        return v.value

    def close(self) -> None:
        """Drops the caller's reference; requests using the layout keep it until they end."""
        self._drop(n.lib.kvx_layout_destroy)


class Request(_Owned):
    """A submitted transfer. `wait()` raises the failure. `await request` works in
    asyncio: a request submitted inside a running loop is settled on that loop from
    kvxfer's thread (`call_soon_threadsafe`); one submitted elsewhere is waited for on
    the loop's executor."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._h: Optional[int] = None
        #: Inside `kvx_transfer_submit`: a callback that runs before it returned sets `_h`.
        self._submitting = False
        #: Set when submitted inside a running event loop: settled on that loop.
        self._future: "Optional[asyncio.Future[None]]" = None

    def _handle(self) -> int:
        self.engine._handle()
        if not self._h:
            raise InvalidArgument("the request is released", 2)
        return self._h

    def _message(self) -> str:
        m = n.lib.kvx_request_error(self._h) if self._h else b""
        return m.decode("utf-8", "replace") if m else ""

    def wait(self, timeout: Optional[float] = None) -> None:
        """Waits up to `timeout` seconds (None: forever); raises `kvxfer.Timeout` if it
        is still running, or the request's failure."""
        ns = 2**64 - 1 if timeout is None else max(0, int(timeout * 1e9))
        st = n.lib.kvx_request_wait(self._handle(), ns)
        if st == n.OK:
            return
        if st == 10:
            raise Timeout(n.last_error() or f"the request did not complete within {timeout} s", 10)
        raise error_for(st, self._message() or n.last_error())

    def done(self) -> bool:
        """Whether it ended (successfully or not); never raises for a failed request."""
        return n.lib.kvx_request_poll(self._handle()) != n.PENDING

    def cancel(self) -> None:
        """Skips what has not started; `wait()` then raises `kvxfer.Cancelled`."""
        _check(n.lib.kvx_request_cancel(self._handle()))

    def __await__(self):
        if self._future is not None and self._future.get_loop() is asyncio.get_running_loop():
            return self._future.__await__()
        # Submitted outside this loop: wait on the loop's executor instead.
        return asyncio.get_running_loop().run_in_executor(None, self.wait).__await__()

    def release(self) -> None:
        """Drops the handle; a running transfer still completes."""
        self._drop(n.lib.kvx_request_release)

    close = release
