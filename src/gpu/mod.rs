//! The device the engine copies to and from, behind one small trait.
//!
//! `Emulated` stands in for a GPU on machines without CUDA: device memory is host memory
//! and copies are memcpy, issued on the same copy thread and completed through the same
//! fences as real copies, so the pipeline's scheduling is exercised everywhere. The CUDA
//! backend implements the same trait.

mod emulated;
mod probe;

pub use emulated::Emulated;
pub use probe::{open_device, DEVICE_AUTO, DEVICE_EMULATED};

use crate::error::Result;

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

/// Something to wait on for a batch of copies that was issued asynchronously.
pub trait PendingCopy: Send {
    /// Blocks (sleeping, not spinning) until the copies finished; their outcome.
    fn wait(self: Box<Self>) -> Result<()>;
}

/// The completion of an issued batch of copies.
pub enum Fence {
    /// The copies already finished (emulated device, or a synchronous fallback).
    Done,
    Pending(Box<dyn PendingCopy>),
}

impl Fence {
    pub fn wait(self) -> Result<()> {
        match self {
            Fence::Done => Ok(()),
            Fence::Pending(p) => p.wait(),
        }
    }
}

/// A GPU (or its stand-in). Implementations are shared between the engine's threads.
pub trait Gpu: Send + Sync + 'static {
    /// CUDA ordinal, or -1 for the emulated device.
    fn ordinal(&self) -> i32;
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

    /// Called once on the copy thread before its first copy (e.g. to make a context current).
    fn bind_copy_thread(&self) -> Result<()>;

    /// Issues `ops` (all of one kind) and returns their fence. Called on the copy thread only.
    fn copy(&self, kind: CopyKind, ops: &[CopyOp]) -> Result<Fence>;
}
