"""An offloading handler shaped like the worker side of vLLM's offloading connector:
the scheduler hands it store and load jobs by block ids, and each step it reports which
jobs finished. kvxfer does the moving, between the GPU's KV cache and two tiers (pinned
host memory and a disk file); completions arrive through `on_complete`, so a step never
polls job by job.

    python3 python/examples/offload_connector.py            # emulated device, NumPy
    python3 python/examples/offload_connector.py --torch    # CUDA tensors (on a GPU)
"""

from __future__ import annotations

import argparse
import os
import queue
import tempfile
from typing import Dict, List, Sequence, Tuple

import kvxfer

Medium = str  # "gpu", "cpu" or "disk"


class KvxferOffloadingHandler:
    """Moves blocks between media for numbered jobs; `get_finished()` returns the jobs
    that ended since the last call, with whether they succeeded."""

    def __init__(self, engine: kvxfer.Engine, media: Dict[Medium, kvxfer.Layout]):
        self.engine = engine
        self.media = media
        self._done: "queue.SimpleQueue[Tuple[int, bool]]" = queue.SimpleQueue()
        self._running: Dict[int, kvxfer.Request] = {}

    def transfer_async(self, job_id: int, src: Tuple[Medium, Sequence[int]], dst: Tuple[Medium, Sequence[int]]) -> bool:
        """Starts moving `src` blocks to `dst` blocks; False if kvxfer refused the job
        (bad ids, engine busy), which the scheduler then retries or drops."""
        (sm, sids), (dm, dids) = src, dst

        def finished(_req: kvxfer.Request, err: "kvxfer.Error | None", job: int = job_id) -> None:
            self._done.put((job, err is None))

        try:
            self._running[job_id] = self.engine.submit(self.media[sm], sids, self.media[dm], dids, on_complete=finished)
        except kvxfer.Error as e:
            print(f"job {job_id} refused: {e}")
            return False
        return True

    def get_finished(self) -> List[Tuple[int, bool]]:
        out = []
        while True:
            try:
                job, ok = self._done.get_nowait()
            except queue.Empty:
                return out
            self._running.pop(job).release()
            out.append((job, ok))

    def wait_all(self) -> List[Tuple[int, bool]]:
        for r in list(self._running.values()):
            try:
                r.wait()
            except kvxfer.Error:
                pass
        return self.get_finished()


def run(use_torch: bool, num_blocks: int = 64, steps: int = 8, workdir: str | None = None) -> None:
    cfg = kvxfer.LayoutConfig(kind="layer_outer_first", num_blocks=num_blocks, num_layers=4, outer_dim=2, page_size=16,
                              inner_dim=8 * 64, dtype_bytes=2)
    shape = (2, num_blocks, 16, 8, 64)
    with tempfile.TemporaryDirectory(dir=workdir) as d, kvxfer.Engine(device="auto" if use_torch else "emulated") as engine:
        if use_torch:
            import torch

            kv = [torch.randn(shape, dtype=torch.float16, device="cuda") for _ in range(cfg.num_layers)]
            gpu = engine.register(kv, cfg)
            snapshot = [t.clone() for t in kv]
        else:
            gpu = engine.device_layout(cfg)  # the emulated device's memory
            import numpy as np

            fill = engine.host_layout(cfg)
            rng = np.random.default_rng(0)
            for layer in range(cfg.num_layers):
                view = (np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * cfg.base_bytes).from_address(fill.base(layer))))
                view[:] = rng.integers(0, 255, cfg.base_bytes, dtype=np.uint8)
            engine.submit(fill, range(num_blocks), gpu, range(num_blocks)).wait()
        cpu = engine.host_layout(cfg)
        disk = engine.disk_layout(cfg, os.path.join(d, "kv.bin"))
        handler = KvxferOffloadingHandler(engine, {"gpu": gpu, "cpu": cpu, "disk": disk})
        job, finished = 0, []
        # Decode steps: each offloads the 2 blocks just filled to CPU, and every other
        # step the CPU tier spills those to disk.
        for step in range(steps):
            blocks = [2 * step, 2 * step + 1]
            assert handler.transfer_async(job, ("gpu", blocks), ("cpu", blocks))
            job += 1
            if step % 2 == 1:
                finished += handler.wait_all()  # the spill reads what the stores wrote
                spill = list(range(2 * step - 2, 2 * step + 2))
                assert handler.transfer_async(job, ("cpu", spill), ("disk", spill))
                job += 1
            finished += handler.get_finished()
        finished += handler.wait_all()
        # A prefix hit: load the offloaded blocks back from disk into other GPU blocks.
        stored = list(range(2 * steps))
        target = [num_blocks - 1 - b for b in stored]
        assert handler.transfer_async(job, ("disk", stored), ("gpu", target))
        finished += handler.wait_all()
        assert len(finished) == job + 1 and all(ok for _, ok in finished), finished
        # A job the engine refuses comes back False, not as an exception.
        assert not handler.transfer_async(job + 1, ("disk", [num_blocks]), ("gpu", [0]))
        if use_torch:
            torch.cuda.synchronize()
            for t, s in zip(kv, snapshot):
                assert torch.equal(t[:, target], s[:, stored]), "a loaded block differs from the one stored"
        else:
            # What came back into the target blocks is what was first in the stored ones.
            import ctypes

            ref, got = engine.host_layout(cfg), engine.host_layout(cfg)
            engine.submit(fill, stored, ref, stored).wait()
            engine.submit(gpu, target, got, stored).wait()
            for layer in range(cfg.num_layers):
                assert ctypes.string_at(ref.base(layer), cfg.base_bytes) == ctypes.string_at(got.base(layer), cfg.base_bytes)
        for layout in handler.media.values():
            layout.close()  # the disk tier's file goes with it, before its folder does
        print(f"offload connector: {len(finished)} jobs finished, all succeeded; loads of {len(stored)} blocks from disk")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--torch", action="store_true", help="CUDA tensors as the GPU tier")
    a = ap.parse_args()
    run(a.torch)


if __name__ == "__main__":
    main()
