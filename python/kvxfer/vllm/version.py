"""The vLLM versions kvxfer.vllm implements, the check that refuses another, and what of
their offloading interfaces differs between them (kept here, and only here).

Between vLLM 0.33.0 and 0.34.0 the one difference the plug-ins meet is what an
`OffloadingWorker`'s `submit_store` and `submit_load` get for the GPU side of a job:
0.33.0 passes a `GPULoadStoreSpec` (block ids, in KV cache group order, and each group's
count), 0.34.0 the `DevicePointers` vLLM resolves from it against the worker's KV caches
(a pointer per block and layer of each group). `JobBlocks` turns either into block ids.
The tiering interface (`SecondaryTierManager`, `JobResult`) and the manager's
(`OffloadingManager`) differ only by what kvxfer leaves out (`touch`, gone in 0.34.0;
`JobResult.deferred_release`, new in 0.34.0 and optional). 0.34.0's `OffloadingEvent` also
names the request a stored block came from (`req_context`, for self-describing KV
events); 0.33.0's has no such field (`event_request`)."""

from __future__ import annotations

from dataclasses import fields
from typing import Any, Dict, List, Sequence, Tuple

from ..errors import InvalidArgument
from ..tier import check_version

#: The vLLM versions whose offloading interfaces kvxfer.vllm implements, each tested by
#: `make integration-test` (docs/vllm.md says how a new one is added).
SUPPORTED_VLLM = ("0.33.0", "0.34.0")


def check_vllm_version() -> str:
    """The installed vLLM's version; raises `Unsupported` naming the supported ones when
    it is another (or when vLLM is not installed)."""
    return check_version("kvxfer.vllm", "vllm", "vLLM", SUPPORTED_VLLM, "offloading interfaces")


def event_request(event_cls: type, context: Any) -> Dict[str, Any]:
    """The fields of an `OffloadingEvent` (`event_cls`) that name the request `context`
    a stored block came from: `req_context` where the installed vLLM has it and a
    request is known, none otherwise."""
    if context is None or "req_context" not in {f.name for f in fields(event_cls)}:
        return {}
    return {"req_context": context}


def _extent(pages: Any) -> Tuple[int, int, int]:
    """A `(num_blocks, page)` torch tensor's or NumPy array's address, bytes from one
    block to the next, and blocks."""
    if hasattr(pages, "data_ptr"):
        return int(pages.data_ptr()), int(pages.stride(0)) * pages.element_size(), int(pages.shape[0])
    return int(pages.ctypes.data), int(pages.strides[0]), int(pages.shape[0])


class JobBlocks:
    """The GPU blocks of a worker's jobs, from what vLLM passes for them. `pages` are the
    worker's KV tensors as `(num_blocks, page_size_bytes)` byte views, `groups` each KV
    cache group's tensor indices (vLLM's `group_data_refs`, in its order)."""

    def __init__(self, pages: Sequence[Any], groups: Sequence[Sequence[int]]):
        #: Per tensor: its address, bytes from one block to the next, and its blocks.
        self._tensors = [_extent(p) for p in pages]
        self._groups = [list(g) for g in groups]

    def __call__(self, device: Any) -> Tuple[List[int], List[int]]:
        """`(block_ids, group_sizes)`: the job's GPU block ids in group order and how many
        are of each group, from a `GPULoadStoreSpec` (vLLM 0.33.0) or from `DevicePointers`
        (vLLM 0.34.0), whose pointers must each be the start of a block of the tensor
        they stand for, the same block for every layer of a group."""
        if not hasattr(device, "ptrs"):
            return [int(b) for b in device.block_ids], [int(n) for n in device.group_sizes]
        import numpy as np

        ptrs = np.asarray(device.ptrs, dtype=np.uint64).astype(np.int64)
        counts = [int(n) for n in device.group_block_counts]
        refs = [int(n) for n in device.group_data_ref_counts]
        if len(counts) != len(self._groups) or any(n and r != len(g) for n, r, g in zip(counts, refs, self._groups)) or len(ptrs) != sum(n * r for n, r in zip(counts, refs)):
            raise InvalidArgument(
                f"a job's device pointers cover {len(counts)} KV cache groups of {refs} layers ({len(ptrs)} pointers); "
                f"this worker registered {len(self._groups)} groups of {[len(g) for g in self._groups]} layers"
            )
        ids: List[int] = []
        at = 0
        for n, group in zip(counts, self._groups):
            if not n:
                continue
            blocks = None
            for i in group:
                base, stride, rows = self._tensors[i]
                offsets = ptrs[at : at + n] - base
                at += n
                mine = offsets // stride
                if (offsets % stride).any() or (mine < 0).any() or (mine >= rows).any() or (blocks is not None and (mine != blocks).any()):
                    raise InvalidArgument(f"a job's device pointers for KV tensor {i} are not the starts of its blocks, the same for each layer of the group; this worker moves whole blocks of its registered KV caches")
                blocks = mine
            ids += [int(b) for b in blocks]  # type: ignore[union-attr]
        return ids, counts
