"""The Python binding on the emulated device (or on `KVX_TEST_DEVICE=<ordinal>`) with
NumPy arrays: round trips, layer ranges, callbacks, asyncio, and the errors a caller
gets for bad input. Torch tests run where torch is installed and say so otherwise."""

import asyncio
import ctypes
import logging
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

import kvxfer
from kvxfer import _native as n

# As the Rust suites read it: unset, `emulated` or -1 is the emulated device, else a CUDA ordinal.
_DEVICE_ENV = os.environ.get("KVX_TEST_DEVICE", "emulated")
DEVICE = "emulated" if _DEVICE_ENV in ("emulated", "-1") else int(_DEVICE_ENV)


def geometry(kind="contiguous", blocks=16, layers=4):
    return kvxfer.LayoutConfig(kind=kind, num_blocks=blocks, num_layers=layers, outer_dim=2, page_size=16, inner_dim=64, dtype_bytes=2)


@pytest.fixture
def engine():
    with kvxfer.Engine(device=DEVICE, io_threads=2, bounce_bytes=1 << 20, slot_bytes=64 << 10) as e:
        yield e


def host_arrays(cfg, seed=0):
    """One uint16 array per allocation of `cfg`, filled with a pattern."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 65535, size=cfg.base_bytes // 2, dtype=np.uint16) for _ in range(cfg.bases)]


def blocks_of(arrays, cfg, block):
    """The bytes of one block across the layout's allocations, as the layout places them."""
    per_layer = cfg.outer_dim * cfg.page_size * cfg.inner_dim * cfg.dtype_bytes
    if cfg.kind == "contiguous":
        b = arrays[0].view(np.uint8)
        return b[block * cfg.block_bytes : (block + 1) * cfg.block_bytes].tobytes()
    out = b""
    for a in arrays:
        u = a.view(np.uint8)
        if cfg.kind == "layer_block_first":
            out += u[block * per_layer : (block + 1) * per_layer].tobytes()
        else:  # outer first: [outer][block][page*inner]
            half = per_layer // cfg.outer_dim
            for o in range(cfg.outer_dim):
                start = (o * cfg.num_blocks + block) * half
                out += u[start : start + half].tobytes()
    return out


@pytest.mark.parametrize("kind", ["contiguous", "layer_block_first", "layer_outer_first"])
def test_numpy_round_trip_through_disk_and_device(engine, tmp_path, kind):
    cfg = geometry(kind)
    src = host_arrays(cfg, 1)
    back = [np.zeros_like(a) for a in src]
    with engine.register(src, cfg) as h, engine.register(back, cfg) as b, engine.device_layout(cfg) as d, engine.disk_layout(
        cfg, tmp_path / "kv.bin"
    ) as k:
        ids = np.array([3, 0, 7, 12], dtype=np.int64)
        engine.submit(h, ids, k, ids[::-1]).wait()
        engine.submit(k, ids[::-1], d, [1, 2, 3, 4]).wait()
        engine.submit(d, range(1, 5), b, ids).wait(timeout=30)
    for blk in ids:
        assert blocks_of(back, cfg, blk) == blocks_of(src, cfg, blk)
    untouched = [x for x in range(cfg.num_blocks) if x not in ids]
    assert all(blocks_of(back, cfg, x) == bytes(cfg.block_bytes) for x in untouched)


def test_a_critical_transfer_moves_its_blocks_beside_bulk_ones(engine, tmp_path):
    cfg = geometry()
    src = host_arrays(cfg, 3)
    back = [np.zeros_like(a) for a in src]
    with engine.register(src, cfg) as h, engine.register(back, cfg) as b, engine.disk_layout(cfg, tmp_path / "kv.bin") as k:
        bulk = [engine.submit(h, [i], k, [i]) for i in range(8)]
        engine.submit(h, [9], k, [9], critical=True).wait(timeout=30)
        for r in bulk:
            r.wait(timeout=30)
        engine.submit(k, list(range(8)) + [9], b, list(range(8)) + [9], critical=True).wait(timeout=30)
    for blk in list(range(8)) + [9]:
        assert blocks_of(back, cfg, blk) == blocks_of(src, cfg, blk)


def test_layer_ranges_move_only_those_layers(engine):
    cfg = geometry("layer_block_first")
    src, back = host_arrays(cfg, 2), [np.zeros(cfg.base_bytes // 2, np.uint16) for _ in range(cfg.bases)]
    with engine.register(src, cfg) as h, engine.register(back, cfg) as b:
        engine.submit(h, [5], b, [5], layers=(1, 3)).wait()
        engine.submit(h, [6], b, [6], layers=slice(3, None)).wait()
    per = cfg.block_bytes // cfg.num_layers
    got, want = blocks_of(back, cfg, 5), blocks_of(src, cfg, 5)
    assert got[per : 3 * per] == want[per : 3 * per] and got[:per] == bytes(per) and got[3 * per :] == bytes(per)
    assert blocks_of(back, cfg, 6)[3 * per :] == blocks_of(src, cfg, 6)[3 * per :]


@pytest.mark.parametrize("layers", [range(0, 0), slice(0, 0), slice(None, 0), (0, 0), range(2, 2), (3, 1), slice(3, 1)])
def test_an_empty_layer_range_is_refused_and_moves_nothing(engine, layers):
    cfg = geometry("layer_block_first")
    src, back = host_arrays(cfg, 3), [np.zeros(cfg.base_bytes // 2, np.uint16) for _ in range(cfg.bases)]
    with engine.register(src, cfg) as h, engine.register(back, cfg) as b:
        with pytest.raises(kvxfer.InvalidArgument, match="empty"):
            engine.submit(h, [0], b, [0], layers=layers)
    assert blocks_of(back, cfg, 0) == bytes(cfg.block_bytes)


@pytest.mark.parametrize("layers", [-1, (-1, 2), range(-1, 2), (0, -1), (-4, 0)])
def test_a_negative_layer_is_refused(engine, layers):
    cfg = geometry()
    with engine.host_layout(cfg) as h, engine.device_layout(cfg) as d:
        with pytest.raises(kvxfer.InvalidArgument, match="negative"):
            engine.submit(h, [0], d, [0], layers=layers)


def test_a_layer_past_the_layout_is_out_of_range_even_past_32_bits(engine):
    cfg = geometry()
    with engine.host_layout(cfg) as h, engine.device_layout(cfg) as d:
        for layers in ((0, 2**32), range(0, 2**32 + 1), 2**32):
            with pytest.raises(kvxfer.OutOfRange, match="past the layout"):
                engine.submit(h, [0], d, [0], layers=layers)


def test_slices_of_layers_count_from_the_end_like_python(engine):
    cfg = geometry("layer_block_first")
    src, back = host_arrays(cfg, 4), [np.zeros(cfg.base_bytes // 2, np.uint16) for _ in range(cfg.bases)]
    with engine.register(src, cfg) as h, engine.register(back, cfg) as b:
        engine.submit(h, [2], b, [2], layers=slice(-1, None)).wait()
    per = cfg.block_bytes // cfg.num_layers
    got, want = blocks_of(back, cfg, 2), blocks_of(src, cfg, 2)
    assert got[3 * per :] == want[3 * per :] and got[: 3 * per] == bytes(3 * per)


def test_callbacks_run_once_on_a_kvxfer_thread_with_the_error(engine):
    cfg = geometry()
    seen = []
    done = threading.Event()

    def on_complete(req, err):
        seen.append((threading.current_thread().name, err))
        done.set()

    with engine.host_layout(cfg) as h, engine.device_layout(cfg) as d:
        r = engine.submit(h, [0, 1], d, [0, 1], on_complete=on_complete)
        r.wait()
        assert done.wait(10) and len(seen) == 1 and seen[0][1] is None
        assert seen[0][0] != threading.current_thread().name
        assert r.done()


def test_inside_its_callback_a_request_is_done_and_waits_on_others_raise(engine):
    cfg = geometry()
    seen = []

    with engine.host_layout(cfg) as h, engine.device_layout(cfg) as d:
        other = engine.submit(h, [3], d, [3])
        other.wait()

        def on_complete(req, err):
            seen.append(req.done())
            req.wait(5)  # returns at once: its own request is done for the callback
            try:
                other.wait(5)
                seen.append("waited")
            except kvxfer.InvalidArgument as e:
                seen.append(str(e))
            seen.append(other.done())

        r = engine.submit(h, [0, 1], d, [0, 1], on_complete=on_complete)
        r.wait(30)
        assert seen[0] is True and "completion callback" in seen[1] and seen[2] is True, seen


def test_a_callback_that_runs_before_submit_returned_can_use_its_request(engine):
    # Threads spinning in Python hold the GIL, so the submitting thread often gets it
    # back from kvx_transfer_submit only after kvxfer's thread ran the callback. Before
    # the callback set the handle, 1 in 10 saw "the request is released" here.
    cfg = geometry()
    seen = []
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            pass

    def on_complete(req, err):
        try:
            seen.append(req.done())
        except kvxfer.Error as e:
            seen.append(str(e))

    spinners = [threading.Thread(target=spin) for _ in range(2)]
    with engine.host_layout(cfg) as h, engine.device_layout(cfg) as d:
        for t in spinners:
            t.start()
        try:
            reqs = [engine.submit(h, [i % 16], d, [i % 16], on_complete=on_complete) for i in range(200)]
            for r in reqs:
                r.wait(30)
        finally:
            stop.set()
            for t in spinners:
                t.join()
    assert len(seen) == 200 and all(s is True for s in seen), [s for s in seen if s is not True][:3]


def test_await_a_request_in_asyncio(engine):
    cfg = geometry()

    async def main():
        with engine.host_layout(cfg) as h, engine.device_layout(cfg) as d:
            await engine.submit(h, [0, 1, 2], d, [0, 1, 2])
            reqs = [engine.submit(d, [i], h, [i + 8]) for i in range(3)]
            await asyncio.gather(*reqs)
            with pytest.raises(kvxfer.OutOfRange):
                await engine.submit(h, [0], d, [99])

    asyncio.run(main())


def test_await_is_settled_on_the_loop_without_a_thread(engine):
    cfg = geometry()
    seen = []

    async def main():
        loop = asyncio.get_running_loop()
        with engine.host_layout(cfg) as h, engine.device_layout(cfg) as d:
            reqs = [engine.submit(h, [i], d, [i], on_complete=lambda r, e: seen.append(e)) for i in range(8)]
            assert all(r._future is not None and r._future.get_loop() is loop for r in reqs)
            await asyncio.wait_for(asyncio.gather(*reqs), 30)
            outside = []
            t = threading.Thread(target=lambda: outside.append(engine.submit(h, [9], d, [9])))
            t.start(), t.join()
            assert outside[0]._future is None
            await outside[0]  # falls back to the executor

    asyncio.run(main())
    assert seen == [None] * 8  # the caller's own callback still runs


def test_a_raising_callback_still_settles_the_awaited_request(engine, caplog):
    cfg = geometry()

    async def main():
        with engine.host_layout(cfg) as h, engine.device_layout(cfg) as d:
            await asyncio.wait_for(engine.submit(h, [0], d, [0], on_complete=lambda r, e: 1 / 0), 30)

    with caplog.at_level(logging.ERROR, logger="kvxfer"):
        asyncio.run(main())
    assert any("callback raised" in r.getMessage() and r.exc_info and r.exc_info[0] is ZeroDivisionError for r in caplog.records)


def test_cancelled_request_raises_cancelled(engine, tmp_path):
    cfg = geometry(blocks=256, layers=8)
    with engine.host_layout(cfg) as h, engine.disk_layout(cfg, tmp_path / "big.bin") as k:
        reqs = [engine.submit(h, range(256), k, range(256)) for _ in range(4)]
        for r in reqs:
            r.cancel()
        outcomes = set()
        for r in reqs:
            try:
                r.wait(60)
                outcomes.add("ok")
            except kvxfer.Cancelled as e:
                outcomes.add("cancelled")
                assert e.status == 11 and "cancel" in e.message
        assert "cancelled" in outcomes


def test_stats_and_effective_config(engine):
    cfg = geometry()
    with engine.host_layout(cfg) as h, engine.device_layout(cfg) as d:
        engine.submit(h, [0], d, [0]).wait()
    s = engine.stats()
    assert s.requests_completed == 1 and s.bytes_host_to_device == cfg.block_bytes and s.slots_quarantined == 0
    c = engine.config()
    assert c.slot_bytes == 64 << 10 and c.io_threads == 2 and c.io_backend in ("posix", "uring", "nixl", "gds")
    assert isinstance(c, kvxfer.EngineConfig) and isinstance(s, kvxfer.Stats)


def test_bad_arrays_are_refused_with_the_reason(engine):
    cfg = geometry("layer_block_first")
    good = host_arrays(cfg)
    with pytest.raises(kvxfer.InvalidArgument, match="4-byte elements but dtype_bytes is 2"):
        engine.register([a.view(np.uint32) for a in good], cfg)
    with pytest.raises(kvxfer.InvalidArgument, match="not C-contiguous"):
        engine.register([np.zeros(cfg.base_bytes, np.uint16)[::2] for _ in range(cfg.bases)], cfg)
    with pytest.raises(kvxfer.InvalidArgument, match="the layout needs"):
        engine.register([a[:-1] for a in good], cfg)
    with pytest.raises(kvxfer.InvalidArgument, match="spans 4 allocation"):
        engine.register(good[:2], cfg)
    ro = [a.copy() for a in good]
    for a in ro:
        a.setflags(write=False)
    with pytest.raises(kvxfer.InvalidArgument, match="read-only"):
        engine.register(ro, cfg)
    with pytest.raises(kvxfer.InvalidArgument, match="pass a NumPy array"):
        engine.register([b"x" * cfg.base_bytes] * cfg.bases, cfg)
    with pytest.raises(kvxfer.InvalidArgument, match="layout kind"):
        engine.device_layout(kvxfer.LayoutConfig(kind="paged", num_blocks=1, num_layers=1, outer_dim=1, page_size=1, inner_dim=1, dtype_bytes=1))


def test_bad_transfers_and_settings_raise_their_status(engine):
    cfg = geometry()
    with engine.host_layout(cfg) as h, engine.device_layout(cfg) as d:
        with pytest.raises(kvxfer.OutOfRange, match="block id 16"):
            engine.submit(h, [16], d, [0])
        with pytest.raises(kvxfer.InvalidArgument, match="appears twice"):
            engine.submit(h, [0, 1], d, [2, 2])
        with pytest.raises(kvxfer.InvalidArgument, match="negative block id"):
            engine.submit(h, [-1], d, [0])
        with pytest.raises(kvxfer.InvalidArgument, match="2 source ids but 1"):
            engine.submit(h, [0, 1], d, [0])
        with pytest.raises(kvxfer.OutOfRange, match="layer_end 9"):
            engine.submit(h, [0], d, [0], layers=(0, 9))
        other = geometry(layers=2)
        with engine.device_layout(other) as o, pytest.raises(kvxfer.Incompatible, match="geometry differs"):
            engine.submit(h, [0], o, [0])
    with pytest.raises(kvxfer.InvalidArgument, match="unknown engine setting 'threads'"):
        kvxfer.Engine(device="emulated", threads=4)
    with pytest.raises(kvxfer.InvalidArgument, match="slot_bytes"):
        kvxfer.Engine(device="emulated", slot_bytes=1000)
    with pytest.raises(kvxfer.InvalidArgument, match="device="):
        kvxfer.Engine(device="gpu0")
    assert issubclass(kvxfer.OutOfRange, IndexError) and issubclass(kvxfer.Timeout, TimeoutError)


def test_every_status_has_its_exception_class():
    from kvxfer.errors import error_for

    for code in range(2, 19):
        e = error_for(code, "why")
        assert type(e) is not kvxfer.Error and isinstance(e, kvxfer.Error) and e.status == code, code
        assert getattr(kvxfer, type(e).__name__) is type(e) and type(e).__name__ in kvxfer.__all__, code
    assert isinstance(error_for(17, "the peer exited"), kvxfer.RemoteError)
    assert type(error_for(99, "")) is kvxfer.Error


def test_a_closed_engine_says_so(tmp_path):
    cfg = geometry()
    e = kvxfer.Engine(device="emulated", io_threads=2)
    h = e.host_layout(cfg)
    d = e.device_layout(cfg)
    r = e.submit(h, [0], d, [0])
    e.close()
    e.close()  # idempotent
    for call in (lambda: e.device_layout(cfg), lambda: e.submit(h, [0], d, [0]), e.stats, r.wait, lambda: h.base(0)):
        with pytest.raises(kvxfer.Shutdown, match="closed"):
            call()
    h.close(), d.close(), r.release()  # still allowed after the engine closed


def test_a_missing_disk_file_is_an_io_error(engine, tmp_path):
    with pytest.raises(kvxfer.IOError, match="nope.bin"):
        engine.disk_layout(geometry(), tmp_path / "nope.bin", create=False)


def test_struct_layouts_match_the_library():
    # kvx_engine_config_init and kvx_transfer_options_init write struct_size: the sizes
    # the library expects must be the sizes ctypes lays out.
    for cls, init in (
        (n.EngineConfigC, n.lib.kvx_engine_config_init),
        (n.LayoutConfigC, n.lib.kvx_layout_config_init),
        (n.TransferOptionsC, n.lib.kvx_transfer_options_init),
    ):
        c = cls()
        init(ctypes.byref(c))
        assert c.struct_size == ctypes.sizeof(cls), cls.__name__


def test_the_library_is_found_in_the_package_or_by_kvxfer_library():
    assert os.path.isfile(kvxfer.library_path)
    assert kvxfer.version().startswith("kvxfer ")


def test_the_package_version_is_the_librarys():
    import importlib.metadata

    # "kvxfer <crate version> abi ...": the wheel's version is the crate's.
    assert importlib.metadata.version("kvxfer") == kvxfer.__version__ == kvxfer.version().split()[1]


def _library_found_with(env):
    """kvxfer.library_path in a fresh interpreter with `env` added (None: the import failed, with its message)."""
    clean = {k: v for k, v in os.environ.items() if k not in ("KVX_LIBRARY", "KVXFER_LIBRARY")}
    p = subprocess.run(
        [sys.executable, "-c", "import kvxfer; print(kvxfer.library_path)"], env={**clean, **env}, capture_output=True, text=True
    )
    return (p.stdout.strip(), None) if p.returncode == 0 else (None, p.stderr)


def test_kvx_library_names_the_library_and_kvxfer_library_is_its_alias(tmp_path):
    lib = kvxfer.library_path
    assert _library_found_with({"KVX_LIBRARY": lib}) == (lib, None)
    assert _library_found_with({"KVXFER_LIBRARY": lib}) == (lib, None)
    # KVX_LIBRARY wins over the alias.
    assert _library_found_with({"KVX_LIBRARY": lib, "KVXFER_LIBRARY": str(tmp_path / "other.so")}) == (lib, None)
    path, err = _library_found_with({"KVX_LIBRARY": str(tmp_path / "missing.so")})
    assert path is None and "KVX_LIBRARY=" in err and "does not exist" in err


def test_torch_cpu_tensors(engine):
    torch = pytest.importorskip("torch", reason="torch is not installed here")
    cfg = geometry("layer_block_first")
    src = [torch.randint(0, 30000, (cfg.base_bytes // 2,), dtype=torch.int16) for _ in range(cfg.bases)]
    back = [torch.zeros_like(t) for t in src]
    with engine.register(src, cfg) as h, engine.register(back, cfg) as b, engine.device_layout(cfg) as d:
        ids = torch.tensor([1, 4, 9])
        engine.submit(h, ids, d, ids).wait()
        engine.submit(d, ids, b, ids).wait()
    for s, t in zip(src, back):
        per = cfg.base_bytes // cfg.num_blocks // 2
        for blk in (1, 4, 9):
            assert torch.equal(s[blk * per : (blk + 1) * per], t[blk * per : (blk + 1) * per])
    with pytest.raises(kvxfer.InvalidArgument, match="not contiguous"):
        engine.register([torch.zeros(cfg.base_bytes, dtype=torch.int16)[::2] for _ in range(cfg.bases)], cfg)


def test_the_offload_connector_example_runs(tmp_path):
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), "..", "examples", "offload_connector.py")
    spec = importlib.util.spec_from_file_location("offload_connector", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.run(use_torch=False, num_blocks=32, steps=6, workdir=str(tmp_path))


def _readable(fd, timeout):
    import select

    return bool(select.select([fd], [], [], timeout)[0])


def test_the_completion_fd_is_readable_once_a_request_ended(engine):
    cfg = geometry()
    fd = engine.completion_fd()
    assert fd == engine.completion_fd() and not _readable(fd, 0)
    with engine.host_layout(cfg) as h, engine.device_layout(cfg) as d:
        engine.submit(h, [0, 1], d, [0, 1]).wait(30)
        assert _readable(fd, 0), "the request was seen to end, so the fd was made readable first"
        assert int.from_bytes(os.read(fd, 8), "little") == 1
        assert not _readable(fd, 0)
    engine.close()
    with pytest.raises(kvxfer.Shutdown):
        engine.completion_fd()
    with pytest.raises(OSError):
        os.fstat(fd)  # closed with the engine


def test_await_waits_on_the_completion_fd_not_an_executor_thread(engine):
    cfg = geometry()

    async def main():
        loop = asyncio.get_running_loop()

        def no_executor(*a, **k):
            raise AssertionError("awaiting a request took an executor thread")

        loop.run_in_executor = no_executor
        with engine.host_layout(cfg) as h, engine.device_layout(cfg) as d:
            outside = []
            t = threading.Thread(target=lambda: outside.extend(engine.submit(h, [i], d, [i]) for i in range(4)))
            t.start(), t.join()
            await asyncio.wait_for(asyncio.gather(*outside), 30)
            await asyncio.wait_for(outside[0], 30)  # ended already: settled at once

    asyncio.run(main())
