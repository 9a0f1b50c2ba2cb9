"""What a runtime's KV tier over a `Store` needs whatever the runtime: a namespace that
fingerprints the runtime's configuration, store keys from the runtime's keys, and the
layout of a chunk kept as one block. The runtime plug-ins (kvxfer.vllm, kvxfer.lmcache)
build on it."""

from __future__ import annotations

import functools
import hashlib
import json
from typing import Any, Dict

from .engine import LayoutConfig

#: The store's longest key.
MAX_KEY = 64


def namespace_of(kind: str, fields: Dict[str, Any]) -> bytes:
    """The store namespace of a configuration: `kind` (which plug-in made it), a space,
    and the SHA-256 of `fields` as canonical JSON (sorted keys), in hex. Two tiers share
    entries only where every field is equal, so a field that changes what bytes a key
    names (model, dtype, parallel layout, chunk size…) belongs in it."""
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return kind.encode() + b" " + hashlib.sha256(canonical.encode()).hexdigest().encode()


def store_key(key: bytes) -> bytes:
    """A runtime's key as a store key: the key itself, or past the store's 64 bytes its
    64-byte BLAKE2b digest."""
    key = bytes(key)
    return key if len(key) <= MAX_KEY else hashlib.blake2b(key, digest_size=MAX_KEY).digest()


#: The largest region of a chunk: the store checksums each region within one bounce slot
#: (2 MiB by default), so a chunk of several MiB is several regions.
MAX_REGION = 256 * 1024
_PAGE = 4096


@functools.lru_cache(maxsize=None)
def _region(chunk_bytes: int) -> int:
    """The largest divisor of `chunk_bytes` of at most `MAX_REGION` bytes, of whole 4 KiB
    pages where the chunk is whole pages."""
    if chunk_bytes <= MAX_REGION:
        return chunk_bytes
    if chunk_bytes % _PAGE == 0:
        pages = chunk_bytes // _PAGE
        return _PAGE * max(d for d in range(1, MAX_REGION // _PAGE + 1) if pages % d == 0)
    return max(d for d in range(1, MAX_REGION + 1) if chunk_bytes % d == 0)


def chunk_layout(num_chunks: int, chunk_bytes: int) -> LayoutConfig:
    """`num_chunks` chunks of `chunk_bytes` bytes with a chunk as one block, cut into equal
    regions (its "layers") of at most 256 KiB: the store checksums a region at a time and
    never looks inside a chunk otherwise."""
    region = _region(chunk_bytes)
    return LayoutConfig(num_blocks=num_chunks, num_layers=chunk_bytes // region, outer_dim=1, page_size=1, inner_dim=region, dtype_bytes=1)
