//! Publishing a store's puts to its shared tier: what a put commits locally is read back
//! from the local store (a verified get) into staging and written as objects, behind the
//! put (bounded by `pending_puts`, dropped and counted past it) or through it (the put's
//! keys end once published).
//!
//! One thread (`kvx-store-publish`) takes the puts in order, those queued together as one
//! round, and starts their writes; it does not wait for them, so rounds overlap. Puts are
//! bulk work beside the gets that read the same tier: the publisher keeps at most half the
//! tier's threads writing, and takes staging in turn with the gets' chunks. Each put's bound
//! counts from the put: a round ends when every write answered or at its earliest put's
//! bound, whichever is first, and keys unanswered then end `Timeout`; a round whose bound
//! passed while it was queued (a hung backend holding staging or writers) ends at once.

use super::config::Key;
use super::request::StoreRequest;
use super::staging::LEASE_BLOCKS;
use super::Inner;
use crate::engine::TransferOptions;
use crate::error::Status;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Keys a put committed (or will) locally, to publish once its local request ends.
pub(super) struct Publish {
    local: Arc<StoreRequest>,
    keys: Vec<(usize, Key)>,
    /// Write-through: the caller's request, whose keys end once published.
    through: Option<Arc<StoreRequest>>,
    /// When its keys end, published or not.
    deadline: Instant,
}

/// A key's outcome: (index in its put, status, why).
type Outcome = (usize, Status, String);

/// Puts published together, and their keys' outcomes as they come.
struct Round {
    inner: Arc<Inner>,
    jobs: Vec<Publish>,
    /// Each job's outcomes so far and the writes still unanswered; `None` once it ended.
    state: Mutex<Option<(Vec<Vec<Outcome>>, usize)>>,
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
        let job = Publish { local: local.clone(), keys, through, deadline: sh.tier.deadline() };
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
    fn published(&self, job: &Publish, results: Vec<Outcome>) {
        self.shared().pending.fetch_sub(job.keys.len(), Ordering::Relaxed);
        if let Some(t) = &job.through {
            results.into_iter().for_each(|(i, st, why)| t.settle(i, st, why));
        }
        self.end();
    }

    /// The publisher (`kvx-store-publish`): takes a put, and those queued behind it up to a
    /// lease's worth of keys, and publishes them as one round. Puts of a block or two each
    /// (a runtime's usual) would otherwise have one write in flight at a time.
    pub(super) fn run_publisher(self: Arc<Self>, rx: crossbeam_channel::Receiver<Publish>) {
        while let Ok(first) = rx.recv() {
            let mut keys = first.keys.len();
            let mut jobs = vec![first];
            while keys < LEASE_BLOCKS {
                let Ok(job) = rx.try_recv() else { break };
                keys += job.keys.len();
                jobs.push(job);
            }
            self.start_round(jobs);
        }
    }

    /// Waits for `jobs`' local requests, then starts writing what they committed, a lease of
    /// staging at a time.
    fn start_round(self: &Arc<Self>, jobs: Vec<Publish>) {
        let mut outcomes: Vec<Vec<Outcome>> = jobs.iter().map(|_| Vec::new()).collect();
        // (job, index in its put, key) of each committed key.
        let mut committed = Vec::new();
        for (n, job) in jobs.iter().enumerate() {
            job.local.wait(None);
            for &(i, key) in &job.keys {
                match job.local.key_status(i) {
                    Some(Status::Ok) => committed.push((n, i, key)),
                    st => outcomes[n].push((i, st.unwrap_or(Status::Internal), job.local.key_message(i))),
                }
            }
        }
        let writes = committed.len();
        let round = Arc::new(Round { inner: self.clone(), jobs, state: Mutex::new(Some((outcomes, writes))) });
        if writes == 0 {
            round.end();
            return;
        }
        let tier = self.shared().tier.clone();
        let deadline = round.jobs.iter().map(|j| j.deadline).min().expect("a round has a job");
        let weak = Arc::downgrade(&round);
        tier.at(deadline, move || {
            if let Some(r) = weak.upgrade() {
                r.end();
            }
        });
        for chunk in committed.chunks(LEASE_BLOCKS) {
            let Some(slots) = self.shared().staging.lease_by(chunk.len(), deadline) else {
                // The round's bound passed waiting for staging: the rest end `Timeout`.
                round.end();
                break;
            };
            let ids: Vec<u64> = slots.iter().map(|s| s.id()).collect();
            let keys: Vec<Key> = chunk.iter().map(|k| k.2).collect();
            let back = match self.get_keys(keys, self.shared().staging.layout(), &ids, &TransferOptions::default(), false) {
                Ok(r) => r,
                Err(e) => {
                    chunk.iter().for_each(|&(n, i, _)| round.record(n, (i, e.status, e.message.clone())));
                    continue;
                }
            };
            back.wait(None);
            for (j, &(n, i, key)) in chunk.iter().enumerate() {
                if back.key_status(j) != Some(Status::Ok) {
                    // Evicted or removed since its put: nothing to publish.
                    tier.dropped(1);
                    round.record(n, (i, back.key_status(j).unwrap_or(Status::Internal), back.key_message(j)));
                    continue;
                }
                if !self.start_writing(deadline) {
                    round.end(); // the round's bound passed waiting for a writer
                    return;
                }
                // Each write holds its staging block until it ends.
                let (r, me) = (round.clone(), self.clone());
                tier.write(key.as_bytes().to_vec(), slots[j].buf(), move |w| {
                    me.done_writing();
                    let outcome = match w {
                        Ok(()) => (i, Status::Ok, String::new()),
                        Err(e) => (i, e.status, format!("publishing to the shared tier: {}", e.message)),
                    };
                    r.record(n, outcome);
                });
            }
        }
    }
}

impl Inner {
    /// Takes one of the publisher's writers (half the tier's threads, so gets always find
    /// some), waiting for one until `deadline`; whether it got one.
    fn start_writing(&self, deadline: Instant) -> bool {
        let sh = self.shared();
        let most = (sh.tier.config().threads() / 2).max(1);
        let mut writing = sh.writing.lock().unwrap();
        while *writing >= most {
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            writing = sh.wrote.wait_timeout(writing, deadline - now).unwrap().0;
        }
        *writing += 1;
        true
    }

    fn done_writing(&self) {
        let sh = self.shared();
        *sh.writing.lock().unwrap() -= 1;
        sh.wrote.notify_one();
    }
}

impl Drop for Round {
    /// A round no write holds any more has nothing more coming: it ends now.
    fn drop(&mut self) {
        self.end();
    }
}

impl Round {
    /// Takes job `n`'s key's outcome; the last ends the round.
    fn record(&self, n: usize, outcome: Outcome) {
        let mut st = self.state.lock().unwrap();
        let Some((outcomes, left)) = st.as_mut() else { return };
        outcomes[n].push(outcome);
        *left -= 1;
        if *left == 0 {
            drop(st);
            self.end();
        }
    }

    /// Ends the round (once): every key without an outcome ends `Timeout`, and each job
    /// gives its keys their outcomes.
    fn end(&self) {
        let Some((mut outcomes, _)) = self.state.lock().unwrap().take() else { return };
        let tier = &self.inner.shared().tier;
        for (job, out) in self.jobs.iter().zip(&mut outcomes) {
            let answered: std::collections::HashSet<usize> = out.iter().map(|o| o.0).collect();
            for &(i, _) in job.keys.iter().filter(|(i, _)| !answered.contains(i)) {
                tier.timed_out(1);
                out.push((i, Status::Timeout, format!("{} did not take the object within {:?}", tier.describe(), tier.config().timeout())));
            }
        }
        for (job, out) in self.jobs.iter().zip(outcomes) {
            self.inner.published(job, out);
        }
    }
}
