//! Pinned staging for the shared tier: one allocation of host memory the device copies from
//! directly, made when the store opens, handed out a few blocks at a time.
//!
//! Allocating and freeing pinned memory per read costs more than the read (freeing it also
//! waits for the device), so the blocks are allocated once, and a lease that finds too few
//! free waits its turn, first come first served. The memory a store's shared tier holds is
//! therefore bounded, and no read allocates.

use crate::engine::Engine;
use crate::error::Result;
use crate::layout::{LayoutConfig, LayoutKind};
use crate::memory::{Layout, StorageKind};
use crate::shared::read::Dest;
use crate::shared::tier::Buf;
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Most blocks one lease takes: a get's misses and a put's publishing go in leases of this
/// many.
pub(super) const LEASE_BLOCKS: usize = 16;
/// Bytes of staging a store keeps: enough leases in flight for the tier's threads to read
/// one while others move to their destinations.
const STAGING_BYTES: u64 = 128 << 20;
/// Fewest and most blocks, whatever their size: two leases at least, and no more than the
/// tier's calls can use.
const MIN_BLOCKS: u64 = 2 * LEASE_BLOCKS as u64;
const MAX_BLOCKS: u64 = 64 * LEASE_BLOCKS as u64;

/// A lease waiting for blocks: how many, whether it is still wanted (a waiter whose caller
/// stopped waiting is dropped unserved), and what to do with them.
struct Waiter {
    n: usize,
    wanted: Box<dyn Fn() -> bool + Send>,
    then: Box<dyn FnOnce(Vec<Arc<Slot>>) + Send>,
}

thread_local! {
    /// The stagings whose waiters this thread is serving: a block given back inside a
    /// waiter's call (its lease dropped at once, say) is only freed there, and the outer
    /// call serves on, so serving never nests.
    static SERVING: std::cell::RefCell<Vec<usize>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// A store's staging blocks.
pub(super) struct Staging {
    layout: Arc<Layout>,
    state: Mutex<State>,
}

struct State {
    free: Vec<u64>,
    waiting: VecDeque<Waiter>,
}

/// One block of staging, leased; given back when the last holder drops it. Each call of the
/// tier that reads or writes it holds it, so a block whose call outlives its caller's bound
/// stays out alone while the rest of its lease goes back.
pub(super) struct Slot {
    staging: Arc<Staging>,
    id: u64,
}

impl Staging {
    /// Staging for blocks of `block`'s geometry, allocated now.
    pub fn new(engine: &Engine, block: &LayoutConfig) -> Result<Arc<Staging>> {
        let block_bytes = LayoutConfig { num_blocks: 1, ..*block }.validate()?.block_bytes;
        let blocks = (STAGING_BYTES / block_bytes).clamp(MIN_BLOCKS, MAX_BLOCKS);
        let cfg = LayoutConfig { num_blocks: blocks, ..*block };
        let layout = engine.create_layout(&cfg, LayoutKind::FullyContiguous, StorageKind::Pinned)?;
        let state = State { free: (0..blocks).rev().collect(), waiting: VecDeque::new() };
        Ok(Arc::new(Staging { layout, state: Mutex::new(state) }))
    }

    /// The staging layout, whose blocks the slots are.
    pub fn layout(&self) -> &Arc<Layout> {
        &self.layout
    }

    /// Leases `n ≤ LEASE_BLOCKS` blocks to `then`: now, on this thread, if they are free and
    /// no one waits before it; else once enough come back, on the thread that gives them,
    /// unless `wanted` says by then that the caller stopped waiting (the waiter is then
    /// dropped unserved; a caller that stops waiting calls `drop_stale`, so waiters no
    /// longer wanted hold nothing for long). `wanted` is asked only then and at the queue's
    /// head, so a lease takes no waiter's lock.
    pub fn lease(
        self: &Arc<Self>,
        n: usize,
        wanted: impl Fn() -> bool + Send + 'static,
        then: impl FnOnce(Vec<Arc<Slot>>) + Send + 'static,
    ) {
        assert!(n <= LEASE_BLOCKS, "a lease takes at most {LEASE_BLOCKS} blocks");
        let mut st = self.state.lock().unwrap();
        if !st.waiting.is_empty() || st.free.len() < n {
            st.waiting.push_back(Waiter { n, wanted: Box::new(wanted), then: Box::new(then) });
            return;
        }
        let slots = self.take(&mut st, n);
        drop(st);
        then(slots)
    }

    /// Leases `n` blocks, waiting for them until `deadline`; `None` past it.
    pub fn lease_by(self: &Arc<Self>, n: usize, deadline: Instant) -> Option<Vec<Arc<Slot>>> {
        let (tx, rx) = crossbeam_channel::bounded(1);
        let gave_up = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let g = gave_up.clone();
        // A lease that comes after the deadline finds no receiver and goes straight back.
        self.lease(
            n,
            move || !g.load(std::sync::atomic::Ordering::Relaxed),
            move |s| {
                let _ = tx.send(s);
            },
        );
        let got = rx.recv_deadline(deadline).ok();
        if got.is_none() {
            gave_up.store(true, std::sync::atomic::Ordering::Relaxed);
            self.drop_stale();
        }
        got
    }

    /// Drops the waiters no longer wanted.
    pub fn drop_stale(&self) {
        let stale = Self::prune(&mut self.state.lock().unwrap());
        drop(stale);
    }

    /// Takes the waiters no longer wanted out of the queue, to be dropped once its lock is
    /// released (dropping one may give blocks back).
    fn prune(st: &mut State) -> Vec<Waiter> {
        if st.waiting.iter().all(|w| (w.wanted)()) {
            return Vec::new();
        }
        let mut stale = Vec::new();
        for w in std::mem::take(&mut st.waiting) {
            match (w.wanted)() {
                true => st.waiting.push_back(w),
                false => stale.push(w),
            }
        }
        stale
    }

    fn take(self: &Arc<Self>, st: &mut State, n: usize) -> Vec<Arc<Slot>> {
        let at = st.free.len() - n;
        st.free.split_off(at).into_iter().map(|id| Arc::new(Slot { staging: self.clone(), id })).collect()
    }

    /// Takes back block `id` and serves the waiters it lets through, in order, in a loop:
    /// blocks that serving gives back on this thread are served by the same loop.
    fn give_back(self: &Arc<Self>, id: u64) {
        self.state.lock().unwrap().free.push(id);
        let me = Arc::as_ptr(self) as usize;
        if SERVING.with_borrow(|s| s.contains(&me)) {
            return;
        }
        let _serving = Serving::start(me);
        loop {
            let (mut ready, mut stale) = (Vec::new(), Vec::new());
            {
                let mut st = self.state.lock().unwrap();
                while let Some(w) = st.waiting.pop_front() {
                    if !(w.wanted)() {
                        stale.push(w);
                    } else if w.n <= st.free.len() {
                        let slots = self.take(&mut st, w.n);
                        ready.push((w.then, slots));
                    } else {
                        st.waiting.push_front(w);
                        break;
                    }
                }
            }
            if ready.is_empty() && stale.is_empty() {
                break;
            }
            drop(stale);
            for (then, slots) in ready {
                then(slots);
            }
        }
    }
}

/// This thread serves a staging's waiters while it lives.
struct Serving(usize);

impl Serving {
    fn start(staging: usize) -> Serving {
        SERVING.with_borrow_mut(|s| s.push(staging));
        Serving(staging)
    }
}

impl Drop for Serving {
    fn drop(&mut self) {
        SERVING.with_borrow_mut(|s| s.retain(|&x| x != self.0));
    }
}

impl Slot {
    /// The block's id in the staging layout.
    pub fn id(&self) -> u64 {
        self.id
    }

    fn span(&self) -> (*mut u8, usize) {
        let layout = &self.staging.layout;
        let bytes = layout.geometry().block_bytes as usize;
        let base = layout.bases().expect("staging is memory")[0] as *mut u8;
        // SAFETY: block `id` lies within the staging allocation.
        (unsafe { base.add(self.id as usize * bytes) }, bytes)
    }

    /// The block as memory for one write of the tier, which holds it until the call ends.
    pub fn buf(self: &Arc<Self>) -> Buf {
        let (ptr, len) = self.span();
        // SAFETY: the staging allocation lives as long as the slot (kept by the Buf); a
        // leased block is no one else's until its slot is dropped, and it is given to one
        // call at a time.
        unsafe { Buf::new(ptr, len, self.clone()) }
    }

    /// Adds the block to `dest` as a target of one read, which holds it until it ends.
    pub fn add_to(self: &Arc<Self>, dest: &mut Dest) {
        let (ptr, len) = self.span();
        // SAFETY: as for `buf`.
        unsafe { dest.add(vec![(ptr, len)], None, self.clone()) }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.staging.clone().give_back(self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::EngineConfig;
    use std::time::Duration;

    /// Staging of `MIN_BLOCKS` blocks (each larger than `STAGING_BYTES / MIN_BLOCKS`).
    fn staging() -> Arc<Staging> {
        let engine = Engine::new(&EngineConfig::default()).unwrap();
        let block = LayoutConfig { num_blocks: 0, num_layers: 1, outer_dim: 1, page_size: 1, inner_dim: (8 << 20) >> 1, dtype_bytes: 2 };
        Staging::new(&engine, &block).unwrap()
    }

    fn take(s: &Arc<Staging>, n: usize) -> Vec<Arc<Slot>> {
        s.lease_by(n, Instant::now()).expect("free blocks are leased at once")
    }

    #[test]
    fn leases_are_disjoint_and_bounded_by_what_was_allocated() {
        let s = staging();
        assert_eq!(s.layout.geometry().cfg.num_blocks, MIN_BLOCKS);
        let (a, b) = (take(&s, LEASE_BLOCKS), take(&s, LEASE_BLOCKS));
        let mut ids: Vec<u64> = a.iter().chain(&b).map(|s| s.id()).collect();
        ids.sort();
        assert_eq!(ids, (0..MIN_BLOCKS).collect::<Vec<_>>());
        assert!(s.lease_by(1, Instant::now() + Duration::from_millis(20)).is_none(), "none is free");
        drop(a);
        assert_eq!(take(&s, LEASE_BLOCKS).len(), LEASE_BLOCKS);
    }

    #[test]
    fn waiters_are_served_in_order_when_blocks_come_back() {
        let s = staging();
        let (a, b, c) = (take(&s, LEASE_BLOCKS), take(&s, LEASE_BLOCKS - 1), take(&s, 1));
        let order = Arc::new(Mutex::new(Vec::new()));
        let (tx, rx) = crossbeam_channel::unbounded();
        for (who, n) in [(0, LEASE_BLOCKS), (1, 1)] {
            let (order, tx) = (order.clone(), tx.clone());
            s.lease(
                n,
                || true,
                move |slots| {
                    order.lock().unwrap().push(who);
                    tx.send(slots).unwrap();
                },
            );
        }
        // One block back: the second waiter would fit, but does not pass the first.
        drop(c);
        assert!(order.lock().unwrap().is_empty());
        drop(b);
        let first = rx.recv_timeout(Duration::from_secs(5)).unwrap();
        assert_eq!((order.lock().unwrap().clone(), first.len()), (vec![0], LEASE_BLOCKS));
        drop(a);
        let _second = rx.recv_timeout(Duration::from_secs(5)).unwrap();
        assert_eq!(*order.lock().unwrap(), vec![0, 1]);
    }

    #[test]
    fn a_lease_granted_past_its_deadline_goes_back() {
        let s = staging();
        let a = take(&s, LEASE_BLOCKS);
        let b = take(&s, LEASE_BLOCKS);
        assert!(s.lease_by(LEASE_BLOCKS, Instant::now() + Duration::from_millis(10)).is_none());
        drop((a, b));
        // The late waiter got its blocks and gave them straight back: all are free.
        assert_eq!(s.state.lock().unwrap().free.len() as u64, MIN_BLOCKS);
        assert!(s.state.lock().unwrap().waiting.is_empty());
    }

    #[test]
    fn a_block_still_in_a_call_stays_out_alone() {
        let s = staging();
        let lease = take(&s, LEASE_BLOCKS);
        let in_call = lease[3].buf();
        let mut dest = Dest::new();
        lease[5].add_to(&mut dest);
        drop(lease);
        assert_eq!(s.state.lock().unwrap().free.len() as u64, MIN_BLOCKS - 2);
        drop((in_call, dest));
        assert_eq!(s.state.lock().unwrap().free.len() as u64, MIN_BLOCKS);
    }

    #[test]
    fn waiters_given_up_are_dropped_and_hold_nothing() {
        let s = staging();
        let all = (take(&s, LEASE_BLOCKS), take(&s, LEASE_BLOCKS));
        for _ in 0..100 {
            assert!(s.lease_by(1, Instant::now()).is_none());
        }
        assert!(s.state.lock().unwrap().waiting.is_empty(), "a lease that timed out waits no more");
        let wanted = Arc::new(std::sync::atomic::AtomicBool::new(true));
        let w = wanted.clone();
        let held = Arc::new(());
        let h = held.clone();
        s.lease(1, move || w.load(std::sync::atomic::Ordering::Relaxed), move |_| drop(h));
        assert_eq!(Arc::strong_count(&held), 2);
        wanted.store(false, std::sync::atomic::Ordering::Relaxed);
        s.drop_stale();
        assert_eq!(Arc::strong_count(&held), 1, "a waiter no longer wanted is dropped, with what it holds");
        drop(all);
        assert_eq!(s.state.lock().unwrap().free.len() as u64, MIN_BLOCKS);
    }

    #[test]
    fn serving_many_waiters_that_give_their_blocks_straight_back_does_not_nest() {
        let s = staging();
        let all = (take(&s, LEASE_BLOCKS), take(&s, LEASE_BLOCKS));
        let served = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        for _ in 0..20_000 {
            let served = served.clone();
            s.lease(
                1,
                || true,
                move |slots| {
                    served.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    drop(slots);
                },
            );
        }
        // Given back on a thread with a small stack: one frame per waiter would overflow it.
        std::thread::Builder::new().stack_size(256 << 10).spawn(move || drop(all)).unwrap().join().unwrap();
        assert_eq!(served.load(std::sync::atomic::Ordering::Relaxed), 20_000);
        assert_eq!(s.state.lock().unwrap().free.len() as u64, MIN_BLOCKS);
    }
}
