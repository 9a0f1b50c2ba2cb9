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
    /// Requests admitted and not yet complete (the `max_inflight` limit applies to it).
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
        }
    }

    pub fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Relaxed);
    }
}
