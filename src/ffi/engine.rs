//! `kvx_engine_*` and `kvx_engine_stats`.

use super::boundary::*;
use super::convert;
use super::handle::{ArcHandle, Handle};
use super::types::*;
use crate::engine::Engine;
use std::sync::Arc;

impl Versioned for kvx_engine_config {
    const NAME: &'static str = "kvx_engine_config";
    const V1_SIZE: usize = std::mem::size_of::<kvx_engine_config>();
    fn defaults() -> Self {
        kvx_engine_config {
            struct_size: std::mem::size_of::<kvx_engine_config>() as u32,
            device: KVX_DEVICE_AUTO,
            io_threads: 0,
            io_backend: KVX_IO_AUTO,
            bounce_bytes: 0,
            slot_bytes: 0,
            max_inflight: 0,
            flags: 0,
        }
    }
}

impl Versioned for kvx_stats {
    const NAME: &'static str = "kvx_stats";
    const V1_SIZE: usize = std::mem::offset_of!(kvx_stats, disk_read_ns);
    fn defaults() -> Self {
        kvx_stats {
            struct_size: std::mem::size_of::<kvx_stats>() as u32,
            requests_completed: 0,
            requests_failed: 0,
            requests_cancelled: 0,
            bytes_disk_read: 0,
            bytes_disk_written: 0,
            bytes_host_to_device: 0,
            bytes_device_to_host: 0,
            disk_read_ns: 0,
            disk_write_ns: 0,
            host_copy_ns: 0,
            device_copy_ns: 0,
            slot_wait_ns: 0,
            slots_quarantined: 0,
        }
    }
}

/// The engine behind a handle.
///
/// # Safety
/// A non-NULL `e` must come from `kvx_engine_create` and not be destroyed.
pub(crate) unsafe fn engine<'a>(e: *const kvx_engine) -> crate::error::Result<&'a Engine> {
    kvx_engine::borrow(e, "engine")
}

/// Fills `cfg` with `struct_size` and the defaults (automatic device, default sizes).
/// NULL is ignored.
#[no_mangle]
pub unsafe extern "C" fn kvx_engine_config_init(cfg: *mut kvx_engine_config) {
    if !cfg.is_null() {
        cfg.write(kvx_engine_config::defaults());
    }
}

/// Starts an engine: resolves the device, allocates the pinned bounce ring and starts its
/// threads. `cfg` may be NULL for defaults. On success `*out` owns the engine; free it
/// with `kvx_engine_destroy`.
#[no_mangle]
pub unsafe extern "C" fn kvx_engine_create(cfg: *const kvx_engine_config, out: *mut *mut kvx_engine) -> kvx_status {
    guard(
        || {
            let out = Out::new(out, "out")?;
            let c = if cfg.is_null() { kvx_engine_config::defaults() } else { read_versioned(cfg)? };
            super::logger::ensure_installed();
            let engine = Engine::new(&convert::engine_config(&c)?)?;
            Ok((out, engine))
        },
        |(out, engine)| out.write(kvx_engine::into_c(Arc::new(engine))),
    )
}

/// Cancels requests that have not started, waits for those that have, joins the threads
/// and frees the engine. Layouts and requests made from it must not be used afterwards,
/// except that they may still be destroyed/released. NULL is a no-op. Should not be
/// called from one of this engine's own completion callbacks: there it cannot wait for
/// its threads, so it returns at once and the shutdown finishes in the background.
/// Close the engine's stores first: a store still open keeps the engine's memory until
/// `kvx_store_close`, its puts and gets in flight end (cancelled where they had not
/// started), and every later call on it but `kvx_store_close` is `KVX_ERR_SHUTDOWN`.
#[no_mangle]
pub unsafe extern "C" fn kvx_engine_destroy(e: *mut kvx_engine) {
    if !e.is_null() {
        infallible((), || {
            if let Ok(engine) = kvx_engine::borrow(e, "engine") {
                engine.shutdown();
            }
            kvx_engine::free(e)
        });
    }
}

/// The device the engine resolved: a CUDA ordinal, or -1 for the emulated device.
#[no_mangle]
pub unsafe extern "C" fn kvx_engine_device(e: *const kvx_engine, device_out: *mut i32) -> kvx_status {
    guard(|| Ok((Out::new(device_out, "device_out")?, convert::device_code(engine(e)?.device()))), |(o, d)| o.write(d))
}

/// ABI 1.1. The disk I/O backend the engine uses: `KVX_IO_POSIX`, `KVX_IO_URING`,
/// `KVX_IO_NIXL` or `KVX_IO_GDS` (`KVX_IO_AUTO` resolves to one of them; the log says
/// which and why the others were not taken).
#[no_mangle]
pub unsafe extern "C" fn kvx_engine_io_backend(e: *const kvx_engine, backend_out: *mut u32) -> kvx_status {
    guard(|| Ok((Out::new(backend_out, "backend_out")?, convert::io_backend_code(engine(e)?.io_backend()))), |(o, b)| o.write(b))
}

/// ABI 1.1. The settings the engine runs with, defaults filled in and `io_backend`
/// resolved (what `KVX_IO_AUTO` chose), so a caller can size its own work (a benchmark's
/// baselines, say) to match. Set `out->struct_size` first (to `sizeof(kvx_engine_config)`).
#[no_mangle]
pub unsafe extern "C" fn kvx_engine_config_get(e: *const kvx_engine, out: *mut kvx_engine_config) -> kvx_status {
    status(|| write_versioned(out, convert::engine_config_c(engine(e)?.config())))
}

/// Copies the engine's counters into `*out`. Set `out->struct_size` first (to
/// `sizeof(kvx_stats)`); fields beyond it are not written.
#[no_mangle]
pub unsafe extern "C" fn kvx_engine_stats(e: *const kvx_engine, out: *mut kvx_stats) -> kvx_status {
    status(|| {
        let s = engine(e)?.stats();
        write_versioned(
            out,
            kvx_stats {
                struct_size: 0,
                requests_completed: s.requests_completed,
                requests_failed: s.requests_failed,
                requests_cancelled: s.requests_cancelled,
                bytes_disk_read: s.bytes_disk_read,
                bytes_disk_written: s.bytes_disk_written,
                bytes_host_to_device: s.bytes_host_to_device,
                bytes_device_to_host: s.bytes_device_to_host,
                disk_read_ns: s.disk_read_ns,
                disk_write_ns: s.disk_write_ns,
                host_copy_ns: s.host_copy_ns,
                device_copy_ns: s.device_copy_ns,
                slot_wait_ns: s.slot_wait_ns,
                slots_quarantined: s.slots_quarantined,
            },
        )
    })
}

/// (1.5) The engine's completion fd: an eventfd (non-blocking, close-on-exec) that
/// becomes readable once a request of this engine has ended since it was last read — a
/// transfer, or a put, get, slot read or slot write of a store on this engine. For a
/// caller that waits on many things at once (poll, epoll, an event loop): when it is
/// readable, read 8 bytes from it (the count of ends, which resets it), then poll the
/// requests it waits for. A request ends (its status is final) before it makes the fd
/// readable, so one that ends after the read makes it readable again: no end is missed.
/// The fd is made by the first call, and ends before that are not counted: poll the
/// requests submitted before it once. Each call returns the same fd.
/// The engine owns it: do not close it; `kvx_engine_destroy` closes it (unregister it
/// from your poller first). `KVX_ERR_SHUTDOWN` once the engine is shutting down.
#[no_mangle]
pub unsafe extern "C" fn kvx_engine_completion_fd(e: *const kvx_engine, fd_out: *mut i32) -> kvx_status {
    guard(|| Ok((Out::new(fd_out, "fd_out")?, engine(e)?.completion_fd()?)), |(o, fd)| o.write(fd))
}
