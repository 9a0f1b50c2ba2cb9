//! The store over a shared tier (`crate::shared`): what the local store misses, a get reads
//! from the shared tier into staging memory, checks, and moves to its destination (then
//! admits into the local store); what a put commits locally is published (`publish`),
//! behind the put or through it.
//!
//! Every wait on the shared tier ends at its bound: a get's keys still unanswered then are
//! misses (`Timeout`), whatever the backend does after. Staging memory (`staging`) is leased
//! `LEASE_BLOCKS` blocks at a time, and stays with a read until its call ends.

use super::config::Key;
use super::publish::Publish;
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
use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Condvar, Mutex};

/// A store's shared tier and what its store side keeps.
pub(super) struct Shared {
    pub tier: Arc<Tier>,
    pub(super) staging: Arc<Staging>,
    /// The publisher's queue (`None` once the store closes).
    pub(super) publish: Mutex<Option<Sender<Publish>>>,
    /// Blocks queued to be written behind.
    pub(super) pending: AtomicUsize,
    /// The publisher's writes in flight, and their bound (`publish`).
    pub(super) writing: Mutex<usize>,
    pub(super) wrote: Condvar,
}

impl Shared {
    pub fn new(tier: Tier, engine: &Engine, block: &LayoutConfig) -> Result<Shared> {
        let staging = Staging::new(engine, block)?;
        Ok(Shared {
            tier: Arc::new(tier),
            staging,
            publish: Mutex::new(None),
            pending: AtomicUsize::new(0),
            writing: Mutex::new(0),
            wrote: Condvar::new(),
        })
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
    pub(super) fn shared(&self) -> &Shared {
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
                true => {
                    let weak = Arc::downgrade(&load);
                    let wanted = move || weak.upgrade().is_some_and(|l| l.answers.lock().unwrap().is_some());
                    self.shared().staging.lease(chunk.len(), wanted, move |slots| load.start(slots))
                }
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
        let at_bound = a.is_none();
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
        if at_bound {
            // A chunk still waiting for staging waits no more.
            self.inner.shared().staging.drop_stale();
        }
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
    /// The mode puts publish in.
    pub(super) fn write_mode(&self) -> Option<WriteMode> {
        self.shared.as_ref().map(|s| s.tier.config().write)
    }
}
