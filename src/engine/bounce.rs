//! The bounce ring: one pinned allocation cut into N fixed-size slots. A free slot is a
//! token in a channel; a chunk holds its slot from the first stage to the last, so a
//! slot belongs to exactly one stage at a time and its memory needs no lock.

use crate::error::{bail, Result};
use crate::gpu::Gpu;
use crate::host::prefault;
use crossbeam_channel::{Receiver, Sender};
use std::sync::Arc;

pub struct BounceRing {
    gpu: Arc<dyn Gpu>,
    base: *mut u8,
    total: u64,
    slot_bytes: u64,
    free_tx: Sender<u32>,
    free_rx: Receiver<u32>,
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
        let (free_tx, free_rx) = crossbeam_channel::bounded(slots as usize);
        for i in 0..slots {
            free_tx.send(i).expect("capacity is the slot count");
        }
        Ok(BounceRing { gpu, base, total, slot_bytes, free_tx, free_rx })
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
        self.free_rx.len() as u32
    }

    /// Blocks (sleeping) until a slot is free.
    pub fn acquire(&self) -> u32 {
        self.free_rx.recv().expect("the ring owns a sender")
    }

    /// A free slot if there is one now.
    pub fn try_acquire(&self) -> Option<u32> {
        self.free_rx.try_recv().ok()
    }

    /// Gives a slot back. A release with every slot already free is a bookkeeping bug
    /// (a chunk gave its slot back twice): it panics at once instead of blocking.
    pub fn release(&self, slot: u32) {
        assert!(slot < self.slots(), "bounce slot {slot} released; the ring has {}", self.slots());
        if self.free_tx.try_send(slot).is_err() {
            panic!("bounce slot {slot} released while every slot is free: a chunk gave its slot back twice");
        }
    }

    /// Takes every slot back: returns once no chunk is in flight.
    pub fn drain_all(&self) {
        for _ in 0..self.slots() {
            self.acquire();
        }
    }
}

impl Drop for BounceRing {
    fn drop(&mut self) {
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
}
