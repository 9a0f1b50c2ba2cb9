"""kvxfer.holdings.Holdings over real stores, driven as the plug-ins drive it: the blocks
its events report held are the ones the stores hold, through puts that evict, lookups,
gets, removals and a restart, without vLLM."""

import random
import time

import numpy as np

import kvxfer
from kvxfer.holdings import Holdings

from test_kvxfer import DEVICE, geometry

CAPACITY = 6


def replay(events, held):
    """Applies `events` as a router does; a store of a block held, or a removal of one
    not held, fails."""
    for removed, key, _ in events:
        if removed:
            assert key in held, f"{key} reported removed while not held"
            held.discard(key)
        else:
            assert key not in held, f"{key} reported stored while held"
            held.add(key)


def test_the_events_report_what_the_stores_hold(tmp_path):
    """Random puts (each evicting), hits, gets and removals on a group of two stores of
    six blocks, then a restart: after every call, every block reported held is held by
    both stores, and every block held by both that this process stored or met is
    reported. The events name the runtime's keys (here a key's text), not the stores'."""
    rng = random.Random(7)
    pool = [f"key-{i}".encode() for i in range(16)]
    cfg = geometry(blocks=4)
    with kvxfer.Engine(device=DEVICE, io_threads=2, bounce_bytes=1 << 20, slot_bytes=64 << 10) as engine:
        data = np.zeros(cfg.num_blocks * cfg.block_bytes // 2, dtype=np.uint16)
        src = engine.register(data, cfg)
        for life in range(2):
            stores = [kvxfer.Store(engine, tmp_path / f"rank{r}", cfg, CAPACITY, namespace=f"rank {r}") for r in range(2)]
            h = Holdings(stores)
            reported, seen = set(), set()
            try:
                for _ in range(120):
                    op = rng.choice(["put", "put", "hit", "get", "remove"])
                    keys = list(dict.fromkeys(rng.sample(pool, rng.randint(1, 3))))
                    if op == "put":
                        for r, st in enumerate(stores):
                            present, _ = st.lookup(keys)
                            h.met(r, [(k, k.decode()) for k, p in zip(keys, present) if p])
                            results = st.put(src, list(range(len(keys))), keys).results()
                            h.reconcile()
                            present, _ = st.lookup(keys)
                            h.committed(r, [(k, k.decode()) for k, e, p in zip(keys, results, present) if e is None and p])
                        seen.update(k.decode() for k in keys)
                    elif op == "hit":
                        found = [k for k in keys if all(st.lookup([k])[0][0] for st in stores)]
                        for r in range(len(stores)):
                            h.found(r, [(k, k.decode()) for k in found])
                        seen.update(k.decode() for k in found)
                    elif op == "get":
                        held = [k for k in keys if h.holds(k)]
                        for st in stores:
                            if held:
                                st.get(held, src, list(range(len(held)))).results()
                        h.touched(held)
                        h.reconcile()
                    else:
                        for r, st in enumerate(stores):
                            h.removed(r, keys, st.remove(keys))
                    replay(h.take(), reported)
                    held_by_all = {k.decode() for k in pool if all(st.lookup([k])[0][0] for st in stores)}
                    assert reported <= held_by_all, f"{life=} {op}: reported but not held: {reported - held_by_all}"
                    assert held_by_all & seen <= reported, f"{life=} {op}: held but not reported: {(held_by_all & seen) - reported}"
                    if life == 0:
                        assert reported == held_by_all
            finally:
                for st in stores:
                    st.close()
        src.close()


def held_locally(st, keys):
    """The keys `st` itself holds: a lease covers its own hits only (a lookup answers for
    its shared tier too)."""
    leases, _ = st.lease(keys)
    st.release(leases)
    return {k.decode() for k, lease in zip(keys, leases) if lease is not None}


def test_over_a_shared_tier_the_events_report_what_the_store_itself_holds(tmp_path):
    """Over a shared tier holding every block: a store of two blocks evicts blocks the
    shared tier still holds, and they are reported removed; another store that loads
    blocks from the shared tier reports them once it has admitted them, and no sooner."""
    pool = [f"key-{i}".encode() for i in range(4)]
    cfg = geometry(blocks=4)
    shared = kvxfer.SharedTier.dir(tmp_path / "shared", write="through")
    with kvxfer.Engine(device=DEVICE, io_threads=2, bounce_bytes=1 << 20, slot_bytes=64 << 10) as engine:
        data = np.zeros(cfg.num_blocks * cfg.block_bytes // 2, dtype=np.uint16)
        src = engine.register(data, cfg)
        a = kvxfer.Store(engine, tmp_path / "a", cfg, 2, shared=shared)
        b = kvxfer.Store(engine, tmp_path / "b", cfg, 4, shared=shared)
        try:
            h, reported = Holdings([a]), set()
            for i, k in enumerate(pool):
                assert a.put(src, [i], [k]).results() == [None]
                h.reconcile()
                h.committed(0, [(k, k.decode())])
                replay(h.take(), reported)
                assert reported == held_locally(a, pool), f"after putting {k}"
            assert a.lookup(pool)[0] == [True] * len(pool)  # the shared tier answers for the rest
            h, reported = Holdings([b]), set()
            assert h.held(0, pool) == [False] * len(pool)
            assert b.get(pool, src, list(range(len(pool)))).results() == [None] * len(pool)
            h.loading(0, [(k, k.decode()) for k in pool])
            h.admitted()
            replay(h.take(), reported)
            assert reported <= held_locally(b, pool)  # admitted after the get, on a thread
            deadline = time.monotonic() + 60
            while b.stats().entries < len(pool):
                assert time.monotonic() < deadline, "the loaded blocks were not admitted"
                time.sleep(0.001)
            h.admitted()
            replay(h.take(), reported)
            assert reported == held_locally(b, pool) == {k.decode() for k in pool}
        finally:
            a.close()
            b.close()
        src.close()
