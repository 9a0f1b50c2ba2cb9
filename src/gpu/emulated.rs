//! The emulated device: host memory plays device memory, memcpy plays the DMA engine.
//!
//! Its copies complete before `copy` returns; in test builds (`fault-injection`) it may
//! instead queue them on a stream of its own that runs them later, as a GPU does
//! (`fault::deferred_device`, `deferred.rs`).

use super::{CopyError, CopyKind, CopyOp, Device, Fence, Gate, Gpu, HostSide};
use crate::error::{bail, Error, Result, Status};
use crate::host::{map_anonymous, unmap};
use std::collections::BTreeMap;
use std::sync::RwLock;

/// Device allocations by start address, so copies are checked the way the CUDA driver
/// checks them: a copy may not run past the end of the allocation it starts in.
#[derive(Default)]
pub struct Emulated {
    allocations: RwLock<BTreeMap<u64, u64>>,
    /// Plays a host whose kernels read mapped host memory slowly (`Gpu::reads_host_in_place`).
    slow_host_reads: bool,
    /// Where copies run when they complete later (test builds only): bulk copies' stream
    /// and latency-critical ones', as on a GPU (`Gpu::copy`'s `critical`).
    #[cfg(feature = "fault-injection")]
    stream: Option<[super::deferred::Stream; 2]>,
}

impl Emulated {
    /// The emulated device: copies complete before `copy` returns, or in test builds later
    /// on a stream of its own where `fault::deferred_device` says so.
    pub fn new() -> Emulated {
        Emulated {
            #[cfg(feature = "fault-injection")]
            stream: crate::fault::deferred_device().then(|| [false, true].map(super::deferred::Stream::new)),
            ..Default::default()
        }
    }

    /// An emulated device on a host whose kernels read mapped host memory slowly, so the
    /// planner's other paths for host-to-device copies are tested here too.
    #[cfg(test)]
    pub(crate) fn with_slow_host_reads() -> Emulated {
        Emulated { slow_host_reads: true, ..Default::default() }
    }

    /// The fence of every copy issued so far on the stream of critical copies or of bulk
    /// ones.
    fn fence(&self, _critical: bool) -> Fence {
        #[cfg(feature = "fault-injection")]
        if let Some(s) = &self.stream {
            return Fence::Pending(s[_critical as usize].fence());
        }
        Fence::Done
    }

    fn check_in_one_allocation(&self, addr: u64, len: u64) -> Result<()> {
        let allocs = self.allocations.read().unwrap();
        if let Some((&start, &size)) = allocs.range(..=addr).next_back() {
            if addr < start + size && addr + len > start + size {
                bail!(Cuda, "copy of {len} bytes at {addr:#x} runs past the end of its device allocation (a GPU would refuse it)");
            }
        }
        Ok(())
    }
}

impl Gpu for Emulated {
    fn device(&self) -> Device {
        Device::Emulated
    }

    fn describe(&self) -> String {
        "emulated device (host memory)".to_string()
    }

    fn alloc_device(&self, bytes: u64) -> Result<u64> {
        let addr = map_anonymous(bytes)? as u64;
        self.allocations.write().unwrap().insert(addr, bytes);
        Ok(addr)
    }

    unsafe fn free_device(&self, addr: u64, bytes: u64) {
        self.allocations.write().unwrap().remove(&addr);
        unmap(addr as *mut u8, bytes)
    }

    fn alloc_pinned(&self, bytes: u64) -> Result<*mut u8> {
        map_anonymous(bytes)
    }

    unsafe fn free_pinned(&self, ptr: *mut u8, bytes: u64) {
        unmap(ptr, bytes)
    }

    fn check_device_range(&self, addr: u64, bytes: u64) -> Result<()> {
        // Host memory has no owner to ask; reject only what is certainly wrong.
        if addr == 0 {
            bail!(InvalidArg, "device base is NULL");
        }
        if addr.checked_add(bytes).is_none() {
            bail!(InvalidArg, "device range at {addr:#x} of {bytes} bytes wraps the address space");
        }
        Ok(())
    }

    fn check_pinned_range(&self, addr: u64, bytes: u64) -> Result<()> {
        self.check_device_range(addr, bytes)
    }

    fn maps_host(&self, _addr: u64, _bytes: u64) -> bool {
        true // its "device" is the host: scattered pinned regions take the zero-copy plan
    }

    fn reads_host_in_place(&self) -> bool {
        !self.slow_host_reads
    }

    fn register_host(&self, _addr: u64, _bytes: u64) -> Result<()> {
        Ok(()) // the emulated device copies with memcpy: any host memory will do
    }

    unsafe fn unregister_host(&self, _addr: u64) {}

    fn prepare_slots(&self, _slots: u32, _slot_bytes: u64) -> Result<()> {
        Ok(())
    }

    fn bind_thread(&self) -> Result<()> {
        Ok(())
    }

    fn capture_event(&self, _event: u64) -> Result<Gate> {
        bail!(InvalidArg, "wait_event needs a CUDA device; this engine runs on the emulated device")
    }

    fn release_event(&self, _gate: Gate) {}

    /// Checks every op before it copies any, as the driver checks a copy before it queues
    /// it; an injected op failure (`Site::DeviceOp`) strikes after the ops before it were
    /// copied or queued, as a driver call failing mid-batch does.
    fn copy(
        &self,
        kind: CopyKind,
        ops: &[CopyOp],
        _slot: u32,
        _host: HostSide,
        _after: Option<Gate>,
        critical: bool,
    ) -> std::result::Result<Fence, CopyError> {
        use crate::fault::{check, Site};
        if check(Site::DeviceCopy).is_some() {
            return Err(Error::new(Status::Cuda, "device copy failed (injected fault)").into());
        }
        for op in ops {
            if kind != CopyKind::HostToDevice {
                self.check_in_one_allocation(op.src, op.len)?;
            }
            if kind != CopyKind::DeviceToHost {
                self.check_in_one_allocation(op.dst, op.len)?;
            }
        }
        for (i, op) in ops.iter().enumerate() {
            if check(Site::DeviceOp).is_some() {
                let error = Error::new(Status::Cuda, format!("device op {i} of {} failed (injected fault)", ops.len()));
                return Err(CopyError { error, queued: self.fence(critical) });
            }
            #[cfg(feature = "fault-injection")]
            if let Some(s) = &self.stream {
                s[critical as usize].copy(*op);
                continue;
            }
            // SAFETY: the planner only emits ops inside validated layouts and bounce slots,
            // and a slot or region is owned by exactly one stage at a time.
            unsafe { std::ptr::copy_nonoverlapping(op.src as *const u8, op.dst as *mut u8, op.len as usize) };
        }
        Ok(self.fence(critical))
    }
}
