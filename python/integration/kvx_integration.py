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


#: The attention kinds of the model-family matrix (`ModelFamily`): full attention with
#: grouped KV heads, MLA (one latent, the same on every TP rank), sliding window, and the
#: hybrids vLLM serves as KV cache groups of their own: sliding window (Gemma), chunked
#: local attention (Llama 4) and Mamba (Jamba, Granite 4) beside full attention.
FAMILIES = ("gqa", "mla", "sliding", "hybrid-sliding", "hybrid-chunked", "hybrid-mamba")


class ModelFamily:
    """A four-layer model of attention kind `kind` (one of `FAMILIES`) served with tensor
    parallelism `tp`, laid out as vLLM lays it out: its layers' KV cache specs are vLLM's
    own classes, vLLM's planner groups them and places them in one buffer per rank, and
    vLLM's offloading connector builds the offloading config from them. `vllm_config` is
    the part of vLLM's config those calls read. `dtype` is the KV cache dtype ("auto":
    the model's bfloat16), `layout` vLLM's KV cache layout (a `KVCacheLayout` name)."""

    LAYERS = 4
    TOTAL_KV_HEADS = 4
    KV_BYTES = 16 << 20  # of GPU memory per rank

    def __init__(self, kind, tp, extra, model="kvxfer/test-model", dtype="auto", events=False, layout="LBNHC"):
        import torch
        from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups, get_kv_cache_groups, kv_cache_groups_tp_replicas
        from vllm.v1.kv_cache_layout import KVCacheLayout

        assert kind in FAMILIES, kind
        self.kind, self.tp, self.extra, self.model, self.events = kind, tp, dict(extra), model, events
        self.cache_dtype = dtype
        self.layout = KVCacheLayout[layout]
        self.dtype = torch.bfloat16 if dtype == "auto" else getattr(torch, {"fp8": "float8_e4m3fn"}.get(dtype, dtype))
        self.engine_id = f"kvxfer-{uuid.uuid4().hex[:12]}"
        vc = self.vllm_config(0)
        self.groups = get_kv_cache_groups(vc, self._specs())
        self.kv_cache_config = get_kv_cache_config_from_groups(vc, self.groups, self.KV_BYTES)
        self.kv_cache_config.kv_tp_replicas = kv_cache_groups_tp_replicas(self.groups, tp)

    def _specs(self):
        """Each layer's KV cache spec, as the model's attention layers make them for a
        rank: KV heads split over the ranks, MLA's latent whole on each."""
        import torch
        from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, FullAttentionSpec, MambaSpec, MLAAttentionSpec, SlidingWindowSpec

        heads = max(1, self.TOTAL_KV_HEADS // self.tp)
        attn = dict(block_size=16, num_kv_heads=heads, head_size=64, dtype=self.dtype)
        other = {
            "gqa": FullAttentionSpec(**attn),
            "mla": MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=self.dtype, max_tp_shards=1),
            "sliding": SlidingWindowSpec(**attn, sliding_window=64),
            "hybrid-sliding": SlidingWindowSpec(**attn, sliding_window=64),
            "hybrid-chunked": ChunkedLocalAttentionSpec(**attn, attention_chunk_size=64),
            "hybrid-mamba": MambaSpec(block_size=16, shapes=((4, 64 // self.tp), (8 // self.tp, 16)), dtypes=(self.dtype, torch.float32), mamba_cache_mode="align"),
        }[self.kind]
        first = other if self.kind in ("gqa", "mla", "sliding") else FullAttentionSpec(**attn)
        return {f"model.layers.{i}.attn": (first if i % 2 == 0 else other) for i in range(self.LAYERS)}

    def vllm_config(self, rank):
        """What vLLM's KV cache planner and offloading connector read of its config, for
        the worker of rank `rank` (0 in the scheduler)."""
        import torch
        from types import SimpleNamespace as ns

        layout = self.layout
        return ns(
            kv_transfer_config=ns(kv_connector_extra_config=self.extra, engine_id=self.engine_id),
            parallel_config=ns(
                tensor_parallel_size=self.tp, pipeline_parallel_size=1, prefill_context_parallel_size=1, decode_context_parallel_size=1,
                cp_kv_cache_interleave_size=1, world_size=self.tp, distributed_executor_backend="mp", nnodes_within_dp=1, rank=rank,
                data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
            ),
            cache_config=ns(
                block_size=16, prefix_match_unit=None, enable_prefix_caching=True, cache_dtype=self.cache_dtype, kv_cache_layout=layout.name,
                prefix_cache_retention_interval=None, num_gpu_blocks_override=None, get_resolved_kv_cache_layout=lambda: layout,
            ),
            scheduler_config=ns(disable_hybrid_kv_cache_manager=False),
            attention_config=ns(hisparse_config=None),
            model_config=ns(
                model=self.model, dtype=torch.bfloat16, max_model_len=4096, use_mla=self.kind == "mla", get_total_num_kv_heads=lambda: self.TOTAL_KV_HEADS
            ),
            kv_events_config=ns(enable_kv_cache_events=self.events),
            use_v2_model_runner=False,
        )

    def offloading_config(self, rank):
        """The `OffloadingConfig` vLLM's offloading connector builds for rank `rank`."""
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import build_offloading_config

        return build_offloading_config(self.vllm_config(rank), self.kv_cache_config)

    def group_ids(self):
        """The offloaded KV cache groups' ids, in vLLM's order."""
        return [g.group_id for g in self.offloading_config(0).groups]

    def kv_caches(self):
        """A rank's KV caches as vLLM's worker allocates them: one zeroed buffer, and a
        view of it per layer, by layer name."""
        import torch
        from vllm.v1.kv_cache_interface import create_kv_cache_views

        c = self.kv_cache_config
        raw = torch.zeros(c.kv_cache_tensors[0].size, dtype=torch.int8)
        spec_of = {n: g.kv_cache_spec for g in self.groups for n in g.layer_names}
        views = {}
        for t in c.kv_cache_tensors:
            views.update(zip(t.layers, create_kv_cache_views(raw, spec_of[t.layers[0]], c.num_blocks, self.layout, t)))
        return views
