//! Latency-critical transfers: served ahead of bulk ones at each stage they share, while
//! bulk ones keep one turn in four. These tests check the order of completions, never
//! speed: the first bulk transfer is held in the stage under test (its disk write or its
//! device copy, `Fault::Hold`), the others queue behind it, and once it is let go the
//! callbacks record who finished when. One I/O worker (and one copy thread) runs every
//! stage and every callback, so the order is the engine's, not the host's.
mod common;
use common::*;
use kvxfer::fault::{self, Fault, Site};
use kvxfer::{DiskFlags, Engine, IoBackend, Layout, LayoutKind, OnComplete, Request, Status, StorageKind, TransferOptions};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The fault plan is process-wide: one test of this file at a time.
static SERIAL: Mutex<()> = Mutex::new(());

/// A hang guard only: every wait here ends in milliseconds unless the engine hangs.
const GUARD: Duration = Duration::from_secs(60);

/// An engine of `slots` bounce slots and one I/O worker, a host layout and a disk file
/// of 4 KiB blocks: a transfer of one block is one chunk, one memcpy and one pwrite.
struct Line {
    e: Engine,
    host: Arc<Layout>,
    disk: Arc<Layout>,
    done: Arc<Mutex<Vec<String>>>,
}

impl Line {
    fn new(slots: u64, tag: &str) -> Line {
        let e = engine_with(|c| {
            c.io_threads = 1;
            c.io_backend = IoBackend::Posix; // the hold site is the pwrite call
            c.slot_bytes = 64 << 10;
            c.bounce_bytes = slots * (64 << 10);
        });
        let c = cfg(64, 1, 1, 16, 128, 2);
        let host = make_layout(&e, &c, LayoutKind::FullyContiguous, StorageKind::Host);
        let disk = e.create_disk_layout(&c, &temp_path(tag), DiskFlags::CREATE).unwrap();
        Line { e, host, disk, done: Default::default() }
    }

    /// A transfer's options: recorded as `name` in the record of completions.
    fn named(&self, name: &str, critical: bool) -> TransferOptions {
        let (done, name) = (self.done.clone(), name.to_string());
        let on_complete: OnComplete = Arc::new(move |_: &Request, _| done.lock().unwrap().push(name.clone()));
        TransferOptions { on_complete: Some(on_complete), critical, ..Default::default() }
    }

    /// Offloads block `b` (host to disk), named `name` in the record of completions.
    fn offload(&self, b: u64, name: &str, critical: bool) -> Arc<Request> {
        self.e.submit(&self.host, &[b], &self.disk, &[b], &self.named(name, critical)).unwrap()
    }

    /// Loads block `b` (disk to host), bulk, named `name` in the record of completions.
    fn load(&self, b: u64, name: &str) -> Arc<Request> {
        self.e.submit(&self.disk, &[b], &self.host, &[b], &self.named(name, false)).unwrap()
    }

    /// Holds the first disk write: `b0` (bulk) is in flight until `run` lets it go.
    fn hold_first(&self) -> Arc<Request> {
        fault::inject(Site::DiskWrite, 0, Fault::Hold);
        let b0 = self.offload(0, "b0", false);
        wait_held("the first transfer never reached its disk write");
        b0
    }

    /// `b0` held in its disk write, then `bulk` bulk offloads `b1`.. and `critical`
    /// critical ones `c1`.. queued behind it, in that order.
    fn queued(&self, bulk: u64, critical: u64) -> Vec<Arc<Request>> {
        let mut reqs = vec![self.hold_first()];
        reqs.extend((1..=bulk).map(|b| self.offload(b, &format!("b{b}"), false)));
        reqs.extend((1..=critical).map(|i| self.offload(bulk + i, &format!("c{i}"), true)));
        reqs
    }

    /// Lets the held write go and waits for every request: the order they completed in.
    fn run(&self, reqs: &[Arc<Request>]) -> Vec<String> {
        fault::clear();
        for r in reqs {
            assert_eq!(r.wait(Some(GUARD)), Status::Ok);
        }
        // A callback runs before `wait` reports the request done.
        self.done.lock().unwrap().clone()
    }
}

/// Waits until a call is held at its fault site.
fn wait_held(why: &str) {
    let started = Instant::now();
    while !fault::holding() && started.elapsed() < GUARD {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(fault::holding(), "{why}");
}

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn position(order: &[String], name: &str) -> usize {
    order.iter().position(|n| n == name).unwrap_or_else(|| panic!("{name} never completed: {order:?}"))
}

/// Two I/O workers, a device and a host layout, and two page-cache files: one that
/// offloads write (its first write held in its pwrite: `b0`, bulk, returned) and one
/// that loads read, its block 2 written.
struct Gate {
    line: Line,
    device: Arc<Layout>,
    offloads: Arc<Layout>,
    hot: Arc<Layout>,
}

impl Gate {
    fn new(tag: &str) -> (Gate, Arc<Request>) {
        let e = engine_with(|c| {
            c.io_threads = 2;
            c.io_backend = IoBackend::Posix; // the hold site is the pwrite call
            c.slot_bytes = 64 << 10;
            c.bounce_bytes = 8 * (64 << 10);
        });
        let c = cfg(64, 1, 1, 16, 128, 2);
        let device = make_layout(&e, &c, LayoutKind::FullyContiguous, StorageKind::Device);
        let host = make_layout(&e, &c, LayoutKind::FullyContiguous, StorageKind::Host);
        let buffered = DiskFlags::CREATE | DiskFlags::BUFFERED;
        let offloads = e.create_disk_layout(&c, &temp_path(&format!("{tag}-out")), buffered).unwrap();
        let hot = e.create_disk_layout(&c, &temp_path(&format!("{tag}-in")), buffered).unwrap();
        assert_eq!(e.submit(&device, &[2], &hot, &[2], &TransferOptions::default()).unwrap().wait(Some(GUARD)), Status::Ok);
        let disk = offloads.clone();
        let gate = Gate { line: Line { e, host, disk, done: Default::default() }, device, offloads, hot };
        fault::inject(Site::DiskWrite, 0, Fault::Hold);
        let b0 = gate.offload(0, "b0", false);
        wait_held("the first offload never reached its disk write");
        (gate, b0)
    }

    /// Offloads device block `b` to the page-cache file; its device copy is done within
    /// the submit, so its write is queued when this returns.
    fn offload(&self, b: u64, name: &str, critical: bool) -> Arc<Request> {
        self.line.e.submit(&self.device, &[b], &self.offloads, &[b], &self.line.named(name, critical)).unwrap()
    }

    /// Loads block 2 of the other file into the host layout (bulk) and waits for it.
    fn load(&self) {
        let load = self.line.e.submit(&self.hot, &[2], &self.line.host, &[2], &self.line.named("load", false)).unwrap();
        assert_eq!(load.wait(Some(GUARD)), Status::Ok);
    }
}

/// Page-cache writes to one file run one at a time (the kernel copies them one after
/// another under the file's lock, every writer asleep meanwhile): while one is held in
/// its pwrite, a second write to the file waits for it instead of taking the other I/O
/// worker, which stays free for a load queued behind it.
#[test]
fn a_second_write_to_a_page_cache_file_waits_for_the_first_and_leaves_the_other_worker_free() {
    let _serial = serial();
    let (gate, b0) = Gate::new("prio-gate");
    let b1 = gate.offload(1, "b1", false);
    gate.load();
    let second = b1.poll();
    let order = gate.line.run(&[b0, b1]);
    assert_eq!(second, Status::Pending, "the second write to the file ran beside the held one, on the worker the load waited for");
    assert_eq!(order, ["load", "b0", "b1"]);
}

/// The writes parked behind a page-cache file's writer run when its write is done,
/// critical ones first: a bulk and then a critical offload park behind the held write,
/// and once it is let go the critical one is written next.
#[test]
fn writes_parked_behind_a_page_cache_files_writer_run_critical_first() {
    let _serial = serial();
    let (gate, b0) = Gate::new("prio-gate-order");
    let b1 = gate.offload(1, "b1", false);
    let c1 = gate.offload(3, "c1", true);
    // The free worker takes c1 and b1 (parking both) before the load queued after them.
    gate.load();
    let order = gate.line.run(&[b0, b1, c1]);
    assert_eq!(order, ["load", "b0", "c1", "b1"]);
}

/// The bounce slots (through the dispatcher's turns): with the only slot out, six bulk
/// transfers queue for it, then a critical one. The slot that comes back goes to the
/// critical one, not to the bulk ones queued ahead of it.
#[test]
fn a_critical_transfer_gets_the_next_free_slot_before_bulk_ones_queued_ahead() {
    let _serial = serial();
    let line = Line::new(1, "prio-slot");
    let reqs = line.queued(6, 1);
    let order = line.run(&reqs);
    assert_eq!(position(&order, "c1"), 1, "the critical transfer took the slot after the held one: {order:?}");
}

/// The I/O workers' queue: with slots to spare, six bulk transfers' memcpys queue for
/// the one I/O worker, then a critical one's. The worker runs the critical one's stages
/// next, ahead of the bulk ones queued before it.
#[test]
fn a_critical_transfer_overtakes_bulk_ones_in_the_io_workers_queue() {
    let _serial = serial();
    let line = Line::new(16, "prio-io");
    let reqs = line.queued(6, 1);
    assert_eq!(line.e.slots().0, 16 - 8, "every transfer has its slot: they wait for the I/O worker, not for slots");
    let order = line.run(&reqs);
    assert_eq!(position(&order, "c1"), 1, "the critical transfer ran next on the I/O worker: {order:?}");
}

/// A chunk's next I/O stage runs at once on the worker that ran its last one, except a
/// bulk chunk's while critical work waits: a bulk load's read is held, a critical offload
/// queues its memcpy, and once the read is let go the load's copy out of its slot queues
/// behind the offload's stages, which complete first.
#[test]
fn a_bulk_chunks_next_stage_waits_behind_critical_work_queued_meanwhile() {
    let _serial = serial();
    let line = Line::new(16, "prio-next");
    fault::inject(Site::DiskRead, 0, Fault::Hold);
    let load = line.load(0, "load");
    wait_held("the load never reached its disk read");
    let c = line.offload(7, "c", true);
    let order = line.run(&[load, c]);
    assert_eq!(order, ["c", "load"], "the critical offload went ahead of the bulk load's copy: {order:?}");
}

/// The floor: with critical transfers queued all along, bulk ones still get one slot in
/// four, so they complete while critical work keeps coming instead of after all of it.
#[test]
fn bulk_transfers_keep_one_turn_in_four_while_critical_ones_are_queued() {
    let _serial = serial();
    let line = Line::new(1, "prio-floor");
    let reqs = line.queued(3, 12);
    let order = line.run(&reqs);
    let want = ["b0", "c1", "c2", "c3", "b1", "c4", "c5", "c6", "b2", "c7", "c8", "c9", "b3", "c10", "c11", "c12"];
    assert_eq!(order, want, "critical first, every fourth slot bulk");
}

/// The floor at the I/O worker, where a worker runs a chunk's next stage itself: with a
/// slot for every transfer (no turns for slots to space them), three bulk transfers and
/// twelve critical ones queue for the one I/O worker. Each bulk one still completes while
/// critical ones are queued, not after all of them, and the critical ones go first.
#[test]
fn bulk_transfers_keep_their_floor_at_the_io_worker_while_critical_ones_are_queued() {
    let _serial = serial();
    let line = Line::new(32, "prio-floor-io");
    let reqs = line.queued(3, 12);
    assert_eq!(line.e.slots().0, 32 - 16, "every transfer has its slot: they wait for the I/O worker, not for slots");
    let order = line.run(&reqs);
    let last = position(&order, "c12");
    for b in 1..=3 {
        assert!(position(&order, &format!("b{b}")) < last, "b{b} waited for every critical transfer: {order:?}");
    }
    assert!(position(&order, "c1") < position(&order, "b1"), "the critical transfers go first: {order:?}");
}

/// Through the C ABI: `KVX_XFER_CRITICAL` in `kvx_transfer_options.flags` marks a
/// transfer critical; a caller of an older ABI (a 1.0-sized struct, flags 0 as it had to
/// pass) gets the order transfers came in.
#[test]
fn through_the_c_abi_the_flag_orders_and_an_older_options_struct_gets_arrival_order() {
    use kvxfer::ffi::{engine::*, layout::*, transfer::*, *};
    use std::ffi::c_void;
    let _serial = serial();
    static DONE: Mutex<Vec<usize>> = Mutex::new(Vec::new());
    unsafe extern "C" fn record(user_data: *mut c_void, _r: *mut kvx_request, _s: kvx_status) {
        DONE.lock().unwrap().push(user_data as usize);
    }
    // (struct size, flags) of the last transfer's options, and where it completed.
    let cases = [
        (std::mem::size_of::<kvx_transfer_options>(), KVX_XFER_CRITICAL, 1),
        (std::mem::offset_of!(kvx_transfer_options, wait_event), 0, 4),
    ];
    for (size, flags, want) in cases {
        DONE.lock().unwrap().clear();
        unsafe {
            let mut ec = std::mem::zeroed::<kvx_engine_config>();
            kvx_engine_config_init(&mut ec);
            ec.device = KVX_DEVICE_EMULATED;
            ec.io_threads = 1;
            ec.io_backend = KVX_IO_POSIX;
            ec.slot_bytes = 64 << 10;
            ec.bounce_bytes = 64 << 10;
            let mut e = std::ptr::null_mut();
            assert_eq!(kvx_engine_create(&ec, &mut e), KVX_OK);
            let lc = kvx_layout_config {
                struct_size: std::mem::size_of::<kvx_layout_config>() as u32,
                kind: KVX_LAYOUT_FULLY_CONTIGUOUS,
                num_blocks: 8,
                num_layers: 1,
                outer_dim: 1,
                page_size: 16,
                inner_dim: 128,
                dtype_bytes: 2,
            };
            let (mut host, mut disk) = (std::ptr::null_mut(), std::ptr::null_mut());
            assert_eq!(kvx_layout_create_host(e, &lc, 0, &mut host), KVX_OK);
            let path = std::ffi::CString::new(temp_path("prio-abi").to_str().unwrap()).unwrap();
            assert_eq!(kvx_layout_create_disk(e, &lc, path.as_ptr(), KVX_DISK_CREATE, &mut disk), KVX_OK);
            let submit = |b: u64, size: usize, flags: u32| {
                let mut o = std::mem::zeroed::<kvx_transfer_options>();
                kvx_transfer_options_init(&mut o);
                o.struct_size = size as u32;
                o.flags = flags;
                o.on_complete = Some(record);
                o.user_data = b as *mut c_void;
                let mut r = std::ptr::null_mut();
                assert_eq!(kvx_transfer_submit(e, host, &b, disk, &b, 1, &o, &mut r), KVX_OK, "submit {b}");
                r
            };
            fault::inject(Site::DiskWrite, 0, Fault::Hold);
            let mut reqs = vec![submit(0, size, 0)];
            let started = Instant::now();
            while !fault::holding() && started.elapsed() < GUARD {
                std::thread::sleep(Duration::from_millis(1));
            }
            assert!(fault::holding(), "the first transfer never reached its disk write");
            reqs.extend((1..=3).map(|b| submit(b, size, 0)));
            reqs.push(submit(4, size, flags));
            fault::clear();
            for r in reqs {
                assert_eq!(kvx_request_wait(r, GUARD.as_nanos() as u64), KVX_OK);
                kvx_request_release(r);
            }
            let order = DONE.lock().unwrap().clone();
            assert_eq!(order.iter().position(|&b| b == 4), Some(want), "struct_size {size}, flags {flags}: {order:?}");
            kvx_layout_destroy(host);
            kvx_layout_destroy(disk);
            kvx_engine_destroy(e);
        }
    }
}

/// The device's streams and the fence threads: with bulk copies queued on a held stream,
/// a critical transfer's copies go on a stream of their own and its fences are waited
/// on a lane of their own, so it completes while the bulk copies queued before it wait.
#[test]
fn a_critical_transfer_completes_while_bulk_copies_ahead_of_it_are_held_on_the_device() {
    let _serial = serial();
    fault::set_deferred_device(Some(true));
    let e = engine_with(|c| c.device = kvxfer::Device::Emulated);
    fault::set_deferred_device(None);
    let c = cfg(8, 2, 2, 16, 128, 2);
    let (src, dst) = (
        make_layout(&e, &c, LayoutKind::FullyContiguous, StorageKind::Pinned),
        make_layout(&e, &c, LayoutKind::FullyContiguous, StorageKind::Device),
    );
    fill(&src, 21);
    fill(&dst, 22);
    fault::hold_bulk_device_stream(true);
    let bulk: Vec<_> = (0..4).map(|b| e.submit(&src, &[b], &dst, &[b], &Default::default()).unwrap()).collect();
    let critical = e.submit(&src, &[7], &dst, &[7], &TransferOptions { critical: true, ..Default::default() }).unwrap();
    let status = critical.wait(Some(Duration::from_secs(30)));
    let bulk_then: Vec<Status> = bulk.iter().map(|r| r.poll()).collect();
    fault::hold_bulk_device_stream(false);
    for r in &bulk {
        assert_eq!(r.wait(Some(GUARD)), Status::Ok);
    }
    assert_eq!(status, Status::Ok, "the critical transfer waited for the bulk copies held ahead of it");
    assert!(bulk_then.iter().all(|&s| s == Status::Pending), "the bulk stream ran while held: {bulk_then:?}");
    let pairs: Vec<(u64, u64)> = [0, 1, 2, 3, 7].iter().map(|&b| (b, b)).collect();
    check(&dst, 22, 21, &pairs, 0..2, "bulk and critical copies");
}

/// The copy thread's queue: a pageable host -> device transfer is memcpy'd into its slot
/// by the I/O worker and copied to the device by the copy thread. With the copy thread
/// held in the first bulk transfer's copy, four more bulk ones queue for it, then a
/// critical one; the copy thread copies the critical one next.
#[test]
fn a_critical_transfer_overtakes_bulk_ones_in_the_copy_threads_queue() {
    let _serial = serial();
    // The immediate emulated device: a copy is done when the copy thread issues it, so
    // the order of completions is the order of issue.
    fault::set_deferred_device(Some(false));
    let e = engine_with(|c| {
        c.device = kvxfer::Device::Emulated; // its copies can be held
        c.io_threads = 1;
        c.io_backend = IoBackend::Posix;
    });
    fault::set_deferred_device(None);
    let c = cfg(16, 1, 1, 16, 128, 2);
    let host = make_layout(&e, &c, LayoutKind::FullyContiguous, StorageKind::Host);
    let dev = make_layout(&e, &c, LayoutKind::FullyContiguous, StorageKind::Device);
    let disk = e.create_disk_layout(&c, &temp_path("prio-copy"), DiskFlags::CREATE).unwrap();
    let done: Arc<Mutex<Vec<String>>> = Default::default();
    let upload = |b: u64, name: &str, critical: bool| {
        let (done, name) = (done.clone(), name.to_string());
        let on_complete: OnComplete = Arc::new(move |_: &Request, _| done.lock().unwrap().push(name.clone()));
        e.submit(&host, &[b], &dev, &[b], &TransferOptions { on_complete: Some(on_complete), critical, ..Default::default() }).unwrap()
    };
    fault::inject(Site::DeviceCopy, 0, Fault::Hold);
    let mut reqs = vec![upload(0, "b0", false)];
    let started = Instant::now();
    while !fault::holding() && started.elapsed() < GUARD {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(fault::holding(), "the first transfer never reached its device copy");
    // A bulk offload behind each batch on the one I/O worker: once its disk write starts,
    // the worker has sent every upload before it on to the copy thread. So the bulk
    // uploads are queued there before the critical one is submitted.
    let mut markers = Vec::new();
    let mut behind = |b: u64| {
        markers.push(e.submit(&host, &[b], &disk, &[b], &Default::default()).unwrap());
        while fault::calls(Site::DiskWrite) < markers.len() as u64 && started.elapsed() < GUARD {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(fault::calls(Site::DiskWrite), markers.len() as u64, "a marker's disk write never started");
    };
    reqs.extend((1..=4).map(|b| upload(b, &format!("b{b}"), false)));
    behind(6);
    reqs.push(upload(5, "c", true));
    behind(7);
    fault::clear();
    for r in reqs.iter().chain(&markers) {
        assert_eq!(r.wait(Some(GUARD)), Status::Ok);
    }
    let order = done.lock().unwrap().clone();
    assert_eq!(position(&order, "c"), 1, "the critical transfer was copied next: {order:?}");
}
