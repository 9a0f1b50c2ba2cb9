"""kvxfer's blocks as vLLM's KV events: what `Holdings` saw, as the `OffloadingEvent`s a
manager or tier hands vLLM from `take_events`. vLLM's offloading connector turns them
into `BlockStored` and `BlockRemoved` events of the given medium and publishes them with
the GPU's (`--kv-events-config`), where KV-aware routers count them."""

from __future__ import annotations

from typing import Any, List, Sequence

from ..holdings import Event
from .version import event_request


def offloading_events(event_cls: type, taken: Sequence[Event], **tier: Any) -> List[Any]:
    """`taken` as `event_cls` (vLLM's `OffloadingEvent`) events, in order: one event per
    run of stores or of removals (and of one request), each with the fields `tier`
    (`medium`, `locality`, `ownership`, `removal_expected`)."""
    runs: List[Any] = []
    for removed, key, context in taken:
        if runs and runs[-1][0] == removed and runs[-1][1] is context:
            runs[-1][2].append(key)
        else:
            runs.append((removed, context, [key]))
    return [event_cls(keys=keys, removed=removed, **tier, **event_request(event_cls, context)) for removed, context, keys in runs]
