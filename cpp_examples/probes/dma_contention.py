#!/usr/bin/env python3
"""What caps disk->device from a hot file on this host: the PCIe copy and the page-cache
reads share host memory. Measures, on a file in the page cache or on tmpfs:

  1. 2 MiB host->device copies from a 64 MiB pinned ring on two streams (kvxfer's shape);
  2. N threads pread-ing the file in 2 MiB pieces (the I/O workers' shape);
  3. both at once: the ceiling of any read-into-bounce-memory-then-DMA design;
  4. the copies straight from the file's pages, mapped and registered whole with the
     device (one memory crossing instead of three), and what registering costs.

  python3 cpp_examples/probes/dma_contention.py /dev/shm/file [threads]   # needs cupy and a GPU
"""
import ctypes
import mmap
import os
import sys
import threading
import time

import cupy as cp

MiB = 1 << 20
PIECE = 2 * MiB


def main():
    path, nthreads = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 12
    size = os.path.getsize(path) // PIECE * PIECE
    ring = cp.cuda.alloc_pinned_memory(64 * MiB)
    dev = cp.cuda.alloc(1 << 30)
    streams = [cp.cuda.Stream(non_blocking=True) for _ in range(2)]

    def copies(src, span, piece, seconds=2.0):
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            for i in range(span // piece):
                d = dev.ptr + (n * piece) % ((1 << 30) - piece)
                cp.cuda.runtime.memcpyAsync(d, src + i * piece, piece, 1, streams[i % 2].ptr)
                n += 1
            for s in streams:
                s.synchronize()
        return n * piece / (time.perf_counter() - t0) / 1e9

    stop, done = threading.Event(), [0] * nthreads

    def reader(k):
        fd, buf = os.open(path, os.O_RDONLY), bytearray(PIECE)
        off = k * PIECE
        while not stop.is_set():
            os.preadv(fd, [buf], off)
            done[k] += PIECE
            off = (off + nthreads * PIECE) % size
        os.close(fd)

    def with_readers(fn):
        stop.clear()
        done[:] = [0] * nthreads
        ts = [threading.Thread(target=reader, args=(k,)) for k in range(nthreads)]
        t0 = time.perf_counter()
        for t in ts:
            t.start()
        out = fn()
        stop.set()
        for t in ts:
            t.join()
        return out, sum(done) / (time.perf_counter() - t0) / 1e9

    copies(ring.ptr, 64 * MiB, PIECE, 0.5)  # warm-up
    print(f"host->device 2 MiB copies from a pinned ring, alone: {copies(ring.ptr, 64 * MiB, PIECE):.2f} GB/s")
    _, r = with_readers(lambda: time.sleep(2))
    print(f"{nthreads} threads pread-ing the file, alone: {r:.2f} GB/s")
    g, r = with_readers(lambda: copies(ring.ptr, 64 * MiB, PIECE))
    print(f"both at once: copies {g:.2f} GB/s while pread {r:.2f} GB/s")

    fd = os.open(path, os.O_RDWR)
    mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    t0 = time.perf_counter()
    cp.cuda.runtime.hostRegister(addr, size, 8)  # cudaHostRegisterReadOnly
    print(f"registering the mapped file ({size >> 20} MiB, read-only): {time.perf_counter() - t0:.3f} s")
    for piece in (PIECE, 6 * PIECE):
        print(f"host->device {piece >> 20} MiB copies straight from the file's pages: {copies(addr, size, piece):.2f} GB/s")
    cp.cuda.runtime.hostUnregister(addr)
    t0, moved = time.perf_counter(), 0
    while time.perf_counter() - t0 < 1:  # registering per piece instead
        a = addr + moved % size
        cp.cuda.runtime.hostRegister(a, PIECE, 8)
        cp.cuda.runtime.memcpy(dev.ptr, a, PIECE, 1)
        cp.cuda.runtime.hostUnregister(a)
        moved += PIECE
    print(f"register + copy + unregister per 2 MiB piece, one thread: {moved / (time.perf_counter() - t0) / 1e9:.2f} GB/s")


if __name__ == "__main__":
    sys.exit(main())
