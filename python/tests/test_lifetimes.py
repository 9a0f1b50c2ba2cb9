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
DEVICE = int(os.environ["KVXFER_TEST_DEVICE"]) if os.environ.get("KVXFER_TEST_DEVICE") else "emulated"
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
        p = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=dict(os.environ, MALLOC_PERTURB_="165"), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the child hung ({timeout} s); its output:\n{e.stdout}\n{e.stderr}")
    assert p.returncode == 0, f"the child exited {p.returncode}:\n{p.stdout}\n{p.stderr[-3000:]}"
    return p.stdout


def test_a_callback_may_release_its_request_even_before_submit_returned(tmp_path):
    # Threads spinning in Python hold the GIL, so the callback often runs before submit
    # has handed out the request; the release there must be the only one.
    out = run_child(
        """
        cfg = geometry()
        stop = threading.Event()

        def spin():
            while not stop.is_set():
                pass

        def on_complete(req, err):
            req.release()
            ran.append(err)

        e = engine()
        h, d = e.host_layout(cfg), e.device_layout(cfg)
        spinners = [threading.Thread(target=spin) for _ in range(2)]
        for t in spinners:
            t.start()
        try:
            for round in range(4):
                ran = []
                reqs = [e.submit(h, [i % 16], d, [i % 16], on_complete=on_complete) for i in range(300)]
                deadline = time.monotonic() + 60
                while len(ran) < len(reqs) and time.monotonic() < deadline:
                    time.sleep(0.001)
                assert len(ran) == 300 and all(x is None for x in ran), ran[:3]
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
        finally:
            stop.set()
            for t in spinners:
                t.join()
        h.close(), d.close(), e.close()
        print("ok")
        """,
        tmp_path,
    )
    assert out.strip() == "ok"
