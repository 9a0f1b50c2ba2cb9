//! `kvx_engine_export`, `kvx_blob_*`, `kvx_engine_import` (ABI 1.3): remote layouts.

use super::boundary::*;
use super::engine::engine;
use super::handle::{ArcHandle, BoxHandle, Handle};
use super::layout::layout;
use super::types::*;
use crate::error::bail;
use std::time::Duration;

/// Exports `layouts` (device, pinned or host memory layouts of `engine`) as one blob
/// that another engine — in this process, another one, or on another host — imports
/// with `kvx_engine_import` to reach exactly these layouts (and no other memory of this
/// engine). Moving the bytes to the peer is the caller's business (a socket, a file,
/// the runtime's control plane). Each export is newer than the last: a peer importing
/// it replaces what it imported from this engine before. The layouts stay reachable
/// while they live. `*out` is freed with `kvx_blob_destroy`. `KVX_ERR_UNSUPPORTED` with
/// the reason when NIXL or its UCX plugin is not found at run time. (1.3)
#[no_mangle]
pub unsafe extern "C" fn kvx_engine_export(
    e: *mut kvx_engine,
    layouts: *const *const kvx_layout,
    num_layouts: usize,
    out: *mut *mut kvx_blob,
) -> kvx_status {
    guard(
        || {
            let out = Out::new(out, "out")?;
            let e = engine(e)?;
            if layouts.is_null() {
                bail!(InvalidArg, "layouts is NULL");
            }
            let ls =
                (0..num_layouts).map(|i| layout(*layouts.add(i), &format!("layouts[{i}]"))).collect::<crate::error::Result<Vec<_>>>()?;
            Ok((out, e.export(&ls)?))
        },
        |(o, blob)| o.write(kvx_blob::into_c(blob)),
    )
}

/// The blob's bytes and, in `*len`, their count. Valid until `kvx_blob_destroy`.
/// NULL (and `*len` 0) for a NULL blob.
#[no_mangle]
pub unsafe extern "C" fn kvx_blob_bytes(blob: *const kvx_blob, len: *mut usize) -> *const u8 {
    infallible(std::ptr::null(), || {
        let b = kvx_blob::borrow(blob, "blob").ok();
        if !len.is_null() {
            len.write(b.map_or(0, |b| b.len()));
        }
        b.map_or(std::ptr::null(), |b| b.as_ptr())
    })
}

/// Frees a blob; NULL is a no-op.
#[no_mangle]
pub unsafe extern "C" fn kvx_blob_destroy(blob: *mut kvx_blob) {
    infallible((), || kvx_blob::free(blob))
}

/// Imports a peer's blob (`blob_len` bytes): writes one layout handle per exported
/// layout, in export order, to `layouts[0..*num_layouts]` (at most `capacity`; with
/// `layouts` NULL and `capacity` 0 it only sets `*num_layouts`, after the same checks,
/// and imports nothing).
/// The handles are used in `kvx_transfer_submit` like local ones, with a local memory
/// or disk layout on the other side; each is freed with `kvx_layout_destroy`.
/// `timeout_ms`: how long one transfer with this peer may take before its request ends
/// with `KVX_ERR_REMOTE` (0: 10 000). A transfer that times out or fails also closes
/// the import: later submits with its handles fail with `KVX_ERR_REMOTE` until the
/// peer's blob is imported again. A newer blob of the same peer (or the same blob
/// again) replaces the older import: transfers with the older handles are then
/// refused, and those still running end with `KVX_ERR_REMOTE`. `KVX_ERR_INVALID_ARG`
/// with the reason for a damaged, truncated or foreign blob, one of another ABI major,
/// an older export than the one imported, or this engine's own blob;
/// `KVX_ERR_UNSUPPORTED` without NIXL/UCX; `KVX_ERR_REMOTE` when NIXL fails to load
/// metadata it had accepted on a checking agent, or fails to start (import again). (1.3)
#[no_mangle]
pub unsafe extern "C" fn kvx_engine_import(
    e: *mut kvx_engine,
    blob: *const u8,
    blob_len: usize,
    timeout_ms: u32,
    layouts: *mut *mut kvx_layout,
    capacity: usize,
    num_layouts: *mut usize,
) -> kvx_status {
    guard(
        || {
            let n_out = Out::new(num_layouts, "num_layouts")?;
            let e = engine(e)?;
            if blob.is_null() {
                bail!(InvalidArg, "blob is NULL");
            }
            if layouts.is_null() && capacity != 0 {
                bail!(InvalidArg, "layouts is NULL but capacity is {capacity}");
            }
            let bytes = slice(blob, blob_len, "blob")?;
            // The count query imports nothing: it must not replace an earlier import.
            let count = e.import_count(bytes)?;
            if layouts.is_null() {
                return Ok((n_out, count, None));
            }
            if count > capacity {
                bail!(InvalidArg, "the blob holds {count} layouts but capacity is {capacity}");
            }
            Ok((n_out, count, Some(e.import(bytes, Duration::from_millis(timeout_ms as u64))?)))
        },
        |(n, count, imported)| {
            n.write(count);
            for (i, l) in imported.into_iter().flatten().enumerate() {
                layouts.add(i).write(kvx_layout::into_c(l));
            }
        },
    )
}
