//! `kvx_transfer_*` and `kvx_request_*`. A `kvx_request*` is an `Arc<Request>` turned
//! into a raw pointer; the engine holds its own reference until the request completes.

use super::boundary::*;
use super::engine::engine;
use super::handle::{ArcHandle, Handle};
use super::layout::layout;
use super::types::*;
use crate::engine::{Request, TransferOptions};
use crate::error::{bail, Result, Status};
use std::ffi::{c_char, c_void};
use std::sync::Arc;
use std::time::Duration;

impl Versioned for kvx_transfer_options {
    const NAME: &'static str = "kvx_transfer_options";
    const V1_SIZE: usize = std::mem::offset_of!(kvx_transfer_options, wait_event);
    fn defaults() -> Self {
        kvx_transfer_options {
            struct_size: std::mem::size_of::<kvx_transfer_options>() as u32,
            layer_begin: 0,
            layer_end: 0,
            flags: 0,
            on_complete: None,
            user_data: std::ptr::null_mut(),
            wait_event: std::ptr::null_mut(),
        }
    }
}

/// The C callback and its `user_data`, carried to the engine's threads.
struct CCallback {
    func: unsafe extern "C" fn(*mut c_void, *mut kvx_request, kvx_status),
    user_data: *mut c_void,
}
// SAFETY: the C contract says the callback runs on kvxfer's threads with this user_data.
unsafe impl Send for CCallback {}
unsafe impl Sync for CCallback {}

impl CCallback {
    fn call(&self, r: &Request, s: Status) {
        // SAFETY: the caller registered this function for this purpose; the engine holds
        // a reference while it runs, so the handle stays valid.
        unsafe { (self.func)(self.user_data, kvx_request::of(r), s.code()) }
    }
}

/// A caller's transfer options as the engine's: the C callback becomes a completion
/// closure that hands the callback the request's handle (the `Arc`'s pointer, what
/// `kvx_transfer_submit` returned).
pub fn options(o: &kvx_transfer_options) -> Result<TransferOptions> {
    if o.flags & !KVX_XFER_CRITICAL != 0 {
        bail!(InvalidArg, "unknown transfer flags {:#x}; known: KVX_XFER_CRITICAL", o.flags & !KVX_XFER_CRITICAL);
    }
    let on_complete = o.on_complete.map(|func| {
        let cb = CCallback { func, user_data: o.user_data };
        Arc::new(move |r: &Request, s: Status| cb.call(r, s)) as crate::engine::OnComplete
    });
    Ok(TransferOptions {
        layer_begin: o.layer_begin,
        layer_end: o.layer_end,
        on_complete,
        wait_event: o.wait_event as u64,
        critical: o.flags & KVX_XFER_CRITICAL != 0,
    })
}

/// The request behind a handle, borrowed for the duration of a call.
///
/// # Safety
/// A non-NULL `r` must come from `kvx_transfer_submit` and not be released.
unsafe fn request<'a>(r: *const kvx_request) -> crate::error::Result<&'a Request> {
    kvx_request::borrow(r, "request")
}

/// Fills `o` with `struct_size` and the defaults: all layers, no flags, no callback.
/// NULL is ignored.
#[no_mangle]
pub unsafe extern "C" fn kvx_transfer_options_init(o: *mut kvx_transfer_options) {
    if !o.is_null() {
        o.write(kvx_transfer_options::defaults());
    }
}

/// Moves blocks `src_blocks[i]` of `src` to `dst_blocks[i]` of `dst`, i < `num_blocks`,
/// asynchronously. Everything that can be checked is checked before anything starts
/// (counts, ids, duplicate destinations, geometry, layer range). `opts` may be NULL.
/// On success `*out` is the request; free it with `kvx_request_release`.
#[no_mangle]
pub unsafe extern "C" fn kvx_transfer_submit(
    e: *mut kvx_engine,
    src: *const kvx_layout,
    src_blocks: *const u64,
    dst: *const kvx_layout,
    dst_blocks: *const u64,
    num_blocks: usize,
    opts: *const kvx_transfer_options,
    out: *mut *mut kvx_request,
) -> kvx_status {
    guard(
        || {
            let out = Out::new(out, "out")?;
            let engine = engine(e)?;
            let (src, dst) = (layout(src, "src")?, layout(dst, "dst")?);
            let sb = slice(src_blocks, num_blocks, "src_blocks")?;
            let db = slice(dst_blocks, num_blocks, "dst_blocks")?;
            let o = if opts.is_null() { kvx_transfer_options::defaults() } else { read_versioned(opts)? };
            Ok((out, engine.submit(&src, sb, &dst, db, &options(&o)?)?))
        },
        |(o, req)| o.write(kvx_request::into_c(req)),
    )
}

/// Reports a request's final status as this call's result, with its message as the last
/// error when it failed.
fn report(s: Status, r: &Request) -> kvx_status {
    if s != Status::Ok && s != Status::Pending {
        let msg = r.error_message().to_string_lossy();
        set_last_error(if msg.is_empty() { s.name() } else { &msg });
    }
    s.code()
}

/// Waits up to `timeout_ns` (`UINT64_MAX`: forever) and returns the request's final
/// status, or `KVX_ERR_TIMEOUT` if it is still running. 0 polls. From inside a completion
/// callback: the callback's own request returns its status at once; another request of
/// the same engine is `KVX_ERR_INVALID_ARG` unless `timeout_ns` is 0.
#[no_mangle]
pub unsafe extern "C" fn kvx_request_wait(r: *mut kvx_request, timeout_ns: u64) -> kvx_status {
    let mut result = KVX_ERR_INTERNAL;
    let s = guard(
        || {
            let r = request(r)?;
            let t = (timeout_ns != u64::MAX).then(|| Duration::from_nanos(timeout_ns));
            Ok((r, r.try_wait(t)?))
        },
        |(r, st)| {
            result = match st {
                Status::Timeout => {
                    set_last_error(&format!("the request did not complete within {timeout_ns} ns"));
                    KVX_ERR_TIMEOUT
                }
                st => report(st, r),
            }
        },
    );
    if s == KVX_OK {
        result
    } else {
        s
    }
}

/// `KVX_PENDING` until the request completes, then its final status.
#[no_mangle]
pub unsafe extern "C" fn kvx_request_poll(r: *const kvx_request) -> kvx_status {
    let mut result = KVX_ERR_INTERNAL;
    let s = guard(|| request(r).map(|r| (r, r.poll())), |(r, st)| result = report(st, r));
    if s == KVX_OK {
        result
    } else {
        s
    }
}

/// Asks the request to stop: stages not yet started are skipped and its final status is
/// `KVX_ERR_CANCELLED` (unless it already completed or failed). Does not wait; the
/// destination's contents are then unspecified.
#[no_mangle]
pub unsafe extern "C" fn kvx_request_cancel(r: *mut kvx_request) -> kvx_status {
    status(|| {
        // Cancelling may finalise, which needs the Arc.
        kvx_request::clone_arc(r, "request")?.cancel();
        Ok(())
    })
}

/// The failure message of a failed or cancelled request, "" otherwise (never NULL).
/// Valid until `kvx_request_release`.
#[no_mangle]
pub unsafe extern "C" fn kvx_request_error(r: *const kvx_request) -> *const c_char {
    infallible(c"".as_ptr(), || match kvx_request::borrow(r, "request") {
        Ok(r) => r.error_message().as_ptr(),
        Err(_) => c"".as_ptr(),
    })
}

/// Drops the caller's reference; a running transfer still completes (and its callback
/// still runs). NULL is a no-op.
#[no_mangle]
pub unsafe extern "C" fn kvx_request_release(r: *mut kvx_request) {
    if !r.is_null() {
        infallible((), || kvx_request::free(r));
    }
}
