"""kvxfer as SGLang's HiCache storage backend: `KvxferStorage`, a `HiCacheStorage` (the
L3 tier of SGLang's hierarchical cache) backed by a kvxfer `Store`, so pages SGLang writes
back from its host KV pool land on disk or tmpfs and come back by their page hashes.

SGLang loads it by module path, without a fork::

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config
    '{"backend_name": "kvxfer", "module_path": "kvxfer.sglang", "class_name": "KvxferStorage",
      "interface_v1": 1, "root_dir": "/mnt/nvme/kv", "capacity_bytes": 500000000000}'

It runs in each scheduler process (one per tensor-, pipeline- and context-parallel rank and
per data-parallel replica), with a store of its own. SGLang's host pool is registered once
as a kvxfer host layout, a page as one block, and pages move between it and the store in
place (SGLang's v1 interface: `batch_get_v1`, `batch_set_v1`, `batch_exists`). A hybrid
model's pools beside the KV pool (SWA, Mamba state) get stores of their own through
SGLang's v2 interface (`kvxfer.sglang_v2`).
`import kvxfer.sglang` needs no SGLang; SGLang (the version in `SUPPORTED_SGLANG`) is
imported when the backend class is first asked for. See docs/sglang.md."""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .tier import MAX_REGION, capacity_blocks, check_version, engine_settings, log_failures, make_root, namespace_of, open_or_remake, region_bytes, shared_tier, store_key
from .engine import Engine, Layout, LayoutConfig
from .errors import Busy, Error, InvalidArgument, NotFound, Unsupported
from .sglang_v2 import HybridPools
from .store import Store

log = logging.getLogger("kvxfer.sglang")

#: The SGLang versions whose HiCache storage interface this module implements, each
#: tested by `make integration-test`; another is refused unless KVX_SGLANG_ANY_VERSION=1
#: (docs/sglang.md says how a release is added). What differs between them, for this
#: module, is kept beside this list. Between 0.5.22 and 0.5.23 nothing this module uses
#: does: 0.5.23's `HiCacheStorageConfig` adds the decode-context-parallel fields
#: (`dcp_size`, `dcp_rank`, `logical_page_size`), which apply to an MLA model over several
#: TP ranks only, refused here on either release, its `HiCacheStorage` an
#: `on_host_pools_registered` hook, empty by default and not needed by a backend that opens
#: its store when the KV pool is registered, and its host pools the `page_unified` layout,
#: which `page_bases` refuses as it does any layout SGLang gives no zero-copy description of.
SUPPORTED_SGLANG = ("0.5.22", "0.5.23")

#: Part of every namespace: a change to how this module lays pages out changes it.
_FORMAT = "kvxfer.sglang storage 1"

#: SGLang's own keys in the extra config, beside the backend's settings.
_SGLANG_KEYS = ("backend_name", "module_path", "class_name", "interface_v1")
_SETTINGS = ("root_dir", "capacity_bytes", "capacity_pages", "shards", "durable", "buffered", "verify_on_open", "namespace", "engine", "replicas", "shared")

#: kvxfer's default bounce slot and ring (docs/configuration.md); a region must fit in a
#: slot with room for two direct-I/O alignments, so larger regions get larger slots.
_SLOT_BYTES = 2 << 20
_BOUNCE_BYTES = 64 << 20
_IO_ALIGN = 4096


def page_key(key: str) -> bytes:
    """The store key of an SGLang page hash: `h` and its 32 bytes when it is SGLang's
    SHA-256 digest in lower-case hex (64 digits), else `u` and its UTF-8 bytes (as
    `store_key` keeps them). The tag byte keeps each page hash its own key: a string whose
    UTF-8 bytes equal another key's hex-decoded bytes, or hex in upper case, names other
    bytes."""
    if len(key) == 64:
        try:
            raw = bytes.fromhex(key)
        except ValueError:
            raw = b""
        if raw.hex() == key:
            return b"h" + raw
    return store_key(b"u" + key.encode())


def check_sglang_version() -> str:
    """The installed SGLang's version; raises `Unsupported` naming the supported ones when
    it is another (or when SGLang is not installed)."""
    return check_version("kvxfer.sglang", "sglang", "SGLang", SUPPORTED_SGLANG, "HiCache storage interface")


def page_bases(pool: Any) -> Tuple[List[Any], int]:
    """Where the host pool keeps its pages: the byte ranges ("bases") one page spreads
    over, each holding every page's piece densely (page `p`'s piece at `p × span`), and
    that span. Read from the pool's own zero-copy description (`get_page_buffer_meta`,
    what SGLang's v1 backends move), checked on the first, second and last page, so any
    host layout whose page pieces are dense and of one size is taken: `layer_first` (a
    piece per layer and K/V), `page_first`, `page_first_direct` and `page_head` (K and V
    pieces), and MLA's (one piece per layer, or one per page)."""
    import torch

    buffer = getattr(pool, "kv_buffer", None)
    if not isinstance(buffer, torch.Tensor) or not buffer.is_contiguous():
        raise Unsupported(f"kvxfer.sglang moves a host pool kept in one contiguous tensor; {type(pool).__name__} ({pool.layout}) is not", 5)
    num_pages = pool.size // pool.page_size
    if num_pages < 2:
        raise InvalidArgument(f"the host pool holds {num_pages} page(s); kvxfer.sglang needs at least two")

    def meta(page: int) -> Tuple[List[int], List[int]]:
        try:
            ptrs, sizes = pool.get_page_buffer_meta(torch.arange(page * pool.page_size, (page + 1) * pool.page_size, dtype=torch.int64))
        except (NotImplementedError, ValueError, AssertionError, AttributeError) as e:
            raise Unsupported(f"SGLang's {type(pool).__name__} with layout {pool.layout!r} does not describe its pages for zero-copy storage ({e}); kvxfer.sglang needs it", 5) from e
        return [int(p) for p in ptrs], [int(s) for s in sizes]

    first, sizes = meta(0)
    span = sizes[0] if sizes else 0
    if not first or any(s != span for s in sizes):
        raise Unsupported(f"SGLang's {type(pool).__name__} ({pool.layout}) keeps a page in pieces of {sorted(set(sizes))} bytes; kvxfer.sglang needs pieces of one size", 5)
    flat = buffer.reshape(-1).view(torch.uint8)
    start, end = buffer.data_ptr(), buffer.data_ptr() + flat.numel()
    for page in (1, num_pages - 1):
        ptrs, _ = meta(page)
        if ptrs != [p + page * span for p in first]:
            raise Unsupported(f"SGLang's {type(pool).__name__} ({pool.layout}) does not keep its pages densely; kvxfer.sglang cannot register it", 5)
    if any(p < start or p + num_pages * span > end for p in first):
        raise Unsupported(f"SGLang's {type(pool).__name__} ({pool.layout}) keeps pages outside its kv_buffer; kvxfer.sglang cannot register it", 5)
    return [flat[p - start : p - start + num_pages * span] for p in first], span


def page_layout(num_pages: int, num_bases: int, span: int) -> LayoutConfig:
    """The host pool as a kvxfer layout, a page as one block: the store checksums a
    region at a time, so a page is cut into regions of at most 256 KiB where it can be.
    One base: the page is contiguous and its regions are "layers". Several: one "layer"
    per base, its piece halved (as K and V are "outer" halves) when past 256 KiB."""
    if num_bases == 1:
        region = region_bytes(span)
        return LayoutConfig(num_blocks=num_pages, num_layers=span // region, outer_dim=1, page_size=1, inner_dim=region, dtype_bytes=1)
    outer = 2 if span > MAX_REGION and span % 2 == 0 else 1
    return LayoutConfig(num_blocks=num_pages, num_layers=num_bases, outer_dim=outer, page_size=1, inner_dim=span // outer, dtype_bytes=1, kind="layer_block_first")


def slot_settings(engine: Optional[Dict[str, Any]], config: LayoutConfig) -> Dict[str, Any]:
    """The caller's engine settings and, where the caller sets no slot size and a region
    needs more than kvxfer's default slot, slots that fit one (and a ring of at least four
    of them)."""
    settings = dict(engine or {})
    region = config.page_size * config.inner_dim * config.dtype_bytes
    slot = _SLOT_BYTES
    while slot < region + 2 * _IO_ALIGN:
        slot *= 2
    if slot > _SLOT_BYTES and "slot_bytes" not in settings:
        settings["slot_bytes"] = slot
        settings.setdefault("bounce_bytes", max(_BOUNCE_BYTES, 4 * slot))
    return settings


def fingerprint(storage_config: Any, pool: Any, config: LayoutConfig, extra: str = "") -> Dict[str, Any]:
    """What makes equal SGLang page hashes name different bytes: the model (with the host
    pool's page format tag SGLang adds to it), the pool class, KV dtype, host layout,
    tokens per page, layers and per-token geometry, the ranks that hold different slices
    (tensor, pipeline, attention context parallel), the byte layout; plus `extra` (the
    backend's `namespace` setting, for what SGLang does not say, such as a weights
    revision). The data-parallel rank is not in it: replicas hold the same bytes under
    the same hashes."""
    c = storage_config
    geometry = {k: getattr(pool, k) for k in ("head_num", "head_dim", "v_head_dim", "kv_cache_dim", "kv_lora_rank", "qk_rope_head_dim") if isinstance(getattr(pool, k, None), int)}
    return {
        "format": _FORMAT,
        "model": c.model_name,
        "pool": type(pool).__name__,
        "dtype": str(pool.dtype),
        "layout": pool.layout,
        "page_size": pool.page_size,
        "layer_num": pool.layer_num,
        "start_layer": pool.start_layer,
        "end_layer": pool.end_layer,
        "size_per_token": pool.size_per_token,
        "geometry": geometry,
        "mla": bool(c.is_mla_model),
        "tp": [c.tp_rank, c.tp_size],
        "pp": [c.pp_rank, c.pp_size],
        "attn_cp": [c.attn_cp_rank, c.attn_cp_size],
        "block": [config.num_layers, config.outer_dim, config.inner_dim],
        "extra": extra,
    }


def _refuse_unsupported_parallelism(c: Any) -> None:
    """SGLang setups where a per-rank store cannot serve the pages SGLang asks for."""
    if c.is_mla_model and c.tp_size > 1:
        raise Unsupported(
            f"kvxfer.sglang does not support an MLA model with attention TP size {c.tp_size}: SGLang writes its replicated pages "
            "from one rank only, and a kvxfer store has one owner, so the other ranks would never find them; use TP size 1 "
            "per attention group (e.g. --enable-dp-attention with --dp-size equal to --tp-size)",
            5,
        )
    if getattr(c, "should_split_heads", False):
        raise Unsupported("kvxfer.sglang does not split heads across heterogeneous TP sizes; remove tp_lcm_size from the extra config", 5)


def _make_backend_class() -> type:
    version = check_sglang_version()
    try:
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
        from sglang.srt.observability.metrics_collector import StorageMetrics
    except ImportError as e:
        raise Unsupported(f"SGLang {version} is installed but its HiCache storage module does not import ({e}); kvxfer.sglang needs it", 5) from e

    class KvxferStorage(HybridPools, HiCacheStorage):
        """An SGLang HiCache storage backend in a kvxfer store. Extra config keys (beside
        SGLang's `backend_name`, `module_path`, `class_name` and `interface_v1`, which
        must be 1): `root_dir` (required), `capacity_bytes` or `capacity_pages`
        (required), `shards` (data files, default 4), `durable`, `buffered` (tmpfs or
        page-cache I/O), `verify_on_open`, `namespace` (added to the fingerprint),
        `engine` (kvxfer engine settings: `io_threads`, `io_backend`, ...), `replicas`
        (processes of a rank that each own a store under `root_dir`: the data-parallel
        size, default 1). The store opens when SGLang registers its host pool; a hybrid
        model's other pools get stores of their own beside it (`HybridPools`)."""

        def __init__(self, storage_config: Any, kwargs: Optional[Dict[str, Any]] = None) -> None:
            extra = dict(storage_config.extra_config or {})
            unknown = sorted(k for k in extra if k not in _SGLANG_KEYS and k not in _SETTINGS)
            if unknown:
                raise InvalidArgument(f"kvxfer.sglang: unknown extra config key(s) {', '.join(unknown)}; known: {', '.join(_SETTINGS)}")
            if not extra.get("interface_v1"):
                raise InvalidArgument(
                    'kvxfer.sglang moves pages in place through SGLang\'s v1 storage interface; add "interface_v1": 1 to '
                    "--hicache-storage-backend-extra-config"
                )
            if not extra.get("root_dir"):
                raise InvalidArgument('kvxfer.sglang needs "root_dir" (the directory its stores are made in) in the extra config')
            _refuse_unsupported_parallelism(storage_config)
            make_root(str(extra["root_dir"]), "kvxfer.sglang")
            self.storage_config = storage_config
            self._settings = {k: extra[k] for k in _SETTINGS if k in extra}
            self._shared = shared_tier("kvxfer.sglang", self._settings.get("shared"))
            self._engine: Optional[Engine] = None
            self._layout: Optional[Layout] = None
            self._store: Optional[Store] = None
            self.directory: Optional[str] = None
            self._pools = {}
            self._recorded = {}
            # SGLang's storage metrics (`get_stats`), recorded only when it asks for them:
            # its prefetch and backup threads call the backend at once, hence the lock.
            self._metrics: Optional[StorageMetrics] = StorageMetrics() if storage_config.enable_storage_metrics else None
            self._metrics_lock = threading.Lock()
            self._put_lock = threading.Lock()

        # -- host pools --------------------------------------------------------
        def register_mem_pool_host(self, mem_pool_host: Any) -> None:
            """Registers SGLang's host pool as a kvxfer layout and opens this rank's store."""
            if self._store is not None:
                raise InvalidArgument("kvxfer.sglang: a host pool is registered already; a backend serves one pool")
            super().register_mem_pool_host(mem_pool_host)
            bases, span = page_bases(mem_pool_host)
            self._page_size = mem_pool_host.page_size
            self._config = page_layout(mem_pool_host.size // mem_pool_host.page_size, len(bases), span)
            s = self._settings
            self._fields = fingerprint(self.storage_config, mem_pool_host, self._config, str(s.get("namespace", "")))
            self.namespace = namespace_of("sglang", self._fields)
            self._capacity = capacity_blocks(s.get("capacity_pages"), s.get("capacity_bytes"), self._config.block_bytes, "pages", "the extra config")
            # The scheduler moves host memory only: no CUDA context for kvxfer there.
            settings = engine_settings(slot_settings(s.get("engine"), self._config), bool(s.get("buffered", False)))
            self._engine = Engine("emulated", **settings)
            try:
                self._layout = self._engine.register(bases, self._config)
                self._open()
            except BaseException:
                self.close()
                raise
            log.info("kvxfer.sglang: store %s, %d pages of %d bytes", self.directory, self._store.stats().capacity, self._config.block_bytes)  # type: ignore[union-attr]

        def _open(self) -> None:
            """Opens the store in the first of `<root_dir>/<model>_<digest>_<n>`, `n`
            below `replicas`, that no other process holds: a store has one owner, and
            each data-parallel replica of a rank (a process of its own, holding the same
            bytes under the same hashes) takes one, with a capacity of its own. With
            every one held, refuses naming their owners: a second SGLang server on the
            same `root_dir` needs its own."""
            s = self._settings
            replicas = s.get("replicas", 1)
            if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 1:
                raise InvalidArgument(f'kvxfer.sglang: "replicas" is {replicas!r}; give the data-parallel size (--dp-size), at least 1')
            model = str(self._fields["model"] or "model").replace("/", "_")
            held = []
            for n in range(replicas):
                directory = os.path.join(str(s["root_dir"]), f"{model}_{self.namespace[7:19].decode()}_{n}")
                os.makedirs(directory, exist_ok=True)
                try:
                    self._store = self._make_store(directory, self._config, self._pool_capacity(directory), self.namespace, self._fields)
                except Busy as e:
                    held.append(e.message)
                    continue
                self.directory = directory
                if n:
                    log.info("kvxfer.sglang: replica %d of %d of this rank: store %s, a capacity of its own", n + 1, replicas, directory)
                return
            raise Busy(
                f"kvxfer.sglang: every store of this rank under {s['root_dir']} is held ({'; '.join(held)}); "
                f'"replicas" is {replicas}: give a second SGLang server its own root_dir, or set "replicas" to the data-parallel size',
                13,
            )

        def _make_store(self, directory: str, config: LayoutConfig, capacity: int, namespace: bytes, fields: Dict[str, Any], engine: Optional[Engine] = None) -> Store:
            """A store of this backend's settings in `directory` (made afresh where the one
            there has other settings), its fingerprint `fields` written beside it
            (`config.json`). The shared tier backs the KV pool's store alone."""
            s = self._settings
            store = open_or_remake(
                lambda: Store(
                    engine or self._engine,  # type: ignore[arg-type]
                    directory,
                    config,
                    capacity,
                    namespace=namespace,
                    durable=bool(s.get("durable", False)),
                    buffered=bool(s.get("buffered", False)),
                    verify_on_open=bool(s.get("verify_on_open", False)),
                    shards=s.get("shards", 4),
                    shared=None if engine else self._shared,
                ),
                directory,
                "kvxfer.sglang",
            )
            with open(os.path.join(directory, "config.json"), "w") as f:
                json.dump(fields, f, indent=2, sort_keys=True)
            return store

        # -- v1: pages in place ------------------------------------------------
        def batch_exists(self, keys: List[str], extra_info: Any = None) -> int:
            """How many leading keys the store holds."""
            try:
                _, leading = self._live().lookup([page_key(k) for k in keys])
            except Error as e:
                log.warning("kvxfer.sglang: a lookup of %d pages failed: %s", len(keys), e)
                return 0
            return leading

        def exists(self, key: str) -> bool:
            return self.batch_exists([key]) == 1

        def batch_get_v1(self, keys: List[str], host_indices: Any, extra_info: Any = None) -> List[bool]:
            """Loads each key's page into the host pool's page at `host_indices` (a page's
            tokens each); per key, whether it loaded. A key not held, or a page that fails
            its checksums or seal, is False for that key alone: the store drops a
            damaged entry, and SGLang recomputes from the first page that did not load."""
            return self._move(keys, host_indices, True)

        def batch_set_v1(self, keys: List[str], host_indices: Any, extra_info: Any = None) -> List[bool]:
            """Stores the host pool's pages at `host_indices` under `keys`; per key, whether
            it is stored (a key held already is, and is not written again)."""
            return self._move(keys, host_indices, False)

        def _move(self, keys: List[str], host_indices: Any, load: bool) -> List[bool]:
            if not keys:
                return []
            ids = [int(i) // self._page_size for i in host_indices[:: self._page_size][: len(keys)].tolist()]
            skeys = [page_key(k) for k in keys]
            try:
                store = self._live()
                if self._metrics is None:
                    results = self._transfer(store, skeys, ids, load)
                elif load:
                    start = time.perf_counter()
                    results = self._transfer(store, skeys, ids, load)
                    self._record(True, sum(e is None for e in results), time.perf_counter() - start)
                else:
                    # A put's per-key result is None for a key held already too; the pages
                    # it wrote are the rise of the store's `puts` counter (blocks written,
                    # not keys held or refused). Exact while no other put runs on the store:
                    # the lock holds off this backend's others (SGLang has one backup thread).
                    with self._put_lock:
                        before = store.stats().puts
                        start = time.perf_counter()
                        results = self._transfer(store, skeys, ids, load)
                        elapsed = time.perf_counter() - start
                        written = store.stats().puts - before
                    self._record(False, written, elapsed)
            except Error as e:
                log.warning("kvxfer.sglang: a %s of %d pages failed: %s", "get" if load else "set", len(keys), e)
                return [False] * len(keys)
            log_failures(log, f"kvxfer.sglang: a {'get' if load else 'set'} of {len(keys)} pages", keys, results, (NotFound,) if load else ())
            return [e is None for e in results]

        def _transfer(self, store: Store, skeys: List[bytes], ids: List[int], load: bool) -> List[Optional[Error]]:
            r = store.get(skeys, self._layout, ids, critical=True) if load else store.put(self._layout, ids, skeys)  # type: ignore[arg-type]
            try:
                return r.results()
            finally:
                r.release()

        def _record(self, load: bool, pages: int, seconds: float) -> None:
            """One op's pages moved and GB/s (2^30 bytes, as SGLang's backends count them)
            over its wall time. An op that moved nothing adds no sample: its zero GB/s
            would read as a slow op in SGLang's bandwidth histogram."""
            if pages == 0:
                return
            gbps = pages * self._config.block_bytes / (1 << 30) / max(seconds, 1e-9)
            with self._metrics_lock:
                m = self._metrics
                (m.prefetch_pgs if load else m.backup_pgs).append(pages)  # type: ignore[union-attr]
                (m.prefetch_bandwidth if load else m.backup_bandwidth).append(gbps)  # type: ignore[union-attr]

        def get_stats(self) -> Optional[StorageMetrics]:
            """Pages and GB/s of each get (prefetch) and set (backup) since the last call,
            when SGLang's storage metrics are on; else SGLang's default (None)."""
            if self._metrics is None:
                return super().get_stats()
            with self._metrics_lock:
                out, self._metrics = self._metrics, StorageMetrics()
            return out

        def _live(self) -> Store:
            if self._store is None:
                raise Unsupported("kvxfer.sglang: no host pool is registered (or the backend is closed)", 5)
            return self._store

        # -- the rest of HiCacheStorage ----------------------------------------
        def _copying_path(self, *args: Any, **kwargs: Any) -> Any:
            raise Unsupported('kvxfer.sglang moves pages in place only (SGLang\'s v1 interface, "interface_v1": 1); it has no copying get or set', 5)

        get = batch_get = set = batch_set = _copying_path

        def clear(self) -> None:
            """Empties this rank's store: closes it, removes its files and opens a new
            one in the same directory."""
            if self._store is None or self.directory is None:
                return
            for p in self._pools.values():
                p.close_store()
            self._store.close()
            self._store = None
            shutil.rmtree(self.directory)
            self._open()
            self._reopen_pools()

        def close(self) -> None:
            """Closes the store (its directory is free for the next start), the layout
            over the host pool and the engine, and those of the pools beside it; SGLang
            may free the pools after."""
            self._close_pools()
            for h in (self._store, self._layout, self._engine):
                if h is not None:
                    h.close()
            self._store = self._layout = self._engine = None

    KvxferStorage.__module__ = __name__
    KvxferStorage.__qualname__ = "KvxferStorage"
    return KvxferStorage


_backend_class: Optional[type] = None


def __getattr__(name: str) -> Any:
    """`KvxferStorage`, made on first use: SGLang is imported (and its version checked)
    only when the backend is asked for, so `import kvxfer.sglang` needs no SGLang."""
    global _backend_class
    if name == "KvxferStorage":
        if _backend_class is None:
            _backend_class = _make_backend_class()
        return _backend_class
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__: Sequence[str] = ["KvxferStorage", "SUPPORTED_SGLANG", "check_sglang_version", "fingerprint", "page_bases", "page_key", "page_layout", "slot_settings"]
