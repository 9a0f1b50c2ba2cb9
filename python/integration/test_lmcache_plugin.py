"""kvxfer as LMCache's L2 storage, driven by LMCache itself (the installed lmcache==0.5.6,
never a copy of its interface): the `--l2-adapter` JSON naming `kvxfer.lmcache` goes
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
import time

import pytest

import kvxfer
import kvxfer.lmcache as kv_lmcache

torch = pytest.importorskip("torch")
l2_config = pytest.importorskip("lmcache.v1.distributed.l2_adapters.config")
from lmcache.v1.distributed.api import ObjectKey  # noqa: E402
from lmcache.v1.distributed.l2_adapters import create_l2_adapter  # noqa: E402
from lmcache.v1.memory_management import MemoryFormat  # noqa: E402
from lmcache.v1.memory_allocators.tensor_memory_allocator import TensorMemoryAllocator  # noqa: E402

#: A hang guard only: every wait here ends as soon as the tasks do.
DEADLINE_S = 60.0
#: One object: K and V of 4 layers × 16 tokens × 64 elements in bf16 (16 KiB).
SHAPE = torch.Size([2, 4, 16, 64])
PARTIAL = torch.Size([2, 4, 5, 64])  # a partial chunk: another object size
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
        self.allocator = TensorMemoryAllocator(torch.empty(1 << 20, dtype=torch.uint8))
        self.made = []

    def make(self, seed=None, shape=SHAPE):
        obj = self.allocator.allocate(shape, torch.bfloat16, MemoryFormat.KV_2LTD)
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


def _data_file(root, size):
    (d,) = [e for e in os.listdir(root) if e.endswith(f"_{size}")]
    return os.path.join(root, d, "data-0")


def test_a_restart_finds_what_was_stored_and_a_flipped_byte_is_a_miss_for_its_key(tmp_path, mem):
    keys = [key(11), key(12), key(13)]
    objs = [mem.make(11), mem.make(12), mem.make(13)]
    adapter = make_adapter(tmp_path)
    try:
        assert int(store(adapter, keys, objs)) >= 0
    finally:
        adapter.close()
    # One byte of the first slot's block changes while no one has the store open.
    path = _data_file(tmp_path, objs[0].get_size())
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


def test_another_lmcache_version_is_refused_naming_the_supported_one(tmp_path, monkeypatch):
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.5.5" if name == "lmcache" else real(name))
    with pytest.raises(kvxfer.Unsupported, match=r"supports LMCache 0\.5\.6.*LMCache 0\.5\.5 is installed"):
        make_adapter(tmp_path)


def test_import_kvxfer_never_imports_lmcache():
    code = "import sys, kvxfer, kvxfer.lmcache; sys.exit('lmcache' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], env=os.environ.copy()).returncode == 0
