//! GPU-only behaviour: registration of caller memory (right and wrong pointers), the
//! batched small-region path on every layout kind, ordering after a caller's event, and
//! the store's puts from and gets into a registered device pool.
//! Without a CUDA device those tests are skipped (and counted so); one test runs only
//! where no driver is.

mod common;
use common::cases::{case, run};
use common::*;
use kvxfer::gpu::cuda::driver::sys;
use kvxfer::store::{Store, StoreConfig};
use kvxfer::{Engine, EngineConfig, LayoutKind, Status, StorageKind, TransferOptions};
use std::sync::Arc;

fn gpu_config() -> EngineConfig {
    let device = match test_device() {
        kvxfer::Device::Emulated => kvxfer::Device::Cuda(0),
        d => d,
    };
    EngineConfig { device, ..Default::default() }
}

/// An engine on the CUDA device of `KVX_TEST_DEVICE` (default 0).
fn gpu_engine() -> Engine {
    Engine::new(&gpu_config()).expect("the CUDA device was there when the tests were listed")
}

fn main() {
    let no_gpu = Engine::new(&gpu_config()).err().map(|e| format!("no CUDA device ({})", e.message));
    let driver = kvxfer::gpu::cuda::present().then(|| "a CUDA driver is present".to_string());
    run(vec![
        case("registered_cumemalloc_memory_round_trips_for_every_kind", registered_cumemalloc_memory_round_trips_for_every_kind)
            .unless(no_gpu.clone()),
        case("registering_a_wrong_pointer_is_an_error_not_corruption", registering_a_wrong_pointer_is_an_error_not_corruption)
            .unless(no_gpu.clone()),
        case(
            "a_store_puts_from_and_gets_into_registered_per_layer_device_pools_byte_exact",
            a_store_puts_from_and_gets_into_registered_per_layer_device_pools_byte_exact,
        )
        .unless(no_gpu.clone()),
        case("small_regions_are_bit_exact_through_the_batched_path", small_regions_are_bit_exact_through_the_batched_path)
            .unless(no_gpu.clone()),
        case("dense_host_spans_land_byte_exact_on_every_device_kind", dense_host_spans_land_byte_exact_on_every_device_kind)
            .unless(no_gpu.clone()),
        case("an_offload_waits_for_the_callers_event", an_offload_waits_for_the_callers_event).unless(no_gpu.clone()),
        case(
            "critical_transfers_beside_bulk_ones_land_byte_exact_on_every_device_kind",
            critical_transfers_beside_bulk_ones_land_byte_exact_on_every_device_kind,
        )
        .unless(no_gpu.clone()),
        case("every_call_leaves_the_callers_own_context_current", every_call_leaves_the_callers_own_context_current).unless(no_gpu.clone()),
        case("a_pinned_layout_over_an_unpinned_page_is_refused", a_pinned_layout_over_an_unpinned_page_is_refused).unless(no_gpu.clone()),
        case("a_request_waiting_for_its_event_holds_up_no_other", a_request_waiting_for_its_event_holds_up_no_other).unless(no_gpu),
        case("wait_event_on_the_emulated_device_is_refused", wait_event_on_the_emulated_device_is_refused),
        case(
            "a_cuda_ordinal_without_a_driver_is_no_device_and_auto_falls_back",
            a_cuda_ordinal_without_a_driver_is_no_device_and_auto_falls_back,
        )
        .unless(driver),
    ])
}

fn dev_alloc(bytes: usize) -> u64 {
    cuda::bind();
    let mut p = 0;
    assert_eq!(unsafe { sys::cuMemAlloc_v2(&mut p, bytes) }, sys::CUresult::CUDA_SUCCESS);
    p
}

fn dev_free(p: u64) {
    cuda::bind();
    unsafe { sys::cuMemFree_v2(p) };
}

fn registered_cumemalloc_memory_round_trips_for_every_kind() {
    let e = gpu_engine();
    let c = cfg(8, 3, 2, 16, 128, 2);
    let g = c.validate().unwrap();
    for kind in KINDS {
        let p = kvxfer::layout::Placement::memory(kind, g);
        let bases: Vec<u64> = (0..p.num_bases()).map(|_| dev_alloc(p.base_bytes() as usize)).collect();
        let reg = e.register_layout(&c, kind, StorageKind::Device, &bases).unwrap();
        let src = make_layout(&e, &c, LayoutKind::FullyContiguous, StorageKind::Disk);
        fill(&src, 31);
        let ids: Vec<u64> = (0..8).collect();
        let pairs: Vec<(u64, u64)> = ids.iter().map(|&b| (b, b)).collect();
        assert_eq!(transfer(&e, &src, &ids, &reg, &ids, &Default::default()), Status::Ok);
        // Read the caller's memory with the driver, not through kvxfer.
        let mut reg_view = vec![0u8; g.region_bytes as usize];
        for b in 0..8 {
            for l in 0..3 {
                for o in 0..2 {
                    let loc = p.region(b, l, o);
                    cuda::read(bases[loc.base as usize] + loc.offset, &mut reg_view);
                    assert_eq!(reg_view, region_pattern(31, b, l, o, g.region_bytes), "{kind:?} ({b},{l},{o})");
                }
            }
        }
        let back = make_layout(&e, &c, LayoutKind::FullyContiguous, StorageKind::Host);
        assert_eq!(transfer(&e, &reg, &ids, &back, &ids, &Default::default()), Status::Ok);
        check(&back, 0, 31, &pairs, 0..3, "registered → host");
        drop(reg);
        bases.into_iter().for_each(dev_free);
    }
}

/// vLLM's device KV cache: one `cuMemAlloc` per layer, `[2, num_blocks, …]` in each,
/// registered as LayerSeparate outer-first. Blocks are put from such a pool under keys,
/// at scattered block ids, and got by key into another at other ids: every region of the
/// second pool, read with the driver, holds its key's bytes, and every block no key was
/// loaded into keeps its own.
fn a_store_puts_from_and_gets_into_registered_per_layer_device_pools_byte_exact() {
    let e = Arc::new(gpu_engine());
    let c = cfg(16, 4, 2, 16, 256, 2); // 8 KiB regions, 64 KiB blocks
    let g = c.validate().unwrap();
    let kind = LayoutKind::LayerSeparate { block_first: false };
    let p = kvxfer::layout::Placement::memory(kind, g);
    assert_eq!(p.num_bases(), 4, "one allocation per layer");
    let pool = || {
        let bases: Vec<u64> = (0..p.num_bases()).map(|_| dev_alloc(p.base_bytes() as usize)).collect();
        let layout = e.register_layout(&c, kind, StorageKind::Device, &bases).unwrap();
        (bases, layout)
    };
    let ((src_bases, src), (dst_bases, dst)) = (pool(), pool());
    let region = |bases: &[u64], b: u64, l: u64, o: u64| {
        let loc = p.region(b, l, o);
        bases[loc.base as usize] + loc.offset
    };
    let keys: Vec<Vec<u8>> = (0..10).map(|i| format!("prefix-hash-{i}").into_bytes()).collect();
    let key_bytes = |k: &[u8], l: u64, o: u64| region_pattern(key_seed(k), 0, l, o, g.region_bytes);
    let src_ids: Vec<u64> = vec![15, 3, 7, 0, 12, 9, 1, 14, 5, 10];
    let dst_ids: Vec<u64> = vec![2, 11, 4, 13, 6, 8, 0, 15, 10, 3];
    // Written with the driver, straight into the caller's allocations.
    for b in 0..16 {
        for l in 0..4 {
            for o in 0..2 {
                let bytes = match src_ids.iter().position(|&s| s == b) {
                    Some(i) => key_bytes(&keys[i], l, o),
                    None => region_pattern(4, b, l, o, g.region_bytes),
                };
                cuda::write(region(&src_bases, b, l, o), &bytes);
                cuda::write(region(&dst_bases, b, l, o), &region_pattern(5, b, l, o, g.region_bytes));
            }
        }
    }
    let dir = temp_dir("store-gpu");
    let s = Store::open(&e, &dir, &StoreConfig { shards: 2, ..StoreConfig::new(c, 32, b"gpu-test tp0/1 page16") }).unwrap();
    let guard = Some(std::time::Duration::from_secs(60));
    let r = s.put(&src, &src_ids, &keys, &Default::default()).unwrap();
    assert_eq!(r.wait(guard), Status::Ok, "put: {}", r.key_message(0));
    assert_eq!(s.stats().entries, 10);
    let r = s.get(&keys, &dst, &dst_ids, &Default::default()).unwrap();
    let status = r.wait(guard);
    let messages: Vec<String> = (0..keys.len()).map(|i| r.key_message(i)).collect();
    assert_eq!(status, Status::Ok, "get: {messages:?}");
    let mut got = vec![0u8; g.region_bytes as usize];
    for b in 0..16 {
        for l in 0..4 {
            for o in 0..2 {
                let want = match dst_ids.iter().position(|&d| d == b) {
                    Some(i) => key_bytes(&keys[i], l, o),
                    None => region_pattern(5, b, l, o, g.region_bytes),
                };
                cuda::read(region(&dst_bases, b, l, o), &mut got);
                assert!(got == want, "region (block {b}, layer {l}, outer {o}) of the registered pool is wrong");
            }
        }
    }
    let st = s.stats();
    assert_eq!((st.hits, st.misses, st.integrity_failures), (10, 0, 0), "{st:?}");
    drop(s);
    drop((src, dst));
    src_bases.into_iter().chain(dst_bases).for_each(dev_free);
    let _ = std::fs::remove_dir_all(&dir);
}

fn registering_a_wrong_pointer_is_an_error_not_corruption() {
    let e = gpu_engine();
    let c = cfg(4, 2, 2, 16, 128, 2); // 64 KiB blocks, 256 KiB in all
    let need = 4 * 2 * 2 * 16 * 128 * 2;
    let host = vec![0u8; need];
    let small = dev_alloc(need / 2);
    let big = dev_alloc(need);
    let fc = LayoutKind::FullyContiguous;
    let cases = [(host.as_ptr() as u64, "not memory CUDA knows"), (small, "allocation ends"), (big + 4096, "allocation ends")];
    for (base, text) in cases {
        let err = e.register_layout(&c, fc, StorageKind::Device, &[base]).unwrap_err();
        assert_eq!(err.status, Status::InvalidArg, "{}", err.message);
        assert!(err.message.contains(text), "{:?} lacks {text:?}", err.message);
    }
    // Pageable memory is not pinned.
    let err = e.register_layout(&c, fc, StorageKind::Pinned, &[host.as_ptr() as u64]).unwrap_err();
    assert_eq!(err.status, Status::InvalidArg);
    assert!(err.message.contains("page-locked"), "{}", err.message);
    // The whole allocation is fine.
    assert!(e.register_layout(&c, fc, StorageKind::Device, &[big]).is_ok());
    dev_free(small);
    dev_free(big);
}

fn small_regions_are_bit_exact_through_the_batched_path() {
    let e = gpu_engine();
    // 16 KiB, 32 KiB and odd-sized (not 16-byte multiple) regions, every kind both ways.
    for c in [cfg(16, 4, 2, 16, 512, 2), cfg(16, 4, 2, 32, 512, 2), cfg(16, 3, 2, 7, 333, 1)] {
        let ids: Vec<u64> = (0..16).rev().collect();
        let pairs: Vec<(u64, u64)> = ids.iter().zip(0..16).map(|(&s, d)| (s, d)).collect();
        let dst_ids: Vec<u64> = (0..16).collect();
        for kind in KINDS {
            for host_storage in [StorageKind::Pinned, StorageKind::Host, StorageKind::Disk] {
                let hk = if host_storage == StorageKind::Disk { LayoutKind::FullyContiguous } else { kind };
                let host = make_layout(&e, &c, hk, host_storage);
                let dev = make_layout(&e, &c, kind, StorageKind::Device);
                fill(&host, 41);
                fill(&dev, 42);
                let what = format!("{host_storage:?} → Device {kind:?} {c:?}");
                assert_eq!(transfer(&e, &host, &ids, &dev, &dst_ids, &Default::default()), Status::Ok, "{what}");
                check(&dev, 42, 41, &pairs, 0..c.num_layers, &what);
                let back = make_layout(&e, &c, hk, host_storage);
                fill(&back, 43);
                assert_eq!(transfer(&e, &dev, &dst_ids, &back, &ids, &Default::default()), Status::Ok, "{what} back");
                let round: Vec<(u64, u64)> = pairs.iter().map(|&(s, _)| (s, s)).collect();
                check(&back, 43, 41, &round, 0..c.num_layers, &format!("{what} and back"));
            }
        }
    }
    let dd = make_layout(&e, &cfg(8, 4, 2, 16, 512, 2), LayoutKind::LayerSeparate { block_first: false }, StorageKind::Device);
    let ds = make_layout(&e, &cfg(8, 4, 2, 16, 512, 2), LayoutKind::LayerSeparate { block_first: true }, StorageKind::Device);
    fill(&ds, 51);
    fill(&dd, 52);
    let ids: Vec<u64> = (0..8).collect();
    assert_eq!(transfer(&e, &ds, &ids, &dd, &ids, &Default::default()), Status::Ok);
    check(&dd, 52, 51, &ids.iter().map(|&b| (b, b)).collect::<Vec<_>>(), 0..4, "device → device");
}

/// A contiguous pinned host layout is dense in one allocation, so host->device chunks of
/// it move their span by one DMA into staging and scatter on the device
/// (`HostSide::MappedSpan`), into every device kind, and back (which never stages into
/// the caller's span). 32 KiB regions as in vLLM; 32 layers, where a chunk is one block
/// (random ids, every block its own span), and 8 layers, where a chunk spans four
/// adjacent blocks (ids in runs); all layers, and a layer range (spans too sparse to stage).
fn dense_host_spans_land_byte_exact_on_every_device_kind() {
    let e = gpu_engine();
    for (c, in_runs) in [(cfg(48, 32, 2, 16, 1024, 2), false), (cfg(96, 8, 2, 16, 1024, 2), true)] {
        let n = c.num_blocks;
        // A fixed shuffle of the block ids (multiplication by a unit mod n).
        let shuffled: Vec<u64> = (0..n).map(|i| (i * 37 + 11) % n).collect();
        let sources: Vec<u64> = if in_runs { (0..n).collect() } else { shuffled.clone() };
        for kind in KINDS {
            let host = make_layout(&e, &c, LayoutKind::FullyContiguous, StorageKind::Pinned);
            let dev = make_layout(&e, &c, kind, StorageKind::Device);
            for (per_request, layers) in [(8usize, 0..c.num_layers), (32, 0..c.num_layers), (16, 2..5)] {
                fill(&host, 61);
                fill(&dev, 62);
                let opts = TransferOptions { layer_begin: layers.start as u32, layer_end: layers.end as u32, ..Default::default() };
                let mut pairs = Vec::new();
                for (i, src) in sources.chunks(per_request).enumerate() {
                    let dst: Vec<u64> = shuffled.iter().rev().skip(i * per_request).take(src.len()).copied().collect();
                    assert_eq!(transfer(&e, &host, src, &dev, &dst, &opts), Status::Ok);
                    pairs.extend(src.iter().copied().zip(dst));
                }
                let what = format!("pinned contiguous -> device {kind:?}, {c:?}, {per_request} blocks per request, layers {layers:?}");
                check(&dev, 62, 61, &pairs, layers.clone(), &what);
                let back = make_layout(&e, &c, LayoutKind::FullyContiguous, StorageKind::Pinned);
                fill(&back, 63);
                let (src, dst): (Vec<u64>, Vec<u64>) = pairs.iter().map(|&(s, d)| (d, s)).unzip();
                assert_eq!(transfer(&e, &dev, &src, &back, &dst, &opts), Status::Ok);
                let round: Vec<(u64, u64)> = pairs.iter().map(|&(s, _)| (s, s)).collect();
                check(&back, 63, 61, &round, layers.clone(), &format!("{what}, and back"));
            }
        }
    }
}

/// Latency-critical copies take their direction's second stream and fence lanes of their
/// own: with bulk transfers both ways in flight on the first streams, critical ones both
/// ways (region-kernel batches for the small regions of layer-separate kinds, plain copies
/// for contiguous ones) land byte-exact, and so do the bulk ones.
fn critical_transfers_beside_bulk_ones_land_byte_exact_on_every_device_kind() {
    let e = gpu_engine();
    let c = cfg(64, 4, 2, 16, 512, 2);
    let critical = TransferOptions { critical: true, ..Default::default() };
    for kind in KINDS {
        let disk = make_layout(&e, &c, LayoutKind::FullyContiguous, StorageKind::Disk);
        let (dev, pinned, dev2) = (
            make_layout(&e, &c, kind, StorageKind::Device),
            make_layout(&e, &c, kind, StorageKind::Pinned),
            make_layout(&e, &c, kind, StorageKind::Device),
        );
        fill(&disk, 71);
        fill(&dev, 73);
        fill(&pinned, 72);
        fill(&dev2, 74);
        // Bulk: disk blocks 0..16 to device 0..16, device 16..32 to disk 16..32.
        let (lo, hi): (Vec<u64>, Vec<u64>) = ((0..16).collect(), (16..32).collect());
        let bulk =
            [e.submit(&disk, &lo, &dev, &lo, &Default::default()).unwrap(), e.submit(&dev, &hi, &disk, &hi, &Default::default()).unwrap()];
        // Critical: pinned 32..48 to the other device layout's 32..48, its 48..64 to pinned 48..64.
        let (up, down): (Vec<u64>, Vec<u64>) = ((32..48).collect(), (48..64).collect());
        let crit = [e.submit(&pinned, &up, &dev2, &up, &critical).unwrap(), e.submit(&dev2, &down, &pinned, &down, &critical).unwrap()];
        for r in crit.iter().chain(&bulk) {
            assert_eq!(r.wait(Some(std::time::Duration::from_secs(60))), Status::Ok, "{kind:?}");
        }
        let same = |v: &[u64]| v.iter().map(|&b| (b, b)).collect::<Vec<_>>();
        check(&dev, 73, 71, &same(&lo), 0..4, &format!("bulk disk -> device {kind:?}"));
        check(&disk, 71, 73, &same(&hi), 0..4, &format!("bulk device -> disk {kind:?}"));
        check(&dev2, 74, 72, &same(&up), 0..4, &format!("critical pinned -> device {kind:?}"));
        check(&pinned, 72, 74, &same(&down), 0..4, &format!("critical device -> pinned {kind:?}"));
    }
}

fn an_offload_waits_for_the_callers_event() {
    let e = gpu_engine();
    let c = cfg(8, 8, 2, 32, 1024, 2); // 16 MiB of KV
    let dev = e.create_layout(&c, LayoutKind::FullyContiguous, StorageKind::Device).unwrap();
    let host = e.create_layout(&c, LayoutKind::FullyContiguous, StorageKind::Pinned).unwrap();
    let base = dev.bases().unwrap()[0];
    let bytes = (c.validate().unwrap().block_bytes * 8) as usize;
    let filler = dev_alloc(4 << 30);
    cuda::bind();
    let (mut stream, mut ev) = (std::ptr::null_mut(), std::ptr::null_mut());
    unsafe {
        assert_eq!(sys::cuStreamCreate(&mut stream, 1), sys::CUresult::CUDA_SUCCESS);
        assert_eq!(sys::cuEventCreate(&mut ev, 2), sys::CUresult::CUDA_SUCCESS);
    }
    let ids: Vec<u64> = (0..8).collect();
    for round in 0u8..4 {
        let value = 0x10 + round;
        unsafe {
            // "Compute" that writes the KV late: a long memset first, then the KV.
            assert_eq!(sys::cuMemsetD8Async(filler, round, 4 << 30, stream), sys::CUresult::CUDA_SUCCESS);
            assert_eq!(sys::cuMemsetD8Async(base, value, bytes, stream), sys::CUresult::CUDA_SUCCESS);
            assert_eq!(sys::cuEventRecord(ev, stream), sys::CUresult::CUDA_SUCCESS);
        }
        let opts = TransferOptions { wait_event: ev as u64, ..Default::default() };
        let r = e.submit(&dev, &ids, &host, &ids, &opts).unwrap();
        assert_eq!(r.wait(None), Status::Ok);
        let got = unsafe { std::slice::from_raw_parts(host.bases().unwrap()[0] as *const u8, bytes) };
        let wrong = got.iter().filter(|&&b| b != value).count();
        assert_eq!(wrong, 0, "round {round}: {wrong} bytes were read before the caller's event");
    }
    unsafe {
        sys::cuStreamSynchronize(stream);
        sys::cuEventDestroy_v2(ev);
        sys::cuStreamDestroy_v2(stream);
    }
    dev_free(filler);
}

const OK: sys::CUresult = sys::CUresult::CUDA_SUCCESS;

fn test_ordinal() -> i32 {
    match gpu_config().device {
        kvxfer::Device::Cuda(d) => d as i32,
        d => unreachable!("gpu_config names a CUDA device, not {d:?}"),
    }
}

/// The context current on this thread.
fn current_context() -> sys::CUcontext {
    let mut c = std::ptr::null_mut();
    assert_eq!(unsafe { sys::cuCtxGetCurrent(&mut c) }, OK);
    c
}

/// Runs `f` with the device's primary context (the engine's) pushed on this thread.
fn in_primary_context<T>(f: impl FnOnce() -> T) -> T {
    let mut ctx = std::ptr::null_mut();
    unsafe {
        let mut dev = 0;
        assert_eq!(sys::cuDeviceGet(&mut dev, test_ordinal()), OK);
        assert_eq!(sys::cuDevicePrimaryCtxRetain(&mut ctx, dev), OK);
        assert_eq!(sys::cuCtxPushCurrent_v2(ctx), OK);
        let out = f();
        let mut popped = std::ptr::null_mut();
        assert_eq!(sys::cuCtxPopCurrent_v2(&mut popped), OK);
        assert_eq!(sys::cuDevicePrimaryCtxRelease_v2(dev), OK);
        out
    }
}

/// A host application with a context of its own current on its thread (not the primary
/// one kvxfer uses) finds it still current after every call into kvxfer: engine
/// creation, pinned layouts created and registered, a registered device layout, a submit
/// gated on its event (captured and issued on this thread), the request's release, and
/// the destruction of each.
fn every_call_leaves_the_callers_own_context_current() {
    let mut mine = std::ptr::null_mut();
    unsafe {
        assert_eq!(sys::cuInit(0), OK);
        let mut dev = 0;
        assert_eq!(sys::cuDeviceGet(&mut dev, test_ordinal()), OK);
        assert_eq!(sys::cuCtxCreate_v2(&mut mine, 0, dev), OK);
    }
    let still_mine = |after: &str| assert_eq!(current_context(), mine, "{after} left another context current on the caller's thread");
    still_mine("cuCtxCreate");

    let e = gpu_engine();
    still_mine("creating the engine");
    let c = cfg(4, 2, 2, 16, 128, 2); // 256 KiB
    let bytes = 4 * 2 * 2 * 16 * 128 * 2;
    let fc = LayoutKind::FullyContiguous;
    let src = e.create_layout(&c, fc, StorageKind::Pinned).unwrap();
    still_mine("creating a pinned host layout");
    let mut pinned = std::ptr::null_mut();
    let flags = sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP;
    assert_eq!(unsafe { sys::cuMemHostAlloc(&mut pinned, bytes, flags) }, OK);
    let back = e.register_layout(&c, fc, StorageKind::Pinned, &[pinned as u64]).unwrap();
    still_mine("registering pinned host memory");
    let dev_mem = in_primary_context(|| {
        let mut p = 0;
        assert_eq!(unsafe { sys::cuMemAlloc_v2(&mut p, bytes) }, OK);
        p
    });
    let dev = e.register_layout(&c, fc, StorageKind::Device, &[dev_mem]).unwrap();
    still_mine("registering device memory");

    let (mut stream, mut ev) = (std::ptr::null_mut(), std::ptr::null_mut());
    unsafe {
        assert_eq!(sys::cuStreamCreate(&mut stream, sys::CUstream_flags_enum::CU_STREAM_NON_BLOCKING as u32), OK);
        assert_eq!(sys::cuEventCreate(&mut ev, sys::CUevent_flags_enum::CU_EVENT_DISABLE_TIMING as u32), OK);
        assert_eq!(sys::cuEventRecord(ev, stream), OK);
    }
    fill(&src, 71);
    fill(&back, 72);
    let ids: Vec<u64> = (0..4).collect();
    let opts = TransferOptions { wait_event: ev as u64, ..Default::default() };
    let r = e.submit(&src, &ids, &dev, &ids, &opts).unwrap();
    still_mine("a submit with wait_event");
    assert_eq!(r.wait(Some(std::time::Duration::from_secs(60))), Status::Ok, "{}", r.error_message().to_string_lossy());
    drop(r);
    still_mine("releasing a request with a captured event");
    assert_eq!(transfer(&e, &dev, &ids, &back, &ids, &Default::default()), Status::Ok);
    still_mine("a device -> host transfer");
    check(&back, 72, 71, &ids.iter().map(|&b| (b, b)).collect::<Vec<_>>(), 0..2, "pinned -> registered device -> registered pinned");

    drop(dev);
    still_mine("destroying the registered device layout");
    drop(back);
    drop(src);
    still_mine("destroying the pinned host layouts");
    drop(e);
    still_mine("destroying the engine");
    unsafe {
        assert_eq!(sys::cuEventDestroy_v2(ev), OK);
        assert_eq!(sys::cuStreamDestroy_v2(stream), OK);
        assert_eq!(sys::cuMemFreeHost(pinned), OK);
        in_primary_context(|| assert_eq!(sys::cuMemFree_v2(dev_mem), OK));
        assert_eq!(sys::cuCtxDestroy_v2(mine), OK);
    }
}

/// Pinned memory is checked over every byte a layout needs: two page-locked halves of
/// one mapping with an unpinned page between them are not one pinned buffer, though a
/// layout across the gap starts and ends in pinned memory. Each half on its own is.
fn a_pinned_layout_over_an_unpinned_page_is_refused() {
    let e = gpu_engine();
    let c = cfg(16, 2, 2, 16, 128, 2); // 16 blocks of 16 KiB: 256 KiB
    let (need, page) = (256usize << 10, 4096usize);
    let total = 2 * need + page;
    let prot = libc::PROT_READ | libc::PROT_WRITE;
    let map = unsafe { libc::mmap(std::ptr::null_mut(), total, prot, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0) };
    assert_ne!(map, libc::MAP_FAILED);
    let base = map as u64;
    let halves = [base, base + (need + page) as u64];
    let flags = sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP;
    in_primary_context(|| {
        for h in halves {
            assert_eq!(unsafe { sys::cuMemHostRegister_v2(h as *mut _, need, flags) }, OK);
        }
    });
    let fc = LayoutKind::FullyContiguous;
    let across = base + 2 * page as u64;
    let err = e.register_layout(&c, fc, StorageKind::Pinned, &[across]).expect_err("a pinned layout across an unpinned page");
    assert_eq!(err.status, Status::InvalidArg, "{}", err.message);
    assert!(err.message.contains("ends before that"), "{}", err.message);
    for h in halves {
        let l = e.register_layout(&c, fc, StorageKind::Pinned, &[h]).unwrap_or_else(|e| panic!("one whole pinned half: {}", e.message));
        drop(l);
    }
    drop(e);
    in_primary_context(|| {
        for h in halves {
            assert_eq!(unsafe { sys::cuMemHostUnregister(h as *mut _) }, OK);
        }
    });
    assert_eq!(unsafe { libc::munmap(map, total) }, 0);
}

/// A caller's stream held until the test lets it go: in a context of the test's own (so
/// it shares no hardware queue with the engine's streams), it waits for a flag in mapped
/// pinned memory, then records the event that gated requests wait for.
struct HeldStream {
    ctx: sys::CUcontext,
    stream: sys::CUstream,
    event: sys::CUevent,
    flag: *mut u32,
}

impl HeldStream {
    fn new() -> HeldStream {
        let mut h =
            HeldStream { ctx: std::ptr::null_mut(), stream: std::ptr::null_mut(), event: std::ptr::null_mut(), flag: std::ptr::null_mut() };
        unsafe {
            assert_eq!(sys::cuInit(0), OK);
            let mut dev = 0;
            assert_eq!(sys::cuDeviceGet(&mut dev, test_ordinal()), OK);
            assert_eq!(sys::cuCtxCreate_v2(&mut h.ctx, 0, dev), OK);
            let mut flag = std::ptr::null_mut();
            assert_eq!(sys::cuMemHostAlloc(&mut flag, 4, sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP), OK);
            h.flag = flag as *mut u32;
            std::ptr::write_volatile(h.flag, 0);
            let mut on_device = 0;
            assert_eq!(sys::cuMemHostGetDevicePointer_v2(&mut on_device, flag, 0), OK);
            assert_eq!(sys::cuStreamCreate(&mut h.stream, sys::CUstream_flags_enum::CU_STREAM_NON_BLOCKING as u32), OK);
            assert_eq!(sys::cuEventCreate(&mut h.event, sys::CUevent_flags_enum::CU_EVENT_DISABLE_TIMING as u32), OK);
            let geq = sys::CUstreamWaitValue_flags_enum::CU_STREAM_WAIT_VALUE_GEQ as u32;
            assert_eq!(sys::cuStreamWaitValue32_v2(h.stream, on_device, 1, geq), OK, "stream memory operations on mapped pinned memory");
            assert_eq!(sys::cuEventRecord(h.event, h.stream), OK);
            let mut popped = std::ptr::null_mut();
            assert_eq!(sys::cuCtxPopCurrent_v2(&mut popped), OK);
        }
        h
    }

    /// Lets the stream run on: the event fires.
    fn release(&self) {
        unsafe { std::ptr::write_volatile(self.flag, 1) };
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
    }
}

impl Drop for HeldStream {
    fn drop(&mut self) {
        self.release();
        unsafe {
            assert_eq!(sys::cuCtxPushCurrent_v2(self.ctx), OK);
            assert_eq!(sys::cuStreamSynchronize(self.stream), OK);
            sys::cuEventDestroy_v2(self.event);
            sys::cuStreamDestroy_v2(self.stream);
            sys::cuMemFreeHost(self.flag as *mut _);
            sys::cuCtxDestroy_v2(self.ctx);
        }
    }
}

/// A request gated on a caller's event that cannot fire yet holds up no other request:
/// ungated requests both ways, on the streams the gated one would have shared, and
/// requests gated on an event that already fired, both ways (the same direction as the
/// waiting one among them), complete while it waits; once its event fires, it completes
/// too. Every byte checked.
fn a_request_waiting_for_its_event_holds_up_no_other() {
    let e = gpu_engine();
    let c = cfg(8, 4, 2, 16, 512, 2); // 32 KiB regions, 256 KiB blocks
    let fc = LayoutKind::FullyContiguous;
    let layout = |s| e.create_layout(&c, fc, s).unwrap();
    let (a_dev, a_host) = (layout(StorageKind::Device), layout(StorageKind::Pinned));
    let (b_dev, b_host) = (layout(StorageKind::Device), layout(StorageKind::Pinned));
    let (c_host, c_dev) = (layout(StorageKind::Pinned), layout(StorageKind::Device));
    let (d_host, d_dev) = (layout(StorageKind::Pinned), layout(StorageKind::Device));
    let (f_dev, f_host) = (layout(StorageKind::Device), layout(StorageKind::Pinned));
    let seeds = [(&a_dev, 81), (&a_host, 82), (&b_dev, 83), (&b_host, 84), (&c_host, 85), (&c_dev, 86), (&d_host, 87), (&d_dev, 88)];
    for (l, seed) in seeds.into_iter().chain([(&f_dev, 89), (&f_host, 90)]) {
        fill(l, seed);
    }
    let ids: Vec<u64> = (0..8).collect();
    let pairs: Vec<(u64, u64)> = ids.iter().map(|&b| (b, b)).collect();

    let held = HeldStream::new();
    let a = e.submit(&a_dev, &ids, &a_host, &ids, &TransferOptions { wait_event: held.event as u64, ..Default::default() }).unwrap();
    let (mut stream, mut fired) = (std::ptr::null_mut(), std::ptr::null_mut());
    cuda::bind();
    unsafe {
        assert_eq!(sys::cuStreamCreate(&mut stream, sys::CUstream_flags_enum::CU_STREAM_NON_BLOCKING as u32), OK);
        assert_eq!(sys::cuEventCreate(&mut fired, sys::CUevent_flags_enum::CU_EVENT_DISABLE_TIMING as u32), OK);
        assert_eq!(sys::cuEventRecord(fired, stream), OK);
        assert_eq!(sys::cuStreamSynchronize(stream), OK);
    }
    // A hang guard only: on any machine these finish in far less.
    let guard = Some(std::time::Duration::from_secs(60));
    let others = [
        ("ungated device -> host", e.submit(&b_dev, &ids, &b_host, &ids, &Default::default()).unwrap()),
        ("ungated host -> device", e.submit(&c_host, &ids, &c_dev, &ids, &Default::default()).unwrap()),
        (
            "host -> device gated on a fired event",
            e.submit(&d_host, &ids, &d_dev, &ids, &TransferOptions { wait_event: fired as u64, ..Default::default() }).unwrap(),
        ),
        (
            "device -> host gated on a fired event",
            e.submit(&f_dev, &ids, &f_host, &ids, &TransferOptions { wait_event: fired as u64, ..Default::default() }).unwrap(),
        ),
    ];
    let outcomes: Vec<(&str, Status, String)> =
        others.iter().map(|(what, r)| (*what, r.wait(guard), r.error_message().to_string_lossy().into_owned())).collect();
    let a_meanwhile = a.poll();
    held.release();
    let a_status = a.wait(guard);
    for (what, status, msg) in outcomes {
        assert_eq!(status, Status::Ok, "{what}, while another request waits for its caller's event: {msg}");
    }
    assert_eq!(a_meanwhile, Status::Pending, "the gated request finished before its event fired");
    assert_eq!(a_status, Status::Ok, "{}", a.error_message().to_string_lossy());
    check(&a_host, 82, 81, &pairs, 0..4, "gated device -> host");
    check(&b_host, 84, 83, &pairs, 0..4, "ungated device -> host");
    check(&c_dev, 86, 85, &pairs, 0..4, "ungated host -> device");
    check(&d_dev, 88, 87, &pairs, 0..4, "host -> device gated on a fired event");
    check(&f_host, 90, 89, &pairs, 0..4, "device -> host gated on a fired event");
    drop(held);
    cuda::bind();
    unsafe {
        sys::cuEventDestroy_v2(fired);
        sys::cuStreamDestroy_v2(stream);
    }
}

fn wait_event_on_the_emulated_device_is_refused() {
    let e = engine_with(|c| c.device = kvxfer::Device::Emulated);
    let c = cfg(2, 1, 1, 1, 16, 1);
    let a = make_layout(&e, &c, LayoutKind::FullyContiguous, StorageKind::Device);
    let b = make_layout(&e, &c, LayoutKind::FullyContiguous, StorageKind::Host);
    let opts = TransferOptions { wait_event: 0x1000, ..Default::default() };
    let err = e.submit(&a, &[0], &b, &[0], &opts).unwrap_err();
    assert_eq!(err.status, Status::InvalidArg);
    assert!(err.message.contains("CUDA"));
}

fn a_cuda_ordinal_without_a_driver_is_no_device_and_auto_falls_back() {
    let err =
        kvxfer::Engine::new(&kvxfer::EngineConfig { device: kvxfer::Device::Cuda(0), ..Default::default() }).err().expect("no GPU here");
    assert_eq!(err.status, Status::NoDevice);
    assert!(err.message.contains("KVX_DEVICE_EMULATED"), "{}", err.message);
    let auto = engine_with(|c| c.device = kvxfer::Device::Auto);
    assert_eq!(auto.device(), kvxfer::Device::Emulated, "Device::Auto runs on the emulated device without a driver");
}
