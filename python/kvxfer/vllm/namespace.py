"""What names a vLLM block in a kvxfer store: the fingerprint of everything that makes
equal vLLM keys name different bytes, and the namespace and directory made from it. Keys,
digests and namespaces themselves are `kvxfer.tier`'s, as for every runtime. Shared by the
tier and the offloading spec; needs no vLLM."""

from __future__ import annotations

import os
from typing import Any, Dict

from .. import tier


def fingerprint(offloading_spec: Any, chunk_bytes: int, extra: str = "", layout_format: str = "kvxfer.vllm tier 1") -> Dict[str, Any]:
    """What makes equal vLLM keys name different bytes, from the `OffloadingSpec` vLLM
    passes: model, KV dtype, tokens per hash and per chunk, the KV cache groups, the
    parallel layout (a chunk of the CPU tier holds every worker's part, in rank order),
    the byte layout and the chunk size; plus `extra` (the `namespace` setting, for what
    vLLM does not say, such as a weights revision) and `layout_format` (how the caller
    lays a chunk out: a change to it changes every namespace). The data-parallel index
    is not in it: replicas of one model hold the same bytes under the same keys."""
    c = offloading_spec.config
    p = c.parallel
    return {
        "format": layout_format,
        "model": c.model.name,
        "dtype": str(c.model.dtype),
        "tokens_per_hash": c.cache.tokens_per_hash,
        "blocks_per_chunk": c.cache.blocks_per_chunk,
        "groups": [{"tokens_per_block": g.tokens_per_block, "layers": list(g.layer_names)} for g in c.groups],
        "world_size": p.world_size,
        "tp": p.tp_size,
        "pp": p.pp_size,
        "pcp": p.pcp_size,
        "dcp": p.dcp_size,
        "worker_kv_bytes_per_block": c.worker_kv_bytes_per_block,
        "replicated_layout": bool(offloading_spec.replicated_layout),
        "canonical_layout": bool(c.canonical_layout),
        "kv_cache_layout": c.kv_cache_layout,
        "chunk_bytes": chunk_bytes,
        "extra": extra,
    }


def namespace_of(fields: Dict[str, Any]) -> bytes:
    """The store namespace of a fingerprint: `vllm` and its digest (`kvxfer.tier`)."""
    return tier.namespace_of("vllm", fields)


def store_directory(root_dir: str, fields: Dict[str, Any], namespace: bytes, dp_index: int, suffix: str = "") -> str:
    """`<root_dir>/<model>_<namespace digest prefix>_dp<k><suffix>`: a configuration of
    its own gets a store of its own, and each data-parallel engine (a scheduler process
    of its own; a store has one owner) its own directory."""
    model = str(fields["model"]).replace("/", "_")
    return os.path.join(root_dir, f"{model}_{namespace[5:17].decode()}_dp{dp_index}{suffix}")
