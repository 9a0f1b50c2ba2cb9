"""Slot handles (`kvx_slot_handle`, ABI 1.5): what a store's owner hands to a process that
opened the store with `data_only=True`, to read a leased slot or write a reserved one
(`Store.lease_slots`, `Store.reserve_slots`). A handle is 48 plain bytes: `bytes(h)` and
`SlotHandle.from_bytes` carry it between processes, and it pickles (as vLLM ships its
scheduler's metadata to its workers)."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Tuple

from . import _native as n
from .errors import InvalidArgument


def need_slots() -> None:
    """Refuses where the loaded library predates slot handles."""
    n.need_minor(5, "slot handles")


class SlotHandle:
    """One slot of a store as its owner handed it out (immutable). `bytes(h)` is its 48
    bytes; equal bytes are equal handles."""

    __slots__ = ("_bytes",)
    SIZE = ctypes.sizeof(n.SlotHandleC)

    def __init__(self, raw: bytes):
        if not isinstance(raw, (bytes, bytearray, memoryview)):
            raise InvalidArgument(f"a slot handle is made from its bytes (bytes(handle)), not a {type(raw).__name__}")
        raw = bytes(raw)  # a memoryview's len() counts its items, not its bytes
        if len(raw) != SlotHandle.SIZE:
            raise InvalidArgument(f"a slot handle is {SlotHandle.SIZE} bytes (bytes(handle)); got {len(raw)}")
        object.__setattr__(self, "_bytes", raw)

    @classmethod
    def from_bytes(cls, raw: bytes) -> "SlotHandle":
        """The handle whose `bytes()` are `raw` (48 bytes, as another process sent them)."""
        return cls(raw)

    @classmethod
    def _from_c(cls, c: n.SlotHandleC) -> "SlotHandle":
        return cls(ctypes.string_at(ctypes.addressof(c), cls.SIZE))

    def _c(self) -> n.SlotHandleC:
        return n.SlotHandleC.from_buffer_copy(self._bytes)

    def __bytes__(self) -> bytes:
        return self._bytes

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("a SlotHandle is immutable")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SlotHandle) and other._bytes == self._bytes

    def __hash__(self) -> int:
        return hash(self._bytes)

    def __reduce__(self) -> Tuple[Any, Tuple[bytes]]:
        return (SlotHandle.from_bytes, (self._bytes,))

    @property
    def slot(self) -> int:
        return int(self._c().slot)

    @property
    def generation(self) -> int:
        return int(self._c().generation)

    @property
    def key_len(self) -> int:
        return int(self._c().key_len)

    def __repr__(self) -> str:
        return f"SlotHandle(slot={self.slot}, generation={self.generation})"


@dataclass(frozen=True)
class Reservation:
    """What `Store.reserve_slots` gave one key: `kind` is `Reservation.WRITE` (write
    `handle`'s slot, then commit or abort it), `HELD` (the store holds the key already),
    `IN_FLIGHT` (another put of it is in flight) or `NO_ROOM` (full of held entries)."""

    kind: int
    handle: Optional[SlotHandle] = None

    WRITE = n.RESERVED_WRITE
    HELD = n.RESERVED_HELD
    IN_FLIGHT = n.RESERVED_IN_FLIGHT
    NO_ROOM = n.RESERVED_NO_ROOM


def handle_array(handles: Sequence[SlotHandle]) -> Tuple[Any, int]:
    """A call's handles as a `kvx_slot_handle` array (and their count)."""
    if isinstance(handles, SlotHandle):
        raise InvalidArgument("handles must be a sequence of SlotHandles; wrap a single one in a list")
    hs = list(handles)
    for i, h in enumerate(hs):
        if not isinstance(h, SlotHandle):
            raise InvalidArgument(f"handles[{i}] is a {type(h).__name__}; expected a SlotHandle (SlotHandle.from_bytes for bytes)")
    array = (n.SlotHandleC * max(len(hs), 1))()
    for i, h in enumerate(hs):
        array[i] = h._c()
    return array, len(hs)
