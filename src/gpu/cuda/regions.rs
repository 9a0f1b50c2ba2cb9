//! Many small regions as one PCIe copy plus one kernel launch.
//!
//! Per-region `cuMemcpyAsync` pays a fixed cost per call that dominates below about a
//! megabyte (measured: 9.7 GB/s for 32 KiB regions on an H200, against ~52 GB/s for the
//! staged path). So a chunk of small regions is moved as:
//! - H2D: one copy host → the slot's device staging area, then `kvx_copy_regions`
//!   scatters staging → regions;
//! - D2H: `kvx_copy_regions` gathers regions → staging, then one copy staging → host;
//! - D2D: `kvx_copy_regions` straight from regions to regions.
//! - Host regions scattered too thinly to stage whole, in pinned memory the device maps:
//!   `kvx_copy_regions` straight between host and device regions, the SMs reading or
//!   writing the host over the bus (measured by `cpp_examples/scatter_limit.cu` on an
//!   H200, 2048 random 32 KiB regions: 0.91 of one contiguous copy H2D and 0.95 D2H,
//!   against 0.50 for `cuMemcpyBatchAsync` and 0.19 for a copy per region). No CPU
//!   gathers the regions and no staging pass runs.
//!
//! The region table goes up with one small copy from the slot's pinned table.

use super::driver::{check, sys};
use crate::error::Result;
use crate::gpu::{CopyKind, CopyOp, HostSide};
use std::ffi::c_void;

/// Regions at most this large (on average in a chunk) take the batched path. Below it the
/// per-call overhead of one memcpy per region costs more than the kernel's extra pass
/// over device memory; see the README's measurement.
pub const BATCH_MAX_REGION: u64 = 1 << 20;
/// Regions per chunk the table holds: as many as one copy may be given.
const MAX_REGIONS: usize = crate::gpu::MAX_OPS_PER_COPY;
/// A host range is copied whole only if the regions cover at least this share of it.
const MIN_DENSITY: f64 = 0.75;

const PTX: &str = concat!(include_str!("kernels.ptx"), "\0");

#[repr(C)]
#[derive(Clone, Copy)]
struct Region {
    dst: u64,
    src: u64,
    len: u64,
}

pub struct RegionKernel {
    module: sys::CUmodule,
    func: sys::CUfunction,
}

impl RegionKernel {
    /// Loads the PTX (the driver JIT-compiles it for this GPU).
    pub fn load() -> Result<RegionKernel> {
        let mut module = std::ptr::null_mut();
        let mut func = std::ptr::null_mut();
        // SAFETY: NUL-terminated PTX text; context current (CudaGpu::open).
        unsafe {
            check(sys::cuModuleLoadData(&mut module, PTX.as_ptr() as *const c_void), "cuModuleLoadData")?;
            if let Err(e) = check(sys::cuModuleGetFunction(&mut func, module, c"kvx_copy_regions".as_ptr()), "cuModuleGetFunction") {
                sys::cuModuleUnload(module);
                return Err(e);
            }
        }
        Ok(RegionKernel { module, func })
    }

    /// # Safety
    /// Context current; no launch in flight.
    pub unsafe fn unload(self) {
        sys::cuModuleUnload(self.module);
    }
}

/// Per-slot device resources: the event that frees the slot, a device staging area of
/// the slot's size, and the region table (pinned host + device).
pub struct SlotResources {
    events: Vec<sys::CUevent>,
    staging: Vec<sys::CUdeviceptr>,
    host_tables: *mut Region,
    device_tables: sys::CUdeviceptr,
    slot_bytes: u64,
}

impl SlotResources {
    pub fn new(slots: u32, slot_bytes: u64, batched: bool) -> Result<SlotResources> {
        let mut r = SlotResources {
            events: Vec::new(),
            staging: Vec::new(),
            host_tables: std::ptr::null_mut(),
            device_tables: 0,
            slot_bytes,
        };
        // SAFETY: context current (prepare_slots binds); on error `free` releases what exists.
        let built = unsafe { r.build(slots, batched) };
        if let Err(e) = built {
            unsafe { r.free() };
            return Err(e);
        }
        Ok(r)
    }

    unsafe fn build(&mut self, slots: u32, batched: bool) -> Result<()> {
        let flags = sys::CUevent_flags_enum::CU_EVENT_BLOCKING_SYNC as u32 | sys::CUevent_flags_enum::CU_EVENT_DISABLE_TIMING as u32;
        for _ in 0..slots {
            let mut ev = std::ptr::null_mut();
            check(sys::cuEventCreate(&mut ev, flags), "cuEventCreate")?;
            self.events.push(ev);
        }
        if !batched {
            return Ok(());
        }
        for _ in 0..slots {
            let mut p = 0;
            check(sys::cuMemAlloc_v2(&mut p, self.slot_bytes as usize), "cuMemAlloc (staging)")?;
            self.staging.push(p);
        }
        let table_bytes = slots as usize * MAX_REGIONS * std::mem::size_of::<Region>();
        let mut h = std::ptr::null_mut();
        check(sys::cuMemHostAlloc(&mut h, table_bytes, sys::CU_MEMHOSTALLOC_PORTABLE), "cuMemHostAlloc (region tables)")?;
        self.host_tables = h as *mut Region;
        check(sys::cuMemAlloc_v2(&mut self.device_tables, table_bytes), "cuMemAlloc (region tables)")?;
        Ok(())
    }

    pub fn event(&self, slot: u32) -> sys::CUevent {
        self.events[slot as usize]
    }

    /// # Safety
    /// Context current; nothing in flight.
    pub unsafe fn free(&self) {
        for &e in &self.events {
            sys::cuEventDestroy_v2(e);
        }
        for &p in &self.staging {
            sys::cuMemFree_v2(p);
        }
        if !self.host_tables.is_null() {
            sys::cuMemFreeHost(self.host_tables as *mut c_void);
        }
        if self.device_tables != 0 {
            sys::cuMemFree_v2(self.device_tables);
        }
    }
}

/// The host address range `[lo, hi)` the ops touch on the host side, and their bytes.
fn host_span(ops: &[CopyOp], host_is_src: bool) -> (u64, u64, u64) {
    let mut lo = u64::MAX;
    let mut hi = 0;
    let mut bytes = 0;
    for op in ops {
        let a = if host_is_src { op.src } else { op.dst };
        lo = lo.min(a);
        hi = hi.max(a + op.len);
        bytes += op.len;
    }
    (lo, hi, bytes)
}

/// Moves `ops` with one staged copy and one launch, or one zero-copy launch, when that
/// pays; `false` when the caller should copy one by one instead.
///
/// # Safety
/// Copy thread with the context current; `slot` is this chunk's.
pub unsafe fn try_batched(
    k: &RegionKernel,
    res: &SlotResources,
    slot: u32,
    kind: CopyKind,
    ops: &[CopyOp],
    host_side: HostSide,
    stream: sys::CUstream,
) -> Result<bool> {
    if ops.len() < 2 || ops.len() > MAX_REGIONS || res.staging.is_empty() {
        return Ok(false);
    }
    let total: u64 = ops.iter().map(|o| o.len).sum();
    if total / ops.len() as u64 > BATCH_MAX_REGION {
        return Ok(false);
    }
    let staging = res.staging[slot as usize];
    let table = res.host_tables.add(slot as usize * MAX_REGIONS);
    let dtable = res.device_tables + (slot as usize * MAX_REGIONS * std::mem::size_of::<Region>()) as u64;
    // Staged, the host side moves as one range: only a bounce slot, which is one
    // allocation whose unused bytes are scratch (a layout's range may span several
    // allocations, which one copy may not cross), and only if it fits the staging area
    // and is dense enough to be worth copying whole. Otherwise the kernel moves the
    // regions in place if the device maps the host side.
    let host = match kind {
        CopyKind::HostToDevice | CopyKind::DeviceToHost => {
            let (lo, hi, bytes) = host_span(ops, kind == CopyKind::HostToDevice);
            let span = hi - lo;
            let dense = bytes as f64 >= MIN_DENSITY * span as f64;
            match host_side {
                HostSide::Bounce | HostSide::MappedSpan if span <= res.slot_bytes && dense => Some((lo, span)),
                HostSide::Mapped | HostSide::MappedSpan => None,
                _ => return Ok(false),
            }
        }
        CopyKind::DeviceToDevice => None,
    };
    let mut max_len = 0;
    for (i, op) in ops.iter().enumerate() {
        let r = match (kind, host) {
            (CopyKind::HostToDevice, Some((lo, _))) => Region { dst: op.dst, src: staging + (op.src - lo), len: op.len },
            (CopyKind::DeviceToHost, Some((lo, _))) => Region { dst: staging + (op.dst - lo), src: op.src, len: op.len },
            _ => Region { dst: op.dst, src: op.src, len: op.len },
        };
        table.add(i).write(r);
        max_len = max_len.max(op.len);
    }
    let table_bytes = ops.len() * std::mem::size_of::<Region>();
    check(sys::cuMemcpyHtoDAsync_v2(dtable, table as *const c_void, table_bytes, stream), "cuMemcpyHtoDAsync (region table)")?;
    if let (CopyKind::HostToDevice, Some((lo, span))) = (kind, host) {
        check(sys::cuMemcpyHtoDAsync_v2(staging, lo as *const c_void, span as usize, stream), "cuMemcpyHtoDAsync (staging)")?;
    }
    // About 64 KiB per thread block: enough blocks per region to fill the GPU.
    let blocks_per_region = max_len.div_ceil(64 << 10).clamp(1, 64) as u32;
    let mut table_arg = dtable;
    let mut count = ops.len() as u32;
    let mut params = [&mut table_arg as *mut u64 as *mut c_void, &mut count as *mut u32 as *mut c_void];
    check(
        sys::cuLaunchKernel(k.func, blocks_per_region, count, 1, 256, 1, 1, 0, stream, params.as_mut_ptr(), std::ptr::null_mut()),
        "cuLaunchKernel (kvx_copy_regions)",
    )?;
    if let (CopyKind::DeviceToHost, Some((lo, span))) = (kind, host) {
        check(sys::cuMemcpyDtoHAsync_v2(lo as *mut c_void, staging, span as usize, stream), "cuMemcpyDtoHAsync (staging)")?;
    }
    Ok(true)
}
