//! The engine's completion fd: readable once a request (a transfer, a store put or get)
//! has ended since it was drained and not before, no wake-up lost while many threads
//! submit, and closed with the engine. Its tests hold disk calls (process-wide fault
//! injection) and look at fd numbers, so they run one at a time.

mod common;
use common::*;
use kvxfer::fault::{self, Fault, Site};
use kvxfer::store::{Store, StoreConfig, StoreRequest};
use kvxfer::{DiskFlags, Engine, LayoutKind, Request, Status, StorageKind};
use std::os::fd::RawFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// A hang guard only: every wait here ends as soon as what it waits for happens.
const GUARD: Duration = Duration::from_secs(60);
const FC: LayoutKind = LayoutKind::FullyContiguous;

/// Whether `fd` becomes readable within `timeout`.
fn readable(fd: RawFd, timeout: Duration) -> bool {
    let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd.
    let n = unsafe { libc::poll(&mut p, 1, timeout.as_millis() as i32) };
    n == 1 && p.revents & libc::POLLIN != 0
}

/// Reads the counter (resets it); 0 when it was not readable.
fn drain(fd: RawFd) -> u64 {
    let mut n = 0u64;
    // SAFETY: reads 8 bytes into a live u64.
    let r = unsafe { libc::read(fd, (&mut n as *mut u64).cast(), 8) };
    if r == 8 {
        n
    } else {
        0
    }
}

/// Lets a held disk call go when dropped: a failed assertion unwinds through it before the
/// engine or store it holds up is dropped (which would wait for that call).
struct Release;

impl Drop for Release {
    fn drop(&mut self) {
        fault::clear();
    }
}

fn wait_until_holding() {
    let started = Instant::now();
    while !fault::holding() {
        assert!(started.elapsed() < GUARD, "the held disk call never started");
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn store(e: &Arc<Engine>, capacity: u64) -> Store {
    let dir = temp_dir("completion-store");
    Store::open(e, &dir, &StoreConfig { shards: 2, ..StoreConfig::new(cfg(0, 2, 2, 4, 64, 2), capacity, b"ns") }).unwrap()
}

#[test]
fn the_fd_becomes_readable_when_a_transfer_ends_and_not_before() {
    let _serial = serial();
    let e = engine();
    let fd = e.completion_fd().unwrap();
    assert_eq!(e.completion_fd().unwrap(), fd, "one fd per engine");
    assert!(!readable(fd, Duration::ZERO), "no request has ended yet");
    let c = cfg(4, 2, 2, 4, 64, 2);
    let src = e.create_layout(&c, FC, StorageKind::Host).unwrap();
    fill(&src, 1);
    let disk = e.create_disk_layout(&c, &temp_path("completion-disk"), DiskFlags::CREATE).unwrap();
    fault::inject(Site::DiskWrite, 0, Fault::Hold);
    let _release = Release;
    let r = e.submit(&src, &[0, 1], &disk, &[0, 1], &Default::default()).unwrap();
    wait_until_holding();
    assert!(!readable(fd, Duration::from_millis(50)), "readable while the only request is still running");
    assert_eq!(r.poll(), Status::Pending);
    fault::clear();
    assert!(readable(fd, GUARD), "the transfer ended but the fd never became readable");
    assert_eq!(r.poll(), Status::Ok, "readable only after the final status is set");
    assert_eq!(drain(fd), 1);
    assert!(!readable(fd, Duration::ZERO), "drained");
}

#[test]
fn a_store_put_and_get_make_the_fd_readable_when_they_end() {
    let _serial = serial();
    let e = Arc::new(engine());
    let s = store(&e, 8);
    let fd = e.completion_fd().unwrap();
    let c = cfg(2, 2, 2, 4, 64, 2);
    let src = e.create_layout(&c, FC, StorageKind::Host).unwrap();
    fill(&src, 2);
    let dst = e.create_layout(&c, FC, StorageKind::Host).unwrap();

    fault::inject(Site::DiskWrite, 0, Fault::Hold);
    let release = Release;
    let put = s.put(&src, &[0], &[b"k".as_slice()], &Default::default()).unwrap();
    wait_until_holding();
    assert!(!readable(fd, Duration::from_millis(50)), "readable while the put is still writing");
    drop(release);
    wait_for_end(fd, || put.poll());
    assert_eq!(put.poll(), Status::Ok);

    drain(fd);
    fault::inject(Site::DiskRead, 0, Fault::Hold);
    let release = Release;
    let get = s.get(&[b"k".as_slice()], &dst, &[1], &Default::default()).unwrap();
    wait_until_holding();
    assert!(!readable(fd, Duration::from_millis(50)), "readable while the get is still reading");
    drop(release);
    wait_for_end(fd, || get.poll());
    assert_eq!(get.poll(), Status::Ok);

    // A get of keys not held ends inside the call, with no transfer: the fd says so too.
    drain(fd);
    let miss = s.get(&[b"absent".as_slice()], &dst, &[0], &Default::default()).unwrap();
    assert_eq!(miss.poll(), Status::NotFound);
    assert!(readable(fd, Duration::ZERO), "a get that missed every key ended without making the fd readable");
}

/// The caller's loop: drain, poll; while pending, the fd must become readable again.
fn wait_for_end(fd: RawFd, poll: impl Fn() -> Status) {
    loop {
        drain(fd);
        if poll() != Status::Pending {
            return;
        }
        assert!(readable(fd, GUARD), "pending after the drain, and no end made the fd readable again: a lost wake-up");
    }
}

/// Threads submit transfers, puts and gets while one waiter only ever drains the fd and
/// polls: if any end were not signalled after its status is set, the waiter would find a
/// request pending with the fd never becoming readable again.
#[test]
fn no_wake_up_is_lost_while_many_threads_submit() {
    let _serial = serial();
    let e = Arc::new(engine());
    let s = Arc::new(store(&e, 64));
    let fd = e.completion_fd().unwrap();
    const THREADS: u64 = 4;
    const EACH: u64 = 60;
    let c = cfg(EACH, 2, 2, 4, 64, 2);
    enum Any {
        Transfer(Arc<Request>),
        Store(Arc<StoreRequest>),
    }
    let (tx, rx) = std::sync::mpsc::channel::<Any>();
    let submitters: Vec<_> = (0..THREADS)
        .map(|t| {
            let (e, s, tx) = (e.clone(), s.clone(), tx.clone());
            std::thread::spawn(move || {
                let src = e.create_layout(&c, FC, StorageKind::Host).unwrap();
                fill(&src, t);
                let dst = e.create_layout(&c, FC, StorageKind::Host).unwrap();
                for i in 0..EACH {
                    let key = format!("t{t}-{}", i / 3).into_bytes();
                    let r = match i % 3 {
                        0 => Any::Transfer(e.submit(&src, &[i], &dst, &[i], &Default::default()).unwrap()),
                        1 => Any::Store(s.put(&src, &[i], &[&key], &Default::default()).unwrap()),
                        _ => Any::Store(s.get(&[&key], &dst, &[i], &Default::default()).unwrap()),
                    };
                    tx.send(r).unwrap();
                }
            })
        })
        .collect();
    drop(tx);
    let mut pending: Vec<Any> = Vec::new();
    let mut ended = 0u64;
    let mut open = true;
    while open || !pending.is_empty() {
        drain(fd);
        loop {
            match rx.try_recv() {
                Ok(r) => pending.push(r),
                Err(std::sync::mpsc::TryRecvError::Empty) => break,
                Err(std::sync::mpsc::TryRecvError::Disconnected) => {
                    open = false;
                    break;
                }
            }
        }
        let before = pending.len();
        pending.retain(|r| match r {
            Any::Transfer(r) => r.poll() == Status::Pending,
            Any::Store(r) => r.poll() == Status::Pending,
        });
        ended += (before - pending.len()) as u64;
        if !pending.is_empty() {
            assert!(
                readable(fd, GUARD),
                "{} requests pending after the drain and the fd never became readable: a lost wake-up",
                pending.len()
            );
        } else if open {
            std::thread::yield_now();
        }
    }
    for t in submitters {
        t.join().unwrap();
    }
    assert_eq!(ended, THREADS * EACH);
}

#[test]
fn the_fd_is_closed_with_the_engine() {
    let _serial = serial();
    let e = engine();
    let fd = e.completion_fd().unwrap();
    // SAFETY: F_GETFD reads the fd's flags only.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFD) };
    assert!(flags >= 0 && flags & libc::FD_CLOEXEC != 0, "an open close-on-exec fd");
    e.shutdown();
    // SAFETY: as above; the fd number is not reused meanwhile (this suite's tests run
    // one at a time and make no other fd here).
    let after = unsafe { libc::fcntl(fd, libc::F_GETFD) };
    assert_eq!((after, std::io::Error::last_os_error().raw_os_error()), (-1, Some(libc::EBADF)), "the fd outlived the engine");
    assert_eq!(e.completion_fd().unwrap_err().status, Status::Shutdown);
}
