"""What a runtime's KV tier over a `Store` needs whatever the runtime: a namespace that
fingerprints the runtime's configuration, store keys from the runtime's keys, the regions
a block's bytes are cut into, the layout of a chunk kept as one block, the store's
capacity and its engine's settings from the plug-in's, the checks of the root directory
and the capacity at the runtime's start, the store opened (or made afresh where it cannot
be), one log line for a job's failed keys, and the check of the runtime's version. The
runtime plug-ins (kvxfer.vllm, kvxfer.sglang, kvxfer.lmcache) build on it; none of it
imports a runtime."""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
from typing import Any, Callable, Dict, Optional, Sequence, Tuple, Type, TypeVar

from .engine import LayoutConfig
from .errors import Incompatible, IntegrityError, InvalidArgument, Unsupported, VersionError

log = logging.getLogger("kvxfer.tier")

T = TypeVar("T")

#: The store's longest key.
MAX_KEY = 64

#: The largest region of a block: the store checksums each region within one bounce slot
#: (2 MiB by default), so a block of several MiB is several regions.
MAX_REGION = 256 * 1024
_PAGE = 4096


def digest(fields: Dict[str, Any]) -> str:
    """The SHA-256 (hex) of `fields` as canonical JSON (sorted keys): equal fingerprints,
    and only those, give equal digests, in any process."""
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def namespace_of(kind: str, fields: Dict[str, Any]) -> bytes:
    """The store namespace of a configuration: `kind` (which plug-in made it), a space,
    and `digest(fields)`. Two tiers share entries only where every field is equal, so a
    field that changes what bytes a key names (model, dtype, parallel layout, chunk
    size…) belongs in it."""
    return kind.encode() + b" " + digest(fields).encode()


def store_key(key: bytes) -> bytes:
    """A runtime's key as a store key: the key itself when shorter than the store's 64
    bytes, else its 64-byte BLAKE2b digest. No two keys share a store key: a key kept
    as it is has at most 63 bytes, a digest 64, so a digest never answers for a key
    whose bytes it happens to be."""
    key = bytes(key)
    return key if len(key) < MAX_KEY else hashlib.blake2b(key, digest_size=MAX_KEY).digest()


@functools.lru_cache(maxsize=None)
def region_bytes(span: int) -> int:
    """The region a contiguous span of `span` bytes is cut into: the largest divisor of
    `span` of at most `MAX_REGION` bytes, of whole 4 KiB pages where the span is whole
    pages."""
    if span <= MAX_REGION:
        return span
    if span % _PAGE == 0:
        pages = span // _PAGE
        return _PAGE * max(d for d in range(1, MAX_REGION // _PAGE + 1) if pages % d == 0)
    return max(d for d in range(1, MAX_REGION + 1) if span % d == 0)


def chunk_layout(num_chunks: int, chunk_bytes: int) -> LayoutConfig:
    """`num_chunks` chunks of `chunk_bytes` bytes with a chunk as one block, cut into equal
    regions (its "layers") of `region_bytes(chunk_bytes)`: the store checksums a region at
    a time and never looks inside a chunk otherwise."""
    region = region_bytes(chunk_bytes)
    return LayoutConfig(num_blocks=num_chunks, num_layers=chunk_bytes // region, outer_dim=1, page_size=1, inner_dim=region, dtype_bytes=1)


#: I/O workers and bounce ring of a store whose files bypass the page cache (not
#: `buffered`): a worker then waits on the disk, not on a core, and a disk answers faster
#: with more requests queued. With 32 workers and a 128 MiB ring, vLLM's tier moved 2 MiB
#: chunks to and from a local disk at 0.51-0.59 of the disk's best in the same run, against
#: 0.38-0.48 with the engine's default there (4 workers on a 2-core machine)
#: (docs/benchmarks.md#kvxfers-vllm-tier-against-vllms-fs-tier).
DISK_IO_THREADS = 32
DISK_BOUNCE_BYTES = 128 << 20


def engine_settings(engine: Optional[Dict[str, Any]], buffered: bool) -> Dict[str, Any]:
    """The engine settings of a tier's stores: the plug-in user's, and where the stores
    bypass the page cache, `DISK_IO_THREADS` workers and a ring of at least
    `DISK_BOUNCE_BYTES` (and four slots) unless the user sets them."""
    settings = dict(engine or {})
    if not buffered:
        settings.setdefault("io_threads", DISK_IO_THREADS)
        settings.setdefault("bounce_bytes", max(DISK_BOUNCE_BYTES, 4 * int(settings.get("slot_bytes", 0))))
    return settings


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


def log_failures(logger: logging.Logger, what: str, keys: Sequence[Any], errors: Sequence[Optional[BaseException]], quiet: Tuple[Type[BaseException], ...] = ()) -> None:
    """One line for the keys of a call that failed: how many of how many, and the first
    failure's kind, key and reason (a disk error or an admission limit fails many keys
    at once, for one cause). At WARNING, unless every failure is of a `quiet` kind (a miss
    the runtime expects), then at DEBUG; each key's own reason goes to DEBUG."""
    failed = [(k, e) for k, e in zip(keys, errors) if e is not None]
    if not failed:
        return
    shown = [(k.hex() if isinstance(k, (bytes, bytearray)) else str(k), e) for k, e in failed]
    for k, e in shown:
        logger.debug("%s: key %s: %s", what, k, e)
    loud = [(k, e) for k, e in shown if not isinstance(e, quiet)]
    k, e = (loud or shown)[0]
    logger.log(logging.WARNING if loud else logging.DEBUG, "%s: %d of %d keys failed (%s, key %s: %s)", what, len(failed), len(keys), type(e).__name__, k, e)


def make_root(root_dir: str, plugin: str) -> str:
    """`root_dir`, made where missing; refuses, with what to do, a path this process
    cannot make a directory at or write in, so the runtime stops at its start with that
    line rather than at its first store."""
    try:
        os.makedirs(root_dir, exist_ok=True)
    except OSError as e:
        raise InvalidArgument(f"{plugin}: root_dir {root_dir} cannot be made ({e.strerror}); give a directory this process may make and write in") from None
    if not os.access(root_dir, os.W_OK | os.X_OK):
        raise InvalidArgument(f"{plugin}: this process may not write in root_dir {root_dir}; give a directory it may write in")
    return root_dir


def check_room(root_dir: str, capacity_bytes: int, plugin: str) -> None:
    """Refuses a capacity past the size of `root_dir`'s file system: a store takes its
    whole capacity when it is made, so that store could never be made."""
    fs = os.statvfs(root_dir)
    size = fs.f_blocks * fs.f_frsize
    if capacity_bytes > size:
        raise InvalidArgument(
            f"{plugin}: capacity_bytes is {capacity_bytes}, more than the file system of {root_dir} holds ({size} bytes); "
            "a store takes its whole capacity when it is made: give a smaller capacity"
        )


def open_or_remake(open_store: Callable[[], T], directory: str, plugin: str) -> T:
    """`open_store()`, the plug-in's store in `directory`; where the store there was made
    with other settings (geometry, capacity, shard count), by another store version, or
    is damaged past opening (the store refuses only what makes it unknowable as a whole),
    the directory is removed and the store made afresh, empty, with a warning naming
    why: that costs what was stored, never the runtime's start."""
    try:
        return open_store()
    except (Incompatible, VersionError, IntegrityError) as e:
        log.warning("%s: %s; making the store afresh, what it held is dropped", plugin, e.message)
    shutil.rmtree(directory)
    return open_store()


#: The keys of a plug-in's "shared" setting.
SHARED_KEYS = ("dir", "capacity_bytes", "s3_bucket", "s3_prefix", "s3_endpoint", "s3_region", "write", "timeout", "admit", "threads", "pending_puts")


def shared_tier(plugin: str, value: Any) -> Any:
    """The shared tier a plug-in's "shared" setting names (a `kvxfer.SharedTier`), or None
    where it names none. The setting is a mapping: {"dir": PATH} for a directory many
    instances (and hosts, over NFS, Lustre, CephFS) share, with "capacity_bytes"; or
    {"s3_bucket": NAME} for an S3-compatible bucket, with "s3_prefix", "s3_endpoint" and
    "s3_region" (credentials from the standard AWS variables and files); either with
    "write" ("behind" or "through"), "timeout" (seconds), "admit", "threads" and
    "pending_puts". A wrong setting is refused at the runtime's start, naming the valid keys."""
    if value is None:
        return None
    from .store import SharedTier

    if not isinstance(value, dict):
        raise InvalidArgument(f'{plugin}: "shared" is {value!r}; give a mapping, e.g. {{"dir": "/mnt/nfs/kv"}} or {{"s3_bucket": "kv"}}')
    unknown = sorted(k for k in value if k not in SHARED_KEYS)
    if unknown:
        raise InvalidArgument(f'{plugin}: unknown "shared" key(s) {", ".join(unknown)}; known: {", ".join(SHARED_KEYS)}')
    if ("dir" in value) == ("s3_bucket" in value):
        raise InvalidArgument(f'{plugin}: "shared" names one place: "dir" (a shared directory) or "s3_bucket" (an S3-compatible bucket)')
    tuning = {k: value[k] for k in ("write", "timeout", "admit", "threads", "pending_puts") if k in value}
    if "dir" in value:
        return SharedTier.dir(value["dir"], capacity_bytes=value.get("capacity_bytes", 0), **tuning)
    if "capacity_bytes" in value:
        raise InvalidArgument(f'{plugin}: "shared" capacity_bytes bounds a directory; a bucket is bounded by its lifecycle rules')
    return SharedTier.s3(
        value["s3_bucket"], prefix=value.get("s3_prefix", ""), endpoint=value.get("s3_endpoint", ""), region=value.get("s3_region", ""), **tuning
    )


def check_version(plugin: str, package: str, name: str, supported: Sequence[str], interface: str) -> str:
    """The installed `package`'s version; raises `Unsupported` naming the `supported` ones
    (the releases `make integration-test` runs the plug-in against) when it is another,
    unless the environment's `KVX_<PACKAGE>_ANY_VERSION` (`KVX_VLLM_ANY_VERSION`, ...) is
    `1`, the user's choice to run an untested release: then it logs a warning naming them
    and goes on. A `package` that is not installed is refused either way. `plugin` and
    `name` name the plug-in and the runtime in the message, `interface` what of the
    runtime it implements."""
    from importlib import metadata

    want = " or ".join(supported)
    try:
        v = metadata.version(package)
    except metadata.PackageNotFoundError:
        raise Unsupported(f"{plugin} needs {name} {want}; {name} is not installed (pip install {package}=={supported[-1]})", 5) from None
    if v in supported:
        return v
    opt_in = f"KVX_{package.upper()}_ANY_VERSION"
    if os.environ.get(opt_in) == "1":
        log.warning("%s is tested with %s %s; %s %s is installed and runs untested (%s=1): its %s may differ", plugin, name, want, name, v, opt_in, interface)
        return v
    raise Unsupported(
        f"{plugin} supports {name} {want}, whose {interface} it implements and is tested with; "
        f"{name} {v} is installed: install {package}=={supported[-1]} or a kvxfer that supports {v}, "
        f"or set {opt_in}=1 to run it untested",
        5,
    )
