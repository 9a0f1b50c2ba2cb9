//! `kvx_transfer_*` and `kvx_request_*`. A `kvx_request*` is an `Arc<Request>` turned
//! into a raw pointer; the engine holds its own reference until the request completes.

use super::boundary::*;
use super::engine::engine;
use super::layout::layout;
use super::types::*;
use crate::engine::{Callback, CompletionFn, Request, TransferOptions};
use crate::error::Status;
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

/// The request behind a handle, borrowed for the duration of a call.
///
/// # Safety
/// A non-NULL `r` must come from `kvx_transfer_submit` and not be released.
unsafe fn request<'a>(r: *const kvx_request) -> crate::error::Result<&'a Request> {
    non_null(r as *const Request, "request")
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
            let on_complete = o.on_complete.map(|f| Callback {
                // SAFETY: same ABI; only the pointee type of the request argument differs.
                func: std::mem::transmute::<unsafe extern "C" fn(*mut c_void, *mut kvx_request, kvx_status), CompletionFn>(f),
                user_data: o.user_data,
            });
            let opts = TransferOptions {
                layer_begin: o.layer_begin,
                layer_end: o.layer_end,
                flags: o.flags,
                on_complete,
                wait_event: o.wait_event as u64,
            };
            Ok((out, engine.submit(&src, sb, &dst, db, &opts)?))
        },
        |(o, req)| o.write(Arc::into_raw(req) as *mut kvx_request),
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
/// status, or `KVX_ERR_TIMEOUT` if it is still running. 0 polls.
#[no_mangle]
pub unsafe extern "C" fn kvx_request_wait(r: *mut kvx_request, timeout_ns: u64) -> kvx_status {
    let mut result = KVX_ERR_INTERNAL;
    let s = guard(
        || {
            let r = request(r)?;
            let t = (timeout_ns != u64::MAX).then(|| Duration::from_nanos(timeout_ns));
            Ok((r, r.wait(t)))
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
    if s == KVX_OK { result } else { s }
}

/// `KVX_PENDING` until the request completes, then its final status.
#[no_mangle]
pub unsafe extern "C" fn kvx_request_poll(r: *const kvx_request) -> kvx_status {
    let mut result = KVX_ERR_INTERNAL;
    let s = guard(|| request(r).map(|r| (r, r.poll())), |(r, st)| result = report(st, r));
    if s == KVX_OK { result } else { s }
}

/// Asks the request to stop: stages not yet started are skipped and its final status is
/// `KVX_ERR_CANCELLED` (unless it already completed or failed). Does not wait; the
/// destination's contents are then unspecified.
#[no_mangle]
pub unsafe extern "C" fn kvx_request_cancel(r: *mut kvx_request) -> kvx_status {
    status(|| {
        let r = request(r)?;
        // The handle is an Arc's pointer; cancelling may finalise, which needs the Arc.
        let arc = std::mem::ManuallyDrop::new(Arc::from_raw(r as *const Request));
        arc.cancel();
        Ok(())
    })
}

/// The failure message of a failed or cancelled request, "" otherwise (never NULL).
/// Valid until `kvx_request_release`.
#[no_mangle]
pub unsafe extern "C" fn kvx_request_error(r: *const kvx_request) -> *const c_char {
    infallible(c"".as_ptr(), || match (r as *const Request).as_ref() {
        Some(r) => r.error_message().as_ptr(),
        None => c"".as_ptr(),
    })
}

/// Drops the caller's reference; a running transfer still completes (and its callback
/// still runs). NULL is a no-op.
#[no_mangle]
pub unsafe extern "C" fn kvx_request_release(r: *mut kvx_request) {
    if !r.is_null() {
        infallible((), || drop(Arc::from_raw(r as *const Request)));
    }
}

