"""kvxfer as a vLLM secondary KV tier: `KvxferTier`, a `SecondaryTierManager` of vLLM's
tiered offloading (`vllm/v1/kv_offload/tiering/`) backed by a kvxfer `Store`, so chunks
cascade from vLLM's CPU tier to disk or tmpfs and come back by their block keys.

vLLM loads it by module path, without a fork::

    "secondary_tiers": [{"type": "KvxferTier", "module_path": "kvxfer.vllm",
                         "root_dir": "/mnt/nvme/kv", "capacity_bytes": 500000000000}]

It runs in vLLM's scheduler process, where the CPU tier is one memoryview of
`(num_chunks, chunk_bytes)`: that memory is registered once as a kvxfer host layout, and a
chunk moves between it and the store as one block. vLLM (the version in `SUPPORTED_VLLM`)
is imported by `make_tier_class`, when vLLM first asks `kvxfer.vllm` for the tier. See
docs/vllm.md."""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set

from ..engine import Engine
from ..errors import Error, InvalidArgument, NotFound, Unsupported
from ..holdings import Holdings
from ..store import Store, StoreRequest
from ..tier import capacity_blocks as capacity_blocks_of
from ..tier import chunk_layout, engine_settings, log_failures, make_root, open_or_remake, shared_tier, store_key
from .events import offloading_events
from .namespace import fingerprint, namespace_of, store_directory
from .version import check_vllm_version

log = logging.getLogger("kvxfer.vllm")


#: The tier's keys of its tier config (beside vLLM's `type`, `module_path` and
#: `backpressure`, which vLLM takes out first).
TIER_SETTINGS = ("root_dir", "capacity_bytes", "capacity_blocks", "shards", "durable", "buffered", "verify_on_open", "namespace", "engine", "locality", "enable_kv_events", "shared")


@dataclass
class _Job:
    """A store or load job in flight: the vLLM job, and the store request moving it."""

    job: Any
    keys: List[Any]
    request: StoreRequest
    is_load: bool
    submitted: float
    #: A load's store keys the store did not hold at its submit: those it loads come from
    #: the shared tier (reported once admitted), where KV events are on.
    remote: Set[bytes] = field(default_factory=set)


def make_tier_class() -> type:
    version = check_vllm_version()
    import numpy as np  # a dependency of vLLM's

    try:
        from vllm.v1.kv_offload.base import Locality, LookupResult, Medium, OffloadingEvent, RequestOffloadingContext
        from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager
    except ImportError as e:
        raise Unsupported(f"vLLM {version} is installed but its tiering modules do not import ({e}); kvxfer.vllm needs them", 5) from e

    class KvxferTier(SecondaryTierManager):
        """A vLLM secondary tier in a kvxfer store. Tier config keys (beside `type`,
        `module_path` and vLLM's `backpressure`): `root_dir` (required), `capacity_bytes`
        or `capacity_blocks` (required; chunks), `shards` (data files, default 4),
        `durable`, `buffered` (tmpfs or page-cache I/O), `verify_on_open`, `namespace`
        (added to the fingerprint), `engine` (kvxfer engine settings: `io_threads`,
        `io_backend`, ...), `locality`, `enable_kv_events` (default true: where vLLM
        publishes KV events, the tier reports the chunks it stores and removes, medium
        STORAGE)."""

        medium = Medium.STORAGE

        def __init__(
            self,
            offloading_spec: Any,
            primary_kv_view: memoryview,
            tier_type: str,
            root_dir: str,
            capacity_bytes: Optional[int] = None,
            capacity_blocks: Optional[int] = None,
            shards: int = 4,
            durable: bool = False,
            buffered: bool = False,
            verify_on_open: bool = False,
            namespace: str = "",
            engine: Optional[Dict[str, Any]] = None,
            locality: Optional[str] = None,
            enable_kv_events: bool = True,
            shared: Optional[Dict[str, Any]] = None,
            backpressure_detector: Any = None,
            **unknown: Any,
        ) -> None:
            if unknown:
                raise InvalidArgument(f"the kvxfer tier has no setting {', '.join(sorted(unknown))}; its tier config keys are {', '.join(TIER_SETTINGS)}")
            super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
            self.locality = Locality(locality) if locality is not None else None
            rows = np.asarray(primary_kv_view)
            if rows.ndim != 2 or rows.itemsize != 1:
                raise InvalidArgument(f"vLLM's CPU tier view has shape {rows.shape} of {rows.dtype}; the kvxfer tier expects (num_chunks, chunk_bytes) bytes")
            num_chunks, chunk_bytes = rows.shape
            make_root(root_dir, "kvxfer tier")
            shared_cfg = shared_tier("kvxfer tier", shared)
            self._fields = fingerprint(offloading_spec, chunk_bytes, namespace)
            self.namespace = namespace_of(self._fields)
            self.directory = store_directory(root_dir, self._fields, self.namespace, offloading_spec.config.parallel.data_parallel_index)
            os.makedirs(self.directory, exist_ok=True)
            self._config = chunk_layout(num_chunks, chunk_bytes)
            # The scheduler process moves host memory only: no CUDA context there.
            self._engine = Engine("emulated", **engine_settings(engine, buffered))
            try:
                self._primary = self._engine.register(rows, self._config)
                blocks = capacity_blocks_of(capacity_blocks, capacity_bytes, chunk_bytes, "blocks", "its tier config (a block is a chunk of the CPU tier)")
                self._store = open_or_remake(
                    lambda: Store(
                        self._engine,
                        self.directory,
                        self._config,
                        blocks,
                        namespace=self.namespace,
                        durable=durable,
                        buffered=buffered,
                        verify_on_open=verify_on_open,
                        shards=shards,
                        shared=shared_cfg,
                    ),
                    self.directory,
                    f"kvxfer tier {tier_type}",
                )
                #: What the tier has reported held, where vLLM publishes KV events; None
                #: where it does not (vLLM then never takes them).
                self._holdings = Holdings([self._store]) if enable_kv_events and offloading_spec.kv_events_config.enable_kv_cache_events else None
                #: Whether a load from the shared tier is admitted into the store.
                self._admits = shared_cfg is not None and shared_cfg.admit
            except BaseException:
                self._engine.close()
                raise
            with open(os.path.join(self.directory, "config.json"), "w") as f:
                json.dump(self._fields, f, indent=2, sort_keys=True)
            self._jobs: List[_Job] = []
            self._finished: List[Any] = []
            #: Store key -> store jobs in flight putting it (a hit on such a key is the
            #: job's entry, reported when the job ends).
            self._putting: Dict[bytes, int] = {}
            log.info("kvxfer tier %s: store %s, %d chunks of %d bytes", tier_type, self.directory, self._store.stats().capacity, chunk_bytes)

        # -- index -------------------------------------------------------------
        def lookup(self, key: Any, req_context: Any) -> Any:
            skey = store_key(key)
            present, _ = self._store.lookup([skey])
            if present[0] and self._holdings is not None and skey not in self._putting:
                self._holdings.found(0, [(skey, key)], req_context)
            return LookupResult.HIT if present[0] else LookupResult.MISS

        def take_events(self) -> List[Any]:
            """The chunks stored into and removed from the store since the last call
            (a commit, a chunk loaded from the shared tier found admitted; an eviction, a
            removal, a failed check), medium STORAGE, named by this tier's type; none
            where vLLM publishes no KV events."""
            if self._holdings is None:
                return []
            self._holdings.admitted()
            return offloading_events(
                OffloadingEvent, self._holdings.take(), medium=self.medium, locality=self.locality or Locality.LOCAL, ownership=self.tier_type, removal_expected=True
            )

        def on_new_request(self, req_context: Any) -> Any:
            return RequestOffloadingContext()

        # -- jobs --------------------------------------------------------------
        def submit_store(self, job_metadata: Any) -> None:
            self._submit(job_metadata, False)

        def submit_load(self, job_metadata: Any) -> None:
            self._submit(job_metadata, True)

        def _submit(self, job: Any, is_load: bool) -> None:
            """Starts the job's put or get; a call the store refuses (a closed store, a
            chunk id past the CPU tier) is a failed job, reported by the next poll. A get
            is latency-critical (a request waits for it), a put bulk."""
            keys = list(job.keys)
            skeys = [store_key(k) for k in keys]
            holdings = self._holdings
            remote: Set[bytes] = set()
            try:
                if is_load:
                    if holdings is not None and self._admits:
                        # What the store misses comes from the shared tier, admitted after.
                        unknown = [s for s in skeys if not holdings.knows(0, s)]
                        remote = {s for s, p in zip(unknown, holdings.held(0, unknown)) if not p}
                    r = self._store.get(skeys, self._primary, job.chunk_ids, critical=True)
                else:
                    if holdings is not None:
                        # The put touches the keys held already: those from before this
                        # process are met here (the put then only dedups them).
                        present = holdings.held(0, skeys)
                        holdings.met(0, [(s, k) for s, k, p in zip(skeys, keys, present) if p and s not in self._putting], job.req_context)
                    r = self._store.put(self._primary, job.chunk_ids, skeys)
            except Error as e:
                log.warning("kvxfer tier: a %s job of %d chunks was refused: %s", "load" if is_load else "store", len(keys), e)
                self._finished.append(JobResult(job_id=job.job_id, success=False, transfer_bytes=0))
                return
            if holdings is not None:
                if is_load:
                    holdings.touched(skeys)
                else:
                    holdings.reconcile()  # the put's evictions
                    for s in skeys:
                        self._putting[s] = self._putting.get(s, 0) + 1
            self._jobs.append(_Job(job, keys, r, is_load, time.monotonic(), remote))

        def get_finished_jobs(self) -> List[Any]:
            running = []
            for j in self._jobs:
                if j.request.done():
                    self._finished.append(self._result(j))
                else:
                    running.append(j)
            self._jobs = running
            out, self._finished = self._finished, []
            return out

        def _result(self, j: _Job) -> Any:
            """The vLLM result of an ended job: a load that failed for some keys (a miss,
            a failed integrity check) reports the keys that loaded, so vLLM keeps those
            and recomputes only the others."""
            results = j.request.results()
            j.request.release()
            ok = [k for k, e in zip(j.keys, results) if e is None]
            if self._holdings is not None:
                self._note(j, ok, results)
            log_failures(log, f"kvxfer tier: a {'load' if j.is_load else 'store'} job", [bytes(k) for k in j.keys], results, (NotFound,) if j.is_load else ())
            success = len(ok) == len(j.keys)
            return JobResult(
                job_id=j.job.job_id,
                success=success,
                successful_keys=tuple(ok) if (j.is_load and not success and ok) else None,
                transfer_time=time.monotonic() - j.submitted,
                transfer_bytes=len(ok) * self.block_size_bytes,
            )

        def _note(self, j: _Job, ok: List[Any], results: List[Any]) -> None:
            """What an ended job changed in the store: a load may have dropped entries
            that failed their check; a store's keys are held where they still are (an
            entry may be evicted between its commit and this)."""
            holdings = self._holdings
            assert holdings is not None
            if j.is_load:
                # An entry that failed its check was dropped; a get's end lists the
                # others as the newest.
                holdings.reconcile(suspects=[store_key(k) for k, e in zip(j.keys, results) if e is not None])
                holdings.touched(map(store_key, j.keys))
                holdings.loading(0, [(s, k) for s, k in zip(map(store_key, ok), ok) if s in j.remote], j.job.req_context)
                return
            for s in map(store_key, j.keys):
                left = self._putting.pop(s) - 1
                if left:
                    self._putting[s] = left
            skeys = [store_key(k) for k in ok]
            present = holdings.held(0, skeys)
            holdings.committed(0, [(s, k) for s, k, p in zip(skeys, ok, present) if p], j.job.req_context)

        def has_pending_work(self) -> bool:
            return bool(self._jobs or self._finished)

        def drain_jobs(self) -> None:
            """Waits for every job; their results stay for the next `get_finished_jobs`."""
            for j in self._jobs:
                self._finished.append(self._result(j))
            self._jobs = []

        def shutdown(self) -> None:
            """Drains the jobs, closes the store, and lets go of the CPU tier's memory:
            vLLM unmaps it next, which it does only once no array still exports it."""
            self.drain_jobs()
            self._store.close()
            self._primary.close()
            self._engine.close()
            self._primary = self._store = self._engine = None  # type: ignore[assignment]

    KvxferTier.__module__ = "kvxfer.vllm"
    KvxferTier.__qualname__ = "KvxferTier"
    return KvxferTier
