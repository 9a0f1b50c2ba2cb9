"""The GPU worker's data path of the offloading spec: vLLM's KV cache tensors registered
as kvxfer layouts, and GPU blocks moved to and from store slots through them. It imports
torch (where vLLM's tensors live; NumPy arrays stand in for CPU tensors) but not vLLM, so
it runs, and is tested, without vLLM.

vLLM hands a worker its KV caches as a list of tensors whose first dimension is the block
(`(num_blocks, ...)`, a page of `page_size_bytes` per block) and, for each KV cache group,
the tensors of its layers. One store block is one GPU block of one group: the group's
layers, a page each. Each group is one kvxfer layout of kind `layer_block_first` over
its tensors (one allocation per layer, block `b` of a layer at `b * page`), so blocks move
straight between GPU memory and the store's slots, with no copy in host memory between."""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

from ..buffers import _is_torch
from ..engine import Engine, Layout, LayoutConfig
from ..errors import Error, InvalidArgument, NotFound, Unsupported
from ..store import Store, StoreRequest


def block_geometry(pages: Sequence[int], groups: Sequence[Sequence[int]], num_blocks: int) -> LayoutConfig:
    """The one block geometry of every group: as many layers as the group has tensors, a
    page of bytes each. A store holds blocks of one geometry, so groups whose layer
    count or page size differ are refused."""
    shapes = {(len(g), pages[g[0]] if g else 0) for g in groups}
    if not groups or any(not g for g in groups):
        raise InvalidArgument("vLLM's KV caches list no tensor for a KV cache group; nothing to offload")
    per_group = {pages[i] for g in groups for i in g}
    if len(shapes) != 1 or len(per_group) != 1:
        raise Unsupported(
            "kvxfer's offloading spec keeps one block geometry per store, but the KV cache groups differ "
            f"(layers and page bytes per group: {[(len(g), sorted({pages[i] for i in g})) for g in groups]}); "
            "use vLLM's CPU offloading with the kvxfer tier for this model"
        )
    layers, page = shapes.pop()
    return LayoutConfig(num_blocks=num_blocks, num_layers=layers, outer_dim=1, page_size=1, inner_dim=page, dtype_bytes=1, kind="layer_block_first")


def as_pages(tensor: Any, page_size_bytes: int) -> Any:
    """`tensor` (first dimension the block) as `(num_blocks, page_size_bytes)` bytes, a
    view of the same memory."""
    if not _is_torch(tensor):
        import numpy as np

        return np.asarray(tensor).view(np.int8).reshape(-1, page_size_bytes)
    import torch

    return tensor.view(torch.int8).view(-1, page_size_bytes)


def _device(tensor: Any) -> Tuple[str, Optional[int]]:
    """Where `tensor` lives: ("cuda", ordinal), or ("cpu", None) (NumPy arrays too)."""
    if not _is_torch(tensor):
        return ("cpu", None)
    d = tensor.device
    if d.type == "cuda":
        import torch

        return ("cuda", d.index if d.index is not None else torch.cuda.current_device())
    return (d.type, None)


def engine_for(tensors: Sequence[Any], settings: Optional[dict] = None) -> Engine:
    """An engine on the tensors' CUDA device, or on the emulated device for CPU tensors
    (which then stand in for GPU caches)."""
    devices = {_device(t) for t in tensors}
    if len(devices) != 1:
        raise InvalidArgument(f"vLLM's KV cache tensors are on several devices ({sorted(map(str, devices))}); a worker's caches are on one")
    kind, index = devices.pop()
    if kind == "cuda":
        return Engine(index, **(settings or {}))
    if kind == "cpu":
        return Engine("emulated", **(settings or {}))
    raise Unsupported(f"vLLM's KV caches are on {kind}; kvxfer moves CUDA tensors (or CPU tensors on its emulated device)")


class SlotJob:
    """One vLLM job's store requests (a job's blocks may span several groups, one layout
    each): done when all are, with a result per block of the job."""

    def __init__(self, size: int, requests: List[Tuple[StoreRequest, List[int]]], failed: List[Tuple[int, Error]]):
        self._size = size
        self._requests = requests
        self._failed = failed

    def done(self) -> bool:
        return all(r.done() for r, _ in self._requests)

    def wait(self) -> None:
        for r, _ in self._requests:
            r.wait()

    def results(self) -> List[Optional[Error]]:
        """Per block of the job: None (moved, or nothing for this worker to move) or why
        not. Waits for the requests, then releases them."""
        out: List[Optional[Error]] = [None] * self._size
        for i, e in self._failed:
            out[i] = e
        for r, positions in self._requests:
            for i, e in zip(positions, r.results()):
                out[i] = e
            r.release()
        self._requests = []
        return out


class SlotMover:
    """A worker's KV caches as kvxfer layouts, one per KV cache group, and the moves
    between their blocks and store slots. `tensors` are `(tensor, page_size_bytes)` pairs,
    each tensor's first dimension the block (vLLM's `CanonicalKVCaches.tensors`);
    `groups` lists each group's tensor indices, in layer order (its
    `group_data_refs`)."""

    def __init__(self, engine: Engine, tensors: Sequence[Tuple[Any, int]], groups: Sequence[Sequence[int]]):
        pages = [as_pages(t, p) for t, p in tensors]
        num_blocks = min(p.shape[0] for p in pages) if pages else 0
        self.geometry = block_geometry([p.shape[1] for p in pages], groups, num_blocks)
        self._cuda = _device(pages[0])[0] == "cuda"
        self._layouts: List[Layout] = []
        try:
            for g in groups:
                self._layouts.append(engine.register([pages[i][:num_blocks] for i in g], self.geometry))
        except BaseException:
            self.close()
            raise

    @property
    def block_bytes(self) -> int:
        return self.geometry.block_bytes

    def write(self, store: Store, block_ids: Sequence[int], group_sizes: Sequence[int], handles: Sequence[Any]) -> SlotJob:
        """Writes GPU block `block_ids[i]` to the slot of write handle `handles[i]`; the
        blocks are in group order, `group_sizes[g]` of group `g`. A None handle is a
        block this store holds already: nothing to write."""
        return self._move(store, block_ids, group_sizes, handles, False)

    def read(self, store: Store, handles: Sequence[Any], block_ids: Sequence[int], group_sizes: Sequence[int], critical: bool = False) -> SlotJob:
        """Reads the slot of read handle `handles[i]` into GPU block `block_ids[i]`; a
        None handle (a key this store did not hold when the owner leased it) fails that
        block with `NotFound`. `critical`: latency-critical reads (a request waits for
        them), served ahead of bulk transfers (`Engine.submit`'s `critical`)."""
        return self._move(store, block_ids, group_sizes, handles, True, critical)

    def _move(self, store: Store, block_ids: Sequence[int], group_sizes: Sequence[int], handles: Sequence[Any], is_read: bool, critical: bool = False) -> SlotJob:
        ids = [int(b) for b in block_ids]
        if len(ids) != len(handles) or sum(group_sizes) != len(ids) or len(group_sizes) != len(self._layouts):
            raise InvalidArgument(
                f"a job of {len(ids)} GPU blocks in {len(group_sizes)} groups (sizes {list(group_sizes)}) with {len(handles)} slot handles; "
                f"expected one handle per block and one size per KV cache group ({len(self._layouts)})"
            )
        # The blocks are read or written by the model's stream: a store must see the KV it
        # computed, a load must land after the writes queued to its blocks. The copies wait
        # for an event recorded on that stream, on the device: the host does not wait.
        ready = None
        if self._cuda:
            import torch

            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream())
        requests: List[Tuple[StoreRequest, List[int]]] = []
        failed: List[Tuple[int, Error]] = []
        start = 0
        try:
            for layout, size in zip(self._layouts, group_sizes):
                positions = [i for i in range(start, start + size) if handles[i] is not None]
                failed += [(i, NotFound(f"no slot of this rank's store held the key of block {ids[i]} when it was leased; it loads on no rank")) for i in range(start, start + size) if is_read and handles[i] is None]
                start += size
                if not positions:
                    continue
                hs = [handles[i] for i in positions]
                gpu = [ids[i] for i in positions]
                r = store.read_slots(hs, layout, gpu, critical=critical, wait_event=ready) if is_read else store.write_slots(layout, gpu, hs, wait_event=ready)
                requests.append((r, positions))
        except BaseException:
            for r, _ in requests:
                r.wait()
                r.release()
            raise
        return SlotJob(len(ids), requests, failed)

    def close(self) -> None:
        for layout in self._layouts:
            layout.close()
        self._layouts = []
