"""C handles that threads share and any of them may close.

A call holds its handle for the length of its C call (`with handle as h:`): ctypes lets
go of the GIL meanwhile, so another thread may close the object then. Closing refuses
new calls at once (they raise the handle's closed error) and frees the C object only
once no call holds it, because the C side must never free what a call is using:
`close()` waits for the calls in progress and frees on the closing thread,
`close_deferred()` returns at once and the last call to return frees it (for a closer
that must not block, such as a completion callback, or one that runs inside a call).
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional

from .errors import Error

_local = threading.local()


def in_callback() -> bool:
    """Whether this thread is running a completion callback (of any engine)."""
    return getattr(_local, "callbacks", 0) > 0


def enter_callback() -> None:
    """Marks this thread as running a completion callback until `leave_callback`."""
    _local.callbacks = getattr(_local, "callbacks", 0) + 1


def leave_callback() -> None:
    _local.callbacks -= 1


class Handle:
    """One C handle, the function that frees it, and the calls holding it."""

    __slots__ = (
        "_h", "_free", "_closed", "_lock", "_users", "_closing", "_claimed", "_free_on_leave", "_idle", "_freed",
        "_on_freed", "_adopted",
    )

    def __init__(self, h: Optional[int], free: Callable[[int], None], closed: Callable[[], Error]):
        self._h = h
        self._free = free
        #: The exception a call gets once the handle is closed.
        self._closed = closed
        # A plain lock: calls only count themselves in and out, and a closer that has
        # to wait gets an Event, made then.
        self._lock = threading.Lock()
        self._users = 0
        #: Closed for new calls.
        self._closing = False
        #: A closer took on the free (it waits for the calls, or the last call frees).
        self._claimed = False
        self._free_on_leave = False
        #: Set by the last call to return, for a closer that waits for it.
        self._idle: Optional[threading.Event] = None
        #: The free has returned (or there was nothing to free).
        self._freed = False
        #: Set then, for closers that wait for another one's free.
        self._on_freed: Optional[threading.Event] = None
        self._adopted = h is not None

    def adopt(self, h: int) -> None:
        """Takes a handle that comes after the object was made (a request's, from submit
        or from its own callback, whichever comes first). Later ones are the same pointer
        and are ignored, as is one that comes after a close."""
        with self._lock:
            if not self._adopted and not self._closing:
                self._adopted = True
                self._h = h

    def __enter__(self) -> int:
        with self._lock:
            if not self._closing and self._h is not None:
                self._users += 1
                return self._h
        # Made outside the lock: making it may start a collection, and a finalizer then
        # may close this same handle, which takes the lock.
        raise self._closed()

    def __exit__(self, *exc: Any) -> None:
        with self._lock:
            self._users -= 1
            if self._users or not self._closing:
                return
            if not self._free_on_leave:
                if self._idle is not None:
                    self._idle.set()
                return
            self._free_on_leave = False
            h, self._h = self._h, None
        self._free_now(h)

    def shut(self) -> bool:
        """Refuses new calls; true if this call closed it (false if it already was)."""
        with self._lock:
            was, self._closing = self._closing, True
            return not was

    def close(self) -> None:
        """Closes it and returns once it is freed: frees it here after the calls in
        progress have returned, or waits for the closer that took that on."""
        with self._lock:
            self._closing = True
            claimed, self._claimed = self._claimed, True
            if claimed:
                if self._freed:
                    return
                if self._on_freed is None:
                    self._on_freed = threading.Event()
                on_freed = self._on_freed
            idle = None
            if not claimed and self._users:
                idle = self._idle = threading.Event()
        if claimed:
            on_freed.wait()
            return
        if idle is not None:
            idle.wait()
        with self._lock:
            h, self._h = self._h, None
        self._free_now(h)

    def close_deferred(self) -> None:
        """Closes it without waiting: frees it here if no call holds it, else the last
        call to return does."""
        with self._lock:
            self._closing = True
            if self._claimed:
                return
            self._claimed = True
            if self._users:
                self._free_on_leave = True
                return
            h, self._h = self._h, None
        self._free_now(h)

    def _free_now(self, h: Optional[int]) -> None:
        try:
            if h:
                self._free(h)
        finally:
            with self._lock:
                self._freed = True
                on_freed = self._on_freed
            if on_freed is not None:
                on_freed.set()
