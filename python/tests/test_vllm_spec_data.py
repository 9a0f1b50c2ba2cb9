"""The offloading spec's worker data path (`kvxfer.vllm.slot_mover`, no vLLM): KV caches
shaped as vLLM hands them to a worker (one `(num_blocks, page)` tensor per layer, the
layers of each KV cache group), registered as kvxfer layouts, and blocks moved between
them and store slots by handles a store's owner gave out. On CUDA tensors when
`KVX_TEST_DEVICE=<ordinal>` is set and torch sees a GPU; else torch CPU tensors (or NumPy
arrays without torch) on the emulated device."""

import os

import pytest

try:
    import torch
except ImportError:
    torch = None
try:
    import numpy as np
except ImportError:
    np = None

if torch is None and np is None:
    pytest.skip("the data path moves torch tensors or NumPy arrays; neither is installed here", allow_module_level=True)

import kvxfer
from kvxfer.vllm.slot_mover import SlotMover, block_geometry, engine_for

_ENV = os.environ.get("KVX_TEST_DEVICE", "emulated")
CUDA = _ENV not in ("emulated", "-1") and torch is not None and torch.cuda.is_available()

PAGE = 16 * 1024
BLOCKS = 16


def caches(layers, seed):
    """`layers` KV cache tensors of `(BLOCKS, PAGE)` bytes, random: CUDA tensors, CPU
    tensors, or NumPy arrays."""
    if torch is not None:
        g = torch.Generator().manual_seed(seed)
        ts = [torch.randint(-128, 128, (BLOCKS, PAGE), dtype=torch.int8, generator=g) for _ in range(layers)]
        return [t.to(f"cuda:{int(_ENV)}") for t in ts] if CUDA else ts
    rng = np.random.default_rng(seed)
    return [rng.integers(-128, 128, (BLOCKS, PAGE), dtype=np.int8) for _ in range(layers)]


def page(t, b):
    """Block `b` of tensor `t` as bytes, on the host."""
    row = t[b]
    return (row.cpu().numpy() if torch is not None and isinstance(row, torch.Tensor) else row).tobytes()


def zero(ts):
    for t in ts:
        t[:] = 0


class Setup:
    """A worker's mover over `tensors` (grouped by `groups`), its rank's store made and
    owned by a scheduler-side engine, and the same store opened for data only on the
    worker's engine."""

    def __init__(self, tmp_path, tensors, groups):
        self.tensors = tensors
        self.engine = engine_for(tensors)
        self.mover = SlotMover(self.engine, [(t, PAGE) for t in tensors], groups)
        self.owner_engine = kvxfer.Engine("emulated")
        d = str(tmp_path / "rank0")
        self.owner = kvxfer.Store(self.owner_engine, d, self.mover.geometry, 32, namespace=b"test model rank 0", shards=2)
        self.data = kvxfer.Store(self.engine, d, self.mover.geometry, 32, namespace=b"test model rank 0", shards=2, data_only=True, create=False)

    def close(self):
        self.data.close()
        self.owner.close()
        self.mover.close()
        self.owner_engine.close()
        self.engine.close()

    def store(self, keys, blocks, group_sizes):
        """The owner reserves, the worker writes, the owner commits."""
        res = self.owner.reserve_slots(keys)
        assert all(r.kind == kvxfer.Reservation.WRITE for r in res)
        handles = [r.handle for r in res]
        assert self.mover.write(self.data, blocks, group_sizes, handles).results() == [None] * len(keys)
        assert self.owner.commit_slots(handles) == [None] * len(keys)

    def load(self, keys, blocks, group_sizes):
        """The owner leases, the worker reads, the owner releases. Returns the per-block
        results."""
        handles = self.owner.lease_slots(keys)
        try:
            return self.mover.read(self.data, handles, blocks, group_sizes).results()
        finally:
            self.owner.release_leases([k for k, h in zip(keys, handles) if h is not None])


@pytest.fixture
def one_group(tmp_path):
    s = Setup(tmp_path, caches(3, seed=1), [[0, 1, 2]])
    yield s
    s.close()


def test_the_geometry_is_a_page_per_layer_of_the_group(one_group):
    g = one_group.mover.geometry
    assert (g.num_layers, g.inner_dim, g.block_bytes, g.kind) == (3, PAGE, 3 * PAGE, "layer_block_first")


def test_blocks_written_to_slots_read_back_exact(one_group):
    s = one_group
    keys = [b"hash-%d" % i for i in range(4)]
    want = [[page(t, b) for t in s.tensors] for b in (0, 1, 2, 3)]
    s.store(keys, [0, 1, 2, 3], [4])
    zero(s.tensors)
    assert s.load(keys, [12, 13, 14, 15], [4]) == [None] * 4
    assert [[page(t, b) for t in s.tensors] for b in (12, 13, 14, 15)] == want


def test_a_store_block_is_the_group_layers_pages_in_order(one_group):
    """What a worker wrote is what a plain get of the key returns: layer 0's page, then
    layer 1's, ... (the store's block of the geometry)."""
    if np is None:
        pytest.skip("the check reads the block into a NumPy array; NumPy is not installed here")
    s = one_group
    s.store([b"k"], [5], [1])
    host = np.zeros(2 * s.mover.block_bytes, dtype=np.uint8)
    cfg = kvxfer.LayoutConfig(num_blocks=2, num_layers=3, outer_dim=1, page_size=1, inner_dim=PAGE, dtype_bytes=1)
    with s.owner_engine.register(host, cfg) as dst:
        s.owner.get([b"k"], dst, [1]).wait()
    assert host[s.mover.block_bytes :].tobytes() == b"".join(page(t, 5) for t in s.tensors)


def test_a_missing_handle_fails_its_block_alone(one_group):
    s = one_group
    s.store([b"a", b"b"], [0, 1], [2])
    want = [page(t, 1) for t in s.tensors]
    zero(s.tensors)
    results = s.load([b"never stored", b"b"], [6, 7], [2])
    assert isinstance(results[0], kvxfer.NotFound) and results[1] is None
    assert [page(t, 7) for t in s.tensors] == want


def test_a_critical_read_reads_its_slots_critical(one_group, monkeypatch):
    """A request waits for its load: the worker asks the mover for latency-critical
    reads, which the store serves ahead of bulk transfers."""
    s = one_group
    s.store([b"e"], [2], [1])
    want = [page(t, 2) for t in s.tensors]
    zero(s.tensors)
    asked = []
    read = s.data.read_slots

    def recording(*args, **kwargs):
        asked.append(kwargs.get("critical", False))
        return read(*args, **kwargs)

    monkeypatch.setattr(s.data, "read_slots", recording)
    handles = s.owner.lease_slots([b"e"])
    try:
        assert s.mover.read(s.data, handles, [6], [1], critical=True).results() == [None]
        assert s.mover.read(s.data, handles, [7], [1]).results() == [None]
    finally:
        s.owner.release_leases([b"e"])
    assert asked == [True, False]
    assert [page(t, 6) for t in s.tensors] == want and [page(t, 7) for t in s.tensors] == want


def test_groups_of_one_geometry_each_move_their_own_layers(tmp_path):
    """Two KV cache groups (two layers each): a job's blocks come group by group, and each
    block moves the layers of its group."""
    s = Setup(tmp_path, caches(4, seed=2), [[0, 1], [2, 3]])
    try:
        want = [page(s.tensors[i], b) for i, b in ((0, 3), (1, 3), (0, 4), (1, 4), (2, 9), (3, 9))]
        s.store([b"g0-a", b"g0-b", b"g1-a"], [3, 4, 9], [2, 1])
        zero(s.tensors)
        assert s.load([b"g0-a", b"g0-b", b"g1-a"], [1, 2, 11], [2, 1]) == [None] * 3
        got = [page(s.tensors[i], b) for i, b in ((0, 1), (1, 1), (0, 2), (1, 2), (2, 11), (3, 11))]
        assert got == want
    finally:
        s.close()


def test_groups_of_different_geometry_are_refused():
    with pytest.raises(kvxfer.Unsupported, match="KV cache groups differ"):
        block_geometry([PAGE, PAGE, PAGE], [[0, 1], [2]], BLOCKS)
    with pytest.raises(kvxfer.Unsupported, match="KV cache groups differ"):
        block_geometry([PAGE, 2 * PAGE], [[0], [1]], BLOCKS)


def test_a_job_whose_handles_do_not_match_its_blocks_is_refused(one_group):
    s = one_group
    with pytest.raises(kvxfer.InvalidArgument, match="one handle per block"):
        s.mover.read(s.data, [None], [0, 1], [2])


def test_the_caches_are_on_the_gpu_kvx_test_device_names(one_group):
    """Says, in the skip reasons, where the suite ran when no GPU was asked for or seen."""
    if _ENV in ("emulated", "-1"):
        pytest.skip("KVX_TEST_DEVICE names no GPU: CPU memory on the emulated device stood in for vLLM's GPU caches")
    if not CUDA:
        why = "torch is not installed" if torch is None else "torch sees no CUDA GPU"
        pytest.skip(f"KVX_TEST_DEVICE={_ENV}, but {why}: the suite ran on the emulated device")
    assert one_group.engine.device == int(_ENV)
    assert all(t.is_cuda and t.device.index == int(_ENV) for t in one_group.tensors)
