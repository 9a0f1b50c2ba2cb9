"""SGLang's HiCache v2 storage interface for kvxfer.sglang: the host pools a hybrid model
has beside its KV pool (a sliding-window SWA pool, a Mamba state pool, a sparse indexer
pool), each registered through `register_mem_host_pool_v2` and moved by `batch_get_v2`,
`batch_set_v2` and `batch_exists_v2`. The KV pool's pages keep moving through the v1
calls.

Each such pool has a kvxfer store of its own, in `<rank directory>/<pool name>`, under a
namespace of its own (the rank's fingerprint, the pool's name and its page geometry), so
a pool's pages never load into another pool. The configured capacity is split across the
pools in proportion to their bytes per page: every pool's store holds the same number of
pages (a prefix page may need one in each). The pools a rank last registered are kept in
`<rank directory>/pools.json`, so a restart opens the KV store with the share it had.

`import kvxfer.sglang_v2` needs no SGLang; SGLang's names are imported where used."""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
from typing import Any, Dict, List, Optional, Tuple

from .engine import Engine, Layout, LayoutConfig
from .errors import Error, InvalidArgument, NotFound, Unsupported
from .store import Store
from .tier import engine_settings, log_failures, namespace_of

log = logging.getLogger("kvxfer.sglang")

#: The file in the rank's directory naming the pools beside the KV pool and their bytes
#: per page, as last registered.
POOLS_FILE = "pools.json"

#: Pages a staged pool moves per store call (SGLang's own batch limit, `STORAGE_BATCH_SIZE`).
_STAGED_PAGES = 128

#: The pool attributes that say what bytes a page holds, where a pool class has them.
_GEOMETRY = (
    "dtype", "layout", "page_size", "size_per_token", "layer_num", "start_layer", "end_layer", "head_num", "head_dim",
    "v_head_dim", "kv_lora_rank", "qk_rope_head_dim", "num_mamba_layers", "temporal_dtype", "conv_dtype",
    "temporal_state_shape", "conv_state_shapes", "index_head_dim",
)


def pool_name(name: Any) -> str:
    """SGLang's pool name (a `PoolName`, a `str` enum, or its value) as a plain string: the
    enum hashes by member name, so it and its value are different dictionary keys."""
    return str(getattr(name, "value", name))


def capacity_share(total_bytes: int, page_bytes: List[int]) -> int:
    """Pages each pool's store holds when `total_bytes` is split across pools in
    proportion to their bytes per page (`page_bytes`): an equal number of pages each."""
    return total_bytes // sum(page_bytes)


def read_pools(directory: str) -> Dict[str, int]:
    """The pools beside the KV pool recorded in `directory` (name to bytes per page); none
    where no record is there or it does not parse."""
    try:
        with open(os.path.join(directory, POOLS_FILE)) as f:
            pools = json.load(f)
    except (OSError, ValueError):
        return {}
    if not isinstance(pools, dict) or not all(isinstance(v, int) and v > 0 for v in pools.values()):
        return {}
    return pools


class Pool:
    """One host pool beside the KV pool and its store. A pool whose pages SGLang describes
    for zero-copy storage (an SWA pool is an MHA host pool) moves in place; another (a
    Mamba pool keeps a page in tensors of several sizes) is staged: its pages are copied
    through SGLang's flat page form (`get_data_page`, `set_from_flat_data_page`) into a
    buffer the store moves, one per direction, as SGLang's own file backend copies them."""

    def __init__(self, name: str, host_pool: Any, settings: Dict[str, Any]) -> None:
        import torch

        from .sglang import page_bases, page_layout, slot_settings

        self.name = name
        self.host_pool = host_pool
        self.page_size = int(getattr(host_pool, "page_size", 1) or 1)
        self.num_pages = host_pool.size // self.page_size
        self.store: Optional[Store] = None
        self.store_dir: Optional[str] = None
        self._locks = (threading.Lock(), threading.Lock())
        try:
            bases, span = page_bases(host_pool)
            self.staged = False
        except Unsupported as e:
            log.info("kvxfer.sglang: the %s pool is staged through a buffer: %s", name, e)
            dummy = host_pool.get_dummy_flat_data_page()
            self._dtype = dummy.dtype
            span = int(dummy.numel() * dummy.element_size())
            self.staged = True
            self._slots = min(self.num_pages, _STAGED_PAGES)
            self._buffer = torch.zeros(2 * self._slots * span, dtype=torch.uint8)
            bases = [self._buffer]
        blocks = 2 * self._slots if self.staged else self.num_pages
        self.config: LayoutConfig = page_layout(blocks, len(bases), span)
        self.page_bytes = self.config.block_bytes
        self.engine = Engine("emulated", **engine_settings(slot_settings(settings.get("engine"), self.config), bool(settings.get("buffered", False))))
        try:
            self.layout: Layout = self.engine.register(bases, self.config)
        except BaseException:
            self.engine.close()
            raise

    def geometry(self) -> Dict[str, Any]:
        """What a page of this pool holds, for its namespace."""
        g = {k: str(getattr(self.host_pool, k)) for k in _GEOMETRY if getattr(self.host_pool, k, None) is not None}
        return {"name": self.name, "class": type(self.host_pool).__name__, "geometry": g, "staged": self.staged, "block": [self.config.num_layers, self.config.outer_dim, self.config.inner_dim]}

    def live(self) -> Store:
        if self.store is None:
            raise Unsupported(f"kvxfer.sglang: the {self.name} pool's store is closed", 5)
        return self.store

    def move(self, keys: List[bytes], pages: List[int], load: bool) -> List[Optional[Error]]:
        """Loads (or stores) `keys` into (from) host `pages`; per key, its error or None."""
        store = self.live()
        if not self.staged:
            return _transfer(store, self.layout, keys, pages, load)
        results: List[Optional[Error]] = []
        base = 0 if load else self._slots
        with self._locks[0 if load else 1]:
            for at in range(0, len(keys), self._slots):
                chunk = pages[at : at + self._slots]
                slots = list(range(base, base + len(chunk)))
                if not load:
                    for slot, page in zip(slots, chunk):
                        self._slot(slot).copy_(self.host_pool.get_data_page(page * self.page_size, flat=True).reshape(-1).view(self._buffer.dtype))
                got = _transfer(store, self.layout, keys[at : at + len(chunk)], slots, load)
                if load:
                    for slot, page, e in zip(slots, chunk, got):
                        if e is None:
                            self.host_pool.set_from_flat_data_page(page * self.page_size, self._slot(slot).view(self._dtype))
                results.extend(got)
        return results

    def _slot(self, slot: int) -> Any:
        return self._buffer[slot * self.page_bytes : (slot + 1) * self.page_bytes]

    def close_store(self) -> None:
        if self.store is not None:
            self.store.close()
            self.store = None

    def close(self) -> None:
        self.close_store()
        self.layout.close()
        self.engine.close()


def _transfer(store: Store, layout: Layout, keys: List[bytes], ids: List[int], load: bool) -> List[Optional[Error]]:
    r = store.get(keys, layout, ids, critical=True) if load else store.put(layout, ids, keys)
    try:
        return r.results()
    finally:
        r.release()


class HybridPools:
    """The v2 half of `KvxferStorage` (mixed in before SGLang's `HiCacheStorage`): the pools
    beside the KV pool, by name, each with its store. Uses the backend's `_store` (the KV
    pool's), `directory`, `_settings`, `_fields`, `_config`, `_make_store` and `close`."""

    _pools: Dict[str, Pool]
    _recorded: Dict[str, int]

    def _pool_capacity(self, directory: str) -> int:
        """Pages of each store in `directory`: the configured capacity split across the KV
        pool and the pools recorded there (none recorded: all of it to the KV pool)."""
        self._recorded = read_pools(directory)
        return self._share(self._recorded)

    def _share(self, pools: Dict[str, int]) -> int:
        s = self._settings  # type: ignore[attr-defined]
        kv_bytes = self._config.block_bytes  # type: ignore[attr-defined]
        total = int(s["capacity_bytes"]) if s.get("capacity_bytes") is not None else self._capacity * kv_bytes  # type: ignore[attr-defined]
        pages = capacity_share(total, [kv_bytes, *pools.values()])
        if pages <= 0:
            raise InvalidArgument(
                f"kvxfer.sglang: the capacity holds no page of every pool ({kv_bytes} bytes for the KV pool, "
                f"{', '.join(f'{v} for {k}' for k, v in pools.items())}); give a larger capacity_bytes or capacity_pages"
            )
        return pages

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """The KV pool (registered already as the anchor) or a pool beside it, which gets a
        store of its own. Where the pools differ from those the rank's stores were opened
        for, every store is reopened with its new capacity share (a store of another
        capacity is made afresh, empty). Refusing a pool fails SGLang's attach, and SGLang
        keeps the backend without closing it, so the backend closes itself first: its
        stores are free for the next attach."""
        name = pool_name(host_pool_name)
        super().register_mem_host_pool_v2(host_pool, host_pool_name)  # type: ignore[misc]
        if host_pool is getattr(self, "mem_pool_host", None):
            return
        try:
            if self._store is None or self.directory is None:  # type: ignore[attr-defined]
                raise Unsupported(f"kvxfer.sglang: the {name} pool is registered before the KV pool; SGLang registers the KV pool first", 5)
            if name in self._pools:
                raise InvalidArgument(f"kvxfer.sglang: a {name} pool is registered already; a backend serves one pool of each name")
            pool = Pool(name, host_pool, self._settings)  # type: ignore[attr-defined]
            self._pools[name] = pool
            if self._recorded.get(name) != pool.page_bytes:
                self._recorded[name] = pool.page_bytes
                self._reopen_stores()
            else:
                self._open_pool(pool, self._share(self._recorded))
        except BaseException:
            self.close()  # type: ignore[attr-defined]
            raise
        log.info("kvxfer.sglang: %s pool store %s, %d pages of %d bytes", name, pool.store_dir, pool.store.stats().capacity, pool.page_bytes)  # type: ignore[union-attr]

    def _reopen_stores(self) -> None:
        """Every store of the rank reopened with its capacity share of the recorded pools.
        An empty KV store (a first start) is removed first, with the rank's directory:
        its store is made anew with the share, without the warning of a store dropped."""
        pages = self._share(self._recorded)
        for p in self._pools.values():
            p.close_store()
        empty = self._store.stats().entries == 0  # type: ignore[attr-defined,has-type]
        self._store.close()  # type: ignore[attr-defined,has-type]
        self._store = None
        directory = self.directory  # type: ignore[attr-defined]
        if empty:
            shutil.rmtree(directory)
            os.makedirs(directory)
        self._store = self._make_store(directory, self._config, pages, self.namespace, self._fields)  # type: ignore[attr-defined]
        with open(os.path.join(directory, POOLS_FILE), "w") as f:
            json.dump(self._recorded, f, indent=2, sort_keys=True)
        for p in self._pools.values():
            self._open_pool(p, pages)

    def _open_pool(self, pool: Pool, pages: int) -> None:
        fields = {**self._fields, "pool": pool.geometry()}  # type: ignore[attr-defined]
        directory = os.path.join(self.directory, pool.name)  # type: ignore[attr-defined]
        os.makedirs(directory, exist_ok=True)
        pool.store = self._make_store(directory, pool.config, pages, namespace_of("sglang", fields), fields, pool.engine)  # type: ignore[attr-defined]
        pool.store_dir = directory

    def _close_pools(self) -> None:
        for p in self._pools.values():
            p.close()
        self._pools = {}

    def _reopen_pools(self) -> None:
        """After the KV store is made afresh in the same directory (`clear`)."""
        pages = self._share(self._recorded)
        for p in self._pools.values():
            self._open_pool(p, pages)

    # -- v2: pages of every pool -----------------------------------------------
    def batch_exists_v2(self, keys: List[str], pool_transfers: Optional[List[Any]] = None, extra_info: Any = None) -> Any:
        """The usable prefix of `keys`: the KV pool's leading hits, cut by each pool's hit
        policy as SGLang's own file backend cuts it. All pages: every page of the prefix
        held in that pool. Trailing pages (and block groups): the longest prefix whose
        last `len(keys)` pages of the transfer are held. The result maps the KV pool and
        each pool with a hit to its own prefix."""
        from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransferResult

        from .sglang import page_key

        skeys = [page_key(k) for k in keys]
        try:
            _, kv_pages = self._live().lookup(skeys)  # type: ignore[attr-defined]
            hits: Dict[Any, int] = {PoolName.KV: kv_pages} if kv_pages else {}
            final = kv_pages
            for t in pool_transfers or []:
                if final == 0:
                    break
                held, _ = self._pool(t.name).live().lookup(skeys[:kv_pages]) if kv_pages else ([], 0)
                if t.hit_policy == PoolHitPolicy.ALL_PAGES:
                    boundary = next((i for i, h in enumerate(held) if not h), kv_pages)
                else:
                    trailing = max(1, len(t.keys) if t.keys else 1)
                    boundary = next((n for n in range(kv_pages, 0, -1) if all(held[max(0, n - trailing) : n])), 0)
                if boundary:
                    hits[t.name] = boundary
                final = min(final, boundary)
        except Error as e:
            log.warning("kvxfer.sglang: a lookup of %d pages failed: %s", len(keys), e)
            return PoolTransferResult.empty()
        return PoolTransferResult(final, hits)

    def batch_get_v2(self, transfers: List[Any], extra_info: Any = None) -> Dict[Any, List[bool]]:
        """Loads each transfer's keys into its pool's pages at its `host_indices`; per pool,
        per key, whether it loaded (a key not held or failing its checks is False alone)."""
        return self._move_v2(transfers, True)

    def batch_set_v2(self, transfers: List[Any], extra_info: Any = None) -> Dict[Any, List[bool]]:
        """Stores each transfer's pool pages at its `host_indices` under its keys; per pool,
        per key, whether it is stored."""
        return self._move_v2(transfers, False)

    def _move_v2(self, transfers: List[Any], load: bool) -> Dict[Any, List[bool]]:
        from .sglang import page_key

        what = "get" if load else "set"
        out: Dict[Any, List[bool]] = {}
        for t in transfers:
            keys = list(t.keys or [])
            try:
                pool = self._pool(t.name)
                indices = t.host_indices
                if indices is None or indices.numel() != len(keys) * pool.page_size:
                    raise InvalidArgument(f"{len(keys)} keys with {0 if indices is None else indices.numel()} host indices; the {pool.name} pool needs {pool.page_size} per key")
                pages = [int(i) // pool.page_size for i in indices[:: pool.page_size].tolist()]
                results = pool.move([page_key(k) for k in keys], pages, load)
            except Error as e:
                log.warning("kvxfer.sglang: a %s of %d %s pages failed: %s", what, len(keys), pool_name(t.name), e)
                out[t.name] = [False] * len(keys)
                continue
            log_failures(log, f"kvxfer.sglang: a {what} of {len(keys)} {pool_name(t.name)} pages", keys, results, (NotFound,) if load else ())
            out[t.name] = [e is None for e in results]
        return out

    def _pool(self, name: Any) -> Pool:
        pool = self._pools.get(pool_name(name))
        if pool is None:
            raise Unsupported(f"kvxfer.sglang: no {pool_name(name)} pool is registered (or the backend is closed)", 5)
        return pool

__all__: Tuple[str, ...] = ("HybridPools", "POOLS_FILE", "capacity_share", "pool_name")
