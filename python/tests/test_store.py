"""kvxfer.Store on the emulated device (or on `KVX_TEST_DEVICE=<ordinal>`) with NumPy
arrays: round trips, misses, namespaces, reopening, per-key results, and the errors a
caller gets for bad input and closed handles."""

import asyncio
import ctypes
import gc
import os

import numpy as np
import pytest

import kvxfer
from kvxfer import _native as n

from test_kvxfer import DEVICE, geometry


@pytest.fixture
def engine():
    with kvxfer.Engine(device=DEVICE, io_threads=2, bounce_bytes=1 << 20, slot_bytes=64 << 10) as e:
        yield e


def host_pool(engine, cfg, seed):
    """A registered host layout over a NumPy array filled with a pattern (and the array)."""
    a = np.random.default_rng(seed).integers(0, 255, size=cfg.num_blocks * cfg.block_bytes, dtype=np.uint8)
    a = a.view(np.uint16)
    return engine.register(a, cfg), a


def block(a, cfg, b):
    return a.view(np.uint8)[b * cfg.block_bytes : (b + 1) * cfg.block_bytes].tobytes()


KEYS = [b"prefix-hash-0", b"prefix-hash-1", "prefix-hash-2", bytearray(b"prefix-hash-3")]


def test_put_lookup_get_remove_round_trip(engine, tmp_path):
    cfg = geometry(blocks=8)
    src, a = host_pool(engine, cfg, 1)
    dst, b = host_pool(engine, cfg, 2)
    with kvxfer.Store(engine, tmp_path / "s", cfg, capacity_blocks=16, namespace=b"model bf16 tp0/1", shards=2) as s:
        put = s.put(src, [1, 3, 5, 7], KEYS)
        put.wait()
        assert len(put) == 4 and put.results() == [None] * 4 and put.key_status(2) == n.OK
        assert s.lookup(KEYS + [b"never put"]) == ([True, True, True, True, False], 4)
        assert s.lookup([b"never put"] + KEYS) == ([False, True, True, True, True], 0)
        s.get(KEYS, dst, [0, 2, 4, 6]).wait()
        for i, (sb, db) in enumerate(zip([1, 3, 5, 7], [0, 2, 4, 6])):
            assert block(b, cfg, db) == block(a, cfg, sb), f"key {i}: other bytes"
        # A key put again is held already: nothing written.
        s.put(src, [0], KEYS[:1]).wait()
        removed = s.remove(KEYS[:2] + [b"never put"])
        assert removed[:2] == [None, None] and isinstance(removed[2], kvxfer.NotFound)
        assert s.lookup(KEYS) == ([False, False, True, True], 0)
        st = s.stats()
        assert (st.entries, st.capacity, st.puts, st.dedups, st.hits, st.removes) == (2, 16, 4, 1, 4, 2), st
        assert st.bytes == 2 * cfg.block_bytes


def test_a_critical_get_loads_its_blocks(engine, tmp_path):
    cfg = geometry(blocks=8)
    src, a = host_pool(engine, cfg, 5)
    dst, b = host_pool(engine, cfg, 6)
    with kvxfer.Store(engine, tmp_path / "s", cfg, capacity_blocks=16, namespace=b"ns") as s:
        s.put(src, [1, 3], KEYS[:2]).wait()
        get = s.get(KEYS[:2] + [b"never put"], dst, [0, 2, 4], critical=True)
        with pytest.raises(kvxfer.NotFound):
            get.wait()
        assert get.results()[:2] == [None, None]
        assert block(b, cfg, 0) == block(a, cfg, 1) and block(b, cfg, 2) == block(a, cfg, 3)

def test_a_miss_fails_its_key_alone_and_wait_raises_it(engine, tmp_path):
    cfg = geometry(blocks=4)
    src, a = host_pool(engine, cfg, 3)
    dst, b = host_pool(engine, cfg, 4)
    with kvxfer.Store(engine, tmp_path / "s", cfg, capacity_blocks=4) as s:
        s.put(src, [2], [b"held"]).wait()
        s.put(src, [3], [b"nul\x00key"]).wait()  # a key is its bytes, NUL included
        assert s.lookup([b"nul\x00key", b"nul\x00kez", b"nul"]) == ([True, False, False], 1)
        r = s.get([b"held", b"missing"], dst, [0, 1])
        with pytest.raises(kvxfer.NotFound, match="key 1"):
            r.wait()
        assert r.done()
        res = r.results()
        assert res[0] is None and isinstance(res[1], kvxfer.NotFound) and isinstance(res[1], LookupError)
        assert r.key_status(1) == kvxfer.NotFound.status
        assert block(b, cfg, 0) == block(a, cfg, 2), "the hit of a batch with a miss loaded"
        with pytest.raises(kvxfer.OutOfRange):
            r.key_status(2)
        r.release()
        r.release()  # idempotent
        assert s.stats().misses == 1


def test_a_store_request_waited_on_in_a_completion_callback_raises(tmp_path):
    # The callback holds the engine's only I/O worker, which the get may need: a wait
    # there could never end, so it raises; a wait of 0 polls.
    cfg = geometry(blocks=4)
    seen = []
    with kvxfer.Engine(device=DEVICE, io_threads=1, bounce_bytes=1 << 20, slot_bytes=64 << 10) as e:
        src, a = host_pool(e, cfg, 7)
        dst, b = host_pool(e, cfg, 8)
        with kvxfer.Store(e, tmp_path / "s", cfg, capacity_blocks=4) as s:
            s.put(src, [1], [b"held"]).wait()

            def on_complete(req, err):
                get = s.get([b"held"], dst, [0])
                seen.append(get)
                for timeout in (5, None):
                    try:
                        get.wait(timeout)
                        seen.append("waited")
                    except kvxfer.Error as e:
                        seen.append(e)
                        if not isinstance(e, kvxfer.InvalidArgument):
                            break  # not refused: a wait without a timeout would never end
                try:
                    get.wait(0)
                    seen.append("waited")
                except kvxfer.Error as e:
                    seen.append(e)

            e.submit(src, [2], dst, [2], on_complete=on_complete).wait(60)
            get, *waits = seen
            assert len(waits) == 3, waits
            for w in waits[:2]:
                assert isinstance(w, kvxfer.InvalidArgument) and "completion callback" in str(w), waits
            assert waits[2] == "waited" or isinstance(waits[2], kvxfer.Timeout), waits  # a poll
            get.wait(60)
            assert block(b, cfg, 0) == block(a, cfg, 1)


def test_namespaces_never_mix(engine, tmp_path):
    cfg = geometry(blocks=4)
    one, a = host_pool(engine, cfg, 5)
    two, b = host_pool(engine, cfg, 6)
    out, c = host_pool(engine, cfg, 7)
    with kvxfer.Store(engine, tmp_path / "a", cfg, 4, namespace=b"model A") as sa, kvxfer.Store(
        engine, tmp_path / "b", cfg, 4, namespace="model B"
    ) as sb:
        sa.put(one, [0], [b"k"]).wait()
        sb.put(two, [1], [b"k"]).wait()
        sa.get([b"k"], out, [0]).wait()
        sb.get([b"k"], out, [1]).wait()
        assert block(c, cfg, 0) == block(a, cfg, 0) and block(c, cfg, 1) == block(b, cfg, 1)
    with pytest.raises(kvxfer.Incompatible, match="namespace"):
        kvxfer.Store(engine, tmp_path / "a", cfg, 4, namespace=b"model B", create=False)


def test_a_reopened_store_finds_its_entries(engine, tmp_path):
    cfg = geometry(blocks=4)
    src, a = host_pool(engine, cfg, 8)
    dst, b = host_pool(engine, cfg, 9)
    with kvxfer.Store(engine, tmp_path / "s", cfg, 8, namespace=b"ns", durable=True) as s:
        s.put(src, [0, 1, 2], [b"x", b"y", b"z"]).wait()
        s.remove([b"y"])
    with kvxfer.Store(engine, tmp_path / "s", cfg, 8, namespace=b"ns", create=False, verify_on_open=True) as s:
        assert s.lookup([b"x", b"y", b"z"]) == ([True, False, True], 1)
        s.get([b"x", b"z"], dst, [3, 1]).wait()
        assert block(b, cfg, 3) == block(a, cfg, 0) and block(b, cfg, 1) == block(a, cfg, 2)
        assert s.stats().entries == 2
    with pytest.raises(kvxfer.Incompatible, match="capacity"):
        kvxfer.Store(engine, tmp_path / "s", cfg, 9, namespace=b"ns", create=False)


def test_leases_and_await(engine, tmp_path):
    cfg = geometry(blocks=2)
    src, a = host_pool(engine, cfg, 10)
    dst, b = host_pool(engine, cfg, 11)
    with kvxfer.Store(engine, tmp_path / "s", cfg, 2) as s:

        async def go():
            await s.put(src, [0, 1], [b"a", b"b"])
            assert s.lookup([b"a", b"b"], lease=True) == ([True, True], 2)
            s.release_leases([b"b"])
            await s.get([b"a"], dst, [1])

        asyncio.run(go())
        assert block(b, cfg, 1) == block(a, cfg, 0)


def test_bad_input_raises_its_status_and_changes_nothing(engine, tmp_path):
    cfg = geometry(blocks=4)
    src, _ = host_pool(engine, cfg, 12)
    other = engine.host_layout(geometry(blocks=4, layers=2))
    with pytest.raises(kvxfer.InvalidArgument, match="CREATE"):
        kvxfer.Store(engine, tmp_path / "none", cfg, 4, create=False)
    with pytest.raises(kvxfer.InvalidArgument, match="at most 256"):
        kvxfer.Store(engine, tmp_path / "ns", cfg, 4, namespace=b"n" * 257)
    with pytest.raises(kvxfer.InvalidArgument, match="capacity_blocks"):
        kvxfer.Store(engine, tmp_path / "zero", cfg, 0)
    s = kvxfer.Store(engine, tmp_path / "s", cfg, 4)
    with pytest.raises(kvxfer.Busy, match=f"process {os.getpid()}"):
        kvxfer.Store(engine, tmp_path / "s", cfg, 4)
    for keys, match in (([b""], "0 bytes"), ([b"k" * 65], "65 bytes"), ([], "no keys"), (b"one key", "sequence"), ([3], "int")):
        with pytest.raises(kvxfer.InvalidArgument, match=match):
            s.lookup(keys)
    with pytest.raises(kvxfer.InvalidArgument, match="65 bytes"):
        s.remove([b"k" * 65])
    with pytest.raises(kvxfer.InvalidArgument, match="2 keys but 1"):
        s.put(src, [0], [b"a", b"b"])
    with pytest.raises(kvxfer.OutOfRange):
        s.put(src, [9], [b"a"])
    with pytest.raises(kvxfer.Incompatible):
        s.put(other, [0], [b"a"])
    with pytest.raises(kvxfer.InvalidArgument, match="twice"):
        s.get([b"a", b"b"], src, [1, 1])
    assert s.stats().puts == 0 and s.lookup([b"a"]) == ([False], 0)
    s.close()
    s.close()  # idempotent
    for call in (lambda: s.lookup([b"a"]), s.stats, lambda: s.put(src, [0], [b"a"])):
        with pytest.raises(kvxfer.Shutdown, match="store is closed"):
            call()
    other.close()


def test_a_store_whose_engine_closed_says_so_and_still_closes(tmp_path):
    cfg = geometry(blocks=2)
    e = kvxfer.Engine(device=DEVICE, io_threads=2, bounce_bytes=1 << 20, slot_bytes=64 << 10)
    src, _ = host_pool(e, cfg, 13)
    s = kvxfer.Store(e, tmp_path / "s", cfg, 2)
    r = s.put(src, [0, 1], [b"a", b"b"])
    e.close()
    with pytest.raises(kvxfer.Shutdown, match="engine is closed"):
        s.lookup([b"a"])
    r.results()  # every key ends, whatever its result
    s.close()
    r.release()


def test_a_lease_token_is_its_holders_until_it_gives_it_back(engine, tmp_path):
    cfg = geometry(blocks=4)
    src, a = host_pool(engine, cfg, 1)
    dst, b = host_pool(engine, cfg, 2)
    with kvxfer.Store(engine, tmp_path / "s", cfg, capacity_blocks=2, namespace=b"ns") as s:
        s.put(src, [0, 1], [b"a", b"b"]).wait()
        leases, leading = s.lease([b"a", b"never put"])
        assert leading == 1 and leases[1] is None and isinstance(leases[0], int)
        # Another caller's get of the key does not spend the lease: eviction passes it by.
        s.get([b"a"], dst, [0]).wait()
        s.put(src, [2], [b"c"]).wait()
        s.put(src, [3], [b"d"]).wait()
        assert s.lookup([b"a", b"b", b"c"]) == ([True, False, False], 1)
        s.get([b"a"], dst, [1]).wait()
        assert block(b, cfg, 1) == block(a, cfg, 0)
        with pytest.raises(kvxfer.InvalidArgument):
            s.release([leases[0], leases[0]])
        s.release(leases)
        with pytest.raises(kvxfer.InvalidArgument):
            s.release(leases)


def test_a_released_get_still_lands_its_blocks(engine, tmp_path):
    cfg = geometry(blocks=4)
    dst, b = host_pool(engine, cfg, 14)
    src, a = host_pool(engine, cfg, 15)
    with kvxfer.Store(engine, tmp_path / "s", cfg, 4) as s:
        s.put(src, [0, 1, 2, 3], [b"a", b"b", b"c", b"d"]).wait()
        expect = [block(a, cfg, i) for i in range(4)]
        r = s.get([b"a", b"b", b"c", b"d"], dst, [3, 2, 1, 0])
        r.release()
        view = b.view(np.uint8)
        del r, dst, b
        gc.collect()
        s.put(src, [0], [b"e"]).wait()  # sweeps the released get once it ended
    # The close waited for the get: its destination holds the blocks.
    assert [view[(3 - i) * cfg.block_bytes : (4 - i) * cfg.block_bytes].tobytes() for i in range(4)] == expect


def test_store_structs_match_the_library():
    c = n.StoreConfigC()
    n.lib.kvx_store_config_init(ctypes.byref(c))
    assert c.struct_size == ctypes.sizeof(n.StoreConfigC)
    assert c.flags == n.STORE_CREATE and c.shards == 1 and not c.shared
    assert ctypes.sizeof(n.KeyC) == 16 and ctypes.sizeof(n.StoreCountersC) == 152
    sc = n.SharedConfigC()
    n.lib.kvx_shared_config_init(ctypes.byref(sc))
    assert sc.struct_size == ctypes.sizeof(n.SharedConfigC) == 72 and sc.kind == 0 and sc.flags == 0


def test_results_of_a_request_every_key_of_which_succeeded_ask_no_key(engine, tmp_path, monkeypatch):
    """A request's status is OK only when every key's is: its results need no call per
    key, which a scheduler thread polling jobs of hundreds of chunks would pay."""
    cfg = geometry(blocks=4)
    src, _ = host_pool(engine, cfg, 16)
    with kvxfer.Store(engine, tmp_path / "s", cfg, 8) as s:
        put = s.put(src, [0, 1, 2, 3], [b"a", b"b", b"c", b"d"])
        put.wait()
        asked = []
        key_status = n.lib.kvx_store_request_key_status
        monkeypatch.setattr(n.lib, "kvx_store_request_key_status", lambda *a: asked.append(a[1]) or key_status(*a))
        assert put.results() == [None] * 4
        assert asked == []
        r = s.get([b"a", b"never put"], src, [0, 1])
        res = r.results()
        assert res[0] is None and isinstance(res[1], kvxfer.NotFound) and asked == [0, 1]


def test_keys_of_every_length_and_kind_name_their_own_blocks(engine, tmp_path):
    """The keys of one call are passed to the library as one array over their bytes:
    each key is exactly its own bytes, whatever the lengths of its neighbours."""
    cfg = geometry(blocks=8)
    src, a = host_pool(engine, cfg, 17)
    dst, b = host_pool(engine, cfg, 18)
    keys = [b"k", b"\x00" * 64, "ключ", bytearray(b"ab"), memoryview(b"abc"), b"a" * 63, b"abcd", b"\x00"]
    with kvxfer.Store(engine, tmp_path / "s", cfg, 16) as s:
        s.put(src, list(range(8)), keys).wait()
        assert s.lookup([b"a" * 62, b"ab", b"abc\x00", b"abcd"]) == ([False, True, False, True], 0)
        s.get(keys[::-1], dst, list(range(8))).wait()
        assert [block(b, cfg, i) for i in range(8)] == [block(a, cfg, 7 - i) for i in range(8)]


def test_a_call_of_one_key_names_exactly_that_key(engine, tmp_path):
    """A call of one key (how runtimes' tiers look keys up) passes that key's bytes alone:
    each kind and length finds its own block, and a prefix or an extension of it none."""
    cfg = geometry(blocks=8)
    src, a = host_pool(engine, cfg, 19)
    dst, b = host_pool(engine, cfg, 20)
    keys = [b"k", b"\x00" * 64, "ключ", bytearray(b"ab"), memoryview(b"abc"), b"a" * 63, b"abcd", b"\x00"]
    with kvxfer.Store(engine, tmp_path / "s", cfg, 16) as s:
        for i, k in enumerate(keys):
            s.put(src, [i], [k]).wait()
        for i, k in enumerate(keys):
            assert s.lookup([k]) == ([True], 1)
            s.get([k], dst, [i]).wait()
            assert block(b, cfg, i) == block(a, cfg, i)
        assert [s.lookup([k])[0][0] for k in (b"a" * 62, b"abc\x00", b"\x00" * 63, b"ab\x00")] == [False] * 4
        with pytest.raises(kvxfer.InvalidArgument):
            s.lookup([b""])
        with pytest.raises(kvxfer.InvalidArgument):
            s.lookup([b"a" * 65])


def test_awaiting_store_requests_takes_no_thread(engine, tmp_path):
    cfg = geometry(blocks=4)
    src, a = host_pool(engine, cfg, 16)
    dst, b = host_pool(engine, cfg, 17)
    fd = engine.completion_fd()

    async def main():
        loop = asyncio.get_running_loop()

        def no_executor(*args, **kwargs):
            raise AssertionError("awaiting a store request took an executor thread")

        loop.run_in_executor = no_executor
        with kvxfer.Store(engine, tmp_path / "s", cfg, 8) as s:
            await asyncio.wait_for(asyncio.gather(*(s.put(src, [i], [b"k%d" % i]) for i in range(4))), 30)
            await asyncio.wait_for(s.get([b"k2", b"k0"], dst, [0, 1]), 30)
            with pytest.raises(kvxfer.NotFound):
                await asyncio.wait_for(s.get([b"absent"], dst, [3]), 30)

    asyncio.run(main())
    assert block(b, cfg, 0) == block(a, cfg, 2) and block(b, cfg, 1) == block(a, cfg, 0)
    os.read(fd, 8)  # the fd is still the engine's, and was signalled


def reserved_handles(s, keys):
    """The write handles `reserve_slots` gives `keys`, each a slot to write."""
    out = s.reserve_slots(keys)
    assert all(r.kind == kvxfer.Reservation.WRITE for r in out), out
    return [r.handle for r in out]


def test_a_slot_handle_is_48_bytes_that_round_trip_and_pickle(engine, tmp_path):
    import pickle

    cfg = geometry(blocks=4)
    with kvxfer.Store(engine, tmp_path / "s", cfg, capacity_blocks=4) as s:
        h, g = reserved_handles(s, [b"a", b"b"])
        raw = bytes(h)
        assert len(raw) == 48 == ctypes.sizeof(n.SlotHandleC)
        again = kvxfer.SlotHandle.from_bytes(raw)
        assert again == h and hash(again) == hash(h) and again != g and bytes(g) != raw
        assert pickle.loads(pickle.dumps(h)) == h
        assert {h: 1}[again] == 1
        assert (h.slot, h.key_len) == (again.slot, 1) and h.slot != g.slot
        with pytest.raises(AttributeError):
            h.slot = 3
        with pytest.raises(kvxfer.InvalidArgument, match="48 bytes"):
            kvxfer.SlotHandle.from_bytes(raw[:40])
        # 48 items of 8 bytes are not a handle, nor is 6 items' worth of its bytes.
        with pytest.raises(kvxfer.InvalidArgument, match="48 bytes"):
            kvxfer.SlotHandle.from_bytes(memoryview(bytes(48 * 8)).cast("Q"))
        assert kvxfer.SlotHandle.from_bytes(memoryview(raw).cast("Q")) == h
        with pytest.raises(kvxfer.InvalidArgument, match="SlotHandle"):
            s.commit_slots([raw])
        s.abort_slots([h, g])


def test_a_reservation_says_why_a_key_has_no_slot_to_write(engine, tmp_path):
    cfg = geometry(blocks=4)
    src, _ = host_pool(engine, cfg, 15)
    with kvxfer.Store(engine, tmp_path / "s", cfg, capacity_blocks=2) as s:
        s.put(src, [0], [b"held"]).wait()
        (mine,) = reserved_handles(s, [b"new"])
        # Reserved and not committed: a second reservation of the key waits for the first.
        again = s.reserve_slots([b"new", b"held"])
        assert again == [
            kvxfer.Reservation(kvxfer.Reservation.IN_FLIGHT, None),
            kvxfer.Reservation(kvxfer.Reservation.HELD, None),
        ]
        # Both slots taken (one held and leased, one reserved): no room for a third key.
        assert s.lease_slots([b"held"])[0] is not None
        assert s.reserve_slots([b"third"]) == [kvxfer.Reservation(kvxfer.Reservation.NO_ROOM, None)]
        s.release_leases([b"held"])
        s.abort_slots([mine])
        # A handle naming a slot past the capacity is another store's.
        c = n.SlotHandleC.from_buffer_copy(bytes(mine))
        c.slot = 2
        with pytest.raises(kvxfer.OutOfRange, match="slot 2"):
            s.abort_slots([kvxfer.SlotHandle.from_bytes(bytes(c))])


def test_an_owner_and_a_data_only_open_move_blocks_through_slot_handles(engine, tmp_path):
    cfg = geometry(blocks=8)
    src, a = host_pool(engine, cfg, 11)
    dst, b = host_pool(engine, cfg, 12)
    with kvxfer.Store(engine, tmp_path / "s", cfg, capacity_blocks=8, shards=2) as owner, kvxfer.Store(
        engine, tmp_path / "s", cfg, capacity_blocks=8, shards=2, data_only=True
    ) as data:
        owner.put(src, [0], [b"held"]).wait()
        got = owner.reserve_slots([b"k0", b"k1", b"k2", b"held"])
        assert got[3] == kvxfer.Reservation(kvxfer.Reservation.HELD, None)
        writes = [r.handle for r in got[:3]]
        data.write_slots(src, [1, 2, 3], writes).wait()
        assert owner.commit_slots(writes) == [None, None, None]
        again = owner.commit_slots(writes[:1])
        assert isinstance(again[0], kvxfer.InvalidArgument), again
        owner.get([b"k0", b"k1", b"k2"], dst, [0, 1, 2]).wait()
        assert [block(b, cfg, i) for i in range(3)] == [block(a, cfg, i) for i in (1, 2, 3)]
        # Leased slots read back in the data-only open; a miss has no handle.
        leased = owner.lease_slots([b"k2", b"held", b"never put"])
        assert leased[2] is None
        data.read_slots(leased[:2], dst, [5, 6]).wait()
        assert (block(b, cfg, 5), block(b, cfg, 6)) == (block(a, cfg, 3), block(a, cfg, 0))
        owner.release_leases([b"k2", b"held"])
        # A reservation committed unwritten is a miss, not an entry; an aborted one no entry.
        unwritten, aborted = reserved_handles(owner, [b"u", b"x"])
        assert isinstance(owner.commit_slots([unwritten])[0], kvxfer.IntegrityError)
        owner.abort_slots([aborted])
        assert owner.lookup([b"u", b"x"]) == ([False, False], 0)
        # The index is the owner's.
        for call in (
            lambda: data.lookup([b"k0"]),
            lambda: data.put(src, [0], [b"k9"]),
            lambda: data.get([b"k0"], dst, [0]),
            lambda: data.remove([b"k0"]),
            lambda: data.reserve_slots([b"k9"]),
            lambda: data.lease_slots([b"k0"]),
            lambda: data.commit_slots(writes),
            lambda: data.abort_slots(writes),
        ):
            with pytest.raises(kvxfer.InvalidArgument, match="DATA_ONLY"):
                call()
        with pytest.raises(kvxfer.InvalidArgument, match="handles"):
            data.write_slots(src, [0], [])
        with pytest.raises(kvxfer.InvalidArgument, match="2 handles but 1"):
            data.write_slots(src, [0], writes[:2])


def test_slot_moves_take_the_event_their_copies_wait_for(engine, tmp_path):
    # A CUDA event reaches the engine, which waits for it on the device; this engine's
    # emulated device has none, and says so. A handle that is no event is refused first.
    cfg = geometry(blocks=4)
    src, _ = host_pool(engine, cfg, 1)
    dst, _ = host_pool(engine, cfg, 2)
    with kvxfer.Store(engine, tmp_path / "s", cfg, capacity_blocks=4) as owner, kvxfer.Store(
        engine, tmp_path / "s", cfg, capacity_blocks=4, data_only=True
    ) as data:
        owner.put(src, [0], [b"held"]).wait()
        leased = owner.lease_slots([b"held"])
        writes = reserved_handles(owner, [b"w"])
        for move in (
            lambda ev: data.read_slots(leased, dst, [1], wait_event=ev),
            lambda ev: data.write_slots(src, [1], writes, wait_event=ev),
        ):
            with pytest.raises(kvxfer.InvalidArgument, match="wait_event needs a CUDA device"):
                move(0x1234)
            with pytest.raises(kvxfer.InvalidArgument, match="recorded torch.cuda.Event"):
                move(0)
        data.read_slots(leased, dst, [1]).wait()
        owner.release_leases([b"held"])
        owner.abort_slots(writes)


#: The data mover of the two-process test: opens the store data-only, writes the reserved
#: slots it reads as hex lines on stdin ("W <hex>") from a pattern of its own seed, reads
#: the leased ones ("R <hex>") and prints their bytes in hex.
_DATA_MOVER = r"""
import sys
import numpy as np
import kvxfer
device, directory = sys.argv[1], sys.argv[2]
device = device if device == "emulated" else int(device)
cfg = kvxfer.LayoutConfig(kind="contiguous", num_blocks=8, num_layers=4, outer_dim=2, page_size=16, inner_dim=64, dtype_bytes=2)
lines = sys.stdin.read().split()
writes = [kvxfer.SlotHandle.from_bytes(bytes.fromhex(h)) for t, h in zip(lines[::2], lines[1::2]) if t == "W"]
reads = [kvxfer.SlotHandle.from_bytes(bytes.fromhex(h)) for t, h in zip(lines[::2], lines[1::2]) if t == "R"]
with kvxfer.Engine(device=device, io_threads=2, bounce_bytes=1 << 20, slot_bytes=64 << 10) as e:
    a = np.random.default_rng(21).integers(0, 255, size=cfg.num_blocks * cfg.block_bytes, dtype=np.uint8).view(np.uint16)
    b = np.zeros(cfg.num_blocks * cfg.block_bytes // 2, dtype=np.uint16)
    src, dst = e.register(a, cfg), e.register(b, cfg)
    with kvxfer.Store(e, directory, cfg, capacity_blocks=8, data_only=True) as s:
        s.write_slots(src, list(range(len(writes))), writes).wait()
        s.read_slots(reads, dst, list(range(len(reads)))).wait()
    for i in range(len(reads)):
        print(b.view(np.uint8)[i * cfg.block_bytes : (i + 1) * cfg.block_bytes].tobytes().hex())
"""


def test_an_owner_and_a_data_only_process_move_blocks_through_handles_sent_as_bytes(engine, tmp_path):
    import subprocess
    import sys

    cfg = geometry(blocks=8)
    src, a = host_pool(engine, cfg, 13)
    dst, b = host_pool(engine, cfg, 14)
    with kvxfer.Store(engine, tmp_path / "s", cfg, capacity_blocks=8) as owner:
        owner.put(src, [4, 5], [b"r0", b"r1"]).wait()
        reads = owner.lease_slots([b"r0", b"r1"])
        writes = reserved_handles(owner, [b"w0", b"w1", b"w2"])
        text = "".join(f"W {bytes(h).hex()}\n" for h in writes) + "".join(f"R {bytes(h).hex()}\n" for h in reads)
        child = subprocess.run(
            [sys.executable, "-c", _DATA_MOVER, str(DEVICE), str(tmp_path / "s")],
            input=text, capture_output=True, text=True, timeout=120,
        )
        assert child.returncode == 0, child.stderr
        read_back = [bytes.fromhex(line) for line in child.stdout.split()]
        assert read_back == [block(a, cfg, 4), block(a, cfg, 5)], "the leased slots' bytes, read in the child"
        owner.release_leases([b"r0", b"r1"])
        assert owner.commit_slots(writes) == [None, None, None]
        owner.get([b"w0", b"w1", b"w2"], dst, [0, 1, 2]).wait()
    expect = np.random.default_rng(21).integers(0, 255, size=cfg.num_blocks * cfg.block_bytes, dtype=np.uint8)
    for i in range(3):
        assert block(b, cfg, i) == expect[i * cfg.block_bytes : (i + 1) * cfg.block_bytes].tobytes(), f"w{i}: other bytes"


def test_two_stores_over_one_shared_directory_load_each_others_blocks_bit_exact(engine, tmp_path):
    cfg = geometry(blocks=8)
    src, a = host_pool(engine, cfg, 21)
    dst, b = host_pool(engine, cfg, 22)
    tier = kvxfer.SharedTier.dir(tmp_path / "shared", write="through", timeout=30.0)
    ns = b"model bf16 tp0/1"
    with kvxfer.Store(engine, tmp_path / "a", cfg, 16, namespace=ns, shared=tier) as one:
        with kvxfer.Store(engine, tmp_path / "b", cfg, 16, namespace=ns, shared=tier) as other:
            one.put(src, [1, 3, 5, 7], KEYS).wait()
            st = one.stats()
            assert (st.puts, st.shared_puts, st.shared_puts_dropped) == (4, 4, 0), st
            # The other store never held them: its lookup and get find them in the tier.
            assert other.lookup(KEYS) == ([True] * 4, 4)
            other.get(KEYS, dst, [6, 4, 2, 0]).wait()
            for i, (sb, db) in enumerate(zip([1, 3, 5, 7], [6, 4, 2, 0])):
                assert block(b, cfg, db) == block(a, cfg, sb), f"key {i}: other bytes"
            st = other.stats()
            assert (st.hits, st.misses, st.shared_hits, st.shared_integrity_failures, st.shared_errors) == (4, 0, 4, 0, 0), st
            assert st.shared_requests >= 4 and st.shared_timeouts == 0
    # Without a shared tier a store has none: all its shared counters are 0.
    with kvxfer.Store(engine, tmp_path / "c", cfg, 16, namespace=ns) as alone:
        assert isinstance(alone.get(KEYS[:1], dst, [0]).results()[0], kvxfer.NotFound)
        st = alone.stats()
        assert all(getattr(st, f) == 0 for f in st.__dataclass_fields__ if f.startswith("shared_")), st


def test_a_bad_shared_tier_raises_with_the_reason(engine, tmp_path):
    cfg = geometry(blocks=4)
    bad = (
        (kvxfer.SharedTier.dir(""), "path is empty"),
        (kvxfer.SharedTier("nfs", path=str(tmp_path)), "kind='nfs'"),
        (kvxfer.SharedTier.dir(tmp_path / "shared", write="sideways"), "'behind' or 'through'"),
        (kvxfer.SharedTier.dir(tmp_path / "shared", timeout=0), "timeout=0"),
        (kvxfer.SharedTier.dir(tmp_path / "shared", threads=257), "threads is 257"),
        (kvxfer.SharedTier.s3(""), "bucket is empty"),
        (kvxfer.SharedTier.dir("a\0b"), "without NUL"),
        (str(tmp_path / "shared"), "pass a kvxfer.SharedTier"),
    )
    for tier, match in bad:
        with pytest.raises(kvxfer.InvalidArgument, match=match):
            kvxfer.Store(engine, tmp_path / "s", cfg, 4, shared=tier)
    with pytest.raises(kvxfer.InvalidArgument, match="DATA_ONLY"):
        kvxfer.Store(engine, tmp_path / "s", cfg, 4, data_only=True, shared=kvxfer.SharedTier.dir(tmp_path / "shared"))


def test_a_shared_tier_on_a_library_before_it_says_so(engine, tmp_path, monkeypatch):
    monkeypatch.setattr(n.lib, "kvx_abi_version", lambda: (1 << 16) | 6)
    with pytest.raises(kvxfer.Unsupported, match=r"a shared tier \(ABI 1.7\)"):
        kvxfer.Store(engine, tmp_path / "s", geometry(blocks=4), 4, shared=kvxfer.SharedTier.dir(tmp_path / "shared"))
