"""kvxfer as a vLLM offloading spec: `KvxferOffloadingSpec`, an `OffloadingSpec` of vLLM's
OffloadingConnector that moves KV blocks between GPU memory and kvxfer stores directly,
with no CPU tier between. vLLM loads it by name and module path, without a fork::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "KvxferOffloadingSpec",
        "spec_module_path": "kvxfer.vllm", "root_dir": "/mnt/nvme/kv",
        "capacity_bytes": 500000000000}}'

The split follows vLLM's processes (the store's slot handles):

- the manager (scheduler process) owns one store per worker rank: it looks keys up,
  leases the hits a load reads, reserves slots for a store and commits them (or aborts
  them) when the workers report; eviction is the stores' LRU;
- each worker (one per GPU rank) opens its rank's store for data only and moves blocks
  between vLLM's KV tensors and the slots the manager's handles name (`slot_mover`).

Where every rank holds the same KV (MLA's latent with tensor parallelism, which vLLM lays
out replicated), one store holds it for every rank: rank 0 writes it (vLLM hands the
other ranks no store job) and every rank loads from it.

A worker publishes its block geometry (`geometry.json` in its rank's directory) when
vLLM registers its KV caches; the manager opens the stores once every rank has, before
the first step (until then a lookup misses and a store is refused).

vLLM resets its caches when the weights change (`reset_cache`): a reset starts a new
store generation, a number kept in a file beside the ranks' directories, and each rank's
store of generation G lives in `store-G` under its directory. So nothing stored before a
reset is loaded after it, also after a restart; the job specs carry the generation, and a
worker opens the new generation's store on its first job of it. vLLM (the version in
`SUPPORTED_VLLM`) is imported by `make_spec_classes`. See docs/vllm.md."""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..engine import Engine, LayoutConfig
from ..errors import Error, IntegrityError, InvalidArgument, Unsupported
from ..holdings import Event, Holdings, need_holdings
from ..store import Store
from ..tier import capacity_blocks, check_room, engine_settings, log_failures, make_root, open_or_remake, store_key
from .events import offloading_events
from .namespace import fingerprint, namespace_of, store_directory
from .slot_mover import SlotJob, SlotMover, as_pages, engine_for
from .version import JobBlocks, check_vllm_version

log = logging.getLogger("kvxfer.vllm")

#: Part of every namespace: a change to how a store block holds a GPU block changes it.
_FORMAT = "kvxfer.vllm spec 1"

#: Written by a worker in its rank's directory: its block geometry, for the manager to
#: make the store with.
GEOMETRY_FILE = "geometry.json"
#: Written by the manager in a store's directory: the store's settings, for the workers to
#: open it with.
CONFIG_FILE = "config.json"
#: Appended to by a worker in a store's directory: keys (hex) whose block failed its check
#: on a load, for the manager to remove when it next opens the store.
FAILED_FILE = "failed-loads"


def engine_fields(offloading_spec: Any, extra: str) -> Dict[str, Any]:
    """The fingerprint of an engine's stores: the tier's fields with this format and the
    bytes a worker keeps per block."""
    return fingerprint(offloading_spec, offloading_spec.config.worker_kv_bytes_per_block, extra, _FORMAT)


def rank_fields(offloading_spec: Any, rank: int, extra: str) -> Dict[str, Any]:
    """The fingerprint of rank `rank`'s store: the engine's and the rank."""
    return {**engine_fields(offloading_spec, extra), "rank": rank}


def generation_store(rank_directory: str, generation: int) -> str:
    """Where rank's store of `generation` lives."""
    return os.path.join(rank_directory, f"store-{generation}")


def read_generation(path: str, directories: Sequence[str]) -> int:
    """The engine's store generation, from the file at `path` (0 where there is none). A
    file that does not hold a number starts a generation past every store found, so
    nothing stored before it loads."""
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        return 0
    try:
        return int(text)
    except ValueError:
        found = [int(n[6:]) for d in directories if os.path.isdir(d) for n in os.listdir(d) if n.startswith("store-") and n[6:].isdigit()]
        log.warning("kvxfer offloading: %s holds no generation number (%r); starting past every store found", path, text[:40])
        return max(found, default=0) + 1


def write_generation(path: str, generation: int) -> None:
    """Replaces the generation file whole and durably: it is what a reset commits to."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(f"{generation}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


#: The spec's keys of `kv_connector_extra_config`.
SPEC_SETTINGS = ("root_dir", "capacity_bytes", "capacity_blocks", "shards", "durable", "buffered", "verify_on_open", "namespace", "engine")
#: vLLM's own keys there, which its OffloadingConnector and offloading specs read (the
#: same in every supported version).
VLLM_SETTINGS = (
    "spec_name",
    "spec_module_path",
    "block_size",
    "blocks_per_chunk",
    "canonical_layout",
    "offload_prompt_only",
    "self_describing_kv_events",
    "sync_load_budget_bytes",
    "cpu_bytes_to_use",
    "eviction_policy",
    "max_tracker_size",
    "store_threshold",
    "secondary_tiers",
    "tier_poll_interval_s",
    "backpressure",
    "enable_telemetry",
    "connectors",
)


class _Settings:
    """The spec's keys of `kv_connector_extra_config`, checked once."""

    def __init__(self, offloading_spec: Any):
        x = offloading_spec.extra_config
        c = offloading_spec.config
        if "shared" in x:
            # Its workers move blocks through slot handles of a store the scheduler owns,
            # and a shared tier's reads run in the store's owner.
            raise InvalidArgument(
                'KvxferOffloadingSpec has no "shared" tier: its GPU workers move blocks through slots its scheduler hands out; '
                'put kvxfer\'s tier (kvxfer.vllm.KvxferTier) under vLLM\'s CPU tier to share KV across instances'
            )
        unknown = sorted(k for k in x if k not in SPEC_SETTINGS and k not in VLLM_SETTINGS)
        if unknown:
            raise InvalidArgument(f"KvxferOffloadingSpec: unknown kv_connector_extra_config key(s) {', '.join(unknown)}; its keys are {', '.join(SPEC_SETTINGS)}")
        if not x.get("root_dir"):
            raise InvalidArgument('KvxferOffloadingSpec needs "root_dir" (the stores\' directory) in kv_connector_extra_config')
        if c.cache.blocks_per_chunk != 1:
            raise Unsupported(
                f"KvxferOffloadingSpec stores one GPU block per key, but blocks_per_chunk is {c.cache.blocks_per_chunk}: "
                'leave "block_size" and "blocks_per_chunk" out of kv_connector_extra_config'
            )
        if c.canonical_layout:
            raise Unsupported('KvxferOffloadingSpec stores each rank\'s own pages: leave "canonical_layout" out of kv_connector_extra_config')
        if (x.get("capacity_bytes") is None) == (x.get("capacity_blocks") is None):
            raise InvalidArgument('KvxferOffloadingSpec needs one of "capacity_bytes" or "capacity_blocks" (GPU blocks per rank) in kv_connector_extra_config')
        self.root_dir = make_root(str(x["root_dir"]), "KvxferOffloadingSpec")
        self.capacity_bytes: Optional[int] = x.get("capacity_bytes")
        if self.capacity_bytes is not None:
            check_room(self.root_dir, int(self.capacity_bytes), "KvxferOffloadingSpec")
        self.capacity_blocks: Optional[int] = x.get("capacity_blocks")
        self.shards = int(x.get("shards", 4))
        self.durable = bool(x.get("durable", False))
        self.buffered = bool(x.get("buffered", False))
        self.verify_on_open = bool(x.get("verify_on_open", False))
        self.namespace = str(x.get("namespace", ""))
        self.engine: Dict[str, Any] = engine_settings(x.get("engine"), self.buffered)
        #: Whether vLLM publishes KV events (and takes the manager's).
        self.kv_events = bool(offloading_spec.kv_events_config.enable_kv_cache_events)
        p = c.parallel
        engine = engine_fields(offloading_spec, self.namespace)
        #: Whether every rank holds the same KV, as vLLM says of MLA's latent with tensor
        #: parallelism on one node (`replicated_layout`): then one store, of the engine's
        #: fingerprint, serves every rank; else each rank has a store of its own.
        self.replicated = bool(offloading_spec.replicated_layout)
        if self.replicated:
            self.fields = [engine]
            suffixes = ["_replicated"]
        else:
            self.fields = [rank_fields(offloading_spec, r, self.namespace) for r in range(p.world_size)]
            suffixes = [f"_rank{r}" for r in range(p.world_size)]
        self.namespaces = [namespace_of(f) for f in self.fields]
        self.directories = [store_directory(self.root_dir, f, ns, p.data_parallel_index, x) for f, ns, x in zip(self.fields, self.namespaces, suffixes)]
        #: The engine's store generation (`read_generation`), beside its ranks' directories.
        self.generation_file = store_directory(self.root_dir, engine, namespace_of(engine), p.data_parallel_index, ".generation")

    def store_of(self, rank: int) -> int:
        """The index of the store rank `rank` moves blocks of (in `directories`)."""
        return 0 if self.replicated else rank

    def capacity(self, block_bytes: Sequence[int]) -> int:
        """Blocks per store: `capacity_blocks`, or `capacity_bytes` over a block of
        every store (the stores keep the same keys)."""
        return capacity_blocks(self.capacity_blocks, self.capacity_bytes, sum(block_bytes), "blocks", "kv_connector_extra_config (a block is one GPU block of each store: every rank's, or the one store of replicated KV)")


def _write_json(path: str, value: Dict[str, Any]) -> None:
    """Replaces `path` whole (a reader never sees half a file)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(value, f, indent=2, sort_keys=True)
    os.replace(tmp, path)


def _read_json(path: str) -> Optional[Dict[str, Any]]:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def _geometry(d: Dict[str, Any]) -> LayoutConfig:
    return LayoutConfig(num_blocks=0, num_layers=d["num_layers"], outer_dim=1, page_size=1, inner_dim=d["page_bytes"], dtype_bytes=1, kind="layer_block_first")


def make_spec_classes() -> Dict[str, type]:
    """`KvxferOffloadingSpec` and the classes vLLM meets through it, subclasses of vLLM's
    (imported here, its version checked)."""
    version = check_vllm_version()
    try:
        from vllm.v1.kv_offload.base import (
            LoadStoreSpec,
            Locality,
            LookupResult,
            Medium,
            OffloadingEvent,
            OffloadingManager,
            OffloadingSpec,
            OffloadingWorker,
            PrepareStoreOutput,
            RequestOffloadingContext,
            TransferResult,
        )
        from vllm.v1.metrics.cache_hit_source import CacheHitSource
    except ImportError as e:
        raise Unsupported(f"vLLM {version} is installed but its offloading modules do not import ({e}); kvxfer.vllm needs them") from e

    from .. import Reservation

    class KvxferSlots(LoadStoreSpec):
        """What a load or store job moves, from the manager to the workers: the store keys,
        for each store a slot handle per key (None: nothing to move there), and the store
        generation the handles are of."""

        def __init__(self, keys: List[bytes], handles: List[List[Any]], generation: int):
            self.keys = keys
            self.handles = handles
            self.generation = generation

        def __repr__(self) -> str:
            return f"KvxferSlots({len(self.keys)} keys, {len(self.handles)} ranks)"

    class KvxferOffloadingManager(OffloadingManager):
        """The index side, in the scheduler process: one store per rank, owned here."""

        def __init__(self, settings: _Settings):
            self._s = settings
            self._engine = Engine("emulated", **settings.engine)
            self._stores: List[Store] = []
            #: Store key -> each rank's write handle (None: held there), until the
            #: workers report the store job.
            self._writing: Dict[bytes, List[Any]] = {}
            #: Store key -> leases taken per rank by loads not yet complete.
            self._leased: Dict[bytes, List[int]] = {}
            #: The stores' generation: `store-<generation>` in each rank's directory.
            self._generation = read_generation(settings.generation_file, settings.directories)
            #: What the stores hold as reported in KV events (a block is held where every
            #: rank's store holds it), once they are open and where vLLM publishes KV
            #: events; and the events of stores given up (a reset) not yet taken.
            self._holdings: Optional[Holdings] = None
            self._given_up: List[Event] = []
            if settings.kv_events:
                need_holdings()  # refused at the start, not at the first lookup

        # -- the stores ------------------------------------------------------------
        def _ready(self) -> bool:
            """Opens the stores once every worker has published its geometry."""
            if self._stores:
                return True
            s = self._s
            found = [_read_json(os.path.join(d, GEOMETRY_FILE)) for d in s.directories]
            if any(g is None for g in found):
                return False
            geometries = [_geometry(g) for g in found]  # type: ignore[arg-type]
            capacity = s.capacity([g.block_bytes for g in geometries])
            self._remove_other_generations()
            stores: List[Store] = []
            try:
                for d, geometry, ns in zip(s.directories, geometries, s.namespaces):
                    at = generation_store(d, self._generation)
                    stores.append(
                        open_or_remake(
                            lambda: Store(
                                self._engine,
                                at,
                                geometry,
                                capacity,
                                namespace=ns,
                                durable=s.durable,
                                buffered=s.buffered,
                                verify_on_open=s.verify_on_open,
                                shards=s.shards,
                            ),
                            at,
                            "kvxfer offloading",
                        )
                    )
            except BaseException:
                for st in stores:
                    st.close()
                raise
            for d, fields in zip(s.directories, s.fields):
                _write_json(os.path.join(generation_store(d, self._generation), CONFIG_FILE), {**fields, "capacity_blocks": capacity, "shards": s.shards})
            self._stores = stores
            self._remove_failed()
            if s.kv_events:
                self._holdings = Holdings(stores)
            log.info("kvxfer offloading: %d stores of %d blocks under %s (generation %d)", len(stores), capacity, s.root_dir, self._generation)
            return True

        def _remove_other_generations(self) -> None:
            """Removes every rank's stores of other generations: those a reset left (it
            removes them after it commits the new generation, which a crash may cut)."""
            keep = os.path.basename(generation_store("", self._generation))
            for d in self._s.directories:
                for name in os.listdir(d) if os.path.isdir(d) else []:
                    if name.startswith("store-") and name != keep:
                        shutil.rmtree(os.path.join(d, name), ignore_errors=True)

        def store_directory(self, rank: int) -> str:
            """Where rank `rank`'s store of the current generation lives."""
            return generation_store(self._s.directories[rank], self._generation)

        def _remove_failed(self) -> None:
            """Removes, from every rank, the keys a worker found corrupt on a load."""
            keys = set()
            for r in range(len(self._s.directories)):
                path = os.path.join(self.store_directory(r), FAILED_FILE)
                try:
                    with open(path) as f:
                        keys.update(bytes.fromhex(line.strip()) for line in f if line.strip())
                except FileNotFoundError:
                    continue
                os.unlink(path)
            if keys:
                for st in self._stores:
                    st.remove(sorted(keys))
                log.warning("kvxfer offloading: removed %d keys that failed their check on a load", len(keys))

        # -- lookups and loads -----------------------------------------------------
        def lookup(self, key: Any, req_context: Any) -> Any:
            if not self._ready():
                return LookupResult.MISS
            k = [store_key(key)]
            if all(st.lookup(k)[0][0] for st in self._stores):
                if self._holdings is not None and k[0] not in self._writing:
                    for r in range(len(self._stores)):
                        self._holdings.found(r, [(k[0], key)], req_context)
                return LookupResult.HIT
            return LookupResult.MISS

        def get_load_source(self, key: Any, req_context: Any) -> Any:
            return CacheHitSource.DISK

        def prepare_load(self, keys: Any, req_context: Any) -> Any:
            skeys = [store_key(k) for k in keys]
            unique = list(dict.fromkeys(skeys))
            per_rank = []
            for r, st in enumerate(self._stores):
                leased = dict(zip(unique, st.lease_slots(unique)))
                for k, h in leased.items():
                    if h is not None:
                        self._leased.setdefault(k, [0] * len(self._stores))[r] += 1
                per_rank.append([leased[k] for k in skeys])
            if self._holdings is not None:
                self._holdings.touched(unique)
            return KvxferSlots(skeys, per_rank, self._generation)

        def complete_load(self, keys: Any, req_context: Any) -> None:
            skeys = list(dict.fromkeys(store_key(k) for k in keys))
            self._release(skeys, self._leased)
            if self._holdings is not None:
                self._holdings.touched(skeys)  # an entry's last lease lists it as the newest

        def _release(self, keys: Any, leased: Dict[bytes, List[int]]) -> None:
            for k in keys:
                counts = leased.get(k)
                if counts is None:
                    continue
                for r, st in enumerate(self._stores):
                    if counts[r]:
                        st.release_leases([k])
                        counts[r] -= 1
                if not any(counts):
                    del leased[k]

        # -- stores ------------------------------------------------------------------
        def prepare_store(self, keys: Any, req_context: Any) -> Any:
            if not self._ready():
                return None
            offered = list(dict.fromkeys(keys))
            skeys = [store_key(k) for k in offered]
            fresh = [k for k in skeys if k not in self._writing]
            reservations = [dict(zip(fresh, st.reserve_slots(fresh))) for st in self._stores]
            if self._holdings is not None:
                # A reservation touches the keys held already, and may evict others.
                by_skey = dict(zip(skeys, offered))
                for r, res in enumerate(reservations):
                    self._holdings.met(r, [(k, by_skey[k]) for k, x in res.items() if x.kind == Reservation.HELD], req_context)
                self._holdings.reconcile()
            to_store, handles, abort, no_room = [], [[] for _ in self._stores], [[] for _ in self._stores], 0
            for key, k in zip(offered, skeys):
                if k not in reservations[0]:
                    continue
                kinds = [res[k].kind for res in reservations]
                if all(kind == Reservation.HELD for kind in kinds):
                    continue
                if any(kind in (Reservation.NO_ROOM, Reservation.IN_FLIGHT) for kind in kinds):
                    no_room += Reservation.NO_ROOM in kinds
                    for r, res in enumerate(reservations):
                        if res[k].kind == Reservation.WRITE:
                            abort[r].append(res[k].handle)
                    continue
                to_store.append(key)
                rank_handles = [res[k].handle if res[k].kind == Reservation.WRITE else None for res in reservations]
                self._writing[k] = rank_handles
                for r, h in enumerate(rank_handles):
                    handles[r].append(h)
            for st, hs in zip(self._stores, abort):
                if hs:
                    st.abort_slots(hs)
            if not to_store and no_room:
                return None
            return PrepareStoreOutput(keys_to_store=to_store, store_spec=KvxferSlots([store_key(k) for k in to_store], handles, self._generation), evicted_keys=[])

        def complete_store(self, keys: Any, req_context: Any, success: bool = True) -> None:
            done = [(k, self._writing.pop(k)) for k in dict.fromkeys(store_key(x) for x in keys) if k in self._writing]
            if not done:
                return
            failed = set()
            by_skey = {store_key(x): x for x in keys}
            for r, st in enumerate(self._stores):
                mine = [(k, hs[r]) for k, hs in done if hs[r] is not None]
                if not mine:
                    continue
                if not success:
                    st.abort_slots([h for _, h in mine])
                    continue
                stored = []
                for (k, _), err in zip(mine, st.commit_slots([h for _, h in mine])):
                    if err is not None:
                        log.warning("kvxfer offloading: rank %d did not store key %s: %s", r, k.hex(), err)
                        failed.add(k)
                    else:
                        stored.append((k, by_skey[k]))
                if self._holdings is not None:
                    self._holdings.committed(r, stored, req_context)
            if failed:
                # A key is loadable only where every rank holds it: drop the others' parts.
                gone = sorted(failed)
                for r, st in enumerate(self._stores):
                    errors = st.remove(gone)
                    if self._holdings is not None:
                        self._holdings.removed(r, gone, errors)

        # -- the rest of vLLM's calls --------------------------------------------------
        def on_new_request(self, req_context: Any) -> Any:
            return RequestOffloadingContext()

        def reset_cache(self) -> None:
            """Starts a new store generation (vLLM resets its caches when the weights
            change, and on sleep and wake): nothing stored before loads again, whoever
            stored it, also after a restart. The generation file commits it; the old
            stores are closed, and the new ones made empty on the next lookup or store.
            Jobs in flight were handed out from the old stores and the workers end them
            there (vLLM drops their reports), so the old stores' files are removed only
            once vLLM says the workers reported them (`on_reset_flushed`), or at the
            next start."""
            self._writing, self._leased = {}, {}
            if self._holdings is not None:
                self._given_up += self._holdings.drop_all()
                self._holdings = None
            stores, self._stores = self._stores, []
            for st in stores:
                st.close()
            self._generation += 1
            write_generation(self._s.generation_file, self._generation)
            log.info("kvxfer offloading: cache reset: store generation %d under %s", self._generation, self._s.root_dir)

        def on_reset_flushed(self) -> None:
            self._remove_other_generations()

        def take_events(self) -> List[Any]:
            """The blocks stored into and removed from the stores since the last call (a
            commit on every rank; an eviction, a removal, a failed check on any, every
            block at a reset), medium STORAGE, local to this engine; none where vLLM
            publishes no KV events."""
            taken, self._given_up = self._given_up, []
            if self._holdings is not None:
                taken += self._holdings.take()
            return offloading_events(OffloadingEvent, taken, medium=Medium.STORAGE, locality=Locality.LOCAL, removal_expected=True)

        def shutdown(self) -> None:
            for st in self._stores:
                st.close()
            self._stores = []
            self._engine.close()

    class KvxferOffloadingWorker(OffloadingWorker):
        """The data side, in a GPU worker process: this rank's store, opened for data
        only, and vLLM's KV tensors as kvxfer layouts."""

        def __init__(self, settings: _Settings, rank: int, kv_caches: Any):
            self._s = settings
            self._rank = rank
            #: The store this rank moves blocks of: its own, or the one every rank shares.
            self._store_index = settings.store_of(rank)
            self._dir = settings.directories[self._store_index]
            # vLLM tells how each rank's page maps into a canonical page wherever it can
            # (a ref's `mapping`), whether or not `canonical_layout` asks for such pages:
            # the spec refuses that setting, and stores each rank's own pages as they are.
            tensors = [(t.tensor, t.page_size_bytes) for t in kv_caches.tensors]
            groups = [[ref.tensor_idx for ref in refs] for refs in kv_caches.group_data_refs]
            self._blocks = JobBlocks([as_pages(t, p) for t, p in tensors], groups)
            self._engine = engine_for([t for t, _ in tensors], settings.engine)
            try:
                self._mover = SlotMover(self._engine, tensors, groups)
            except BaseException:
                self._engine.close()
                raise
            os.makedirs(self._dir, exist_ok=True)
            g = self._mover.geometry
            _write_json(os.path.join(self._dir, GEOMETRY_FILE), {"num_layers": g.num_layers, "page_bytes": g.inner_dim})
            #: This rank's stores by generation, opened for data only.
            self._stores: Dict[int, Store] = {}
            self._jobs: Dict[int, Tuple[SlotJob, KvxferSlots, bool, float]] = {}
            self._finished: List[Any] = []

        def _open(self, generation: int) -> Store:
            """This rank's store of `generation`, opened for data only on the first job of
            it (the manager has made it by then: the job's handles come from it)."""
            store = self._stores.get(generation)
            if store is None:
                d = generation_store(self._dir, generation)
                cfg = _read_json(os.path.join(d, CONFIG_FILE))
                if cfg is None:
                    raise InvalidArgument(f"{d} has no {CONFIG_FILE}: the scheduler's kvxfer manager has not opened this rank's store")
                store = Store(
                    self._engine,
                    d,
                    self._mover.geometry,
                    cfg["capacity_blocks"],
                    namespace=self._s.namespaces[self._store_index],
                    create=False,
                    durable=self._s.durable,
                    buffered=self._s.buffered,
                    shards=cfg["shards"],
                    data_only=True,
                )
                self._stores[generation] = store
            return store

        def _close_old(self) -> None:
            """Closes the stores of generations before the newest once no job uses them
            (a reset's jobs in flight end on the store they started on)."""
            newest = max(self._stores, default=0)
            busy = {slots.generation for _, slots, *_ in self._jobs.values()}
            for g in [g for g in self._stores if g < newest and g not in busy]:
                self._stores.pop(g).close()

        def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
            return self._submit(job_id, src_spec, dst_spec, False)

        def submit_load(self, job_id: int, src_spec: Any, dst_spec: Any, expedited: bool = False) -> bool:
            return self._submit(job_id, dst_spec, src_spec, True)

        def _submit(self, job_id: int, gpu: Any, slots: Any, is_load: bool) -> bool:
            """Starts the job; a call the store refuses fails every block of it (reported
            by `get_finished`, as vLLM polls for it). `gpu` is the job's GPU side as the
            installed vLLM passes it (`JobBlocks`). A load moves as latency-critical
            transfers, ahead of stores: a request waits for its load (an expedited one
            within the step), and for no store."""
            assert isinstance(slots, KvxferSlots)
            handles = slots.handles[self._store_index]
            try:
                block_ids, group_sizes = self._blocks(gpu)
                store = self._open(slots.generation)
                if is_load:
                    job = self._mover.read(store, handles, block_ids, group_sizes, critical=True)
                else:
                    job = self._mover.write(store, block_ids, group_sizes, handles)
            except Error as e:
                job = SlotJob(len(slots.keys), [], [(i, e) for i in range(len(slots.keys))])
            self._jobs[job_id] = (job, slots, is_load, time.monotonic())
            return True

        def get_finished(self) -> List[Any]:
            out, self._finished = self._finished, []
            for job_id in [j for j, (job, *_) in self._jobs.items() if job.done()]:
                out.append(self._result(job_id))
            self._close_old()
            return out

        def wait(self, job_ids: Any) -> None:
            for j in job_ids:
                if j in self._jobs:
                    self._jobs[j][0].wait()

        def _result(self, job_id: int) -> Any:
            """A store job succeeds whatever its blocks did: the manager commits a slot
            only if its write completed, so a failed write is a key not stored. A load
            that failed for any block fails: vLLM's KV for it is not what was stored.
            Only a block that failed its check (`IntegrityError`) is named in
            `failed-loads` for removal: one that failed otherwise (an I/O error, the
            engine's admission limit) may be sound, and loads at the next start."""
            job, slots, is_load, started = self._jobs.pop(job_id)
            results = job.results()
            bad = [(k, e) for k, e in zip(slots.keys, results) if e is not None]
            log_failures(log, f"kvxfer offloading: rank {self._rank}'s {'load' if is_load else 'store'} job", slots.keys, results)
            damaged = [k for k, e in bad if isinstance(e, IntegrityError)]
            if is_load and damaged:
                path = os.path.join(generation_store(self._dir, slots.generation), FAILED_FILE)
                try:
                    with open(path, "a") as f:
                        f.writelines(f"{k.hex()}\n" for k in damaged)
                except OSError as e:
                    log.warning("kvxfer offloading: rank %d could not list %d damaged keys in %s (%s); they stay stored and fail their check again", self._rank, len(damaged), path, e)
            moved = sum(1 for h, e in zip(slots.handles[self._store_index], results) if h is not None and e is None)
            return TransferResult(job_id=job_id, success=not (is_load and bad), transfer_size=moved * self._mover.block_bytes, transfer_time=time.monotonic() - started)

        def shutdown(self) -> None:
            for job, *_ in self._jobs.values():
                job.wait()
                job.results()
            self._jobs = {}
            for store in self._stores.values():
                store.close()
            self._stores = {}
            self._mover.close()
            self._engine.close()

    class KvxferOffloadingSpec(OffloadingSpec):
        """vLLM's offloading straight between GPU memory and kvxfer stores. Keys of
        `kv_connector_extra_config` (beside `spec_name` and `spec_module_path`):
        `root_dir` (required), `capacity_bytes` (all ranks together) or `capacity_blocks`
        (GPU blocks per rank) (one required), `shards` (data files per rank, default 4),
        `durable`, `buffered`, `verify_on_open`, `namespace` (added to the fingerprint),
        `engine` (kvxfer engine settings)."""

        def __init__(self, config: Any):
            super().__init__(config)
            # Where every rank holds the same KV, vLLM's connector then has rank 0 alone
            # store (the others report their store jobs done without running them) and
            # every rank load; the fingerprint records it.
            self.replicated_layout = bool(config.replicated_layout)
            self._settings = _Settings(self)
            self._manager: Optional[KvxferOffloadingManager] = None
            self._worker: Optional[KvxferOffloadingWorker] = None

        def get_manager(self) -> Any:
            if self._manager is None:
                self._manager = KvxferOffloadingManager(self._settings)
            return self._manager

        def get_worker(self, kv_caches: Any) -> Any:
            if self._worker is None:
                self._worker = KvxferOffloadingWorker(self._settings, self.config.parallel.rank, kv_caches)
            return self._worker

    classes: Dict[str, type] = {}
    for cls in (KvxferSlots, KvxferOffloadingManager, KvxferOffloadingWorker, KvxferOffloadingSpec):
        cls.__module__ = "kvxfer.vllm"
        cls.__qualname__ = cls.__name__
        classes[cls.__name__] = cls
    return classes
