//! Routes the `log` records of kvxfer to the host: its callback, or stderr filtered by
//! the `KVX_LOG` environment variable (error|warn|info|debug|trace or 1..5; default warn).
//! Installed on first use of the C API; a Rust host keeps its own logger.
//!
//! The callback runs with the sink's read lock held, so `kvx_set_logger`, which takes
//! the write lock, returns only once no thread is still inside the callback it replaces:
//! the host may free the old `user_data` then. A thread already inside the callback
//! neither logs again (its records are dropped) nor swaps the sink (refused), since
//! either would wait on the lock it holds.

use super::boundary::*;
use super::types::*;
use crate::error::{bail, Result};
use log::{Level, LevelFilter, Log, Metadata, Record};
use std::ffi::{c_void, CString};
use std::io::Write;
use std::sync::{OnceLock, RwLock};

#[derive(Clone, Copy)]
struct Sink {
    func: unsafe extern "C" fn(*mut c_void, u32, *const std::ffi::c_char, *const std::ffi::c_char),
    user_data: *mut c_void,
}
// SAFETY: the C contract says the callback may run on any thread with this user_data.
unsafe impl Send for Sink {}
unsafe impl Sync for Sink {}

struct HostLogger {
    sink: RwLock<Option<Sink>>,
}

static LOGGER: HostLogger = HostLogger { sink: RwLock::new(None) };

thread_local! {
    /// This thread is running the host's log callback.
    static IN_CALLBACK: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

fn level_number(l: Level) -> u32 {
    l as u32 // Error = 1 … Trace = 5, as in the C API
}

fn filter_of(n: u32) -> LevelFilter {
    match n {
        0 => LevelFilter::Off,
        1 => LevelFilter::Error,
        2 => LevelFilter::Warn,
        3 => LevelFilter::Info,
        4 => LevelFilter::Debug,
        _ => LevelFilter::Trace,
    }
}

/// `KVX_LOG`'s level; warn when unset or unreadable.
fn env_filter() -> LevelFilter {
    let v = std::env::var("KVX_LOG").unwrap_or_default().to_ascii_lowercase();
    match v.as_str() {
        "off" | "0" => LevelFilter::Off,
        "error" | "1" => LevelFilter::Error,
        "info" | "3" => LevelFilter::Info,
        "debug" | "4" => LevelFilter::Debug,
        "trace" | "5" => LevelFilter::Trace,
        _ => LevelFilter::Warn,
    }
}

impl Log for HostLogger {
    fn enabled(&self, m: &Metadata) -> bool {
        m.target().starts_with("kvxfer")
    }

    fn log(&self, r: &Record) {
        if !self.enabled(r.metadata()) {
            return;
        }
        if IN_CALLBACK.with(|c| c.get()) {
            return;
        }
        let sink = self.sink.read().unwrap_or_else(|e| e.into_inner());
        match *sink {
            Some(s) => {
                let target = CString::new(r.target()).unwrap_or_default();
                let msg = CString::new(r.args().to_string().replace('\0', " ")).unwrap_or_default();
                IN_CALLBACK.with(|c| c.set(true));
                // SAFETY: the host registered this callback for log records; the read
                // lock keeps it current until it returns.
                unsafe { (s.func)(s.user_data, level_number(r.level()), target.as_ptr(), msg.as_ptr()) };
                IN_CALLBACK.with(|c| c.set(false));
            }
            None => {
                let _ = writeln!(std::io::stderr(), "[kvxfer {}] {}", r.level(), r.args());
            }
        }
    }

    fn flush(&self) {}
}

/// Installs the logger once; returns whether kvxfer's logger is the process's logger.
pub fn ensure_installed() -> bool {
    static OURS: OnceLock<bool> = OnceLock::new();
    *OURS.get_or_init(|| {
        let ok = log::set_logger(&LOGGER).is_ok();
        if ok {
            log::set_max_level(env_filter());
        }
        ok
    })
}

fn set(log_fn: kvx_log_fn, user_data: *mut c_void, max_level: u32) -> Result<()> {
    if max_level > 5 {
        bail!(InvalidArg, "max_level {max_level} is not 0 (off) to 5 (trace)");
    }
    if IN_CALLBACK.with(|c| c.get()) {
        bail!(InvalidArg, "kvx_set_logger was called from the log callback; call it from another thread");
    }
    if !ensure_installed() {
        bail!(Unsupported, "the process already has another `log` logger (a Rust host); kvxfer logs through it");
    }
    *LOGGER.sink.write().unwrap_or_else(|e| e.into_inner()) = log_fn.map(|func| Sink { func, user_data });
    log::set_max_level(if log_fn.is_some() { filter_of(max_level) } else { env_filter().min(filter_of(max_level)) });
    Ok(())
}

/// Sends kvxfer's log records at or below `max_level` (1 error … 5 trace; 0 off) to `log_fn`,
/// which runs on any kvxfer thread and must not block. When this returns, the callback
/// it replaced has returned everywhere and is never called again. It must not be called
/// from the log callback (`KVX_ERR_INVALID_ARG`). `log_fn` NULL restores the default:
/// stderr, filtered by the `KVX_LOG` environment variable (default warn) and `max_level`.
#[no_mangle]
pub unsafe extern "C" fn kvx_set_logger(log_fn: kvx_log_fn, user_data: *mut c_void, max_level: u32) -> kvx_status {
    status(|| set(log_fn, user_data, max_level))
}
