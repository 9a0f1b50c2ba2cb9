//! Fault injection, SQLite style: for a disk -> device and a device -> disk transfer,
//! make each disk call, each device copy and each op of one in turn fail (EIO, ENOSPC),
//! get interrupted (EINTR) or come back short, and check the request's status and
//! message, that EINTR and short I/O were retried invisibly (bytes right), that every
//! bounce slot came back, and that the engine keeps serving. Prints the matrix.
mod common;
use common::*;
use kvxfer::fault::{self, Fault, Site};
use kvxfer::{Engine, IoBackend, Layout, LayoutKind, Status, StorageKind};
use std::io::Write;
use std::sync::{Arc, Mutex};

/// The fault plan is process-wide: one test of this file at a time.
static SERIAL: Mutex<()> = Mutex::new(());

const FAULTS: [(Fault, &str); 4] = [
    (Fault::Errno(libc::EIO), "EIO"),
    (Fault::Errno(libc::ENOSPC), "ENOSPC"),
    (Fault::Errno(libc::EINTR), "EINTR"),
    (Fault::Short, "short"),
];

struct Setup {
    e: Engine,
    disk: Arc<Layout>,
    dev: Arc<Layout>,
    /// Every other block of the disk file, so each chunk's disk side is several extents
    /// (a fault then strikes one I/O while its siblings are in flight).
    disk_ids: Vec<u64>,
    dev_ids: Vec<u64>,
}

impl Setup {
    /// (src ids, dst ids) for a transfer from `src`.
    fn ids(&self, src_is_disk: bool) -> (&[u64], &[u64]) {
        if src_is_disk {
            (&self.disk_ids, &self.dev_ids)
        } else {
            (&self.dev_ids, &self.disk_ids)
        }
    }

    /// (src block, dst block) pairs of a transfer from `src`.
    fn pairs(&self, src_is_disk: bool) -> Vec<(u64, u64)> {
        let (s, d) = self.ids(src_is_disk);
        s.iter().copied().zip(d.iter().copied()).collect()
    }
}

/// Faults are injected at the pread/pwrite and io_uring calls; NIXL and cuFile make
/// their own, so under those the walk runs on POSIX (and says so).
fn backend() -> IoBackend {
    match test_io_backend() {
        b @ (IoBackend::Posix | IoBackend::Uring) => b,
        _ => {
            let _ = writeln!(std::io::stderr(), "faults: KVX_TEST_IO_BACKEND has no injection points; walking the POSIX path");
            IoBackend::Posix
        }
    }
}

fn setup() -> Setup {
    let backend = backend();
    let e = engine_with(|c| {
        // Device copies can be made to fail on the emulated device only, so these tests
        // run there even where KVX_TEST_DEVICE names a GPU.
        c.device = kvxfer::Device::Emulated;
        c.io_threads = 2;
        c.io_backend = backend;
    });
    // 24 KiB blocks, 16 moved: 64 KiB chunks of two or three extents each.
    let disk = make_layout(&e, &cfg(32, 3, 2, 16, 128, 2), LayoutKind::FullyContiguous, StorageKind::Disk);
    let dev = make_layout(&e, &cfg(16, 3, 2, 16, 128, 2), LayoutKind::LayerSeparate { block_first: false }, StorageKind::Device);
    Setup { e, disk, dev, disk_ids: (0..16).map(|b| 2 * b).collect(), dev_ids: (0..16).collect() }
}

fn expect_for(fault: Fault) -> (Status, &'static str) {
    match fault {
        Fault::Errno(libc::EIO) => (Status::Io, "Input/output error"),
        Fault::Errno(libc::ENOSPC) => (Status::Io, "No space left on device"),
        Fault::CopyError => (Status::Cuda, "injected"),
        _ => (Status::Ok, ""),
    }
}

/// Runs `transfer` with the `n`th call at `site` faulted; checks status, message, slots.
#[allow(clippy::too_many_arguments)]
fn one(s: &Setup, site: Site, n: u64, fault: Fault, name: &str, src_is_disk: bool, out: &mut String) {
    let (src, dst) = if src_is_disk { (&s.disk, &s.dev) } else { (&s.dev, &s.disk) };
    let (src_ids, dst_ids) = s.ids(src_is_disk);
    fault::inject(site, n, fault);
    let r = s.e.submit(src, src_ids, dst, dst_ids, &Default::default()).unwrap();
    let status = r.wait(Some(std::time::Duration::from_secs(30)));
    fault::clear();
    let (want, text) = expect_for(fault);
    let msg = r.error_message().to_string_lossy().into_owned();
    out.push_str(&format!(
        "  {site:?} call {n:2} {name:6} -> {}{}\n",
        status.name(),
        if msg.is_empty() { String::new() } else { format!(" ({msg})") }
    ));
    assert_eq!(status, want, "{site:?} call {n} {name}: {msg}");
    assert!(msg.contains(text), "{site:?} call {n} {name}: message {msg:?} lacks {text:?}");
    let (free, total) = s.e.slots();
    assert_eq!(free, total, "{site:?} call {n} {name}: a bounce slot did not come back");
}

fn walk(src_is_disk: bool) {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let s = setup();
    let (src, dst) = if src_is_disk { (s.disk.clone(), s.dev.clone()) } else { (s.dev.clone(), s.disk.clone()) };
    fill(&src, 7);
    fill(&dst, 8);
    let disk_site = if src_is_disk { Site::DiskRead } else { Site::DiskWrite };
    // How many calls a clean transfer makes at each site.
    let (src_ids, dst_ids) = s.ids(src_is_disk);
    fault::count_only();
    assert_eq!(transfer(&s.e, &src, src_ids, &dst, dst_ids, &Default::default()), Status::Ok);
    let (disk_calls, copy_calls, op_calls) = (fault::calls(disk_site), fault::calls(Site::DeviceCopy), fault::calls(Site::DeviceOp));
    fault::clear();
    assert!(disk_calls >= 6 && copy_calls >= 6 && op_calls > copy_calls, "{disk_calls} disk calls, {copy_calls} copies, {op_calls} ops");
    let mut out = format!(
        "{} ({disk_calls} disk calls, {copy_calls} device copies of {op_calls} ops):\n",
        if src_is_disk { "disk -> device" } else { "device -> disk" }
    );
    for n in 0..disk_calls {
        for (fault, name) in FAULTS {
            one(&s, disk_site, n, fault, name, src_is_disk, &mut out);
        }
    }
    for n in 0..copy_calls {
        one(&s, Site::DeviceCopy, n, Fault::CopyError, "error", src_is_disk, &mut out);
    }
    for n in 0..op_calls {
        one(&s, Site::DeviceOp, n, Fault::CopyError, "error", src_is_disk, &mut out);
    }
    // Still serving, and a clean transfer moves every byte.
    fill(&dst, 8);
    assert_eq!(transfer(&s.e, &src, src_ids, &dst, dst_ids, &Default::default()), Status::Ok);
    check(&dst, 8, 7, &s.pairs(src_is_disk), 0..3, "after the faults");
    let _ = std::io::stderr().write_all(out.as_bytes());
}

#[test]
fn every_disk_read_and_device_copy_of_disk_to_device_can_fail() {
    walk(true);
}

#[test]
fn every_disk_write_and_device_copy_of_device_to_disk_can_fail() {
    walk(false);
}

#[test]
fn interrupted_and_short_io_is_invisible() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let s = setup();
    fill(&s.disk, 3);
    fill(&s.dev, 4);
    for (fault, _) in FAULTS.iter().filter(|(f, _)| matches!(f, Fault::Short | Fault::Errno(libc::EINTR))) {
        fault::inject(Site::DiskRead, 0, *fault);
        assert_eq!(transfer(&s.e, &s.disk, &s.disk_ids, &s.dev, &s.dev_ids, &Default::default()), Status::Ok);
        fault::clear();
        check(&s.dev, 4, 3, &s.pairs(true), 0..3, "retried");
    }
}

/// A one-block read on an idle engine is shared by every I/O worker (`engine::fanout`):
/// each of its parts' calls in turn fails or comes back short; the request ends with
/// the failure (or retries invisibly), its slot comes back once every part is done, and
/// the engine keeps serving.
#[test]
fn every_part_of_a_shared_read_can_fail() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let e = engine_with(|c| {
        c.device = kvxfer::Device::Emulated;
        c.io_threads = 4;
        c.io_backend = backend();
        c.slot_bytes = 1 << 20;
        c.bounce_bytes = 4 << 20;
    });
    let c = cfg(4, 4, 2, 16, 2048, 2); // 1 MiB blocks: one chunk, one extent
    let disk = make_layout(&e, &c, LayoutKind::FullyContiguous, StorageKind::Disk);
    let dev = make_layout(&e, &c, LayoutKind::LayerSeparate { block_first: false }, StorageKind::Device);
    let s = Setup { e, disk, dev, disk_ids: vec![1], dev_ids: vec![2] };
    fill(&s.disk, 5);
    fill(&s.dev, 6);
    let shared = s.e.stats().reads_fanned_out;
    fault::count_only();
    assert_eq!(transfer(&s.e, &s.disk, &s.disk_ids, &s.dev, &s.dev_ids, &Default::default()), Status::Ok);
    let calls = fault::calls(Site::DiskRead);
    fault::clear();
    assert!(s.e.stats().reads_fanned_out > shared, "the read was not shared, so this test checks nothing");
    assert!(calls >= 2, "{calls} disk reads for a shared read");
    let mut out = format!("shared one-block read ({calls} disk calls):\n");
    for n in 0..calls {
        for (fault, name) in FAULTS {
            fill(&s.dev, 6);
            one(&s, Site::DiskRead, n, fault, name, true, &mut out);
            if expect_for(fault).0 == Status::Ok {
                check(&s.dev, 6, 5, &s.pairs(true), 0..4, &format!("call {n} {name}, retried"));
            }
        }
    }
    fill(&s.dev, 6);
    assert_eq!(transfer(&s.e, &s.disk, &s.disk_ids, &s.dev, &s.dev_ids, &Default::default()), Status::Ok);
    check(&s.dev, 6, 5, &s.pairs(true), 0..4, "after the faults");
    let _ = std::io::stderr().write_all(out.as_bytes());
}

/// A batch of device copies that fails part-way keeps its slot until what it had queued
/// is done. On a device whose copies complete later (the deferred emulated device, its
/// stream held), request X's batch of three ops fails at its third, the first two still
/// queued; request Y, which needs X's slot (the ring has one), must not get it before
/// they ran: else they land in the slot over Y's disk read, and Y's device blocks get
/// X's bytes.
#[test]
fn a_batch_failing_after_queued_copies_keeps_its_slot_until_they_ran() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    fault::set_deferred_device(Some(true));
    let e = engine_with(|c| {
        c.device = kvxfer::Device::Emulated;
        c.io_backend = backend();
        c.slot_bytes = 64 << 10;
        c.bounce_bytes = 64 << 10;
    });
    fault::set_deferred_device(None);
    assert_eq!(e.slots(), (1, 1));
    // 4 KiB regions, three layers each in a base of its own: a block moves as three ops.
    let c = cfg(2, 3, 1, 16, 128, 2);
    let separate = LayoutKind::LayerSeparate { block_first: false };
    let x_src = make_layout(&e, &c, separate, StorageKind::Device);
    let x_dst = make_layout(&e, &c, LayoutKind::FullyContiguous, StorageKind::Disk);
    let y_src = make_layout(&e, &c, LayoutKind::FullyContiguous, StorageKind::Disk);
    let y_dst = make_layout(&e, &c, separate, StorageKind::Device);
    fill(&x_src, 11);
    fill(&y_src, 12);
    fill(&y_dst, 13);

    fault::hold_device_streams(true);
    fault::inject(Site::DeviceOp, 2, Fault::CopyError);
    let x = e.submit(&x_src, &[0], &x_dst, &[0], &Default::default()).unwrap();
    let y = e.submit(&y_src, &[0], &y_dst, &[0], &Default::default()).unwrap();
    // Someone waits on the held stream: X's failed batch (its slot kept), or, where the
    // slot went back at once, Y's copies behind X's, after Y's read into that slot.
    let waiting = fault::wait_for_fence_waiter(std::time::Duration::from_secs(30));
    let x_early = x.poll();
    fault::hold_device_streams(false);
    assert!(waiting, "nothing waits on the held device stream");
    let (xs, ys) = (x.wait(Some(std::time::Duration::from_secs(30))), y.wait(Some(std::time::Duration::from_secs(30))));
    fault::clear();
    let msg = x.error_message().to_string_lossy().into_owned();
    assert_eq!(xs, Status::Cuda, "{msg}");
    assert!(msg.contains("injected"), "{msg}");
    assert_eq!(ys, Status::Ok, "{}", y.error_message().to_string_lossy());
    check(&y_dst, 13, 12, &[(0, 0)], 0..3, "the request that reused the failed batch's slot");
    assert_eq!(x_early, Status::Pending, "the failed request finished while its queued copies had not run");
    assert_eq!(e.slots(), (1, 1));
}
