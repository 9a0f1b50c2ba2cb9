"""vLLM-shaped onboarding from PyTorch: per-layer device tensors `[2, num_blocks, 16, 8,
128]` bf16 (kvxfer's layer_outer_first), a disk tier (a file, hot on /dev/shm for the
pipeline's speed), random block ids in requests of 32, all submitted at once.

    python3 python/examples/torch_onboard.py --dir /dev/shm --num-blocks 2048

Checks a device -> disk -> device round trip byte for byte first, then prints one line of
GB/s (JSON with --json) for comparison with `./cpp_examples/bench` on the same shape:
`--layout layer-outer-first --num-layers 32 --outer-dim 2 --page-size 16 --inner-dim 1024
--num-blocks N --blocks-per-batch 32 --random-blocks --direction disk-to-device --buffered`.
"""

import argparse
import json
import os
import time

import torch

import kvxfer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/dev/shm")
    ap.add_argument("--num-blocks", type=int, default=2048)
    ap.add_argument("--num-layers", type=int, default=32)
    ap.add_argument("--per-request", type=int, default=32)
    ap.add_argument("--iterations", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()

    heads, head_dim, page = 8, 128, 16
    cfg = kvxfer.LayoutConfig(
        kind="layer_outer_first", num_blocks=a.num_blocks, num_layers=a.num_layers, outer_dim=2,
        page_size=page, inner_dim=heads * head_dim, dtype_bytes=2,
    )
    shape = (2, a.num_blocks, page, heads, head_dim)
    kv = [torch.randn(shape, dtype=torch.bfloat16, device="cuda") for _ in range(a.num_layers)]
    back = [torch.zeros(shape, dtype=torch.bfloat16, device="cuda") for _ in range(a.num_layers)]
    path = os.path.join(a.dir, f"kvxfer-torch-{os.getpid()}.kv")
    with kvxfer.Engine(device=torch.cuda.current_device()) as e:
        dev, dev_back = e.register(kv, cfg), e.register(back, cfg)
        disk = e.disk_layout(cfg, path, buffered=True)
        ids = torch.randperm(a.num_blocks)
        ev = torch.cuda.Event()
        ev.record()  # the tensors' initialisation, which the offload must wait for
        e.submit(dev, ids, disk, torch.arange(a.num_blocks), wait_event=ev).wait()
        e.submit(disk, torch.arange(a.num_blocks), dev_back, ids).wait()
        torch.cuda.synchronize()
        exact = all(torch.equal(x.view(torch.int16), y.view(torch.int16)) for x, y in zip(kv, back))
        if not exact:
            raise SystemExit("torch_onboard: ROUND TRIP FAILED: device tensors differ after device -> disk -> device")

        # Onboarding: the file's blocks into shuffled device blocks, requests of 32 at once.
        order = torch.randperm(a.num_blocks, generator=torch.Generator().manual_seed(7)).numpy()
        batches = [order[i : i + a.per_request] for i in range(0, a.num_blocks, a.per_request)]
        seconds = 0.0
        for it in range(a.iterations + 1):
            t0 = time.perf_counter()
            reqs = [e.submit(disk, b, dev_back, b) for b in batches]
            for r in reqs:
                r.wait()
            if it:  # the first pass warms up; the others are summed, as the bench does
                seconds += time.perf_counter() - t0
        best = a.iterations * a.num_blocks * cfg.block_bytes / seconds / 1e9
        disk.close()
    result = {"system": "kvxfer-python", "gbps": round(best, 3), "num_blocks": a.num_blocks, "per_request": a.per_request,
              "block_bytes": cfg.block_bytes, "round_trip_exact": exact}
    print(json.dumps(result) if a.json else f"torch onboard: round trip exact; {best:.2f} GB/s disk -> device, "
          f"{a.num_blocks} blocks of {cfg.block_bytes / 1e6:.2f} MB in requests of {a.per_request}")


if __name__ == "__main__":
    main()
