//! Request life cycle: concurrency, cancel, admission, callbacks, engine destroy with
//! work in flight, validation, and files that outlive their layout.

mod common;
use common::*;
use kvxfer::{DiskFlags, LayoutKind, Status, StorageKind, TransferOptions};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

const FC: LayoutKind = LayoutKind::FullyContiguous;

#[test]
fn eight_threads_submitting_at_once_all_get_their_bytes() {
    let e = Arc::new(engine());
    let c = cfg(64, 4, 2, 8, 128, 2);
    let src = make_layout(&e, &c, FC, StorageKind::Disk);
    fill(&src, 5);
    let dst = make_layout(&e, &c, LayoutKind::LayerSeparate { block_first: false }, StorageKind::Device);
    fill(&dst, 6);
    std::thread::scope(|s| {
        for t in 0..8u64 {
            let (e, src, dst) = (e.clone(), src.clone(), dst.clone());
            s.spawn(move || {
                // Each thread owns 8 destination blocks and moves them in 4 requests.
                for k in 0..4u64 {
                    let d = [t * 8 + 2 * k, t * 8 + 2 * k + 1];
                    let sb = [63 - d[0], 63 - d[1]];
                    assert_eq!(transfer(&e, &src, &sb, &dst, &d, &Default::default()), Status::Ok);
                }
            });
        }
    });
    let pairs: Vec<(u64, u64)> = (0..64).map(|d| (63 - d, d)).collect();
    check(&dst, 6, 5, &pairs, 0..4, "8 threads");
    assert_eq!(e.stats().requests_completed, 32);
}

/// A request large enough (256 MiB through 64 KiB slots, one I/O thread) that it is
/// certainly still running microseconds after submit.
fn big(e: &kvxfer::Engine) -> (Arc<kvxfer::Layout>, Arc<kvxfer::Layout>, Vec<u64>) {
    let c = cfg(64, 8, 2, 16, 8192, 2); // 256 KiB regions, 4 MiB blocks
    let src = e.create_layout(&c, FC, StorageKind::Host).unwrap();
    let dst = e.create_layout(&c, FC, StorageKind::Device).unwrap();
    (src, dst, (0..64).collect())
}

/// The dispatcher hands slots out in turns: a small request submitted behind a large
/// one gets a slot after a chunk or two of the large one, not after the large one's last
/// chunk has a slot (4096 chunks through 32 slots here, so that would be after 99 % of
/// its bytes moved).
#[test]
fn a_small_request_behind_a_large_one_is_not_held_until_the_large_one_is_out() {
    let e = engine();
    let (src, dst, ids) = big(&e);
    let c = cfg(1, 1, 1, 1, 64, 1);
    let (h, d) = (make_layout(&e, &c, FC, StorageKind::Host), make_layout(&e, &c, FC, StorageKind::Device));
    let large = e.submit(&src, &ids, &dst, &ids, &Default::default()).unwrap();
    let small = e.submit(&h, &[0], &d, &[0], &Default::default()).unwrap();
    assert_eq!(small.wait(Some(Duration::from_secs(60))), Status::Ok);
    let moved = e.stats().bytes_host_to_device;
    let total = src.geometry().block_bytes * ids.len() as u64;
    assert!(moved < total / 4, "the small request completed after {moved} of the large one's {total} bytes had moved");
    assert_eq!(large.wait(Some(Duration::from_secs(60))), Status::Ok);
}

/// Requests cancelled while queued stay in the queue until the dispatcher reaches them,
/// but no longer count against `max_inflight`: many more of them than the limit, behind
/// a dispatcher that cannot move, must never make `submit` wait.
#[test]
fn submit_never_blocks_behind_requests_cancelled_while_queued() {
    // The engine's only I/O worker runs this callback and stays in it until released, so
    // the next request's chunks cannot run and the dispatcher waits for a slot.
    static RELEASE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    let e = Arc::new(engine_with(|c| {
        c.io_threads = 1;
        c.max_inflight = 3; // the held request, the long one, and one more
    }));
    let c = cfg(4, 1, 1, 1, 64, 1);
    let (h1, h2) = (make_layout(&e, &c, FC, StorageKind::Host), make_layout(&e, &c, FC, StorageKind::Host));
    let hold = |_: &kvxfer::Request, _| {
        while !RELEASE.load(Ordering::Acquire) {
            std::thread::sleep(Duration::from_millis(1));
        }
    };
    let held = TransferOptions { on_complete: Some(Arc::new(hold)), ..Default::default() };
    let holder = e.submit(&h1, &[0], &h2, &[0], &held).unwrap();
    let (src, dst, ids) = big(&e);
    let running = e.submit(&src, &ids, &dst, &ids, &Default::default()).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let submitter = {
        let (e, h1, h2) = (e.clone(), h1.clone(), h2.clone());
        std::thread::spawn(move || {
            for _ in 0..64 {
                let r = e.submit(&h1, &[1], &h2, &[1], &Default::default()).expect("at most two requests in flight, limit 3");
                r.cancel();
                tx.send(r.wait(Some(Duration::from_secs(30)))).unwrap();
            }
        })
    };
    let seen: Vec<_> = (0..64).map_while(|_| rx.recv_timeout(Duration::from_secs(10)).ok()).collect();
    RELEASE.store(true, Ordering::Release);
    submitter.join().unwrap();
    assert_eq!(seen.len(), 64, "submit {} blocked behind requests cancelled while queued", seen.len());
    assert!(seen.iter().all(|&st| st == Status::Cancelled), "{seen:?}");
    assert_eq!(holder.wait(Some(Duration::from_secs(30))), Status::Ok);
    assert_eq!(running.wait(Some(Duration::from_secs(60))), Status::Ok);
    assert_eq!(e.stats().requests_cancelled, 64);
}

/// Destroying an engine from a callback of *another* engine is an ordinary destroy: it
/// returns once the requests that had started have ended (only an engine's own threads
/// must hand the joining off).
#[test]
fn destroying_an_engine_from_another_engines_callback_waits_for_its_requests() {
    struct Victim {
        engine: std::sync::Mutex<Option<kvxfer::Engine>>,
        request: std::sync::Mutex<Option<Arc<kvxfer::Request>>>,
        seen: std::sync::Mutex<Option<Status>>,
    }
    let victim = Arc::new(Victim { engine: Default::default(), request: Default::default(), seen: Default::default() });
    let b = engine_with(|c| c.io_threads = 1);
    let (src, dst, ids) = big(&b);
    *victim.request.lock().unwrap() = Some(b.submit(&src, &ids, &dst, &ids, &Default::default()).unwrap());
    *victim.engine.lock().unwrap() = Some(b);
    let a = engine();
    let c = cfg(2, 1, 1, 1, 64, 1);
    let (h1, h2) = (make_layout(&a, &c, FC, StorageKind::Host), make_layout(&a, &c, FC, StorageKind::Host));
    let v = victim.clone();
    let destroy_victim = move |_: &kvxfer::Request, _| {
        drop(v.engine.lock().unwrap().take());
        let st = v.request.lock().unwrap().as_ref().map(|r| r.poll());
        *v.seen.lock().unwrap() = st;
    };
    let r = a.submit(&h1, &[0], &h2, &[0], &TransferOptions { on_complete: Some(Arc::new(destroy_victim)), ..Default::default() }).unwrap();
    assert_eq!(r.wait(Some(Duration::from_secs(60))), Status::Ok);
    let seen = *victim.seen.lock().unwrap();
    assert!(matches!(seen, Some(Status::Ok | Status::Cancelled)), "the victim's request was {seen:?} after its engine was destroyed");
}

#[test]
fn cancel_skips_what_has_not_started_and_says_so() {
    let e = engine_with(|c| c.io_threads = 1);
    let (src, dst, ids) = big(&e);
    let running = e.submit(&src, &ids, &dst, &ids, &Default::default()).unwrap();
    let queued = e.submit(&src, &ids, &dst, &ids, &Default::default()).unwrap();
    queued.cancel();
    running.cancel();
    assert_eq!(queued.wait(Some(Duration::from_secs(30))), Status::Cancelled);
    assert_eq!(running.wait(Some(Duration::from_secs(30))), Status::Cancelled);
    assert!(!running.error_message().to_bytes().is_empty());
    let s = e.stats();
    assert_eq!(s.requests_cancelled, 2);
    // Stages were skipped: far fewer than the 2 × 256 MiB were copied.
    assert!(s.bytes_host_to_device < 256 << 20, "{} bytes copied", s.bytes_host_to_device);
    // The engine keeps serving, and cancelling a finished request changes nothing.
    let r = e.submit(&src, &[0], &dst, &[0], &Default::default()).unwrap();
    assert_eq!(r.wait(None), Status::Ok);
    r.cancel();
    assert_eq!(r.poll(), Status::Ok);
    assert_eq!(r.error_message().to_bytes(), b"");
}

#[test]
fn wait_times_out_and_poll_says_pending_while_running() {
    let e = engine_with(|c| c.io_threads = 1);
    let (src, dst, ids) = big(&e);
    let r = e.submit(&src, &ids, &dst, &ids, &Default::default()).unwrap();
    assert_eq!(r.wait(Some(Duration::ZERO)), Status::Timeout);
    assert_eq!(r.poll(), Status::Pending);
    assert_eq!(r.wait(None), Status::Ok);
    assert_eq!(r.poll(), Status::Ok);
}

#[test]
fn admission_limit_says_busy_and_recovers() {
    let e = engine_with(|c| {
        c.io_threads = 1;
        c.max_inflight = 2
    });
    let (src, dst, ids) = big(&e);
    let a = e.submit(&src, &ids, &dst, &ids, &Default::default()).unwrap();
    let b = e.submit(&src, &ids[..1], &dst, &ids[..1], &Default::default()).unwrap();
    let err = e.submit(&src, &ids[..1], &dst, &ids[..1], &Default::default()).unwrap_err();
    assert_eq!(err.status, Status::Busy);
    assert!(err.message.contains("max_inflight"));
    assert_eq!(a.wait(None), Status::Ok);
    assert_eq!(b.wait(None), Status::Ok);
    let c = e.submit(&src, &ids[..1], &dst, &ids[..1], &Default::default()).unwrap();
    assert_eq!(c.wait(None), Status::Ok);
}

#[derive(Default)]
struct Seen {
    calls: AtomicU32,
    status: std::sync::Mutex<Option<Status>>,
}

/// Options whose callback records into `seen`.
fn recording(seen: &Arc<Seen>) -> TransferOptions {
    let seen = seen.clone();
    let on_done = move |_: &kvxfer::Request, status| {
        *seen.status.lock().unwrap() = Some(status);
        seen.calls.fetch_add(1, Ordering::SeqCst);
    };
    TransferOptions { on_complete: Some(Arc::new(on_done)), ..Default::default() }
}

#[test]
fn callback_runs_once_before_wait_returns() {
    let e = engine();
    let c = cfg(8, 2, 2, 16, 64, 2);
    let src = make_layout(&e, &c, FC, StorageKind::Disk);
    let dst = make_layout(&e, &c, FC, StorageKind::Device);
    let seen = Arc::new(Seen::default());
    let r = e.submit(&src, &[0, 1, 2], &dst, &[0, 1, 2], &recording(&seen)).unwrap();
    assert_eq!(r.wait(None), Status::Ok);
    assert_eq!(seen.calls.load(Ordering::SeqCst), 1);
    assert_eq!(*seen.status.lock().unwrap(), Some(Status::Ok));
    // A cancelled request's callback gets the cancelled status, once.
    let slow = engine_with(|c| c.io_threads = 1);
    let (bs, bd, ids) = big(&slow);
    let seen = Arc::new(Seen::default());
    let r = slow.submit(&bs, &ids, &bd, &ids, &recording(&seen)).unwrap();
    r.cancel();
    assert_eq!(r.wait(None), Status::Cancelled);
    assert_eq!(seen.calls.load(Ordering::SeqCst), 1);
    assert_eq!(*seen.status.lock().unwrap(), Some(Status::Cancelled));
}

#[test]
fn destroying_the_engine_with_requests_in_flight_ends_every_request() {
    for round in 0..5 {
        let e = engine_with(|c| c.io_threads = 2);
        let (src, dst, ids) = big(&e);
        let reqs: Vec<_> = (0..6).map(|_| e.submit(&src, &ids, &dst, &ids, &Default::default()).unwrap()).collect();
        // Releasing handles early must not matter either.
        drop(src);
        drop(dst);
        std::thread::sleep(Duration::from_millis(round));
        drop(e);
        // How far the requests got depends on the machine; that each one ended does not.
        for (i, r) in reqs.iter().enumerate() {
            let s = r.poll();
            assert!(s == Status::Ok || s == Status::Cancelled, "round {round} request {i}: {s:?}");
        }
    }
}

/// Requests that cannot have finished when the engine is destroyed end `Cancelled`: the
/// engine's only I/O worker is held in a completion callback until the destroy has begun,
/// so none of six 256 MiB requests behind it can move a byte before then, on any machine.
#[test]
fn destroying_the_engine_cancels_what_could_not_finish() {
    static RELEASE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    let e = Arc::new(engine_with(|c| c.io_threads = 1));
    let c = cfg(2, 1, 1, 1, 64, 1);
    let (h1, h2) = (make_layout(&e, &c, FC, StorageKind::Host), make_layout(&e, &c, FC, StorageKind::Host));
    let hold = |_: &kvxfer::Request, _| {
        while !RELEASE.load(Ordering::Acquire) {
            std::thread::sleep(Duration::from_millis(1));
        }
    };
    let holder = e.submit(&h1, &[0], &h2, &[0], &TransferOptions { on_complete: Some(Arc::new(hold)), ..Default::default() }).unwrap();
    let (src, dst, ids) = big(&e);
    let reqs: Vec<_> = (0..6).map(|_| e.submit(&src, &ids, &dst, &ids, &Default::default()).unwrap()).collect();
    // The worker is released once submits are refused, that is once the destroy has begun.
    let releaser = {
        let (e, h1, h2) = (e.clone(), h1.clone(), h2.clone());
        std::thread::spawn(move || {
            let deadline = std::time::Instant::now() + Duration::from_secs(60);
            while std::time::Instant::now() < deadline {
                match e.submit(&h1, &[1], &h2, &[1], &Default::default()) {
                    Err(err) if err.status == Status::Shutdown => break,
                    _ => std::thread::sleep(Duration::from_millis(1)),
                }
            }
            RELEASE.store(true, Ordering::Release);
        })
    };
    e.shutdown();
    releaser.join().unwrap();
    assert_eq!(holder.poll(), Status::Ok);
    for (i, r) in reqs.iter().enumerate() {
        assert_eq!(r.poll(), Status::Cancelled, "request {i} of six behind a held worker");
    }
}

#[test]
fn a_reopened_file_still_holds_the_data_and_is_never_truncated() {
    let e = engine();
    let c = cfg(6, 3, 2, 5, 7, 2);
    let path = temp_path("reopen");
    let host = make_layout(&e, &c, FC, StorageKind::Host);
    fill(&host, 9);
    {
        let disk = e.create_disk_layout(&c, &path, DiskFlags::CREATE | DiskFlags::KEEP).unwrap();
        let ids: Vec<u64> = (0..6).collect();
        assert_eq!(transfer(&e, &host, &ids, &disk, &ids, &Default::default()), Status::Ok);
    }
    assert!(path.exists(), "KVX_DISK_KEEP keeps the file");
    let size = std::fs::metadata(&path).unwrap().len();
    // A larger geometry does not fit: refused, and the file is left as it was.
    let err = e.create_disk_layout(&cfg(600, 3, 2, 5, 7, 2), &path, DiskFlags::NONE).unwrap_err();
    assert_eq!(err.status, Status::InvalidArg);
    assert!(err.message.contains("KVX_DISK_CREATE"), "{}", err.message);
    assert_eq!(std::fs::metadata(&path).unwrap().len(), size);
    // Reopened without CREATE: the data is there, read through the engine.
    let disk = e.create_disk_layout(&c, &path, DiskFlags::NONE).unwrap();
    let back = make_layout(&e, &c, FC, StorageKind::Device);
    let ids: Vec<u64> = (0..6).collect();
    assert_eq!(transfer(&e, &disk, &ids, &back, &ids, &Default::default()), Status::Ok);
    check(&back, 0, 9, &ids.iter().map(|&b| (b, b)).collect::<Vec<_>>(), 0..3, "reopened");
    drop(disk);
    assert!(path.exists(), "a file kvxfer did not create is never removed");
    std::fs::remove_file(&path).unwrap();
    // A created file without KEEP goes away with its layout.
    let disk = e.create_disk_layout(&c, &path, DiskFlags::CREATE).unwrap();
    assert!(path.exists());
    drop(disk);
    assert!(!path.exists());
    // A missing file without CREATE is an I/O error naming it.
    let err = e.create_disk_layout(&c, &path, DiskFlags::NONE).unwrap_err();
    assert_eq!(err.status, Status::Io);
    assert!(err.message.contains(path.to_str().unwrap()));
}

#[test]
fn a_destroyed_layout_lives_until_its_requests_complete() {
    let e = engine_with(|c| c.io_threads = 1);
    let c = cfg(64, 8, 2, 16, 512, 2);
    let path = temp_path("inuse");
    let src = e.create_layout(&c, FC, StorageKind::Device).unwrap();
    let disk = e.create_disk_layout(&c, &path, DiskFlags::CREATE).unwrap();
    let ids: Vec<u64> = (0..64).collect();
    let r = e.submit(&src, &ids, &disk, &ids, &Default::default()).unwrap();
    drop(disk);
    drop(src);
    assert_eq!(r.wait(None), Status::Ok);
    drop(r);
    assert!(!path.exists(), "the file goes when the last request using it completes");
}

#[test]
fn submit_validates_before_starting_anything() {
    let e = engine();
    let other = engine();
    let c = cfg(4, 3, 2, 4, 8, 2);
    let a = make_layout(&e, &c, FC, StorageKind::Host);
    let b = make_layout(&e, &c, FC, StorageKind::Device);
    let odd = make_layout(&e, &cfg(4, 3, 2, 4, 16, 2), FC, StorageKind::Device);
    let foreign = make_layout(&other, &c, FC, StorageKind::Device);
    let o = |lb, le| TransferOptions { layer_begin: lb, layer_end: le, ..Default::default() };
    let cases: Vec<(Status, kvxfer::Result<Arc<kvxfer::Request>>, &str)> = vec![
        (Status::InvalidArg, e.submit(&a, &[], &b, &[], &o(0, 0)), "num_blocks is 0"),
        (Status::InvalidArg, e.submit(&a, &[0, 1], &b, &[0], &o(0, 0)), "2 source blocks but 1"),
        (Status::OutOfRange, e.submit(&a, &[4], &b, &[0], &o(0, 0)), "source block id 4"),
        (Status::OutOfRange, e.submit(&a, &[0], &b, &[9], &o(0, 0)), "destination block id 9"),
        (Status::InvalidArg, e.submit(&a, &[0, 1], &b, &[2, 2], &o(0, 0)), "appears twice"),
        (Status::InvalidArg, e.submit(&b, &[0, 1], &b, &[1, 2], &o(0, 0)), "both a source and a destination"),
        (Status::Incompatible, e.submit(&a, &[0], &odd, &[0], &o(0, 0)), "geometry differs"),
        (Status::OutOfRange, e.submit(&a, &[0], &b, &[0], &o(0, 4)), "layer_end 4"),
        (Status::InvalidArg, e.submit(&a, &[0], &b, &[0], &o(2, 2)), "empty"),
        (Status::InvalidArg, e.submit(&a, &[0], &b, &[0], &o(3, 0)), "empty"),
        (Status::InvalidArg, e.submit(&a, &[0], &foreign, &[0], &o(0, 0)), "another engine"),
    ];
    for (i, (want, got, text)) in cases.into_iter().enumerate() {
        let err = got.err().unwrap_or_else(|| panic!("case {i} was accepted"));
        assert_eq!(err.status, want, "case {i}: {}", err.message);
        assert!(err.message.contains(text), "case {i}: {:?} lacks {text:?}", err.message);
    }
    assert_eq!(e.stats(), kvxfer::Stats::default(), "nothing started");
}

/// A Rust completion callback that panics costs neither its request's status nor the
/// engine's thread: later requests still complete.
#[test]
fn a_panicking_callback_leaves_the_engine_serving() {
    let e = engine_with(|c| c.io_threads = 1);
    let c = cfg(4, 1, 1, 1, 64, 1);
    let (a, b) = (make_layout(&e, &c, FC, StorageKind::Host), make_layout(&e, &c, FC, StorageKind::Host));
    let panics = TransferOptions { on_complete: Some(Arc::new(|_: &kvxfer::Request, _| panic!("callback bug"))), ..Default::default() };
    for i in 0..4 {
        let r = e.submit(&a, &[i], &b, &[i], &panics).unwrap();
        assert_eq!(r.wait(Some(Duration::from_secs(30))), Status::Ok, "request {i}");
    }
    let r = e.submit(&a, &[0, 1, 2, 3], &b, &[0, 1, 2, 3], &Default::default()).unwrap();
    assert_eq!(r.wait(Some(Duration::from_secs(30))), Status::Ok);
}

/// Requests may be dispatched on the submitting thread, and on the emulated device their
/// copies then finish before `submit` returns; the callback must still run on one of
/// kvxfer's threads (the C contract), never inside the caller's `submit`.
#[test]
fn callbacks_run_on_kvxfer_threads_even_when_submit_did_the_work() {
    let e = engine();
    let c = cfg(8, 2, 2, 16, 64, 2);
    let (host, dev) = (make_layout(&e, &c, FC, StorageKind::Pinned), make_layout(&e, &c, FC, StorageKind::Device));
    let names = Arc::new(std::sync::Mutex::new(Vec::new()));
    let n = names.clone();
    let record = move |_: &kvxfer::Request, _| n.lock().unwrap().push(std::thread::current().name().map(str::to_string));
    let opts = TransferOptions { on_complete: Some(Arc::new(record)), ..Default::default() };
    for i in 0..32u64 {
        let (a, b) = if i % 2 == 0 { (&host, &dev) } else { (&dev, &host) };
        let r = e.submit(a, &[i % 8], b, &[i % 8], &opts).unwrap();
        assert_eq!(r.wait(Some(Duration::from_secs(30))), Status::Ok);
    }
    let names = names.lock().unwrap();
    assert_eq!(names.len(), 32);
    let me = std::thread::current().name().map(str::to_string);
    for n in names.iter() {
        assert!(n != &me && n.as_deref().is_some_and(|n| n.starts_with("kvx-")), "a callback ran on {n:?}");
    }
}

/// Inside its own callback a request is done: `poll` and `wait` report the status the
/// callback was given. Before, `poll` said pending and `wait` waited for the callback it
/// was called from to return, holding the engine's thread (and every request behind
/// it) forever. Waiting there on another request of the same engine is refused with a
/// message; polling it (timeout 0) and waiting on another engine's request are not.
#[test]
fn inside_a_callback_its_request_is_done_and_waits_on_other_requests_are_refused() {
    #[derive(Default)]
    struct Looked {
        own: std::sync::Mutex<Vec<(Status, Status, Status)>>,
        other: std::sync::Mutex<Option<(Status, Status, Status)>>,
    }
    let e = engine_with(|c| c.io_threads = 1);
    let other_engine = engine();
    let c = cfg(4, 1, 1, 1, 64, 1);
    let (a, b) = (make_layout(&e, &c, FC, StorageKind::Host), make_layout(&e, &c, FC, StorageKind::Host));
    let (oa, ob) = (make_layout(&other_engine, &c, FC, StorageKind::Host), make_layout(&other_engine, &c, FC, StorageKind::Host));
    let earlier = e.submit(&a, &[3], &b, &[3], &Default::default()).unwrap();
    let elsewhere = other_engine.submit(&oa, &[0], &ob, &[0], &Default::default()).unwrap();
    let looked = Arc::new(Looked::default());
    let (l, ea, el) = (looked.clone(), earlier.clone(), elsewhere.clone());
    let look = move |r: &kvxfer::Request, st| {
        l.own.lock().unwrap().push((st, r.poll(), r.wait(Some(Duration::from_secs(5)))));
        let refused = ea.wait(Some(Duration::from_secs(5)));
        let polled = ea.wait(Some(Duration::ZERO));
        *l.other.lock().unwrap() = Some((refused, polled, el.wait(Some(Duration::from_secs(30)))));
    };
    let opts = TransferOptions { on_complete: Some(Arc::new(look)), ..Default::default() };
    assert_eq!(earlier.wait(Some(Duration::from_secs(30))), Status::Ok);
    // One that completes, and one cancelled (too large to be done by then).
    let ok = e.submit(&a, &[0, 1], &b, &[0, 1], &opts).unwrap();
    assert_eq!(ok.wait(Some(Duration::from_secs(30))), Status::Ok);
    let (bs, bd, ids) = big(&e);
    let cancelled = e.submit(&bs, &ids, &bd, &ids, &opts).unwrap();
    cancelled.cancel();
    assert_eq!(cancelled.wait(Some(Duration::from_secs(60))), Status::Cancelled);
    let own = looked.own.lock().unwrap().clone();
    assert_eq!(own, [(Status::Ok, Status::Ok, Status::Ok), (Status::Cancelled, Status::Cancelled, Status::Cancelled)]);
    let other = *looked.other.lock().unwrap();
    assert_eq!(
        other,
        Some((Status::InvalidArg, Status::Ok, Status::Ok)),
        "(wait, poll) on another request of the engine, wait on another engine's"
    );
    // The engine's threads were never held: later requests complete.
    assert_eq!(transfer(&e, &bs, &ids, &bd, &ids, &Default::default()), Status::Ok);
    assert_eq!(transfer(&e, &a, &[0, 1, 2, 3], &b, &[0, 1, 2, 3], &Default::default()), Status::Ok);
}

/// A request's status and what its completion did agree, however a cancel races with
/// the end of a checksummed, synced write: `Cancelled` means the blocks were not sealed
/// (they read back as never written), `Ok` means they were (they read back exactly).
/// The cancels are spread over the write's last step, its seal and `fdatasync`, which
/// other dirty pages of the file make long; the statement holds wherever one lands.
#[test]
fn a_cancel_during_a_writes_completion_never_reports_cancelled_for_sealed_blocks() {
    use std::os::unix::fs::FileExt;
    let e = engine();
    let c = cfg(256, 1, 1, 16, 128, 2); // 4 KiB blocks
    let path = temp_path("cancel-seal");
    let disk = e.create_disk_layout(&c, &path, DiskFlags::CREATE | DiskFlags::CHECKSUM | DiskFlags::SYNC).unwrap();
    let (src, back) = (make_layout(&e, &c, FC, StorageKind::Device), make_layout(&e, &c, FC, StorageKind::Device));
    fill(&src, 3);
    let other = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    let dirt = vec![0x5Au8; 64 << 10];
    let (mut cancelled, mut ok) = (0, 0);
    for round in 0..128u64 {
        // Dirty page-cache pages the block's fdatasync must write out (the last blocks,
        // which no round writes through kvxfer).
        for k in 0..4u64 {
            other.write_all_at(&dirt, (128 + 32 * (round % 4) + 8 * k) * 4096).unwrap();
        }
        let r = e.submit(&src, &[round], &disk, &[round], &Default::default()).unwrap();
        let spin = std::time::Instant::now();
        while spin.elapsed() < Duration::from_micros(round % 32 * 40) {
            std::hint::spin_loop();
        }
        r.cancel();
        let st = r.wait(Some(Duration::from_secs(60)));
        let read = e.submit(&disk, &[round], &back, &[round], &Default::default()).unwrap().wait(Some(Duration::from_secs(60)));
        match st {
            Status::Cancelled => {
                cancelled += 1;
                assert_eq!(read, Status::Integrity, "round {round}: a write reported Cancelled, yet its block was sealed");
            }
            Status::Ok => {
                ok += 1;
                assert_eq!(read, Status::Ok, "round {round}: a write reported Ok, yet its block does not read back");
                assert!(read_region(&back, round, 0, 0) == read_region(&src, round, 0, 0), "round {round}: other bytes read back");
            }
            st => panic!("round {round}: {st:?}"),
        }
    }
    eprintln!("{cancelled} writes cancelled, {ok} completed");
}
