//! Fault injection for tests: make the Nth disk read, disk write, disk sync, device copy
//! or device op fail with an errno, return short, or (on the device) fail like a CUDA
//! error; and make the file system report another direct-I/O alignment. With it comes
//! the deferred emulated device (`deferred_device`), whose copies complete later on a
//! thread of their own, as a GPU's do, and can be held back; and power cuts
//! (`power_cut`), which drop whatever was written and not synced.
//!
//! Only in builds with the `fault-injection` feature, which the crate's own tests turn
//! on (a dev-dependency on itself) and release builds leave off: there `check` is a
//! constant `None` and the call sites compile away. With the feature it is off until a
//! test turns it on (the hot path then costs one relaxed atomic load). The plan is
//! process-wide, so tests that inject must not run concurrently with each other.

/// Where a fault can be injected.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Site {
    /// One `pread` system call.
    DiskRead = 0,
    /// One `pwrite` system call.
    DiskWrite = 1,
    /// One batch of device copies (`Gpu::copy`) on the emulated device, before any of it
    /// is queued.
    DeviceCopy = 2,
    /// One op of a batch on the emulated device, after the ops before it were queued.
    DeviceOp = 3,
    /// One `fdatasync` or `fsync` system call (an `Errno` fault only).
    DiskSync = 4,
}

/// What the chosen call does instead of its work.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// The system call fails with this errno (`EINTR` is retried by the I/O layer).
    Errno(i32),
    /// The system call moves only half of what it was asked (at least one byte).
    Short,
    /// The device copy fails.
    CopyError,
    /// The call waits until `release` (or `clear`), then does its work: its request
    /// stays in flight for as long as the test needs.
    Hold,
}

pub mod power_cut;

#[cfg(feature = "fault-injection")]
pub use plan::*;

/// Without the feature: no fault, ever.
#[cfg(not(feature = "fault-injection"))]
#[inline(always)]
pub(crate) fn check(_site: Site) -> Option<Fault> {
    None
}

/// Without the feature: file systems report what they report.
#[cfg(not(feature = "fault-injection"))]
#[inline(always)]
pub(crate) fn reported_dio_align() -> Option<u64> {
    None
}

#[cfg(feature = "fault-injection")]
mod plan {
    use super::{Fault, Site};
    use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
    use std::sync::{Condvar, Mutex};

    struct Plan {
        site: Site,
        nth: u64,
        fault: Fault,
    }

    static ENABLED: AtomicBool = AtomicBool::new(false);
    static PLAN: Mutex<Option<Plan>> = Mutex::new(None);
    static CALLS: [AtomicU64; 5] = [AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0)];

    /// From now on, the `nth` (0-based) call at `site` gets `fault`; call counts restart.
    pub fn inject(site: Site, nth: u64, fault: Fault) {
        *PLAN.lock().unwrap() = Some(Plan { site, nth, fault });
        reset_counts();
        ENABLED.store(true, Ordering::Release);
    }

    /// Counts calls per site without injecting anything (to learn how many calls a transfer makes).
    pub fn count_only() {
        *PLAN.lock().unwrap() = None;
        reset_counts();
        ENABLED.store(true, Ordering::Release);
    }

    /// Turns injection and counting off, and lets a held call go.
    pub fn clear() {
        ENABLED.store(false, Ordering::Release);
        *PLAN.lock().unwrap() = None;
        release();
    }

    /// Whether a call is held (`Fault::Hold`) now.
    pub fn holding() -> bool {
        *HELD.lock().unwrap()
    }

    /// Lets the held call go on.
    pub fn release() {
        *HELD.lock().unwrap() = false;
        RELEASED.notify_all();
    }

    static HELD: Mutex<bool> = Mutex::new(false);
    static RELEASED: Condvar = Condvar::new();

    fn hold() {
        let mut held = HELD.lock().unwrap();
        *held = true;
        while *held {
            held = RELEASED.wait(held).unwrap();
        }
    }

    /// Calls seen at `site` since the last `inject`/`count_only`.
    pub fn calls(site: Site) -> u64 {
        CALLS[site as usize].load(Ordering::Acquire)
    }

    fn reset_counts() {
        for c in &CALLS {
            c.store(0, Ordering::Release);
        }
    }

    /// The direct-I/O alignment file systems report from now on (`None`: what they
    /// really report), as a file system of larger sectors or pages would.
    pub fn report_dio_align(align: Option<u64>) {
        REPORTED_DIO_ALIGN.store(align.unwrap_or(0), Ordering::Release);
    }

    static REPORTED_DIO_ALIGN: AtomicU64 = AtomicU64::new(0);

    /// The alignment set by `report_dio_align`, if any.
    pub(crate) fn reported_dio_align() -> Option<u64> {
        Some(REPORTED_DIO_ALIGN.load(Ordering::Acquire)).filter(|&a| a != 0)
    }

    /// Called by the I/O and copy layers before each call at `site`.
    #[inline]
    pub(crate) fn check(site: Site) -> Option<Fault> {
        if !ENABLED.load(Ordering::Relaxed) {
            return None;
        }
        let n = CALLS[site as usize].fetch_add(1, Ordering::AcqRel);
        let fault = match &*PLAN.lock().unwrap() {
            Some(p) if p.site == site && p.nth == n => Some(p.fault),
            _ => None,
        };
        if fault == Some(Fault::Hold) {
            hold();
            return None;
        }
        fault
    }

    /// Emulated devices opened from now on: deferred (`Some(true)`), immediate
    /// (`Some(false)`), or as `KVX_TEST_EMULATED` says (`None`, the start).
    pub fn set_deferred_device(deferred: Option<bool>) {
        DEFERRED.store(deferred.map_or(0, |d| 1 + d as u8), Ordering::Release);
    }

    static DEFERRED: AtomicU8 = AtomicU8::new(0);

    /// Whether an emulated device opened now completes its copies later, on a thread of
    /// its own (`set_deferred_device`, else `KVX_TEST_EMULATED=deferred`).
    pub(crate) fn deferred_device() -> bool {
        match DEFERRED.load(Ordering::Acquire) {
            0 => std::env::var("KVX_TEST_EMULATED").is_ok_and(|v| v == "deferred"),
            d => d == 2,
        }
    }

    /// Whether deferred devices' streams are held (all, or bulk copies' only), and how
    /// many fences of theirs are being waited on.
    struct Streams {
        held: bool,
        bulk_held: bool,
        waiting: u64,
    }

    static STREAMS: Mutex<Streams> = Mutex::new(Streams { held: false, bulk_held: false, waiting: 0 });
    static STREAMS_CHANGED: Condvar = Condvar::new();

    /// Holds (`true`) or lets run (`false`) every deferred device's stream: a held stream
    /// queues what it is given and runs none of it.
    pub fn hold_device_streams(held: bool) {
        STREAMS.lock().unwrap().held = held;
        STREAMS_CHANGED.notify_all();
    }

    /// Holds (`true`) or lets run (`false`) the bulk copies' stream of every deferred
    /// device; latency-critical copies' streams keep running.
    pub fn hold_bulk_device_stream(held: bool) {
        STREAMS.lock().unwrap().bulk_held = held;
        STREAMS_CHANGED.notify_all();
    }

    /// Waits until a thread waits on a deferred device's fence, or `timeout` passed;
    /// whether one does.
    pub fn wait_for_fence_waiter(timeout: std::time::Duration) -> bool {
        let s = STREAMS.lock().unwrap();
        let (s, _) = STREAMS_CHANGED.wait_timeout_while(s, timeout, |s| s.waiting == 0).unwrap();
        s.waiting > 0
    }

    /// A deferred stream (`critical`: latency-critical copies') is about to start a job:
    /// waits while it is held.
    pub(crate) fn device_job_starts(critical: bool) {
        let s = STREAMS.lock().unwrap();
        drop(STREAMS_CHANGED.wait_while(s, |s| s.held || (s.bulk_held && !critical)).unwrap());
    }

    /// A thread starts (`true`) or stops waiting on a deferred device's fence.
    pub(crate) fn fence_waiting(waiting: bool) {
        let mut s = STREAMS.lock().unwrap();
        if waiting {
            s.waiting += 1;
        } else {
            s.waiting -= 1;
        }
        STREAMS_CHANGED.notify_all();
    }
}
