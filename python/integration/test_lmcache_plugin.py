"""kvxfer as LMCache's L2 storage, driven by LMCache itself (the installed LMCache, a
release of `SUPPORTED_LMCACHE`, never a copy of its interface): the `--l2-adapter` JSON naming `kvxfer.lmcache` goes
through LMCache's own parser and adapter factory, which load the connector as a
`native_plugin` and wrap it in LMCache's `NativeConnectorL2Adapter`; the tests then make
the calls LMCache's multi-process storage manager makes on that adapter, on objects from
LMCache's own allocator. Skipped where LMCache is not installed (it runs in the venv
that has it); run by `make integration-test`."""

import argparse
import importlib.metadata
import json
import os
import select
import subprocess
import sys
import threading
import time

import pytest

import kvxfer
import kvxfer.lmcache as kv_lmcache
from kvx_integration import fill_up, small_file_system

torch = pytest.importorskip("torch")
l2_config = pytest.importorskip("lmcache.v1.distributed.l2_adapters.config")
from lmcache.integration.vllm.vllm_multi_process_adapter import ParallelStrategy  # noqa: E402
from lmcache.v1.distributed.api import ObjectKey, ipc_key_to_object_keys  # noqa: E402
from lmcache.v1.distributed.internal_api import L2AdapterListener  # noqa: E402
from lmcache.v1.distributed.l2_adapters import create_l2_adapter  # noqa: E402
from lmcache.v1.memory_management import MemoryFormat  # noqa: E402
from lmcache.v1.memory_allocators.tensor_memory_allocator import TensorMemoryAllocator  # noqa: E402
from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey  # noqa: E402
from lmcache.v1.multiprocess.token_hasher import TokenHasher  # noqa: E402
from lmcache.v1.multiprocess.transfer_context.base import gather_paged_kv_to_cpu, scatter_cpu_to_paged_kv  # noqa: E402

#: A hang guard only: every wait here ends as soon as the tasks do.
DEADLINE_S = 60.0
#: One object: K and V of 4 layers × 16 tokens × 64 elements in bf16 (16 KiB).
SHAPE = torch.Size([2, 4, 16, 64])
PARTIAL = torch.Size([2, 4, 5, 64])  # a partial chunk: another object size
#: A full chunk's object size, the `object_bytes` every server over a shared tier is given.
OBJECT_BYTES = SHAPE.numel() * 2
MODEL = "kvxfer/test-model"


if importlib.metadata.version("lmcache") not in kv_lmcache.SUPPORTED_LMCACHE:
    installed = importlib.metadata.version("lmcache")
    pytest.skip(f"LMCache {installed} is installed; these tests drive {kv_lmcache.SUPPORTED_LMCACHE}", allow_module_level=True)


def make_adapter(root, **params):
    """LMCache's adapter for the `--l2-adapter` JSON naming kvxfer.lmcache, built as its
    multi-process server builds it: parsed by its argument parser, made by its factory."""
    spec = {
        "type": "native_plugin",
        "module_path": "kvxfer.lmcache",
        "class_name": "KvxferConnector",
        "adapter_params": {"root_dir": str(root), "capacity_bytes": 64 * SHAPE.numel() * 2, "model": MODEL, "dtype": "bfloat16", **params},
    }
    parser = l2_config.add_l2_adapters_args(argparse.ArgumentParser())
    config = l2_config.parse_args_to_l2_adapters_config(parser.parse_args(["--l2-adapter", json.dumps(spec)]))
    (adapter_config,) = config.adapters
    return create_l2_adapter(adapter_config)


class Objects:
    """LMCache's L1 memory: its tensor allocator over one host buffer."""

    def __init__(self):
        self.allocator = TensorMemoryAllocator(torch.empty(16 << 20, dtype=torch.uint8))
        self.made = []

    def make(self, seed=None, shape=SHAPE, dtype=torch.bfloat16, fmt=MemoryFormat.KV_2LTD):
        obj = self.allocator.allocate(shape, dtype, fmt)
        assert obj is not None
        self.made.append(obj)
        g = torch.Generator().manual_seed(seed if seed is not None else 0)
        obj.raw_data.view(torch.uint8).copy_(torch.randint(0, 256, (obj.get_size(),), dtype=torch.uint8, generator=g))
        if seed is None:
            obj.raw_data.view(torch.uint8).zero_()
        return obj


@pytest.fixture
def mem():
    objects = Objects()
    yield objects
    for obj in objects.made:
        obj.ref_count_down()  # back to the allocator, as LMCache frees them


def payload(obj):
    return bytes(obj.byte_array)


def key(n, salt=""):
    return ObjectKey(chunk_hash=bytes([n]) * 32, model_name=MODEL, kv_rank=0, cache_salt=salt)


def wait_for(fd, fetch):
    """What `fetch()` returns once it is not None, waiting on the adapter's event fd
    between tries, as LMCache's storage controllers do."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        got = fetch()
        if got is not None:
            return got
        assert time.monotonic() < deadline, "the adapter never completed the task"
        select.select([fd], [], [], 1.0)


def store(adapter, keys, objs):
    tid = adapter.submit_store_task(keys, objs)
    results = {}

    def fetch():
        results.update(adapter.pop_completed_store_tasks())
        return results.get(tid)

    return wait_for(adapter.get_store_event_fd(), fetch)


def lookup(adapter, keys):
    tid = adapter.submit_lookup_and_lock_task(keys, {})
    bitmap = wait_for(adapter.get_lookup_and_lock_event_fd(), lambda: adapter.query_lookup_and_lock_result(tid))
    adapter.submit_unlock(keys)
    return [bitmap.test(i) for i in range(len(keys))]


def load(adapter, keys, objs):
    tid = adapter.submit_load_task(keys, objs)
    bitmap = wait_for(adapter.get_load_event_fd(), lambda: adapter.query_load_result(tid))
    return [bitmap.test(i) for i in range(len(keys))]


def test_set_exists_get_byte_exact_and_misses_alone(tmp_path, mem):
    adapter = make_adapter(tmp_path)
    try:
        keys = [key(1), key(2), key(3), key(4, salt="user-a")]
        objs = [mem.make(1), mem.make(2), mem.make(3), mem.make(4, PARTIAL)]
        assert int(store(adapter, keys, objs)) >= 0, "the store task failed"
        assert lookup(adapter, keys + [key(9), key(1, salt="user-b")]) == [True, True, True, True, False, False]
        back = [mem.make(), mem.make(), mem.make(), mem.make(shape=PARTIAL)]
        assert load(adapter, keys, back) == [True] * 4
        assert [payload(b) for b in back] == [payload(o) for o in objs]
        # A miss is a miss for its key alone: the others still load.
        again = [mem.make(), mem.make(), mem.make()]
        assert load(adapter, [key(2), key(9), key(3)], again) == [True, False, True]
        assert payload(again[0]) == payload(objs[1]) and payload(again[2]) == payload(objs[2])
        # A key held at another object size is not loaded into this one.
        assert load(adapter, [key(4, salt="user-a")], [mem.make()]) == [False]
    finally:
        adapter.close()


def test_the_connectors_event_fd_is_readable_when_a_batch_completes(tmp_path, mem):
    """The native client's own protocol, as LMCache's adapter drives it: submit, wait for
    the event fd, drain; the fd stays unreadable once drained with nothing in flight."""
    c = kv_lmcache.KvxferConnector(root_dir=str(tmp_path), capacity_bytes=1 << 20, model=MODEL)
    try:
        fd = c.event_fd()
        assert not select.select([fd], [], [], 0)[0]
        objs = [mem.make(5), mem.make(6)]
        done = {}

        def drain_until(fid):
            deadline = time.monotonic() + DEADLINE_S
            while fid not in done:
                assert time.monotonic() < deadline, "the batch never completed"
                if select.select([fd], [], [], 1.0)[0]:
                    done.update({f: (ok, why, bools) for f, ok, why, bools in c.drain_completions()})
            return done.pop(fid)

        ok, why, bools = drain_until(c.submit_batch_set(["a@0@0@05", "a@0@0@06"], [o.byte_array for o in objs]))
        assert ok and bools == [True, True], why
        assert drain_until(c.submit_batch_exists(["a@0@0@05", "a@0@0@07"]))[2] == [True, False]
        back = [mem.make(), mem.make()]
        ok, why, bools = drain_until(c.submit_batch_get(["a@0@0@07", "a@0@0@06"], [o.byte_array for o in back]))
        assert not ok and bools == [False, True] and "not hold" in why, why
        assert payload(back[1]) == payload(objs[1])
        assert drain_until(c.submit_batch_delete(["a@0@0@05", "a@0@0@07"]))[2] == [True, False]
        assert not select.select([fd], [], [], 0)[0], "readable with nothing in flight after the drain"
        assert c.drain_completions() == []
    finally:
        c.close()


class KeyAccount(L2AdapterListener):
    """The keys LMCache's adapter reports held: stored less deleted, from its key events."""

    def __init__(self):
        self.held = set()

    def on_l2_keys_stored(self, keys, sizes):
        self.held |= set(keys)

    def on_l2_keys_accessed(self, keys):
        pass

    def on_l2_keys_deleted(self, keys):
        self.held -= set(keys)


def test_lmcaches_key_events_follow_the_stores_and_deletes(tmp_path, mem):
    """The key events LMCache's adapter publishes for kvxfer's objects (what its L2
    accounting and coordinator count; the connector has no events of its own) are what
    the store holds after stores and deletes, a key never stored among them: the
    connector answers each key of a delete alone."""
    adapter = make_adapter(tmp_path)
    account = KeyAccount()
    adapter.register_listener(account)
    try:
        keys = [key(n) for n in range(1, 21)]
        for batch in (keys[:10], keys[10:]):
            assert int(store(adapter, batch, [mem.make(k.chunk_hash[0]) for k in batch])) >= 0, "the store task failed"
        adapter.delete([keys[2], key(99), keys[11], keys[19]])
        held = {k for k, h in zip(keys + [key(99)], lookup(adapter, keys + [key(99)])) if h}
        assert len(held) == 17
        assert account.held == held
    finally:
        adapter.close()


def test_an_engine_at_its_admission_limit_fails_objects_alone_and_loses_none(tmp_path, mem):
    """An engine admitting one request at a time: each object of a batch is stored (or
    loaded, byte for byte) or False alone, and an object stored is never lost to the
    pressure: alone, each one loads."""
    c = kv_lmcache.KvxferConnector(root_dir=str(tmp_path), capacity_bytes=1 << 20, model=MODEL, engine={"max_inflight": 1})

    def run(fid):
        return wait_for(c.event_fd(), lambda: next((bools for f, _, _, bools in c.drain_completions() if f == fid), None))

    try:
        keys = [f"a@0@0@{i:02x}" for i in range(6)]
        objs = [mem.make(70 + i) for i in range(6)]
        for k, o, ok in zip(keys, objs, run(c.submit_batch_set(keys, [o.byte_array for o in objs]))):
            if not ok:
                assert run(c.submit_batch_set([k], [o.byte_array])) == [True], "an object alone is stored"
        back = [mem.make() for _ in objs]
        for k, b, o, ok in zip(keys, back, objs, run(c.submit_batch_get(keys, [b.byte_array for b in back]))):
            if not ok:
                assert run(c.submit_batch_get([k], [b.byte_array])) == [True], "a stored object alone loads"
            assert payload(b) == payload(o)
    finally:
        c.close()


def _data_file(root):
    (d,) = [e for e in os.listdir(root) if os.path.isdir(os.path.join(root, e))]
    return os.path.join(root, d, "data-0")


def allocated(root):
    """The bytes the files under `root` take on disk."""
    return sum(os.stat(os.path.join(d, f)).st_blocks * 512 for d, _, fs in os.walk(root) for f in fs)


def test_objects_of_every_size_share_one_capacity(tmp_path, mem):
    """A partial chunk of each size goes into the store of the full chunks: the files
    take the capacity once, however many sizes come."""
    capacity = 64 * SHAPE.numel() * 2
    adapter = make_adapter(tmp_path, capacity_bytes=capacity)
    try:
        shapes = [SHAPE] + [torch.Size([2, 4, t, 64]) for t in (1, 5, 9, 15)]
        keys = [key(30 + i) for i in range(len(shapes))]
        objs = [mem.make(30 + i, shape) for i, shape in enumerate(shapes)]
        assert int(store(adapter, keys, objs)) >= 0
        assert lookup(adapter, keys) == [True] * len(keys)
        back = [mem.make(shape=shape) for shape in shapes]
        assert load(adapter, keys, back) == [True] * len(keys)
        assert [payload(b) for b in back] == [payload(o) for o in objs]
    finally:
        adapter.close()
    assert allocated(tmp_path) <= capacity * 5 // 4, f"{allocated(tmp_path)} bytes on disk for a capacity of {capacity}"


class CompletionThreadAfterListing:
    """LMCache's completion thread, which drains the connector without LMCache's lock,
    started the moment a submit lists its batch (the first release of the connector's
    lock that finds one) and held right after it released the batch's requests, until
    `finish()`: the interleaving that meets a submit still looking at its batch."""

    def __init__(self, connector, monkeypatch):
        self.connector = connector
        self.lock = connector._lock
        self.released = threading.Event()
        self.go_on = threading.Event()
        self.drained = []
        self.thread = None
        release = kvxfer.StoreRequest.release

        def held_release(request):
            release(request)
            if threading.current_thread() is self.thread:
                self.released.set()
                self.go_on.wait(DEADLINE_S)

        monkeypatch.setattr(kvxfer.StoreRequest, "release", held_release)

    def __enter__(self):
        self.lock.acquire()

    def __exit__(self, *exc):
        self.lock.release()
        if self.connector._batches and self.thread is None:
            self.thread = threading.Thread(target=lambda: self.drained.extend(self.connector.drain_completions()))
            self.thread.start()
            self.released.wait(DEADLINE_S)

    def finish(self):
        self.go_on.set()
        if self.thread is not None:
            self.thread.join(DEADLINE_S)


def test_a_batch_the_completion_thread_finishes_first_never_fails_its_submit(tmp_path, mem, monkeypatch):
    c = kv_lmcache.KvxferConnector(root_dir=str(tmp_path), capacity_bytes=1 << 20, model=MODEL)
    try:
        put = c.submit_batch_set(["a@0@0@01"], [mem.make(1).byte_array])
        assert wait_for(c.event_fd(), lambda: next((ok for f, ok, _, _ in c.drain_completions() if f == put), None))
        c._lock = racing = CompletionThreadAfterListing(c, monkeypatch)
        try:
            fid = c.submit_batch_get(["a@0@0@09"], [mem.make().byte_array])  # not held: ends inside the call
        finally:
            racing.finish()
            c._lock = racing.lock
        assert [bools for f, _, _, bools in racing.drained if f == fid] == [[False]]
    finally:
        c.close()


def test_a_restart_finds_what_was_stored_and_a_flipped_byte_is_a_miss_for_its_key(tmp_path, mem):
    keys = [key(11), key(12), key(13)]
    objs = [mem.make(11), mem.make(12), mem.make(13)]
    adapter = make_adapter(tmp_path)
    try:
        assert int(store(adapter, keys, objs)) >= 0
    finally:
        adapter.close()
    # One byte of the first slot's block changes while no one has the store open.
    path = _data_file(tmp_path)
    with open(path, "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0x5A]))
    adapter = make_adapter(tmp_path)
    try:
        assert lookup(adapter, keys) == [True] * 3, "a restart finds what was stored"
        back = [mem.make(), mem.make(), mem.make()]
        loaded = load(adapter, keys, back)
        assert loaded.count(False) == 1, f"exactly the damaged key misses: {loaded}"
        for ok, b, o in zip(loaded, back, objs):
            if ok:
                assert payload(b) == payload(o)
        # The damaged entry is dropped: it is not found again.
        assert lookup(adapter, keys) == loaded
    finally:
        adapter.close()


def test_a_changed_configuration_does_not_find_what_another_stored(tmp_path, mem):
    adapter = make_adapter(tmp_path)
    try:
        assert int(store(adapter, [key(21)], [mem.make(21)])) >= 0
    finally:
        adapter.close()
    for changed in ({"dtype": "float16"}, {"world_size": 2}, {"namespace": "weights v2"}):
        adapter = make_adapter(tmp_path, **changed)
        try:
            assert lookup(adapter, [key(21)]) == [False], changed
        finally:
            adapter.close()
    adapter = make_adapter(tmp_path)
    try:
        assert lookup(adapter, [key(21)]) == [True], "the first configuration still finds it"
    finally:
        adapter.close()


def serving(root, mem, shared, **params):
    """A connector over `shared` that has served objects of its own already, a full
    chunk first and then a partial one: its store is made, with a full chunk's slot, and
    holds both sizes."""
    adapter = make_adapter(root, shared=shared, object_bytes=OBJECT_BYTES, **params)
    try:
        assert int(store(adapter, [key(50), key(51)], [mem.make(50), mem.make(51, PARTIAL)])) >= 0
    except BaseException:
        adapter.close()
        raise
    return adapter


@pytest.mark.parametrize("write", ["through", "behind"])
def test_a_second_server_loads_what_the_first_stored_through_a_shared_tier(tmp_path, mem, write):
    """Two LMCache servers of one model, each with a root_dir of its own, over one shared
    directory: a prompt the first stores (full chunks and a partial last one; written
    through: published when its store task completes; behind: published by its close at
    the latest), the second, serving objects of both sizes already, finds whole and
    loads byte for byte into its own objects; an object never stored is a miss, and a
    server of another configuration finds none of it."""
    shared = {"dir": str(tmp_path / "shared"), "write": write}
    keys = [key(1), key(2), key(3)]
    objs = [mem.make(1), mem.make(2), mem.make(3, PARTIAL)]
    a = make_adapter(tmp_path / "a", shared=shared, object_bytes=OBJECT_BYTES)
    running = [a]
    try:
        assert int(store(a, keys, objs)) >= 0, "the store task failed"
        if write == "behind":
            running.pop().close()  # what is still behind is published here
        b = serving(tmp_path / "b", mem, shared)
        running.append(b)
        assert lookup(b, keys + [key(9)]) == [True, True, True, False]
        back = [mem.make(), mem.make(), mem.make(shape=PARTIAL), mem.make()]
        assert load(b, keys + [key(9)], back) == [True, True, True, False]
        assert [payload(o) for o in back[:3]] == [payload(o) for o in objs]
    finally:
        for adapter in running:
            adapter.close()
    for n, other in enumerate(({"model": "kvxfer/other-model"}, {"namespace": "weights v2"})):
        c = serving(tmp_path / f"c{n}", mem, shared, **other)
        try:
            assert lookup(c, keys) == [False] * 3, other
            assert load(c, keys, [mem.make(), mem.make(), mem.make(shape=PARTIAL)]) == [False] * 3, other
        finally:
            c.close()


def test_a_server_that_stored_nothing_yet_finds_what_another_stored_through_a_shared_tier(tmp_path, mem):
    """Servers over one shared tier open their stores at the start with `object_bytes`
    as the slot: one that has stored nothing yet finds and loads another's full chunks,
    and so does one whose first object was a partial chunk."""
    shared = {"dir": str(tmp_path / "shared"), "write": "through"}
    keys = [key(1), key(2)]
    objs = [mem.make(1), mem.make(2)]
    a = make_adapter(tmp_path / "a", shared=shared, object_bytes=OBJECT_BYTES)
    try:
        assert int(store(a, keys, objs)) >= 0, "the store task failed"
        b = make_adapter(tmp_path / "b", shared=shared, object_bytes=OBJECT_BYTES)
        try:
            assert lookup(b, keys) == [True, True]
            back = [mem.make(), mem.make()]
            assert load(b, keys, back) == [True, True]
            assert [payload(o) for o in back] == [payload(o) for o in objs]
        finally:
            b.close()
        c = make_adapter(tmp_path / "c", shared=shared, object_bytes=OBJECT_BYTES)
        try:
            assert int(store(c, [key(60)], [mem.make(60, PARTIAL)])) >= 0, "the store task failed"
            assert lookup(c, keys) == [True, True]
            back = [mem.make(), mem.make()]
            assert load(c, keys, back) == [True, True]
            assert [payload(o) for o in back] == [payload(o) for o in objs]
        finally:
            c.close()
    finally:
        a.close()


@pytest.mark.parametrize("bad", [None, 0, True, "16384", [], [16384, 0]], ids=["missing", "zero", "bool", "text", "empty-list", "list-with-zero"])
def test_a_shared_tier_without_a_valid_object_bytes_is_refused_at_the_start(tmp_path, bad):
    params = {} if bad is None else {"object_bytes": bad}
    with pytest.raises(kvxfer.InvalidArgument, match="object_bytes"):
        make_adapter(tmp_path / "root", shared={"dir": str(tmp_path / "shared")}, **params)
    assert not (tmp_path / "root").exists(), "nothing made before the refusal"


@pytest.mark.parametrize("bad", [{"bucket": "kv"}, "/mnt/nfs/kv"], ids=["unknown-key", "not-a-mapping"])
def test_a_bad_shared_setting_is_refused_at_the_start(tmp_path, bad):
    says = r'unknown "shared" key\(s\) bucket; known: dir, capacity_bytes, s3_bucket' if isinstance(bad, dict) else "give a mapping"
    with pytest.raises(kvxfer.InvalidArgument, match=says):
        make_adapter(tmp_path, shared=bad)


def another_lmcache(monkeypatch, version):
    """`importlib.metadata` reports LMCache at `version`, a release outside the tested ones."""
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: version if name == "lmcache" else real(name))


@pytest.mark.parametrize("version", ["0.5.4", "0.5.7"])
def test_another_lmcache_version_is_refused_naming_the_supported_ones(tmp_path, monkeypatch, version):
    another_lmcache(monkeypatch, version)
    monkeypatch.delenv("KVX_LMCACHE_ANY_VERSION", raising=False)
    with pytest.raises(kvxfer.Unsupported, match=rf"supports LMCache 0\.5\.5 or 0\.5\.6,.*LMCache {version} is installed.*set KVX_LMCACHE_ANY_VERSION=1"):
        make_adapter(tmp_path)


def test_the_opt_in_runs_another_lmcache_version_with_a_warning(tmp_path, monkeypatch, mem, caplog):
    another_lmcache(monkeypatch, "0.5.7")
    monkeypatch.setenv("KVX_LMCACHE_ANY_VERSION", "1")
    with caplog.at_level("WARNING", logger="kvxfer.tier"):
        adapter = make_adapter(tmp_path)
    try:
        (line,) = [r.getMessage() for r in caplog.records if r.name == "kvxfer.tier"]
        assert "tested with LMCache 0.5.5 or 0.5.6; LMCache 0.5.7 is installed and runs untested" in line
        obj = mem.make(7)
        assert int(store(adapter, [key(7)], [obj])) >= 0, "the store task failed"
        back = mem.make()
        assert load(adapter, [key(7)], [back]) == [True] and payload(back) == payload(obj)
    finally:
        adapter.close()


def test_import_kvxfer_never_imports_lmcache():
    code = "import sys, kvxfer, kvxfer.lmcache; sys.exit('lmcache' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], env=os.environ.copy()).returncode == 0


def test_a_full_disk_fails_the_objects_it_stops_and_loses_none(tmp_path, mem, caplog):
    """A file system filled up under the store: a set whose bookkeeping cannot be written
    (an object of a size not stored before) is False for that object, with one line
    naming the cause, and LMCache serves on; what was stored still loads."""
    with small_file_system(tmp_path / "fs", 4 << 20) as root:
        c = kv_lmcache.KvxferConnector(root_dir=str(root), capacity_bytes=1 << 20, model=MODEL)

        def run(fid):
            return wait_for(c.event_fd(), lambda: next((bools for f, _, _, bools in c.drain_completions() if f == fid), None))

        try:
            objs = [mem.make(80), mem.make(81)]
            assert run(c.submit_batch_set(["a@0@0@50", "a@0@0@51"], [o.byte_array for o in objs])) == [True, True]
            fill_up(root)
            partial = mem.make(82, PARTIAL)
            with caplog.at_level("WARNING", logger="kvxfer.lmcache"):
                assert run(c.submit_batch_set(["a@0@0@52", "a@0@0@53"], [partial.byte_array, mem.make(83).byte_array])) == [False, True]
            (line,) = [r.getMessage() for r in caplog.records if r.name == "kvxfer.lmcache"]
            assert "a set of 2 objects: 1 of 2 keys failed (OSError, key a@0@0@52: [Errno 28] No space left" in line
            back = [mem.make(), mem.make()]
            assert run(c.submit_batch_get(["a@0@0@50", "a@0@0@51"], [b.byte_array for b in back])) == [True, True]
            assert [payload(b) for b in back] == [payload(o) for o in objs]
        finally:
            c.close()


def test_a_misspelt_setting_is_refused_naming_the_settings(tmp_path):
    with pytest.raises(kvxfer.InvalidArgument, match=r"capacity_byte\b.*capacity_bytes, capacity_gb"):
        make_adapter(tmp_path, capacity_byte=1 << 20)


@pytest.mark.parametrize("bad", [{"shards": 0}, {"capacity_bytes": "filesystem + 1"}], ids=["no-shards", "past-the-file-system"])
def test_a_setting_no_store_can_take_is_refused_at_the_start(tmp_path, bad):
    if bad.get("capacity_bytes") == "filesystem + 1":
        fs = os.statvfs(tmp_path)
        bad = {"capacity_bytes": fs.f_blocks * fs.f_frsize + 1}
    with pytest.raises(kvxfer.InvalidArgument, match="shards|file system"):
        make_adapter(tmp_path, **bad)


def test_a_root_dir_that_cannot_be_made_is_refused_at_the_start(tmp_path):
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(kvxfer.InvalidArgument, match=r"root_dir .*file/kv cannot be made \(Not a directory\); give a directory"):
        make_adapter(tmp_path / "file" / "kv")


def test_a_second_server_on_the_same_root_dir_is_refused_naming_the_first(tmp_path, mem):
    first = make_adapter(tmp_path)
    try:
        assert int(store(first, [key(40)], [mem.make(40)])) >= 0
        with pytest.raises(kvxfer.Busy, match=rf"pid {os.getpid()}\b.*its own root_dir"):
            make_adapter(tmp_path)
        assert lookup(first, [key(40)]) == [True], "the first serves on"
    finally:
        first.close()
    again = make_adapter(tmp_path)
    try:
        assert lookup(again, [key(40)]) == [True], "the next start owns the store"
    finally:
        again.close()


def test_another_shard_count_makes_the_store_afresh_with_a_warning(tmp_path, mem, caplog):
    adapter = make_adapter(tmp_path, shards=1)
    try:
        assert int(store(adapter, [key(50)], [mem.make(50)])) >= 0
    finally:
        adapter.close()
    with caplog.at_level("WARNING", logger="kvxfer.tier"):
        adapter = make_adapter(tmp_path, shards=2)
    try:
        assert any("shards" in r.getMessage() and "afresh" in r.getMessage() for r in caplog.records)
        assert lookup(adapter, [key(50)]) == [False]
        obj = mem.make(51)
        assert int(store(adapter, [key(51)], [obj])) >= 0
        back = mem.make()
        assert load(adapter, [key(51)], [back]) == [True] and payload(back) == payload(obj)
    finally:
        adapter.close()


def test_a_drain_does_not_wait_for_the_store_to_be_made(tmp_path, mem, monkeypatch):
    """Making the store takes its whole capacity (a long fallocate): LMCache's
    completion thread drains meanwhile."""
    c = kv_lmcache.KvxferConnector(root_dir=str(tmp_path), capacity_bytes=1 << 20, model=MODEL)
    opening, go_on = threading.Event(), threading.Event()
    make = kv_lmcache.Store

    def slow_store(*args, **kwargs):
        opening.set()
        go_on.wait(DEADLINE_S)
        return make(*args, **kwargs)

    monkeypatch.setattr(kv_lmcache, "Store", slow_store)
    setter = threading.Thread(target=lambda: c.submit_batch_set(["a@0@0@01"], [mem.make(1).byte_array]))
    try:
        setter.start()
        assert opening.wait(DEADLINE_S)
        drain = threading.Thread(target=c.drain_completions)
        drain.start()
        drain.join(10)
        waited = drain.is_alive()
    finally:
        go_on.set()
        setter.join(DEADLINE_S)
        c.close()
    assert not waited, "the drain waited for the store to be made"


def test_the_layouts_over_lmcaches_objects_are_bounded(tmp_path, mem, monkeypatch):
    monkeypatch.setattr(kv_lmcache, "MAX_LAYOUTS", 2, raising=False)
    adapter = make_adapter(tmp_path)
    try:
        objs = [mem.make(60 + i) for i in range(5)]
        for i, obj in enumerate(objs):
            assert int(store(adapter, [key(60 + i)], [obj])) >= 0
        assert len(adapter._client._layouts) <= 2
        back = [mem.make() for _ in objs]
        assert load(adapter, [key(60 + i) for i in range(5)], back) == [True] * 5
        assert [payload(b) for b in back] == [payload(o) for o in objs]
    finally:
        adapter.close()


#: The attention kinds of vLLM's models that LMCache's multi-process mode stores to its
#: L2 (`LMCacheFamily`): full attention with grouped KV heads (Llama, Qwen), MLA
#: (DeepSeek V2/V3) and sliding-window layers beside full attention (Gemma 2/3, gpt-oss).
LMCACHE_FAMILIES = ("gqa", "mla", "hybrid-sliding")
#: A prompt of two chunks.
TOKENS = tuple(range(2 * 32))


class LMCacheFamily:
    """A model of attention kind `kind` (one of `LMCACHE_FAMILIES`) served by vLLM with
    tensor parallelism `tp` through LMCache's multi-process server, each step LMCache's
    own: each rank's KV caches are vLLM's tensors (NHD layout), one dict of layers per
    object group; LMCache's gather cuts a chunk's object out of them and its scatter puts
    one back; its `ParallelStrategy` says which ranks write and which shard a rank's
    objects are (MLA's latent is whole on every rank: one copy, written by rank 0, read by
    every rank); its key expansion names each object by model, kv rank and object group."""

    LAYERS = 4
    TOTAL_KV_HEADS = 2
    HEAD_SIZE = 64
    MLA_LATENT = 576  # DeepSeek's: the 512-wide compressed KV and the 64-wide RoPE key
    BLOCK = 16
    BLOCKS_PER_CHUNK = 2
    NUM_BLOCKS = 8
    HINTS = {"kv_layout": "NHD"}
    STORED_BLOCKS = [1, 2, 3, 4]
    LOADED_BLOCKS = [6, 0, 7, 5]

    def __init__(self, kind, tp, model=MODEL, dtype=torch.bfloat16):
        assert kind in LMCACHE_FAMILIES, kind
        self.kind, self.tp, self.model, self.dtype = kind, tp, model, dtype
        self.block_axis = 0 if kind == "mla" else 1

    def params(self):
        """The connector's `adapter_params` for this server: LMCache's settings copied."""
        return {"model": self.model, "dtype": str(self.dtype).removeprefix("torch."), "world_size": self.tp, "capacity_bytes": 16 << 20}

    def group_layers(self):
        """Each object group's layer count: a hybrid model's sliding-window layers are a
        group of their own, here half as many as its full-attention ones (objects of two
        sizes)."""
        return [self.LAYERS, self.LAYERS // 2] if self.kind == "hybrid-sliding" else [self.LAYERS]

    def kv_caches(self, rank):
        """Rank `rank`'s KV caches, each group's layers random (MLA's latent the same on
        every rank, other kinds' heads each rank's own)."""
        g = torch.Generator().manual_seed(0 if self.kind == "mla" else rank + 1)
        if self.kind == "mla":
            shape = (self.NUM_BLOCKS, self.BLOCK, self.MLA_LATENT)
        else:
            shape = (2, self.NUM_BLOCKS, self.BLOCK, self.TOTAL_KV_HEADS // self.tp, self.HEAD_SIZE)
        nbytes = torch.Size(shape).numel() * self.dtype.itemsize
        return [
            {f"g{group}.layer{i}": torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g).view(self.dtype).view(shape) for i in range(layers)}
            for group, layers in enumerate(self.group_layers())
        ]

    def object_shape(self, group):
        """The shape of one chunk's object of `group` in LMCache's L1."""
        layers, tokens = self.group_layers()[group], self.BLOCKS_PER_CHUNK * self.BLOCK
        if self.kind == "mla":
            return torch.Size([layers, tokens, self.MLA_LATENT])
        return torch.Size([2, layers, tokens, self.TOTAL_KV_HEADS // self.tp * self.HEAD_SIZE])

    def object_bytes(self):
        """Each object group's full chunk's object size, group 0's first."""
        return [self.object_shape(group).numel() * self.dtype.itemsize for group in range(len(self.group_layers()))]

    def objects(self, mem, group):
        """LMCache's L1 objects for the chunks of one group, as its server allocates them."""
        fmt = MemoryFormat.KV_MLA_FMT if self.kind == "mla" else MemoryFormat.KV_2LTD
        return [mem.make(shape=self.object_shape(group), dtype=self.dtype, fmt=fmt) for _ in range(len(self.STORED_BLOCKS) // self.BLOCKS_PER_CHUNK)]

    def strategy(self, rank):
        return ParallelStrategy(mla_only=self.kind == "mla", vllm_world_size=self.tp, vllm_worker_id=rank, tp_size=self.tp, pp_size=1, n_servers=1)

    def keys(self, rank, group):
        """The object keys of rank `rank`'s chunks of `TOKENS` in `group`, as LMCache's
        server makes them from the worker's request."""
        s = self.strategy(rank)
        ipc = IPCCacheServerKey(
            model_name=self.model, world_size=s.kv_world_size, worker_id=s.kv_worker_id, token_ids=TOKENS, start=0, end=len(TOKENS), request_id="r"
        )
        hashes = TokenHasher(chunk_size=self.BLOCKS_PER_CHUNK * self.BLOCK).compute_chunk_hashes(list(TOKENS))
        (keys,) = ipc_key_to_object_keys(ipc, hashes, [group])
        return keys

    def serve(self, adapter, mem):
        """Every writing rank stores each group's chunks of `TOKENS`; returns every rank's
        KV caches."""
        caches = [self.kv_caches(rank) for rank in range(self.tp)]
        for rank, groups in enumerate(caches):
            if not self.strategy(rank).is_kv_writer:
                continue
            for group, layers in enumerate(groups):
                objs = self.objects(mem, group)
                gather_paged_kv_to_cpu(layers, self.STORED_BLOCKS, self.BLOCKS_PER_CHUNK, layout_hints=self.HINTS, out=[o.tensor for o in objs])
                assert int(store(adapter, self.keys(rank, group), objs)) >= 0, "the store task failed"
        return caches

    def blocks(self, tensor, ids):
        return tensor.index_select(self.block_axis, torch.tensor(ids)).view(torch.uint8)

    def check(self, adapter, mem, caches):
        """Every rank's chunks of every group are found and load from `adapter` into
        LMCache's objects, and LMCache's scatter puts them into other blocks of fresh KV
        caches bit-exact."""
        for rank, groups in enumerate(caches):
            for group, layers in enumerate(groups):
                keys = self.keys(rank, group)
                assert lookup(adapter, keys) == [True] * len(keys), (rank, group)
                back = self.objects(mem, group)
                assert load(adapter, keys, back) == [True] * len(keys), (rank, group)
                fresh = {name: torch.zeros_like(t) for name, t in layers.items()}
                scatter_cpu_to_paged_kv(fresh, self.LOADED_BLOCKS, [o.tensor for o in back], self.BLOCKS_PER_CHUNK, layout_hints=self.HINTS)
                for name, t in layers.items():
                    assert torch.equal(self.blocks(fresh[name], self.LOADED_BLOCKS), self.blocks(t, self.STORED_BLOCKS)), (rank, group, name)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("kind", LMCACHE_FAMILIES)
def test_every_model_family_comes_back_exact(tmp_path, mem, kind, tp):
    """Every rank's KV of every object group, stored by the ranks that LMCache makes
    writers, comes back bit-exact into every rank's KV caches through LMCache's own
    scatter; MLA at TP 2 is one copy, not one per rank."""
    fam = LMCacheFamily(kind, tp)
    adapter = make_adapter(tmp_path, **fam.params())
    try:
        caches = fam.serve(adapter, mem)
        shards = fam.strategy(0).kv_world_size
        assert shards == (1 if kind == "mla" else tp)
        chunks = len(fam.STORED_BLOCKS) // fam.BLOCKS_PER_CHUNK
        assert adapter._client._store.stats().entries == chunks * len(fam.group_layers()) * shards
        fam.check(adapter, mem, caches)
    finally:
        adapter.close()


@pytest.mark.parametrize("kind", LMCACHE_FAMILIES)
def test_another_tp_size_dtype_or_model_is_a_miss(tmp_path, mem, kind):
    """A server of another TP size, KV dtype (float16 objects are as large as bfloat16
    ones, under the same keys) or model finds none of what one stored, never its KV."""
    fam = LMCacheFamily(kind, 1)
    adapter = make_adapter(tmp_path, **fam.params())
    try:
        fam.serve(adapter, mem)
    finally:
        adapter.close()
    for other in (LMCacheFamily(kind, 2), LMCacheFamily(kind, 1, dtype=torch.float16), LMCacheFamily(kind, 1, model="kvxfer/other-model")):
        adapter = make_adapter(tmp_path, **other.params())
        try:
            for rank in range(other.tp):
                for group in range(len(other.group_layers())):
                    keys = other.keys(rank, group)
                    assert lookup(adapter, keys) == [False] * len(keys), other.params()
                    assert load(adapter, keys, other.objects(mem, group)) == [False] * len(keys), other.params()
        finally:
            adapter.close()
    adapter = make_adapter(tmp_path, **fam.params())
    try:
        keys = fam.keys(0, 0)
        assert lookup(adapter, keys) == [True] * len(keys), "the first configuration still finds its KV"
    finally:
        adapter.close()


@pytest.mark.parametrize("tp", [1, 2])
def test_a_fresh_server_finds_every_group_of_a_hybrid_model_through_a_shared_tier(tmp_path, mem, tp):
    """`object_bytes` lists each object group's full chunk's object size: a server over a
    shared tier that has stored nothing yet finds and loads every group's chunks that
    another published, bit-exact."""
    fam = LMCacheFamily("hybrid-sliding", tp)
    params = {**fam.params(), "shared": {"dir": str(tmp_path / "shared"), "write": "through"}, "object_bytes": fam.object_bytes()}
    a = make_adapter(tmp_path / "a", **params)
    try:
        caches = fam.serve(a, mem)
    finally:
        a.close()
    b = make_adapter(tmp_path / "b", **params)
    try:
        fam.check(b, mem, caches)
    finally:
        b.close()


def test_one_object_size_given_as_a_list_is_the_same_configuration(tmp_path, mem):
    """`object_bytes` of one size, as a number or a one-item list, is one namespace:
    servers that spell it either way share."""
    shared = {"dir": str(tmp_path / "shared"), "write": "through"}
    a = make_adapter(tmp_path / "a", shared=shared, object_bytes=OBJECT_BYTES)
    try:
        obj = mem.make(1)
        assert int(store(a, [key(1)], [obj])) >= 0, "the store task failed"
    finally:
        a.close()
    b = make_adapter(tmp_path / "b", shared=shared, object_bytes=[OBJECT_BYTES])
    try:
        back = mem.make()
        assert load(b, [key(1)], [back]) == [True] and payload(back) == payload(obj)
    finally:
        b.close()
