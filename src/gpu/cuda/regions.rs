//! Many small regions as one PCIe copy plus one kernel launch.
//!
//! Per-region `cuMemcpyAsync` pays a fixed cost per call that dominates below about a
//! megabyte (32 KiB regions move at about a fifth of the staged path's rate:
//! `docs/benchmarks.md#small-regions`). So a chunk of small regions is moved as:
//! - H2D: one copy host → the slot's device staging area, then `kvx_copy_regions`
//!   scatters staging → regions;
//! - D2H: `kvx_copy_regions` gathers regions → staging, then one copy staging → host;
//! - D2D: `kvx_copy_regions` straight from regions to regions.
//!   The host side is staged whole only where its bytes between the regions may be read
//!   (a bounce slot, or a layout's dense span in one allocation, H2D) or written (a slot).
//! - Host regions scattered too thinly to stage whole, in pinned memory the device maps:
//!   `kvx_copy_regions` straight between host and device regions, the SMs reading or
//!   writing the host over the bus, faster than `cuMemcpyBatchAsync` or a copy per region
//!   (`docs/benchmarks.md#scattered-regions-the-hardware-alone`, measured by
//!   `cpp_examples/probes/scatter_limit.cu`). No CPU gathers the regions and no staging
//!   pass runs.
//!
//! The kernel reads each chunk's region table straight from the slot's pinned host table,
//! which the device maps. A copy of the table into device memory sat in the copy engine's
//! queue before every chunk's data and slowed a stream of 2 MiB staged chunks by about 6 %
//! (`cpp_examples/probes/stage_limit.cu` measures it).

use super::driver::{check, sys};
use crate::error::Result;
use crate::gpu::{CopyKind, CopyOp, HostSide};
use std::ffi::c_void;

/// Regions at most this large (on average in a chunk) take the batched path. Below it the
/// per-call overhead of one memcpy per region costs more than the kernel's extra pass
/// over device memory (`docs/benchmarks.md#small-regions`).
pub const BATCH_MAX_REGION: u64 = 1 << 20;
/// Regions per chunk the table holds: as many as one copy may be given.
const MAX_REGIONS: usize = crate::gpu::MAX_OPS_PER_COPY;
/// A host range is copied whole only if the regions cover at least this share of it.
const MIN_DENSITY: f64 = 0.75;

const PTX: &str = concat!(include_str!("kernels.ptx"), "\0");

/// One entry of the kernel's region table (`kernels.cu`).
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct Region {
    pub dst: u64,
    pub src: u64,
    pub len: u64,
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

    /// Launches `kvx_copy_regions` over `count` regions of the table at device address
    /// `table`, the longest `max_len` bytes, on `stream`.
    ///
    /// # Safety
    /// Context current; the table and every region stay valid until the launch is done.
    pub unsafe fn launch(&self, table: sys::CUdeviceptr, count: u32, max_len: u64, stream: sys::CUstream) -> Result<()> {
        // About 64 KiB per thread block: enough blocks per region to fill the GPU.
        let blocks_per_region = max_len.div_ceil(64 << 10).clamp(1, 64) as u32;
        let mut table_arg = table;
        let mut count = count;
        let mut params = [&mut table_arg as *mut u64 as *mut c_void, &mut count as *mut u32 as *mut c_void];
        check(
            sys::cuLaunchKernel(self.func, blocks_per_region, count, 1, 256, 1, 1, 0, stream, params.as_mut_ptr(), std::ptr::null_mut()),
            "cuLaunchKernel (kvx_copy_regions)",
        )
    }

    /// # Safety
    /// Context current; no launch in flight.
    pub unsafe fn unload(self) {
        sys::cuModuleUnload(self.module);
    }
}

/// Per-slot device resources: the event that frees the slot, a device staging area of
/// the slot's size, and the region table in pinned host memory the device maps. A slot's
/// table is rewritten only once its event has fired, so after the kernel that read it.
pub struct SlotResources {
    events: Vec<sys::CUevent>,
    staging: Vec<sys::CUdeviceptr>,
    host_tables: *mut Region,
    /// `host_tables` as the device addresses it.
    mapped_tables: sys::CUdeviceptr,
    slot_bytes: u64,
}

impl SlotResources {
    pub fn new(slots: u32, slot_bytes: u64, batched: bool) -> Result<SlotResources> {
        let mut r =
            SlotResources { events: Vec::new(), staging: Vec::new(), host_tables: std::ptr::null_mut(), mapped_tables: 0, slot_bytes };
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
        let flags = sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP;
        check(sys::cuMemHostAlloc(&mut h, table_bytes, flags), "cuMemHostAlloc (region tables)")?;
        self.host_tables = h as *mut Region;
        check(sys::cuMemHostGetDevicePointer_v2(&mut self.mapped_tables, h, 0), "cuMemHostGetDevicePointer (region tables)")?;
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

/// How one chunk's ops move.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Batch {
    /// One copy per op (the caller's `copy_each`).
    PerOp,
    /// One launch moves the regions between their own addresses (device to device, or
    /// pinned host memory the device maps).
    InPlace,
    /// The host side `[lo, lo + span)` moves as one copy to or from the slot's device
    /// staging area, and one launch scatters or gathers the regions there.
    Staged { lo: u64, span: u64 },
}

/// Picks how `ops` move, given what their host side is and how large the staging area is.
///
/// Staged, the host side moves as one range: so it must be dense enough to be worth
/// copying whole and fit the staging area, and the range must be one the copy may read
/// or write whole. A bounce slot's bytes between the ops are scratch, either way. A
/// layout's dense span in one allocation (`MappedSpan`) may be read whole, never written
/// whole (the bytes between its regions are the caller's). Otherwise the kernel moves
/// the regions in place if the device maps the host side.
fn batch_for(kind: CopyKind, ops: &[CopyOp], host_side: HostSide, staging_bytes: u64) -> Batch {
    if ops.len() < 2 || ops.len() > MAX_REGIONS {
        return Batch::PerOp;
    }
    let total: u64 = ops.iter().map(|o| o.len).sum();
    if total / ops.len() as u64 > BATCH_MAX_REGION {
        return Batch::PerOp;
    }
    if kind == CopyKind::DeviceToDevice {
        return Batch::InPlace;
    }
    let h2d = kind == CopyKind::HostToDevice;
    let (lo, hi, bytes) = host_span(ops, h2d);
    let span = hi - lo;
    let fits = span <= staging_bytes && bytes as f64 >= MIN_DENSITY * span as f64;
    match host_side {
        HostSide::Bounce if fits => Batch::Staged { lo, span },
        HostSide::MappedSpan if fits && h2d => Batch::Staged { lo, span },
        HostSide::Mapped | HostSide::MappedSpan => Batch::InPlace,
        HostSide::Bounce | HostSide::Pinned => Batch::PerOp,
    }
}

/// The region the kernel moves for `op`: the host side replaced by its place in
/// `staging` when staged.
fn region(kind: CopyKind, op: &CopyOp, batch: Batch, staging: u64) -> Region {
    match (kind, batch) {
        (CopyKind::HostToDevice, Batch::Staged { lo, .. }) => Region { dst: op.dst, src: staging + (op.src - lo), len: op.len },
        (CopyKind::DeviceToHost, Batch::Staged { lo, .. }) => Region { dst: staging + (op.dst - lo), src: op.src, len: op.len },
        _ => Region { dst: op.dst, src: op.src, len: op.len },
    }
}

/// Whether `ops` move with one staged copy and one launch, or one zero-copy launch
/// (`run_batched`), rather than a copy each.
pub fn batches(res: &SlotResources, kind: CopyKind, ops: &[CopyOp], host_side: HostSide) -> bool {
    !res.staging.is_empty() && batch_for(kind, ops, host_side, res.slot_bytes) != Batch::PerOp
}

/// Moves `ops` with one staged copy and one launch, or one zero-copy launch; only for
/// ops that `batches`.
///
/// # Safety
/// Copy thread with the context current; `slot` is this chunk's.
pub unsafe fn run_batched(
    k: &RegionKernel,
    res: &SlotResources,
    slot: u32,
    kind: CopyKind,
    ops: &[CopyOp],
    host_side: HostSide,
    stream: sys::CUstream,
) -> Result<()> {
    let batch = batch_for(kind, ops, host_side, res.slot_bytes);
    debug_assert!(batch != Batch::PerOp && !res.staging.is_empty(), "run_batched on ops that do not batch");
    let staging = res.staging[slot as usize];
    let table = res.host_tables.add(slot as usize * MAX_REGIONS);
    let mapped_table = res.mapped_tables + (slot as usize * MAX_REGIONS * std::mem::size_of::<Region>()) as u64;
    let mut max_len = 0;
    for (i, op) in ops.iter().enumerate() {
        table.add(i).write(region(kind, op, batch, staging));
        max_len = max_len.max(op.len);
    }
    if let (CopyKind::HostToDevice, Batch::Staged { lo, span }) = (kind, batch) {
        check(sys::cuMemcpyHtoDAsync_v2(staging, lo as *const c_void, span as usize, stream), "cuMemcpyHtoDAsync (staging)")?;
    }
    k.launch(mapped_table, ops.len() as u32, max_len, stream)?;
    if let (CopyKind::DeviceToHost, Batch::Staged { lo, span }) = (kind, batch) {
        check(sys::cuMemcpyDtoHAsync_v2(lo as *mut c_void, staging, span as usize, stream), "cuMemcpyDtoHAsync (staging)")?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs a batch on the CPU as the device would: the staging copy of the host span,
    /// then the kernel's regions (for D2H the other way round).
    fn run(kind: CopyKind, ops: &[CopyOp], batch: Batch, staging: &mut [u8]) {
        let st = staging.as_mut_ptr() as u64;
        let copy = |dst: u64, src: u64, len: u64| unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, len as usize) };
        if let (CopyKind::HostToDevice, Batch::Staged { lo, span }) = (kind, batch) {
            copy(st, lo, span);
        }
        for op in ops {
            let r = region(kind, op, batch, st);
            copy(r.dst, r.src, r.len);
        }
        if let (CopyKind::DeviceToHost, Batch::Staged { lo, span }) = (kind, batch) {
            copy(lo, st, span);
        }
    }

    fn pattern(n: usize, seed: u8) -> Vec<u8> {
        (0..n).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
    }

    /// 8 host regions of 4 KiB with 512-byte gaps (dense), each to or from a scattered
    /// place on the "device" (`host`, `dev`: the buffers' addresses).
    fn ops(host: u64, dev: u64, h2d: bool) -> Vec<CopyOp> {
        (0..8u64)
            .map(|i| {
                let h = host + 100 + i * (4096 + 512);
                let d = dev + (7 - i) * 3 * 4096;
                if h2d {
                    CopyOp { src: h, dst: d, len: 4096 }
                } else {
                    CopyOp { src: d, dst: h, len: 4096 }
                }
            })
            .collect()
    }

    /// A dense span of one allocation moves host -> device staged, and every region's
    /// bytes land where its op says, nothing else on the device changes.
    #[test]
    fn a_dense_mapped_span_is_staged_host_to_device_and_every_byte_lands() {
        let host = pattern(64 << 10, 1);
        let mut dev = vec![0u8; 32 * 4096];
        let dev_addr = dev.as_mut_ptr() as u64;
        let ops = ops(host.as_ptr() as u64, dev_addr, true);
        let batch = batch_for(CopyKind::HostToDevice, &ops, HostSide::MappedSpan, 64 << 10);
        let Batch::Staged { lo, span } = batch else { panic!("a dense span is staged: {batch:?}") };
        assert_eq!((lo, span), (ops[0].src, ops[7].src + 4096 - ops[0].src));
        let mut staging = vec![0u8; 64 << 10];
        let mut want = dev.clone();
        for op in &ops {
            let (s, d) = ((op.src - host.as_ptr() as u64) as usize, (op.dst - dev_addr) as usize);
            want[d..d + 4096].copy_from_slice(&host[s..s + 4096]);
        }
        run(CopyKind::HostToDevice, &ops, batch, &mut staging);
        assert!(dev == want, "device bytes differ from the ops' sources");
    }

    /// Device -> host never writes a layout's span whole (the bytes between its regions
    /// are the caller's): in place, and the bytes between the regions stay as they were.
    /// A bounce slot's span may be, and its regions' bytes still land.
    #[test]
    fn device_to_host_stages_only_into_a_slot() {
        let dev = pattern(32 * 4096, 7);
        for side in [HostSide::MappedSpan, HostSide::Mapped, HostSide::Bounce] {
            let mut host = pattern(64 << 10, 3);
            let before = host.clone();
            let host_addr = host.as_mut_ptr() as u64;
            let ops = ops(host_addr, dev.as_ptr() as u64, false);
            let batch = batch_for(CopyKind::DeviceToHost, &ops, side, 64 << 10);
            let staged = matches!(batch, Batch::Staged { .. });
            assert_eq!(staged, side == HostSide::Bounce, "{side:?} -> {batch:?}");
            let mut staging = vec![0u8; 64 << 10];
            run(CopyKind::DeviceToHost, &ops, batch, &mut staging);
            let mut covered = vec![false; host.len()];
            for op in &ops {
                let (h, d) = ((op.dst - host_addr) as usize, (op.src - dev.as_ptr() as u64) as usize);
                assert_eq!(&host[h..h + 4096], &dev[d..d + 4096], "{side:?}: a region's bytes");
                covered[h..h + 4096].iter_mut().for_each(|c| *c = true);
            }
            if !staged {
                assert!(host.iter().zip(&before).zip(&covered).all(|((a, b), c)| *c || a == b), "{side:?} wrote between the regions");
            }
        }
    }

    /// Sparse, too large, or not mapped: never staged; what the device cannot reach in
    /// place is copied op by op.
    #[test]
    fn sparse_or_oversized_spans_are_not_staged() {
        let (host, dev) = (1u64 << 40, 2u64 << 40); // addresses only: nothing is copied
        let sparse: Vec<CopyOp> = (0..8u64).map(|i| CopyOp { src: host + i * 65536, dst: dev + i * 4096, len: 4096 }).collect();
        assert_eq!(batch_for(CopyKind::HostToDevice, &sparse, HostSide::MappedSpan, 1 << 20), Batch::InPlace);
        assert_eq!(batch_for(CopyKind::HostToDevice, &sparse, HostSide::Bounce, 1 << 20), Batch::PerOp);
        let dense = ops(host, dev, true);
        assert_eq!(
            batch_for(CopyKind::HostToDevice, &dense, HostSide::MappedSpan, 16 << 10),
            Batch::InPlace,
            "larger than the staging area"
        );
        assert_eq!(batch_for(CopyKind::HostToDevice, &dense, HostSide::Pinned, 64 << 10), Batch::PerOp);
        assert_eq!(batch_for(CopyKind::HostToDevice, &dense[..1], HostSide::MappedSpan, 64 << 10), Batch::PerOp, "one op is one copy");
    }
}
