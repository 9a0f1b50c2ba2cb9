//! The disk I/O backends: each one named moves the same bytes as POSIX or is refused with
//! `KVX_ERR_UNSUPPORTED` and a reason that names the way out; `KVX_IO_AUTO` takes one that
//! works. The data tests of a backend this machine lacks are skipped (and counted so).
mod common;
use common::cases::{case, run};
use common::*;
use kvxfer::{DiskFlags, Engine, EngineConfig, IoBackend, LayoutKind, Status, StorageKind, TransferOptions};

const FC: LayoutKind = LayoutKind::FullyContiguous;

/// An engine on `backend`, or the refusal (which must be `Unsupported` naming a fallback,
/// or `NoDevice` when `KVX_TEST_DEVICE` names a GPU this machine lacks).
fn engine_on(backend: IoBackend) -> Result<Engine, kvxfer::Error> {
    let r = Engine::new(&EngineConfig {
        device: test_device(),
        io_backend: backend,
        io_threads: 4,
        bounce_bytes: 1 << 20,
        slot_bytes: 64 << 10,
        ..Default::default()
    });
    if let Err(err) = &r {
        assert!(err.status == Status::Unsupported || err.status == Status::NoDevice, "{err}");
        assert!(err.status == Status::NoDevice || err.message.contains("KVX_IO_POSIX"), "no way out named: {}", err.message);
    }
    r
}

/// Host -> disk -> device and device -> disk -> host with unaligned regions (so both the
/// aligned and the buffered descriptor are used) and a layer range, checked without the
/// engine; a checksummed file too.
fn moves_the_same_bytes(e: &Engine, what: &str) {
    let c = cfg(8, 3, 2, 5, 7, 2);
    let ids: Vec<u64> = (0..8).collect();
    let pairs: Vec<(u64, u64)> = ids.iter().map(|&b| (b, b)).collect();
    let host = make_layout(e, &c, FC, StorageKind::Host);
    let disk = make_layout(e, &c, FC, StorageKind::Disk);
    let dev = make_layout(e, &c, LayoutKind::LayerSeparate { block_first: false }, StorageKind::Device);
    fill(&host, 12);
    fill(&dev, 13);
    assert_eq!(transfer(e, &host, &ids, &disk, &ids, &Default::default()), Status::Ok);
    let opts = TransferOptions { layer_begin: 1, layer_end: 2, ..Default::default() };
    assert_eq!(transfer(e, &disk, &ids, &dev, &ids, &opts), Status::Ok);
    check(&dev, 13, 12, &pairs, 1..2, what);

    // Device -> disk (aligned regions) -> a second device layout.
    let c = cfg(6, 2, 2, 16, 64, 2);
    let ids: Vec<u64> = (0..6).collect();
    let pairs: Vec<(u64, u64)> = ids.iter().map(|&b| (b, b)).collect();
    let src = make_layout(e, &c, LayoutKind::LayerSeparate { block_first: true }, StorageKind::Device);
    let disk = make_layout(e, &c, FC, StorageKind::Disk);
    let back = make_layout(e, &c, FC, StorageKind::Device);
    fill(&src, 21);
    fill(&back, 22);
    assert_eq!(transfer(e, &src, &ids, &disk, &ids, &Default::default()), Status::Ok);
    assert_eq!(transfer(e, &disk, &ids, &back, &ids, &Default::default()), Status::Ok);
    check(&back, 22, 21, &pairs, 0..2, what);

    // A checksummed file verifies on host bytes, whatever the backend.
    let sum = e.create_disk_layout(&c, &temp_path("sum"), DiskFlags::CREATE | DiskFlags::CHECKSUM).expect("disk layout");
    fill(&back, 23);
    assert_eq!(transfer(e, &src, &ids, &sum, &ids, &Default::default()), Status::Ok);
    assert_eq!(transfer(e, &sum, &ids, &back, &ids, &Default::default()), Status::Ok);
    check(&back, 23, 21, &pairs, 0..2, what);
}

fn main() {
    let refused = |b| engine_on(b).err().map(|e| e.message);
    let (uring, nixl, gds) = (refused(IoBackend::Uring), refused(IoBackend::Nixl), refused(IoBackend::Gds));
    run(vec![
        case("io_uring_moves_the_same_bytes", || moves(IoBackend::Uring, "io_uring")).unless(uring.clone()),
        case("nixl_moves_the_same_bytes", || moves(IoBackend::Nixl, "NIXL")).unless(nixl.clone()),
        case("gds_moves_the_same_bytes", || moves(IoBackend::Gds, "cuFile")).unless(gds),
        case("a_refused_backend_says_why_and_names_the_way_out", a_refused_backend_says_why_and_names_the_way_out),
        case("auto_takes_a_backend_that_works_and_never_an_unproven_one", auto_takes_a_backend_that_works_and_never_an_unproven_one),
        case("an_unknown_backend_is_an_invalid_argument", an_unknown_backend_is_an_invalid_argument),
        case("posix_reads_a_file_cut_short_as_an_io_error", || a_file_cut_short_is_an_io_error(IoBackend::Posix)),
        case("io_uring_reads_a_file_cut_short_as_an_io_error", || a_file_cut_short_is_an_io_error(IoBackend::Uring)).unless(uring),
        case("nixl_reads_a_file_cut_short_as_an_io_error", || a_file_cut_short_is_an_io_error(IoBackend::Nixl)).unless(nixl),
    ])
}

/// On `backend`, the same bytes as POSIX.
fn moves(backend: IoBackend, what: &str) {
    let e = engine_on(backend).expect("the backend worked when the tests were listed");
    assert_eq!(e.io_backend(), backend);
    moves_the_same_bytes(&e, what);
}

/// Each backend refused here: `Unsupported` naming a way out (checked by `engine_on`)
/// and the reason that applies.
fn a_refused_backend_says_why_and_names_the_way_out() {
    if let Err(err) = engine_on(IoBackend::Nixl) {
        if kvxfer::io::nixl::missing().is_some() {
            assert!(err.message.contains("libnixl_capi.so"), "the refusal names the missing library: {}", err.message);
        }
    }
    if let Err(err) = engine_on(IoBackend::Gds) {
        if test_device() == kvxfer::Device::Emulated {
            assert!(err.message.contains("emulated device"), "{}", err.message);
        }
    }
    if let Err(err) = engine_on(IoBackend::Uring) {
        assert!(err.message.contains("io_uring"), "{}", err.message);
    }
}

fn auto_takes_a_backend_that_works_and_never_an_unproven_one() {
    let e = engine_on(IoBackend::Auto).expect("KVX_IO_AUTO always finds a backend");
    let b = e.io_backend();
    assert!([IoBackend::Posix, IoBackend::Uring, IoBackend::Gds].contains(&b), "AUTO chose {b:?}");
    // io_uring is taken whenever the kernel allows it; GDS only with nvidia-fs.
    assert_eq!(b == IoBackend::Uring, engine_on(IoBackend::Uring).is_ok() && b != IoBackend::Gds);
    if b == IoBackend::Gds {
        assert!(std::path::Path::new("/proc/driver/nvidia-fs/version").exists());
    }
    moves_the_same_bytes(&e, "auto");
}

/// Backend codes are C's: an unknown one is refused at the ABI, naming the known ones.
fn an_unknown_backend_is_an_invalid_argument() {
    use kvxfer::ffi::{api::kvx_last_error, engine::*, *};
    unsafe {
        let mut c = std::mem::zeroed::<kvx_engine_config>();
        kvx_engine_config_init(&mut c);
        c.device = KVX_DEVICE_EMULATED;
        c.io_backend = KVX_IO_GDS + 1;
        let mut out = std::ptr::null_mut();
        assert_eq!(kvx_engine_create(&c, &mut out), KVX_ERR_INVALID_ARG);
        assert!(out.is_null());
        let msg = std::ffi::CStr::from_ptr(kvx_last_error()).to_string_lossy().into_owned();
        assert!(msg.contains("KVX_IO_"), "{msg}");
    }
}

/// A file cut short under a layout: the read fails with `KVX_ERR_IO` on `backend` —
/// never old slot bytes served as the block.
fn a_file_cut_short_is_an_io_error(backend: IoBackend) {
    let e = engine_on(backend).expect("the backend worked when the tests were listed");
    let c = cfg(4, 2, 2, 16, 64, 2);
    let ids: Vec<u64> = (0..4).collect();
    let path = temp_path("cut");
    let disk = e.create_disk_layout(&c, &path, DiskFlags::CREATE).expect("disk layout");
    let host = make_layout(&e, &c, FC, StorageKind::Host);
    fill(&host, 5);
    assert_eq!(transfer(&e, &host, &ids, &disk, &ids, &Default::default()), Status::Ok);
    std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(4096).unwrap();
    let back = make_layout(&e, &c, FC, StorageKind::Host);
    let r = e.submit(&disk, &ids, &back, &ids, &Default::default()).expect("submit");
    let status = r.wait(Some(std::time::Duration::from_secs(60)));
    assert_eq!(status, Status::Io, "backend {backend:?}: {}", r.error_message().to_string_lossy());
}
