//! Counters shared by the engine's threads and its requests. Relaxed atomics: they are
//! statistics, read by `kvx_engine_stats`, never used to synchronise.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::Relaxed};

#[derive(Debug, Default)]
pub struct Counters {
    pub requests_completed: AtomicU64,
    pub requests_failed: AtomicU64,
    pub requests_cancelled: AtomicU64,
    pub bytes_disk_read: AtomicU64,
    pub bytes_disk_written: AtomicU64,
    pub bytes_host_to_device: AtomicU64,
    pub bytes_device_to_host: AtomicU64,
    /// Busy time per pipeline stage, summed over threads (see `Stats`).
    pub disk_read_ns: AtomicU64,
    pub disk_write_ns: AtomicU64,
    pub host_copy_ns: AtomicU64,
    pub device_copy_ns: AtomicU64,
    pub slot_wait_ns: AtomicU64,
    pub reads_fanned_out: AtomicU64,
    /// The caller's transfers admitted and not yet complete, which `max_inflight` bounds
    /// (a store's own transfers are not counted: `Engine::submit_for_store`).
    pub inflight: AtomicU32,
}

/// A copy of the counters at one moment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    pub requests_completed: u64,
    pub requests_failed: u64,
    pub requests_cancelled: u64,
    pub bytes_disk_read: u64,
    pub bytes_disk_written: u64,
    pub bytes_host_to_device: u64,
    pub bytes_device_to_host: u64,
    /// Nanoseconds I/O workers spent in disk reads, summed over workers.
    pub disk_read_ns: u64,
    /// Nanoseconds I/O workers spent in disk writes, summed over workers.
    pub disk_write_ns: u64,
    /// Nanoseconds I/O workers spent in host memcpy (pageable/pinned ↔ slot).
    pub host_copy_ns: u64,
    /// Nanoseconds from issuing each chunk's device copies to their completion, summed.
    pub device_copy_ns: u64,
    /// Nanoseconds the dispatcher waited for a free bounce slot (the ring was full).
    pub slot_wait_ns: u64,
    /// Chunk reads an I/O worker shared with idle ones (`engine::fanout`); not in
    /// `kvx_stats`.
    pub reads_fanned_out: u64,
    /// Bounce slots held out of the ring now: a remote transfer through each timed out
    /// or failed, and NIXL has not reported it ended. A slot whose transfer NIXL
    /// reported failed stays out for good.
    pub slots_quarantined: u64,
}

impl Counters {
    pub fn snapshot(&self) -> Stats {
        Stats {
            requests_completed: self.requests_completed.load(Relaxed),
            requests_failed: self.requests_failed.load(Relaxed),
            requests_cancelled: self.requests_cancelled.load(Relaxed),
            bytes_disk_read: self.bytes_disk_read.load(Relaxed),
            bytes_disk_written: self.bytes_disk_written.load(Relaxed),
            bytes_host_to_device: self.bytes_host_to_device.load(Relaxed),
            bytes_device_to_host: self.bytes_device_to_host.load(Relaxed),
            disk_read_ns: self.disk_read_ns.load(Relaxed),
            disk_write_ns: self.disk_write_ns.load(Relaxed),
            host_copy_ns: self.host_copy_ns.load(Relaxed),
            device_copy_ns: self.device_copy_ns.load(Relaxed),
            slot_wait_ns: self.slot_wait_ns.load(Relaxed),
            reads_fanned_out: self.reads_fanned_out.load(Relaxed),
            slots_quarantined: 0, // the ring's count (`Engine::stats`)
        }
    }

    pub fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Relaxed);
    }

    pub fn add_since(counter: &AtomicU64, start: std::time::Instant) {
        counter.fetch_add(start.elapsed().as_nanos() as u64, Relaxed);
    }
}
