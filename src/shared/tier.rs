//! The tier's machinery: a backend's blocking calls run on threads of the tier's own, each
//! object checked as it is read, and a timer that ends a caller's wait at its bound
//! whatever the backend does. A call that outlives its bound still runs to its end on its
//! thread (nothing can interrupt a blocked system call or socket read); the memory it
//! reads into stays alive until then, or is the caller's and is no longer written
//! (`read::Dest`), and its answer is dropped.

use super::backend::Backend;
use super::object::{self, Expected, HEADER_BYTES};
use super::read::{Checked, Dest, Outcome};
use super::SharedConfig;
use crate::error::{Error, Result, Status};
use crate::layout::LayoutConfig;
use crossbeam_channel::{Receiver, Sender};
use std::collections::BinaryHeap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

type Job = Box<dyn FnOnce() + Send>;

/// A failed existence check is logged at warn at most once in this long, the others at
/// debug: a faulty backend fails every lookup's checks, and one line says what happened.
const WARN_EVERY: std::time::Duration = std::time::Duration::from_secs(10);

/// Memory a write publishes from, kept alive (by `keep`) until the call ends.
pub struct Buf {
    ptr: *mut u8,
    len: usize,
    _keep: Arc<dyn Send + Sync>,
}

// SAFETY: a Buf is handed to one call at a time, whose caller guarantees no one else
// touches those bytes until the call ends; `_keep` owns the memory.
unsafe impl Send for Buf {}

impl Buf {
    /// # Safety
    /// `ptr..ptr+len` stays valid while `keep` lives, and nothing else reads or writes it
    /// until the call it is given to ends.
    pub unsafe fn new(ptr: *mut u8, len: usize, keep: Arc<dyn Send + Sync>) -> Buf {
        Buf { ptr, len, _keep: keep }
    }

    fn slice(&mut self) -> &mut [u8] {
        // SAFETY: see `new`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

/// What the shared tier did since it was opened.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TierStats {
    /// Blocks read and checked.
    pub hits: u64,
    /// Reads that found no object.
    pub misses: u64,
    /// Objects that failed a check (damaged, cut short, of another namespace or key).
    pub integrity_failures: u64,
    /// Calls whose caller stopped waiting at its bound.
    pub timeouts: u64,
    /// Calls that failed (the backend's error).
    pub errors: u64,
    /// Objects published.
    pub puts: u64,
    /// Objects not written: more were waiting than the tier keeps, or the write failed.
    pub puts_dropped: u64,
    /// Calls made to the backend (existence checks, reads, writes): what a bucket bills.
    pub requests: u64,
}

#[derive(Default)]
struct Counters {
    hits: AtomicU64,
    misses: AtomicU64,
    integrity_failures: AtomicU64,
    timeouts: AtomicU64,
    errors: AtomicU64,
    puts: AtomicU64,
    puts_dropped: AtomicU64,
    requests: AtomicU64,
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

/// Timed actions, soonest first.
struct Timer {
    due: Mutex<(BinaryHeap<Due>, bool)>,
    wake: Condvar,
}

struct Due(Instant, u64, Job);

impl PartialEq for Due {
    fn eq(&self, o: &Due) -> bool {
        (self.0, self.1) == (o.0, o.1)
    }
}
impl Eq for Due {}
impl PartialOrd for Due {
    fn partial_cmp(&self, o: &Due) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Due {
    fn cmp(&self, o: &Due) -> std::cmp::Ordering {
        (o.0, o.1).cmp(&(self.0, self.1))
    }
}

pub struct Tier {
    backend: Arc<dyn Backend>,
    /// Shared with each call's job, which checks or writes it into the header.
    namespace: Arc<[u8]>,
    block: LayoutConfig,
    cfg: SharedConfig,
    jobs: Option<Sender<Job>>,
    timer: Arc<Timer>,
    next_due: AtomicU64,
    counters: Arc<Counters>,
    threads: Vec<JoinHandle<()>>,
    /// When a failed existence check was last logged at warn (`WARN_EVERY`).
    warned: Mutex<Option<Instant>>,
}

/// Why a read served nothing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Miss {
    pub status: Status,
    pub why: String,
}

impl Tier {
    /// Opens the configured backend (refusing bad configuration now, with the reason) and
    /// starts the tier's threads.
    pub fn open(cfg: &SharedConfig, namespace: &[u8], block: LayoutConfig) -> Result<Tier> {
        cfg.validate()?;
        let backend = cfg.open_backend()?;
        Ok(Tier::with_backend(backend, cfg, namespace, block))
    }

    /// As `open`, over a backend made by the caller.
    pub fn with_backend(backend: Arc<dyn Backend>, cfg: &SharedConfig, namespace: &[u8], block: LayoutConfig) -> Tier {
        let (tx, rx): (Sender<Job>, Receiver<Job>) = crossbeam_channel::unbounded();
        let mut threads: Vec<JoinHandle<()>> = (0..cfg.threads())
            .map(|i| {
                let rx = rx.clone();
                std::thread::Builder::new()
                    .name(format!("kvx-shared-{i}"))
                    .spawn(move || rx.iter().for_each(|job| job()))
                    .expect("spawning a shared-tier thread")
            })
            .collect();
        let timer = Arc::new(Timer { due: Mutex::new((BinaryHeap::new(), false)), wake: Condvar::new() });
        let t = timer.clone();
        threads.push(std::thread::Builder::new().name("kvx-shared-timer".into()).spawn(move || run_timer(&t)).expect("spawning the timer"));
        Tier {
            backend,
            namespace: namespace.into(),
            block: LayoutConfig { num_blocks: 1, ..block },
            cfg: cfg.clone(),
            jobs: Some(tx),
            timer,
            next_due: AtomicU64::new(0),
            counters: Arc::default(),
            threads,
            warned: Mutex::new(None),
        }
    }

    pub fn describe(&self) -> String {
        self.backend.describe()
    }

    pub fn config(&self) -> &SharedConfig {
        &self.cfg
    }

    pub fn stats(&self) -> TierStats {
        let c = &self.counters;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        TierStats {
            hits: l(&c.hits),
            misses: l(&c.misses),
            integrity_failures: l(&c.integrity_failures),
            timeouts: l(&c.timeouts),
            errors: l(&c.errors),
            puts: l(&c.puts),
            puts_dropped: l(&c.puts_dropped),
            requests: l(&c.requests),
        }
    }

    /// Runs `job` on one of the tier's threads.
    pub fn spawn(&self, job: impl FnOnce() + Send + 'static) {
        if let Some(tx) = &self.jobs {
            let _ = tx.send(Box::new(job));
        }
    }

    /// Runs `job` on the timer's thread at `at` (so it must not block).
    pub fn at(&self, at: Instant, job: impl FnOnce() + Send + 'static) {
        let mut d = self.timer.due.lock().unwrap();
        d.0.push(Due(at, self.next_due.fetch_add(1, Ordering::Relaxed), Box::new(job)));
        self.timer.wake.notify_one();
    }

    /// When a call started now must end for its caller.
    pub fn deadline(&self) -> Instant {
        Instant::now() + self.cfg.timeout()
    }

    /// Counts a caller that stopped waiting at its bound.
    pub fn timed_out(&self, n: u64) {
        self.counters.timeouts.fetch_add(n, Ordering::Relaxed);
    }

    /// Reads `key`'s object into `dest` (one block's bytes in each of its targets), on a tier
    /// thread, and hands `done` the outcome: `Ok` only when the object is `key`'s block in
    /// this namespace and geometry and its checksum holds. The header is checked before any
    /// payload is placed; on a miss, what `dest` holds is unspecified.
    pub fn read(&self, key: Vec<u8>, dest: Dest, done: impl FnOnce(std::result::Result<(), Miss>) + Send + 'static) {
        let (backend, counters, name) = (self.backend.clone(), self.counters.clone(), object::name(&self.namespace, &key));
        let (namespace, block) = (self.namespace.clone(), self.block);
        self.spawn(move || {
            bump(&counters.requests);
            let want = Expected { namespace: &namespace, key: &key, block: &block };
            let payload_bytes = want.payload_bytes() as usize;
            let object_bytes = (HEADER_BYTES + payload_bytes) as u64;
            let mut sink = Checked::new(&want, object_bytes, dest);
            let outcome = match backend.read(&name, HEADER_BYTES, payload_bytes, &mut sink) {
                Ok(None) => {
                    bump(&counters.misses);
                    Err(Miss { status: Status::NotFound, why: "neither the store nor the shared tier holds this key".into() })
                }
                Ok(Some(len)) => {
                    let outcome = match len == object_bytes {
                        true => sink.outcome(),
                        false => Outcome::Bad(format!("it is {len} bytes; header and payload are {object_bytes}")),
                    };
                    match outcome {
                        Outcome::Good => {
                            bump(&counters.hits);
                            Ok(())
                        }
                        Outcome::Withdrawn => Err(Miss { status: Status::Timeout, why: "its caller stopped waiting".into() }),
                        Outcome::Bad(why) => {
                            bump(&counters.integrity_failures);
                            log::warn!("{}: object {name} is a miss: {why}", backend.describe());
                            Err(Miss { status: Status::Integrity, why: format!("the shared tier's object is a miss: {why}") })
                        }
                    }
                }
                Err(e) => {
                    bump(&counters.errors);
                    Err(Miss { status: e.status, why: format!("reading the shared tier: {}", e.message) })
                }
            };
            done(outcome);
        });
    }

    /// Publishes `payload` (one block) as `key`'s object, on a tier thread, and hands
    /// `done` the outcome.
    pub fn write(&self, key: Vec<u8>, mut payload: Buf, done: impl FnOnce(Result<()>) + Send + 'static) {
        let (backend, counters, name) = (self.backend.clone(), self.counters.clone(), object::name(&self.namespace, &key));
        let (namespace, block) = (self.namespace.clone(), self.block);
        self.spawn(move || {
            bump(&counters.requests);
            let want = Expected { namespace: &namespace, key: &key, block: &block };
            let header = object::header(&want, payload.slice());
            let r = backend.write(&name, &header, payload.slice());
            drop(payload);
            match &r {
                Ok(()) => bump(&counters.puts),
                Err(e) => {
                    bump(&counters.puts_dropped);
                    log::warn!("{}: writing object {name} failed; the block stays local only: {}", backend.describe(), e.message);
                }
            }
            if let Err(e) = backend.maintain() {
                log::warn!("{}: maintenance failed: {}", backend.describe(), e.message);
            }
            done(r);
        });
    }

    /// Counts objects that were not written (more were waiting than the tier keeps).
    pub fn dropped(&self, n: u64) {
        self.counters.puts_dropped.fetch_add(n, Ordering::Relaxed);
    }

    /// How many of `keys`, from the first, the shared tier holds, taking a prefix's
    /// property that a block is held only if those before it are: a search that checks
    /// three keys a round, about 1.6·log2(n) checks in log4(n) rounds, instead of one
    /// check a key. Ends at the tier's bound; what is not known by then is not held.
    pub fn leading<K: AsRef<[u8]> + Sync>(&self, keys: &[K]) -> usize {
        let deadline = self.deadline();
        // Known: keys[..lo] are held; keys[hi..] are not (hi == len: unknown past the end).
        let (mut lo, mut hi) = (0usize, keys.len());
        while lo < hi {
            let span = hi - lo;
            let probes: Vec<usize> = if span <= 3 { (lo..hi).collect() } else { (1..=3).map(|j| lo + span * j / 4).collect() };
            let (tx, rx) = crossbeam_channel::bounded(probes.len());
            for &p in &probes {
                let (backend, counters, tx) = (self.backend.clone(), self.counters.clone(), tx.clone());
                let name = object::name(&self.namespace, keys[p].as_ref());
                self.spawn(move || {
                    bump(&counters.requests);
                    let _ = tx.send((p, backend.exists(&name)));
                });
            }
            let mut found = vec![None; probes.len()];
            for _ in 0..probes.len() {
                match rx.recv_deadline(deadline) {
                    Ok((p, r)) => {
                        let at = probes.iter().position(|&q| q == p).unwrap();
                        found[at] = Some(r.unwrap_or_else(|e| {
                            self.check_failed(&e);
                            false
                        }));
                    }
                    Err(_) => {
                        self.timed_out(1);
                        return lo;
                    }
                }
            }
            // The first probe found absent bounds hi; the last held one before it bounds lo.
            let mut next = (lo, hi);
            for (at, &p) in probes.iter().enumerate() {
                if found[at] == Some(true) {
                    next.0 = p + 1;
                } else {
                    next.1 = p;
                    break;
                }
            }
            if next == (lo, hi) {
                break;
            }
            (lo, hi) = next;
        }
        lo
    }

    /// Counts and logs an existence check that failed. A lookup has no message of its
    /// own, and a runtime gets only what a lookup found, so the log is where a lookup's
    /// misses say why.
    fn check_failed(&self, e: &Error) {
        bump(&self.counters.errors);
        let due = {
            let mut warned = self.warned.lock().unwrap();
            let due = warned.is_none_or(|at| at.elapsed() >= WARN_EVERY);
            if due {
                *warned = Some(Instant::now());
            }
            due
        };
        let what = format!(
            "{}: an existence check failed, so lookups count its key and those after it as misses: {}",
            self.backend.describe(),
            e.message
        );
        if due {
            log::warn!("{what} (logged at most once every {WARN_EVERY:?}; shared_errors counts them)");
        } else {
            log::debug!("{what}");
        }
    }
}

fn run_timer(t: &Timer) {
    let mut d = t.due.lock().unwrap();
    loop {
        if d.1 {
            return;
        }
        let now = Instant::now();
        match d.0.peek().map(|x| x.0) {
            Some(at) if at <= now => {
                let Due(_, _, job) = d.0.pop().unwrap();
                drop(d);
                job();
                d = t.due.lock().unwrap();
            }
            Some(at) => d = t.wake.wait_timeout(d, at - now).unwrap().0,
            None => d = t.wake.wait(d).unwrap(),
        }
    }
}

impl Drop for Tier {
    /// Stops the threads without waiting for them: one blocked in a backend call past its
    /// bound finishes alone, so closing a store never waits for a hung server.
    fn drop(&mut self) {
        self.jobs = None;
        self.timer.due.lock().unwrap().1 = true;
        self.timer.wake.notify_all();
        self.threads.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shared::backend::Sink;
    use crate::shared::{Location, SharedConfig};
    use std::time::Duration;

    /// A backend that holds the objects named in `held`, answering each call after `delay`.
    struct Fake {
        held: Vec<String>,
        delay: Duration,
        calls: AtomicU64,
    }

    impl Backend for Fake {
        fn describe(&self) -> String {
            "fake".into()
        }
        fn exists(&self, name: &str) -> Result<bool> {
            self.calls.fetch_add(1, Ordering::Relaxed);
            std::thread::sleep(self.delay);
            Ok(self.held.iter().any(|h| h == name))
        }
        fn read(&self, _: &str, _: usize, _: usize, _: &mut dyn Sink) -> Result<Option<u64>> {
            std::thread::sleep(self.delay);
            Ok(None)
        }
        fn write(&self, _: &str, _: &[u8], _: &[u8]) -> Result<()> {
            Ok(())
        }
        fn remove(&self, _: &str) -> Result<()> {
            Ok(())
        }
    }

    fn block() -> LayoutConfig {
        LayoutConfig { num_blocks: 1, num_layers: 1, outer_dim: 1, page_size: 1, inner_dim: 64, dtype_bytes: 1 }
    }

    fn tier(held: usize, n: usize, delay: Duration, timeout: Duration) -> (Tier, Vec<Vec<u8>>, Arc<Fake>) {
        let keys: Vec<Vec<u8>> = (0..n).map(|i| format!("key-{i}").into_bytes()).collect();
        let fake = Arc::new(Fake { held: keys[..held].iter().map(|k| object::name(b"ns", k)).collect(), delay, calls: AtomicU64::new(0) });
        let cfg = SharedConfig { timeout, ..SharedConfig::new(Location::Dir { path: "unused".into(), capacity_bytes: 0 }) };
        (Tier::with_backend(fake.clone(), &cfg, b"ns", block()), keys, fake)
    }

    #[test]
    fn leading_hits_take_logarithmic_checks() {
        for n in [0usize, 1, 2, 5, 100, 1000] {
            for held in [0, 1, n / 3, n.saturating_sub(1), n] {
                let (t, keys, fake) = tier(held.min(n), n, Duration::ZERO, Duration::from_secs(30));
                assert_eq!(t.leading(&keys), held.min(n), "{held} of {n}");
                let calls = fake.calls.load(Ordering::Relaxed);
                let bound = 3 * ((n as f64 + 1.0).log(4.0).ceil() as u64 + 1);
                assert!(calls <= bound, "{calls} checks for {n} keys; at most {bound}");
                assert_eq!(t.stats().requests, calls);
            }
        }
    }

    #[test]
    fn a_lookup_ends_at_its_bound_when_the_backend_hangs() {
        let (t, keys, _) = tier(10, 10, Duration::from_secs(5), Duration::from_millis(100));
        let start = Instant::now();
        assert_eq!(t.leading(&keys), 0, "nothing is known in time");
        assert!(start.elapsed() < Duration::from_secs(4), "the wait ended at the bound, not the backend's answer");
        assert_eq!(t.stats().timeouts, 1);
    }
}
