"""kvxfer's vLLM tier against vLLM's own fs tier, through vLLM's tiering manager.

Both tiers are built by vLLM (`TieringOffloadingSpec`, as `vllm serve` builds them from
`kv_connector_extra_config`) and driven with the scheduler's calling sequence:

- store: per request, `on_new_request`, `prepare_store`, the worker's GPU -> CPU copy (the
  chunks' first 8 bytes stamped with the key's index; the rest is random, written once),
  `complete_store` (which submits the cascade job to the tier) and `on_request_finished`;
- load (after `reset_cache`, which empties the CPU tier): per request, the scheduler's
  prefix lookup of every key, step after step, until all are HIT (a secondary hit starts a
  promotion, submitted as one load job per request at the step's end), then
  `prepare_load`, the worker's CPU -> GPU read (each chunk's stamp checked) and
  `complete_load`;
- a step (`on_schedule_end`, which polls the tier's finished jobs) every `--step-ms`.

`--inflight` requests are in flight at once, each of `--job-mib` MiB. A job is one
`submit_store`/`submit_load` of the tier; its latency runs from that call to the step
whose `get_finished_jobs` returns it (so it includes up to one step of waiting).

`raw` is the medium's limit, measured in the same run: first a sweep of I/O sizes and
thread counts (`--raw-io-sizes`, `--raw-threads`; each thread writes then reads a file of
its own, `O_DIRECT` on disk), then, in every round, the same bytes as the tiers' runs at
the sweep's fastest setting for each direction. Its line is the fastest the medium moved.

An untimed store and load of each tier on each medium comes first (`--warmup-gib`). Runs
then alternate (kvxfer, fs, raw, kvxfer, ...) for every chunk size and medium, each in a
fresh directory. Between store and load the page cache is dropped (disk medium, needs
root) so the loads are cold. GB/s is 10^9 bytes per second of the phase (first request to
last job reported); CPU s/GB is the process's user + system time over the phase (every
thread: the tier's, vLLM's, the driver's) per 10^9 bytes.

    PYTHONPATH=python KVX_LIBRARY=target/release/libkvxfer.so \\
        target/vllm-venv/bin/python python/integration/bench_vllm_tier.py [--json out.json]

Run by `make integration-bench`."""

from __future__ import annotations

import argparse
import gc
import json
import mmap
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Optional

import numpy as np
from kvx_integration import tiering_manager

from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key
from vllm.utils.gc_utils import freeze_gc_heap

GB = 1e9
MiB = 1 << 20
TIERS = ("kvxfer", "fs", "raw")
#: A hang guard only: a phase that takes this long has stopped moving.
PHASE_DEADLINE_S = 600.0


def parse_size(s: str) -> int:
    s = s.strip().upper()
    for suffix, mult in (("KIB", 1 << 10), ("MIB", 1 << 20), ("GIB", 1 << 30), ("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30)):
        if s.endswith(suffix):
            return int(float(s[: -len(suffix)]) * mult)
    return int(s)


def size_name(n: int) -> str:
    return f"{n >> 20} MiB" if n >= MiB else f"{n >> 10} KiB"


def tier_config(args: argparse.Namespace, tier: str, root: str, medium: str, total_bytes: int) -> Dict[str, Any]:
    if tier == "kvxfer":
        # Page-cache I/O on tmpfs (docs/vllm.md), direct I/O on disk; room for every chunk.
        return {
            "type": "KvxferTier",
            "module_path": "kvxfer.vllm",
            "root_dir": root,
            "capacity_bytes": total_bytes + total_bytes // 4,
            "buffered": medium == "shm",
            **args.kvxfer_config,
        }
    # vLLM's defaults: 16 read and 16 write threads, O_DIRECT where the file system takes it.
    return {"type": "fs", "root_dir": root, **args.fs_config}


def make_manager(cfg: Dict[str, Any], chunk_bytes: int, cpu_bytes: int) -> Any:
    return tiering_manager(cfg, chunk_bytes, cpu_bytes, "kvxfer/bench-model")


class JobClock:
    """Times the tier's jobs: submit_store/submit_load to the poll that reports them."""

    def __init__(self, tier: Any):
        self.submitted: Dict[Any, float] = {}
        self.latencies: List[float] = []
        self.failed = 0
        submit_store, submit_load, poll = tier.submit_store, tier.submit_load, tier.get_finished_jobs

        def timed_store(job: Any) -> None:
            self.submitted[job.job_id] = time.perf_counter()
            submit_store(job)

        def timed_load(job: Any) -> None:
            self.submitted[job.job_id] = time.perf_counter()
            submit_load(job)

        def timed_poll() -> List[Any]:
            out = list(poll())
            now = time.perf_counter()
            for r in out:
                self.latencies.append(now - self.submitted.pop(r.job_id))
                self.failed += not r.success
            return out

        tier.submit_store, tier.submit_load, tier.get_finished_jobs = timed_store, timed_load, timed_poll

    @property
    def in_flight(self) -> int:
        return len(self.submitted)


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def step(m: Any) -> None:
    with m.lock:
        m.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))


class Run:
    """One tier, chunk size and medium: the store phase, then the load phase."""

    def __init__(self, args: argparse.Namespace, tier: str, chunk_bytes: int, medium: str):
        self.args, self.tier_name, self.chunk_bytes, self.medium = args, tier, chunk_bytes, medium
        self.chunks_per_job = max(1, args.job_mib * MiB // chunk_bytes)
        self.num_jobs = max(1, int(args.gib * (1 << 30)) // (self.chunks_per_job * chunk_bytes))
        self.total_bytes = self.num_jobs * self.chunks_per_job * chunk_bytes
        cpu_chunks = 2 * args.inflight * self.chunks_per_job
        self.root = os.path.join(args.shm_dir if medium == "shm" else args.disk_dir, f"{tier}-{uuid.uuid4().hex[:8]}")
        os.makedirs(self.root)
        self.m = make_manager(tier_config(args, tier, self.root, medium, self.total_bytes), chunk_bytes, cpu_chunks * chunk_bytes)
        (self.tier,) = self.m.secondary_tiers
        self.view = np.asarray(self.m.primary_tier.get_kv_memoryview()).view(np.uint8)
        # The chunks' bytes: random (what kvxfer checksums is not all zeros), written once.
        rng = np.random.default_rng(1)
        for row in range(self.view.shape[0]):
            self.view[row] = rng.integers(0, 256, chunk_bytes, dtype=np.uint8)
        salt = uuid.uuid4().bytes
        self.keys = [make_offload_key(salt + i.to_bytes(16, "little"), 0) for i in range(self.num_jobs * self.chunks_per_job)]
        self.step_s = args.step_ms / 1000.0
        # As vLLM's engine core does once it has started: what exists now is never
        # garbage, so the collector stops walking it.
        freeze_gc_heap()

    def describe(self) -> Dict[str, Any]:
        t = self.tier
        if self.tier_name == "fs":
            from vllm.v1.kv_offload.tiering.fs import io as fs_io
            from vllm.v1.kv_offload.tiering.fs import manager as fs_manager

            return {"fs_io_C": fs_io._HAS_FSIO_C, "batch_lookup_C": fs_manager._HAS_BATCH_LOOKUP_C, "o_direct": t._use_o_direct, "threads": len(t._pool._threads)}
        c, cfg = t._engine.config(), tier_config(self.args, "kvxfer", self.root, self.medium, self.total_bytes)
        return {"buffered": bool(cfg.get("buffered")), "shards": cfg.get("shards", 4), "io_threads": c.io_threads, "io_backend": c.io_backend, "slot_bytes": c.slot_bytes}

    def job_keys(self, j: int) -> List[Any]:
        return self.keys[j * self.chunks_per_job : (j + 1) * self.chunks_per_job]

    def _phase(self, body: Any) -> Dict[str, Any]:
        clock = JobClock(self.tier)
        c0, s0, t0 = cpu_seconds(), time.thread_time(), time.perf_counter()
        body(clock)
        wall, cpu, sched = time.perf_counter() - t0, cpu_seconds() - c0, time.thread_time() - s0
        lat = np.array(clock.latencies) * 1000.0
        return {
            "bytes": self.total_bytes,
            "seconds": wall,
            "gbps": self.total_bytes / wall / GB,
            "cpu_s_per_gb": cpu / (self.total_bytes / GB),
            "scheduler_cpu_s_per_gb": sched / (self.total_bytes / GB),
            "jobs": len(clock.latencies),
            "failed_jobs": clock.failed,
            "latency_ms": [float(x) for x in lat],
        }

    def _deadline_check(self, t0: float, what: str) -> None:
        if time.perf_counter() - t0 > PHASE_DEADLINE_S:
            raise RuntimeError(f"{self.tier_name} {what}: no end after {PHASE_DEADLINE_S:.0f} s")

    def store(self) -> Dict[str, Any]:
        def body(clock: JobClock) -> None:
            m, started, t0 = self.m, 0, time.perf_counter()
            while started < self.num_jobs or m.has_pending_work():
                self._deadline_check(t0, "store")
                while started < self.num_jobs and clock.in_flight < self.args.inflight:
                    keys, ctx = self.job_keys(started), ReqContext(req_id=uuid.uuid4().hex)
                    with m.lock:
                        m.on_new_request(ctx)
                        out = m.prepare_store(keys, ctx)
                    if out is None:  # the CPU tier is full of chunks still cascading
                        with m.lock:
                            m.on_request_finished(ctx)
                        break
                    assert len(out.keys_to_store) == len(keys)
                    base = started * self.chunks_per_job
                    for i, cid in enumerate(out.store_spec.chunk_ids):
                        self.view[cid, :8] = np.frombuffer((base + i).to_bytes(8, "little"), np.uint8)
                    with m.lock:
                        m.complete_store(out.keys_to_store, ctx)
                        m.on_request_finished(ctx)
                    started += 1
                step(m)
                time.sleep(self.step_s)

        return self._phase(body)

    def load(self) -> Dict[str, Any]:
        with self.m.lock:
            self.m.reset_cache()
            self.m.on_reset_flushed()
        if self.medium == "disk":
            drop_page_cache()

        def body(clock: JobClock) -> None:
            m, started, t0 = self.m, 0, time.perf_counter()
            waiting: deque = deque()
            while started < self.num_jobs or waiting or m.has_pending_work():
                self._deadline_check(t0, "load")
                while started < self.num_jobs and len(waiting) < self.args.inflight:
                    ctx = ReqContext(req_id=uuid.uuid4().hex)
                    with m.lock:
                        m.on_new_request(ctx)
                    waiting.append((started, ctx))
                    started += 1
                ready = []
                with m.lock:
                    for j, ctx in waiting:
                        # The scheduler's prefix lookup: every key, until none is deferred;
                        # then the load of the hits, before another request's promotion
                        # can evict them.
                        keys, deferred = self.job_keys(j), False
                        for k in keys:
                            r = m.lookup(k, ctx)
                            if r is LookupResult.MISS:
                                raise RuntimeError(f"{self.tier_name}: a stored key of job {j} is a miss")
                            deferred |= r is not LookupResult.HIT
                        if deferred:
                            continue
                        spec = m.prepare_load(keys, ctx)
                        base = j * self.chunks_per_job
                        for i, cid in enumerate(spec.chunk_ids):  # the worker's CPU -> GPU read
                            got = int.from_bytes(self.view[cid, :8].tobytes(), "little")
                            if got != base + i:
                                raise RuntimeError(f"{self.tier_name}: chunk {base + i} came back as chunk {got}")
                        m.complete_load(keys, ctx)
                        m.on_request_finished(ctx)
                        ready.append((j, ctx))
                for r in ready:
                    waiting.remove(r)
                step(m)
                time.sleep(self.step_s)

        return self._phase(body)

    def close(self) -> None:
        self.view = None  # vLLM unmaps the CPU tier only once nothing exports it
        self.m.shutdown()
        gc.unfreeze()
        shutil.rmtree(self.root, ignore_errors=True)


#: Raw I/Os come from and go to a region this large, past any CPU cache, as the tiers' move
#: to and from vLLM's CPU tier: a buffer that stayed in cache would copy faster than any
#: tier could.
RAW_REGION_BYTES = 256 * MiB
_raw_region: List[memoryview] = []


def raw_region() -> memoryview:
    """The raw runs' memory: page-aligned (for `O_DIRECT`), random bytes, made once."""
    if not _raw_region:
        m = mmap.mmap(-1, RAW_REGION_BYTES)
        view = np.frombuffer(m, dtype=np.uint8)
        view[:] = np.random.default_rng(0).integers(0, 256, RAW_REGION_BYTES, dtype=np.uint8)
        _raw_region.append(memoryview(m))
    return _raw_region[0]


def raw_worker(path: str, flags: int, first: int, size: int, count: int, write: bool) -> None:
    """`count` I/Os of `size` bytes, one after another, to or from one file, walking the
    raw region from I/O number `first`."""
    region, slots = raw_region(), RAW_REGION_BYTES // size
    fd = os.open(path, (os.O_WRONLY | os.O_CREAT if write else os.O_RDONLY) | flags, 0o644)
    try:
        for c in range(count):
            off = (first + c) % slots * size
            buf = region[off : off + size]
            n = os.pwrite(fd, buf, c * size) if write else os.preadv(fd, [buf], c * size)
            if n != size:
                raise OSError(f"raw {'write' if write else 'read'} of {path} moved {n} of {size} bytes")
    finally:
        os.close(fd)


class RawFiles:
    """The medium without vLLM, a key or a checksum: `threads` threads, each writing then
    reading a file of its own in `io_bytes` I/Os (`O_DIRECT` on disk, page-cache I/O on
    tmpfs), from and to `raw_region`. The files are allocated before the writes are timed,
    as kvxfer's store allocates its data files when it opens."""

    def __init__(self, root: str, medium: str, io_bytes: int, threads: int, total_bytes: int):
        self.root, self.medium, self.io_bytes, self.threads = root, medium, io_bytes, threads
        self.count = max(1, total_bytes // threads // io_bytes)
        self.moved = self.count * io_bytes * threads
        self.flags = os.O_DIRECT if medium == "disk" else 0
        raw_region()

    def run(self, write: bool) -> Dict[str, Any]:
        """Every thread's file written (or read) once; timed like a tier's phase."""
        paths = [os.path.join(self.root, f"raw-{self.io_bytes}-{self.threads}-{i}") for i in range(self.threads)]
        if write:
            for path in paths:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
                try:
                    os.posix_fallocate(fd, 0, self.count * self.io_bytes)
                finally:
                    os.close(fd)
        elif self.medium == "disk":
            drop_page_cache()
        c0, t0 = cpu_seconds(), time.perf_counter()
        with ThreadPoolExecutor(self.threads) as pool:
            list(pool.map(lambda i: raw_worker(paths[i], self.flags, i * self.count, self.io_bytes, self.count, write), range(self.threads)))
        wall, cpu = time.perf_counter() - t0, cpu_seconds() - c0
        return {"bytes": self.moved, "seconds": wall, "gbps": self.moved / wall / GB, "cpu_s_per_gb": cpu / (self.moved / GB),
                "scheduler_cpu_s_per_gb": None, "jobs": 0, "failed_jobs": 0, "latency_ms": [],
                "io_bytes": self.io_bytes, "threads": self.threads}


def raw_sweep(args: argparse.Namespace, medium: str) -> Dict[str, Any]:
    """The medium's limit: every I/O size of `--raw-io-sizes` with every thread count of
    `--raw-threads`, `--raw-mib` written then read (cold on disk) at each; the fastest
    setting per direction is what the rounds' `raw` runs use."""
    root = os.path.join(args.shm_dir if medium == "shm" else args.disk_dir, f"sweep-{uuid.uuid4().hex[:8]}")
    os.makedirs(root)
    points = []
    try:
        for io_bytes in [parse_size(x) for x in args.raw_io_sizes.split(",")]:
            for threads in [int(x) for x in args.raw_threads.split(",")]:
                files = RawFiles(root, medium, io_bytes, threads, args.raw_mib * MiB)
                try:
                    w, r = files.run(True), files.run(False)
                finally:
                    for f in os.listdir(root):
                        os.unlink(os.path.join(root, f))
                points.append({"io_bytes": io_bytes, "threads": threads, "store_gbps": w["gbps"], "load_gbps": r["gbps"]})
                print(f"raw sweep {medium:4} {size_name(io_bytes):>7} x {threads:2} threads: write {w['gbps']:6.2f} GB/s, read {r['gbps']:6.2f} GB/s", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    best = {d: max(points, key=lambda p: p[f"{d}_gbps"]) for d in ("store", "load")}
    return {"points": points, "best": {d: {"io_bytes": b["io_bytes"], "threads": b["threads"]} for d, b in best.items()}}


class RawRun:
    """The medium's limit in a round: the same bytes as a tier's run, written at the
    sweep's fastest write setting and read at its fastest read setting (the files laid
    out again, untimed, when the two differ); dropped as the tiers' runs are."""

    def __init__(self, args: argparse.Namespace, chunk_bytes: int, medium: str, best: Dict[str, Dict[str, int]]):
        self.medium, self.best = medium, best
        chunks_per_job = max(1, args.job_mib * MiB // chunk_bytes)
        num_jobs = max(1, int(args.gib * (1 << 30)) // (chunks_per_job * chunk_bytes))
        self.total_bytes = num_jobs * chunks_per_job * chunk_bytes
        self.root = os.path.join(args.shm_dir if medium == "shm" else args.disk_dir, f"raw-{uuid.uuid4().hex[:8]}")
        os.makedirs(self.root)

    def _files(self, direction: str) -> RawFiles:
        b = self.best[direction]
        return RawFiles(self.root, self.medium, b["io_bytes"], b["threads"], self.total_bytes)

    def store(self) -> Dict[str, Any]:
        return self._files("store").run(True)

    def load(self) -> Dict[str, Any]:
        files = self._files("load")
        if self.best["load"] != self.best["store"]:
            for f in os.listdir(self.root):
                os.unlink(os.path.join(self.root, f))
            files.run(True)
        return files.run(False)

    def describe(self) -> Dict[str, Any]:
        return {d: f"{size_name(b['io_bytes'])} I/Os x {b['threads']} threads" for d, b in self.best.items()} | {"o_direct": self.medium == "disk"}

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


_drop_warned = False


def drop_page_cache() -> None:
    """Writes back and drops the page cache (root only); says once when it cannot."""
    global _drop_warned
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError as e:
        if not _drop_warned:
            print(f"note: cannot drop the page cache ({e}); disk loads may be served from it", file=sys.stderr)
            _drop_warned = True


def percentile(xs: List[float], q: float) -> float:
    return float(np.percentile(np.array(xs), q)) if xs else float("nan")


def summarize(runs: List[Dict[str, Any]], sweeps: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Per (tier, chunk, medium, direction): the median run's GB/s and CPU s/GB, and
    latency percentiles over every job of every run. Raw's GB/s is the fastest the medium
    moved in the run: the sweep's best point or a round's raw run, whichever was faster."""
    groups: Dict[tuple, List[Dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault((r["tier"], r["chunk_bytes"], r["medium"], r["direction"]), []).append(r)
    rows = []
    for (tier, chunk, medium, direction), rs in groups.items():
        lat = [x for r in rs for x in r["latency_ms"]]
        rows.append({
            "tier": tier,
            "chunk_bytes": chunk,
            "medium": medium,
            "direction": direction,
            "runs": len(rs),
            "gbps": statistics.median(r["gbps"] for r in rs),
            "gbps_all": [round(r["gbps"], 3) for r in rs],
            "cpu_s_per_gb": statistics.median(r["cpu_s_per_gb"] for r in rs),
            "scheduler_cpu_s_per_gb": None if tier == "raw" else statistics.median(r["scheduler_cpu_s_per_gb"] for r in rs),
            "p50_ms": percentile(lat, 50),
            "p99_ms": percentile(lat, 99),
            "p999_ms": percentile(lat, 99.9),
            "jobs": len(lat),
            "failed_jobs": sum(r["failed_jobs"] for r in rs),
        })
        if tier == "raw":
            swept = max(p[f"{direction}_gbps"] for p in sweeps[medium]["points"])
            rows[-1].update(gbps=max(swept, *(r["gbps"] for r in rs)), io_bytes=rs[0]["io_bytes"], threads=rs[0]["threads"])
    by = {(r["tier"], r["chunk_bytes"], r["medium"], r["direction"]): r for r in rows}
    for r in rows:
        fs = by.get(("fs", r["chunk_bytes"], r["medium"], r["direction"]))
        raw = by.get(("raw", r["chunk_bytes"], r["medium"], r["direction"]))
        r["ratio_vs_fs"] = r["gbps"] / fs["gbps"] if fs and fs["gbps"] > 0 else None
        r["of_raw"] = r["gbps"] / raw["gbps"] if raw and raw["gbps"] > 0 else None
    order = {t: i for i, t in enumerate(TIERS)}
    rows.sort(key=lambda r: (-r["chunk_bytes"], r["medium"], r["direction"] != "store", order[r["tier"]]))
    return rows


def table(rows: List[Dict[str, Any]]) -> str:
    head = "| chunk | medium | direction | tier | GB/s | of raw | job p50 ms | p99 ms | p99.9 ms | CPU s/GB | scheduler thread CPU s/GB | kvxfer/fs |"
    out = [head, "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]

    def num(x: Optional[float], fmt: str) -> str:
        return "" if x is None or x != x else format(x, fmt)

    for r in rows:
        ratio = f"{r['ratio_vs_fs']:.2f}×" if r["tier"] == "kvxfer" and r["ratio_vs_fs"] is not None else ""
        tiered = r["tier"] != "raw"
        name = r["tier"] if tiered else f"raw ({size_name(r['io_bytes'])} × {r['threads']})"
        out.append(
            f"| {size_name(r['chunk_bytes'])} | {r['medium']} | {r['direction']} | {name} | {r['gbps']:.2f} | "
            f"{num(r['of_raw'], '.2f') if tiered else ''} | {num(r['p50_ms'], '.1f')} | {num(r['p99_ms'], '.1f')} | "
            f"{num(r['p999_ms'], '.1f')} | {r['cpu_s_per_gb']:.2f} | {num(r['scheduler_cpu_s_per_gb'], '.2f') if tiered else ''} | {ratio} |"
        )
    return "\n".join(out)


def describe_setup(d: Dict[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in d.items())


def machine(args: argparse.Namespace) -> Dict[str, Any]:
    """The facts a reader needs to place the figures: CPUs, kernel, vLLM, file systems."""

    def df(path: str) -> str:
        try:
            return subprocess.run(["df", "-hT", path], capture_output=True, text=True, timeout=10).stdout.splitlines()[-1]
        except (OSError, subprocess.SubprocessError, IndexError):
            return "?"

    import vllm

    return {"cpus": os.cpu_count(), "kernel": os.uname().release, "vllm": vllm.__version__, "shm": df(args.shm_dir), "disk": df(args.disk_dir)}


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=2.0, help="bytes per direction per run, GiB (default 2)")
    p.add_argument("--chunks", default="2M,64K", help="chunk sizes (default 2M,64K)")
    p.add_argument("--media", default="shm,disk", help="shm (tmpfs), disk, or both (default)")
    p.add_argument("--shm-dir", default="/dev/shm/kvxfer-vbench", help="the tmpfs directory")
    p.add_argument("--disk-dir", default="/var/tmp/kvxfer-vbench", help="a directory on the local disk")
    p.add_argument("--rounds", type=int, default=3, help="runs of each tier per line, alternating (default 3)")
    p.add_argument("--tiers", default="kvxfer,fs,raw", help="tiers to run; raw is the medium's limit (default kvxfer,fs,raw)")
    p.add_argument("--job-mib", type=int, default=32, help="MiB per request, one tier job (default 32)")
    p.add_argument("--inflight", type=int, default=8, help="requests in flight at once (default 8)")
    p.add_argument("--step-ms", type=float, default=1.0, help="pause between scheduler steps (default 1)")
    p.add_argument("--raw-io-sizes", default="64K,256K,1M,2M,4M", help="I/O sizes of the raw sweep (default 64K,256K,1M,2M,4M)")
    p.add_argument("--raw-threads", default="1,2,4,8,16", help="thread counts of the raw sweep (default 1,2,4,8,16)")
    p.add_argument("--raw-mib", type=int, default=1024, help="MiB written then read at each point of the raw sweep (default 1024)")
    p.add_argument("--warmup-gib", type=float, default=0.25, help="an untimed store and load of each tier on each medium first, GiB (default 0.25; 0: none)")
    p.add_argument("--kvxfer-config", type=json.loads, default={}, metavar="JSON", help='keys added to kvxfer\'s tier config, e.g. \'{"engine": {"io_threads": 8}}\'')
    p.add_argument("--fs-config", type=json.loads, default={}, metavar="JSON", help="keys added to vLLM's fs tier config")
    p.add_argument("--json", metavar="FILE", help="write the table's rows, every run and the setup as JSON")
    p.add_argument("--md", metavar="FILE", help="write the table as Markdown, with a title line (for docs/results/)")
    args = p.parse_args(argv)

    chunks = [parse_size(c) for c in args.chunks.split(",")]
    media = args.media.split(",")
    tiers = args.tiers.split(",")
    for d, medium in ((args.shm_dir, "shm"), (args.disk_dir, "disk")):
        if medium in media:
            os.makedirs(d, exist_ok=True)
    runs: List[Dict[str, Any]] = []
    setup: Dict[str, Any] = {}
    sweeps = {medium: raw_sweep(args, medium) for medium in media} if "raw" in tiers else {}
    if args.warmup_gib > 0:
        # The first runs of a process are slower whatever the tier (first use of vLLM's
        # and numpy's code paths, of the file system's and the allocator's memory).
        warm = argparse.Namespace(**{**vars(args), "gib": args.warmup_gib})
        for medium in media:
            for tier in tiers:
                if tier != "raw":
                    run = Run(warm, tier, chunks[0], medium)
                    try:
                        run.store(), run.load()
                    finally:
                        run.close()
    for rnd in range(args.rounds):
        for chunk in chunks:
            for medium in media:
                for tier in tiers:
                    run = RawRun(args, chunk, medium, sweeps[medium]["best"]) if tier == "raw" else Run(args, tier, chunk, medium)
                    try:
                        setup.setdefault(f"{tier} {medium}", run.describe())
                        for direction, phase in (("store", run.store), ("load", run.load)):
                            r = phase()
                            r.update(tier=tier, chunk_bytes=chunk, medium=medium, direction=direction, round=rnd)
                            runs.append(r)
                            sched = "" if r["scheduler_cpu_s_per_gb"] is None else f"  (scheduler thread {r['scheduler_cpu_s_per_gb']:5.2f})"
                            print(
                                f"round {rnd} {tier:6} {size_name(chunk):>7} {medium:4} {direction:5} "
                                f"{r['gbps']:6.2f} GB/s  {r['cpu_s_per_gb']:5.2f} CPU s/GB{sched}  {r['jobs']} jobs",
                                file=sys.stderr,
                                flush=True,
                            )
                    finally:
                        run.close()
    rows = summarize(runs, sweeps)
    text = table(rows) + "\n\n" + "\n".join(f"- {k}: {describe_setup(v)}" for k, v in setup.items()) + "\n"
    print(text, end="")
    if args.md:
        with open(args.md, "w") as f:
            f.write(f"# kvxfer's vLLM tier against vLLM's fs tier, {args.gib:g} GiB a direction, {args.rounds} runs a line\n\n{text}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "machine": machine(args), "setup": setup, "raw_sweeps": sweeps, "rows": rows, "runs": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
