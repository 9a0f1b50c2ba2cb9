"""kvxfer's vLLM secondary tier driven by vLLM itself (the installed vLLM, one of
`SUPPORTED_VLLM`, never a copy of its interface): a `TieringOffloadingSpec` whose
`secondary_tiers` name `kvxfer.vllm` by module path builds vLLM's
`TieringOffloadingManager`, CPU tier and all, and the tests make the scheduler's calls
on it. The GPU workers' copies into and out of
the CPU tier are written and read straight in its shared memory, as the workers do.
Run by `make integration-test`."""

import importlib.metadata
import os
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest

import kvxfer
import kvxfer.vllm as kv_vllm
from kvx_integration import FAMILIES, ModelFamily, Published, block_of, flip_a_byte, record_criticality, tiering_manager
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

BLOCK_BYTES = 64 * 1024  # one worker's KV bytes of one block: a 64 KiB chunk
CPU_CHUNKS = 8
#: A hang guard only: every wait here ends as soon as the jobs do.
DEADLINE_S = 60.0


def make_manager(root, model="kvxfer/test-model", tier_config=None, block_bytes=BLOCK_BYTES, events=False, **tier):
    """vLLM's tiering manager with the kvxfer tier (or `tier_config`'s), as vLLM builds
    it from kv_connector_extra_config (`events`: where vLLM publishes KV events)."""
    if tier_config is None:
        tier_config = {"type": "KvxferTier", "module_path": "kvxfer.vllm", "root_dir": str(root), "capacity_blocks": 32, "shards": 2, **tier}
    return tiering_manager(tier_config, block_bytes, CPU_CHUNKS * block_bytes, model, events)


def keys_of(*names):
    """vLLM offload keys: a 32-byte block hash (sha256's size) and group 0."""
    return [make_offload_key(bytes([n]) * 32, 0) for n in names]


def payload(key, size):
    return np.random.default_rng(int.from_bytes(key[:8], "little")).integers(0, 256, size, dtype=np.uint8)


def cpu_tier(m):
    """The CPU tier's memory as bytes, one row a chunk."""
    return np.asarray(m.primary_tier.get_kv_memoryview()).view(np.uint8)


def step(m):
    with m.lock:
        m.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))


def wait_idle(m):
    deadline = time.monotonic() + DEADLINE_S
    while m.has_pending_work():
        assert time.monotonic() < deadline, "the tier's jobs did not finish"
        step(m)
        time.sleep(0.001)


def offload(m, keys):
    """A request's chunks stored GPU -> CPU tier, which cascades them to the kvxfer tier."""
    ctx = ReqContext(req_id=uuid.uuid4().hex)
    view = cpu_tier(m)
    with m.lock:
        m.on_new_request(ctx)
        out = m.prepare_store(keys, ctx)
    assert out is not None and list(out.keys_to_store) == list(keys)
    for k, cid in zip(out.keys_to_store, out.store_spec.chunk_ids):
        view[cid] = payload(k, view.shape[1])  # the worker's GPU -> CPU copy
    with m.lock:
        m.complete_store(out.keys_to_store, ctx)
        m.on_request_finished(ctx)
    wait_idle(m)


def empty_cpu_tier(m):
    """Drops every chunk of the CPU tier and zeroes its memory: what comes back is read
    from the kvxfer tier."""
    with m.lock:
        m.reset_cache()
        m.on_reset_flushed()
    cpu_tier(m)[:] = 0


def onboard(m, keys):
    """The scheduler's lookups for a new request until each key is a HIT or a MISS (a
    secondary hit is promoted into the CPU tier first), then the worker's CPU -> GPU read
    of the hits. Returns {key: LookupResult} and {key: bytes read}."""
    ctx = ReqContext(req_id=uuid.uuid4().hex)
    with m.lock:
        m.on_new_request(ctx)
    results = {}
    deadline = time.monotonic() + DEADLINE_S
    while len(results) < len(keys):
        assert time.monotonic() < deadline, "the promotions did not finish"
        with m.lock:
            for k in keys:
                if k not in results:
                    r = m.lookup(k, ctx)
                    if r in (LookupResult.HIT, LookupResult.MISS):
                        results[k] = r
        step(m)
        time.sleep(0.001)
    hits = [k for k in keys if results[k] is LookupResult.HIT]
    view = cpu_tier(m)
    with m.lock:
        spec = m.prepare_load(hits, ctx)
    got = {k: view[cid].copy() for k, cid in zip(hits, spec.chunk_ids)}  # the worker's CPU -> GPU copy
    with m.lock:
        m.complete_load(hits, ctx)
        m.on_request_finished(ctx)
    wait_idle(m)
    return results, got


def tier_of(m):
    (tier,) = m.secondary_tiers
    return tier


def record_results(tier):
    """A list that collects every JobResult the tier hands vLLM from now on."""
    reported = []
    poll = tier.get_finished_jobs

    def recording_poll():
        out = list(poll())
        reported.extend(out)
        return out

    tier.get_finished_jobs = recording_poll
    return reported


@pytest.fixture
def manager(tmp_path):
    m = make_manager(tmp_path)
    yield m
    m.shutdown()


def test_vllm_loads_the_tier_by_module_path(manager):
    tier = tier_of(manager)
    assert type(tier).__name__ == "KvxferTier" and type(tier).__module__ == "kvxfer.vllm"
    assert tier.block_size_bytes == BLOCK_BYTES
    assert os.path.isfile(os.path.join(tier.directory, "config.json"))


def test_chunks_cascade_to_the_store_and_come_back_exact(manager):
    keys = keys_of(1, 2, 3, 4, 5)
    offload(manager, keys)
    assert tier_of(manager)._store.stats().entries == 5
    empty_cpu_tier(manager)
    results, got = onboard(manager, keys)
    assert all(results[k] is LookupResult.HIT for k in keys)
    for k in keys:
        assert np.array_equal(got[k], payload(k, BLOCK_BYTES)), f"chunk of {k.hex()} differs"


def test_loads_are_latency_critical_and_stores_bulk(manager, monkeypatch):
    """A request waits for a promotion from the tier, and for no cascade into it: the
    tier's gets are critical transfers, its puts bulk."""
    calls = record_criticality(monkeypatch, kvxfer.Store, {"get": "get", "put": "put"})
    keys = keys_of(1, 2)
    offload(manager, keys)
    empty_cpu_tier(manager)
    results, _ = onboard(manager, keys)
    assert all(results[k] is LookupResult.HIT for k in keys)
    assert sorted(set(calls)) == [("get", True), ("put", False)]


@pytest.mark.parametrize("chunk_bytes", [2 << 20, 5 * 4096 * 64, 3 * 4096])
def test_chunks_of_other_sizes_come_back_exact(tmp_path, chunk_bytes):
    """2 MiB (eight checksummed regions), 1.25 MiB (regions of 5 pages) and 12 KiB."""
    m = make_manager(tmp_path, block_bytes=chunk_bytes)
    try:
        keys = keys_of(1, 2, 3)
        offload(m, keys)
        empty_cpu_tier(m)
        results, got = onboard(m, keys)
        assert all(results[k] is LookupResult.HIT and np.array_equal(got[k], payload(k, chunk_bytes)) for k in keys)
    finally:
        m.shutdown()


def test_vllms_own_fs_tier_passes_the_same_calling_sequence(tmp_path):
    """The sequence these tests drive, checked on vLLM's own disk tier: what the kvxfer
    tier passes, a tier vLLM ships passes too."""
    m = make_manager(tmp_path, tier_config={"type": "fs", "root_dir": str(tmp_path), "n_read_threads": 2, "n_write_threads": 2})
    try:
        keys = keys_of(1, 2, 3)
        offload(m, keys)
        empty_cpu_tier(m)
        (absent,) = keys_of(9)
        results, got = onboard(m, keys + [absent])
        assert results[absent] is LookupResult.MISS
        assert all(results[k] is LookupResult.HIT and np.array_equal(got[k], payload(k, BLOCK_BYTES)) for k in keys)
    finally:
        m.shutdown()


def test_a_key_never_stored_is_a_miss(manager):
    keys = keys_of(1, 2)
    offload(manager, keys)
    empty_cpu_tier(manager)
    (absent,) = keys_of(9)
    results, got = onboard(manager, keys + [absent])
    assert results[absent] is LookupResult.MISS
    assert all(results[k] is LookupResult.HIT for k in keys)
    assert all(np.array_equal(got[k], payload(k, BLOCK_BYTES)) for k in keys)


def test_a_damaged_chunk_fails_its_key_alone(manager):
    keys = keys_of(1, 2, 3)
    offload(manager, keys)
    empty_cpu_tier(manager)
    tier = tier_of(manager)
    # Flip a byte of key 2's block where the store keeps it.
    want = payload(keys[1], BLOCK_BYTES).tobytes()
    assert flip_a_byte(tier.directory, want, 1000), "key 2's block is in no data file"
    reported = record_results(tier)
    results, got = onboard(manager, keys)
    # One promotion job of the three keys, reported failed with the two that loaded:
    # vLLM keeps those, frees the damaged one's CPU slot, and its next lookup misses
    # (the store dropped the entry).
    (job,) = reported
    assert not job.success and set(job.successful_keys) == {keys[0], keys[2]}
    assert job.transfer_bytes == 2 * BLOCK_BYTES
    assert results[keys[1]] is LookupResult.MISS
    for k in (keys[0], keys[2]):
        assert results[k] is LookupResult.HIT
        assert np.array_equal(got[k], payload(k, BLOCK_BYTES))
    stats = tier._store.stats()
    assert stats.integrity_failures == 1 and stats.entries == 2


def test_chunks_failed_in_one_job_are_one_warning_naming_the_cause(manager, caplog):
    keys = keys_of(1, 2, 3)
    offload(manager, keys)
    empty_cpu_tier(manager)
    tier = tier_of(manager)
    for k in keys[1:]:
        assert flip_a_byte(tier.directory, payload(k, BLOCK_BYTES).tobytes(), 1000)
    with caplog.at_level("DEBUG", logger="kvxfer.vllm"):
        results, _ = onboard(manager, keys)
    assert [results[k] for k in keys] == [LookupResult.HIT, LookupResult.MISS, LookupResult.MISS]
    (line,) = [r.getMessage() for r in caplog.records if r.name == "kvxfer.vllm" and r.levelname == "WARNING"]
    assert "a load job: 2 of 3 keys failed (IntegrityError" in line


def test_an_engine_at_its_admission_limit_stores_and_loads_every_chunk(tmp_path):
    """An engine admitting one request at a time: the store's transfers are not counted
    against the limit nor refused for it, so every chunk of a job spanning every shard is
    stored, and every one loads byte for byte at the first onboard."""
    m = make_manager(tmp_path, engine={"max_inflight": 1}, shards=4)
    try:
        keys = keys_of(1, 2, 3, 4, 5, 6)
        offload(m, keys)
        assert all(tier_of(m)._store.lookup([k])[0][0] for k in keys), "a chunk was not stored"
        empty_cpu_tier(m)
        results, got = onboard(m, keys)
        assert all(results[k] is LookupResult.HIT for k in keys), results
        assert all(np.array_equal(got[k], payload(k, BLOCK_BYTES)) for k in keys)
    finally:
        m.shutdown()


def test_a_store_job_that_cannot_store_every_key_is_reported_failed(tmp_path):
    m = make_manager(tmp_path, capacity_blocks=2, shards=1)
    try:
        tier = tier_of(m)
        reported = record_results(tier)
        keys = keys_of(1, 2, 3)
        offload(m, keys)  # a put never evicts a key of its own batch: one key is Busy
        (job,) = reported
        assert not job.success and job.transfer_bytes == 2 * BLOCK_BYTES
        assert tier._store.stats().entries == 2
    finally:
        m.shutdown()


def test_a_restart_of_the_same_configuration_finds_its_chunks(tmp_path):
    keys = keys_of(1, 2, 3)
    m = make_manager(tmp_path)
    try:
        offload(m, keys)
    finally:
        m.shutdown()
    m = make_manager(tmp_path)
    try:
        results, got = onboard(m, keys)
        assert all(results[k] is LookupResult.HIT for k in keys)
        assert all(np.array_equal(got[k], payload(k, BLOCK_BYTES)) for k in keys)
    finally:
        m.shutdown()
    # Another model (or another tier namespace) never serves those bytes.
    for other in (make_manager(tmp_path, model="kvxfer/other-model"), make_manager(tmp_path, namespace="weights-rev-2")):
        try:
            results, _ = onboard(other, keys)
            assert all(results[k] is LookupResult.MISS for k in keys)
        finally:
            other.shutdown()


@pytest.mark.parametrize("write", ["through", "behind"])
def test_a_second_instance_loads_what_the_first_stored_through_a_shared_tier(tmp_path, write):
    """Two vLLM instances of one model, each with a root_dir of its own, over one shared
    directory: what the first stores (written through: published when its store job ends;
    behind: published by its shutdown at the latest), the second finds and loads byte for
    byte into its CPU tier; a chunk never stored is a miss, and an instance of another
    model or tier namespace finds none of it."""
    shared = {"dir": str(tmp_path / "shared"), "write": write}
    keys = keys_of(1, 2, 3)
    (absent,) = keys_of(9)
    a = make_manager(tmp_path / "a", shared=shared)
    running = [a]
    try:
        offload(a, keys)
        if write == "behind":
            running.pop().shutdown()  # what is still behind is published here
        b = make_manager(tmp_path / "b", shared=shared)
        try:
            assert tier_of(b).directory != tier_of(a).directory and tier_of(b)._store.stats().entries == 0
            results, got = onboard(b, keys + [absent])
            assert results[absent] is LookupResult.MISS
            assert all(results[k] is LookupResult.HIT for k in keys), results
            for k in keys:
                assert np.array_equal(got[k], payload(k, BLOCK_BYTES)), f"chunk of {k.hex()} differs"
            assert tier_of(b)._store.stats().shared_hits == len(keys)
        finally:
            b.shutdown()
    finally:
        for m in running:
            m.shutdown()
    for n, other in enumerate(({"model": "kvxfer/other-model"}, {"namespace": "weights-rev-2"})):
        c = make_manager(tmp_path / f"c{n}", shared=shared, **other)
        try:
            results, _ = onboard(c, keys)
            assert all(results[k] is LookupResult.MISS for k in keys), other
        finally:
            c.shutdown()


@pytest.mark.parametrize("bad", [{"bucket": "kv"}, "/mnt/nfs/kv"], ids=["unknown-key", "not-a-mapping"])
def test_a_bad_shared_setting_is_refused_at_the_start(tmp_path, bad):
    says = r'unknown "shared" key\(s\) bucket; known: dir, capacity_bytes, s3_bucket' if isinstance(bad, dict) else "give a mapping"
    with pytest.raises(kvxfer.InvalidArgument, match=says):
        make_manager(tmp_path, shared=bad)


def held_blocks(m, keys):
    """The blocks of `keys` the tier's store holds."""
    return {block_of(k) for k in keys if tier_of(m)._store.lookup([k])[0][0]}


def test_the_kv_events_report_what_the_tier_holds(tmp_path):
    """With vLLM's KV events on, the chunks the tier reports (medium STORAGE, through
    vLLM's offloading connector) are those its store holds after every step: stores,
    evictions from a store of four chunks, loads, a chunk dropped for a failed check. After
    a restart, a chunk from before is reported once met, and the entries not met are the
    ones evicted first."""
    keys = keys_of(*range(1, 13))
    m = make_manager(tmp_path, capacity_blocks=4, shards=1, events=True)
    seen = Published()
    try:
        offload(m, keys[0:3])
        assert seen.take(m) == held_blocks(m, keys) and len(seen.blocks) == 3
        offload(m, keys[3:6])  # two evictions
        assert seen.take(m) == held_blocks(m, keys) and len(seen.blocks) == 4
        empty_cpu_tier(m)
        onboard(m, keys[2:4])  # keys 3 and 4 become the most recently used
        offload(m, keys[6:8])
        assert seen.take(m) == held_blocks(m, keys) == {block_of(k) for k in (keys[2], keys[3], keys[6], keys[7])}
        empty_cpu_tier(m)
        assert flip_a_byte(tier_of(m).directory, payload(keys[6], BLOCK_BYTES).tobytes(), 1000)
        results, _ = onboard(m, keys[6:8])
        assert results[keys[6]] is LookupResult.MISS
        assert seen.take(m) == held_blocks(m, keys) == {block_of(k) for k in (keys[2], keys[3], keys[7])}
    finally:
        m.shutdown()
    m = make_manager(tmp_path, capacity_blocks=4, shards=1, events=True)
    seen = Published()
    try:
        results, _ = onboard(m, [keys[2]])  # of keys 3, 4 and 8, key 3 is met: reported
        assert results[keys[2]] is LookupResult.HIT
        assert seen.take(m) == {block_of(keys[2])}
        offload(m, keys[8:10])  # evicts the older of the two not met (key 4)
        assert seen.take(m) == {block_of(k) for k in (keys[2], keys[8], keys[9])}
        assert held_blocks(m, keys) == seen.blocks | {block_of(keys[7])}
        offload(m, keys[10:12])  # evicts the one not met (key 8), then the oldest met (key 3)
        assert seen.take(m) == held_blocks(m, keys) == {block_of(k) for k in keys[8:12]}
    finally:
        m.shutdown()


def held_locally(m, keys):
    """The blocks of `keys` the tier's store itself holds: a lease covers its own hits
    only (a lookup answers for its shared tier too)."""
    st = tier_of(m)._store
    leases, _ = st.lease(keys)
    st.release(leases)
    return {block_of(k) for k, lease in zip(keys, leases) if lease is not None}


def test_the_kv_events_report_the_chunks_admitted_from_a_shared_tier(tmp_path):
    """A second instance loads from the shared tier what the first stored, and admits it
    into its own store after the loads: its events report those chunks once its store
    holds them, and never a chunk its store does not hold."""
    shared = {"dir": str(tmp_path / "shared"), "write": "through"}
    keys = keys_of(1, 2, 3)
    a = make_manager(tmp_path / "a", shared=shared)
    try:
        offload(a, keys)
    finally:
        a.shutdown()
    b = make_manager(tmp_path / "b", shared=shared, events=True)
    seen = Published()
    try:
        results, _ = onboard(b, keys)
        assert all(results[k] is LookupResult.HIT for k in keys), results
        assert seen.take(b) <= held_locally(b, keys)  # the admissions run on after the loads
        deadline = time.monotonic() + DEADLINE_S
        while tier_of(b)._store.stats().entries < len(keys):
            assert time.monotonic() < deadline, "the loaded chunks were not admitted"
            time.sleep(0.001)
        assert seen.take(b) == held_locally(b, keys) == {block_of(k) for k in keys}
    finally:
        b.shutdown()


def test_no_kv_events_where_vllm_publishes_none(manager):
    offload(manager, keys_of(1, 2))
    with manager.lock:
        assert [e for e in manager.take_events() if e.ownership == "KvxferTier"] == []


def family_manager(family):
    """vLLM's tiering manager, from the offloading config vLLM's connector builds for
    `family` (a `ModelFamily` whose extra config names the kvxfer tier)."""
    return TieringOffloadingSpec(family.offloading_config(0)).get_manager()


def tiered_family(root, kind, tp, **change):
    """`ModelFamily(kind, tp)` with a CPU tier of `CPU_CHUNKS` chunks over the kvxfer tier
    in `root`; `change`: `model` or `dtype` other than the family's."""
    probe = ModelFamily(kind, tp, {})
    chunk = probe.offloading_config(0).worker_kv_bytes_per_block * tp
    tier = {"type": "KvxferTier", "module_path": "kvxfer.vllm", "root_dir": str(root), "capacity_blocks": 32, "shards": 2}
    return ModelFamily(kind, tp, {"cpu_bytes_to_use": CPU_CHUNKS * chunk, "secondary_tiers": [tier]}, **change)


def family_keys(family, *names):
    """A key per name for each offloaded KV cache group of `family`, in group order."""
    return [make_offload_key(bytes([n]) * 32, g) for g in family.group_ids() for n in names]


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
@pytest.mark.parametrize("kind", FAMILIES)
def test_every_model_family_comes_back_exact(tmp_path, kind, tp):
    """Each attention kind vLLM serves, with TP 1 and 2: the chunks of every KV cache
    group of the CPU tier vLLM lays out for it cascade to the tier and come back exact.
    MLA's latent is the same on every rank, and vLLM's CPU tier keeps one copy of it
    (its replicated layout): so does the tier, a chunk being one rank's bytes."""
    family = tiered_family(tmp_path, kind, tp)
    m = family_manager(family)
    try:
        tier = tier_of(m)
        config = family.offloading_config(0)
        copies = 1 if kind == "mla" else tp
        assert config.replicated_layout == (kind == "mla" and tp > 1)
        assert tier.block_size_bytes >= copies * config.worker_kv_bytes_per_block and tier.block_size_bytes < (copies + 1) * config.worker_kv_bytes_per_block
        keys = family_keys(family, 1, 2)
        offload(m, keys)
        assert tier._store.stats().entries == len(keys)
        empty_cpu_tier(m)
        results, got = onboard(m, keys)
        assert all(results[k] is LookupResult.HIT for k in keys)
        for k in keys:
            assert np.array_equal(got[k], payload(k, tier.block_size_bytes)), f"chunk of {k.hex()} differs"
    finally:
        m.shutdown()


@pytest.mark.parametrize("change", ["tp", "dtype", "model"])
@pytest.mark.parametrize("kind", FAMILIES)
def test_another_tp_size_dtype_or_model_is_a_miss(tmp_path, kind, change):
    """What one configuration stored is never loaded by another: a restart with another
    TP size (MLA's one copy of the latent too, whose chunk is the same size), KV dtype
    or model misses every chunk, and then stores and loads its own."""
    first = tiered_family(tmp_path, kind, 1)
    m = family_manager(first)
    try:
        keys_before = family_keys(first, 1, 2)
        offload(m, keys_before)
    finally:
        m.shutdown()
    other = {"tp": dict(), "dtype": dict(dtype="fp8"), "model": dict(model="kvxfer/another-model")}[change]
    second = tiered_family(tmp_path, kind, 2 if change == "tp" else 1, **other)
    m = family_manager(second)
    try:
        results, _ = onboard(m, keys_before)
        assert all(results[k] is LookupResult.MISS for k in keys_before)
        offload(m, keys_before)
        empty_cpu_tier(m)
        results, got = onboard(m, keys_before)
        assert all(results[k] is LookupResult.HIT and np.array_equal(got[k], payload(k, tier_of(m).block_size_bytes)) for k in keys_before)
    finally:
        m.shutdown()


def test_a_root_dir_that_cannot_be_made_is_refused_at_the_start(tmp_path):
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(kvxfer.InvalidArgument, match=r"root_dir .*file/kv cannot be made \(Not a directory\); give a directory"):
        make_manager(tmp_path / "file" / "kv")


def test_a_misspelt_setting_is_refused_naming_the_settings(tmp_path):
    with pytest.raises(kvxfer.InvalidArgument, match=r"capacity_byte\b.*capacity_bytes, capacity_blocks"):
        make_manager(tmp_path, capacity_byte=1 << 20)


def test_another_shard_count_makes_the_store_afresh_with_a_warning(tmp_path, caplog):
    keys = keys_of(1, 2)
    m = make_manager(tmp_path, shards=1)
    try:
        offload(m, keys)
    finally:
        m.shutdown()
    with caplog.at_level("WARNING", logger="kvxfer.tier"):
        m = make_manager(tmp_path, shards=2)
    try:
        assert any("1 shards, not 2" in r.getMessage() and "afresh" in r.getMessage() for r in caplog.records)
        results, _ = onboard(m, keys)
        assert all(results[k] is LookupResult.MISS for k in keys)
        offload(m, keys_of(3))
        empty_cpu_tier(m)
        results, got = onboard(m, keys_of(3))
        assert results[keys_of(3)[0]] is LookupResult.HIT and np.array_equal(got[keys_of(3)[0]], payload(keys_of(3)[0], BLOCK_BYTES))
    finally:
        m.shutdown()


def test_another_vllm_version_is_refused_naming_the_supported_ones(monkeypatch):
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.35.0")
    monkeypatch.delenv("KVX_VLLM_ANY_VERSION", raising=False)
    with pytest.raises(kvxfer.Unsupported, match=r"supports vLLM 0\.33\.0 or 0\.34\.0,.*vLLM 0\.35\.0 is installed: install vllm==0\.34\.0.*set KVX_VLLM_ANY_VERSION=1"):
        kv_vllm.check_vllm_version()


def test_the_opt_in_runs_another_vllm_version_with_a_warning(monkeypatch, caplog):
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.35.0")
    monkeypatch.setenv("KVX_VLLM_ANY_VERSION", "1")
    with caplog.at_level("WARNING", logger="kvxfer.tier"):
        assert kv_vllm.check_vllm_version() == "0.35.0"
    (line,) = [r.getMessage() for r in caplog.records if r.name == "kvxfer.tier"]
    assert "tested with vLLM 0.33.0 or 0.34.0; vLLM 0.35.0 is installed and runs untested" in line


def test_kvxfer_and_its_vllm_module_import_without_vllm():
    code = (
        "import sys; sys.modules['vllm'] = None\n"
        "import kvxfer, kvxfer.vllm\n"
        "assert kvxfer.vllm.store_key(b'k' * 80) != b'k' * 80 and len(kvxfer.vllm.store_key(b'k' * 80)) == 64\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
