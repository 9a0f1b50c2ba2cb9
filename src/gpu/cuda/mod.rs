//! A real GPU through the CUDA driver API (cudarc, loaded at run time).
//!
//! - One primary context: made current once on each of kvxfer's own threads (`bind`);
//!   on a thread of the caller's, pushed for the call and popped after (`Pushed`), so the
//!   caller's own current context is left as it was.
//! - Two H2D and two D2H streams (by slot parity), so both directions run at once and a
//!   chunk's region kernel overlaps the next chunk's PCIe copy; device-to-device copies
//!   use the H2D streams. Plain bulk copies all take the first stream of their direction,
//!   latency-critical plain copies the second, so they queue behind no plain bulk copy;
//!   region-kernel chunks of either kind take their slot's parity. A request gated on a
//!   caller's event has its event captured,
//!   and its copies queued, on a gated lane's stream, one of its own while lanes last, so
//!   that wait holds up no other request (`gated.rs`).
//! - One event per bounce slot: recorded after the slot's copies, waited on by a fence
//!   thread (briefly by query when its lane is idle, then in blocking sync), then the slot
//!   is free again.
//! - Many small regions move as one large PCIe copy plus one kernel launch, or, scattered
//!   over mapped pinned memory, as one kernel launch that reads or writes the host over
//!   the bus (see `regions.rs`); large ones as one async memcpy each.

pub mod driver;
mod gated;
mod host_reads;
mod regions;

use super::{CopyError, CopyKind, CopyOp, Device, Fence, Gate, Gpu, HostSide, PendingCopy};
use crate::error::{bail, Error, Result, Status};
use driver::{check, sys};
use gated::GatedLanes;
use regions::{RegionKernel, SlotResources};
use std::ffi::c_void;
use std::sync::OnceLock;

pub use driver::{driver_version, present};

/// Owns a retain of its device's primary context from the moment `open` takes it: any
/// error of `open` after that drops the half-built value, and `Drop` releases it.
pub struct CudaGpu {
    ordinal: u32,
    dev: sys::CUdevice,
    name: String,
    ctx: sys::CUcontext,
    h2d: [sys::CUstream; 2],
    d2h: [sys::CUstream; 2],
    /// Where caller events are captured at submit time (see `capture_event`) and the
    /// copies gated on them are queued.
    gated: GatedLanes,
    kernel: Option<RegionKernel>,
    /// The region kernel reads mapped host memory about as fast as a DMA does
    /// (`host_reads.rs`, measured at open).
    reads_host_in_place: bool,
    slots: OnceLock<SlotResources>,
}

// SAFETY: CUDA handles may be used from any thread once the context is current there,
// which `bind` or `current` ensures; the driver API is thread-safe.
unsafe impl Send for CudaGpu {}
unsafe impl Sync for CudaGpu {}

impl CudaGpu {
    /// Opens device `ordinal`: `NoDevice` when there is no driver or no such device.
    pub fn open(ordinal: u32) -> Result<CudaGpu> {
        if !present() {
            bail!(NoDevice, "device {ordinal}: no CUDA driver (libcuda.so not found); use KVX_DEVICE_AUTO or KVX_DEVICE_EMULATED");
        }
        // SAFETY: driver calls with valid out-pointers; the library is present.
        unsafe {
            check(sys::cuInit(0), "cuInit").map_err(|e| Error::new(Status::NoDevice, e.message))?;
            let mut count = 0;
            check(sys::cuDeviceGetCount(&mut count), "cuDeviceGetCount")?;
            if ordinal >= count as u32 {
                bail!(NoDevice, "device {ordinal}: this machine has {count} CUDA device(s)");
            }
            let mut dev = 0;
            check(sys::cuDeviceGet(&mut dev, ordinal as i32), "cuDeviceGet")?;
            let mut name = [0 as std::ffi::c_char; 128];
            check(sys::cuDeviceGetName(name.as_mut_ptr(), name.len() as i32, dev), "cuDeviceGetName")?;
            let name = std::ffi::CStr::from_ptr(name.as_ptr()).to_string_lossy().into_owned();
            let mut ctx = std::ptr::null_mut();
            check(sys::cuDevicePrimaryCtxRetain(&mut ctx, dev), "cuDevicePrimaryCtxRetain")?;
            let mut gpu = CudaGpu {
                ordinal,
                dev,
                name,
                ctx,
                h2d: [std::ptr::null_mut(); 2],
                d2h: [std::ptr::null_mut(); 2],
                gated: GatedLanes::default(),
                kernel: None,
                reads_host_in_place: false,
                slots: OnceLock::new(),
            };
            // Dropped before `gpu` on every return, so an error pops it before `gpu`'s
            // `Drop` releases the context.
            let _current = Pushed::new(ctx)?;
            let flags = sys::CUstream_flags_enum::CU_STREAM_NON_BLOCKING as u32;
            for s in gpu.h2d.iter_mut().chain(gpu.d2h.iter_mut()) {
                check(sys::cuStreamCreate(s, flags), "cuStreamCreate")?;
            }
            gpu.gated.create()?;
            gpu.kernel = match RegionKernel::load() {
                Ok(k) => Some(k),
                Err(e) => {
                    log::warn!("device {ordinal}: region kernel unavailable ({}); small regions use one copy each", e.message);
                    None
                }
            };
            if let Some(k) = &gpu.kernel {
                gpu.reads_host_in_place = host_reads::reads_in_place(ordinal, k, gpu.h2d[0]);
            }
            Ok(gpu)
        }
    }

    /// Makes our context current on one of kvxfer's own threads, for good.
    fn bind(&self) -> Result<()> {
        // SAFETY: our retained primary context.
        check(unsafe { sys::cuCtxSetCurrent(self.ctx) }, "cuCtxSetCurrent")
    }

    /// Makes our context current until the guard drops: every call that may run on a
    /// thread of the caller's, which must find its own context current afterwards.
    fn current(&self) -> Result<Pushed> {
        Pushed::new(self.ctx)
    }

    /// The stream of a chunk's copies. A chunk that launches the region kernel takes its
    /// slot's parity, so one chunk's kernel runs beside the next one's DMA
    /// (`docs/decisions.md#one-fifo-stream-per-direction-for-everything`). Plain copies all
    /// take the direction's first stream: on two, the copy engine served one stream's
    /// copies while the other's waited, and with each submitter's requests held to one slot
    /// parity by the LIFO ring, some submitters' p99 grew several times over
    /// (`docs/decisions.md#plain-copies-on-two-streams-per-direction`). Each fence lane still waits in the
    /// issue order of its stream's events, so lanes sharing a stream stay in order.
    /// A chunk gated on a caller's event takes its request's gated lane, whose fences
    /// have a lane of their own too (`fence_lane`): its wait would hold up every copy
    /// queued behind it on a shared stream.
    ///
    /// A latency-critical chunk of plain copies takes its direction's second stream, so
    /// plain bulk copies, which queue on the first, never hold it up. A critical chunk
    /// that launches the region kernel takes its slot's parity as a bulk one does: on one
    /// stream its kernel and the next chunk's DMA ran one after the other, and a lone
    /// critical onboard of 256 blocks took 1.2× as long as the same in arrival order
    /// (`docs/benchmarks.md#loads-first-and-layer-wise-tails-h100`). A stream of its own
    /// would be a ninth, which shares one of the driver's eight hardware queues with a
    /// stream of ours (`gated.rs`).
    fn stream(&self, kind: CopyKind, slot: u32, kernel: bool, after: Option<Gate>, critical: bool) -> sys::CUstream {
        let i = if kernel {
            (slot % 2) as usize
        } else if critical {
            1
        } else {
            0
        };
        match (kind, after) {
            (_, Some(gate)) => self.gated.stream(gate.lane),
            (CopyKind::DeviceToHost, None) => self.d2h[i],
            (CopyKind::HostToDevice | CopyKind::DeviceToDevice, None) => self.h2d[i],
        }
    }

    /// One async memcpy per op.
    unsafe fn copy_each(&self, kind: CopyKind, ops: &[CopyOp], stream: sys::CUstream) -> Result<()> {
        for op in ops {
            let n = op.len as usize;
            let r = match kind {
                CopyKind::HostToDevice => sys::cuMemcpyHtoDAsync_v2(op.dst, op.src as *const c_void, n, stream),
                CopyKind::DeviceToHost => sys::cuMemcpyDtoHAsync_v2(op.dst as *mut c_void, op.src, n, stream),
                CopyKind::DeviceToDevice => sys::cuMemcpyDtoDAsync_v2(op.dst, op.src, n, stream),
            };
            check(r, "cuMemcpyAsync")?;
        }
        Ok(())
    }

    /// Whether `[addr, end)` lies in the one page-locked allocation or registration that
    /// holds `addr`, and `at(addr)` holds (a property of the whole range). Where the driver
    /// reports no range for host memory, every page is asked `at` instead. A range that
    /// only starts and ends in pinned memory may have unpinned pages or another
    /// allocation in between, which the region kernel would reach.
    fn pinned_throughout(&self, addr: u64, end: u64, at: impl Fn(u64) -> bool) -> bool {
        use sys::CUpointer_attribute_enum::*;
        if !at(addr) {
            return false;
        }
        let start = self.pointer_attribute::<u64>(CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, addr);
        let size = self.pointer_attribute::<usize>(CU_POINTER_ATTRIBUTE_RANGE_SIZE, addr);
        match (start, size) {
            (Ok(start), Ok(size)) if size > 0 && start <= addr => end <= start.saturating_add(size as u64),
            _ => {
                log::warn!("the driver reports no extent for pinned memory at {addr:#x}; checking its {} bytes page by page", end - addr);
                let first_page = addr & !(PAGE - 1);
                (1..).map(|i| first_page + i * PAGE).take_while(|&a| a < end).all(&at) && at(end - 1)
            }
        }
    }

    fn pointer_attribute<T: Default>(&self, attr: sys::CUpointer_attribute, addr: u64) -> std::result::Result<T, sys::CUresult> {
        let mut v = T::default();
        // SAFETY: `v` is the attribute's documented type (callers pick it).
        let r = unsafe { sys::cuPointerGetAttribute(&mut v as *mut T as *mut c_void, attr, addr) };
        if r == sys::CUresult::CUDA_SUCCESS {
            Ok(v)
        } else {
            Err(r)
        }
    }
}

/// A context pushed on this thread, popped again when dropped.
struct Pushed(());

impl Pushed {
    fn new(ctx: sys::CUcontext) -> Result<Pushed> {
        // SAFETY: a retained context; popped in `drop`.
        check(unsafe { sys::cuCtxPushCurrent_v2(ctx) }, "cuCtxPushCurrent")?;
        Ok(Pushed(()))
    }
}

impl Drop for Pushed {
    fn drop(&mut self) {
        let mut popped = std::ptr::null_mut();
        // SAFETY: pops the context `new` pushed on this thread.
        unsafe { sys::cuCtxPopCurrent_v2(&mut popped) };
    }
}

/// The granularity of page-locking (cuMemHostRegister rounds to pages of at least this).
const PAGE: u64 = 4096;

struct EventWait(sys::CUevent);
// SAFETY: events may be synchronised from any thread.
unsafe impl Send for EventWait {}

/// How long a fence keeps looking at its event, yielding between looks: small copies are
/// seen done at once.
const FENCE_SPIN: std::time::Duration = std::time::Duration::from_micros(100);
/// Then, up to `FENCE_POLL_FOR`, it looks every `FENCE_POLL`, sleeping in between: a
/// blocking-sync wake-up costs tens of microseconds after the copy ends (a 12.6 MB copy
/// seen done 50 us after a spinning caller saw it), a short sleep costs a
/// few microseconds of CPU per look. Longer copies sleep in `cuEventSynchronize`.
const FENCE_POLL: std::time::Duration = std::time::Duration::from_micros(10);
const FENCE_POLL_FOR: std::time::Duration = std::time::Duration::from_millis(2);

impl EventWait {
    /// Whether the copies finished.
    fn done(&self) -> Result<bool> {
        // SAFETY: the slot's event, alive as long as the engine's device.
        match unsafe { sys::cuEventQuery(self.0) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            r => check(r, "cuEventQuery").map(|_| false),
        }
    }
}

impl PendingCopy for EventWait {
    fn wait(self: Box<Self>, spin: bool) -> Result<()> {
        let start = std::time::Instant::now();
        if spin {
            while start.elapsed() < FENCE_SPIN {
                if self.done()? {
                    return Ok(());
                }
                // A yield between looks, not a busy pause: each query takes the driver's
                // locks, which the threads issuing copies need, and a yield leaves about
                // a microsecond between looks where 256 pauses left several (a 256 KiB
                // request's p50 over the raw copy: +4-5 us with the yield, up to +10 with
                // the pauses). It also lets a thread that shares
                // this core run.
                std::thread::yield_now();
            }
            while start.elapsed() < FENCE_POLL_FOR {
                if self.done()? {
                    return Ok(());
                }
                std::thread::sleep(FENCE_POLL);
            }
        }
        // SAFETY: the slot's event, alive as long as the engine's device.
        check(unsafe { sys::cuEventSynchronize(self.0) }, "cuEventSynchronize")
    }
}

impl Gpu for CudaGpu {
    fn device(&self) -> Device {
        Device::Cuda(self.ordinal)
    }

    fn describe(&self) -> String {
        format!("CUDA device {}: {} (driver {})", self.ordinal, self.name, driver_version().unwrap_or_default())
    }

    fn alloc_device(&self, bytes: u64) -> Result<u64> {
        let _current = self.current()?;
        let mut p = 0;
        // SAFETY: valid out-pointer, context current.
        let r = unsafe { sys::cuMemAlloc_v2(&mut p, bytes as usize) };
        if r == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
            bail!(NoMemory, "device {}: out of memory allocating {bytes} bytes", self.ordinal);
        }
        check(r, "cuMemAlloc")?;
        Ok(p)
    }

    unsafe fn free_device(&self, addr: u64, _bytes: u64) {
        if let Ok(_current) = self.current() {
            let _ = check(sys::cuMemFree_v2(addr), "cuMemFree").map_err(|e| log::error!("{e}"));
        }
    }

    fn alloc_pinned(&self, bytes: u64) -> Result<*mut u8> {
        let _current = self.current()?;
        let mut p = std::ptr::null_mut();
        // SAFETY: valid out-pointer; PORTABLE so every context sees it pinned.
        let r = unsafe { sys::cuMemHostAlloc(&mut p, bytes as usize, sys::CU_MEMHOSTALLOC_PORTABLE) };
        if r == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
            bail!(NoMemory, "out of pinned host memory allocating {bytes} bytes");
        }
        check(r, "cuMemHostAlloc")?;
        Ok(p as *mut u8)
    }

    unsafe fn free_pinned(&self, ptr: *mut u8, _bytes: u64) {
        if let Ok(_current) = self.current() {
            let _ = check(sys::cuMemFreeHost(ptr as *mut c_void), "cuMemFreeHost").map_err(|e| log::error!("{e}"));
        }
    }

    fn check_device_range(&self, addr: u64, bytes: u64) -> Result<()> {
        use sys::CUpointer_attribute_enum::*;
        let _current = self.current()?;
        let kind: u32 = self.pointer_attribute(CU_POINTER_ATTRIBUTE_MEMORY_TYPE, addr).map_err(|r| {
            Error::new(
                Status::InvalidArg,
                format!("{addr:#x} is not memory CUDA knows ({r:?}); pass a device pointer from cuMemAlloc/cudaMalloc"),
            )
        })?;
        if kind != sys::CUmemorytype_enum::CU_MEMORYTYPE_DEVICE as u32 {
            bail!(
                InvalidArg,
                "{addr:#x} is not device memory (CUDA memory type {kind}); register host memory with kvx_layout_register_host"
            );
        }
        let dev: i32 = self.pointer_attribute(CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, addr).unwrap_or(-1);
        if dev != self.ordinal as i32 {
            bail!(InvalidArg, "{addr:#x} is memory of device {dev}, but this engine drives device {}", self.ordinal);
        }
        let (mut base, mut size) = (0u64, 0usize);
        // SAFETY: valid out-pointers; `addr` is device memory (checked above).
        check(unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, addr) }, "cuMemGetAddressRange")?;
        let end = base + size as u64;
        if addr.checked_add(bytes).is_none_or(|e| e > end) {
            bail!(
                InvalidArg,
                "the layout needs {bytes} bytes from {addr:#x}, but that allocation ends {} bytes after it; check the geometry or the pointer",
                end - addr
            );
        }
        Ok(())
    }

    fn check_pinned_range(&self, addr: u64, bytes: u64) -> Result<()> {
        use sys::CUpointer_attribute_enum::*;
        let Some(end) = addr.checked_add(bytes).filter(|&e| e > addr) else {
            bail!(InvalidArg, "pinned range at {addr:#x} of {bytes} bytes is empty or wraps the address space");
        };
        let _current = self.current()?;
        let kind: u32 = self.pointer_attribute(CU_POINTER_ATTRIBUTE_MEMORY_TYPE, addr).map_err(|_| {
            Error::new(
                Status::InvalidArg,
                format!("{addr:#x} is not page-locked; pin it (cudaHostRegister) or register it without KVX_HOST_PINNED"),
            )
        })?;
        if kind != sys::CUmemorytype_enum::CU_MEMORYTYPE_HOST as u32 {
            bail!(InvalidArg, "{addr:#x} is not pinned host memory (CUDA memory type {kind})");
        }
        if !self.pinned_throughout(addr, end, |a| self.pointer_attribute::<u32>(CU_POINTER_ATTRIBUTE_MEMORY_TYPE, a) == Ok(kind)) {
            bail!(
                InvalidArg,
                "the layout needs {bytes} bytes of page-locked memory from {addr:#x}, but the pinned allocation or registration there ends \
                 before that; pass the whole pinned buffer's size, or register it without KVX_HOST_PINNED"
            );
        }
        Ok(())
    }

    fn maps_host(&self, addr: u64, bytes: u64) -> bool {
        use sys::CUpointer_attribute_enum::CU_POINTER_ATTRIBUTE_DEVICE_POINTER;
        // Without the region kernel nothing would use the mapping.
        let Some(end) = addr.checked_add(bytes).filter(|&e| e > addr && self.kernel.is_some()) else { return false };
        let Ok(_current) = self.current() else { return false };
        // Under unified addressing, pinned memory the device maps has the host's address
        // on the device too; memory pinned without a mapping reports no device pointer.
        self.pinned_throughout(addr, end, |a| self.pointer_attribute::<u64>(CU_POINTER_ATTRIBUTE_DEVICE_POINTER, a) == Ok(a))
    }

    fn reads_host_in_place(&self) -> bool {
        self.reads_host_in_place
    }

    fn register_host(&self, addr: u64, bytes: u64) -> Result<()> {
        let _current = self.current()?;
        // SAFETY: the caller's mapping of `bytes` at `addr`; PORTABLE so every context sees
        // it, DEVICEMAP so the region kernel can address it (`maps_host`).
        let flags = sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP;
        let r = unsafe { sys::cuMemHostRegister_v2(addr as *mut c_void, bytes as usize, flags) };
        if r == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
            bail!(NoMemory, "page-locking {bytes} bytes of a mapped file for the device: out of memory");
        }
        check(r, "cuMemHostRegister")
    }

    unsafe fn unregister_host(&self, addr: u64) {
        if let Ok(_current) = self.current() {
            let _ = check(sys::cuMemHostUnregister(addr as *mut c_void), "cuMemHostUnregister").map_err(|e| log::error!("{e}"));
        }
    }

    fn prepare_slots(&self, slots: u32, slot_bytes: u64) -> Result<()> {
        let _current = self.current()?;
        let r = SlotResources::new(slots, slot_bytes, self.kernel.is_some())?;
        self.slots.set(r).map_err(|_| Error::new(Status::Internal, "slot resources prepared twice"))
    }

    fn bind_thread(&self) -> Result<()> {
        self.bind()
    }

    fn enter(&self) -> Result<()> {
        // SAFETY: our retained primary context; popped again in `leave`.
        check(unsafe { sys::cuCtxPushCurrent_v2(self.ctx) }, "cuCtxPushCurrent")
    }

    fn leave(&self) {
        let mut popped = std::ptr::null_mut();
        // SAFETY: pops the context `enter` pushed on this thread.
        unsafe { sys::cuCtxPopCurrent_v2(&mut popped) };
    }

    fn copy(
        &self,
        kind: CopyKind,
        ops: &[CopyOp],
        slot: u32,
        host: HostSide,
        after: Option<Gate>,
        critical: bool,
    ) -> std::result::Result<Fence, CopyError> {
        let res = self.slots.get().expect("prepare_slots runs before any copy");
        let kernel = self.kernel.as_ref().filter(|_| regions::batches(res, kind, ops, host));
        let stream = self.stream(kind, slot, kernel.is_some(), after, critical);
        // SAFETY: a thread with the context current (the copy thread, an I/O worker, a
        // submit between `enter` and `leave`); ops lie in validated layouts and this
        // chunk's slot; the slot's resources are this chunk's until its fence completes.
        unsafe {
            if let Some(gate) = after {
                check(sys::cuStreamWaitEvent(stream, gate.event as sys::CUevent, 0), "cuStreamWaitEvent")?;
            }
            let queued = match kernel {
                Some(k) => regions::run_batched(k, res, slot, kind, ops, host, stream),
                None => self.copy_each(kind, ops, stream),
            };
            // Recorded even after a failure: what the batch queued before it still reads
            // and writes the slot (and its region table) until this event fires.
            let ev = res.event(slot);
            match (queued, check(sys::cuEventRecord(ev, stream), "cuEventRecord")) {
                (Ok(()), Ok(())) => Ok(Fence::Pending(Box::new(EventWait(ev)))),
                (Err(error), Ok(())) => Err(CopyError { error, queued: Fence::Pending(Box::new(EventWait(ev))) }),
                (queued, Err(recording)) => {
                    // No event to wait on: wait for the stream itself, so nothing of this
                    // batch runs once the slot is free again.
                    if let Err(e) = check(sys::cuStreamSynchronize(stream), "cuStreamSynchronize") {
                        log::error!("device {}: after a failed batch: {e}", self.ordinal);
                    }
                    Err(queued.err().unwrap_or(recording).into())
                }
            }
        }
    }

    fn capture_event(&self, event: u64) -> Result<Gate> {
        if event == 0 {
            bail!(InvalidArg, "wait_event is NULL");
        }
        let _current = self.current()?;
        let mut ev = std::ptr::null_mut();
        // SAFETY: driver calls on our streams; a bad caller event makes cuStreamWaitEvent fail.
        unsafe {
            check(sys::cuEventCreate(&mut ev, sys::CUevent_flags_enum::CU_EVENT_DISABLE_TIMING as u32), "cuEventCreate")?;
            match self.gated.capture(event as sys::CUevent, ev) {
                Ok(lane) => Ok(Gate { event: ev as u64, lane }),
                Err(e) => {
                    sys::cuEventDestroy_v2(ev);
                    Err(Error::new(Status::InvalidArg, format!("wait_event is not a usable CUevent of this device: {}", e.message)))
                }
            }
        }
    }

    fn release_event(&self, gate: Gate) {
        self.gated.release(gate.lane);
        if let Ok(_current) = self.current() {
            // SAFETY: an event from `capture_event`; streams still waiting keep it alive.
            unsafe { sys::cuEventDestroy_v2(gate.event as sys::CUevent) };
        }
    }
}

impl Drop for CudaGpu {
    /// Also on `open`'s error paths, where what was not created yet is null or unset.
    fn drop(&mut self) {
        // SAFETY: every user of these handles (threads, layouts, the ring) is gone.
        unsafe {
            if let Ok(_current) = self.current() {
                if let Some(s) = self.slots.take() {
                    s.free();
                }
                if let Some(k) = self.kernel.take() {
                    k.unload();
                }
                self.gated.free();
                for s in self.h2d.into_iter().chain(self.d2h) {
                    if !s.is_null() {
                        sys::cuStreamDestroy_v2(s);
                    }
                }
            }
            sys::cuDevicePrimaryCtxRelease_v2(self.dev);
        }
    }
}
