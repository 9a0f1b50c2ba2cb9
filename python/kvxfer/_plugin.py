"""What kvxfer's runtime plug-ins (`kvxfer.vllm`, `kvxfer.sglang`) share: how a runtime's
key becomes a store key, how a configuration becomes a namespace, how a block's bytes are
cut into checksummed regions, and the store's capacity from the plug-in's settings. None of
it imports a runtime."""

from __future__ import annotations

import hashlib
import json
from typing import Any, Dict, Optional

from .errors import InvalidArgument

#: The store's longest key.
MAX_KEY = 64

#: The largest region the plug-ins cut a block into: the store checksums each region
#: within one bounce slot (2 MiB by default), so a block of several MiB is several regions.
MAX_REGION = 256 * 1024
_PAGE = 4096


def store_key(key: bytes) -> bytes:
    """A runtime's key as a store key: the key itself, or, past the store's 64 bytes, its
    64-byte BLAKE2b digest."""
    key = bytes(key)
    return key if len(key) <= MAX_KEY else hashlib.blake2b(key, digest_size=MAX_KEY).digest()


def digest(fields: Dict[str, Any]) -> str:
    """The SHA-256 (hex) of a fingerprint's canonical JSON: equal fingerprints, and only
    those, give equal digests, in any process."""
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def region_bytes(span: int) -> int:
    """The region a contiguous span of `span` bytes is cut into: the span itself up to
    256 KiB, else the largest run of whole 4 KiB pages that divides it and is at most
    256 KiB. A span past 256 KiB that is not whole pages is one region."""
    if span <= MAX_REGION or span % _PAGE:
        return span
    pages = span // _PAGE
    return _PAGE * max(d for d in range(1, MAX_REGION // _PAGE + 1) if pages % d == 0)


def capacity_blocks(blocks: Optional[int], nbytes: Optional[int], block_bytes: int, unit: str, where: str) -> int:
    """The store's capacity in blocks from exactly one of `blocks` and `nbytes` (rounded
    down to whole blocks of `block_bytes`); `unit` names a block as the runtime calls it
    (`"chunks"`, `"pages"`) and `where` the settings it is read from."""
    if (blocks is None) == (nbytes is None):
        raise InvalidArgument(f"the kvxfer store needs one of capacity_bytes or capacity_{unit} in {where}")
    n = blocks if blocks is not None else int(nbytes) // block_bytes  # type: ignore[arg-type]
    if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
        raise InvalidArgument(f"the kvxfer store's capacity is {n!r} {unit} of {block_bytes} bytes; give capacity_bytes of at least one of them")
    return n
