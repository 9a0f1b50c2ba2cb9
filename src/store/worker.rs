//! The store's threads: what happens when an engine transfer of a put or a get completes.
//! Engine completion callbacks only send the group to a thread of the store (they run on
//! the engine's threads, which must not block).
//!
//! Two threads, so that no get's completion is ever queued behind a put's commit:
//! - the store thread (`kvx-store`) commits puts (reads seals, then under the `deciding`
//!   mutex writes records and, in durable mode, syncs them), settles data-only writes,
//!   syncs the tombstones of slots that durable puts evicted before starting their
//!   transfers, writes the tombstones of entries that gets found damaged, and writes the
//!   eviction order;
//! - the get thread (`kvx-store-get`) settles gets: it reads each block's seal from the
//!   sidecar, for a handed-out slot its record, and takes the index mutex, which no one
//!   holds across I/O. It writes no record: an entry that fails a check leaves the index
//!   at once (its key a miss), and its tombstone goes to the store thread, which records
//!   it and frees the slot (the slot stays out of use until then).
//!
//! So a get, latency-critical or not, waits for no record write or sync: a commit holding
//! `deciding` across an `fdatasync` delays only other commits and removals. One thread
//! with a queue ordered by class would not do: a get arriving during a commit would still
//! wait for that commit's sync.

use super::config::{Digest, Key};
use super::index::Entry;
use super::record::{Read, Record};
use super::request::StoreRequest;
use super::{add, write_id, Inner};
use crate::engine::{OnComplete, TransferOptions};
use crate::error::Status;
use crate::memory::Layout;
use crossbeam_channel::{Receiver, Sender};
use std::sync::{Arc, Mutex};

/// One key of a put, with the slot it took.
#[derive(Clone, Debug)]
pub struct PutKey {
    pub index: usize,
    pub key: Key,
    pub slot: u32,
    pub generation: u64,
    /// Its block in the source layout.
    pub src: u64,
}

/// The keys of one put that one engine transfer writes (those of one shard).
pub struct PutGroup {
    pub req: Arc<StoreRequest>,
    pub keys: Vec<PutKey>,
}

/// Whether a slot's record is still the one a get's holder vouched for.
enum Vouched {
    Yes,
    Stale,
    Damaged,
}

/// What vouches for the slot a get reads.
#[derive(Clone, Copy, Debug)]
pub enum Holder {
    /// This store's index pinned the entry of this key.
    Pinned(Key),
    /// The owner handed the slot out to this data-only process: the slot's record is read
    /// back after the data, and must still be the one the handle names.
    Handle { digest: Digest, key_len: u32 },
}

/// One key of a get: the entry it reads and its destination block.
#[derive(Clone, Debug)]
pub struct GetKey {
    pub index: usize,
    pub holder: Holder,
    pub entry: Entry,
    pub dst: u64,
}

/// The keys of one get that one engine transfer loads (held in one shard).
pub struct GetGroup {
    pub req: Arc<StoreRequest>,
    pub keys: Vec<GetKey>,
    pub shard: usize,
    pub dst: Arc<Layout>,
    pub opts: TransferOptions,
    /// Retried key by key after the group failed a check: one key, not to be split again.
    pub alone: bool,
}

/// What a put's transfer needs to be made again, key by key.
pub struct PutSource {
    pub shard: usize,
    pub src: Arc<Layout>,
    pub opts: TransferOptions,
    /// Retried key by key after the group's write failed: one key, not to be split again.
    pub alone: bool,
}

/// Slots handed out by the owner that one engine transfer writes: the keys' indices.
pub struct WriteGroup {
    pub req: Arc<StoreRequest>,
    pub keys: Vec<usize>,
}

/// A completion the store thread settles.
pub enum Done {
    Put(PutGroup, PutSource),
    Write(WriteGroup),
}

pub enum Msg {
    /// A transfer completed with this status and message.
    Done(Done, Status, String),
    /// The entry of this slot failed a check and left the index: its tombstone is to be
    /// written (synced in durable mode), then the slot freed.
    Retire(u32),
    /// A durable put evicted slots: their tombstones, written, are to be synced before its
    /// transfers to them start.
    AfterSync(AfterSync),
    Stop,
}

/// The transfers of a durable put that wait for its evicted slots' tombstones to be
/// synced: those of the shards `groups` names (each with its keys).
pub struct AfterSync {
    pub req: Arc<StoreRequest>,
    pub src: Arc<Layout>,
    pub opts: TransferOptions,
    pub evicted: Vec<u32>,
    pub groups: Vec<(usize, Vec<PutKey>)>,
}

/// What the get thread is sent: a get's completion, or `None` to stop.
pub type GetMsg = Option<(GetGroup, Status, String)>;

/// `opts` with a completion callback that sends `done`, with the transfer's status and
/// message, to `tx` (the store thread's or the get thread's) as `msg` makes it; the cell
/// `done` waits in, from which a failed submit takes it back.
pub fn on_complete<D: Send + 'static, M: Send + 'static>(
    tx: &Sender<M>,
    opts: &TransferOptions,
    done: D,
    msg: fn(D, Status, String) -> M,
) -> (TransferOptions, Arc<Mutex<Option<D>>>) {
    let cell = Arc::new(Mutex::new(Some(done)));
    let (tx, held) = (tx.clone(), cell.clone());
    let f: OnComplete = Arc::new(move |r, status| {
        if let Some(done) = held.lock().unwrap().take() {
            // The store's threads live until every transfer they wait for is handled.
            let _ = tx.send(msg(done, status, r.error_message().to_string_lossy().into_owned()));
        }
    });
    (TransferOptions { on_complete: Some(f), ..opts.clone() }, cell)
}

/// How often the store thread writes the eviction order while it changes, so a reopen
/// after a crash keeps the recency of at most this long ago.
const ORDER_EVERY: std::time::Duration = std::time::Duration::from_secs(60);

pub fn run(inner: Arc<Inner>, rx: Receiver<Msg>) {
    use crossbeam_channel::RecvTimeoutError;
    let mut next_order = std::time::Instant::now() + ORDER_EVERY;
    loop {
        match rx.recv_deadline(next_order) {
            Ok(Msg::Done(done, status, message)) => {
                match done {
                    Done::Put(g, source) => inner.put_done(g, source, status, &message),
                    Done::Write(g) => {
                        for i in g.keys {
                            g.req.settle(i, status, message.as_str());
                        }
                    }
                }
                inner.end();
            }
            Ok(Msg::Retire(slot)) => {
                inner.retire(slot);
                inner.end();
            }
            Ok(Msg::AfterSync(a)) => {
                inner.start_after_sync(a);
                inner.end();
            }
            Ok(Msg::Stop) => return inner.save_order(true),
            Err(RecvTimeoutError::Disconnected) => return,
            Err(RecvTimeoutError::Timeout) => {}
        }
        // Also under a steady stream of completions, which never lets the wait time out.
        if std::time::Instant::now() >= next_order {
            inner.save_order(false);
            next_order = std::time::Instant::now() + ORDER_EVERY;
        }
    }
}

/// The get thread: settles the gets' completions, which the engine sends it.
pub fn run_gets(inner: Arc<Inner>, rx: Receiver<GetMsg>) {
    while let Ok(Some((g, status, message))) = rx.recv() {
        inner.get_done(g, status, &message);
        inner.end();
    }
}

impl Inner {
    /// A put's transfer failed: its slots go back (their records are still tombstones)
    /// and its keys, and those that joined them, fail with the transfer's status.
    pub(super) fn put_failed(&self, g: PutGroup, status: Status, message: &str) {
        let mut waiters = Vec::new();
        {
            let mut ix = self.index.lock().unwrap();
            for k in &g.keys {
                waiters.extend(ix.finish_put(k.slot, None));
            }
        }
        for k in &g.keys {
            g.req.settle(k.index, status, message);
        }
        for (r, i) in waiters {
            r.settle(i, status, message);
        }
    }

    /// A put's blocks are written and sealed: record them, then make them entries.
    fn put_done(self: &Arc<Self>, g: PutGroup, source: PutSource, status: Status, message: &str) {
        if status == Status::Io && !source.alone && g.keys.len() > 1 {
            // One failed write (a full disk) fails the whole transfer: write the keys one
            // by one, so it fails its key alone. Blocks the first attempt wrote have
            // their space already, so theirs succeed.
            for k in g.keys {
                self.submit_put(&g.req, source.shard, &source.src, vec![k], &source.opts, true);
            }
            return;
        }
        if status != Status::Ok {
            return self.put_failed(g, status, message);
        }
        self.commit(g);
    }

    /// Records the blocks of `g`, written and sealed, then makes them entries: each only
    /// where its block's seal and every region's tag are those of this key's own write.
    pub(super) fn commit(&self, g: PutGroup) {
        let mut sealed = Vec::with_capacity(g.keys.len());
        for k in g.keys {
            match self.sidecar(self.shard_of(k.slot)).seal_written_by(self.block_of(k.slot), write_id(self.epoch, k.generation)) {
                Ok(Some(seal)) => sealed.push((k, seal)),
                Ok(None) => {
                    let why = format!(
                        "slot {} does not hold a block completely written for this key (its write did not finish, or another write of the slot, such as a late one of an aborted handle, landed on it); put the key again",
                        k.slot
                    );
                    self.put_failed(PutGroup { req: g.req.clone(), keys: vec![k] }, Status::Integrity, &why)
                }
                Err(e) => self.put_failed(PutGroup { req: g.req.clone(), keys: vec![k] }, e.status, &e.message),
            }
        }
        let deciding = self.deciding.lock().unwrap();
        let records = &self.records;
        let (commit, removed): (Vec<_>, Vec<_>) = {
            let ix = self.index.lock().unwrap();
            sealed.into_iter().partition(|(k, _)| ix.may_commit(k.slot))
        };
        let keys = |v: &[(PutKey, u64)]| PutGroup { req: g.req.clone(), keys: v.iter().map(|(k, _)| k.clone()).collect() };
        self.put_failed(keys(&removed), Status::Cancelled, "the key was removed while it was being put");
        let record = |k: &PutKey, seal| Record { namespace: self.namespace, key: k.key, generation: k.generation, seal };
        let written = commit.iter().try_for_each(|(k, seal)| records.write(k.slot, &record(k, *seal))).and_then(|_| records.sync());
        if let Err(e) = written {
            // Records maybe on disk, maybe not: the slots leave use until the next open.
            drop(deciding);
            log::error!("store {}: {e}", self.dir.display());
            return self.abandon_keys(&g.req, &keys(&commit).keys, &e);
        }
        let mut waiters = Vec::new();
        {
            let mut ix = self.index.lock().unwrap();
            for (k, seal) in &commit {
                waiters.extend(ix.finish_put(k.slot, Some(&record(k, *seal))));
            }
        }
        drop(deciding);
        add(&self.counters.puts, commit.len() as u64);
        for (k, _) in &commit {
            g.req.settle(k.index, Status::Ok, "");
        }
        for (r, i) in waiters {
            r.settle(i, Status::Ok, "");
        }
    }

    fn unpin(&self, keys: &[GetKey]) {
        let mut ix = self.index.lock().unwrap();
        for k in keys.iter().filter(|k| matches!(k.holder, Holder::Pinned(_))) {
            ix.unpin(k.entry.slot);
        }
    }

    /// Whether the slot of `k` still holds the record its holder vouched for: always, for
    /// a slot this store's index pinned; read back, for a handed-out one, where `Stale`
    /// is a record that reads well but names another entry (or none), and `Damaged` one
    /// that does not read.
    fn record_still_names(&self, k: &GetKey) -> crate::error::Result<Vouched> {
        let Holder::Handle { digest, key_len } = k.holder else { return Ok(Vouched::Yes) };
        Ok(match self.records.read(k.entry.slot)? {
            Read::Entry(r)
                if r.namespace == self.namespace
                    && r.key.len() == key_len
                    && r.key.digest() == digest
                    && (r.generation, r.seal) == (k.entry.generation, k.entry.seal) =>
            {
                Vouched::Yes
            }
            Read::Entry(_) | Read::Free => Vouched::Stale,
            Read::Damaged => Vouched::Damaged,
        })
    }

    /// A get's transfer failed other than by a check: its keys fail with its status.
    pub(super) fn get_failed(&self, g: GetGroup, status: Status, message: &str) {
        self.unpin(&g.keys);
        add(&self.counters.misses, g.keys.len() as u64);
        for k in &g.keys {
            g.req.settle(k.index, status, message);
        }
    }

    /// A get's blocks failed a check: misses, and their entries dropped.
    fn failed_check(&self, g: GetGroup, message: &str) {
        for k in &g.keys {
            self.integrity_miss(&k.holder, &k.entry, message);
        }
        add(&self.counters.misses, g.keys.len() as u64);
        self.unpin(&g.keys);
        for k in &g.keys {
            g.req.settle(k.index, Status::Integrity, message);
        }
    }

    /// A get's blocks are loaded (every region checked against its checksum and its
    /// block's seal by the engine): each key is a hit if its block's seal is still the one
    /// its record was written with.
    fn get_done(self: &Arc<Self>, g: GetGroup, status: Status, message: &str) {
        if matches!(status, Status::Integrity | Status::Io) && !g.alone && g.keys.len() > 1 {
            // One bad block, or one that cannot be read, fails the whole transfer: load the
            // keys one by one, so it fails its key alone.
            for k in g.keys {
                self.submit_get(&g.req, g.shard, &g.dst, vec![k], &g.opts, true);
            }
            return;
        }
        // A read of one key's block that failed because the block or its checksums lie
        // past the end of a file cut short fails every time: damage, as a failed check
        // is. Any other failed read (EIO) is the disk's, not the block's: the entry stays.
        let cut = match (status, &g.keys[..]) {
            (Status::Io, [k]) => self.cut_short(k.entry.slot),
            _ => None,
        };
        if let Some(why) = cut {
            return self.failed_check(g, &format!("{why} ({message})"));
        }
        if status == Status::Integrity {
            return self.failed_check(g, message);
        }
        if status != Status::Ok {
            return self.get_failed(g, status, message);
        }
        let mut results = Vec::with_capacity(g.keys.len());
        for k in &g.keys {
            let slot = k.entry.slot;
            let seal = self.sidecar(g.shard).seal_of_block(self.block_of(slot));
            let record = self.record_still_names(k);
            results.push(match seal.and_then(|s| record.map(|r| (s, r))) {
                Ok((_, Vouched::Stale)) => {
                    let why = format!(
                        "slot {slot} no longer holds the entry this handle was handed out for: the handle is stale (its lease was released, or the owner opened the store again); lease the key again"
                    );
                    (Status::InvalidArg, why)
                }
                Ok((_, Vouched::Damaged)) => {
                    add(&self.counters.integrity_failures, 1);
                    (Status::Integrity, format!("slot {slot}'s record is damaged"))
                }
                Ok((seal, Vouched::Yes)) if seal == k.entry.seal => (Status::Ok, String::new()),
                Ok(_) => {
                    let why = format!("slot {slot} holds a block other than the one its record was written for");
                    self.integrity_miss(&k.holder, &k.entry, &why);
                    (Status::Integrity, why)
                }
                Err(e) => (e.status, e.message),
            });
        }
        self.unpin(&g.keys);
        let hits = results.iter().filter(|r| r.0 == Status::Ok).count() as u64;
        add(&self.counters.hits, hits);
        add(&self.counters.misses, g.keys.len() as u64 - hits);
        for (k, (st, m)) in g.keys.iter().zip(results) {
            g.req.settle(k.index, st, m);
        }
    }
}
