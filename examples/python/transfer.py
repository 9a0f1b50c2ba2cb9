"""kvxfer from Python: four blocks of a NumPy array go to a file, come back through the device
(GPU 0, or the emulated one) into four others, compared; failures raise kvxfer.Error.
Run: pip install ./python numpy && python3 examples/python/transfer.py"""

import sys

import numpy as np

import kvxfer

cfg = kvxfer.LayoutConfig(num_blocks=8, num_layers=2, outer_dim=2, page_size=16, inner_dim=128, dtype_bytes=2)
kv = np.zeros(cfg.base_bytes // 2, dtype=np.int16)  # the 8 blocks' host memory: 2-byte elements
half = 4 * cfg.block_bytes // 2
kv[:half] = np.arange(half) * 7 + 1
with kvxfer.Engine() as e, e.register(kv, cfg) as host, e.disk_layout(cfg, "kvx-example-py.kv") as disk, e.device_layout(cfg) as dev:
    e.submit(host, [0, 1, 2, 3], disk, [0, 1, 2, 3]).wait()  # host 0-3 to the file
    e.submit(disk, [0, 1, 2, 3], dev, [4, 5, 6, 7]).wait()  # the file to device 4-7
    e.submit(dev, [4, 5, 6, 7], host, [4, 5, 6, 7]).wait()  # and to host 4-7
same = np.array_equal(kv[:half], kv[half:])
print(f"transfer.py: 4 blocks to disk and back, {'every byte the same' if same else 'BYTES DIFFER'}")
sys.exit(0 if same else 1)
