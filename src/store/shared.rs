//! The store over a shared tier (`crate::shared`): what the local store misses, a get reads
//! from the shared tier into staging memory, checks, and moves to its destination (then
//! admits into the local store); what a put commits locally is read back from the local
//! store and published, behind the put or through it.
//!
//! Every wait on the shared tier ends at its bound: a get's keys still unanswered then are
//! misses (`Timeout`), whatever the backend does after. Staging memory comes in chunks of
//! `STAGING_BLOCKS`, kept for reuse, and stays with a read until its call ends.

use super::config::Key;
use super::request::StoreRequest;
use super::{add, Inner};
use crate::engine::TransferOptions;
use crate::error::{Result, Status};
use crate::layout::LayoutKind;
use crate::memory::{Layout, StorageKind};
use crate::shared::tier::{Buf, Miss};
use crate::shared::{Tier, WriteMode};
use crossbeam_channel::Sender;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// Blocks in one staging allocation: a get's misses are read in chunks of this many.
const STAGING_BLOCKS: usize = 16;
/// Staging allocations kept for reuse.
const STAGING_KEPT: usize = 8;

/// A store's shared tier and what its store side keeps.
pub(super) struct Shared {
    pub tier: Arc<Tier>,
    staging: Mutex<Vec<Arc<Layout>>>,
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
    pub fn new(tier: Tier) -> Shared {
        Shared { tier: Arc::new(tier), staging: Mutex::new(Vec::new()), publish: Mutex::new(None), pending: AtomicUsize::new(0) }
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

/// One chunk of a get's keys, read from the shared tier into one staging allocation.
struct Load {
    inner: Arc<Inner>,
    req: Arc<StoreRequest>,
    dst: Arc<Layout>,
    opts: TransferOptions,
    staging: Arc<Layout>,
    /// (index in the request, key, destination block), staging block j for keys[j].
    keys: Vec<(usize, Key, u64)>,
    /// Each read's outcome as it comes; `None` once the chunk moved on (all answered, or
    /// its bound passed).
    answers: Mutex<Option<Vec<Option<Answer>>>>,
}

impl Inner {
    fn shared(&self) -> &Shared {
        self.shared.as_ref().expect("called only with a shared tier")
    }

    /// Staging memory for `n ≤ STAGING_BLOCKS` blocks of the store's geometry: host memory
    /// the device copies from directly (pinned).
    fn staging(&self) -> Result<Arc<Layout>> {
        if let Some(s) = self.shared().staging.lock().unwrap().pop() {
            return Ok(s);
        }
        let cfg = crate::layout::LayoutConfig { num_blocks: STAGING_BLOCKS as u64, ..self.cfg.block };
        self.engine.create_layout(&cfg, LayoutKind::FullyContiguous, StorageKind::Pinned)
    }

    fn give_back_staging(&self, s: Arc<Layout>) {
        let mut kept = self.shared().staging.lock().unwrap();
        if kept.len() < STAGING_KEPT {
            kept.push(s);
        }
    }

    /// Block `j` of staging memory, for one call of the tier.
    fn staging_buf(&self, staging: &Arc<Layout>, j: usize) -> Buf {
        let bytes = staging.geometry().block_bytes as usize;
        let base = staging.bases().expect("staging is memory")[0] as *mut u8;
        // SAFETY: block j lies within the staging allocation, which `staging` (kept by the
        // Buf) owns; each block is given to one call at a time.
        unsafe { Buf::new(base.add(j * bytes), bytes, staging.clone()) }
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
        for chunk in misses.chunks(STAGING_BLOCKS) {
            let staging = match self.staging() {
                Ok(s) => s,
                Err(e) => {
                    add(&self.counters.misses, chunk.len() as u64);
                    for &(i, _, _) in chunk {
                        req.settle(i, e.status, format!("no staging memory for the shared tier: {}", e.message));
                    }
                    continue;
                }
            };
            self.begin();
            let load = Arc::new(Load {
                inner: self.clone(),
                req: req.clone(),
                dst: dst.clone(),
                opts: opts.clone(),
                staging: staging.clone(),
                keys: chunk.to_vec(),
                answers: Mutex::new(Some(vec![None; chunk.len()])),
            });
            let weak = Arc::downgrade(&load);
            tier.at(tier.deadline(), move || {
                if let Some(l) = weak.upgrade() {
                    l.answer(None);
                }
            });
            for (j, (_, key, _)) in chunk.iter().enumerate() {
                let l = load.clone();
                tier.read(key.as_bytes().to_vec(), self.staging_buf(&staging, j), move |r| l.answer(Some((j, r))));
            }
        }
    }
}

impl Load {
    /// Takes answer `(j, outcome)`, or, with `None`, the bound: then every key without an
    /// answer is a `Timeout` miss. The last answer, or the bound, moves what was read.
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
        if ok.is_empty() {
            self.inner.end();
            return;
        }
        let src_ids: Vec<u64> = ok.iter().map(|&j| j as u64).collect();
        let dst_ids: Vec<u64> = ok.iter().map(|&j| self.keys[j].2).collect();
        let me = self.clone();
        let done: crate::engine::OnComplete = Arc::new(move |r, status| {
            let msg = r.error_message().to_string_lossy().into_owned();
            me.moved(&ok, status, msg);
        });
        let opts = TransferOptions { on_complete: Some(done), ..self.opts.clone() };
        if let Err(e) = self.inner.engine.submit_for_store(&self.staging, &src_ids, &self.dst, &dst_ids, &opts, None) {
            for &j in &src_ids {
                self.miss(self.keys[j as usize].0, e.status, e.message.clone());
            }
            self.inner.end();
        }
    }

    fn miss(&self, i: usize, status: Status, why: String) {
        add(&self.inner.counters.misses, 1);
        self.req.settle(i, status, why);
    }

    /// The move of the blocks read (`ok`, staging indices) ended with `status`: settles
    /// their keys, then admits them into the local store, on a tier thread (that put's
    /// wait must not run in an engine callback).
    fn moved(self: &Arc<Self>, ok: &[usize], status: Status, msg: String) {
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
        let (me, ok) = (self.clone(), ok.to_vec());
        self.inner.shared().tier.spawn(move || {
            if admit {
                let ids: Vec<u64> = ok.iter().map(|&j| j as u64).collect();
                let keys: Vec<Key> = ok.iter().map(|&j| me.keys[j].1).collect();
                match me.inner.put_keys(&me.staging, &ids, keys, &TransferOptions::default()) {
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

impl Drop for Load {
    fn drop(&mut self) {
        // Every call that wrote into the staging memory has ended (each held this load).
        self.inner.give_back_staging(self.staging.clone());
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
            while keys < STAGING_BLOCKS {
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
        for chunk in committed.chunks(STAGING_BLOCKS) {
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
        let staging = match self.staging() {
            Ok(s) => s,
            Err(e) => {
                self.shared().tier.dropped(keys.len() as u64);
                return keys.iter().map(|&(i, _)| (i, e.status, format!("no staging memory to publish: {}", e.message))).collect();
            }
        };
        let ids: Vec<u64> = (0..keys.len() as u64).collect();
        let local_keys: Vec<Key> = keys.iter().map(|k| k.1).collect();
        let back = match self.get_keys(local_keys, &staging, &ids, &TransferOptions::default(), false) {
            Ok(r) => r,
            Err(e) => return keys.iter().map(|&(i, _)| (i, e.status, e.message.clone())).collect(),
        };
        back.wait(None);
        let tier = self.shared().tier.clone();
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
            tier.write(key.as_bytes().to_vec(), self.staging_buf(&staging, j), move |r| {
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
        // The staging goes back only when no write still reads it: each write holds it.
        if Arc::strong_count(&staging) == 1 {
            self.give_back_staging(staging);
        }
        out
    }

    /// The mode puts publish in.
    pub(super) fn write_mode(&self) -> Option<WriteMode> {
        self.shared.as_ref().map(|s| s.tier.config().write)
    }
}
