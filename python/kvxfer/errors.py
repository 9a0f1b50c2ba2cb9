"""kvxfer's statuses as exceptions: `Error` carries `.status` (the C code) and `.message`
(kvxfer's explanation, which says what to do); one subclass per status."""

from __future__ import annotations

import builtins


class Error(Exception):
    """A kvxfer call or transfer failed."""

    status: int = -1

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status


def _status(code: int, name: str, doc: str, *bases: type) -> type:
    return type(name, (Error, *bases), {"status": code, "__doc__": doc, "__module__": __name__})


InvalidArgument = _status(2, "InvalidArgument", "A bad argument (KVX_ERR_INVALID_ARG).", ValueError)
OutOfRange = _status(3, "OutOfRange", "A block id or layer past the layout (KVX_ERR_OUT_OF_RANGE).", IndexError)
Incompatible = _status(4, "Incompatible", "Layouts whose block geometry differs (KVX_ERR_INCOMPATIBLE).")
Unsupported = _status(5, "Unsupported", "Not possible here, with the reason (KVX_ERR_UNSUPPORTED).")
NoDevice = _status(6, "NoDevice", "No such CUDA device or no driver (KVX_ERR_NO_DEVICE).")
CudaError = _status(7, "CudaError", "A CUDA driver call failed (KVX_ERR_CUDA).")
IOError = _status(8, "IOError", "A file operation failed (KVX_ERR_IO).", builtins.OSError)
NoMemory = _status(9, "NoMemory", "Out of host, pinned or device memory (KVX_ERR_NO_MEMORY).", MemoryError)
Timeout = _status(10, "Timeout", "The request did not complete in time (KVX_ERR_TIMEOUT).", TimeoutError)
Cancelled = _status(11, "Cancelled", "The request was cancelled (KVX_ERR_CANCELLED).")
Shutdown = _status(12, "Shutdown", "The engine is shutting down or closed (KVX_ERR_SHUTDOWN).")
Busy = _status(13, "Busy", "Too many requests in flight; wait for one (KVX_ERR_BUSY).")
IntegrityError = _status(14, "IntegrityError", "Checksummed data did not verify (KVX_ERR_INTEGRITY).")
VersionError = _status(15, "VersionError", "A struct or library of another version (KVX_ERR_VERSION).")
InternalError = _status(16, "InternalError", "A kvxfer bug; please report it (KVX_ERR_INTERNAL).")
RemoteError = _status(
    17, "RemoteError",
    "A remote peer failed a transfer, did not answer in time or exited; re-import its blob once it is back (KVX_ERR_REMOTE).",
)
NotFound = _status(
    18, "NotFound", "A key the store does not hold: a get's or a remove's miss (KVX_ERR_NOT_FOUND).", LookupError,
)

_BY_STATUS = {
    c.status: c
    for c in (
        InvalidArgument, OutOfRange, Incompatible, Unsupported, NoDevice, CudaError, IOError, NoMemory,
        Timeout, Cancelled, Shutdown, Busy, IntegrityError, VersionError, InternalError, RemoteError, NotFound,
    )
}


def error_for(status: int, message: str) -> Error:
    """The exception for a C status and its message."""
    cls = _BY_STATUS.get(status, Error)
    return cls(message or f"kvxfer status {status}", status)
