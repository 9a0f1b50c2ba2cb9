"""kvxfer from Python: an engine on the default device (GPU 0, or the emulated device where
there is none), a host layout over a NumPy array and a disk layout; four blocks are written
to the file, read back through the device into four other host blocks, and compared.
Failures raise kvxfer.Error.

Run from the repository root, after `pip install ./python numpy`:
    python3 examples/python/transfer.py
"""

import os
import sys

import numpy as np

import kvxfer


def main(directory: str) -> int:
    cfg = kvxfer.LayoutConfig(num_blocks=8, num_layers=2, outer_dim=2, page_size=16, inner_dim=128, dtype_bytes=2)
    kv = np.zeros(cfg.base_bytes // 2, dtype=np.int16)  # the host memory: 2-byte elements, one contiguous array
    per_block = cfg.block_bytes // 2
    kv[: 4 * per_block] = np.arange(4 * per_block) * 7 + 1
    path = os.path.join(directory, "kvx-example-py.kv")
    # Closing the disk layout removes the file it created.
    with kvxfer.Engine(device="auto") as e, e.register(kv, cfg) as host, e.disk_layout(cfg, path) as disk, e.device_layout(cfg) as dev:
        e.submit(host, [0, 1, 2, 3], disk, [0, 1, 2, 3]).wait()  # host blocks 0-3 to the file's 0-3
        e.submit(disk, [0, 1, 2, 3], dev, [4, 5, 6, 7]).wait()  # the file's 0-3 to device blocks 4-7
        e.submit(dev, [4, 5, 6, 7], host, [4, 5, 6, 7]).wait()  # and to host blocks 4-7
    same = np.array_equal(kv[: 4 * per_block], kv[4 * per_block :])
    print(f"transfer.py ({kvxfer.version()}): 4 blocks to disk and back, {'every byte the same' if same else 'BYTES DIFFER'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "."))
