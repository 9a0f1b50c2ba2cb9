"""kvxfer's offloading spec driven by vLLM itself (the installed vLLM, one of
`SUPPORTED_VLLM`, never a copy of its interface): vLLM's `OffloadingSpecFactory` builds
`KvxferOffloadingSpec` from `spec_name` and `spec_module_path`, and the tests make the calls vLLM's
OffloadingConnector makes, in its order: the scheduler side's on the manager (lookup,
prepare_store / complete_store, prepare_load / complete_load), the worker side's on one
worker per rank (submit_store / submit_load, get_finished), with the job specs pickled on
their way from the one to the other as vLLM ships them. CPU tensors shaped as vLLM's
canonical KV caches stand in for GPU memory, on kvxfer's emulated device. Run by
`make integration-test`."""

import dataclasses
import json
import os
import pickle
import subprocess
import sys
import textwrap
import time
import uuid

import pytest
import torch

import kvxfer
from kvx_integration import FAMILIES, ModelFamily, Published, block_of, fill_up, flip_a_byte, record_criticality, small_file_system
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingConnectorMetadata, TransferJob
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import OffloadingConnectorWorker
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCacheTensor,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LookupResult,
    ReqContext,
    get_offload_group_idx,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

try:  # vLLM 0.34.0's connector resolves a job's GPU blocks to device pointers for the worker
    from vllm.v1.kv_offload.pointer_utils import resolve_device_pointers
except ImportError:  # vLLM 0.33.0's passes the GPULoadStoreSpec itself
    resolve_device_pointers = None

LAYERS = 2  # per rank
PAGE = 16 * 1024  # one layer's bytes of one GPU block
GPU_BLOCKS = 16
#: A hang guard only: every wait here ends as soon as the jobs do.
DEADLINE_S = 60.0


def make_config(root, rank=0, world_size=2, model="kvxfer/test-model", events=False, **extra):
    """vLLM's offloading config of a `world_size`-way tensor-parallel model whose
    kv_connector_extra_config names the kvxfer spec by module path (`events`: where vLLM
    publishes KV events)."""
    extra = {"spec_name": "KvxferOffloadingSpec", "spec_module_path": "kvxfer.vllm", "root_dir": str(root), "capacity_blocks": 32, "shards": 2, **extra}
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=tuple(f"model.layers.{i}.attn" for i in range(LAYERS)), group_id=0),),
        worker_kv_bytes_per_block=LAYERS * PAGE,
        enable_kv_cache_events=events,
        extra_config=extra,
        engine_id=f"kvxfer-test-{uuid.uuid4().hex[:12]}",
        model=OffloadingModelConfig(name=model, dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=rank, world_size=world_size, tp_size=world_size, pp_size=1, pcp_size=1, dcp_size=1,
            data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
            is_parallelism_agnostic=False,
        ),
    )


class Engine:
    """One vLLM engine's offloading: a worker per rank (made first, as vLLM registers
    the KV caches before it makes the scheduler) and the scheduler's manager, each from
    a spec of its own, as each process makes one. `caches[rank]` are the rank's KV
    tensors, one `(num_blocks, page)` tensor per layer."""

    def __init__(self, root, world_size=2, **kw):
        self.caches = [[torch.zeros((GPU_BLOCKS, PAGE), dtype=torch.int8) for _ in range(LAYERS)] for _ in range(world_size)]
        self.workers, self.kv_caches = [], []
        for r in range(world_size):
            spec = OffloadingSpecFactory.create_spec(make_config(root, r, world_size, **kw))
            kv = CanonicalKVCaches(
                tensors=[CanonicalKVCacheTensor(tensor=t, page_size_bytes=PAGE) for t in self.caches[r]],
                group_data_refs=[[CanonicalKVCacheRef(tensor_idx=i, page_size_bytes=PAGE) for i in range(LAYERS)]],
            )
            self.kv_caches.append(kv)
            self.workers.append(spec.get_worker(kv))
        self.spec = OffloadingSpecFactory.create_spec(make_config(root, 0, world_size, **kw))
        self.manager = self.spec.get_manager()
        self._job = 0
        self.groups = 1

    def shutdown(self):
        for w in self.workers:
            w.shutdown()
        self.manager.shutdown()

    # -- the worker side ---------------------------------------------------------
    def _run(self, submit, gpu_spec, slots, **kw):
        """Submits a job to every worker, each with its own unpickled copy of the specs
        (the GPU side as the installed vLLM's connector passes it), and polls them until
        each reports it. Returns each rank's TransferResult."""
        self._job += 1
        job = self._job
        for w, kv in zip(self.workers, self.kv_caches):
            g, s = pickle.loads(pickle.dumps((gpu_spec, slots)))
            if resolve_device_pointers is not None:
                g = resolve_device_pointers(g, kv)
            assert getattr(w, submit)(job, *((g, s) if submit == "submit_store" else (s, g)), **kw)
        results = [None] * len(self.workers)
        deadline = time.monotonic() + DEADLINE_S
        while any(r is None for r in results):
            assert time.monotonic() < deadline, "the workers' jobs did not finish"
            for i, w in enumerate(self.workers):
                for r in w.get_finished():
                    assert r.job_id == job
                    results[i] = r
            time.sleep(0.001)
        return results

    # -- the scheduler's sequence ------------------------------------------------
    def _gpu(self, keys, blocks, moved):
        """The GPU side of a job moving keys `moved` of `keys`, to or from their blocks of
        `blocks`: as vLLM's scheduler lists them, in KV cache group order (the order of
        `keys`) with each group's count."""
        sizes = [0] * self.groups
        for k in moved:
            sizes[get_offload_group_idx(k)] += 1
        return GPULoadStoreSpec([blocks[keys.index(k)] for k in moved], group_sizes=sizes, block_indices=[0] * self.groups)

    def offload(self, keys, blocks):
        """A request's blocks `blocks` stored under `keys`. Returns the keys the manager
        took and each rank's TransferResult."""
        m = self.manager
        ctx = ReqContext(req_id=uuid.uuid4().hex)
        with m.lock:
            m.on_new_request(ctx)
            out = m.prepare_store(keys, ctx)
        assert out is not None
        stored = list(out.keys_to_store)
        results = self._run("submit_store", self._gpu(keys, blocks, stored), out.store_spec) if stored else []
        with m.lock:
            m.complete_store(stored, ctx)
            m.on_request_finished(ctx)
        return stored, results

    def lookup(self, keys):
        m = self.manager
        ctx = ReqContext(req_id=uuid.uuid4().hex)
        with m.lock:
            m.on_new_request(ctx)
            return [m.lookup(k, ctx) for k in keys]

    def onboard(self, keys, blocks, expedited=False):
        """The hits of `keys` loaded into GPU blocks `blocks` (`expedited`: as vLLM
        submits a load it waits for within the step). Returns {key: lookup result} and
        each rank's TransferResult (None without a hit)."""
        m = self.manager
        ctx = ReqContext(req_id=uuid.uuid4().hex)
        with m.lock:
            m.on_new_request(ctx)
            found = {k: m.lookup(k, ctx) for k in keys}
        hits = [k for k in keys if found[k] is LookupResult.HIT]
        if not hits:
            return found, None
        with m.lock:
            src = m.prepare_load(hits, ctx)
        results = self._run("submit_load", self._gpu(keys, blocks, hits), src, expedited=expedited)
        with m.lock:
            m.complete_load(set(hits), ctx)
            m.on_request_finished(ctx)
        return found, results


def keys_of(*names):
    """vLLM offload keys: a 32-byte block hash (sha256's size) and group 0."""
    return [make_offload_key(bytes([n]) * 32, 0) for n in names]


def fill(engine, blocks, seed):
    """Distinct bytes in GPU blocks `blocks` of every layer of every rank."""
    g = torch.Generator().manual_seed(seed)
    for layers in engine.caches:
        for t in layers:
            for b in blocks:
                t[b] = torch.randint(-128, 128, (PAGE,), dtype=torch.int8, generator=g)


def snapshot(engine, blocks):
    return [[t[blocks].clone() for t in layers] for layers in engine.caches]


def same(a, b):
    return all(torch.equal(x, y) for la, lb in zip(a, b) for x, y in zip(la, lb))


def clear(engine):
    for layers in engine.caches:
        for t in layers:
            t.zero_()


@pytest.fixture
def engine(tmp_path):
    e = Engine(tmp_path)
    yield e
    e.shutdown()


def test_vllm_builds_the_spec_by_name_and_module_path(engine):
    assert type(engine.spec).__name__ == "KvxferOffloadingSpec" and type(engine.spec).__module__ == "kvxfer.vllm"
    # A store per rank, each of its own namespace: rank 1's pages never answer for rank 0.
    s = engine.spec._settings
    assert len(s.directories) == 2 and s.directories[0].endswith("_rank0") and s.directories[1].endswith("_rank1")
    assert s.namespaces[0] != s.namespaces[1]


@pytest.mark.parametrize("expedited", [False, True], ids=["load", "expedited-load"])
def test_blocks_stored_then_loaded_come_back_exact(engine, expedited):
    keys = keys_of(1, 2, 3, 4)
    fill(engine, [0, 1, 2, 3], seed=1)
    want = snapshot(engine, [0, 1, 2, 3])
    stored, results = engine.offload(keys, [0, 1, 2, 3])
    assert stored == keys and all(r.success and r.transfer_size == 4 * LAYERS * PAGE for r in results)
    clear(engine)
    found, results = engine.onboard(keys, [8, 9, 10, 11], expedited=expedited)
    assert all(found[k] is LookupResult.HIT for k in keys)
    assert all(r.success for r in results)
    assert same(snapshot(engine, [8, 9, 10, 11]), want)


@pytest.mark.skipif(resolve_device_pointers is None, reason="this vLLM passes a worker block ids, not device pointers")
@pytest.mark.parametrize("moved", ["one-byte-past-a-block-start", "second-layer-at-another-block"])
def test_a_load_to_device_pointers_off_the_workers_blocks_fails_and_moves_nothing(engine, monkeypatch, moved):
    """A worker moves whole blocks of the KV caches it registered: device pointers that
    are not the start of one block of each layer of a group fail the job, and no byte
    of GPU memory is written, nowhere the pointers name."""
    keys = keys_of(1, 2)
    fill(engine, [0, 1], seed=2)
    engine.offload(keys, [0, 1])
    clear(engine)
    resolve = resolve_device_pointers

    def moved_pointers(gpu_spec, kv_caches):
        pointers = resolve(gpu_spec, kv_caches)
        ptrs = pointers.ptrs.copy()
        if moved == "one-byte-past-a-block-start":
            ptrs += 1
        else:
            ptrs[len(keys) :] += PAGE
        return dataclasses.replace(pointers, ptrs=ptrs)

    monkeypatch.setitem(globals(), "resolve_device_pointers", moved_pointers)
    found, results = engine.onboard(keys, [8, 9])
    assert all(found[k] is LookupResult.HIT for k in keys)
    assert all(not r.success and r.transfer_size == 0 for r in results)
    assert not any(t.any() for layers in engine.caches for t in layers)


def test_an_engine_at_its_admission_limit_stores_and_loads_every_block(tmp_path):
    """Workers whose engines admit one request at a time: the store's transfers are not
    counted against the limit nor refused for it, so every block of a job spanning every
    shard is stored, and every one loads back exact (vLLM asserts on a failed load)."""
    e = Engine(tmp_path, engine={"max_inflight": 1}, shards=4)
    try:
        keys = keys_of(1, 2, 3, 4, 5, 6, 7, 8)
        fill(e, list(range(8)), seed=3)
        want = snapshot(e, list(range(8)))
        stored, results = e.offload(keys, list(range(8)))
        assert stored == keys and all(r.success for r in results)
        clear(e)
        found, results = e.onboard(keys, list(range(8, 16)))
        assert all(found[k] is LookupResult.HIT for k in keys)
        assert all(r.success for r in results), [r for r in results if not r.success]
        assert same(snapshot(e, list(range(8, 16))), want)
    finally:
        e.shutdown()


def test_loads_are_latency_critical_and_stores_bulk(engine, monkeypatch):
    """A request waits for its load, expedited or not, and for no store: the workers'
    slot reads are critical transfers, their writes bulk."""
    calls = record_criticality(monkeypatch, kvxfer.Store, {"read_slots": "read", "write_slots": "write"})
    keys = keys_of(1, 2)
    fill(engine, [0, 1], seed=8)
    engine.offload(keys, [0, 1])
    engine.onboard(keys, [4, 5])
    engine.onboard(keys, [6, 7], expedited=True)
    assert sorted(set(calls)) == [("read", True), ("write", False)]


def test_a_key_stored_already_is_not_stored_again(engine):
    keys = keys_of(1, 2)
    fill(engine, [0, 1, 2], seed=2)
    engine.offload(keys, [0, 1])
    stored, _ = engine.offload(keys_of(1, 2, 3), [0, 1, 2])
    assert stored == keys_of(3)


def test_a_key_never_stored_is_a_miss_and_the_others_load(engine):
    keys = keys_of(1, 2)
    fill(engine, [0, 1], seed=3)
    want = snapshot(engine, [0, 1])
    engine.offload(keys, [0, 1])
    clear(engine)
    (absent,) = keys_of(9)
    found, results = engine.onboard(keys + [absent], [4, 5, 6])
    assert found[absent] is LookupResult.MISS
    assert all(found[k] is LookupResult.HIT for k in keys) and all(r.success for r in results)
    assert same(snapshot(engine, [4, 5]), want)




def test_a_damaged_block_fails_its_load_and_is_dropped_on_the_next_open(tmp_path):
    keys = keys_of(1, 2, 3)
    e = Engine(tmp_path)
    try:
        fill(e, [0, 1, 2], seed=4)
        e.offload(keys, [0, 1, 2])
        # Key 2's page of layer 0 on rank 1, damaged on disk.
        want = e.caches[1][0][1].numpy().tobytes()
        assert flip_a_byte(e.manager.store_directory(1), want, 1000), "the block is in no data file"
        found, results = e.onboard(keys, [8, 9, 10])
        assert all(found[k] is LookupResult.HIT for k in keys)
        # vLLM's TransferResult of a failed job: rank 1 says its load failed (its KV is
        # not what was stored), rank 0's loaded whole.
        assert results[0].success and results[0].transfer_size == 3 * LAYERS * PAGE
        assert not results[1].success and results[1].transfer_size == 2 * LAYERS * PAGE
    finally:
        e.shutdown()
    # The worker named the key; the next manager to open the stores removes it from
    # every rank, so vLLM computes it again instead of loading it.
    e = Engine(tmp_path)
    try:
        assert e.lookup(keys) == [LookupResult.HIT, LookupResult.MISS, LookupResult.HIT]
    finally:
        e.shutdown()


def test_blocks_failed_in_one_job_are_one_warning_naming_the_cause(engine, caplog):
    keys = keys_of(1, 2, 3)
    fill(engine, [0, 1, 2], seed=16)
    engine.offload(keys, [0, 1, 2])
    for b in (1, 2):
        assert flip_a_byte(engine.manager.store_directory(1), engine.caches[1][0][b].numpy().tobytes(), 1000)
    with caplog.at_level("DEBUG", logger="kvxfer.vllm"):
        _, results = engine.onboard(keys, [8, 9, 10])
    assert results[0].success and not results[1].success
    (line,) = [r.getMessage() for r in caplog.records if r.name == "kvxfer.vllm" and r.levelname == "WARNING"]
    assert "rank 1's load job: 2 of 3 keys failed (IntegrityError" in line


def test_a_load_failed_for_another_reason_than_its_check_keeps_the_key(tmp_path, monkeypatch):
    """Only a block that failed its check is named for removal: a load that failed for
    another reason (here the engine's admission limit) fails its job, and the key, whose
    stored block is sound, still loads after a restart."""
    from kvxfer.vllm.slot_mover import SlotJob

    keys = keys_of(1, 2)
    e = Engine(tmp_path)
    try:
        fill(e, [0, 1], seed=13)
        want = snapshot(e, [0, 1])
        e.offload(keys, [0, 1])
        results_of = SlotJob.results

        def busy_first(job):
            out = results_of(job)
            out[0] = kvxfer.Busy("the engine is at its admission limit", 13)
            return out

        monkeypatch.setattr(SlotJob, "results", busy_first)
        _, results = e.onboard(keys, [4, 5])
        assert not any(r.success for r in results)
        monkeypatch.undo()
    finally:
        e.shutdown()
    e = Engine(tmp_path)
    try:
        clear(e)
        found, results = e.onboard(keys, [0, 1])
        assert [found[k] for k in keys] == [LookupResult.HIT] * 2 and all(r.success for r in results)
        assert same(snapshot(e, [0, 1]), want)
    finally:
        e.shutdown()


def reset(engine):
    """vLLM's cache reset (on a weight update), then its report that the workers have
    reported every job from before it."""
    with engine.manager.lock:
        engine.manager.reset_cache()
        engine.manager.on_reset_flushed()


def test_a_reset_drops_what_was_stored_before_the_last_restart(tmp_path):
    """vLLM resets its caches when the weights change: nothing stored before the reset
    loads again, whoever stored it and after any restart, and the workers, whose stores
    were open before it, store and load after it."""
    keys = keys_of(1, 2)
    e = Engine(tmp_path)
    try:
        fill(e, [0, 1], seed=10)
        e.offload(keys, [0, 1])
    finally:
        e.shutdown()
    e = Engine(tmp_path)
    try:
        assert e.lookup(keys) == [LookupResult.HIT] * 2
        stored, results = e.offload(keys_of(7), [2])  # the workers open their stores
        assert stored == keys_of(7) and all(r.success for r in results)
        reset(e)
        assert e.lookup(keys) == [LookupResult.MISS] * 2
        fill(e, [4, 5], seed=11)
        want = snapshot(e, [4, 5])
        stored, results = e.offload(keys_of(1, 3), [4, 5])
        assert stored == keys_of(1, 3) and all(r.success for r in results)
        clear(e)
        found, results = e.onboard(keys_of(1, 3), [6, 7])
        assert all(found[k] is LookupResult.HIT for k in keys_of(1, 3)) and all(r.success for r in results)
        assert same(snapshot(e, [6, 7]), want)
    finally:
        e.shutdown()
    e = Engine(tmp_path)
    try:
        assert e.lookup(keys_of(1, 2, 3, 7)) == [LookupResult.HIT, LookupResult.MISS, LookupResult.HIT, LookupResult.MISS]
    finally:
        e.shutdown()


def test_a_reset_before_the_stores_open_drops_them_too(tmp_path):
    keys = keys_of(1)
    e = Engine(tmp_path)
    try:
        fill(e, [0], seed=12)
        e.offload(keys, [0])
    finally:
        e.shutdown()
    e = Engine(tmp_path)
    try:
        assert not e.manager._stores, "the stores open on the first lookup"
        reset(e)
        assert e.lookup(keys) == [LookupResult.MISS]
    finally:
        e.shutdown()


def test_a_full_disk_under_the_failed_loads_list_fails_the_job_not_the_worker(tmp_path, caplog):
    """A damaged block whose key cannot be listed for removal (the file system is full):
    the worker still reports the failed job to vLLM, and logs why the key stays."""
    keys = keys_of(1, 2)
    with small_file_system(tmp_path / "fs", 8 << 20) as root:
        e = Engine(root, capacity_blocks=4)
        try:
            fill(e, [0, 1], seed=17)
            e.offload(keys, [0, 1])
            assert flip_a_byte(e.manager.store_directory(1), e.caches[1][0][1].numpy().tobytes(), 1000)
            fill_up(root)
            with caplog.at_level("WARNING", logger="kvxfer.vllm"):
                _, results = e.onboard(keys, [4, 5])
            assert results[0].success and not results[1].success
            assert any("failed-loads" in r.getMessage() and "No space left" in r.getMessage() for r in caplog.records)
        finally:
            e.shutdown()


def test_a_failed_store_job_is_rolled_back(engine):
    keys = keys_of(1, 2)
    m = engine.manager
    ctx = ReqContext(req_id="r")
    with m.lock:
        m.on_new_request(ctx)
        out = m.prepare_store(keys, ctx)
        m.complete_store(out.keys_to_store, ctx, success=False)
    assert engine.lookup(keys) == [LookupResult.MISS, LookupResult.MISS]
    fill(engine, [0, 1], seed=5)
    stored, results = engine.offload(keys, [0, 1])
    assert stored == keys and all(r.success for r in results)
    assert engine.lookup(keys) == [LookupResult.HIT, LookupResult.HIT]


def test_a_store_no_worker_wrote_is_not_committed(engine):
    """The scheduler commits what the workers report; a slot no write completed fails
    its commit, and the key stays a miss."""
    keys = keys_of(1)
    m = engine.manager
    ctx = ReqContext(req_id="r")
    with m.lock:
        m.on_new_request(ctx)
        out = m.prepare_store(keys, ctx)
        m.complete_store(out.keys_to_store, ctx)
    assert engine.lookup(keys) == [LookupResult.MISS]


def held_blocks(engine, keys):
    """The blocks of `keys` every rank's store holds (none before the stores open)."""
    stores = engine.manager._stores
    return {block_of(k) for k in keys if stores and all(st.lookup([k])[0][0] for st in stores)}


def test_the_kv_events_report_what_the_stores_hold(tmp_path):
    """With vLLM's KV events on, the blocks the spec reports (medium STORAGE, through
    vLLM's offloading connector) are those every rank's store holds after every step:
    stores, evictions from stores of four blocks, loads, a store no worker wrote; after a
    restart a block from before is reported once met, and the blocks not met are evicted
    first; a reset removes every block."""
    keys = keys_of(*range(1, 11))
    blocks = lambda *ns: {block_of(keys[n - 1]) for n in ns}  # noqa: E731
    e = Engine(tmp_path, capacity_blocks=4, events=True)
    seen = Published()
    try:
        fill(e, list(range(GPU_BLOCKS)), seed=11)
        e.offload(keys[0:3], [0, 1, 2])
        assert seen.take(e.manager) == held_blocks(e, keys) == blocks(1, 2, 3)
        e.offload(keys[3:6], [3, 4, 5])  # two evictions
        assert seen.take(e.manager) == held_blocks(e, keys) and len(seen.blocks) == 4
        e.onboard(keys[2:4], [8, 9])  # keys 3 and 4 become the most recently used
        e.offload(keys[6:8], [6, 7])
        assert seen.take(e.manager) == held_blocks(e, keys) == blocks(3, 4, 7, 8)
        m, ctx = e.manager, ReqContext(req_id="unwritten")
        with m.lock:  # key 9's slot evicts key 3 or 4 (the load released them in any order)
            m.on_new_request(ctx)
            out = m.prepare_store([keys[8]], ctx)
            m.complete_store(out.keys_to_store, ctx)  # no worker wrote it: not stored
        assert seen.take(e.manager) == held_blocks(e, keys) and len(seen.blocks) == 3 and blocks(7, 8) <= seen.blocks
        kept = 3 if block_of(keys[2]) in seen.blocks else 4
    finally:
        e.shutdown()
    e = Engine(tmp_path, capacity_blocks=4, events=True)
    seen = Published()
    try:
        fill(e, list(range(GPU_BLOCKS)), seed=12)
        found, _ = e.onboard([keys[kept - 1]], [10])  # of the three blocks held, this one is met: reported
        assert found[keys[kept - 1]] is LookupResult.HIT
        assert seen.take(e.manager) == blocks(kept)
        e.offload(keys[8:10], [0, 1])  # evicts the older of the two not met (key 7)
        assert seen.take(e.manager) == blocks(kept, 9, 10)
        assert held_blocks(e, keys) == blocks(kept, 8, 9, 10)
        with e.manager.lock:
            e.manager.reset_cache()
        assert seen.take(e.manager) == held_blocks(e, keys) == set()
        e.offload(keys[0:2], [2, 3])
        assert seen.take(e.manager) == held_blocks(e, keys) == blocks(1, 2)
    finally:
        e.shutdown()


def test_a_restart_of_the_same_configuration_finds_its_blocks(tmp_path):
    keys = keys_of(1, 2, 3)
    e = Engine(tmp_path)
    try:
        fill(e, [0, 1, 2], seed=6)
        want = snapshot(e, [0, 1, 2])
        e.offload(keys, [0, 1, 2])
    finally:
        e.shutdown()
    e = Engine(tmp_path)
    try:
        found, results = e.onboard(keys, [0, 1, 2])
        assert all(found[k] is LookupResult.HIT for k in keys) and all(r.success for r in results)
        assert same(snapshot(e, [0, 1, 2]), want)
    finally:
        e.shutdown()


@pytest.mark.parametrize("other", [{"model": "kvxfer/other-model"}, {"namespace": "weights-rev-2"}, {"world_size": 1}])
def test_another_model_namespace_or_parallel_layout_does_not_find_them(tmp_path, other):
    keys = keys_of(1, 2)
    e = Engine(tmp_path)
    try:
        fill(e, [0, 1], seed=7)
        e.offload(keys, [0, 1])
    finally:
        e.shutdown()
    e = Engine(tmp_path, **other)
    try:
        assert e.lookup(keys) == [LookupResult.MISS, LookupResult.MISS]
    finally:
        e.shutdown()


class ConnectorWorker(OffloadingConnectorWorker):
    """vLLM's offloading connector worker, keeping the canonical KV caches it hands the
    spec (to fill and read the pages the tests move) and the spec's worker's
    TransferResults by job."""

    def _init_worker(self, kv_caches):
        self.canonical = kv_caches
        super()._init_worker(kv_caches)
        self.results = {}
        finished = self.worker.get_finished

        def recording():
            out = finished()
            self.results.update((r.job_id, r) for r in out)
            return out

        self.worker.get_finished = recording


class FamilyEngine(Engine):
    """An `Engine` serving `ModelFamily(kind, tp)`: on each rank vLLM's own offloading
    connector worker registers the rank's KV caches, laid out as vLLM lays them out, and
    runs the jobs the scheduler ships it, step by step, as in a GPU worker. Keys and
    blocks are listed in KV cache group order. `change`: `model`, `dtype` or `layout`
    other than the family's."""

    def __init__(self, root, kind, tp, **change):
        extra = {"spec_name": "KvxferOffloadingSpec", "spec_module_path": "kvxfer.vllm", "root_dir": str(root), "capacity_blocks": 32, "shards": 2}
        self.family = ModelFamily(kind, tp, extra, **change)
        self.groups = len(self.family.group_ids())
        self.workers = []
        for r in range(tp):
            w = ConnectorWorker(OffloadingSpecFactory.create_spec(self.family.offloading_config(r)), self.family.vllm_config(r), self.family.kv_cache_config)
            w.register_kv_caches(self.family.kv_caches())
            self.workers.append(w)
        self.spec = OffloadingSpecFactory.create_spec(self.family.offloading_config(0))
        self.manager = self.spec.get_manager()
        self._job = 0

    def keys(self, *names):
        """For each KV cache group, in vLLM's order, a key per name."""
        return [make_offload_key(bytes([n]) * 32, g) for g in self.family.group_ids() for n in names]

    def pages(self, rank, key, block):
        """GPU block `block` of `key`'s KV cache group on rank `rank`: each layer's page as
        the layer uses it (not its padding)."""
        c = self.workers[rank].canonical
        return [c.tensors[ref.tensor_idx].tensor[block, : ref.page_size_bytes] for ref in c.group_data_refs[get_offload_group_idx(key)]]

    def fill(self, keys, blocks, seed):
        """Distinct bytes in the blocks of `keys` on every rank; but MLA's latent is the
        same on every rank, as its ranks compute it."""
        gen = torch.Generator().manual_seed(seed)
        for r in range(len(self.workers)):
            if r and self.family.kind == "mla":
                gen = torch.Generator().manual_seed(seed)
            for k, b in zip(keys, blocks):
                for page in self.pages(r, k, b):
                    page.copy_(torch.randint(-128, 128, page.shape, dtype=torch.int8, generator=gen))

    def snapshot(self, keys, blocks):
        return [[p.clone() for k, b in zip(keys, blocks) for p in self.pages(r, k, b)] for r in range(len(self.workers))]

    def clear(self):
        for w in self.workers:
            for t in w.canonical.tensors:
                t.tensor.zero_()

    def _run(self, submit, gpu_spec, slots, expedited=False):
        """A job through every rank's connector worker, as vLLM's steps run it: a load
        starts in its step (an expedited one waited for within it), a store is queued at
        the end of one and starts in the next. Returns each rank's TransferResult, None
        for a rank vLLM had run none (a replicated layout's store, on a rank but 0)."""
        self._job += 1
        job = self._job
        req = uuid.uuid4().hex
        if submit == "submit_load":
            step = OffloadingConnectorMetadata(load_jobs={job: TransferJob(req, src_spec=slots, dst_spec=gpu_spec, sync=expedited)}, store_jobs={})
        else:
            step = OffloadingConnectorMetadata(load_jobs={}, store_jobs={job: TransferJob(req, src_spec=gpu_spec, dst_spec=slots)})
        for w in self.workers:
            meta = pickle.loads(pickle.dumps(step))
            w.start_kv_transfers(meta)
            w.prepare_store_kv(meta)
            w.start_kv_transfers(OffloadingConnectorMetadata(load_jobs={}, store_jobs={}))
        done = 0
        deadline = time.monotonic() + DEADLINE_S
        while done < len(self.workers):
            assert time.monotonic() < deadline, "the workers' jobs did not finish"
            for w in self.workers:
                w.get_finished(set())
                meta = w.build_connector_worker_meta()
                if meta is not None:
                    done += meta.completed_jobs.get(job, 0)
            time.sleep(0.001)
        return [w.results.pop(job, None) for w in self.workers]


def family_blocks(engine, first, n):
    """`n` GPU blocks per KV cache group from block `first` on, no two groups' the same
    (the groups share the blocks of one pool), in group order."""
    return list(range(first, first + engine.groups * n))


def moved_exact(results):
    """Whether every rank that ran the job moved its blocks."""
    return all(r is None or r.success for r in results) and any(r is not None for r in results)


#: Each family in vLLM's layer-outermost KV cache layout, and in a block-outermost one (a
#: block holds every layer's page, and vLLM hands the offloading the block whole), where
#: vLLM lays the family out so (it has no block-outermost layout for a Mamba state).
LAYOUTS = [(kind, layout) for kind in FAMILIES for layout in ("LBNHC", "BLNHC") if (kind, layout) != ("hybrid-mamba", "BLNHC")]


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
@pytest.mark.parametrize("kind, layout", LAYOUTS)
def test_every_model_family_comes_back_exact(tmp_path, kind, layout, tp):
    """Each attention kind vLLM serves, with TP 1 and 2, its KV caches laid out and
    registered by vLLM itself: the blocks of every KV cache group of every rank are
    stored and load back exact into other blocks."""
    e = FamilyEngine(tmp_path, kind, tp, layout=layout)
    try:
        keys = e.keys(1, 2, 3)
        src, dst = family_blocks(e, 1, 3), family_blocks(e, 1 + 3 * e.groups, 3)
        e.fill(keys, src, seed=11)
        want = e.snapshot(keys, src)
        stored, results = e.offload(keys, src)
        assert stored == keys and moved_exact(results)
        e.clear()
        found, results = e.onboard(keys, dst)
        assert all(found[k] is LookupResult.HIT for k in keys) and all(r.success for r in results)
        assert same(e.snapshot(keys, dst), want)
    finally:
        e.shutdown()


def test_mlas_latent_is_stored_once_for_every_rank(tmp_path):
    """MLA's latent is the same on every TP rank, and vLLM lays it out replicated: the
    spec keeps one copy of it, written by rank 0 alone (vLLM's connector hands the other
    ranks no store job), in one store (that every rank loads from: the family test)."""
    e = FamilyEngine(tmp_path, "mla", 2)
    try:
        assert e.spec.replicated_layout and len(e.spec._settings.directories) == 1
        keys = e.keys(1, 2, 3)
        stored, results = e.offload(keys, family_blocks(e, 1, 3))
        assert stored == keys and results[0].success and results[1] is None
        assert sum(st.stats().entries for st in e.manager._stores) == 3
        with open(os.path.join(e.manager.store_directory(0), "config.json")) as f:
            assert json.load(f)["replicated_layout"] is True  # in its fingerprint
    finally:
        e.shutdown()


@pytest.mark.parametrize("change", ["tp", "dtype", "model"])
@pytest.mark.parametrize("kind", FAMILIES)
def test_another_tp_size_dtype_or_model_is_a_miss(tmp_path, kind, change):
    """What one configuration stored is never loaded by another: a restart with another
    TP size (MLA's latent too, the same bytes on every rank), KV dtype or model misses
    every block."""
    e = FamilyEngine(tmp_path, kind, 1)
    try:
        keys = e.keys(1, 2)
        e.fill(keys, family_blocks(e, 1, 2), seed=12)
        stored, results = e.offload(keys, family_blocks(e, 1, 2))
        assert stored == keys and moved_exact(results)
    finally:
        e.shutdown()
    other = {"tp": dict(), "dtype": dict(dtype="fp8"), "model": dict(model="kvxfer/another-model")}[change]
    e = FamilyEngine(tmp_path, kind, 2 if change == "tp" else 1, **other)
    try:
        assert all(r is LookupResult.MISS for r in e.lookup(keys))
    finally:
        e.shutdown()


def test_a_root_dir_that_cannot_be_made_is_refused_at_the_start(tmp_path):
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(kvxfer.InvalidArgument, match=r"root_dir .*file/kv cannot be made \(Not a directory\); give a directory"):
        OffloadingSpecFactory.create_spec(make_config(tmp_path / "file" / "kv"))


def test_a_capacity_past_the_file_system_is_refused_at_the_start(tmp_path):
    fs = os.statvfs(tmp_path)
    config = make_config(tmp_path, capacity_blocks=None, capacity_bytes=fs.f_blocks * fs.f_frsize + 1)
    with pytest.raises(kvxfer.InvalidArgument, match="more than the file system"):
        OffloadingSpecFactory.create_spec(config)


def test_a_misspelt_setting_is_refused_naming_the_settings(tmp_path):
    with pytest.raises(kvxfer.InvalidArgument, match=r"capacity_block\b.*capacity_bytes, capacity_blocks"):
        OffloadingSpecFactory.create_spec(make_config(tmp_path, capacity_block=8))


def test_a_shared_tier_is_refused_pointing_at_the_tier(tmp_path):
    config = make_config(tmp_path, shared={"dir": str(tmp_path / "shared")})
    with pytest.raises(kvxfer.InvalidArgument, match=r'KvxferOffloadingSpec has no "shared" tier: .*put kvxfer\'s tier \(kvxfer\.vllm\.KvxferTier\) under vLLM\'s CPU tier'):
        OffloadingSpecFactory.create_spec(config)


def test_another_shard_count_makes_the_stores_afresh_with_a_warning(tmp_path, caplog):
    keys = keys_of(1, 2)
    e = Engine(tmp_path, shards=1)
    try:
        fill(e, [0, 1], seed=14)
        e.offload(keys, [0, 1])
    finally:
        e.shutdown()
    with caplog.at_level("WARNING", logger="kvxfer.tier"):
        e = Engine(tmp_path, shards=2)
        try:
            assert e.lookup(keys) == [LookupResult.MISS] * 2
            assert any("1 shards, not 2" in r.getMessage() and "afresh" in r.getMessage() for r in caplog.records)
            fill(e, [0], seed=15)
            want = snapshot(e, [0])
            stored, results = e.offload(keys_of(3), [0])
            assert stored == keys_of(3) and all(r.success for r in results)
            clear(e)
            found, results = e.onboard(keys_of(3), [1])
            assert all(r.success for r in results) and same(snapshot(e, [1]), want)
        finally:
            e.shutdown()


def test_a_chunk_of_several_blocks_is_refused_naming_the_setting(tmp_path):
    config = dataclasses.replace(make_config(tmp_path), cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=4))
    with pytest.raises(kvxfer.Unsupported, match="blocks_per_chunk is 4"):
        OffloadingSpecFactory.create_spec(config)


def _plugin_run(env_value):
    """Loads vLLM's general plugins in a fresh process, as vLLM does in each of its
    processes, and says which names vLLM's factories then know. kvxfer's entry point is
    the installed package's, or (run from the source tree) the one pyproject.toml
    declares, put on the path as a distribution's metadata."""
    code = textwrap.dedent(
        """
        import importlib.metadata as md, os, sys, tempfile
        if not any(ep.value.startswith("kvxfer") for ep in md.entry_points(group="vllm.general_plugins")):
            import tomllib
            import importlib.util
            pkg = os.path.dirname(importlib.util.find_spec("kvxfer").origin)
            pyproject = os.path.join(os.path.dirname(pkg), "pyproject.toml")
            with open(pyproject, "rb") as f:
                eps = tomllib.load(f)["project"]["entry-points"]["vllm.general_plugins"]
            d = tempfile.mkdtemp()
            info = os.path.join(d, "kvxfer-0.dist-info")
            os.mkdir(info)
            with open(os.path.join(info, "METADATA"), "w") as f:
                f.write("Metadata-Version: 2.1\\nName: kvxfer\\nVersion: 0\\n")
            with open(os.path.join(info, "entry_points.txt"), "w") as f:
                f.write("[vllm.general_plugins]\\n" + "".join(f"{k} = {v}\\n" for k, v in eps.items()))
            sys.path.insert(0, d)
        import vllm.plugins
        found = "kvxfer" in vllm.plugins.load_plugins_by_group("vllm.general_plugins")
        vllm.plugins.load_general_plugins()
        loaded_kvxfer = "kvxfer" in sys.modules
        from vllm.v1.kv_offload.factory import OffloadingSpecFactory
        from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
        try:
            spec = OffloadingSpecFactory.get_spec_cls({"spec_name": "KvxferOffloadingSpec"})
            spec = f"{spec.__module__}.{spec.__name__}"
        except ValueError:
            spec = None
        try:
            tier = SecondaryTierFactory.get_tier_class({"type": "KvxferTier"})
            tier = f"{tier.__module__}.{tier.__name__}"
        except Exception:
            tier = None
        print(found, loaded_kvxfer, spec, tier)
        """
    )
    env = dict(os.environ)
    env.pop("KVX_VLLM", None)
    if env_value is not None:
        env["KVX_VLLM"] = env_value
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env, cwd="/")
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]


def test_the_entry_point_registers_the_spec_and_tier_by_name_when_configured():
    assert _plugin_run("1") == "True False kvxfer.vllm.KvxferOffloadingSpec kvxfer.vllm.KvxferTier"


def test_the_entry_point_does_nothing_unless_configured():
    assert _plugin_run(None) == "True False None None"
