//! Helpers shared by the integration tests: engines sized for tests, random fills, and
//! reading any layout's regions back *without* the engine (pointers for memory, pread
//! for files), so a check never trusts the code it checks.
#![allow(dead_code)]

pub mod cases;
pub mod fault_proxy;
pub mod s3;
pub mod shared_tier;

use kvxfer::layout::Placement;
use kvxfer::{Device, DiskFlags, Engine, EngineConfig, IoBackend, Layout, LayoutConfig, LayoutKind, Status, StorageKind, TransferOptions};
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

pub const KINDS: [LayoutKind; 3] =
    [LayoutKind::FullyContiguous, LayoutKind::LayerSeparate { block_first: true }, LayoutKind::LayerSeparate { block_first: false }];
pub const STORAGES: [StorageKind; 4] = [StorageKind::Device, StorageKind::Pinned, StorageKind::Host, StorageKind::Disk];

/// Engine on the device chosen by `KVX_TEST_DEVICE` (default: emulated), with small
/// slots so every test crosses many slot boundaries.
pub fn engine() -> Engine {
    engine_with(|_| {})
}

/// `KVX_TEST_DEVICE=<ordinal>` runs the suites on that GPU; the emulated device otherwise.
pub fn test_device() -> Device {
    match std::env::var("KVX_TEST_DEVICE").as_deref() {
        Err(_) | Ok("-1") | Ok("emulated") => Device::Emulated,
        Ok(v) => Device::Cuda(v.parse().unwrap_or_else(|_| panic!("KVX_TEST_DEVICE={v}: expected a CUDA ordinal or `emulated`"))),
    }
}

/// `KVX_TEST_IO_BACKEND=posix|uring|nixl|gds|auto` runs the suites on that backend;
/// POSIX by default, so the plain run always covers the pread/pwrite path.
pub fn test_io_backend() -> IoBackend {
    match std::env::var("KVX_TEST_IO_BACKEND").as_deref() {
        Ok("uring") => IoBackend::Uring,
        Ok("nixl") => IoBackend::Nixl,
        Ok("gds") => IoBackend::Gds,
        Ok("auto") => IoBackend::Auto,
        Ok("posix") | Err(_) => IoBackend::Posix,
        Ok(other) => panic!("KVX_TEST_IO_BACKEND={other}: expected posix, uring, nixl, gds or auto"),
    }
}

pub fn engine_with(f: impl FnOnce(&mut EngineConfig)) -> Engine {
    let mut c = EngineConfig {
        device: test_device(),
        io_backend: test_io_backend(),
        io_threads: 4,
        bounce_bytes: 2 << 20,
        slot_bytes: 64 << 10,
        ..Default::default()
    };
    f(&mut c);
    Engine::new(&c).expect("engine")
}

pub fn cfg(nb: u64, nl: u64, od: u64, ps: u64, id: u64, dt: u64) -> LayoutConfig {
    LayoutConfig { num_blocks: nb, num_layers: nl, outer_dim: od, page_size: ps, inner_dim: id, dtype_bytes: dt }
}

/// A fresh path in the temp dir (the test removes it, or kvxfer does).
pub fn temp_path(tag: &str) -> PathBuf {
    static N: AtomicU64 = AtomicU64::new(0);
    let dir = std::env::var_os("KVX_TEST_DIR").map(PathBuf::from).unwrap_or_else(std::env::temp_dir);
    dir.join(format!("kvx-test-{}-{}-{tag}", std::process::id(), N.fetch_add(1, Ordering::Relaxed)))
}

/// A fresh folder in the temp dir, made (the test removes it, or kvxfer does).
pub fn temp_dir(tag: &str) -> PathBuf {
    let d = temp_path(tag);
    std::fs::create_dir_all(&d).unwrap();
    d
}

pub fn make_layout(e: &Engine, c: &LayoutConfig, kind: LayoutKind, storage: StorageKind) -> Arc<Layout> {
    match storage {
        StorageKind::Disk => e.create_disk_layout(c, &temp_path("disk"), DiskFlags::CREATE).expect("disk layout"),
        s => e.create_layout(c, kind, s).expect("memory layout"),
    }
}

/// xorshift: deterministic bytes for a seed.
pub fn random_bytes(seed: u64, n: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

/// Device memory of a real GPU cannot be dereferenced from the host.
fn on_gpu(l: &Layout) -> bool {
    !l.host_addressable()
}

fn placement(l: &Layout) -> Placement {
    l.placement
}

/// Reads region (b, l, o) straight from memory or the file.
pub fn read_region(layout: &Layout, b: u64, l: u64, o: u64) -> Vec<u8> {
    let p = placement(layout);
    let loc = p.region(b, l, o);
    let n = p.geom.region_bytes as usize;
    match layout.bases() {
        Some(bases) if on_gpu(layout) => {
            let mut v = vec![0u8; n];
            cuda::read(bases[loc.base as usize] + loc.offset, &mut v);
            v
        }
        Some(bases) => {
            let ptr = (bases[loc.base as usize] + loc.offset) as *const u8;
            unsafe { std::slice::from_raw_parts(ptr, n) }.to_vec()
        }
        None => {
            let f = std::fs::File::open(layout.disk().unwrap().path()).unwrap();
            let mut v = vec![0u8; n];
            f.read_exact_at(&mut v, loc.offset).unwrap();
            v
        }
    }
}

/// Writes region (b, l, o) straight into memory or the file.
pub fn write_region(layout: &Layout, b: u64, l: u64, o: u64, data: &[u8]) {
    let loc = placement(layout).region(b, l, o);
    match layout.bases() {
        Some(bases) if on_gpu(layout) => cuda::write(bases[loc.base as usize] + loc.offset, data),
        Some(bases) => {
            let ptr = (bases[loc.base as usize] + loc.offset) as *mut u8;
            unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), ptr, data.len()) };
        }
        None => {
            let f = std::fs::OpenOptions::new().write(true).open(layout.disk().unwrap().path()).unwrap();
            f.write_all_at(data, loc.offset).unwrap();
        }
    }
}

/// Fills every region with bytes derived from (seed, block, layer, outer).
pub fn fill(layout: &Layout, seed: u64) {
    let c = placement(layout).geom.cfg;
    for b in 0..c.num_blocks {
        for l in 0..c.num_layers {
            for o in 0..c.outer_dim {
                write_region(layout, b, l, o, &region_pattern(seed, b, l, o, placement(layout).geom.region_bytes));
            }
        }
    }
}

pub fn region_pattern(seed: u64, b: u64, l: u64, o: u64, n: u64) -> Vec<u8> {
    random_bytes(seed ^ (b << 40) ^ (l << 20) ^ (o << 8), n as usize)
}

/// Runs a transfer to completion and returns its status.
pub fn transfer(e: &Engine, src: &Arc<Layout>, sb: &[u64], dst: &Arc<Layout>, db: &[u64], opts: &TransferOptions) -> Status {
    let r = e.submit(src, sb, dst, db, opts).expect("submit");
    let s = r.wait(Some(Duration::from_secs(60)));
    if s != Status::Ok {
        // Straight to stderr so the reason shows next to the failed assertion.
        use std::io::Write;
        let _ = writeln!(std::io::stderr(), "transfer ended {s:?}: {}", r.error_message().to_string_lossy());
    }
    s
}

/// Checks that every region of `dst` equals what the mapping says: moved regions come
/// from `src_seed`'s pattern of their source block, all others keep `dst_seed`'s.
pub fn check(dst: &Layout, dst_seed: u64, src_seed: u64, pairs: &[(u64, u64)], layers: std::ops::Range<u64>, what: &str) {
    let g = placement(dst).geom;
    for b in 0..g.cfg.num_blocks {
        let from = pairs.iter().find(|p| p.1 == b).map(|p| p.0);
        for l in 0..g.cfg.num_layers {
            for o in 0..g.cfg.outer_dim {
                let want = match from {
                    Some(sb) if layers.contains(&l) => region_pattern(src_seed, sb, l, o, g.region_bytes),
                    _ => region_pattern(dst_seed, b, l, o, g.region_bytes),
                };
                let got = read_region(dst, b, l, o);
                assert!(got == want, "{what}: region (block {b}, layer {l}, outer {o}) is wrong (source block {from:?})");
            }
        }
    }
}

/// Device memory access for checks when the tests run on a real GPU (`KVX_TEST_DEVICE`
/// ≥ 0): synchronous driver copies in the primary context the engine also uses.
pub mod cuda {
    use kvxfer::gpu::cuda::driver::sys;
    use std::sync::OnceLock;

    /// The primary context of device `KVX_TEST_DEVICE`, current on this thread.
    pub fn bind() {
        static CTX: OnceLock<usize> = OnceLock::new();
        let ctx = *CTX.get_or_init(|| unsafe {
            assert_eq!(sys::cuInit(0), sys::CUresult::CUDA_SUCCESS);
            let kvxfer::Device::Cuda(ordinal) = super::test_device() else { panic!("device memory checks need KVX_TEST_DEVICE=<ordinal>") };
            let mut dev = 0;
            assert_eq!(sys::cuDeviceGet(&mut dev, ordinal as i32), sys::CUresult::CUDA_SUCCESS);
            let mut ctx = std::ptr::null_mut();
            assert_eq!(sys::cuDevicePrimaryCtxRetain(&mut ctx, dev), sys::CUresult::CUDA_SUCCESS);
            ctx as usize
        });
        unsafe { assert_eq!(sys::cuCtxSetCurrent(ctx as sys::CUcontext), sys::CUresult::CUDA_SUCCESS) };
    }

    pub fn read(addr: u64, out: &mut [u8]) {
        bind();
        let r = unsafe { sys::cuMemcpyDtoH_v2(out.as_mut_ptr() as *mut _, addr, out.len()) };
        assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
    }

    pub fn write(addr: u64, data: &[u8]) {
        bind();
        let r = unsafe { sys::cuMemcpyHtoD_v2(addr, data.as_ptr() as *const _, data.len()) };
        assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
    }
}

/// A seed derived from a store key alone (FNV-1a), so a block's bytes say which key it holds.
pub fn key_seed(key: &[u8]) -> u64 {
    key.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3))
}

/// Writes block `b` of `l` with the bytes of `key` (`key_seed`).
pub fn fill_block_for_key(l: &Layout, b: u64, key: &[u8]) {
    let g = l.geometry();
    for layer in 0..g.cfg.num_layers {
        for o in 0..g.cfg.outer_dim {
            write_region(l, b, layer, o, &region_pattern(key_seed(key), 0, layer, o, g.region_bytes));
        }
    }
}

/// Whether block `b` of `l` holds exactly the bytes of `key`.
pub fn holds_key(l: &Layout, b: u64, key: &[u8]) -> bool {
    let g = l.geometry();
    (0..g.cfg.num_layers).all(|layer| {
        (0..g.cfg.outer_dim).all(|o| read_region(l, b, layer, o) == region_pattern(key_seed(key), 0, layer, o, g.region_bytes))
    })
}
