//! `kvx_set_logger`: once it returns, the callback it replaced never runs again, so a
//! host may free the old `user_data` right after the call.

use kvxfer::ffi::logger::kvx_set_logger;
use kvxfer::ffi::KVX_OK;
use std::ffi::{c_char, c_void};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The logger is process-wide: one test of this file at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[derive(Default)]
struct Probe {
    /// Set right after `kvx_set_logger` replaced this probe's callback.
    retired: AtomicBool,
    calls: AtomicU64,
    /// Calls still running after `retired` was set.
    late: AtomicU64,
}

unsafe extern "C" fn on_log(user_data: *mut c_void, _level: u32, _target: *const c_char, _msg: *const c_char) {
    let p = &*(user_data as *const Probe);
    p.calls.fetch_add(1, Ordering::Relaxed);
    // A real sink takes a moment (a write to a file): stay in the callback for a while.
    let t = Instant::now();
    while t.elapsed() < Duration::from_micros(20) {
        std::hint::spin_loop();
    }
    if p.retired.load(Ordering::Acquire) {
        p.late.fetch_add(1, Ordering::Relaxed);
    }
}

#[test]
fn a_replaced_callback_never_runs_after_set_logger_returns() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let stop = Arc::new(AtomicBool::new(false));
    let loggers: Vec<_> = (0..4)
        .map(|i| {
            let stop = stop.clone();
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    log::warn!(target: "kvxfer::test", "record from thread {i}");
                }
            })
        })
        .collect();
    let probes: Vec<Probe> = (0..100).map(|_| Probe::default()).collect();
    for p in &probes {
        assert_eq!(unsafe { kvx_set_logger(Some(on_log), p as *const Probe as *mut c_void, 5) }, KVX_OK);
        std::thread::sleep(Duration::from_millis(2));
        // Back to the default sink, silenced (max_level 0), then the old user_data is "freed".
        assert_eq!(unsafe { kvx_set_logger(None, std::ptr::null_mut(), 0) }, KVX_OK);
        p.retired.store(true, Ordering::Release);
    }
    std::thread::sleep(Duration::from_millis(5));
    stop.store(true, Ordering::Relaxed);
    loggers.into_iter().for_each(|t| t.join().unwrap());
    let calls: u64 = probes.iter().map(|p| p.calls.load(Ordering::Relaxed)).sum();
    let late: u64 = probes.iter().map(|p| p.late.load(Ordering::Relaxed)).sum();
    assert!(calls > 0, "the callbacks ran");
    assert_eq!(late, 0, "{late} of {calls} callbacks were still running after kvx_set_logger had replaced them");
}

/// The log callback may not swap the logger (it would wait for itself): refused, not a
/// deadlock.
#[test]
fn set_logger_from_inside_the_log_callback_is_refused() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    static SEEN: AtomicU64 = AtomicU64::new(u64::MAX);
    unsafe extern "C" fn swapping(_: *mut c_void, _: u32, _: *const c_char, _: *const c_char) {
        SEEN.store(kvx_set_logger(None, std::ptr::null_mut(), 0) as u64, Ordering::Relaxed);
    }
    assert_eq!(unsafe { kvx_set_logger(Some(swapping), std::ptr::null_mut(), 5) }, KVX_OK);
    log::warn!(target: "kvxfer::test", "one record");
    assert_eq!(unsafe { kvx_set_logger(None, std::ptr::null_mut(), 0) }, KVX_OK);
    assert_eq!(SEEN.load(Ordering::Relaxed), kvxfer::ffi::KVX_ERR_INVALID_ARG as u64);
}
