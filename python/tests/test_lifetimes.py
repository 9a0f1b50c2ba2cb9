"""Lifetimes across threads: what a request keeps alive, and closing a handle while
other threads or callbacks use it. Each case runs in a child process with a time limit,
so a crash and a hang both fail the test instead of taking the suite down."""

import os
import subprocess
import sys
import textwrap

import pytest

# The child's preamble: an engine on the test device with a small bounce ring, so a
# transfer of a few MiB is still in flight when submit returns.
PRELUDE = """
import gc, mmap, os, sys, threading, time
import numpy as np
import kvxfer
DEVICE = int(os.environ["KVX_TEST_DEVICE"]) if os.environ.get("KVX_TEST_DEVICE") else "emulated"
def geometry(blocks=16, layers=4, inner=64):
    return kvxfer.LayoutConfig(num_blocks=blocks, num_layers=layers, outer_dim=2, page_size=16, inner_dim=inner, dtype_bytes=2)
def engine():
    return kvxfer.Engine(device=DEVICE, io_threads=2, bounce_bytes=1 << 20, slot_bytes=64 << 10)
"""


def run_child(body, tmp_path, timeout=120, prelude=""):
    """Runs PRELUDE, `prelude` and `body` in a fresh interpreter; returns its stdout.
    Fails on a non-zero exit (a crash shows as a negative signal number) or past
    `timeout` s. Freed memory is filled with junk (MALLOC_PERTURB_), so a use after
    free reads junk instead of what was there."""
    script = PRELUDE + prelude + textwrap.dedent(body)
    try:
        p = subprocess.run(
            [sys.executable, "-c", script],
            cwd=tmp_path,
            env=dict(os.environ, MALLOC_PERTURB_="165"),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the child hung ({timeout} s); its output:\n{e.stdout}\n{e.stderr}")
    assert p.returncode == 0, f"the child exited {p.returncode}:\n{p.stdout}\n{p.stderr[-3000:]}"
    return p.stdout


def test_a_request_keeps_registered_arrays_alive_until_it_ends(tmp_path):
    # The arrays sit in anonymous mmaps, so freeing them unmaps the memory: a transfer
    # still reading it would crash or write other bytes than the 7s.
    out = run_child(
        """
        cfg = geometry(blocks=128, inner=512)   # 4 MiB
        e = engine()
        disk = e.disk_layout(cfg, "kv.bin")

        def filled(value):
            m = mmap.mmap(-1, cfg.base_bytes)
            a = np.frombuffer(m, np.uint16)
            a[:] = value
            return a

        def start(value):
            h = e.register(filled(value), cfg)  # only the layout refers to the array
            return e.submit(h, range(cfg.num_blocks), disk, range(cfg.num_blocks))

        def disk_holds(value):
            back = np.zeros(cfg.base_bytes // 2, np.uint16)
            with e.register(back, cfg) as b:
                e.submit(disk, range(cfg.num_blocks), b, range(cfg.num_blocks)).wait(60)
            return bool((back == value).all())

        for value in range(1, 6):
            r = start(value)
            gc.collect()
            r.wait(60)
            assert disk_holds(value), value

        # Dropped at once, without a callback: the engine keeps the layouts until it ends.
        before = e.stats().requests_completed
        start(9)
        gc.collect()
        while e.stats().requests_completed == before:
            time.sleep(0.001)
        assert disk_holds(9)
        e.close()
        print("ok")
        """,
        tmp_path,
    )
    assert out.strip() == "ok"


# kvx_transfer_submit as the binding sees it returns only once the request's callback
# has run (`ran` is set), as happens whenever other threads keep the GIL from the
# submitting thread for a while.
HOLD_SUBMIT = """
from kvxfer import _native as n

class HoldSubmit:
    def __init__(self, lib):
        self.lib = lib

    def __getattr__(self, name):
        f = getattr(self.lib, name)
        if name != "kvx_transfer_submit":
            return f
        def call(*args):
            st = f(*args)
            if st == 0:
                assert ran.wait(30), "the callback did not run"
            return st
        return call

ran = threading.Event()
n.lib = HoldSubmit(n.lib)
"""


def test_a_callback_may_release_its_request_even_before_submit_returned(tmp_path):
    out = run_child(
        """
        cfg = geometry()
        errors = []

        def on_complete(req, err):
            req.release()
            errors.append(err)
            ran.set()

        e = engine()
        h, d = e.host_layout(cfg), e.device_layout(cfg)
        reqs = []
        for i in range(100):
            ran.clear()
            reqs.append(e.submit(h, [i % 16], d, [i % 16], on_complete=on_complete))
        assert errors == [None] * 100, errors[:3]
        gc.collect()
        for r in reqs:
            try:
                r.done()
                raise AssertionError("a request its callback released still answered done()")
            except kvxfer.InvalidArgument as x:
                assert "released" in str(x)
            r.release()  # again: nothing left to drop
        del reqs, r
        gc.collect()
        h.close(), d.close(), e.close()
        print("ok")
        """,
        tmp_path,
        prelude=HOLD_SUBMIT,
    )
    assert out.strip() == "ok"


# Every C call of the binding, held open for 50 ms and watched: freeing a handle that
# another thread's call is using ends the child at once (exit 3), before the freed
# memory is touched.
WATCH = """
from kvxfer import _native as n

class Watch:
    FREES = {"kvx_engine_destroy", "kvx_layout_destroy", "kvx_request_release"}
    SLOW = {"kvx_transfer_submit", "kvx_request_wait"}

    def __init__(self, lib):
        self.lib, self.lock, self.busy = lib, threading.Lock(), {}
        self.inside = threading.Event()

    def __getattr__(self, name):
        f = getattr(self.lib, name)
        def call(*args):
            if name in self.FREES:
                with self.lock:
                    if self.busy.get(args[0]):
                        print(name, "while another thread's call uses the handle", flush=True)
                        os._exit(3)
                return f(*args)
            handles = [a for a in args if isinstance(a, int)]
            with self.lock:
                for h in handles:
                    self.busy[h] = self.busy.get(h, 0) + 1
            try:
                if name in self.SLOW:
                    self.inside.set()
                    time.sleep(0.05)
                return f(*args)
            finally:
                with self.lock:
                    for h in handles:
                        self.busy[h] -= 1
        return call

watch = n.lib = Watch(n.lib)

def while_inside(call, close):
    # Runs `call` on a thread and `close` once that thread is inside a C call.
    errors = []
    def run():
        try:
            call()
        except kvxfer.Error as x:
            errors.append(x)
    watch.inside.clear()
    t = threading.Thread(target=run)
    t.start()
    watch.inside.wait(30)
    close()
    t.join(30)
    assert not t.is_alive()
    return errors
"""


def test_a_handle_is_freed_only_once_no_other_thread_calls_through_it(tmp_path):
    out = run_child(
        """
        cfg = geometry()
        e = engine()
        h, k, d = e.host_layout(cfg), e.host_layout(cfg), e.device_layout(cfg)

        # A request released while another thread waits for it: one still running
        # (the engine takes it over), and one already seen to end (freed at once).
        for seen_to_end in (False, True):
            r = e.submit(h, [0], d, [0])
            if seen_to_end:
                r.wait(30)
            assert while_inside(lambda: r.wait(30), r.release) == []
            try:
                r.wait(1)
                raise AssertionError("a released request still waited")
            except kvxfer.InvalidArgument as x:
                assert "released" in str(x)

        # A layout closed while another thread submits with it.
        assert while_inside(lambda: e.submit(h, [1], d, [1]).wait(30), h.close) == []
        try:
            h.base(0)
            raise AssertionError("a closed layout still answered")
        except kvxfer.InvalidArgument as x:
            assert "closed" in str(x)

        # The engine closed while another thread submits.
        errors = while_inside(lambda: e.submit(k, [2], d, [2]).wait(30), e.close)
        assert all(isinstance(x, kvxfer.Shutdown) for x in errors), errors
        try:
            e.stats()
            raise AssertionError("a closed engine still answered")
        except kvxfer.Shutdown:
            pass
        d.close(), k.close()
        print("ok")
        """,
        tmp_path,
        prelude=WATCH,
    )
    assert out.strip() == "ok"


def test_closing_the_engine_while_threads_submit_raises_shutdown_in_them(tmp_path):
    # Two threads submit tiny requests and wait for them while the main thread closes
    # the engine, 200 rounds: each thread must end with Shutdown, never a crash.
    out = run_child(
        """
        sys.setswitchinterval(1e-5)
        cfg = geometry()
        ended = set()

        def one_round():
            e = engine()
            h, d = e.host_layout(cfg), e.device_layout(cfg)
            started = threading.Barrier(3)
            def work(block):
                started.wait(30)
                while True:
                    try:
                        e.submit(h, [block], d, [block]).wait(30)
                        e.stats()
                    except kvxfer.Cancelled:
                        continue  # the close cancelled it before it started
                    except kvxfer.Error as x:
                        ended.add(type(x).__name__)
                        return
            threads = [threading.Thread(target=work, args=(b,)) for b in (0, 1)]
            for t in threads:
                t.start()
            started.wait(30)
            time.sleep(0.002)
            e.close()
            for t in threads:
                t.join(30)
                assert not t.is_alive()
            h.close(), d.close()

        for _ in range(200):
            one_round()
        print(*sorted(ended))
        """,
        tmp_path,
        timeout=300,
    )
    assert out.split() == ["Shutdown"], out


def test_closing_the_engine_from_a_callback_returns_also_while_another_thread_closes_it(tmp_path):
    out = run_child(
        """
        cfg = geometry(blocks=256, inner=512)   # 8 MiB per layout
        for round in range(3):
            e = engine()
            h, k = e.host_layout(cfg), e.disk_layout(cfg, "kv.bin")
            closed_in_callback = []
            def on_complete(req, err):
                req.engine.close()
                closed_in_callback.append(err)
            reqs = [e.submit(h, range(256), k, range(256), on_complete=on_complete) for _ in range(4)]
            if round == 0:
                e.close()  # while the requests run: their callbacks close it too
            else:
                # Only callbacks close it (the first one to run); the requests end.
                for r in reqs:
                    try:
                        r.wait(60)
                    except kvxfer.Error:
                        pass
                e.close()
            assert len(closed_in_callback) == 4, closed_in_callback
            h.close(), k.close()
        print("ok")
        """,
        tmp_path,
        timeout=60,
    )
    assert out.strip() == "ok"


def test_a_collection_inside_a_sweep_does_not_deadlock_a_concurrent_release(tmp_path):
    # A collection may run wherever Python allocates, so also while one thread sweeps
    # the engine's released requests and another releases a running one. The collection
    # here is forced at that point: thread A is inside the sweep and finalizes a request
    # in a reference cycle (as an awaited request that failed is), while thread B is
    # handing its running request to the engine.
    out = run_child(
        """
        from kvxfer import _native as n
        gc.disable()
        in_sweep, b_hands_on = threading.Event(), threading.Event()
        a = None

        class InSweep:
            def __init__(self, lib):
                self.lib = lib
            def __getattr__(self, name):
                f = getattr(self.lib, name)
                if name != "kvx_request_poll":
                    return f
                def poll(h):
                    # The main thread's sweeps see the released request running, however
                    # fast it really ends, so it is still there for thread A's sweep.
                    if threading.current_thread() is threading.main_thread() and not in_sweep.is_set():
                        return n.PENDING
                    if threading.current_thread() is a and not in_sweep.is_set():
                        in_sweep.set()
                        assert b_hands_on.wait(30)
                        gc.collect()   # as any allocation in the sweep may
                    return f(h)
                return poll

        n.lib = InSweep(n.lib)
        cfg = geometry()
        e = engine()
        src, dst = e.host_layout(cfg), e.host_layout(cfg)
        ids = range(cfg.num_blocks)
        e.submit(src, ids, dst, ids).release()   # not seen to end: a later submit sweeps it
        running = e.submit(src, ids, dst, ids)
        v = e.submit(src, ids, dst, ids)
        v.me = v   # only the collector frees it
        del v
        add = e._unfinished.add
        def hand_on(gate, keep):
            b_hands_on.set()
            return add(gate, keep)
        e._unfinished.add = hand_on

        def submit():
            e.submit(src, ids, dst, ids).wait(60)
        def release():
            assert in_sweep.wait(30)
            running.release()
        a = threading.Thread(target=submit, daemon=True)
        b = threading.Thread(target=release, daemon=True)
        a.start(), b.start()
        a.join(30), b.join(30)
        if a.is_alive() or b.is_alive():
            print("deadlocked: the sweeping thread and the releasing one wait for each other", flush=True)
            os._exit(1)
        e.close()
        print("ok")
        """,
        tmp_path,
    )
    assert out.strip() == "ok"


def test_a_collection_while_a_released_request_refuses_a_call_does_not_deadlock(tmp_path):
    # Raising the "released" error allocates, so a collection may run then and finalize
    # another released request, which shares the released requests' handle.
    out = run_child(
        """
        from kvxfer import engine as ke
        gc.disable()
        cfg = geometry()
        e = engine()
        src, dst = e.host_layout(cfg), e.host_layout(cfg)
        ids = range(cfg.num_blocks)
        r = e.submit(src, ids, dst, ids)
        r.release()
        v = e.submit(src, ids, dst, ids)
        v.release()
        v.me = v   # only the collector frees it
        del v
        closed = ke._RELEASED._closed
        def collect_then_closed():
            gc.collect()   # as the allocation of the error may
            return closed()
        ke._RELEASED._closed = collect_then_closed
        try:
            r.done()
            raise AssertionError("a released request answered done()")
        except kvxfer.InvalidArgument as x:
            assert "released" in str(x)
        ke._RELEASED._closed = closed
        e.close()
        print("ok")
        """,
        tmp_path,
        timeout=60,
    )
    assert out.strip() == "ok"


# Requests submitted while REMOTE is set end with KVX_ERR_REMOTE as the binding sees
# them (callback, wait, poll), once they have really ended: a remote transfer that timed
# out, which NIXL may still be writing.
FAIL_REMOTE = """
import weakref
from kvxfer import _native as n
from kvxfer import engine as ke

REMOTE = False
KVX_ERR_REMOTE = 17

@n.COMPLETION_FN
def remote_callback(user_data, handle, status):
    ke._trampoline(user_data, handle, KVX_ERR_REMOTE)

class FailRemote:
    def __init__(self, lib):
        self.lib, self.remote = lib, set()

    def __getattr__(self, name):
        f = getattr(self.lib, name)
        if name == "kvx_transfer_submit":
            def submit(*args):
                opts, out = args[6]._obj, args[7]._obj
                if REMOTE and opts.user_data:
                    opts.on_complete = remote_callback
                st = f(*args)
                if REMOTE and st == 0:
                    self.remote.add(out.value)
                return st
            return submit
        if name in ("kvx_request_poll", "kvx_request_wait"):
            def ended(h, *rest):
                st = f(h, *rest)
                return KVX_ERR_REMOTE if h in self.remote and st in (0, KVX_ERR_REMOTE) else st
            return ended
        if name == "kvx_request_release":
            def release(h):
                self.remote.discard(h)
                return f(h)
            return release
        return f

n.lib = FailRemote(n.lib)
"""


def test_a_request_that_ended_with_a_remote_error_keeps_its_arrays_until_the_engine_closes(tmp_path):
    out = run_child(
        """
        cfg = geometry()
        e = engine()
        dst = e.host_layout(cfg)
        ids = range(cfg.num_blocks)

        def submit(**kw):
            a = np.zeros(cfg.base_bytes // 2, np.uint16)
            return weakref.ref(a), e.submit(e.register(a, cfg), ids, dst, ids, **kw)

        def ended_locally():
            # The control: a request that ended otherwise lets go of its arrays.
            ref, r = submit()
            r.wait(60)
            del r
            gc.collect()
            assert ref() is None, "a request that ended kept its arrays"

        ended_locally()
        REMOTE = True
        kept = {}

        ref, r = submit()
        try:
            r.wait(60)
            raise AssertionError("wait() did not raise RemoteError")
        except kvxfer.RemoteError:
            pass
        kept["wait"] = ref

        ref, r = submit()
        while not r.done():
            time.sleep(0.001)
        kept["done"] = ref

        got = []
        ended = threading.Event()
        def on_complete(req, err):
            got.append(err)
            ended.set()
        ref, r = submit(on_complete=on_complete)
        assert ended.wait(60)
        assert isinstance(got[0], kvxfer.RemoteError), got
        kept["callback"] = ref

        # Read before the submit: the request may end before submit returns, and every
        # earlier one was counted before its wait, poll or callback saw it end.
        before = e.stats().requests_completed
        ref, r = submit()
        r.release()   # the engine's sweep sees it end
        kept["sweep"] = ref
        REMOTE = False
        while e.stats().requests_completed == before:
            time.sleep(0.001)
        e.submit(dst, [0], dst, [1]).wait(60)

        del r
        gc.collect()
        ended_locally()
        gone = [how for how, ref in kept.items() if ref() is None]
        assert not gone, f"arrays freed while a remote write may still run (ended through {gone})"
        e.close()
        gc.collect()
        alive = [how for how, ref in kept.items() if ref() is not None]
        assert not alive, f"arrays still kept once the engine closed (ended through {alive})"
        print("ok")
        """,
        tmp_path,
        timeout=60,
        prelude=FAIL_REMOTE,
    )
    assert out.strip() == "ok"
