//! The bounce ring: one pinned allocation cut into N fixed-size slots. A free slot is a
//! token on a stack; a chunk holds its slot from the first stage to the last, so a slot
//! belongs to exactly one stage at a time and its memory needs no lock.
//!
//! The most recently freed slot is handed out first: its lines are still in the host's
//! cache, so a worker's read into it writes cached lines instead of fetching them from
//! DRAM first. Only as many slots as the work in flight needs stay warm, instead of the
//! whole ring taking turns (a hot 12.6 MB block: 0.85 ms against 1.03 through a ring
//! handed out in turn).

use crate::error::{bail, Result};
use crate::gpu::Gpu;
use crate::host::prefault;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Condvar, Mutex};

pub struct BounceRing {
    gpu: Arc<dyn Gpu>,
    base: *mut u8,
    total: u64,
    slot_bytes: u64,
    /// Free slots; the last one pushed is the next handed out.
    free: Mutex<Vec<u32>>,
    freed: Condvar,
    /// Slots held out of the ring (`hold`): a remote transfer through them timed out or
    /// failed and may still read or write them. Changed under `free`'s lock.
    held: AtomicU32,
    /// Set when the engine shuts down (`close`): `acquire` no longer waits.
    closed: AtomicBool,
}

// SAFETY: the ring only hands out addresses; ownership of each slot's bytes is the token.
unsafe impl Send for BounceRing {}
unsafe impl Sync for BounceRing {}

impl BounceRing {
    pub fn new(gpu: Arc<dyn Gpu>, slots: u32, slot_bytes: u64) -> Result<BounceRing> {
        if slots == 0 {
            bail!(InvalidArg, "the bounce ring needs at least one slot");
        }
        let total = slot_bytes * slots as u64;
        let base = gpu.alloc_pinned(total)?;
        // Fault the pages in now so the first transfers are not slowed by page faults.
        // SAFETY: a fresh allocation of `total` bytes that nobody else uses yet.
        unsafe { prefault(base, total) };
        // Slot 0 on top: the first chunks take the ring's start in order.
        let free = Mutex::new((0..slots).rev().collect());
        Ok(BounceRing {
            gpu,
            base,
            total,
            slot_bytes,
            free,
            freed: Condvar::new(),
            held: AtomicU32::new(0),
            closed: AtomicBool::new(false),
        })
    }

    pub fn slots(&self) -> u32 {
        (self.total / self.slot_bytes) as u32
    }

    /// The whole ring's memory (address, bytes), e.g. to register it with the kernel.
    pub fn memory(&self) -> (u64, u64) {
        (self.base as u64, self.total)
    }

    pub fn slot_bytes(&self) -> u64 {
        self.slot_bytes
    }

    pub fn addr(&self, slot: u32) -> u64 {
        self.base as u64 + slot as u64 * self.slot_bytes
    }

    /// Slots not held by any chunk right now.
    pub fn free_slots(&self) -> u32 {
        self.free.lock().unwrap().len() as u32
    }

    /// Half the ring or more is free: a chunk's stages then follow each other at once,
    /// so its read is streamed (`Router::stream_read`), shared by every I/O worker
    /// (`fanout`), and its copy issued where the read ends (`Router::read_done`).
    pub fn shallow(&self) -> bool {
        self.free_slots() * 2 >= self.slots()
    }

    /// Blocks (sleeping) until a slot is free; `None` once the ring is closed.
    pub fn acquire(&self) -> Option<u32> {
        let mut free = self.free.lock().unwrap();
        loop {
            if self.closed.load(Ordering::Acquire) {
                return None;
            }
            match free.pop() {
                Some(slot) => return Some(slot),
                None => free = self.freed.wait(free).unwrap(),
            }
        }
    }

    /// Wakes every `acquire` waiting and makes later ones return `None` at once: the
    /// engine is shutting down, and a slot may not come back soon (or at all, while
    /// remote transfers hold slots).
    pub fn close(&self) {
        let _free = self.free.lock().unwrap();
        self.closed.store(true, Ordering::Release);
        self.freed.notify_all();
    }

    /// The most slots that remote transfers may hold out of the ring at once (`hold`):
    /// one always stays for the work that waits on no peer.
    pub fn max_held(&self) -> u32 {
        self.slots() - 1
    }

    /// A free slot if there is one now.
    pub fn try_acquire(&self) -> Option<u32> {
        self.free.lock().unwrap().pop()
    }

    /// Gives a slot back. A release with every slot already free is a bookkeeping bug
    /// (a chunk gave its slot back twice): it panics at once instead of blocking.
    pub fn release(&self, slot: u32) {
        assert!(slot < self.slots(), "bounce slot {slot} released; the ring has {}", self.slots());
        let mut free = self.free.lock().unwrap();
        if free.len() as u32 + self.held() == self.slots() {
            drop(free);
            panic!("bounce slot {slot} released while every slot is free: a chunk gave its slot back twice");
        }
        free.push(slot);
        drop(free);
        self.freed.notify_one();
    }

    /// Keeps a chunk's slot out of the ring instead of giving it back: a remote
    /// transfer through it timed out or failed, and NIXL has not reported it ended.
    pub fn hold(&self, slot: u32) {
        assert!(slot < self.slots(), "bounce slot {slot} held; the ring has {}", self.slots());
        let _free = self.free.lock().unwrap();
        self.held.fetch_add(1, Ordering::Relaxed);
        self.freed.notify_all(); // a drain counts held slots as back
    }

    /// Gives a held slot back once the transfer through it has ended.
    pub fn unhold(&self, slot: u32) {
        let mut free = self.free.lock().unwrap();
        self.held.fetch_sub(1, Ordering::Relaxed);
        free.push(slot);
        drop(free);
        self.freed.notify_one();
    }

    /// Slots held out of the ring now (`hold`).
    pub fn held(&self) -> u32 {
        self.held.load(Ordering::Relaxed)
    }

    /// Takes every slot back: returns once no chunk is in flight. Held slots are not
    /// waited for: the transfers through them may never end.
    pub fn drain_all(&self) {
        let mut free = self.free.lock().unwrap();
        while (free.len() as u32) + self.held() < self.slots() {
            free = self.freed.wait(free).unwrap();
        }
        free.clear();
    }
}

impl Drop for BounceRing {
    fn drop(&mut self) {
        if self.held() > 0 {
            // A transfer NIXL never reported ended may still write a held slot.
            log::warn!(
                "{} bounce slots were held after remote transfers that did not end; the ring's {} bytes are not freed",
                self.held(),
                self.total
            );
            return;
        }
        // SAFETY: allocated in `new` with the same size; no chunk outlives the engine.
        unsafe { self.gpu.free_pinned(self.base, self.total) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::Emulated;
    use std::time::Duration;

    /// A release with every slot already free is a bookkeeping bug: it must be reported
    /// at once, not block the thread forever.
    #[test]
    fn a_release_beyond_the_slot_count_is_reported_not_blocked_on() {
        let ring = Arc::new(BounceRing::new(Arc::new(Emulated::default()), 2, 64 << 10).unwrap());
        let (tx, rx) = std::sync::mpsc::channel();
        let r = ring.clone();
        std::thread::spawn(move || {
            let res = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| r.release(0)));
            let _ = tx.send(res.is_err());
        });
        assert_eq!(rx.recv_timeout(Duration::from_secs(5)), Ok(true), "the extra release blocked");
        assert_eq!(ring.free_slots(), 2);
    }

    /// The slot freed last is the one handed out next (its bytes are still cached); a
    /// ring that took turns would hand out slot 2 here.
    #[test]
    fn the_most_recently_freed_slot_is_reused_first() {
        let ring = BounceRing::new(Arc::new(Emulated::default()), 4, 64 << 10).unwrap();
        let (a, b) = (ring.acquire().unwrap(), ring.acquire().unwrap());
        assert_eq!((a, b), (0, 1), "a fresh ring hands out its slots from the start");
        ring.release(a);
        assert_eq!(ring.acquire(), Some(a));
        ring.release(b);
        ring.release(a);
        assert_eq!((ring.try_acquire(), ring.try_acquire(), ring.try_acquire()), (Some(a), Some(b), Some(2)));
    }

    /// The ring is shallow while half its slots or more are free, and deep past that.
    #[test]
    fn a_ring_is_shallow_until_more_than_half_its_slots_are_held() {
        let ring = BounceRing::new(Arc::new(Emulated::default()), 4, 64 << 10).unwrap();
        assert!(ring.shallow(), "an idle ring");
        let (a, b) = (ring.acquire().unwrap(), ring.acquire().unwrap());
        assert!(ring.shallow(), "two of four held");
        let c = ring.acquire().unwrap();
        assert!(!ring.shallow(), "three of four held");
        ring.release(c);
        assert!(ring.shallow(), "back to two of four");
        ring.release(a);
        ring.release(b);
    }

    /// A held slot is neither handed out nor waited for by a drain; given back, it is
    /// handed out again.
    #[test]
    fn a_held_slot_stays_out_until_given_back_and_a_drain_does_not_wait_for_it() {
        let ring = Arc::new(BounceRing::new(Arc::new(Emulated::default()), 2, 64 << 10).unwrap());
        let (a, b) = (ring.acquire().unwrap(), ring.acquire().unwrap());
        ring.hold(a);
        ring.release(b);
        assert_eq!((ring.held(), ring.free_slots()), (1, 1));
        assert_eq!((ring.try_acquire(), ring.try_acquire()), (Some(b), None), "the held slot was handed out");
        ring.release(b);
        ring.unhold(a);
        assert_eq!((ring.held(), ring.free_slots()), (0, 2));
        let (a, b) = (ring.acquire().unwrap(), ring.acquire().unwrap());
        ring.hold(a);
        ring.release(b);
        let r = ring.clone();
        let drain = std::thread::spawn(move || r.drain_all());
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while !drain.is_finished() && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(drain.is_finished(), "the drain waited for a held slot");
        drain.join().unwrap();
    }

    /// A waiter blocked on an empty ring gets the slot that comes back.
    #[test]
    fn acquire_waits_for_a_release() {
        let ring = Arc::new(BounceRing::new(Arc::new(Emulated::default()), 1, 64 << 10).unwrap());
        let slot = ring.acquire().unwrap();
        let r = ring.clone();
        let waiter = std::thread::spawn(move || r.acquire());
        std::thread::sleep(Duration::from_millis(20));
        assert!(!waiter.is_finished(), "acquire returned with no slot free");
        ring.release(slot);
        assert_eq!(waiter.join().unwrap(), Some(slot));
    }

    /// A waiter blocked on a ring whose every slot is held wakes when the ring is
    /// closed, and gets no slot; later waiters get none at once.
    #[test]
    fn close_wakes_a_waiter_on_a_held_ring() {
        let ring = Arc::new(BounceRing::new(Arc::new(Emulated::default()), 1, 64 << 10).unwrap());
        let slot = ring.acquire().unwrap();
        ring.hold(slot);
        let r = ring.clone();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(r.acquire());
        });
        std::thread::sleep(Duration::from_millis(20));
        ring.close();
        assert_eq!(rx.recv_timeout(Duration::from_secs(5)), Ok(None), "the waiter did not wake with no slot");
        ring.unhold(slot);
        assert_eq!(ring.acquire(), None, "a closed ring handed out a slot");
    }
}
