#!/usr/bin/env python3
"""kvxfer against its peers on the same disk->device workload, in one run.

Runs on a GPU machine: ./cpp_examples/bench (kvxfer, on each --io-backends entry, e.g.
its own choice and NIXL's POSIX plugin), KvikIO (`kvikio-cu13`, compat mode, 1/16/64
threads, each block -- or each region for layer-separate layouts -- read straight into its
place in a device array), NIXL on its own as Dynamo's block manager uses it (POSIX plugin
reads a block into one of two pinned buffers while the other is copied to the device,
lock-step; needs libnixl_capi.so on LD_LIBRARY_PATH) and a naive baseline (pread into
pinned memory, one cudaMemcpy per block), for several blocks-per-batch values. Writes a
Markdown table and a PNG plot (GB/s against blocks per batch, one line per system).

  python3 cpp_examples/compare.py --dir /dev/shm --out results   # file on tmpfs (hot)
  python3 cpp_examples/compare.py --write ...   # device -> disk instead: kvxfer, KvikIO
                                                # pwrite, naive cudaMemcpy + pwrite
  python3 cpp_examples/compare.py --direct --dir /mnt/nvme ...   # every system on O_DIRECT
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import time

import numpy as np


def parse():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bench", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench"))
    p.add_argument("--dir", default="/dev/shm", help="where the files live")
    p.add_argument("--out", default=".", help="folder for compare.md and compare.png")
    p.add_argument("--num-blocks", type=int, default=683, help="683 x 12.58 MB = 8.6 GB")
    p.add_argument("--num-layers", type=int, default=24)
    p.add_argument("--inner-dim", type=int, default=4096)
    p.add_argument("--page-size", type=int, default=32)
    p.add_argument("--layout", default="contiguous", choices=["contiguous", "layer-block-first"])
    p.add_argument("--batches", default="1,4,16,64")
    p.add_argument("--kvikio-threads", default="1,16,64")
    p.add_argument("--iterations", type=int, default=2)
    p.add_argument("--device", default="0")
    p.add_argument("--io-backends", default="auto,nixl",
                   help="kvxfer's --io-backend values to run; 'mapped' runs the bench with --mapped (KVX_DISK_MAPPED)")
    p.add_argument("--write", action="store_true", help="device -> disk instead of disk -> device")
    p.add_argument("--direct", action="store_true",
                   help="O_DIRECT for every system (a real disk), instead of page-cache I/O on a hot file")
    return p.parse_args()


def io_mode(a):
    return "O_DIRECT" if a.direct else "hot"


def cpu_seconds():
    """User + system CPU seconds of this process, all its threads (KvikIO's pool too)."""
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


def timed(fn, iterations, total):
    """(GB/s, CPU s/GB) of `fn` moving `total` bytes, after one warm-up call."""
    fn()
    t0, c0 = time.perf_counter(), cpu_seconds()
    for _ in range(iterations):
        fn()
    secs, cpu = time.perf_counter() - t0, cpu_seconds() - c0
    return total * iterations / secs / 1e9, cpu / (total * iterations / 1e9)


def direction(a):
    return "device-to-disk" if a.write else "disk-to-device"


def kvxfer_runs(a, batches):
    rows = []
    for backend in a.io_backends.split(","):
        for b in batches:
            cmd = [a.bench, "--device", a.device, "--direction", direction(a), "--dir", a.dir,
                   *([] if a.direct else ["--buffered"]),
                   "--num-blocks", str(a.num_blocks), "--blocks-per-batch", str(b), "--num-layers", str(a.num_layers),
                   "--inner-dim", str(a.inner_dim), "--page-size", str(a.page_size), "--layout", a.layout,
                   "--iterations", str(a.iterations), "--json", "--no-verify",
                   *(["--mapped"] if backend == "mapped" else ["--io-backend", backend])]
            run = subprocess.run(cmd, capture_output=True, text=True)
            if run.returncode != 0:
                print(f"kvxfer on {backend}: not run: {run.stderr.strip()}", flush=True)
                break
            r = [json.loads(l) for l in run.stdout.splitlines() if l.startswith("{")][0]
            name = {"auto": "kvxfer", "mapped": "kvxfer, KVX_DISK_MAPPED"}.get(backend, f"kvxfer over {r['io_backend']}")
            rows.append((name, "-", b, r["gbps"], r["limit_gbps"], r["cpu_s_per_gb"]))
            print(f"{name:24} batch {b:3}: {r['gbps']:6.2f} GB/s (limit {r['limit_gbps']:.2f}), {r['cpu_s_per_gb']:.3f} CPU s/GB", flush=True)
    return rows


def nixl_ab_bounce(a, path, total, block, pieces, dev, batches):
    """NIXL's POSIX plugin reads block i into pinned buffer i % 2 while the other buffer's
    block is copied to the device (one cudaMemcpyAsync per block or region), lock-step."""
    import ctypes
    import cupy as cp
    try:
        lib = ctypes.CDLL("libnixl_capi.so")
    except OSError as e:
        print(f"NIXL A/B bounce: not run: {e}", flush=True)
        return []
    vp, P = ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)
    lib.nixl_capi_reg_dlist_add_desc.argtypes = [vp, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_uint64, vp, ctypes.c_size_t]
    lib.nixl_capi_xfer_dlist_add_desc.argtypes = [vp, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_uint64]
    lib.nixl_capi_create_xfer_req.argtypes = [vp, ctypes.c_int, vp, vp, ctypes.c_char_p, P, vp]
    for f in ("register_mem", "post_xfer_req"):
        getattr(lib, f"nixl_capi_{f}").argtypes = [vp, vp, vp]
    for f in ("get_xfer_status", "release_xfer_req", "opt_args_add_backend"):
        getattr(lib, f"nixl_capi_{f}").argtypes = [vp, vp]
    for f in ("destroy_xfer_req", "destroy_xfer_dlist", "destroy_reg_dlist"):
        getattr(lib, f"nixl_capi_{f}").argtypes = [vp]

    def ok(status, what):
        if status not in (0, 1):
            raise RuntimeError(f"NIXL {what}: status {status}")

    agent, mems, params, backend, opt = vp(), vp(), vp(), vp(), vp()
    try:
        ok(lib.nixl_capi_create_agent(b"kvx-compare", ctypes.byref(agent)), "create agent")
        ok(lib.nixl_capi_get_plugin_params(agent, b"POSIX", ctypes.byref(mems), ctypes.byref(params)), "POSIX plugin")
        ok(lib.nixl_capi_create_backend(agent, b"POSIX", params, ctypes.byref(backend)), "POSIX backend")
    except RuntimeError as e:
        print(f"NIXL A/B bounce: not run: {e} (is plugins/libplugin_POSIX.so beside libnixl.so, or NIXL_PLUGIN_DIR set?)", flush=True)
        return []
    ok(lib.nixl_capi_create_opt_args(ctypes.byref(opt)), "opt args")
    ok(lib.nixl_capi_opt_args_add_backend(opt, backend), "opt args backend")
    bufs = [cp.cuda.alloc_pinned_memory(block) for _ in range(2)]
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if a.direct else 0))
    for mem, descs in ((0, [(b.ptr, block, 0) for b in bufs]), (4, [(0, total, fd)])):
        dl = vp()
        ok(lib.nixl_capi_create_reg_dlist(mem, ctypes.byref(dl)), "reg list")
        for d in descs:
            ok(lib.nixl_capi_reg_dlist_add_desc(dl, *d, None, 0), "reg desc")
        ok(lib.nixl_capi_register_mem(agent, dl, opt), "register")
        lib.nixl_capi_destroy_reg_dlist(dl)

    def read(bi, buf):
        loc, rem, req = vp(), vp(), vp()
        ok(lib.nixl_capi_create_xfer_dlist(0, ctypes.byref(loc)), "xfer list")
        ok(lib.nixl_capi_create_xfer_dlist(4, ctypes.byref(rem)), "xfer list")
        ok(lib.nixl_capi_xfer_dlist_add_desc(loc, buf.ptr, block, 0), "xfer desc")
        ok(lib.nixl_capi_xfer_dlist_add_desc(rem, bi * block, block, fd), "xfer desc")
        ok(lib.nixl_capi_create_xfer_req(agent, 0, loc, rem, b"kvx-compare", ctypes.byref(req), opt), "create read")
        st = lib.nixl_capi_post_xfer_req(agent, req, opt)
        while st == 1:
            st = lib.nixl_capi_get_xfer_status(agent, req)
        ok(st, "read")
        lib.nixl_capi_release_xfer_req(agent, req)
        lib.nixl_capi_destroy_xfer_req(req)
        lib.nixl_capi_destroy_xfer_dlist(loc)
        lib.nixl_capi_destroy_xfer_dlist(rem)

    stream = cp.cuda.Stream(non_blocking=True)
    done = [cp.cuda.Event(), cp.cuda.Event()]
    rows = []
    for b in batches:
        def run():
            for start in range(0, a.num_blocks, b):
                for bi in range(start, min(a.num_blocks, start + b)):
                    k = bi % 2
                    done[k].synchronize()  # the copy out of this buffer finished
                    read(bi, bufs[k])
                    for (off, d, n) in pieces[bi]:
                        cp.cuda.runtime.memcpyAsync(dev.data.ptr + d, bufs[k].ptr + off - bi * block, n, 1, stream.ptr)
                    done[k].record(stream)
                stream.synchronize()
        g, c = timed(run, a.iterations, total)
        rows.append(("NIXL POSIX, A/B bounce", "1", b, g, None, c))
        print(f"NIXL A/B bounce   batch {b:3}: {g:6.2f} GB/s, {c:.3f} CPU s/GB", flush=True)
    os.close(fd)
    return rows


def peer_runs(a, batches):
    import cupy as cp
    os.environ["KVIKIO_COMPAT_MODE"] = "ON"
    import kvikio
    import kvikio.defaults
    if a.direct:
        # KvikIO's own switches for direct I/O in POSIX (compat) mode; say so when absent.
        for key in ("auto_direct_io_read", "auto_direct_io_write"):
            try:
                kvikio.defaults.set(key, True)
            except (AttributeError, KeyError, TypeError, ValueError) as e:
                print(f"KvikIO: cannot set {key} ({e}); its I/O may go through the page cache", flush=True)

    region = a.page_size * a.inner_dim * 2
    block = a.num_layers * 2 * region
    total = block * a.num_blocks
    path = os.path.join(a.dir, f"kvx-compare-{os.getpid()}.kv")
    data = np.random.default_rng(1).integers(0, 255, size=total, dtype=np.uint8)
    data.tofile(path)
    del data
    dev = cp.empty(total, dtype=cp.uint8)  # the device KV pool
    # Where each (file offset, length) lands on the device: block by block for a
    # contiguous pool, region by region for a layer-separate one ([layer][block][2][region]).
    if a.layout == "contiguous":
        pieces = [[(bi * block, bi * block, block)] for bi in range(a.num_blocks)]
    else:
        per_layer = a.num_blocks * 2 * region
        pieces = [[(bi * block + (l * 2 + o) * region, l * per_layer + (bi * 2 + o) * region, region)
                   for l in range(a.num_layers) for o in range(2)] for bi in range(a.num_blocks)]
    rows = []
    try:
        for threads in [int(t) for t in a.kvikio_threads.split(",")]:
            try:
                kvikio.defaults.set("num_threads", threads)
            except (AttributeError, TypeError):
                kvikio.defaults.num_threads_reset(threads)
            with kvikio.CuFile(path, "r+" if a.write else "r") as f:
                io = f.pwrite if a.write else f.pread
                for b in batches:
                    def run():
                        for start in range(0, a.num_blocks, b):
                            futs = [io(dev[d:d + n], n, off) for bi in range(start, min(a.num_blocks, start + b))
                                    for (off, d, n) in pieces[bi]]
                            for fu in futs:
                                fu.get()
                    g, c = timed(run, a.iterations, total)
                    rows.append(("KvikIO", str(threads), b, g, None, c))
                    print(f"KvikIO {threads:2} threads batch {b:3}: {g:6.2f} GB/s, {c:.3f} CPU s/GB", flush=True)
        if a.write:
            print("NIXL A/B bounce: reads only", flush=True)
        else:
            rows += nixl_ab_bounce(a, path, total, block, pieces, dev, batches)
        pinned = cp.cuda.alloc_pinned_memory(block)
        host = np.frombuffer(pinned, dtype=np.uint8, count=block)
        fd = os.open(path, os.O_RDWR | (os.O_DIRECT if a.direct else 0))  # pinned memory is page-aligned
        for b in batches:
            def naive():
                for bi in range(a.num_blocks):
                    if not a.write:
                        os.preadv(fd, [host], bi * block)
                    for (off, d, n) in pieces[bi]:
                        h = host.ctypes.data + off - bi * block
                        if a.write:
                            cp.cuda.runtime.memcpy(h, dev.data.ptr + d, n, 2)  # cudaMemcpyDeviceToHost
                        else:
                            cp.cuda.runtime.memcpy(dev.data.ptr + d, h, n, 1)  # cudaMemcpyHostToDevice
                    if a.write:
                        os.pwritev(fd, [host], bi * block)
            g, c = timed(naive, a.iterations, total)
            rows.append(("naive cudaMemcpy + pwrite" if a.write else "naive pread + cudaMemcpy", "1", b, g, None, c))
            print(f"naive             batch {b:3}: {g:6.2f} GB/s, {c:.3f} CPU s/GB", flush=True)
        os.close(fd)
    finally:
        os.unlink(path)
    return rows


def report(a, rows):
    os.makedirs(a.out, exist_ok=True)
    best_kvikio = {}
    for s, t, b, g, *_ in rows:
        if s == "KvikIO":
            best_kvikio[b] = max(best_kvikio.get(b, 0), g)
    what = "device -> disk" if a.write else "disk -> device"
    md = [f"# {what}, {a.layout}, {a.num_blocks} blocks x {a.num_layers * 2 * a.page_size * a.inner_dim * 2 / 1e6:.2f} MB, "
          f"file in {a.dir} ({io_mode(a)})", "", "| system | threads | blocks/batch | GB/s | x best KvikIO | limit GB/s | CPU s/GB |",
          "|---|---|---|---|---|---|---|"]
    for s, t, b, g, lim, cpu in rows:
        ratio = f"{g / best_kvikio[b]:.2f}" if b in best_kvikio else ""
        md.append(f"| {s} | {t} | {b} | {g:.2f} | {ratio} | {'' if lim is None else f'{lim:.2f}'} | {cpu:.3f} |")
    with open(os.path.join(a.out, "compare.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key in sorted({(s, t) for s, t, *_ in rows}):
        pts = sorted((b, g) for s, t, b, g, *_ in rows if (s, t) == key)
        label = key[0] if key[1] in ("-", "1") and key[0] != "KvikIO" else f"{key[0]} ({key[1]} threads)"
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("blocks per batch")
    ax.set_ylabel("GB/s (1e9 B/s)")
    ax.set_title(f"{what}, {a.layout} layout, {io_mode(a)} file")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(a.out, "compare.png"), dpi=120)


def main():
    a = parse()
    batches = [int(b) for b in a.batches.split(",")]
    rows = kvxfer_runs(a, batches) + peer_runs(a, batches)
    report(a, rows)


if __name__ == "__main__":
    sys.exit(main())
