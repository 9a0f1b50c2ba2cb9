"""kvxfer's SGLang HiCache storage backend driven through SGLang itself (the installed
SGLang, a release of `SUPPORTED_SGLANG`, never a copy of its interface): SGLang's own
host KV pools (`MHATokenToKVPoolHost`, `MLATokenToKVPoolHost`, on the CPU, over SGLang's
device pools made on the CPU) and `StorageBackendFactory` creating the backend as
`--hicache-storage-backend dynamic` does, then registering the host pool as SGLang's cache
controller does. Keys are SGLang's page hashes (`get_storage_hash_str`, what its
controller asks storage for). The tests make the controller's v1 calls: pages set from
host pages come back byte for byte into other host pages, a page never stored is a miss,
a flipped byte fails its page alone, a restart finds the pages and a changed
configuration does not, storage metrics count the pages moved, and another SGLang
version is refused, or runs with the opt-in. The model-family matrix (attention kind ×
TP size) drives each kind through the host pools SGLang's pool assembler makes for it:
each rank's pages come back byte for byte, another TP size, dtype or model is a miss,
and a kind the backend cannot serve is refused saying why. Run by `make integration-test` in a venv per
supported release."""

import importlib.metadata
import inspect
import logging
import os
import subprocess
import sys
import time

import pytest
import torch

# SGLang builds its page hash extension on first use with ninja, which its venv has on
# no PATH unless activated.
os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")

import kvxfer  # noqa: E402
import kvxfer.sglang as kv_sglang  # noqa: E402
from kvx_integration import flip_a_byte  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, PoolHitPolicy, PoolName, PoolTransfer  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo  # noqa: E402
from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost  # noqa: E402
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.storage import StorageBackendFactory  # noqa: E402
from sglang.srt.mem_cache.utils import get_storage_hash_str  # noqa: E402
from sglang.srt.observability.metrics_collector import StorageMetrics  # noqa: E402

PAGE = 16  # tokens per page
DEVICE_TOKENS = 8 * PAGE
MHA_LAYOUTS = ["layer_first", "page_first", "page_first_direct", "page_head"]
MLA_LAYOUTS = ["layer_first", "page_first", "page_first_direct"]


def host_pool(layout="page_first", mla=False, dtype=torch.bfloat16, page=PAGE, layers=4, heads=2, head_dim=64, device_tokens=DEVICE_TOKENS):
    """SGLang's host KV pool over its device pool, both on the CPU, as its pool assembler
    builds them (host pool twice the device pool)."""
    if mla:
        dev = MLATokenToKVPool(
            size=device_tokens, page_size=page, dtype=dtype, kv_lora_rank=64, qk_rope_head_dim=16, layer_num=layers,
            device="cpu", enable_memory_saver=False, start_layer=0, end_layer=layers - 1,
        )
        return host_over(MLATokenToKVPoolHost, dev, page, layout, layers, device_tokens, target_layer_num=layers)
    dev = MHATokenToKVPool(
        size=device_tokens, page_size=page, dtype=dtype, head_num=heads, head_dim=head_dim, layer_num=layers,
        device="cpu", enable_memory_saver=False, start_layer=0, end_layer=layers - 1,
    )
    return host_over(MHATokenToKVPoolHost, dev, page, layout, layers, device_tokens)


def host_over(cls, dev, page, layout, layers, device_tokens, **geometry):
    """A host pool of class `cls` over the device pool `dev`, as the installed SGLang
    makes one: SGLang 0.5.22's take the device pool itself, 0.5.23's its buffer
    description and the geometry (`geometry`: what a class needs beyond the MHA pool's)."""
    if "buffer_info" not in inspect.signature(cls.__init__).parameters:
        return cls(dev, 2.0, 0, page, layout, pin_memory=False, device="cpu")
    info = dev.get_device_pool_infos()[0].buffer_info
    return cls(
        info, 2.0, 0, page, layout, pin_memory=False, device="cpu",
        device_capacity_tokens=device_tokens, start_layer=0, end_layer=layers - 1, **geometry,
    )


def storage_config(root, model="kvxfer/test-model", tp_rank=0, tp_size=1, mla=False, layout="page_first", metrics=False, **settings):
    extra = {
        "backend_name": "kvxfer", "module_path": "kvxfer.sglang", "class_name": "KvxferStorage", "interface_v1": 1,
        "root_dir": str(root), "capacity_pages": 32, "shards": 2, **settings,
    }
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=mla,
        enable_storage_metrics=metrics, is_page_first_layout=layout == "page_first", model_name=model,
        extra_config={k: v for k, v in extra.items() if v is not None},
    )


def attach(pool, config):
    """The backend as SGLang's cache controller attaches it: the factory creates it from
    the extra config, then the host pool is registered."""
    backend = StorageBackendFactory.create_backend("dynamic", config, pool)
    backend.register_mem_pool_host(pool)
    return backend


def page_hashes(n, seed=0, page=PAGE):
    """SGLang's storage keys of the first `n` pages of a token sequence."""
    return get_storage_hash_str(list(range(seed * 100000, seed * 100000 + n * page)), None, page_size=page)


def page_bytes(pool, page):
    """The bytes of one host page, wherever the layout keeps them."""
    return pool.get_data_page(page * pool.page_size).contiguous().view(torch.uint8).clone()


def fill_pages(pool, pages, seed):
    """Writes random bytes into host pages, as a device -> host backup would."""
    g = torch.Generator().manual_seed(seed)
    for p in pages:
        flat = pool.get_data_page(p * pool.page_size)
        data = torch.randint(0, 256, (flat.numel() * flat.element_size(),), dtype=torch.uint8, generator=g)
        pool.set_from_flat_data_page(p * pool.page_size, data.view(flat.dtype))


def token_indices(pages, page=PAGE):
    """Host token indices of whole pages, as the controller passes them."""
    return torch.cat([torch.arange(p * page, (p + 1) * page, dtype=torch.int64) for p in pages])


def transfer(name, pool, keys, pages=None, policy=PoolHitPolicy.TRAILING_PAGES):
    """The controller's v2 descriptor of a pool's pages: `keys` at host `pages` of `pool`
    (a Mamba pool's page is a request slot), under the pool's hit policy."""
    indices = None if pages is None else token_indices(pages, pool.page_size)
    return PoolTransfer(name=name, host_indices=indices, keys=list(keys), hit_policy=policy)


@pytest.fixture
def pool():
    return host_pool()


@pytest.fixture
def backend(tmp_path, pool):
    b = attach(pool, storage_config(tmp_path))
    yield b
    b.close()


def test_sglangs_factory_loads_the_backend_by_module_path(backend):
    assert type(backend).__name__ == "KvxferStorage" and type(backend).__module__ == "kvxfer.sglang"
    assert os.path.isfile(os.path.join(backend.directory, "config.json"))


@pytest.mark.parametrize("layout,mla", [(lay, False) for lay in MHA_LAYOUTS] + [(lay, True) for lay in MLA_LAYOUTS])
def test_pages_come_back_byte_exact_into_other_pages(tmp_path, layout, mla):
    pool = host_pool(layout, mla=mla)
    b = attach(pool, storage_config(tmp_path, mla=mla, layout=layout))
    try:
        keys = page_hashes(3)
        fill_pages(pool, [1, 2, 3], seed=7)
        want = [page_bytes(pool, p) for p in (1, 2, 3)]
        assert b.batch_set_v1(keys, token_indices([1, 2, 3])) == [True] * 3
        assert b.batch_exists(keys) == 3
        fill_pages(pool, [9, 10, 11], seed=8)  # stale bytes in the pages loaded into
        assert b.batch_get_v1(keys, token_indices([11, 9, 10])) == [True] * 3
        for p, w in zip((11, 9, 10), want):
            assert torch.equal(page_bytes(pool, p), w), f"{layout}: host page {p} differs"
        # The pages they were stored from are as they were.
        assert all(torch.equal(page_bytes(pool, p), w) for p, w in zip((1, 2, 3), want))
    finally:
        b.close()


def test_pages_larger_than_a_bounce_slot_come_back_exact(tmp_path):
    """A page_first page's K (and V) piece of 4.5 MiB: regions past kvxfer's default
    2 MiB slot, which the backend sizes its slots for."""
    pool = host_pool("page_first", page=64, layers=72, heads=4, head_dim=128, device_tokens=4 * 64)
    b = attach(pool, storage_config(tmp_path, capacity_pages=4))
    try:
        keys = page_hashes(2, page=64)
        fill_pages(pool, [0, 1], seed=3)
        want = [page_bytes(pool, p) for p in (0, 1)]
        assert b.batch_set_v1(keys, token_indices([0, 1], 64)) == [True, True]
        assert b.batch_get_v1(keys, token_indices([5, 6], 64)) == [True, True]
        assert torch.equal(page_bytes(pool, 5), want[0]) and torch.equal(page_bytes(pool, 6), want[1])
    finally:
        b.close()


def test_a_page_never_stored_is_a_miss(backend, pool):
    keys = page_hashes(4)
    fill_pages(pool, [1, 2, 3, 4], seed=1)
    want = [page_bytes(pool, p) for p in (1, 2, 3, 4)]
    # Pages 0, 1 and 3 stored; page 2 never.
    stored = [keys[0], keys[1], keys[3]]
    assert backend.batch_set_v1(stored, token_indices([1, 2, 4])) == [True] * 3
    assert backend.batch_exists(keys) == 2  # the leading run SGLang prefetches
    assert not backend.exists(keys[2]) and backend.exists(keys[3])
    assert backend.batch_get_v1(keys, token_indices([10, 11, 12, 13])) == [True, True, False, True]
    assert torch.equal(page_bytes(pool, 10), want[0]) and torch.equal(page_bytes(pool, 11), want[1])
    assert torch.equal(page_bytes(pool, 13), want[3])


def test_a_flipped_byte_fails_that_page_alone(backend, pool):
    keys = page_hashes(3)
    fill_pages(pool, [1, 2, 3], seed=2)
    want = [page_bytes(pool, p) for p in (1, 2, 3)]
    assert backend.batch_set_v1(keys, token_indices([1, 2, 3])) == [True] * 3
    # Flip a byte of page 2's piece in the data file that holds it.
    piece = bytes(want[1][:256].numpy())
    assert flip_a_byte(backend.directory, piece, 100), "page 2's bytes are in no data file"
    assert backend.batch_get_v1(keys, token_indices([10, 11, 12])) == [True, False, True]
    assert torch.equal(page_bytes(pool, 10), want[0]) and torch.equal(page_bytes(pool, 12), want[2])
    # The damaged entry is dropped: SGLang's next query misses it and recomputes.
    assert not backend.exists(keys[1]) and backend.batch_exists(keys) == 1
    stats = backend._store.stats()
    assert stats.integrity_failures == 1 and stats.entries == 2


def test_an_engine_at_its_admission_limit_fails_pages_alone_and_loses_none(tmp_path):
    """An engine admitting one request at a time: each page of a call is stored (or
    loaded, byte for byte) or False alone, SGLang recomputes the False ones, and a page
    stored is never lost to the pressure: alone, each one loads."""
    pool = host_pool()
    b = attach(pool, storage_config(tmp_path, engine={"max_inflight": 1}))
    try:
        pages = list(range(1, 7))
        keys = page_hashes(len(pages), seed=16)
        fill_pages(pool, pages, seed=16)
        want = [page_bytes(pool, p) for p in pages]
        for k, p, ok in zip(keys, pages, b.batch_set_v1(keys, token_indices(pages))):
            if not ok:
                assert b.batch_set_v1([k], token_indices([p])) == [True], "a page alone is stored"
        into = [p + 8 for p in pages]
        for i, ok in enumerate(b.batch_get_v1(keys, token_indices(into))):
            if not ok:
                assert b.batch_get_v1([keys[i]], token_indices([into[i]])) == [True], "a stored page alone loads"
            assert torch.equal(page_bytes(pool, into[i]), want[i])
    finally:
        b.close()


def test_pages_failed_in_one_call_are_one_warning_naming_the_cause(backend, pool, caplog):
    keys = page_hashes(3, seed=17)
    fill_pages(pool, [1, 2, 3], seed=17)
    pieces = [bytes(page_bytes(pool, p)[:256].numpy()) for p in (2, 3)]
    assert backend.batch_set_v1(keys, token_indices([1, 2, 3])) == [True] * 3
    assert all(flip_a_byte(backend.directory, piece, 100) for piece in pieces)
    with caplog.at_level("DEBUG", logger="kvxfer.sglang"):
        assert backend.batch_get_v1(keys, token_indices([10, 11, 12])) == [True, False, False]
    (line,) = [r.getMessage() for r in caplog.records if r.name == "kvxfer.sglang" and r.levelname == "WARNING"]
    assert "2 of 3 keys failed (IntegrityError" in line and keys[1] in line


def test_a_key_held_already_is_stored_without_a_write(backend, pool):
    keys = page_hashes(2)
    fill_pages(pool, [1, 2], seed=4)
    assert backend.batch_set_v1(keys, token_indices([1, 2])) == [True, True]
    assert backend.batch_set_v1(keys, token_indices([1, 2])) == [True, True]
    stats = backend._store.stats()
    assert stats.entries == 2 and stats.dedups == 2


def test_storage_metrics_count_the_pages_each_op_moved(tmp_path, pool):
    """With SGLang's storage metrics on: a set counts the pages it wrote (not those held
    already), a get the pages it loaded; GB/s over the op's wall time; get_stats() hands
    them over once."""
    b = attach(pool, storage_config(tmp_path, metrics=True))
    try:
        keys = page_hashes(5, seed=12)
        fill_pages(pool, [1, 2, 3, 4, 5], seed=12)
        assert b.batch_set_v1(keys[:2], token_indices([1, 2])) == [True, True]
        assert b.get_stats().backup_pgs == [2]
        block = b._config.block_bytes

        def timed(call):
            start = time.perf_counter()
            out = call()
            return out, time.perf_counter() - start

        # Five pages, two held already: three written.
        done, set_s = timed(lambda: b.batch_set_v1(keys, token_indices([1, 2, 3, 4, 5])))
        assert done == [True] * 5
        # Four held pages and one never stored: four loaded.
        asked = keys[:4] + page_hashes(1, seed=13)
        done, get_s = timed(lambda: b.batch_get_v1(asked, token_indices([8, 9, 10, 11, 12])))
        assert done == [True, True, True, True, False]
        # A set of held pages only writes nothing and adds no sample.
        assert b.batch_set_v1(keys[:2], token_indices([1, 2])) == [True, True]
        m = b.get_stats()
        assert isinstance(m, StorageMetrics)
        assert m.backup_pgs == [3] and m.prefetch_pgs == [4]
        assert len(m.backup_bandwidth) == 1 and len(m.prefetch_bandwidth) == 1
        # The backend times the I/O inside the call: at least the bytes over the call's time.
        assert m.backup_bandwidth[0] >= 3 * block / (1 << 30) / set_s > 0
        assert m.prefetch_bandwidth[0] >= 4 * block / (1 << 30) / get_s > 0
        again = b.get_stats()
        assert (again.prefetch_pgs, again.backup_pgs, again.prefetch_bandwidth, again.backup_bandwidth) == ([], [], [], [])
    finally:
        b.close()


def test_storage_metrics_off_records_nothing(backend, pool):
    keys = page_hashes(2, seed=14)
    fill_pages(pool, [1, 2], seed=14)
    assert backend.batch_set_v1(keys, token_indices([1, 2])) == [True, True]
    assert backend.batch_get_v1(keys, token_indices([3, 4])) == [True, True]
    assert backend.get_stats() is None and backend._metrics is None


def test_a_restart_of_the_same_configuration_finds_its_pages(tmp_path):
    keys = page_hashes(3, seed=5)
    pool = host_pool()
    b = attach(pool, storage_config(tmp_path))
    fill_pages(pool, [1, 2, 3], seed=5)
    want = [page_bytes(pool, p) for p in (1, 2, 3)]
    assert b.batch_set_v1(keys, token_indices([1, 2, 3])) == [True] * 3
    b.close()
    # A new process: SGLang's page hashes are SHA-256 over the tokens (and the request's
    # extra key and cache salt), so the same tokens give the same keys in any process.
    code = (
        "from sglang.srt.mem_cache.utils import get_storage_hash_str\n"
        f"print(' '.join(get_storage_hash_str(list(range(500000, 500000 + 3 * {PAGE})), None, page_size={PAGE})))\n"
    )
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-3:] == keys
    pool = host_pool()
    b = attach(pool, storage_config(tmp_path))
    try:
        assert b.batch_exists(keys) == 3
        assert b.batch_get_v1(keys, token_indices([4, 5, 6])) == [True] * 3
        assert all(torch.equal(page_bytes(pool, p), w) for p, w in zip((4, 5, 6), want))
    finally:
        b.close()


@pytest.mark.parametrize(
    "change",
    [
        {"model": "kvxfer/other-model"},
        {"namespace": "weights-rev-2"},
        {"tp_rank": 1, "tp_size": 2},
        {"dtype": torch.float16},
        {"layout": "layer_first"},
        {"page": 2 * PAGE},
    ],
    ids=lambda c: next(iter(c)),
)
def test_a_changed_configuration_does_not_find_them(tmp_path, change):
    keys = page_hashes(3, seed=6)
    pool = host_pool()
    b = attach(pool, storage_config(tmp_path))
    fill_pages(pool, [1, 2, 3], seed=6)
    assert b.batch_set_v1(keys, token_indices([1, 2, 3])) == [True] * 3
    b.close()
    pool = host_pool(change.get("layout", "page_first"), dtype=change.get("dtype", torch.bfloat16), page=change.get("page", PAGE))
    config = {k: v for k, v in change.items() if k in ("model", "namespace", "tp_rank", "tp_size", "layout")}
    b = attach(pool, storage_config(tmp_path, **config))
    try:
        assert b.batch_exists(keys) == 0
        assert b.batch_get_v1(keys, token_indices([4, 5, 6], pool.page_size)) == [False] * 3
    finally:
        b.close()


@pytest.mark.parametrize("write", ["through", "behind"])
def test_a_second_server_loads_what_the_first_stored_through_a_shared_tier(tmp_path, write):
    """Two SGLang servers of one model, each with a root_dir of its own, over one shared
    directory: what the first sets (written through: published when the set returns;
    behind: published by its close at the latest), the second finds (the leading run
    SGLang prefetches) and loads byte for byte into its own host pages; a page never set
    is a miss, and a server of another model or namespace finds none of it."""
    shared = {"dir": str(tmp_path / "shared"), "write": write}
    keys = page_hashes(3, seed=20)
    absent = page_hashes(1, seed=21)
    pools = [host_pool(), host_pool()]
    a = attach(pools[0], storage_config(tmp_path / "a", shared=shared))
    running = [a]
    try:
        fill_pages(pools[0], [1, 2, 3], seed=20)
        want = [page_bytes(pools[0], p) for p in (1, 2, 3)]
        assert a.batch_set_v1(keys, token_indices([1, 2, 3])) == [True] * 3
        if write == "behind":
            running.pop().close()  # what is still behind is published here
        b = attach(pools[1], storage_config(tmp_path / "b", shared=shared))
        running.append(b)
        assert b._store.stats().entries == 0
        assert b.batch_exists(keys + absent) == 3
        assert not b.exists(absent[0])
        fill_pages(pools[1], [4, 5, 6, 7], seed=22)  # stale bytes in the pages loaded into
        assert b.batch_get_v1(keys + absent, token_indices([6, 4, 5, 7])) == [True, True, True, False]
        for p, w in zip((6, 4, 5), want):
            assert torch.equal(page_bytes(pools[1], p), w), f"host page {p} differs"
        assert b._store.stats().shared_hits == 3
    finally:
        for backend in running:
            backend.close()
    for n, other in enumerate(({"model": "kvxfer/other-model"}, {"namespace": "weights-rev-2"})):
        pool = host_pool()
        c = attach(pool, storage_config(tmp_path / f"c{n}", shared=shared, **other))
        try:
            assert c.batch_exists(keys) == 0, other
            assert c.batch_get_v1(keys, token_indices([1, 2, 3])) == [False] * 3, other
        finally:
            c.close()


@pytest.mark.parametrize("bad", [{"bucket": "kv"}, "/mnt/nfs/kv"], ids=["unknown-key", "not-a-mapping"])
def test_a_bad_shared_setting_is_refused_at_the_start(tmp_path, pool, bad):
    says = r'unknown "shared" key\(s\) bucket; known: dir, capacity_bytes, s3_bucket' if isinstance(bad, dict) else "give a mapping"
    with pytest.raises(kvxfer.InvalidArgument, match=says):
        StorageBackendFactory.create_backend("dynamic", storage_config(tmp_path, shared=bad), pool)


def test_a_second_process_of_the_same_rank_takes_a_store_of_its_own(tmp_path):
    """Data-parallel replicas of a rank: a store has one owner, so the second opens the
    next directory and both serve pages."""
    pools = [host_pool(), host_pool()]
    first, second = (attach(p, storage_config(tmp_path, replicas=2)) for p in pools)
    try:
        assert first.directory != second.directory
        for i, (b, p) in enumerate(((first, pools[0]), (second, pools[1]))):
            keys = page_hashes(2, seed=10 + i)
            fill_pages(p, [1, 2], seed=10 + i)
            want = [page_bytes(p, 1), page_bytes(p, 2)]
            assert b.batch_set_v1(keys, token_indices([1, 2])) == [True, True]
            assert b.batch_get_v1(keys, token_indices([3, 4])) == [True, True]
            assert torch.equal(page_bytes(p, 3), want[0]) and torch.equal(page_bytes(p, 4), want[1])
    finally:
        first.close()
        second.close()


def test_a_second_server_on_the_same_root_dir_is_refused_naming_the_first(tmp_path, backend):
    """Without data-parallel replicas, a second process of the same rank on the same
    root_dir is another server: refused, not given a store (and a capacity) of its own."""
    with pytest.raises(kvxfer.Busy, match=rf"process {os.getpid()}\b.*its own root_dir"):
        attach(host_pool(), storage_config(tmp_path))
    assert len([d for d in os.listdir(tmp_path) if os.path.isdir(os.path.join(tmp_path, d))]) == 1


def test_another_shard_count_makes_the_store_afresh_with_a_warning(tmp_path, caplog):
    keys = page_hashes(2, seed=15)
    pool = host_pool()
    b = attach(pool, storage_config(tmp_path, shards=1))
    fill_pages(pool, [1, 2], seed=15)
    assert b.batch_set_v1(keys, token_indices([1, 2])) == [True, True]
    b.close()
    with caplog.at_level("WARNING", logger="kvxfer.tier"):
        b = attach(pool, storage_config(tmp_path, shards=2))
    try:
        assert any("1 shards, not 2" in r.getMessage() and "afresh" in r.getMessage() for r in caplog.records)
        assert b.batch_exists(keys) == 0
        assert b.batch_set_v1(keys, token_indices([1, 2])) == [True, True]
        assert b.batch_get_v1(keys, token_indices([3, 4])) == [True, True]
    finally:
        b.close()


def test_a_store_damaged_past_opening_is_made_afresh_with_a_warning(tmp_path, caplog):
    keys = page_hashes(2, seed=18)
    pool = host_pool()
    b = attach(pool, storage_config(tmp_path))
    fill_pages(pool, [1, 2], seed=18)
    assert b.batch_set_v1(keys, token_indices([1, 2])) == [True, True]
    directory = b.directory
    b.close()
    with open(os.path.join(directory, "meta"), "r+b") as f:
        f.seek(20)
        byte = f.read(1)
        f.seek(20)
        f.write(bytes([byte[0] ^ 0x40]))
    with caplog.at_level("WARNING", logger="kvxfer.tier"):
        b = attach(pool, storage_config(tmp_path))
    try:
        assert any("damaged" in r.getMessage() and "afresh" in r.getMessage() for r in caplog.records)
        assert b.batch_exists(keys) == 0
        assert b.batch_set_v1(keys, token_indices([1, 2])) == [True, True]
        assert b.batch_get_v1(keys, token_indices([3, 4])) == [True, True]
    finally:
        b.close()


def test_clear_empties_the_store(backend, pool):
    keys = page_hashes(2)
    fill_pages(pool, [1, 2], seed=9)
    assert backend.batch_set_v1(keys, token_indices([1, 2])) == [True, True]
    backend.clear()
    assert backend.batch_exists(keys) == 0
    assert backend.batch_set_v1(keys, token_indices([1, 2])) == [True, True]
    assert backend.batch_exists(keys) == 2


def test_a_root_dir_that_cannot_be_made_is_refused_at_the_start(tmp_path, pool):
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(kvxfer.InvalidArgument, match=r"root_dir .*file/kv cannot be made \(Not a directory\); give a directory"):
        StorageBackendFactory.create_backend("dynamic", storage_config(tmp_path / "file" / "kv"), pool)


def test_a_config_without_interface_v1_is_refused(tmp_path, pool):
    config = storage_config(tmp_path, interface_v1=None)
    with pytest.raises(kvxfer.InvalidArgument, match="interface_v1"):
        StorageBackendFactory.create_backend("dynamic", config, pool)


def test_an_unknown_setting_is_refused(tmp_path, pool):
    with pytest.raises(kvxfer.InvalidArgument, match="capacity_byte"):
        StorageBackendFactory.create_backend("dynamic", storage_config(tmp_path, capacity_pages=None, capacity_byte=1 << 30), pool)


def test_an_mla_model_over_several_attention_tp_ranks_is_refused(tmp_path):
    pool = host_pool(mla=True)
    with pytest.raises(kvxfer.Unsupported, match="MLA model with attention TP size 2"):
        StorageBackendFactory.create_backend("dynamic", storage_config(tmp_path, mla=True, tp_rank=1, tp_size=2), pool)


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
def test_a_layout_without_a_zero_copy_description_is_refused(tmp_path, mla):
    try:
        pool = host_pool("page_unified", mla=mla)
    except ValueError as e:  # SGLang 0.5.22 has no such layout: nothing to refuse
        pytest.skip(f"SGLang {importlib.metadata.version('sglang')} makes no page_unified host pool ({e})")
    with pytest.raises(kvxfer.Unsupported, match="page_unified"):
        attach(pool, storage_config(tmp_path, mla=mla, layout="page_unified"))


#: The attention kinds of the model-family matrix as SGLang's pool assembler hands them
#: to a storage backend: full attention with grouped KV heads (one MHA host pool, its
#: heads split over the TP ranks), MLA (one MLA host pool, the latent whole on every
#: rank), and the hybrids whose other layers get a host pool of their own beside the KV
#: pool, registered through SGLang's v2 interface: sliding window (gpt-oss, Gemma 4: an
#: SWA pool, an MHA pool over the sliding layers) and Mamba (Qwen3-Next, Nemotron-H: a
#: Mamba state pool).
SGLANG_FAMILIES = ("gqa", "mla", "hybrid-swa", "hybrid-mamba")
FAMILY_LAYERS = 4
FAMILY_KV_HEADS = 4


def family_pools(kind, tp, dtype=torch.bfloat16):
    """One rank's host pools of a four-layer model of attention kind `kind` (one of
    `SGLANG_FAMILIES`) served with TP size `tp`: the KV pool, and the pools beside it by
    SGLang's pool name. A hybrid's layers alternate: two full-attention layers in the
    KV pool, two in the other."""
    heads = FAMILY_KV_HEADS // tp
    if kind == "gqa":
        return host_pool(dtype=dtype, layers=FAMILY_LAYERS, heads=heads), {}
    if kind == "mla":
        return host_pool(mla=True, dtype=dtype, layers=FAMILY_LAYERS), {}
    kv = host_pool(dtype=dtype, layers=FAMILY_LAYERS // 2, heads=heads)
    if kind == "hybrid-swa":
        return kv, {PoolName.SWA: host_pool(dtype=dtype, layers=FAMILY_LAYERS // 2, heads=heads)}
    assert kind == "hybrid-mamba", kind
    # Mamba2's state per layer and request slot: SSM heads split over the TP ranks.
    slots = DEVICE_TOKENS // PAGE + 1
    state = MambaStateBufferInfo(
        temporal=torch.zeros(FAMILY_LAYERS // 2, slots, 8 // tp, 16, 16, dtype=torch.float32),
        conv=(torch.zeros(FAMILY_LAYERS // 2, slots, 128 // tp, 3, dtype=dtype),),
    )
    return kv, {PoolName.MAMBA: MambaPoolHost(state, 2.0, 0, device_capacity=slots, pin_memory=False, layout="page_first")}


def attach_family(kv, others, config):
    """The backend as SGLang's hybrid cache controller attaches it: the KV pool
    registered as the anchor, then every pool of the group (`register_group`)."""
    backend = attach(kv, config)
    register_group(backend, kv, others)
    return backend


def register_group(backend, kv, others):
    """Every pool of the group, the KV pool among them, registered through the v2
    interface after the anchor. A pool the backend refuses fails SGLang's attach there,
    and SGLang keeps the backend as it is (its controller holds it; no detach, no
    close)."""
    for name, pool in [(PoolName.KV, kv), *others.items()]:
        backend.register_mem_host_pool_v2(pool, name)


#: Where the backend refuses a family at a TP size, what its refusal says.
FAMILY_REFUSALS = {
    ("mla", 2): "MLA model with attention TP size 2",
}


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("kind", SGLANG_FAMILIES)
def test_the_model_family_matrix_round_trips_each_rank_byte_exact(tmp_path, kind, tp):
    """Each rank of `kind` at TP size `tp`: the pages it sets come back byte for byte
    into other pages of its pool. The ranks set other bytes under the same page hashes
    (each its own shard), and each loads its own, from a store of its own. A family the
    backend cannot serve is refused when SGLang attaches it, saying why (docs/sglang.md's
    "Model families")."""
    refusal = FAMILY_REFUSALS.get((kind, tp))
    if refusal is not None:
        kv, others = family_pools(kind, tp)
        config = storage_config(tmp_path, tp_rank=tp - 1, tp_size=tp, mla=kind == "mla")
        with pytest.raises(kvxfer.Unsupported, match=refusal):
            attach_family(kv, others, config)
        return
    keys = page_hashes(3, seed=30)
    ranks = []
    try:
        for rank in range(tp):
            kv, others = family_pools(kind, tp)
            ranks.append((kv, others, attach_family(kv, others, storage_config(tmp_path, tp_rank=rank, tp_size=tp, mla=kind == "mla"))))
        for rank, (kv, others, b) in enumerate(ranks):
            fill_pages(kv, [1, 2, 3], seed=30 + rank)
            want = [page_bytes(kv, p) for p in (1, 2, 3)]
            assert b.batch_set_v1(keys, token_indices([1, 2, 3])) == [True] * 3
            fill_pages(kv, [9, 10, 11], seed=40 + rank)  # stale bytes in the pages loaded into
            assert b.batch_get_v1(keys, token_indices([10, 11, 9])) == [True] * 3
            for p, w in zip((10, 11, 9), want):
                assert torch.equal(page_bytes(kv, p), w), f"{kind} TP {tp} rank {rank}: host page {p} differs"
            for name, other in others.items():
                fill_pages(other, [1, 2, 3], seed=50 + rank)
                want = [page_bytes(other, p) for p in (1, 2, 3)]
                assert b.batch_set_v2([transfer(name, other, keys, [1, 2, 3])]) == {name: [True] * 3}
                found = b.batch_exists_v2(keys, [transfer(name, other, keys[-1:])])
                assert (found.kv_hit_pages, found.extra_pool_hit_pages) == (3, {PoolName.KV: 3, name: 3})
                fill_pages(other, [9, 10, 11], seed=60 + rank)
                assert b.batch_get_v2([transfer(name, other, keys, [10, 11, 9])]) == {name: [True] * 3}
                for p, w in zip((10, 11, 9), want):
                    assert torch.equal(page_bytes(other, p), w), f"{kind} TP {tp} rank {rank}: {name} page {p} differs"
        assert len({b.directory for *_, b in ranks}) == tp
        assert all(b._store.stats().entries == 3 for *_, b in ranks)
    finally:
        for *_, b in ranks:
            b.close()


HYBRIDS = ["hybrid-swa", "hybrid-mamba"]


@pytest.mark.parametrize("kind", HYBRIDS)
def test_a_pools_pages_never_load_into_another_pool(tmp_path, kind):
    """The KV pool and the pool beside it share page hashes but not stores: pages set in
    one pool under keys the other never stored are a miss in the other, and a prefix
    whose KV pages are missing has no hit whatever the other pool holds."""
    kv, others = family_pools(kind, 1)
    (name, other), = others.items()
    b = attach_family(kv, others, storage_config(tmp_path))
    try:
        kv_keys, other_keys = page_hashes(3, seed=32), page_hashes(3, seed=33)
        fill_pages(kv, [1, 2, 3], seed=32)
        fill_pages(other, [1, 2, 3], seed=33)
        assert b.batch_set_v1(kv_keys, token_indices([1, 2, 3])) == [True] * 3
        assert b.batch_set_v2([transfer(name, other, other_keys, [1, 2, 3])]) == {name: [True] * 3}
        assert b.batch_get_v2([transfer(name, other, kv_keys, [4, 5, 6])]) == {name: [False] * 3}
        assert b.batch_get_v1(other_keys, token_indices([4, 5, 6])) == [False] * 3
        assert b.batch_exists(other_keys) == 0
        found = b.batch_exists_v2(other_keys, [transfer(name, other, other_keys[-1:])])
        assert (found.kv_hit_pages, found.extra_pool_hit_pages) == (0, {})
        found = b.batch_exists_v2(kv_keys, [transfer(name, other, kv_keys[-1:])])
        assert (found.kv_hit_pages, found.extra_pool_hit_pages) == (0, {PoolName.KV: 3})
    finally:
        b.close()


def test_each_pools_hit_policy_cuts_the_prefix_as_sglangs_file_backend_does(tmp_path):
    """`batch_exists_v2`: the KV pool's leading hits, then per pool: all pages needs every
    page of that prefix, trailing pages the last `len(keys)` pages of the longest prefix
    that has them; the usable prefix is the shortest."""
    kv, others = family_pools("hybrid-swa", 1)
    swa = others[PoolName.SWA]
    b = attach_family(kv, others, storage_config(tmp_path))
    try:
        keys = page_hashes(4, seed=34)
        fill_pages(kv, [1, 2, 3, 4], seed=34)
        assert b.batch_set_v1(keys, token_indices([1, 2, 3, 4])) == [True] * 4
        assert b.batch_set_v2([transfer(PoolName.SWA, swa, keys[1:3], [2, 3])]) == {PoolName.SWA: [True] * 2}

        def hit(n, policy):
            r = b.batch_exists_v2(keys, [transfer(PoolName.SWA, swa, keys[:n], policy=policy)])
            return r.kv_hit_pages, r.extra_pool_hit_pages.get(PoolName.SWA, 0)

        assert hit(1, PoolHitPolicy.TRAILING_PAGES) == (3, 3)  # pages 1..3, the last held
        assert hit(2, PoolHitPolicy.TRAILING_PAGES) == (3, 3)  # pages 2 and 3 held
        assert hit(3, PoolHitPolicy.TRAILING_PAGES) == (0, 0)  # no held run of three ends a prefix
        assert hit(1, PoolHitPolicy.ALL_PAGES) == (0, 0)  # page 1 not held
    finally:
        b.close()


@pytest.mark.parametrize("kind", HYBRIDS)
def test_a_hybrid_restarted_finds_every_pools_pages_in_its_capacity_share(tmp_path, kind, caplog):
    """Each pool has a store in the rank's directory with an equal number of pages, the
    configured capacity split in proportion to the pools' bytes per page; a restart of
    the same configuration opens them as they are and finds every pool's pages. Neither start drops a store with a warning."""
    keys = page_hashes(3, seed=35)
    kv, others = family_pools(kind, 1)
    (name, other), = others.items()
    caplog.set_level(logging.WARNING, logger="kvxfer")
    b = attach_family(kv, others, storage_config(tmp_path))
    fill_pages(kv, [1, 2, 3], seed=35)
    fill_pages(other, [1, 2, 3], seed=36)
    want = [page_bytes(other, p) for p in (1, 2, 3)]
    assert b.batch_set_v1(keys, token_indices([1, 2, 3])) == [True] * 3
    assert b.batch_set_v2([transfer(name, other, keys, [1, 2, 3])]) == {name: [True] * 3}
    b.close()
    kv, others = family_pools(kind, 1)
    other = others[name]
    b = attach_family(kv, others, storage_config(tmp_path))
    try:
        kv_bytes, other_bytes = page_bytes(kv, 0).numel(), page_bytes(other, 0).numel()
        pages = 32 * kv_bytes // (kv_bytes + other_bytes)
        assert [s.stats().capacity for s in (b._store, b._pools[name].store)] == [pages, pages]
        assert os.path.dirname(b._pools[name].store_dir) == b.directory
        found = b.batch_exists_v2(keys, [transfer(name, other, keys[-1:])])
        assert found.kv_hit_pages == 3
        assert b.batch_get_v2([transfer(name, other, keys, [4, 5, 6])]) == {name: [True] * 3}
        assert all(torch.equal(page_bytes(other, p), w) for p, w in zip((4, 5, 6), want))
        assert not caplog.records, [r.getMessage() for r in caplog.records]
    finally:
        b.close()


@pytest.mark.parametrize("kind", HYBRIDS)
def test_a_pool_refused_beside_the_kv_pool_leaves_no_store_held(tmp_path, kind):
    """The KV pool's store opens when SGLang registers the KV pool, before a pool beside
    it is refused (here a second pool under a name registered already); SGLang leaves a
    failed attach as it is, so the backend closes itself: the rank attaches a backend
    again (SGLang's attach API) and finds its stores free."""
    kv, others = family_pools(kind, 1)
    refused = attach_family(kv, others, storage_config(tmp_path))
    with pytest.raises(kvxfer.InvalidArgument, match="registered already"):
        register_group(refused, kv, family_pools(kind, 1)[1])
    attach_family(kv, others, storage_config(tmp_path)).close()
    assert refused._store is None


#: (kind, change): what the served model changes; MLA over two TP ranks is refused.
FAMILY_CHANGES = [(kind, change) for kind in SGLANG_FAMILIES for change in ({"tp": 2}, {"dtype": torch.float16}, {"model": "kvxfer/other-model"}) if (kind, change.get("tp")) != ("mla", 2)]


@pytest.mark.parametrize("kind,change", FAMILY_CHANGES, ids=lambda c: c if isinstance(c, str) else next(iter(c)))
def test_a_family_served_again_with_another_tp_size_dtype_or_model_misses(tmp_path, kind, change):
    """Pages stored at TP size 1 are a miss, never wrong KV, for the same model served
    with another TP size (on every rank), KV dtype or model name."""
    keys = page_hashes(3, seed=31)
    kv, others = family_pools(kind, 1)
    b = attach_family(kv, others, storage_config(tmp_path, mla=kind == "mla"))
    fill_pages(kv, [1, 2, 3], seed=31)
    assert b.batch_set_v1(keys, token_indices([1, 2, 3])) == [True] * 3
    for name, other in others.items():
        assert b.batch_set_v2([transfer(name, other, keys, [1, 2, 3])]) == {name: [True] * 3}
    b.close()
    tp = change.get("tp", 1)
    for rank in range(tp):
        kv, others = family_pools(kind, tp, dtype=change.get("dtype", torch.bfloat16))
        config = storage_config(tmp_path, model=change.get("model", "kvxfer/test-model"), tp_rank=rank, tp_size=tp, mla=kind == "mla")
        b = attach_family(kv, others, config)
        try:
            assert b.batch_exists(keys) == 0, f"rank {rank}"
            assert b.batch_get_v1(keys, token_indices([4, 5, 6])) == [False] * 3, f"rank {rank}"
            for name, other in others.items():
                assert b.batch_exists_v2(keys, [transfer(name, other, keys[-1:])]).kv_hit_pages == 0, f"rank {rank}"
                assert b.batch_get_v2([transfer(name, other, keys, [4, 5, 6])]) == {name: [False] * 3}, f"rank {rank}"
        finally:
            b.close()


@pytest.mark.parametrize("version", ["0.5.21", "0.5.24"])
def test_another_sglang_version_is_refused_naming_the_supported_ones(monkeypatch, version):
    monkeypatch.setattr(importlib.metadata, "version", lambda name: version)
    monkeypatch.delenv("KVX_SGLANG_ANY_VERSION", raising=False)
    with pytest.raises(kvxfer.Unsupported, match=rf"supports SGLang 0\.5\.22 or 0\.5\.23,.*SGLang {version} is installed.*set KVX_SGLANG_ANY_VERSION=1"):
        kv_sglang.check_sglang_version()


def test_the_opt_in_runs_another_sglang_version_with_a_warning(tmp_path, monkeypatch, pool, caplog):
    """SGLang's factory makes the backend over a release outside the tested ones, with
    KVX_SGLANG_ANY_VERSION=1, and pages go through it."""
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.5.24" if name == "sglang" else real(name))
    monkeypatch.setenv("KVX_SGLANG_ANY_VERSION", "1")
    monkeypatch.setattr(kv_sglang, "_backend_class", None)  # made again, its version checked again
    with caplog.at_level("WARNING", logger="kvxfer.tier"):
        b = attach(pool, storage_config(tmp_path))
    try:
        (line,) = [r.getMessage() for r in caplog.records if r.name == "kvxfer.tier"]
        assert "tested with SGLang 0.5.22 or 0.5.23; SGLang 0.5.24 is installed and runs untested" in line
        keys = page_hashes(2)
        fill_pages(pool, [0, 1], seed=5)
        want = [page_bytes(pool, p) for p in (0, 1)]
        assert b.batch_set_v1(keys, token_indices([0, 1])) == [True, True]
        fill_pages(pool, [2, 3], seed=6)
        assert b.batch_get_v1(keys, token_indices([2, 3])) == [True, True]
        assert all(torch.equal(page_bytes(pool, p), w) for p, w in zip((2, 3), want))
    finally:
        b.close()


def test_kvxfer_and_its_sglang_module_import_without_sglang():
    code = (
        "import sys; sys.modules['sglang'] = None\n"
        "import kvxfer, kvxfer.sglang\n"
        "assert kvxfer.sglang.page_key('ab' * 32) == b'h' + bytes.fromhex('ab' * 32)\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
