//! The device the engine copies to and from, behind one small trait.
//!
//! `Emulated` stands in for a GPU on machines without CUDA: device memory is host memory
//! and copies are memcpy, issued on the same copy thread and completed through the same
//! fences as real copies, so the pipeline's scheduling is exercised everywhere. The CUDA
//! backend implements the same trait.

pub mod cuda;
#[cfg(feature = "fault-injection")]
mod deferred;
mod emulated;
mod probe;

pub use emulated::Emulated;
pub use probe::{open_device, Device};

use crate::error::{Error, Result};

/// Direction of a device copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CopyKind {
    HostToDevice,
    DeviceToHost,
    DeviceToDevice,
}

/// One contiguous copy of `len` bytes; addresses are device pointers or host pointers as
/// `CopyKind` says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CopyOp {
    pub dst: u64,
    pub src: u64,
    pub len: u64,
}

/// What the host side of a device copy is, which decides how a backend may move it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HostSide {
    /// A bounce slot: its bytes between the ops are scratch and may be overwritten.
    Bounce,
    /// A layout's pinned memory that the device's kernels address directly (`maps_host`),
    /// so scattered small regions can move in one kernel launch, no CPU gather.
    Mapped,
    /// As `Mapped`, the source of a host-to-device copy whose ops all lie in one
    /// allocation, so the span from the first to the last byte may be read whole: a
    /// dense span that fits a slot moves by one DMA into staging and a device-side
    /// scatter (in slot-sized chunks this is faster than the kernel reading it in place;
    /// the planner gives large transfers of this shape chunks of up to 64 MiB, which are
    /// faster in place).
    MappedSpan,
    /// Pinned memory that only the DMA engines reach.
    Pinned,
}

/// The most ops one `copy` is given; the planner cuts chunks so none has more (a
/// backend's region table holds this many).
pub const MAX_OPS_PER_COPY: usize = 8192;

/// How many streams carry copies gated on a caller's event, each request's on one of its
/// own (`Gpu::capture_event` picks it). While no more gated requests run at once, a
/// request waiting for its caller's event holds up no other gated request; past that,
/// requests share these streams, and one may wait for the events of those before it on
/// its stream too.
pub const GATED_LANES: usize = 4;

/// Fences complete in issue order within a *lane*, matching the streams a backend may
/// use: a (direction, slot parity) pair; for latency-critical copies (`copy`'s
/// `critical`) a direction of their own, so their fences wait behind no bulk copy's; or
/// for copies gated on a caller's event (`copy`'s `after`) the request's gated lane, so
/// a fence waiting for a caller's event holds up no other request's. One fence thread
/// waits per lane.
pub const FENCE_LANES: usize = 6 + GATED_LANES;

pub fn fence_lane(kind: CopyKind, slot: u32, after: Option<Gate>, critical: bool) -> usize {
    let h2d = matches!(kind, CopyKind::HostToDevice | CopyKind::DeviceToDevice);
    match (after, critical, h2d) {
        (Some(gate), _, _) => 6 + gate.lane,
        (None, true, true) => 4,
        (None, true, false) => 5,
        (None, false, true) => (slot % 2) as usize,
        (None, false, false) => 2 + (slot % 2) as usize,
    }
}

/// A caller's event captured for one request (`Gpu::capture_event`): an event of ours
/// that the request's copies wait for, and the gated lane (below `GATED_LANES`) they take.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Gate {
    pub event: u64,
    pub lane: usize,
}

/// Something to wait on for a batch of copies that was issued asynchronously.
pub trait PendingCopy: Send {
    /// Blocks until the copies finished, their outcome. With `spin`, it looks for
    /// completion for a short while before it sleeps (worth it when nothing else waits:
    /// a sleeping wake-up costs about what a small copy takes).
    fn wait(self: Box<Self>, spin: bool) -> Result<()>;
}

/// The completion of an issued batch of copies.
pub enum Fence {
    /// The copies already finished (emulated device, or a synchronous fallback).
    Done,
    Pending(Box<dyn PendingCopy>),
}

impl Fence {
    pub fn wait(self, spin: bool) -> Result<()> {
        match self {
            Fence::Done => Ok(()),
            Fence::Pending(p) => p.wait(spin),
        }
    }
}

/// A batch of copies that failed: why, and the fence of what of it the device had already
/// queued (`Fence::Done` when nothing is in flight). Until that fence completes, the
/// queued copies still read and write the chunk's slot and layouts, so the slot is not
/// free before it.
pub struct CopyError {
    pub error: Error,
    pub queued: Fence,
}

impl From<Error> for CopyError {
    /// A failure before anything was queued.
    fn from(error: Error) -> CopyError {
        CopyError { error, queued: Fence::Done }
    }
}

impl CopyError {
    /// Waits for what was queued, then the error.
    pub fn settle(self) -> Error {
        if let Err(e) = self.queued.wait(false) {
            log::error!("device copies queued before a failure: {e}");
        }
        self.error
    }

    /// A fence that completes when what was queued does, with the error.
    pub fn into_fence(self) -> Fence {
        Fence::Pending(Box::new(FailedAfter(self)))
    }
}

struct FailedAfter(CopyError);

impl PendingCopy for FailedAfter {
    fn wait(self: Box<Self>, _spin: bool) -> Result<()> {
        Err(self.0.settle())
    }
}

/// A GPU (or its stand-in). Implementations are shared between the engine's threads.
pub trait Gpu: Send + Sync + 'static {
    /// `Device::Cuda(ordinal)`, or `Device::Emulated`; never `Auto`.
    fn device(&self) -> Device;
    /// For logs and the version string, e.g. "emulated device (host memory)".
    fn describe(&self) -> String;

    /// Device memory owned by kvxfer; `free_device` gives it back.
    fn alloc_device(&self, bytes: u64) -> Result<u64>;
    /// # Safety
    /// `addr` came from `alloc_device(bytes)` of this object and is no longer used.
    unsafe fn free_device(&self, addr: u64, bytes: u64);

    /// Page-aligned host memory the device copies to and from at full speed (pinned).
    fn alloc_pinned(&self, bytes: u64) -> Result<*mut u8>;
    /// # Safety
    /// `ptr` came from `alloc_pinned(bytes)` of this object and is no longer used.
    unsafe fn free_pinned(&self, ptr: *mut u8, bytes: u64);

    /// Checks that `[addr, addr + bytes)` is device memory of this device, so registering
    /// a wrong pointer is an error rather than a corrupted KV cache.
    fn check_device_range(&self, addr: u64, bytes: u64) -> Result<()>;

    /// Checks that `[addr, addr + bytes)` is page-locked host memory.
    fn check_pinned_range(&self, addr: u64, bytes: u64) -> Result<()>;

    /// Whether the device's kernels can read and write `[addr, addr + bytes)` of pinned
    /// host memory at those same addresses (zero-copy over the bus).
    fn maps_host(&self, addr: u64, bytes: u64) -> bool;

    /// Whether the device's kernels read host memory they map about as fast as a DMA
    /// does, so a dense host span may move to scattered device regions by the kernel
    /// reading it in place. Where not, the planner stages it instead (measured when a
    /// CUDA device opens: `cuda/host_reads.rs`).
    fn reads_host_in_place(&self) -> bool;

    /// Page-locks existing host memory (a mapped file) for the device's copies until
    /// `unregister_host`.
    fn register_host(&self, addr: u64, bytes: u64) -> Result<()>;
    /// # Safety
    /// `addr` was registered by `register_host` of this object and no copy still uses it.
    unsafe fn unregister_host(&self, addr: u64);

    /// Sets up per-slot device resources (events, staging) once the ring exists.
    fn prepare_slots(&self, slots: u32, slot_bytes: u64) -> Result<()>;

    /// Called once on each engine thread that talks to the device (makes a context current).
    fn bind_thread(&self) -> Result<()>;

    /// Makes the device's context current on a caller's thread for a moment (`copy` from a
    /// submit, or cuFile and UCX asking the driver about our memory); `leave` restores
    /// what was current before. The backend's own calls need neither: each leaves the
    /// caller's current context as it found it.
    fn enter(&self) -> Result<()> {
        Ok(())
    }
    fn leave(&self) {}

    /// Issues `ops` (all of one kind) for the chunk holding bounce slot `slot`, after the
    /// captured event `after` (see `capture_event`; such a chunk's copies wait on its
    /// request's gated lane), and returns their fence; `host` says
    /// what the host side is (unused for device-to-device). `critical`: a latency-critical
    /// request's copies, queued where bulk copies do not hold them up. At most
    /// `MAX_OPS_PER_COPY` ops. Called on the copy thread, or on a submitting thread
    /// between `enter` and `leave`. A failure after part of the batch was queued says so
    /// (`CopyError::queued`).
    fn copy(
        &self,
        kind: CopyKind,
        ops: &[CopyOp],
        slot: u32,
        host: HostSide,
        after: Option<Gate>,
        critical: bool,
    ) -> std::result::Result<Fence, CopyError>;

    /// Captures the caller's CUDA event as of now into an event of ours that copies can
    /// wait on, so re-recording the caller's event later changes nothing, and picks the
    /// gated lane of the request's copies: one no running request has, where there is one.
    fn capture_event(&self, event: u64) -> Result<Gate>;

    /// Frees what `capture_event` took, once no copy of its request is still to be issued.
    fn release_event(&self, gate: Gate);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_gated_lane_has_a_fence_lane_of_its_own() {
        let kinds = [CopyKind::HostToDevice, CopyKind::DeviceToHost, CopyKind::DeviceToDevice];
        let ungated: Vec<usize> = kinds
            .iter()
            .flat_map(|&k| (0..2).flat_map(move |slot| [false, true].map(|critical| fence_lane(k, slot, None, critical))))
            .collect();
        let gated: Vec<usize> =
            (0..GATED_LANES).map(|lane| fence_lane(CopyKind::DeviceToHost, 0, Some(Gate { event: 1, lane }), false)).collect();
        for (lane, &fence) in gated.iter().enumerate() {
            assert!(fence < FENCE_LANES);
            assert!(!ungated.contains(&fence), "gated lane {lane} shares fence lane {fence} with ungated copies");
            assert_eq!(gated.iter().filter(|&&f| f == fence).count(), 1, "gated lane {lane} shares fence lane {fence}");
            for k in kinds {
                for critical in [false, true] {
                    let f = fence_lane(k, 1, Some(Gate { event: 2, lane }), critical);
                    assert_eq!(f, fence, "a request's copies both ways share its lane's fences");
                }
            }
        }
    }

    #[test]
    fn critical_copies_have_fence_lanes_of_their_own() {
        for kind in [CopyKind::HostToDevice, CopyKind::DeviceToHost] {
            let critical = fence_lane(kind, 0, None, true);
            assert!(critical < FENCE_LANES);
            assert_eq!(fence_lane(kind, 1, None, true), critical, "one lane per direction, whatever the slot");
            for k in [CopyKind::HostToDevice, CopyKind::DeviceToHost, CopyKind::DeviceToDevice] {
                for slot in 0..2 {
                    assert_ne!(fence_lane(k, slot, None, false), critical, "a bulk copy's fence on a critical lane");
                }
            }
        }
        assert_ne!(fence_lane(CopyKind::HostToDevice, 0, None, true), fence_lane(CopyKind::DeviceToHost, 0, None, true));
    }
}
