//! The store over a shared tier (`crate::shared`): what the local store misses, a get reads
//! from the shared tier into staging memory, checks, and moves to its destination (then
//! admits into the local store); what a put commits locally is read back from the local
//! store and published, behind the put or through it.
//!
//! Every wait on the shared tier ends at its bound: a get's keys still unanswered then are
//! misses (`Timeout`), whatever the backend does after. Staging memory (`staging`) is leased
//! `LEASE_BLOCKS` blocks at a time, and stays with a read until its call ends.

use super::config::Key;
use super::request::StoreRequest;
use super::staging::{Slot, Staging, LEASE_BLOCKS};
use super::{add, Inner};
use crate::engine::{Engine, TransferOptions};
use crate::error::{Result, Status};
use crate::layout::LayoutConfig;
use crate::memory::{Layout, StorageKind};
use crate::shared::read::{Claim, Dest};
use crate::shared::tier::Miss;
use crate::shared::{Tier, WriteMode};
use crossbeam_channel::Sender;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// A store's shared tier and what its store side keeps.
pub(super) struct Shared {
    pub tier: Arc<Tier>,
    staging: Arc<Staging>,
    /// The publisher's queue (`None` once the store closes).
    publish: Mutex<Option<Sender<Publish>>>,
    /// Blocks queued to be written behind.
    pending: AtomicUsize,
}

/// Keys a put committed (or will) locally, to publish once its local request ends.
pub(super) struct Publish {
    local: Arc<StoreRequest>,
    keys: Vec<(usize, Key)>,
    /// Write-through: the caller's request, whose keys end once published.
    through: Option<Arc<StoreRequest>>,
}

impl Shared {
    pub fn new(tier: Tier, engine: &Engine, block: &LayoutConfig) -> Result<Shared> {
        let staging = Staging::new(engine, block)?;
        Ok(Shared { tier: Arc::new(tier), staging, publish: Mutex::new(None), pending: AtomicUsize::new(0) })
    }

    pub fn set_publisher(&self, tx: Sender<Publish>) {
        *self.publish.lock().unwrap() = Some(tx);
    }

    /// Stops taking puts to publish; the publisher ends once its queue is empty.
    pub fn stop_publishing(&self) {
        self.publish.lock().unwrap().take();
    }
}

/// What one read of the shared tier found.
type Answer = std::result::Result<(), Miss>;

/// One chunk of a get's keys, read from the shared tier.
///
/// Into a destination in host memory, each read goes straight into its block, under its
/// key's claim (withdrawn at the bound, before the key settles, so a late read never
/// writes memory the caller has back); with `admit`, into a staging block too, from which
/// the key is admitted after it settles. Into any other destination (the device), reads go
/// to staging and the engine moves them.
struct Load {
    inner: Arc<Inner>,
    req: Arc<StoreRequest>,
    dst: Arc<Layout>,
    opts: TransferOptions,
    /// Reads land in the destination itself; `claims[j]` guards `keys[j]`'s block.
    direct: bool,
    claims: Vec<Arc<Claim>>,
    /// The lease of staging, once granted (slot `j` for `keys[j]`), until the reads are
    /// answered; none for direct reads that admit nothing.
    slots: Mutex<Option<Vec<Arc<Slot>>>>,
    /// (index in the request, key, destination block).
    keys: Vec<(usize, Key, u64)>,
    /// Each read's outcome as it comes; `None` once the chunk moved on (all answered, or
    /// its bound passed).
    answers: Mutex<Option<Vec<Option<Answer>>>>,
}

impl Inner {
    fn shared(&self) -> &Shared {
        self.shared.as_ref().expect("called only with a shared tier")
    }

    /// Loads `misses` (keys the local store does not hold) from the shared tier into their
    /// destination blocks, settling each key on `req`.
    pub(super) fn load_shared(
        self: &Arc<Self>,
        req: &Arc<StoreRequest>,
        misses: Vec<(usize, Key, u64)>,
        dst: &Arc<Layout>,
        opts: &TransferOptions,
    ) {
        let tier = self.shared().tier.clone();
        let whole = opts.layer_begin == 0 && (opts.layer_end == 0 || opts.layer_end as u64 == dst.geometry().cfg.num_layers);
        let direct = whole && dst.host_addressable() && matches!(dst.kind(), StorageKind::Pinned | StorageKind::Host);
        let staged = !direct || tier.config().admit;
        for chunk in misses.chunks(LEASE_BLOCKS) {
            self.begin();
            let load = Arc::new(Load {
                inner: self.clone(),
                req: req.clone(),
                dst: dst.clone(),
                opts: opts.clone(),
                direct,
                claims: chunk.iter().filter(|_| direct).map(|_| Claim::new()).collect(),
                slots: Mutex::new(None),
                keys: chunk.to_vec(),
                answers: Mutex::new(Some(vec![None; chunk.len()])),
            });
            // The bound counts from the call, a wait for staging included.
            let weak = Arc::downgrade(&load);
            tier.at(tier.deadline(), move || {
                if let Some(l) = weak.upgrade() {
                    l.answer(None);
                }
            });
            match staged {
                true => self.shared().staging.lease(chunk.len(), move |slots| load.start(slots)),
                false => load.start(Vec::new()),
            }
        }
    }
}

impl Load {
    /// Starts the reads, into `slots` (when staged) and the destination (when direct).
    fn start(self: &Arc<Self>, slots: Vec<Arc<Slot>>) {
        let mut dests: Vec<Dest> = self.keys.iter().map(|_| Dest::new()).collect();
        for (j, d) in dests.iter_mut().enumerate() {
            if self.direct {
                // SAFETY: the block's spans lie in the destination, which `dst` keeps; the
                // read writes them only while the key's claim stands, and the claim is
                // withdrawn before the key settles.
                unsafe { d.add(self.block_spans(self.keys[j].2), Some(self.claims[j].clone()), self.dst.clone()) };
            }
            if let Some(slot) = slots.get(j) {
                slot.add_to(d);
            }
        }
        {
            let answers = self.answers.lock().unwrap();
            if answers.is_none() {
                return; // past its bound already: the lease goes straight back
            }
            *self.slots.lock().unwrap() = Some(slots);
        }
        let tier = &self.inner.shared().tier;
        for (j, ((_, key, _), d)) in self.keys.iter().zip(dests).enumerate() {
            let l = self.clone();
            tier.read(key.as_bytes().to_vec(), d, move |r| l.answer(Some((j, r))));
        }
    }

    /// Destination block `block`'s bytes in the order an object holds them (layer, then
    /// outer, each a region), adjacent regions merged.
    fn block_spans(&self, block: u64) -> Vec<(*mut u8, usize)> {
        let p = &self.dst.placement;
        let (c, region) = (p.geom.cfg, p.geom.region_bytes as usize);
        let bases = self.dst.bases().expect("a direct destination is memory");
        let mut spans: Vec<(*mut u8, usize)> = Vec::new();
        for layer in 0..c.num_layers {
            for outer in 0..c.outer_dim {
                let loc = p.region(block, layer, outer);
                let at = (bases[loc.base as usize] + loc.offset) as usize;
                match spans.last_mut() {
                    Some((ptr, len)) if *ptr as usize + *len == at => *len += region,
                    _ => spans.push((at as *mut u8, region)),
                }
            }
        }
        spans
    }

    /// Takes answer `(j, outcome)`, or, with `None`, the bound: then every key without an
    /// answer is a `Timeout` miss. The last answer, or the bound, settles or moves what was
    /// read.
    fn answer(self: &Arc<Self>, a: Option<(usize, Answer)>) {
        let answers = {
            let mut guard = self.answers.lock().unwrap();
            let Some(answers) = guard.as_mut() else { return };
            match a {
                Some((j, r)) => {
                    answers[j] = Some(r);
                    if answers.iter().any(|x| x.is_none()) {
                        return;
                    }
                }
                None => {
                    let late = answers.iter().filter(|x| x.is_none()).count();
                    self.inner.shared().tier.timed_out(late as u64);
                    // Late reads write no more into the destination from here.
                    self.claims.iter().for_each(|c| c.withdraw());
                }
            }
            guard.take().unwrap()
        };
        let tier = &self.inner.shared().tier;
        let mut ok = Vec::new();
        for (j, ans) in answers.into_iter().enumerate() {
            let (i, _, _) = self.keys[j];
            match ans {
                Some(Ok(())) => ok.push(j),
                Some(Err(m)) => self.miss(i, m.status, m.why),
                None => {
                    let why = format!("{} did not answer within {:?}: a miss", tier.describe(), tier.config().timeout());
                    self.miss(i, Status::Timeout, why);
                }
            }
        }
        // The blocks read stay leased until moved (and admitted); the rest go back now, but
        // for those a late call still holds. (No lease: direct reads that admit nothing, or
        // a bound that passed first.)
        let all = self.slots.lock().unwrap().take().unwrap_or_default();
        let slots: Vec<Arc<Slot>> = ok.iter().filter_map(|&j| all.get(j).cloned()).collect();
        drop(all);
        if ok.is_empty() {
            self.inner.end();
            return;
        }
        if self.direct {
            self.moved(&ok, &slots, Status::Ok, String::new());
            return;
        }
        let src_ids: Vec<u64> = slots.iter().map(|s| s.id()).collect();
        let dst_ids: Vec<u64> = ok.iter().map(|&j| self.keys[j].2).collect();
        let (me, moving) = (self.clone(), ok.clone());
        let done: crate::engine::OnComplete = Arc::new(move |r, status| {
            let msg = r.error_message().to_string_lossy().into_owned();
            me.moved(&moving, &slots, status, msg);
        });
        let opts = TransferOptions { on_complete: Some(done), ..self.opts.clone() };
        let staging = self.inner.shared().staging.layout();
        if let Err(e) = self.inner.engine.submit_for_store(staging, &src_ids, &self.dst, &dst_ids, &opts, None) {
            for &j in &ok {
                self.miss(self.keys[j].0, e.status, e.message.clone());
            }
            self.inner.end();
        }
    }

    fn miss(&self, i: usize, status: Status, why: String) {
        add(&self.inner.counters.misses, 1);
        self.req.settle(i, status, why);
    }

    /// The blocks read (`ok`, indices into `keys`; `slots`, their staging) are in their
    /// destination, or their move ended with `status`: settles their keys, then admits them
    /// into the local store from staging, on a tier thread (that put's wait must not run in
    /// an engine callback).
    fn moved(self: &Arc<Self>, ok: &[usize], slots: &[Arc<Slot>], status: Status, msg: String) {
        for &j in ok {
            match status {
                Status::Ok => {
                    add(&self.inner.counters.hits, 1);
                    self.req.settle(self.keys[j].0, Status::Ok, "");
                }
                st => self.miss(self.keys[j].0, st, format!("moving a shared-tier block to its destination: {msg}")),
            }
        }
        let admit = status == Status::Ok && self.inner.shared().tier.config().admit;
        let (me, ok, slots) = (self.clone(), ok.to_vec(), slots.to_vec());
        self.inner.shared().tier.spawn(move || {
            if admit {
                let ids: Vec<u64> = slots.iter().map(|s| s.id()).collect();
                let keys: Vec<Key> = ok.iter().map(|&j| me.keys[j].1).collect();
                match me.inner.put_keys(me.inner.shared().staging.layout(), &ids, keys, &TransferOptions::default()) {
                    Ok(r) => {
                        r.wait(None);
                    }
                    Err(e) => log::debug!("admitting shared-tier blocks into the store: {}", e.message),
                }
            }
            me.inner.end();
        });
    }
}

impl Inner {
    /// Queues the keys of a local put (`local`) to be published once it ends. Behind: past
    /// the pending bound, keys are dropped and counted. Through: `through` is the caller's
    /// request, whose keys end once published.
    pub(super) fn publish(&self, local: &Arc<StoreRequest>, keys: Vec<Key>, through: Option<Arc<StoreRequest>>) {
        let sh = self.shared();
        let mut keys: Vec<(usize, Key)> = keys.into_iter().enumerate().collect();
        if through.is_none() {
            let room = sh.tier.config().pending_puts().saturating_sub(sh.pending.load(Ordering::Relaxed));
            if keys.len() > room {
                sh.tier.dropped((keys.len() - room) as u64);
                keys.truncate(room);
            }
            if keys.is_empty() {
                return;
            }
        }
        sh.pending.fetch_add(keys.len(), Ordering::Relaxed);
        self.begin();
        let job = Publish { local: local.clone(), keys, through };
        let sent = match sh.publish.lock().unwrap().as_ref() {
            Some(tx) => tx.send(job).map_err(|e| e.0),
            None => Err(job),
        };
        if let Err(job) = sent {
            if job.through.is_none() {
                sh.tier.dropped(job.keys.len() as u64);
            }
            let results = job.keys.iter().map(|&(i, _)| (i, Status::Shutdown, "the store is closing".to_string())).collect();
            self.published(&job, results);
        }
    }

    /// Ends a publish job: gives each write-through key its outcome.
    fn published(&self, job: &Publish, results: Vec<(usize, Status, String)>) {
        self.shared().pending.fetch_sub(job.keys.len(), Ordering::Relaxed);
        if let Some(t) = &job.through {
            results.into_iter().for_each(|(i, st, why)| t.settle(i, st, why));
        }
        self.end();
    }

    /// The publisher (`kvx-store-publish`): takes a put, and those queued behind it up to a
    /// chunk's worth of keys, waits for their local requests, reads back the keys they
    /// committed and writes their objects at once. Puts of a block or two each (a runtime's
    /// usual) would otherwise have one write in flight at a time, whatever the tier's threads.
    pub(super) fn run_publisher(self: Arc<Self>, rx: crossbeam_channel::Receiver<Publish>) {
        while let Ok(first) = rx.recv() {
            let mut keys = first.keys.len();
            let mut jobs = vec![first];
            while keys < LEASE_BLOCKS {
                let Ok(job) = rx.try_recv() else { break };
                keys += job.keys.len();
                jobs.push(job);
            }
            self.publish_jobs(&jobs);
        }
    }

    /// Publishes what `jobs` committed locally, in chunks, and ends each job.
    fn publish_jobs(self: &Arc<Self>, jobs: &[Publish]) {
        let mut results: Vec<Vec<(usize, Status, String)>> = jobs.iter().map(|_| Vec::new()).collect();
        // The (job, index in its put) of each committed key, in the order they are published.
        let mut owners = Vec::new();
        let mut committed = Vec::new();
        for (n, job) in jobs.iter().enumerate() {
            job.local.wait(None);
            for &(i, key) in &job.keys {
                match job.local.key_status(i) {
                    Some(Status::Ok) => {
                        committed.push((owners.len(), key));
                        owners.push((n, i));
                    }
                    st => results[n].push((i, st.unwrap_or(Status::Internal), job.local.key_message(i))),
                }
            }
        }
        for chunk in committed.chunks(LEASE_BLOCKS) {
            for (at, st, why) in self.publish_chunk(chunk) {
                let (n, i) = owners[at];
                results[n].push((i, st, why));
            }
        }
        for (job, r) in jobs.iter().zip(results) {
            self.published(job, r);
        }
    }

    /// Reads `keys` back from the local store and publishes them; each key's outcome.
    fn publish_chunk(self: &Arc<Self>, keys: &[(usize, Key)]) -> Vec<(usize, Status, String)> {
        let tier = self.shared().tier.clone();
        let Some(slots) = self.shared().staging.lease_by(keys.len(), tier.deadline()) else {
            tier.timed_out(keys.len() as u64);
            let why =
                format!("no staging memory came free within {:?} to publish; the shared tier's reads hold it", tier.config().timeout());
            return keys.iter().map(|&(i, _)| (i, Status::Timeout, why.clone())).collect();
        };
        let ids: Vec<u64> = slots.iter().map(|s| s.id()).collect();
        let local_keys: Vec<Key> = keys.iter().map(|k| k.1).collect();
        let back = match self.get_keys(local_keys, self.shared().staging.layout(), &ids, &TransferOptions::default(), false) {
            Ok(r) => r,
            Err(e) => return keys.iter().map(|&(i, _)| (i, e.status, e.message.clone())).collect(),
        };
        back.wait(None);
        let (tx, rx) = crossbeam_channel::bounded(keys.len());
        let mut out = Vec::new();
        let mut sent = 0;
        for (j, &(i, key)) in keys.iter().enumerate() {
            if back.key_status(j) != Some(Status::Ok) {
                // Evicted or removed since its put: nothing to publish.
                tier.dropped(1);
                out.push((i, back.key_status(j).unwrap_or(Status::Internal), back.key_message(j)));
                continue;
            }
            let tx = tx.clone();
            tier.write(key.as_bytes().to_vec(), slots[j].buf(), move |r| {
                let _ = tx.send((i, r));
            });
            sent += 1;
        }
        let deadline = tier.deadline();
        for _ in 0..sent {
            match rx.recv_deadline(deadline) {
                Ok((i, Ok(()))) => out.push((i, Status::Ok, String::new())),
                Ok((i, Err(e))) => out.push((i, e.status, format!("publishing to the shared tier: {}", e.message))),
                Err(_) => break,
            }
        }
        let answered: std::collections::HashSet<usize> = out.iter().map(|o| o.0).collect();
        let late: Vec<usize> = keys.iter().map(|k| k.0).filter(|i| !answered.contains(i)).collect();
        tier.timed_out(late.len() as u64);
        for i in late {
            out.push((i, Status::Timeout, format!("{} did not take the object within {:?}", tier.describe(), tier.config().timeout())));
        }
        // Each block goes back once no write still reads it: each write holds its own.
        out
    }

    /// The mode puts publish in.
    pub(super) fn write_mode(&self) -> Option<WriteMode> {
        self.shared.as_ref().map(|s| s.tier.config().write)
    }
}
