"""What a plug-in's stores hold, as far as the plug-in has seen: the source of a
runtime's KV events (a block stored, a block removed), so that a KV-aware router counts
the blocks a kvxfer tier holds, and only those.

A block is held where every store of a group holds its key (the group is a store per
rank; a tier has one). The plug-in tells `Holdings` what its own calls did (a commit, a
hit it met, a removal, an entry a call touched); what the stores do on their own, it
finds out: a store evicts least recently used entries when a put or a reservation needs
room, and drops an entry that fails its check on a get, and no call names those keys. So
after each call that may have done either, `reconcile` reads the store's counters and
looks up the known keys from the least recently used on (a lookup touches nothing) until
it has found as many gone as the counters say.

A store over a shared tier answers a lookup for the shared tier too (for the keys past its
local leading hits), so there a key is looked for in the store itself by leasing it and
giving the lease back at once (leases cover local hits only; a lease makes the entry the
most recently used, which `Holdings` follows). A get of a key the store misses loads it
from the shared tier and, where the tier admits, puts it into the store on a background
thread after the get has ended: the plug-in names such keys (`loading`), and `admitted`
reports each once the store holds it.

A store reopened after a restart holds entries no call of this process has met. Such an
entry is reported once a call meets it (a hit, a put or a reservation of its key). Every
call that touches an entry meets it first, so the entries not met are older than every
other entry, and a store's evictions take them first: `reconcile` counts those off before
it looks for known keys.

Not thread-safe: the plug-ins call it from the runtime's scheduler, under its lock."""

from __future__ import annotations

from collections import OrderedDict
from itertools import chain, islice
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from . import _native as n
from .store import Store

#: At most this many keys wait to be found admitted (a key whose admission failed, say
#: for want of room, would wait for ever): past it the oldest are given up, unreported.
PENDING_ADMISSIONS = 1024

#: One event: (removed, the runtime's key, the context it came with or None).
Event = Tuple[bool, Any, Any]


def need_holdings() -> None:
    """Refuses, with `Unsupported`, a library without lease tokens (ABI 1.6), which
    `Holdings` meets entries with."""
    n.need_minor(6, "the runtimes' KV events")


class Holdings:
    """The keys `stores` hold as far as this process has seen. Keys are given as pairs
    of the store key and the runtime's key (what the events name)."""

    def __init__(self, stores: Sequence[Store]):
        need_holdings()
        self._stores = list(stores)
        self._all = (1 << len(self._stores)) - 1
        #: Store key -> mask of the stores known to hold it, least recently used first.
        self._known: "OrderedDict[bytes, int]" = OrderedDict()
        #: Store key -> the runtime's key, where the two differ (a long key's digest).
        self._names: Dict[bytes, Any] = {}
        counters = [st.stats() for st in self._stores]
        #: Each store's evictions and failed checks already accounted for.
        self._seen = [(c.evictions, c.integrity_failures) for c in counters]
        #: Each store's entries that no call of this process has met (held at its open).
        self._unmet = [c.entries for c in counters]
        self._events: List[Event] = []
        #: (rank, store key) -> (the runtime's key, context): keys loaded from the shared
        #: tier, not yet found admitted into the store; the oldest first.
        self._admitting: "OrderedDict[Tuple[int, bytes], Tuple[Any, Any]]" = OrderedDict()

    def holds(self, skey: bytes) -> bool:
        """Whether the block of `skey` is reported held (every store holds it)."""
        return self._known.get(skey, 0) == self._all

    def knows(self, rank: int, skey: bytes) -> bool:
        """Whether store `rank` is known to hold `skey`."""
        return bool(self._known.get(skey, 0) & (1 << rank))

    def committed(self, rank: int, pairs: Iterable[Tuple[bytes, Any]], context: Any = None) -> None:
        """Store `rank` committed these keys (new entries, the most recently used)."""
        for skey, key in pairs:
            self._add(rank, skey, key, context)

    def met(self, rank: int, pairs: Iterable[Tuple[bytes, Any]], context: Any = None) -> None:
        """A call found these keys held by store `rank` and touched them (a hit, a put
        or a reservation of a held key): one not known there is an entry from before
        this process, now met."""
        for skey, key in pairs:
            if not self.knows(rank, skey):
                self._unmet[rank] = max(self._unmet[rank] - 1, 0)
            self._add(rank, skey, key, context)

    def found(self, rank: int, pairs: Iterable[Tuple[bytes, Any]], context: Any = None) -> None:
        """A lookup (which touches nothing) found these keys held by store `rank`: each
        not known there is touched (leased and given back at once), so that it leaves
        the entries not met, and met."""
        new = [(skey, key) for skey, key in pairs if not self.knows(rank, skey)]
        if not new:
            return
        st = self._stores[rank]
        leases, _ = st.lease([skey for skey, _ in new])
        st.release(leases)
        self.met(rank, [p for p, lease in zip(new, leases) if lease is not None], context)

    def held(self, rank: int, skeys: Sequence[bytes]) -> List[bool]:
        """Which of `skeys` store `rank` itself holds (not its shared tier). Over a shared
        tier, a key held is leased and given back, which makes it the most recently used,
        as the caller is to record (`touched`)."""
        st = self._stores[rank]
        if not skeys:
            return []
        if st.shared is None:
            return st.lookup(skeys)[0]
        leases, _ = st.lease(skeys)
        st.release(leases)
        return [lease is not None for lease in leases]

    def loading(self, rank: int, pairs: Iterable[Tuple[bytes, Any]], context: Any = None) -> None:
        """A get of store `rank` loaded these keys from its shared tier (the store did not
        hold them at its submit), which admits them into the store after the get: each
        is reported once `admitted` finds it there."""
        for skey, key in pairs:
            self._admitting[(rank, skey)] = (key, context)
            self._admitting.move_to_end((rank, skey))
        while len(self._admitting) > PENDING_ADMISSIONS:
            self._admitting.popitem(last=False)

    def admitted(self) -> None:
        """Reports the keys of `loading` each store now holds (admitted, the newest
        entries), after accounting for what the admissions evicted (`reconcile`). A key
        not held yet is looked for again at the next call."""
        if not self._admitting:
            return
        self.reconcile()
        for rank in range(len(self._stores)):
            waiting = [(skey, v) for (r, skey), v in self._admitting.items() if r == rank]
            if not waiting:
                continue
            present = self.held(rank, [skey for skey, _ in waiting])
            for (skey, (key, context)), p in zip(waiting, present):
                if p or self.knows(rank, skey):
                    del self._admitting[(rank, skey)]
                if p:
                    self._add(rank, skey, key, context)

    def touched(self, skeys: Iterable[bytes]) -> None:
        """The stores made these keys their most recently used (a get, a lease)."""
        for skey in skeys:
            if skey in self._known:
                self._known.move_to_end(skey)

    def removed(self, rank: int, skeys: Sequence[bytes], errors: Sequence[Optional[BaseException]]) -> None:
        """Store `rank`'s `remove(skeys)` returned `errors` (None: removed)."""
        for skey, err in zip(skeys, errors):
            if err is not None:
                continue
            if self.knows(rank, skey):
                self._drop(rank, skey)
            else:
                self._unmet[rank] = max(self._unmet[rank] - 1, 0)

    def reconcile(self, suspects: Iterable[bytes] = ()) -> None:
        """Finds the known keys each store evicted or dropped since the last call: its
        evictions take the entries not met first, then known keys; the rest, and its
        failed checks, are looked for among its known keys, `suspects` (keys whose get
        failed) first, then least recently used first."""
        suspects = list(dict.fromkeys(suspects))
        for rank, st in enumerate(self._stores):
            c = st.stats()
            evicted = c.evictions - self._seen[rank][0]
            failed = c.integrity_failures - self._seen[rank][1]
            self._seen[rank] = (c.evictions, c.integrity_failures)
            unmet = min(evicted, self._unmet[rank])
            self._unmet[rank] -= unmet
            if evicted - unmet + failed > 0:
                self._find_gone(rank, evicted - unmet + failed, suspects)

    def drop_all(self) -> List[Event]:
        """Every held block reported removed (the stores are given up, as by a reset),
        and the events not yet taken with them; nothing is known afterwards."""
        for skey, mask in self._known.items():
            if mask == self._all:
                self._events.append((True, self._names.get(skey, skey), None))
        self._known.clear()
        self._names.clear()
        return self.take()

    def take(self) -> List[Event]:
        """The events since the last call, in order."""
        out, self._events = self._events, []
        return out

    # -- inside -------------------------------------------------------------------------
    def _add(self, rank: int, skey: bytes, key: Any, context: Any) -> None:
        was = self._known.get(skey)
        if was is None:
            was = 0
            if key != skey:
                self._names[skey] = key
        else:
            self._known.move_to_end(skey)
        now = self._known[skey] = was | (1 << rank)
        if now == self._all and was != self._all:
            self._events.append((False, key, context))

    def _drop(self, rank: int, skey: bytes) -> None:
        was = self._known[skey]
        if was == self._all:
            self._events.append((True, self._names.get(skey, skey), None))
        if was & ~(1 << rank):
            self._known[skey] = was & ~(1 << rank)
        else:
            del self._known[skey]
            self._names.pop(skey, None)

    def _find_gone(self, rank: int, count: int, suspects: Sequence[bytes]) -> None:
        """Looks up store `rank`'s known keys, `suspects` first, then least recently used
        first, in growing batches, until `count` are gone or none is left to look at."""
        bit = 1 << rank
        first = {k: None for k in suspects if self.knows(rank, k)}
        candidates = chain(first, (k for k, mask in self._known.items() if mask & bit and k not in first))
        gone: List[bytes] = []
        kept: List[bytes] = []
        batch = count + 8
        while len(gone) < count:
            keys = list(islice(candidates, batch))
            if not keys:
                break
            present = self.held(rank, keys)
            gone += [k for k, p in zip(keys, present) if not p]
            kept += [k for k, p in zip(keys, present) if p]
            batch *= 2
        for skey in gone:
            self._drop(rank, skey)
        if self._stores[rank].shared is not None:
            self.touched(kept)  # leased by `held`: now the most recently used
