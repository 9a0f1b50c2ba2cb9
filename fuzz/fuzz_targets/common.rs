//! The fuzzing logic shared by the `abi` and `checks` targets: the C ABI's argument
//! space — struct sizes, configs, flags, block id lists, layer ranges, option structs,
//! store keys and counts — and the layout math, against one long-lived engine and store. Any panic, abort or sanitizer
//! report is a bug; every call must return a status. `real` lets one op in 256 create
//! layouts and engines and run transfers for real (slow: threads); without it every op
//! goes through the same checks only (fast).

use kvxfer::ffi::{api::*, engine::*, layout::*, slots::*, store::*, transfer::*, types::*};
use kvxfer::layout::{segments, LayoutConfig, LayoutKind, Placement};
use std::sync::LazyLock;

struct Fixture {
    engine: usize,
    layouts: Vec<usize>,
    /// A store of the first geometry (on tmpfs, buffered), 8 blocks.
    store: usize,
}

/// Small valid layouts of two geometries, in every storage, on one emulated engine.
static FIXTURE: LazyLock<Fixture> = LazyLock::new(|| unsafe {
    let mut ec = std::mem::zeroed::<kvx_engine_config>();
    kvx_engine_config_init(&mut ec);
    ec.device = KVX_DEVICE_EMULATED;
    ec.io_threads = 2;
    ec.bounce_bytes = 1 << 20;
    ec.slot_bytes = 64 << 10;
    let mut e = std::ptr::null_mut();
    assert_eq!(kvx_engine_create(&ec, &mut e), KVX_OK);
    let mut layouts = Vec::new();
    for (i, inner) in [40u64, 64].into_iter().enumerate() {
        let mut c = std::mem::zeroed::<kvx_layout_config>();
        kvx_layout_config_init(&mut c);
        (c.num_blocks, c.num_layers, c.outer_dim, c.page_size, c.inner_dim, c.dtype_bytes) = (8, 3, 2, 4, inner, 2);
        for kind in [KVX_LAYOUT_FULLY_CONTIGUOUS, KVX_LAYOUT_LAYER_SEPARATE_BLOCK_FIRST, KVX_LAYOUT_LAYER_SEPARATE_OUTER_FIRST] {
            c.kind = kind;
            let mut l = std::ptr::null_mut();
            assert_eq!(kvx_layout_create_device(e, &c, &mut l), KVX_OK);
            layouts.push(l as usize);
            assert_eq!(kvx_layout_create_host(e, &c, (kind % 2) as u32, &mut l), KVX_OK);
            layouts.push(l as usize);
        }
        let path = format!("/dev/shm/kvx-fuzz-{}-{i}\0", std::process::id());
        let mut l = std::ptr::null_mut();
        assert_eq!(kvx_layout_create_disk(e, &c, path.as_ptr() as *const _, KVX_DISK_CREATE | KVX_DISK_CHECKSUM, &mut l), KVX_OK);
        layouts.push(l as usize);
        // The same geometry mapped (KVX_DISK_MAPPED needs tmpfs: /dev/shm).
        let path = format!("/dev/shm/kvx-fuzz-{}-{i}-mapped\0", std::process::id());
        assert_eq!(kvx_layout_create_disk(e, &c, path.as_ptr() as *const _, KVX_DISK_CREATE | KVX_DISK_MAPPED, &mut l), KVX_OK);
        layouts.push(l as usize);
    }
    let mut c = std::mem::zeroed::<kvx_layout_config>();
    kvx_layout_config_init(&mut c);
    (c.num_blocks, c.num_layers, c.outer_dim, c.page_size, c.inner_dim, c.dtype_bytes) = (8, 3, 2, 4, 40, 2);
    let mut sc = std::mem::zeroed::<kvx_store_config>();
    kvx_store_config_init(&mut sc);
    sc.flags |= KVX_STORE_BUFFERED;
    sc.block = &c;
    sc.capacity_blocks = 8;
    let dir = format!("/dev/shm/kvx-fuzz-{}-store\0", std::process::id());
    let mut store = std::ptr::null_mut();
    assert_eq!(kvx_store_open(e, dir.as_ptr() as *const _, &sc, &mut store), KVX_OK);
    Fixture { engine: e as usize, layouts, store: store as usize }
});

struct Input<'a>(&'a [u8]);

impl Input<'_> {
    fn u8(&mut self) -> u8 {
        let (b, rest) = self.0.split_first().map_or((0, &[][..]), |(b, r)| (*b, r));
        self.0 = rest;
        b
    }
    fn u32(&mut self) -> u32 {
        u32::from_le_bytes([self.u8(), self.u8(), self.u8(), self.u8()])
    }
    fn u64(&mut self) -> u64 {
        (self.u32() as u64) | ((self.u32() as u64) << 32)
    }
    /// Mostly small numbers, sometimes anything.
    fn dim(&mut self) -> u64 {
        match self.u8() % 8 {
            0 => self.u64(),
            1 => 0,
            _ => self.u8() as u64 % 17,
        }
    }
}

pub unsafe fn run(data: &[u8], real: bool) {
    let f = &*FIXTURE;
    let e = f.engine as *mut kvx_engine;
    let mut inp = Input(data);
    while !inp.0.is_empty() {
        match inp.u8() % 7 {
            0 => {
                // A layout config: validation only for anything large, so nothing huge is allocated.
                let mut c = std::mem::zeroed::<kvx_layout_config>();
                kvx_layout_config_init(&mut c);
                c.struct_size = if inp.u8() % 4 == 0 { inp.u8() as u32 } else { c.struct_size };
                c.kind = inp.u8() as u32 % 5;
                (c.num_blocks, c.num_layers, c.outer_dim, c.page_size, c.inner_dim, c.dtype_bytes) =
                    (inp.dim(), inp.dim(), inp.dim(), inp.dim(), inp.dim(), inp.dim());
                // Allocating is slow: create for real in one op of 256, else validate
                // through the same struct read and config checks.
                let small = [c.num_blocks, c.num_layers, c.page_size, c.inner_dim, c.dtype_bytes].iter().all(|&v| v <= 16);
                if !real || inp.u8() != 0xEE {
                    if let Ok(v) = kvxfer::ffi::boundary::read_versioned(&c) {
                        let cfg = LayoutConfig {
                            num_blocks: v.num_blocks,
                            num_layers: v.num_layers,
                            outer_dim: v.outer_dim,
                            page_size: v.page_size,
                            inner_dim: v.inner_dim,
                            dtype_bytes: v.dtype_bytes,
                        };
                        if let Ok(g) = cfg.validate() {
                            assert!(g.block_bytes == g.region_bytes * cfg.num_layers * cfg.outer_dim);
                        }
                    }
                    continue;
                }
                let mut l = std::ptr::null_mut();
                let s = if small {
                    kvx_layout_create_host(e, &c, inp.u8() as u32 % 4, &mut l)
                } else {
                    kvx_layout_register_host(e, &c, std::ptr::null(), inp.u8() as usize, 0, &mut l)
                };
                assert!(s == KVX_OK || l.is_null(), "output written on failure");
                assert!(s == KVX_OK || *std::ffi::CStr::from_ptr(kvx_last_error()).to_bytes() != *b"");
                kvx_layout_destroy(l);
            }
            1 => {
                // A transfer between fixture layouts with arbitrary ids, counts, layers, options.
                let n = f.layouts.len();
                let src = f.layouts[inp.u8() as usize % n] as *const kvx_layout;
                let dst = f.layouts[inp.u8() as usize % n] as *const kvx_layout;
                let count = inp.u8() as usize % 10;
                let sb: Vec<u64> = (0..count).map(|_| inp.u8() as u64 % 10).collect();
                let db: Vec<u64> = (0..count).map(|_| inp.u8() as u64 % 10).collect();
                let mut o = std::mem::zeroed::<kvx_transfer_options>();
                kvx_transfer_options_init(&mut o);
                o.struct_size = if inp.u8() % 4 == 0 { inp.u8() as u32 } else { o.struct_size };
                o.layer_begin = inp.u8() as u32 % 5;
                o.layer_end = inp.u8() as u32 % 5;
                o.flags = if inp.u8() % 8 == 0 { inp.u32() } else { 0 };
                // Running a transfer costs thread hops: one op in 256 runs it through the C
                // ABI; the others go through submit's checks only (a dry run).
                if !real || inp.u8() != 0xEE {
                    use kvxfer::ffi::handle::{ArcHandle, Handle};
                    let (s, d) = (kvx_layout::clone_arc(src, "src").unwrap(), kvx_layout::clone_arc(dst, "dst").unwrap());
                    let engine = kvx_engine::borrow(e, "engine").unwrap();
                    if let Ok(opts) = kvxfer::ffi::transfer::options(&o) {
                        let _ = engine.check(&s, &sb, &d, &db, &opts);
                    }
                    continue;
                }
                let mut r = std::ptr::null_mut();
                let s = kvx_transfer_submit(e, src, sb.as_ptr(), dst, db.as_ptr(), count, &o, &mut r);
                if s == KVX_OK {
                    let w = kvx_request_wait(r, u64::MAX);
                    // Fixture disk files may hold blocks never written: integrity errors are right.
                    assert!(w == KVX_OK || w == KVX_ERR_INTEGRITY, "{}", kvx_request_error(r) as usize);
                    kvx_request_release(r);
                } else {
                    assert!(r.is_null(), "request written on failure");
                }
            }
            2 => {
                // Engine configs: sizes and fields; created engines are destroyed at once.
                let mut ec = std::mem::zeroed::<kvx_engine_config>();
                kvx_engine_config_init(&mut ec);
                ec.struct_size = if inp.u8() % 4 == 0 { inp.u8() as u32 } else { ec.struct_size };
                ec.device = -(inp.u8() as i32 % 4);
                ec.io_backend = inp.u8() as u32 % 7;
                ec.io_threads = inp.u8() as u32 % 3;
                ec.slot_bytes = if inp.u8() % 2 == 0 { 0 } else { 1 << (inp.u8() % 24) };
                ec.bounce_bytes = ec.slot_bytes * (inp.u8() as u64 % 4);
                ec.max_inflight = inp.u8() as u32;
                ec.flags = if inp.u8() % 8 == 0 { inp.u32() } else { 0 };
                if ec.device == -2 {
                    ec.device = KVX_DEVICE_EMULATED; // no GPU probing from the fuzzer
                }
                // Starting an engine spawns threads: do it for one op in 65536 and only
                // validate the config (the same checks, nothing started) otherwise.
                if real && inp.u8() == 0xEE && inp.u8() == 0xEE {
                    let mut out = std::ptr::null_mut();
                    if kvx_engine_create(&ec, &mut out) == KVX_OK {
                        kvx_engine_destroy(out);
                    } else {
                        assert!(out.is_null());
                    }
                } else if let Ok(c) = kvxfer::ffi::boundary::read_versioned(&ec) {
                    if let Ok(r) = kvxfer::ffi::convert::engine_config(&c).and_then(|c| c.resolve()) {
                        assert!(r.slot_bytes.is_power_of_two() && r.bounce_bytes % r.slot_bytes == 0 && r.io_threads > 0);
                    }
                }
            }
            4 => {
                // Counts from C at and past what any array can hold: refused with a status
                // before the array is read (the pointers here hold a few elements only).
                let n = f.layouts.len();
                let (src, dst) = (f.layouts[inp.u8() as usize % n] as *const kvx_layout, f.layouts[inp.u8() as usize % n] as *const kvx_layout);
                let ids = [0u64; 4];
                let huge = match inp.u8() % 4 {
                    0 => usize::MAX,
                    1 => usize::MAX / 8 + 1 + inp.u64() as usize % 1024,
                    2 => isize::MAX as usize - inp.u8() as usize,
                    _ => inp.u64() as usize | (1 << 62),
                };
                let mut r = std::ptr::null_mut();
                let s = kvx_transfer_submit(e, src, ids.as_ptr(), dst, ids.as_ptr(), huge, std::ptr::null(), &mut r);
                assert!(s == KVX_ERR_INVALID_ARG && r.is_null(), "num_blocks {huge}: {s}");
                let mut c = std::mem::zeroed::<kvx_layout_config>();
                kvx_layout_config_init(&mut c);
                (c.num_blocks, c.num_layers, c.outer_dim, c.page_size, c.inner_dim, c.dtype_bytes) = (1, 1, 1, 1, 1, 1);
                let bases = [ids.as_ptr() as *mut std::ffi::c_void];
                let mut l = std::ptr::null_mut();
                let s = kvx_layout_register_host(e, &c, bases.as_ptr(), huge, 0, &mut l);
                assert!(s == KVX_ERR_INVALID_ARG && l.is_null(), "num_bases {huge}: {s}");
            }
            5 => {
                // Store keys of any length (NULL bytes too) and counts past any array,
                // through lookup, release and remove (index only, no data moved); a put
                // and a get of them for real in one op of 256. A refused call writes
                // nothing and leaves a message.
                let st = f.store as *mut kvx_store;
                let bytes = [0x5au8; 80];
                let keys: Vec<kvx_key> = (0..inp.u8() % 6)
                    .map(|_| {
                        let len = match inp.u8() % 8 {
                            0 => inp.u32(),
                            1 => 0,
                            _ => 1 + inp.u8() as u32 % 66,
                        };
                        let p = if inp.u8() % 16 == 0 { std::ptr::null() } else { bytes[..].as_ptr().wrapping_add(inp.u8() as usize % 8) };
                        kvx_key { bytes: p, len }
                    })
                    .collect();
                let n = match inp.u8() % 8 {
                    0 => usize::MAX - inp.u8() as usize,
                    1 => isize::MAX as usize / 16 + 1,
                    _ => keys.len(),
                };
                let valid = n == keys.len() && !keys.is_empty() && keys.iter().all(|k| (1..=64).contains(&k.len) && !k.bytes.is_null());
                let mut present = [7u8; 8];
                let mut leading = usize::MAX;
                let flags = if inp.u8() % 8 == 0 { inp.u32() } else { inp.u8() as u32 % 2 };
                let s = kvx_store_lookup(st, keys.as_ptr(), n, flags, present.as_mut_ptr(), &mut leading);
                if s == KVX_OK {
                    assert!(valid && leading <= keys.len());
                } else {
                    assert!(!valid || flags > 1, "lookup refused valid keys: {s}");
                    assert!(present == [7u8; 8] && leading == usize::MAX, "lookup wrote its outputs on failure");
                    assert!(*std::ffi::CStr::from_ptr(kvx_last_error()).to_bytes() != *b"");
                }
                assert_eq!(kvx_store_release_leases(st, keys.as_ptr(), n) == KVX_OK, valid);
                if real && inp.u8() == 0xEE {
                    let host = f.layouts[1] as *const kvx_layout;
                    let ids: Vec<u64> = (0..keys.len()).map(|i| i as u64).collect();
                    let mut r = std::ptr::null_mut();
                    let s = kvx_store_put(st, host, ids.as_ptr(), keys.as_ptr(), n, std::ptr::null(), &mut r);
                    assert_eq!(s == KVX_OK, valid, "put: {s}");
                    if s == KVX_OK {
                        kvx_store_request_wait(r, u64::MAX);
                        kvx_store_request_release(r);
                        let s = kvx_store_get(st, keys.as_ptr(), n, host, ids.as_ptr(), std::ptr::null(), &mut r);
                        // The same key twice in one batch reads into two blocks: allowed.
                        if s == KVX_OK {
                            kvx_store_request_wait(r, u64::MAX);
                            kvx_store_request_release(r);
                        }
                    } else {
                        assert!(r.is_null(), "request written on failure");
                    }
                }
                let mut statuses = [99u32; 8];
                let s = kvx_store_remove(st, keys.as_ptr(), n, statuses.as_mut_ptr());
                assert_eq!(s == KVX_OK, valid, "remove: {s}");
                if s != KVX_OK {
                    assert!(statuses == [99u32; 8], "remove wrote its output on failure");
                }
            }
            6 => {
                // Slot handles of any bytes (slots past the capacity, stale and forged
                // handles) and counts past any array, through commit and abort, and a
                // write and a read of them for real in one op of 256: no handle's bytes
                // crash the store, and a refused call writes nothing. Some are handles
                // the store gave out, some of those changed in a byte.
                let st = f.store as *mut kvx_store;
                let key = [0x33u8; 8];
                let keys = [kvx_key { bytes: key.as_ptr(), len: 1 + inp.u8() as u32 % 8 }];
                let mut given = std::mem::zeroed::<kvx_slot_handle>();
                let mut kind = 0u32;
                let _ = kvx_store_reserve_slots(st, keys.as_ptr(), 1, &mut given, &mut kind);
                let mut hs: Vec<kvx_slot_handle> = (0..inp.u8() % 4).map(|_| given).collect();
                for h in hs.iter_mut() {
                    let bytes = std::slice::from_raw_parts_mut(h as *mut kvx_slot_handle as *mut u8, std::mem::size_of::<kvx_slot_handle>());
                    match inp.u8() % 4 {
                        0 => {}
                        1 => bytes[inp.u8() as usize % bytes.len()] ^= 1 << (inp.u8() % 8),
                        _ => bytes.iter_mut().for_each(|b| *b = inp.u8()),
                    }
                    if inp.u8() % 2 == 0 {
                        h.slot %= 10; // mostly within the capacity of 8
                    }
                }
                let n = match inp.u8() % 8 {
                    0 => usize::MAX - inp.u8() as usize,
                    1 => isize::MAX as usize / 16 + 1,
                    _ => hs.len(),
                };
                let mut statuses = [99u32; 8];
                let s = kvx_store_commit_slots(st, hs.as_ptr(), n, statuses.as_mut_ptr());
                if s != KVX_OK {
                    assert!(statuses == [99u32; 8], "commit wrote its output on failure");
                    assert!(*std::ffi::CStr::from_ptr(kvx_last_error()).to_bytes() != *b"");
                }
                assert!(n == hs.len() || s != KVX_OK, "commit took a count past its array: {s}");
                if real && inp.u8() == 0xEE && !hs.is_empty() {
                    let host = f.layouts[1] as *const kvx_layout;
                    let ids: Vec<u64> = (0..hs.len()).map(|i| i as u64).collect();
                    let mut r = std::ptr::null_mut();
                    for write in [true, false] {
                        let s = if write {
                            kvx_store_write_slots(st, host, ids.as_ptr(), hs.as_ptr(), n, std::ptr::null(), &mut r)
                        } else {
                            kvx_store_read_slots(st, hs.as_ptr(), n, host, ids.as_ptr(), std::ptr::null(), &mut r)
                        };
                        if s == KVX_OK {
                            kvx_store_request_wait(r, u64::MAX);
                            kvx_store_request_release(r);
                        } else {
                            assert!(r.is_null(), "request written on failure");
                        }
                    }
                }
                assert!(kvx_store_abort_slots(st, hs.as_ptr(), n) != KVX_OK || n == hs.len());
                let _ = kvx_store_abort_slots(st, &given, 1);
            }
            _ => {
                // Layout math on its own: validation, region placement and coalescing.
                let c = LayoutConfig {
                    num_blocks: inp.dim(),
                    num_layers: inp.dim(),
                    outer_dim: inp.dim(),
                    page_size: inp.dim(),
                    inner_dim: inp.dim(),
                    dtype_bytes: inp.dim(),
                };
                if let Ok(g) = c.validate() {
                    if g.cfg.num_blocks <= 64 && g.cfg.num_layers <= 64 {
                        let kinds = [LayoutKind::FullyContiguous, LayoutKind::LayerSeparate { block_first: true }, LayoutKind::LayerSeparate { block_first: false }];
                        let a = Placement::memory(kinds[inp.u8() as usize % 3], g);
                        let b = if inp.u8() % 2 == 0 { Placement::disk(g, 4096) } else { Placement::memory(kinds[inp.u8() as usize % 3], g) };
                        let pairs: Vec<(u64, u64)> = (0..inp.u8() % 8).map(|_| (inp.dim() % g.cfg.num_blocks, inp.dim() % g.cfg.num_blocks)).collect();
                        let segs = segments(&a, &b, &pairs, 0..g.cfg.num_layers);
                        let total: u128 = segs.iter().map(|s| s.len as u128).sum();
                        assert_eq!(total, pairs.len() as u128 * g.block_bytes as u128);
                        for s in &segs {
                            assert!(s.src.offset + s.len <= a.base_bytes() && s.dst.offset + s.len <= b.base_bytes());
                        }
                    }
                }
            }
        }
    }
}
