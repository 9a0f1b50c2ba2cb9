"""What the runtime plug-ins' integration tests and the vLLM tier bench share: a store's
data files damaged in place, a record of which store calls were latency-critical,
vLLM's tiering manager over one secondary tier, and what a KV-aware router learns from a
vLLM manager's KV events. vLLM is imported only by the last two."""

import contextlib
import os
import subprocess
import uuid


def flip_a_byte(directory, piece, past):
    """Flips the byte `past` bytes into each copy of `piece` in the data files of the
    store in `directory` (never its checksum sidecars), synced; whether any held one."""
    found = False
    for name in sorted(os.listdir(directory)):
        if not name.startswith("data-") or name.endswith(".kvxsum"):
            continue
        with open(os.path.join(directory, name), "r+b") as f:
            data = f.read()
            at = data.find(piece)
            while at >= 0:
                f.seek(at + past)
                f.write(bytes([data[at + past] ^ 0x40]))
                found = True
                at = data.find(piece, at + len(piece))
            f.flush()
            os.fsync(f.fileno())
    return found


@contextlib.contextmanager
def small_file_system(path, nbytes):
    """A tmpfs of `nbytes` mounted at `path` for the block, for a full disk; skips the
    test where this process may not mount one (it needs root)."""
    import pytest

    os.makedirs(path, exist_ok=True)
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={nbytes}", "tmpfs", str(path)], capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip(f"a full disk needs a small file system: mounting a tmpfs failed ({out.stderr.strip()}); run as root")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill_up(path):
    """Writes a file in `path` until its file system is full."""
    with open(os.path.join(path, "filler"), "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass


def record_criticality(monkeypatch, cls, methods):
    """Wraps each method of `cls` named in `methods` (name -> label) so that each call
    appends `(label, critical)` to the returned list."""
    calls = []

    def recording(label, f):
        def call(self, *args, **kwargs):
            calls.append((label, kwargs.get("critical", False)))
            return f(self, *args, **kwargs)

        return call

    for name, label in methods.items():
        monkeypatch.setattr(cls, name, recording(label, getattr(cls, name)))
    return calls


def tiering_manager(tier_config, chunk_bytes, cpu_bytes, model, events=False):
    """vLLM's `TieringOffloadingManager` as `TieringOffloadingSpec` builds it for a
    one-rank model of one layer, with a CPU tier of `cpu_bytes` and the one secondary
    tier `tier_config`; `events`: as where vLLM publishes KV events."""
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("model.layers.0.attn",), group_id=0),),
        worker_kv_bytes_per_block=chunk_bytes,
        enable_kv_cache_events=events,
        extra_config={"cpu_bytes_to_use": cpu_bytes, "secondary_tiers": [tier_config]},
        engine_id=f"kvxfer-{uuid.uuid4().hex[:12]}",
        model=OffloadingModelConfig(name=model, dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
            data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
            is_parallelism_agnostic=False,
        ),
    )
    return TieringOffloadingSpec(config).get_manager()


def block_of(key):
    """The block hash a KV event names for vLLM offload key `key`."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
    from vllm.v1.kv_offload.base import get_offload_block_hash

    return maybe_convert_block_hash(get_offload_block_hash(key))


class Published:
    """What a KV-aware router learns of `medium` from a vLLM offloading manager's events:
    vLLM's offloading connector turns `take_events` into `BlockStored` and `BlockRemoved`
    (`OffloadingEventsTracker`, as it publishes them), and a block is held from its
    store to its removal. A store of a block held, or a removal of one not held, fails."""

    def __init__(self, medium="STORAGE"):
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import OffloadingEventsTracker
        from vllm.v1.kv_offload.base import OffloadingKVEventsConfig

        self._tracker = OffloadingEventsTracker(OffloadingKVEventsConfig(enable_kv_cache_events=True, self_describing_kv_events=False))
        self.medium = medium
        self.blocks = set()

    def take(self, manager):
        """Takes the manager's events; returns the blocks held."""
        from vllm.distributed.kv_events import BlockRemoved, BlockStored

        with manager.lock:
            events = list(manager.take_events())
        for e in self._tracker.take_events(events):
            if e.medium != self.medium:
                continue
            hashes = set(e.block_hashes)
            if isinstance(e, BlockStored):
                assert not hashes & self.blocks, f"blocks reported stored while held: {hashes & self.blocks}"
                self.blocks |= hashes
            else:
                assert isinstance(e, BlockRemoved) and hashes <= self.blocks, f"blocks reported removed while not held: {hashes - self.blocks}"
                self.blocks -= hashes
        return self.blocks
