//! How fast the region kernel reads pinned host memory, against a DMA of the same bytes.
//!
//! Scattered regions of pinned memory the device maps move host to device by the SMs
//! reading them over the bus (`regions.rs`). How fast SM-issued reads of host memory go
//! depends on the host (its root complex, its IOMMU), not on the GPU alone: some hosts
//! read random 32 KiB regions at about 0.6 of one DMA's rate where others pass 0.9, while
//! the kernel's writes to host memory stay close to the DMA's rate. So a device opens with
//! this short measurement, and where the kernel reads at less than `IN_PLACE_MIN` of the
//! DMA's rate, a dense host span to scattered device regions goes staged: one DMA into
//! device staging and a scatter there (`docs/benchmarks.md#known-limits`). Host regions
//! that are scattered themselves still go in place: gathering them by the CPU into a slot
//! is faster per request but costs far more CPU and lengthens other submitters' tails
//! (`docs/decisions.md#a-cpu-gather-of-scattered-pinned-regions`).

use super::driver::{check, sys};
use super::regions::{Region, RegionKernel};
use crate::error::Result;
use std::ffi::c_void;

/// Bytes each side moves: long enough (~0.6-1.3 ms) that launch costs and the kernel's
/// last wave do not count.
const BYTES: usize = 32 << 20;
/// vLLM's region size (16 tokens x 8 heads x 128 x bf16).
const REGION: usize = 32 << 10;
/// Timed runs of each; the fastest counts.
const RUNS: usize = 3;
/// The share of a DMA's rate below which reading host memory in place loses: staged, a
/// dense span moves at ~0.90 of one copy (`cpp_examples/probes/stage_limit.cu`).
const IN_PLACE_MIN: f64 = 0.8;

/// The measurement, in GB/s.
struct HostReads {
    kernel_gbps: f64,
    dma_gbps: f64,
}

/// Whether device `ordinal`'s kernel reads host memory fast enough for a dense host span
/// to move to scattered device regions in place, measured now and logged. Where it cannot
/// be measured (e.g. the device memory is taken), in place, as before the measurement.
///
/// # Safety
/// As `measure`.
pub unsafe fn reads_in_place(ordinal: u32, kernel: &RegionKernel, stream: sys::CUstream) -> bool {
    match measure(kernel, stream) {
        Ok(m) => {
            let in_place = m.kernel_gbps >= IN_PLACE_MIN * m.dma_gbps;
            log::info!(
                "device {ordinal}: the region kernel reads pinned host memory at {:.1} GB/s, one DMA at {:.1} GB/s ({:.2}): \
                 a dense host span to scattered device regions {}",
                m.kernel_gbps,
                m.dma_gbps,
                m.kernel_gbps / m.dma_gbps,
                if in_place { "is read in place" } else { "is staged (one DMA, then a scatter on the device)" }
            );
            in_place
        }
        Err(e) => {
            log::warn!(
                "device {ordinal}: could not measure the kernel's host reads ({}); dense host spans to scattered device regions are read in place",
                e.message
            );
            true
        }
    }
}

/// Times one DMA of `BYTES` from pinned memory to the device, and one launch of the
/// region kernel that reads the same bytes as 32 KiB regions in a scattered order.
///
/// # Safety
/// The device's context is current; nothing else uses `stream` meanwhile.
unsafe fn measure(kernel: &RegionKernel, stream: sys::CUstream) -> Result<HostReads> {
    let mut held = Held { stream, host: std::ptr::null_mut(), dev: 0, events: [std::ptr::null_mut(); 2] };
    let regions = BYTES / REGION;
    let table_bytes = regions * std::mem::size_of::<Region>();
    let flags = sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP;
    let mut host = std::ptr::null_mut();
    check(sys::cuMemHostAlloc(&mut host, BYTES + table_bytes, flags), "cuMemHostAlloc (host-read probe)")?;
    held.host = host;
    check(sys::cuMemAlloc_v2(&mut held.dev, BYTES), "cuMemAlloc (host-read probe)")?;
    let mut mapped = 0;
    check(sys::cuMemHostGetDevicePointer_v2(&mut mapped, host, 0), "cuMemHostGetDevicePointer (host-read probe)")?;
    // Region i reads host region i * 191 mod n (191 is prime to n, so each region once) into
    // device region i: no two neighbours in the table are neighbours on the host.
    let table = (host as *mut u8).add(BYTES) as *mut Region;
    for i in 0..regions {
        let from = (i * 191) % regions;
        table.add(i).write(Region { dst: held.dev + (i * REGION) as u64, src: mapped + (from * REGION) as u64, len: REGION as u64 });
    }
    for e in &mut held.events {
        check(sys::cuEventCreate(e, sys::CUevent_flags_enum::CU_EVENT_DEFAULT as u32), "cuEventCreate (host-read probe)")?;
    }
    let [start, end] = held.events;
    let time = |run: &dyn Fn() -> Result<()>| -> Result<f64> {
        let mut best = f64::MAX;
        // The first run warms the path (the kernel's first launch, the copy engine); it is not counted.
        for i in 0..=RUNS {
            check(sys::cuEventRecord(start, stream), "cuEventRecord (host-read probe)")?;
            run()?;
            check(sys::cuEventRecord(end, stream), "cuEventRecord (host-read probe)")?;
            check(sys::cuEventSynchronize(end), "cuEventSynchronize (host-read probe)")?;
            let mut ms = 0f32;
            check(sys::cuEventElapsedTime(&mut ms, start, end), "cuEventElapsedTime (host-read probe)")?;
            if i > 0 {
                best = best.min(ms as f64);
            }
        }
        Ok(BYTES as f64 / (best * 1e-3) / 1e9)
    };
    let dma_gbps = time(&|| check(sys::cuMemcpyHtoDAsync_v2(held.dev, host, BYTES, stream), "cuMemcpyHtoDAsync (host-read probe)"))?;
    let table_dev = mapped + BYTES as u64;
    let kernel_gbps = time(&|| kernel.launch(table_dev, regions as u32, REGION as u64, stream))?;
    Ok(HostReads { kernel_gbps, dma_gbps })
}

/// What the probe allocated, freed however it ends, once its stream is idle.
struct Held {
    stream: sys::CUstream,
    host: *mut c_void,
    dev: sys::CUdeviceptr,
    events: [sys::CUevent; 2],
}

impl Drop for Held {
    fn drop(&mut self) {
        // SAFETY: handles this probe created, with the context still current; after an
        // error a copy may still be queued, so the stream drains first.
        unsafe {
            sys::cuStreamSynchronize(self.stream);
            for &e in &self.events {
                if !e.is_null() {
                    sys::cuEventDestroy_v2(e);
                }
            }
            if self.dev != 0 {
                sys::cuMemFree_v2(self.dev);
            }
            if !self.host.is_null() {
                sys::cuMemFreeHost(self.host);
            }
        }
    }
}
