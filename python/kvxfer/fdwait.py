"""`await request` on the engine's completion fd (`kvx_engine_completion_fd`, ABI 1.5):
one reader on the event loop per engine instead of an executor thread per request.

The fd becomes readable once a request of the engine has ended since it was last read.
When it is, the reader reads it (which resets it) and then asks each waiting request
whether it is done, settling those that are. A request ends (its status is final) before
it makes the fd readable, so none is missed: one that ended before the read is seen by
the asks after it, one that ends after it makes the fd readable again. One loop at a time
uses an engine's fd (a read on one loop would take the wake-up from another's waiters); a
coroutine on a second loop is waited for on that loop's executor, as before ABI 1.5.
"""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Any, Callable, List, Optional, Tuple

from . import _native as n
from .errors import Shutdown

Done = Callable[[], bool]


class FdWaiters:
    """The coroutines awaiting requests of one engine, on the loop that holds its fd."""

    def __init__(self, fd_of: Callable[[], int]):
        #: The engine's `completion_fd` (raises once the engine is closed).
        self._fd_of = fd_of
        self._lock = threading.Lock()
        #: The loop whose reader is registered, its fd and waiters (that loop's thread only).
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._fd = -1
        self._waiters: List[Tuple[Done, "asyncio.Future[None]"]] = []

    def wait(self, done: Done) -> "Optional[asyncio.Future[None]]":
        """A future of the running loop settled once `done()` is true, or None where the
        fd cannot serve this loop (a library before ABI 1.5, or another loop holds it)."""
        if n.lib.kvx_abi_version() & 0xFFFF < 5:
            return None
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._loop is None:
                self._fd = self._fd_of()
                loop.add_reader(self._fd, self._readable)
                self._loop = loop
            elif self._loop is not loop:
                return None
        fut = loop.create_future()
        self._waiters.append((done, fut))
        # Ended before the reader could see it, with the fd read by then: settled here.
        self._settle()
        return fut

    def _readable(self) -> None:
        try:
            os.read(self._fd, 8)
        except BlockingIOError:
            pass
        self._settle()

    def _settle(self) -> None:
        """Settles the waiters whose request is done (on the loop's thread); the reader
        goes once none is left, so an idle loop polls nothing of kvxfer's."""
        keep = []
        for done, fut in self._waiters:
            if fut.done():
                continue
            try:
                finished = done()
            except BaseException as e:  # a closed handle: the awaiting coroutine raises it
                fut.set_exception(e)
                continue
            if finished:
                fut.set_result(None)
            else:
                keep.append((done, fut))
        self._waiters = keep
        if not keep:
            self._detach()

    def _detach(self) -> None:
        with self._lock:
            loop, self._loop = self._loop, None
        if loop is not None:
            loop.remove_reader(self._fd)

    def engine_closing(self) -> None:
        """Before the engine (and so its fd) goes: the reader is taken off its loop and
        the coroutines still waiting raise `Shutdown`."""
        with self._lock:
            loop = self._loop
        if loop is None:
            return
        try:
            same = asyncio.get_running_loop() is loop
        except RuntimeError:
            same = False
        if same:
            self._shut()
        elif not loop.is_closed():
            loop.call_soon_threadsafe(self._shut)

    def _shut(self) -> None:
        waiters, self._waiters = self._waiters, []
        self._detach()
        for _, fut in waiters:
            if not fut.done():
                fut.set_exception(Shutdown("the engine was closed while a request was awaited", 12))


def await_done(waiters: FdWaiters, done: Done, then: Callable[[], Any], fallback: Callable[[], Any]) -> Any:
    """The `__await__` of a request: waits on the fd where it can (`done` says whether
    the request ended), then returns `then()` (which raises the request's failure);
    otherwise awaits `fallback()`."""
    fut = waiters.wait(done)
    if fut is None:
        return fallback().__await__()

    async def settled() -> Any:
        await fut
        return then()

    return settled().__await__()
