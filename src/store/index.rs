//! The in-memory index: key → entry, the slots' states and pins, the free list and
//! the least-recently-used order. One mutex holds it (`Store::index`); nothing here does
//! I/O, so the mutex is never held across a read, a write or a sync.
//!
//! A slot is `Free` (on the free list; its record is a tombstone), `Writing` (a put took
//! it; its record is a tombstone until the put commits), `Live` (an entry), or `Retired`
//! (its entry was removed, evicted or dropped, and it goes back to the free list once its
//! tombstone is written and nothing pins it). A pin is a get in flight or a lease; a
//! pinned slot is never evicted nor reused, so its bytes stay its key's. The eviction
//! order lists only live slots that nothing pins (a slot leaves it at its first pin and
//! comes back as the most recently used at its last unpin), so an eviction takes the
//! oldest listed slot at once, however many entries are leased.
//!
//! A lease belongs to its holder: it is a token, given back by that token alone, and it
//! pins the slot it was taken on (not whatever slot its key names later). Leases taken by
//! key (`lease_keyed`: the ABI's `KVX_LOOKUP_LEASE` and slot handles) are tokens the
//! index keeps for the key, oldest first, for callers that name only keys.

use super::config::{Digest, Key};
use super::record::Record;
use super::request::StoreRequest;
use std::collections::HashMap;
use std::sync::Arc;

/// A committed entry, as the index keeps it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Entry {
    pub slot: u32,
    pub generation: u64,
    /// Its block's seal when it was written, as its record holds it.
    pub seal: u64,
}

/// A lease held: the slot it pins, and whether it is kept for its key (taken by key) or
/// is its caller's own token.
#[derive(Debug)]
struct Leased {
    slot: u32,
    keyed: bool,
}

/// A lease token no other lease of this process has had, in any store or open: a token
/// kept past a reopen, or handed to another store, names no lease there.
fn next_lease_token() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// Keys of put requests waiting for another put of the same key to finish.
type Waiters = Vec<(Arc<StoreRequest>, usize)>;

#[derive(Debug)]
enum State {
    Free,
    /// `claimed`: a handed-out slot's commit or abort has begun (it settles once).
    Writing {
        key: Key,
        generation: u64,
        removed: bool,
        claimed: bool,
        waiters: Waiters,
    },
    Live(Key),
    Retired {
        recorded: bool,
    },
}

#[derive(Debug)]
struct Slot {
    state: State,
    pins: u32,
    /// Neighbours in the eviction order (live slots nothing pins; `NIL` at the ends).
    older: u32,
    newer: u32,
}

const NIL: u32 = u32::MAX;

/// Takes a key's own 64-bit hash (`Key`'s `Hash`, seeded) as it is: SipHash over it
/// again would be most of a lookup's time.
#[derive(Default)]
pub struct KeyHasher(u64);

impl std::hash::Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ b as u64;
        }
    }

    fn write_u64(&mut self, v: u64) {
        self.0 = v;
    }
}

type KeyMap<V> = HashMap<Key, V, std::hash::BuildHasherDefault<KeyHasher>>;

/// Where a put of one key goes.
#[derive(Debug, PartialEq, Eq)]
pub enum PutStart {
    /// Held already: nothing to write.
    Present,
    /// Another put of the key is in flight: this key gets that put's outcome.
    Joined,
    /// Write the block to `slot` under `generation`; first write the slot's tombstone
    /// where `evicted` (its record still names the evicted entry).
    Slot { slot: u32, generation: u64, evicted: bool },
    /// Full, and every entry is held by a get, a lease or a put in flight.
    NoRoom,
}

/// What a removal found.
#[derive(Debug, PartialEq, Eq)]
pub enum Removed {
    Absent,
    /// The entry is gone from the index; write `slot`'s tombstone, then `recorded(slot)`.
    Entry(u32),
    /// A put of the key was in flight: it will not commit.
    Writing,
}

#[derive(Debug)]
pub struct Index {
    entries: KeyMap<Entry>,
    /// The least and the most recently used live slots that nothing pins: the ends of the
    /// eviction order, a list through the slots' `older`/`newer`, so a use moves a slot
    /// and an eviction finds its victim in O(1).
    oldest: u32,
    newest: u32,
    slots: Vec<Slot>,
    free: Vec<u32>,
    /// Keys being put → their slot.
    writing: KeyMap<u32>,
    /// Every lease held: token → the slot it pins.
    leases: HashMap<u64, Leased>,
    /// Tokens of the leases taken by key, oldest first (a key removed and put again while
    /// leased may have leases on two slots).
    keyed: KeyMap<std::collections::VecDeque<u64>>,
    generation: u64,
    pub evictions: u64,
    /// Whether the eviction order changed since `take_moved` last looked.
    moved: bool,
    /// Slots found holding a record that no entry uses: their tombstones are written on
    /// open (then `recorded`), before any put may take them.
    pub stale: Vec<u32>,
}

impl Index {
    /// An index of `capacity` slots holding `found` (slot, record) entries, the most
    /// recently written (highest generation) last in the eviction order.
    pub fn new(capacity: u32, found: Vec<(u32, Record)>) -> Index {
        // The records in generation order, sorted as indices: a record is about 100 bytes,
        // and moving a million of them through a sort is most of an open's time.
        let mut by_generation: Vec<u32> = (0..found.len() as u32).collect();
        by_generation.sort_by_key(|&i| found[i as usize].1.generation);
        let mut ix = Index {
            entries: KeyMap::with_capacity_and_hasher(found.len(), Default::default()),
            oldest: NIL,
            newest: NIL,
            slots: (0..capacity).map(|_| Slot { state: State::Free, pins: 0, older: NIL, newer: NIL }).collect(),
            free: Vec::new(),
            writing: KeyMap::default(),
            leases: HashMap::new(),
            keyed: KeyMap::default(),
            generation: by_generation.last().map_or(0, |&i| found[i as usize].1.generation),
            evictions: 0,
            moved: false,
            stale: Vec::new(),
        };
        for i in by_generation {
            let (slot, r) = &found[i as usize];
            let slot = *slot;
            if let Some(old) = ix.entries.get(&r.key).copied() {
                // Two records of one key (only damage makes this: a key is written again
                // only after its entry is gone): keep the newest, retire the other.
                ix.unlink(old.slot);
                ix.slots[old.slot as usize].state = State::Retired { recorded: false };
                ix.stale.push(old.slot);
            }
            ix.insert(r.key, slot, r);
        }
        ix.free = (0..capacity).rev().filter(|&s| matches!(ix.slots[s as usize].state, State::Free)).collect();
        ix
    }

    fn insert(&mut self, key: Key, slot: u32, r: &Record) {
        let e = Entry { slot, generation: r.generation, seal: r.seal };
        self.entries.insert(key, e);
        self.slots[slot as usize].state = State::Live(key);
        self.link_newest(slot);
    }

    fn link_newest(&mut self, slot: u32) {
        self.moved = true;
        let newest = self.newest;
        let s = &mut self.slots[slot as usize];
        (s.older, s.newer) = (newest, NIL);
        match newest {
            NIL => self.oldest = slot,
            n => self.slots[n as usize].newer = slot,
        }
        self.newest = slot;
    }

    fn unlink(&mut self, slot: u32) {
        let (older, newer) = {
            let s = &mut self.slots[slot as usize];
            let links = (s.older, s.newer);
            (s.older, s.newer) = (NIL, NIL);
            links
        };
        match older {
            NIL => self.oldest = newer,
            o => self.slots[o as usize].newer = newer,
        }
        match newer {
            NIL => self.newest = older,
            n => self.slots[n as usize].older = older,
        }
    }

    fn touch(&mut self, key: Key) -> Option<Entry> {
        let e = *self.entries.get(&key)?;
        // A pinned slot is not listed; its last unpin lists it as the most recent.
        if self.slots[e.slot as usize].pins == 0 && self.newest != e.slot {
            self.unlink(e.slot);
            self.link_newest(e.slot);
        }
        Some(e)
    }

    /// Marks a held key as just used: whether it is held.
    pub fn touch_held(&mut self, key: Key) -> bool {
        self.touch(key).is_some()
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn contains(&self, key: Key) -> bool {
        self.entries.contains_key(&key)
    }

    /// Pins a held key's slot until its token is given back (`release`): its entry and
    /// the lease's token, if held.
    pub fn lease(&mut self, key: Key) -> Option<(Entry, u64)> {
        self.take_lease(key, false)
    }

    fn take_lease(&mut self, key: Key, keyed: bool) -> Option<(Entry, u64)> {
        let e = self.touch(key)?;
        self.pin_slot(e.slot);
        let token = next_lease_token();
        self.leases.insert(token, Leased { slot: e.slot, keyed });
        Some((e, token))
    }

    /// Gives back the lease of `token` from `lease`: whether it was held (a lease kept for
    /// a key is not its caller's to give back by token).
    pub fn release(&mut self, token: u64) -> bool {
        self.holds_lease(token) && self.drop_lease(token)
    }

    fn drop_lease(&mut self, token: u64) -> bool {
        let Some(l) = self.leases.remove(&token) else { return false };
        self.unpin(l.slot);
        true
    }

    /// Whether the lease of `token` from `lease` is held.
    pub fn holds_lease(&self, token: u64) -> bool {
        self.leases.get(&token).is_some_and(|l| !l.keyed)
    }

    /// A lease kept for `key` itself, for callers that name only keys: its entry, if held.
    pub fn lease_keyed(&mut self, key: Key) -> Option<Entry> {
        let (e, token) = self.take_lease(key, true)?;
        self.keyed.entry(key).or_default().push_back(token);
        Some(e)
    }

    /// Gives back the oldest lease kept for `key`, where it has one: whether it had.
    pub fn release_keyed(&mut self, key: Key) -> bool {
        self.spend_keyed(key, |_| true)
    }

    /// Gives back the oldest lease kept for `key` on `slot` (a get of the key loads that
    /// slot, and its own pin holds it from here): whether there was one.
    pub fn spend_keyed_on(&mut self, key: Key, slot: u32) -> bool {
        self.spend_keyed(key, |s| s == slot)
    }

    fn spend_keyed(&mut self, key: Key, on: impl Fn(u32) -> bool) -> bool {
        let Some(tokens) = self.keyed.get_mut(&key) else { return false };
        let leases = &self.leases;
        let Some(at) = tokens.iter().position(|t| leases.get(t).is_some_and(|l| on(l.slot))) else { return false };
        let token = tokens.remove(at).expect("a position in the list");
        if tokens.is_empty() {
            self.keyed.remove(&key);
        }
        self.drop_lease(token)
    }

    /// A slot whose record could not be brought back to a tombstone (an I/O error): out of
    /// use until the store is opened again, so no put writes under a record naming another key.
    /// The keys that joined a put of the slot, to be told it failed.
    pub fn abandon(&mut self, slot: u32) -> Waiters {
        match std::mem::replace(&mut self.slots[slot as usize].state, State::Retired { recorded: false }) {
            State::Writing { key, waiters, .. } => {
                self.end_writing(key, slot);
                waiters
            }
            _ => Vec::new(),
        }
    }

    /// Pins a held key's slot for a get; its entry, or `None` for a miss.
    pub fn pin(&mut self, key: Key) -> Option<Entry> {
        let e = self.touch(key)?;
        self.pin_slot(e.slot);
        Some(e)
    }

    /// Pins a live slot: at its first pin it leaves the eviction order.
    fn pin_slot(&mut self, slot: u32) {
        if self.slots[slot as usize].pins == 0 {
            self.unlink(slot);
        }
        self.slots[slot as usize].pins += 1;
    }

    /// Drops one pin of `slot`: at its last, a live slot comes back to the eviction order
    /// as the most recently used.
    pub fn unpin(&mut self, slot: u32) {
        let s = &mut self.slots[slot as usize];
        s.pins -= 1;
        if s.pins == 0 && matches!(s.state, State::Live(_)) {
            self.link_newest(slot);
        }
        self.free_if_done(slot);
    }

    fn free_if_done(&mut self, slot: u32) {
        let s = &mut self.slots[slot as usize];
        if s.pins == 0 && matches!(s.state, State::Retired { recorded: true }) {
            s.state = State::Free;
            self.free.push(slot);
        }
    }

    /// Where a put of `key` goes (see `PutStart`); `waiter` is told the outcome of a put of
    /// the same key already in flight.
    pub fn start_put(&mut self, key: Key, waiter: (&Arc<StoreRequest>, usize)) -> PutStart {
        if self.touch(key).is_some() {
            return PutStart::Present;
        }
        if let Some(&slot) = self.writing.get(&key) {
            if let State::Writing { waiters, removed: false, .. } = &mut self.slots[slot as usize].state {
                waiters.push((waiter.0.clone(), waiter.1));
                return PutStart::Joined;
            }
        }
        let (slot, evicted) = match self.free.pop() {
            Some(slot) => (slot, false),
            None => match self.evict() {
                Some(slot) => (slot, true),
                None => return PutStart::NoRoom,
            },
        };
        self.generation += 1;
        self.slots[slot as usize].state =
            State::Writing { key, generation: self.generation, removed: false, claimed: false, waiters: Vec::new() };
        self.writing.insert(key, slot);
        PutStart::Slot { slot, generation: self.generation, evicted }
    }

    /// Takes the least recently used entry that nothing pins out of the index.
    fn evict(&mut self) -> Option<u32> {
        let slot = self.oldest;
        if slot == NIL {
            return None;
        }
        self.unlink(slot);
        let State::Live(key) = self.slots[slot as usize].state else { unreachable!("the eviction order lists live slots only") };
        self.entries.remove(&key);
        self.evictions += 1;
        Some(slot)
    }

    /// Whether the put that took `slot` may still commit (no removal of its key came).
    pub fn may_commit(&self, slot: u32) -> bool {
        matches!(self.slots[slot as usize].state, State::Writing { removed: false, .. })
    }

    /// Claims a handed-out slot for its one commit or abort: the key it is still being put
    /// for, where that key's digest and length are the handle's, its generation `generation`, and no commit
    /// or abort of it has begun. Checked and claimed under one lock, so a handle listed
    /// twice, or committed and aborted at once, settles once.
    pub fn claim_reserved(&mut self, slot: u32, digest: Digest, key_len: u32, generation: u64) -> Option<Key> {
        match self.slots.get_mut(slot as usize) {
            Some(Slot { state: State::Writing { key, generation: g, claimed, .. }, .. })
                if key.len() == key_len && key.digest() == digest && *g == generation && !*claimed =>
            {
                *claimed = true;
                Some(*key)
            }
            _ => None,
        }
    }

    /// Ends the put that took `slot`: its entry is `committed` (its record is written), or
    /// the slot goes back to the free list (its record is still a tombstone). The keys
    /// that joined it, to be told the outcome.
    pub fn finish_put(&mut self, slot: u32, committed: Option<&Record>) -> Waiters {
        let State::Writing { key, waiters, .. } = std::mem::replace(&mut self.slots[slot as usize].state, State::Free) else {
            unreachable!("a put finishes once, on the slot it took")
        };
        self.end_writing(key, slot);
        match committed {
            Some(r) => self.insert(key, slot, r),
            None => self.free.push(slot),
        }
        waiters
    }

    /// `key`'s put at `slot` is over. A put of the key removed while in flight may end
    /// after a newer put of the key took another slot: the map then names the newer one,
    /// which stays.
    fn end_writing(&mut self, key: Key, slot: u32) {
        if self.writing.get(&key) == Some(&slot) {
            self.writing.remove(&key);
        }
    }

    /// Takes `key` out of the index (see `Removed`).
    pub fn remove(&mut self, key: Key) -> Removed {
        if let Some(e) = self.entries.remove(&key) {
            if self.slots[e.slot as usize].pins == 0 {
                self.unlink(e.slot);
            }
            self.slots[e.slot as usize].state = State::Retired { recorded: false };
            return Removed::Entry(e.slot);
        }
        if let Some(&slot) = self.writing.get(&key) {
            if let State::Writing { removed, .. } = &mut self.slots[slot as usize].state {
                *removed = true;
            }
            return Removed::Writing;
        }
        Removed::Absent
    }

    /// Takes the entry of `key` out if it is still the one at `slot` of `generation` (a
    /// check failed on it): whether it was.
    pub fn drop_entry(&mut self, key: Key, slot: u32, generation: u64) -> bool {
        match self.entries.get(&key) {
            Some(e) if e.slot == slot && e.generation == generation => matches!(self.remove(key), Removed::Entry(_)),
            _ => false,
        }
    }

    /// `slot`'s tombstone is written: it is free once nothing pins it.
    pub fn recorded(&mut self, slot: u32) {
        if let State::Retired { recorded } = &mut self.slots[slot as usize].state {
            *recorded = true;
        }
        self.free_if_done(slot);
    }

    /// Whether the eviction order changed since the last call.
    pub fn take_moved(&mut self) -> bool {
        std::mem::take(&mut self.moved)
    }

    /// The live slots with their generations, least recently used first.
    pub fn order(&self) -> Vec<(u32, u64)> {
        let mut out = self.listed();
        // Pinned entries are in use now: the most recently used.
        out.extend(self.entries.values().filter(|e| self.slots[e.slot as usize].pins > 0).map(|e| (e.slot, e.generation)));
        out
    }

    /// The eviction order as listed (live slots nothing pins), least recently used first.
    fn listed(&self) -> Vec<(u32, u64)> {
        let mut out = Vec::with_capacity(self.entries.len());
        let mut slot = self.oldest;
        while slot != NIL {
            let State::Live(key) = &self.slots[slot as usize].state else { unreachable!("the eviction order lists live slots only") };
            out.push((slot, self.entries[key].generation));
            slot = self.slots[slot as usize].newer;
        }
        out
    }

    /// Puts the listed slots (live, nothing pins them) in `order` (slot, generation; least
    /// recently used first) where each still holds that generation's entry, and every other
    /// listed slot after them in the order it has (entries written since `order` was taken
    /// are the newest).
    pub fn restore_order(&mut self, order: &[(u32, u64)]) {
        let current = self.listed();
        let mut placed = vec![false; self.slots.len()];
        let listed = order.iter().filter(|&&(slot, generation)| {
            let live = match self.slots.get(slot as usize) {
                Some(Slot { state: State::Live(key), pins: 0, .. }) => self.entries[key].generation == generation,
                _ => false,
            };
            live && !std::mem::replace(&mut placed[slot as usize], true)
        });
        let slots: Vec<u32> = listed.map(|&(slot, _)| slot).collect();
        let rest = current.iter().map(|&(slot, _)| slot).filter(|&slot| !placed[slot as usize]);
        let all: Vec<u32> = slots.iter().copied().chain(rest).collect();
        for &slot in &all {
            self.unlink(slot);
            self.link_newest(slot);
        }
    }

    /// Slots of every entry with its record, for a verify on open.
    pub fn entries(&self) -> impl Iterator<Item = (Key, Entry)> + '_ {
        self.entries.iter().map(|(k, e)| (*k, *e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The key named `n`.
    fn k(n: u64) -> Key {
        Key::new(&n.to_le_bytes()).unwrap()
    }

    fn rec(n: u64, generation: u64) -> Record {
        Record { namespace: 1, key: k(n), generation, seal: 9 }
    }

    fn put(ix: &mut Index, n: u64) -> PutStart {
        let req = Arc::new(StoreRequest::new(1));
        let start = ix.start_put(k(n), (&req, 0));
        if let PutStart::Slot { slot, generation, .. } = start {
            ix.finish_put(slot, Some(&rec(n, generation)));
        }
        start
    }

    #[test]
    fn a_full_index_evicts_the_least_recently_used_entry_that_nothing_pins() {
        let mut ix = Index::new(3, vec![(0, rec(10, 1)), (2, rec(12, 3)), (1, rec(11, 2))]);
        assert_eq!(ix.len(), 3);
        // 10 is oldest, but leased; 11 is next, but pinned by a get.
        assert!(ix.lease_keyed(k(10)).is_some());
        let e11 = ix.pin(k(11)).unwrap();
        ix.touch(k(12));
        ix.touch(k(11));
        assert_eq!(put(&mut ix, 13), PutStart::Slot { slot: 2, generation: 4, evicted: true });
        assert!(!ix.contains(k(12)) && ix.contains(k(10)) && ix.contains(k(11)));
        assert_eq!(put(&mut ix, 13), PutStart::Present);
        // Now 13 is the only one unpinned.
        assert!(ix.pin(k(13)).is_some());
        assert_eq!(put(&mut ix, 14), PutStart::NoRoom);
        ix.unpin(e11.slot);
        assert_eq!(put(&mut ix, 14), PutStart::Slot { slot: e11.slot, generation: 5, evicted: true });
        assert_eq!(ix.evictions, 2);
    }

    /// A put removed while in flight, then put again: the first put's end must not take
    /// the second one out of the in-flight map, or a third put of the key would write a
    /// slot of its own and leave an entry the index no longer names (one that comes back
    /// on reopen after its removal was acknowledged).
    #[test]
    fn the_end_of_a_removed_put_leaves_a_newer_put_of_its_key_in_flight() {
        let mut ix = Index::new(4, Vec::new());
        let req = Arc::new(StoreRequest::new(3));
        let PutStart::Slot { slot: a, .. } = ix.start_put(k(7), (&req, 0)) else { panic!("a free slot") };
        assert_eq!(ix.remove(k(7)), Removed::Writing);
        let PutStart::Slot { slot: b, generation: gb, .. } = ix.start_put(k(7), (&req, 1)) else { panic!("a free slot") };
        assert_ne!(a, b);
        ix.finish_put(a, None);
        assert_eq!(ix.start_put(k(7), (&req, 2)), PutStart::Joined, "the newer put is still in flight");
        ix.finish_put(b, Some(&rec(7, gb)));
        assert!(ix.contains(k(7)));
        assert_eq!(ix.len(), 1);
        assert!(matches!(ix.remove(k(7)), Removed::Entry(s) if s == b));
    }

    #[test]
    fn a_removed_slot_is_reused_only_once_recorded_and_unpinned() {
        let mut ix = Index::new(1, vec![(0, rec(10, 1))]);
        let e = ix.pin(k(10)).unwrap();
        assert_eq!(ix.remove(k(10)), Removed::Entry(0));
        assert_eq!(ix.remove(k(10)), Removed::Absent);
        assert_eq!(put(&mut ix, 11), PutStart::NoRoom, "retired, not yet recorded");
        ix.recorded(0);
        assert_eq!(put(&mut ix, 11), PutStart::NoRoom, "still pinned by the get");
        ix.unpin(e.slot);
        assert!(matches!(put(&mut ix, 11), PutStart::Slot { slot: 0, evicted: false, .. }));
    }

    #[test]
    fn a_put_of_a_key_being_put_joins_it_and_a_remove_stops_its_commit() {
        let mut ix = Index::new(2, vec![]);
        let (a, b) = (Arc::new(StoreRequest::new(1)), Arc::new(StoreRequest::new(1)));
        let PutStart::Slot { slot, .. } = ix.start_put(k(7), (&a, 0)) else { panic!() };
        assert_eq!(ix.start_put(k(7), (&b, 0)), PutStart::Joined);
        assert_eq!(ix.remove(k(7)), Removed::Writing);
        assert!(!ix.may_commit(slot));
        assert_eq!(ix.finish_put(slot, None).len(), 1);
        assert!(!ix.contains(k(7)));
        assert_eq!(ix.free.len(), 2);
    }

    /// Random puts, uses, pins and removals against a plain list kept in use order: the
    /// index evicts exactly what the list says is the least recently used unpinned key.
    #[test]
    fn eviction_follows_use_order_through_random_operations() {
        let mut ix = Index::new(8, vec![]);
        let mut order: Vec<u64> = Vec::new(); // least recently used first
        let mut pinned: Vec<(u64, u32)> = Vec::new();
        let mut x = 0x2545_f491_4f6c_dd1du64;
        for _ in 0..20_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let key = x % 20;
            match x >> 60 {
                0..=7 => {
                    let slot_of = |ix: &Index, n: u64| ix.entries().find(|e| e.0 == k(n)).unwrap().1.slot;
                    let is_pinned = |slot: u32| pinned.iter().any(|p| p.1 == slot);
                    let victim = order.iter().copied().find(|&k| !is_pinned(slot_of(&ix, k)));
                    // Slots in use: live ones, and removed ones a pin still holds.
                    let live: Vec<u32> = order.iter().map(|&k| slot_of(&ix, k)).collect();
                    let mut held: Vec<u32> = pinned.iter().map(|p| p.1).filter(|s| !live.contains(s)).collect();
                    held.sort();
                    held.dedup();
                    let full = order.len() + held.len() == 8;
                    match put(&mut ix, key) {
                        PutStart::Present => {
                            order.retain(|&k| k != key);
                            order.push(key);
                        }
                        PutStart::Slot { evicted, .. } => {
                            assert_eq!(evicted, full);
                            if full {
                                let v = victim.expect("an unpinned key to evict");
                                assert!(!ix.contains(k(v)), "the least recently used unpinned key goes");
                                order.retain(|&k| k != v);
                            }
                            order.push(key);
                        }
                        PutStart::NoRoom => assert!(full && victim.is_none()),
                        PutStart::Joined => unreachable!("puts finish at once here"),
                    }
                }
                8..=10 => {
                    if let Some(e) = ix.pin(k(key)) {
                        pinned.push((key, e.slot));
                        order.retain(|&k| k != key);
                        order.push(key);
                    }
                }
                11..=13 => {
                    if let Some((key, slot)) = pinned.pop() {
                        ix.unpin(slot);
                        // The last unpin of a live entry makes it the most recently used.
                        let live_here = ix.entries().any(|(kk, e)| kk == k(key) && e.slot == slot);
                        if live_here && !pinned.iter().any(|p| p.1 == slot) {
                            order.retain(|&o| o != key);
                            order.push(key);
                        }
                    }
                }
                _ => {
                    if let Removed::Entry(slot) = ix.remove(k(key)) {
                        ix.recorded(slot);
                        order.retain(|&k| k != key);
                    }
                }
            }
            assert_eq!(ix.len(), order.len());
        }
    }

    /// A lease is its holder's: a get by another caller, or another holder's release,
    /// never gives it back, and a release gives back the slot that lease pinned.
    #[test]
    fn a_lease_pins_its_own_slot_until_its_own_token_comes_back() {
        let mut ix = Index::new(2, vec![(0, rec(1, 1))]);
        let (a1, t1) = ix.lease(k(1)).unwrap();
        // The key removed and put again: a second holder leases the new entry.
        assert_eq!(ix.remove(k(1)), Removed::Entry(a1.slot));
        ix.recorded(a1.slot);
        assert!(matches!(put(&mut ix, 1), PutStart::Slot { .. }));
        let (a2, t2) = ix.lease(k(1)).unwrap();
        assert_ne!(a1.slot, a2.slot);
        // Another caller's get comes and goes: both leases stay.
        let g = ix.pin(k(1)).unwrap();
        ix.unpin(g.slot);
        assert!(ix.holds_lease(t1) && ix.holds_lease(t2));
        assert_eq!(put(&mut ix, 2), PutStart::NoRoom, "both slots are leased");
        // The first holder gives its lease back: the old slot is freed, the new one stays.
        assert!(ix.release(t1));
        assert!(!ix.release(t1), "a token is given back once");
        assert!(matches!(put(&mut ix, 2), PutStart::Slot { slot, evicted: false, .. } if slot == a1.slot));
        assert!(ix.contains(k(1)), "the second holder's lease still pins its entry");
        assert!(ix.release(t2));
    }

    /// Leases taken by key are given back oldest first, and a get spends only one on the
    /// slot it loads.
    #[test]
    fn leases_by_key_go_back_oldest_first_and_a_get_spends_its_own_slots() {
        let mut ix = Index::new(2, vec![(0, rec(1, 1))]);
        let old = ix.lease_keyed(k(1)).unwrap();
        assert_eq!(ix.remove(k(1)), Removed::Entry(old.slot));
        ix.recorded(old.slot);
        assert!(matches!(put(&mut ix, 1), PutStart::Slot { .. }));
        let new = ix.lease_keyed(k(1)).unwrap();
        assert!(!ix.spend_keyed_on(k(1), 7), "no lease on another slot");
        assert!(ix.release_keyed(k(1)), "the oldest lease, on the old slot");
        assert!(matches!(put(&mut ix, 2), PutStart::Slot { slot, .. } if slot == old.slot));
        assert!(ix.spend_keyed_on(k(1), new.slot));
        assert!(!ix.release_keyed(k(1)));
    }

    /// An order taken from one index, restored in another built in write order, puts
    /// the entries back in use order: stale and unknown slots are skipped, and entries not
    /// in the order (written since) come last.
    #[test]
    fn a_restored_order_evicts_what_was_used_least_before() {
        let found = || vec![(0, rec(10, 1)), (1, rec(11, 2)), (2, rec(12, 3)), (3, rec(13, 4))];
        let mut ix = Index::new(5, found());
        ix.touch(k(10));
        ix.touch(k(12));
        let mut order = ix.order();
        assert_eq!(order, [(1, 2), (3, 4), (0, 1), (2, 3)]);
        order.retain(|&(slot, _)| slot != 3);
        order.insert(0, (2, 99)); // another generation: someone else's entry now
        order.insert(0, (4, 1)); // a free slot
        order.push((9, 1)); // past the capacity
        let mut again = Index::new(5, found());
        again.restore_order(&order);
        assert_eq!(again.order(), [(1, 2), (0, 1), (2, 3), (3, 4)]);
        assert!(matches!(put(&mut again, 20), PutStart::Slot { slot: 4, evicted: false, .. }));
        assert!(matches!(put(&mut again, 21), PutStart::Slot { slot: 1, evicted: true, .. }), "key 11 was used least");
    }

    /// Leased entries leave the eviction order, so an eviction takes its victim at once
    /// however many are leased, and a full store of leased entries is `NoRoom` at once; a
    /// lease given back lists its entry again, as the most recently used.
    #[test]
    fn leased_entries_leave_the_eviction_order_until_their_last_lease_ends() {
        let n = 1000;
        let mut ix = Index::new(n as u32, (0..n).map(|i| (i as u32, rec(i, i + 1))).collect());
        let tokens: Vec<u64> = (1..n).map(|i| ix.lease(k(i)).unwrap().1).collect();
        assert_eq!(ix.listed(), [(0, 1)], "only the entry nothing leases is listed");
        assert_eq!(ix.order().len(), n as usize, "the order kept across a restart still has every entry");
        assert!(matches!(put(&mut ix, 5000), PutStart::Slot { slot: 0, evicted: true, .. }));
        let (_, t) = ix.lease(k(5000)).unwrap();
        assert_eq!(ix.listed(), [], "every entry is leased");
        assert_eq!(put(&mut ix, 5001), PutStart::NoRoom);
        ix.release(tokens[500]);
        ix.release(t);
        assert_eq!(ix.listed(), [(501, 502), (0, n + 1)], "listed again in the order their leases ended");
        assert!(matches!(put(&mut ix, 5001), PutStart::Slot { slot: 501, evicted: true, .. }));
    }

    #[test]
    fn the_newest_record_of_a_key_found_twice_wins() {
        let mut ix = Index::new(2, vec![(0, rec(5, 8)), (1, rec(5, 3))]);
        assert_eq!(ix.entries().find(|e| e.0 == k(5)).unwrap().1.slot, 0);
        assert_eq!(ix.stale, vec![1]);
        assert!(ix.free.is_empty(), "not before its tombstone is written");
        ix.recorded(1);
        assert_eq!(ix.free, vec![1]);
    }
}
