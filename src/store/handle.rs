//! Slot handles: the split for runtimes whose scheduler and data movers are different
//! processes (vLLM's scheduler and GPU workers). The owner keeps the index and hands out
//! slots; a process that opened the store `DATA_ONLY` moves those slots' data with the
//! same checks.
//!
//! ```text
//! owner:  lease_slots(keys) ──handles──►  data process: read_slots(handles, dst, ids)
//!         release_leases(keys)  ◄──done──          (seal and record checked per key)
//! owner:  reserve_slots(keys) ──handles──►  data process: write_slots(src, ids, handles)
//!         commit_slots(handles) ◄──done──          (or abort_slots on failure)
//! ```
//! A read handle's slot is leased: never evicted nor reused until released, and the data
//! process checks that the slot's record still names the handle's key, generation and
//! seal. A write handle's slot is reserved as a put's would be (its tombstone written); the
//! data process's write tags the block's checksums with the handle's write identity (its
//! owner's epoch and generation), and the owner commits it only where the block's seal and
//! every region's tag are that write's, then writes the record: the entry is visible only
//! after its data is complete, as with `put`, and never holds bytes of another write of
//! the slot (an aborted handle's, or one handed out before the owner opened the store
//! again) that landed late, nor a mix of two writes.

use super::config::{keys_of, Digest, StoreFlags, MAX_KEY_BYTES};
use super::index::{Entry, PutStart};
use super::record::Read;
use super::request::StoreRequest;
use super::worker::{self, GetKey, Holder, PutGroup, PutKey, WriteGroup};
use super::{write_id, Inner, Store};
use crate::engine::TransferOptions;
use crate::error::{bail, Result, Status};
use crate::memory::Layout;
use std::sync::Arc;

/// A slot the owner hands to a data-only process: to read (a held entry, leased) or to
/// write (reserved for a key).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotHandle {
    pub slot: u32,
    pub generation: u64,
    /// The key's digest (xxh3-128): with the slot and generation, what a data-only
    /// process checks the slot's record against (the owner's index, which handed the
    /// handle out, compared the key's own bytes).
    pub key_digest: Digest,
    pub key_len: u32,
    /// The block's seal, in a handle to read (0 in one to write).
    pub seal: u64,
    /// The owner's open that handed it out (drawn at random at each open): a write
    /// handle's write is tagged with it, and the owner commits only its own open's handles.
    pub epoch: u64,
}

/// What `reserve_slots` gives a key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reservation {
    /// Held already: nothing to write.
    Held,
    /// Write the block to this slot, then `commit_slots` (or `abort_slots`).
    Write(SlotHandle),
    /// Another put of the key is in flight; look it up once that ends.
    InFlight,
    /// Full, and every entry is held: the key fails alone (as `Busy` for a put).
    NoRoom,
}

impl Store {
    /// As `lookup` with a lease, for a data-only process: a handle to read for each hit.
    /// Each hit stays leased until `release_leases` (or a get of it here).
    pub fn lease_slots<K: AsRef<[u8]>>(&self, keys: &[K]) -> Result<Vec<Option<SlotHandle>>> {
        self.inner.owner()?;
        let keys = keys_of(keys)?;
        let epoch = self.inner.epoch;
        let mut ix = self.inner.index.lock().unwrap();
        Ok(keys
            .iter()
            .map(|&k| {
                ix.lease_keyed(k).map(|e| SlotHandle {
                    slot: e.slot,
                    generation: e.generation,
                    key_digest: k.digest(),
                    key_len: k.len(),
                    seal: e.seal,
                    epoch,
                })
            })
            .collect())
    }

    /// Reserves a slot for each key not held, as a put would (evicting, tombstone first),
    /// for a data-only process to write; `commit_slots` then makes them entries.
    pub fn reserve_slots<K: AsRef<[u8]>>(&self, keys: &[K]) -> Result<Vec<Reservation>> {
        let inner = &self.inner;
        inner.owner()?;
        let keys = keys_of(keys)?;
        // Joined puts settle into this request, which nobody reads: `InFlight` says so.
        let nobody = Arc::new(StoreRequest::new(keys.len()));
        let (mut out, mut evicted) = (Vec::with_capacity(keys.len()), Vec::new());
        {
            let mut ix = inner.index.lock().unwrap();
            for &key in &keys {
                ix.touch_held(key);
            }
            for (i, &key) in keys.iter().enumerate() {
                out.push(match ix.start_put(key, (&nobody, i)) {
                    PutStart::Present => Reservation::Held,
                    PutStart::Joined => Reservation::InFlight,
                    PutStart::NoRoom => Reservation::NoRoom,
                    PutStart::Slot { slot, generation, evicted: e } => {
                        if e {
                            evicted.push(slot);
                        }
                        let (key_digest, key_len) = (key.digest(), key.len());
                        Reservation::Write(SlotHandle { slot, generation, key_digest, key_len, seal: 0, epoch: inner.epoch })
                    }
                });
            }
        }
        // Evicted slots' tombstones first. The slot's old block stays: its checksums carry
        // another write's tags, so `commit_slots` never takes it for the new key's.
        if let Err(e) = inner.tombstone(&evicted) {
            // The call fails whole: every reservation is undone. An evicted slot's record
            // may still name its old key, so it leaves use until the store is opened again;
            // a slot from the free list holds a tombstone and goes back to it.
            let mut ix = inner.index.lock().unwrap();
            for r in &out {
                if let Reservation::Write(h) = r {
                    let waiters = match evicted.contains(&h.slot) {
                        true => ix.abandon(h.slot),
                        false => ix.finish_put(h.slot, None),
                    };
                    for (req, i) in waiters {
                        req.settle(i, e.status, e.message.clone());
                    }
                }
            }
            return Err(e);
        }
        Ok(out)
    }

    /// Makes the written slots of `handles` entries: each block's seal and tags are read
    /// and its record written (in durable mode, its shard synced first and the record after). Per handle: `Ok`; `InvalidArg` for
    /// a handle not reserved by this open (already committed or aborted, or handed out
    /// before the store was opened again); `Integrity` for a block not completely written
    /// through this handle (its write did not finish, or another write of the slot landed
    /// on it); `Cancelled` for a key removed meanwhile.
    pub fn commit_slots(&self, handles: &[SlotHandle]) -> Result<Vec<Status>> {
        let inner = &self.inner;
        inner.owner()?;
        inner.check_handles(handles, handles.len())?;
        let req = Arc::new(StoreRequest::new(handles.len()));
        let keys = self.reserved(handles, &req);
        let keys = self.synced(PutGroup { req: req.clone(), keys });
        inner.commit(PutGroup { req: req.clone(), keys });
        Ok((0..handles.len()).map(|i| req.key_status(i).unwrap_or(Status::Internal)).collect())
    }

    /// In durable mode, makes the blocks of `g` durable (data and checksums) before their
    /// records say they are there: the data process wrote them, and a data-only open made
    /// without `DURABLE` never syncs. The keys of a shard that fails to sync fail with
    /// its error; the others are returned.
    fn synced(&self, g: PutGroup) -> Vec<PutKey> {
        let inner = &self.inner;
        if !inner.cfg.flags.contains(StoreFlags::DURABLE) {
            return g.keys;
        }
        let mut shards: Vec<usize> = g.keys.iter().map(|k| inner.shard_of(k.slot)).collect();
        shards.sort_unstable();
        shards.dedup();
        let mut keys = g.keys;
        for shard in shards {
            let file = inner.shards[shard].file().expect("store shards are files");
            if let Err(e) = file.sync_data() {
                let (failed, rest) = keys.into_iter().partition(|k| inner.shard_of(k.slot) == shard);
                inner.put_failed(PutGroup { req: g.req.clone(), keys: failed }, e.status, &e.message);
                keys = rest;
            }
        }
        keys
    }

    /// Gives back the reserved slots of `handles` unwritten (their records are still
    /// tombstones, whatever the data process wrote). A handle not reserved as handed out
    /// (committed or aborted already, of an earlier open, or naming another key) is
    /// `InvalidArg`, naming the first, after the others were aborted.
    pub fn abort_slots(&self, handles: &[SlotHandle]) -> Result<()> {
        self.inner.owner()?;
        self.inner.check_handles(handles, handles.len())?;
        let req = Arc::new(StoreRequest::new(handles.len()));
        let keys = self.reserved(handles, &req);
        let aborted = keys.len();
        self.inner.put_failed(PutGroup { req: req.clone(), keys }, Status::Cancelled, "aborted by the owner");
        if aborted < handles.len() {
            let i = (0..handles.len()).find(|&i| req.key_status(i) == Some(Status::InvalidArg)).expect("a handle not aborted");
            bail!(InvalidArg, "handle {i}: {} (the other handles were aborted)", req.key_message(i));
        }
        Ok(())
    }

    /// The keys of `handles` still reserved as handed out, claimed for this commit or
    /// abort; the others (a handle listed again included) settled `InvalidArg`.
    fn reserved(&self, handles: &[SlotHandle], req: &Arc<StoreRequest>) -> Vec<PutKey> {
        let mut ix = self.inner.index.lock().unwrap();
        let mut keys = Vec::with_capacity(handles.len());
        for (i, h) in handles.iter().enumerate() {
            if h.key_len == 0 || h.key_len as usize > MAX_KEY_BYTES {
                req.settle(
                    i,
                    Status::InvalidArg,
                    format!("the handle of slot {} names a key of {} bytes; keys are 1 to {MAX_KEY_BYTES}", h.slot, h.key_len),
                );
            } else if h.epoch != self.inner.epoch {
                req.settle(
                    i,
                    Status::InvalidArg,
                    format!("the handle of slot {} was handed out by an earlier open of the store; reserve the key again", h.slot),
                );
            } else if let Some(key) = ix.claim_reserved(h.slot, h.key_digest, h.key_len, h.generation) {
                keys.push(PutKey { index: i, key, slot: h.slot, generation: h.generation, src: 0 });
            } else {
                req.settle(
                    i,
                    Status::InvalidArg,
                    format!("slot {} is not reserved for this key (committed, aborted or never handed out)", h.slot),
                );
            }
        }
        keys
    }

    /// Loads the slots of read handles into `dst_ids` of `dst`. Per key: `Ok`, or
    /// `Integrity` where the slot no longer holds the entry the handle names (its record,
    /// generation or seal differ) or its block fails its checksums.
    pub fn read_slots(
        &self,
        handles: &[SlotHandle],
        dst: &Arc<Layout>,
        dst_ids: &[u64],
        opts: &TransferOptions,
    ) -> Result<Arc<StoreRequest>> {
        let inner = &self.inner;
        inner.check_handles(handles, dst_ids.len())?;
        // A read handle carries its entry's seal (never 0); a write handle or a zeroed one
        // (C's for a key that was not held) names no entry to read.
        if let Some(i) = handles.iter().position(|h| h.seal == 0 || h.epoch == 0) {
            bail!(InvalidArg, "handle {i} is not a read handle (lease_slots gives those, for the keys it found)");
        }
        inner.check_side(dst, dst_ids, "destination")?;
        let plain = TransferOptions { on_complete: None, ..opts.clone() };
        inner.engine.check(&inner.shards[0], &[0], dst, &dst_ids[..1], &plain)?;
        let req = inner.request(handles.len());
        let mut groups: Vec<Vec<GetKey>> = vec![Vec::new(); inner.shards.len()];
        for (i, h) in handles.iter().enumerate() {
            let entry = Entry { slot: h.slot, generation: h.generation, seal: h.seal };
            let holder = Holder::Handle { digest: h.key_digest, key_len: h.key_len };
            groups[inner.shard_of(h.slot)].push(GetKey { index: i, holder, entry, dst: dst_ids[i] });
        }
        for (shard, keys) in groups.into_iter().enumerate().filter(|(_, g)| !g.is_empty()) {
            inner.submit_get(&req, shard, dst, keys, &plain, false);
        }
        Ok(req)
    }

    /// Writes block `src_ids[i]` of `src` to the slot of write handle `handles[i]`, its
    /// checksums tagged with the handle's write; the owner then commits them. Whole blocks
    /// only; a handle is written once.
    pub fn write_slots(
        &self,
        src: &Arc<Layout>,
        src_ids: &[u64],
        handles: &[SlotHandle],
        opts: &TransferOptions,
    ) -> Result<Arc<StoreRequest>> {
        let inner = &self.inner;
        inner.check_handles(handles, src_ids.len())?;
        // A write handle carries its owner's epoch and no seal. Which open's it is cannot
        // be told here, but a zeroed handle (C's for a key given no slot) or a read handle
        // would overwrite a committed entry.
        if let Some(i) = handles.iter().position(|h| h.epoch == 0 || h.seal != 0) {
            bail!(InvalidArg, "handle {i} is not a write handle (reserve_slots gives those, for keys it answered Write)");
        }
        if opts.layer_begin != 0 || (opts.layer_end != 0 && opts.layer_end as u64 != inner.cfg.block.num_layers) {
            bail!(InvalidArg, "a slot is written whole: put every layer");
        }
        // A reserved slot's record is a tombstone until its commit; one that names an entry
        // means the handle is stale (committed already, or handed out before the owner
        // opened the store again), and writing it would destroy that entry.
        {
            let records = &inner.records;
            for (i, h) in handles.iter().enumerate() {
                if let Read::Entry(_) = records.read(h.slot)? {
                    bail!(
                        InvalidArg,
                        "handle {i}: slot {} holds a committed entry, so the handle is stale (committed already, or handed out before the owner opened the store again); reserve the key again",
                        h.slot
                    );
                }
            }
        }
        inner.check_side(src, src_ids, "source")?;
        let plain = TransferOptions { on_complete: None, ..opts.clone() };
        inner.engine.check(src, &src_ids[..1], &inner.shards[0], &[0], &plain)?;
        let req = inner.request(handles.len());
        let mut groups: Vec<Vec<usize>> = vec![Vec::new(); inner.shards.len()];
        for (i, h) in handles.iter().enumerate() {
            groups[inner.shard_of(h.slot)].push(i);
        }
        for (shard, keys) in groups.into_iter().enumerate().filter(|(_, g)| !g.is_empty()) {
            let ids: Vec<u64> = keys.iter().map(|&i| src_ids[i]).collect();
            let blocks: Vec<u64> = keys.iter().map(|&i| inner.block_of(handles[i].slot)).collect();
            let writes: Vec<u64> = keys.iter().map(|&i| write_id(handles[i].epoch, handles[i].generation)).collect();
            inner.begin();
            let group = WriteGroup { req: req.clone(), keys };
            let (opts, group) = worker::on_complete(&inner.tx, &plain, group, |g, st, m| worker::Msg::Done(worker::Done::Write(g), st, m));
            if let Err(e) = inner.engine.submit_for_store(src, &ids, &inner.shards[shard], &blocks, &opts, Some(&writes)) {
                if let Some(g) = group.lock().unwrap().take() {
                    for i in g.keys {
                        req.settle(i, e.status, e.message.clone());
                    }
                }
                inner.end();
            }
        }
        Ok(req)
    }
}

impl Inner {
    /// Refuses no handles, handles of slots past the capacity, or a count that differs
    /// from the blocks'.
    fn check_handles(&self, handles: &[SlotHandle], blocks: usize) -> Result<()> {
        if handles.is_empty() {
            bail!(InvalidArg, "no handles; a slot call takes at least one");
        }
        if handles.len() != blocks {
            bail!(InvalidArg, "{} handles but {blocks} blocks; give one block per handle", handles.len());
        }
        let cap = self.cfg.capacity_blocks;
        if let Some((i, h)) = handles.iter().enumerate().find(|(_, h)| h.slot as u64 >= cap) {
            bail!(OutOfRange, "handle {i} names slot {}; the store has {cap} (a handle of another store?)", h.slot);
        }
        Ok(())
    }
}
