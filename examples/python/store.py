"""The store from Python: four blocks of a NumPy array are put under their keys (a
runtime's prefix hashes), looked up, loaded by key into four others, compared, removed.
Run: pip install ./python numpy && python3 examples/python/store.py"""

import sys

import numpy as np

import kvxfer

cfg = kvxfer.LayoutConfig(num_blocks=8, num_layers=2, outer_dim=2, page_size=16, inner_dim=128, dtype_bytes=2)
kv = np.zeros(cfg.base_bytes // 2, dtype=np.int16)  # the 8 blocks' host memory
half = 4 * cfg.block_bytes // 2
kv[:half] = np.arange(half) * 7 + 1
keys = [b"hash-a", b"hash-b", b"hash-c", b"hash-d"]
with kvxfer.Engine() as e, e.register(kv, cfg) as host, kvxfer.Store(
    e, "kvx-example-store-py", cfg, capacity_blocks=64, namespace=b"example-model bf16 tp0/1 page16"
) as store:
    store.put(host, [0, 1, 2, 3], keys).wait()  # host blocks 0-3 under the four keys
    present, hits = store.lookup(keys, lease=True)  # leased until loaded
    r = store.get(keys[:hits], host, [4, 5, 6, 7][:hits])
    r.wait()  # raises the first key that did not load (NotFound, IntegrityError, ...)
    removed = store.remove(keys)
    left = store.stats().entries
same = hits == 4 and np.array_equal(kv[:half], kv[half:])
print(f"store.py: {hits} of 4 keys held, {'every byte the same' if same else 'BYTES DIFFER'}; {left} entries left")
sys.exit(0 if same else 1)
