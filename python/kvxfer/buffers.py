"""What kvxfer needs to know of a caller's array or tensor (address, size, element size,
where it lives), and block ids as a C array, without a Python loop per id."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Tuple

from .errors import InvalidArgument


@dataclass(frozen=True)
class Buffer:
    addr: int
    nbytes: int
    itemsize: int
    #: CUDA ordinal for device memory, None for host memory.
    device: Optional[int]
    #: Host memory that is page-locked (a pinned torch tensor).
    pinned: bool
    what: str


def _is_torch(obj: Any) -> bool:
    return type(obj).__module__.startswith("torch") and hasattr(obj, "data_ptr")


def describe(obj: Any, what: str) -> Buffer:
    """The memory behind a NumPy array, a torch tensor or a `__cuda_array_interface__`
    object, checked to be one contiguous, writable range."""
    if _is_torch(obj):
        if not obj.is_contiguous():
            raise InvalidArgument(f"{what} is not contiguous (strides {tuple(obj.stride())}); pass tensor.contiguous()")
        dev = obj.device
        if dev.type == "cuda":
            import torch

            ordinal = dev.index if dev.index is not None else torch.cuda.current_device()
            return Buffer(obj.data_ptr(), obj.numel() * obj.element_size(), obj.element_size(), ordinal, False, what)
        if dev.type != "cpu":
            raise InvalidArgument(f"{what} is on {dev}; kvxfer moves CUDA and CPU tensors")
        return Buffer(obj.data_ptr(), obj.numel() * obj.element_size(), obj.element_size(), None, bool(obj.is_pinned()), what)
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is not None:
        if cai.get("strides") is not None:
            raise InvalidArgument(f"{what} is not C-contiguous; pass a contiguous array")
        itemsize = int(cai["typestr"][2:])
        n = 1
        for d in cai["shape"]:
            n *= d
        dev = getattr(getattr(obj, "device", None), "id", None)
        return Buffer(int(cai["data"][0]), n * itemsize, itemsize, dev if dev is not None else 0, False, what)
    ai = getattr(obj, "__array_interface__", None)
    if ai is not None:
        flags = getattr(obj, "flags", None)
        if flags is not None and not flags["C_CONTIGUOUS"]:
            raise InvalidArgument(f"{what} is not C-contiguous; pass numpy.ascontiguousarray(...)")
        if ai["data"][1]:
            raise InvalidArgument(f"{what} is read-only; kvxfer writes into a layout's memory")
        itemsize = int(ai["typestr"][2:])
        n = 1
        for d in ai["shape"]:
            n *= d
        return Buffer(int(ai["data"][0]), n * itemsize, itemsize, None, False, what)
    raise InvalidArgument(f"{what} is a {type(obj).__name__}; pass a NumPy array, a torch tensor or a CUDA array")


def block_ids(ids: Any, what: str) -> Tuple[int, int, Any]:
    """(address, count, owner) of `ids` as contiguous uint64: NumPy arrays and torch
    tensors are used or converted in one call, lists and ranges through NumPy when it is
    installed. `owner` keeps the memory alive for the call."""
    if _is_torch(ids):
        import torch

        t = ids.detach().to("cpu", torch.int64).contiguous()
        if t.numel() and int(t.min()) < 0:
            raise InvalidArgument(f"{what} holds a negative block id")
        return t.data_ptr(), t.numel(), t
    try:
        import numpy as np
    except ImportError:
        np = None
    if np is not None:
        a = np.asarray(ids)
        if a.ndim != 1:
            raise InvalidArgument(f"{what} must be one-dimensional, got shape {a.shape}")
        if a.size and a.dtype.kind not in "iu":
            raise InvalidArgument(f"{what} must hold integers, got {a.dtype}")
        if a.dtype.kind == "i" and a.size and int(a.min()) < 0:
            raise InvalidArgument(f"{what} holds a negative block id")
        a = np.ascontiguousarray(a, dtype=np.uint64)
        return a.ctypes.data, a.size, a
    seq: Sequence[int] = list(ids)
    if any(b < 0 for b in seq):
        raise InvalidArgument(f"{what} holds a negative block id")
    arr = (ctypes.c_uint64 * len(seq))(*seq)
    return ctypes.addressof(arr), len(seq), arr
