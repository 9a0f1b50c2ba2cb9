//! `kvx_store_*_slots` (ABI 1.5): slot handles through the C ABI, for runtimes whose
//! scheduler owns a store and whose data movers, in other processes, open it
//! `KVX_STORE_DATA_ONLY` (`crate::store`'s `SlotHandle`, `docs/store.md`).

use super::boundary::*;
use super::layout::layout;
use super::store::{keys, publish, store, store_options};
use super::types::*;
use crate::error::Result;
use crate::store::{Reservation, SlotHandle};

impl From<SlotHandle> for kvx_slot_handle {
    fn from(h: SlotHandle) -> Self {
        kvx_slot_handle {
            key_digest: h.key_digest.to_le_bytes(),
            generation: h.generation,
            seal: h.seal,
            epoch: h.epoch,
            slot: h.slot,
            key_len: h.key_len,
        }
    }
}

impl From<kvx_slot_handle> for SlotHandle {
    fn from(h: kvx_slot_handle) -> Self {
        SlotHandle {
            slot: h.slot,
            generation: h.generation,
            key_digest: u128::from_le_bytes(h.key_digest),
            key_len: h.key_len,
            seal: h.seal,
            epoch: h.epoch,
        }
    }
}

/// The handles of a call, copied.
///
/// # Safety
/// A non-NULL `p` must point to `n` handles.
unsafe fn slot_handles(p: *const kvx_slot_handle, n: usize) -> Result<Vec<SlotHandle>> {
    Ok(slice(p, n, "handles")?.iter().map(|&h| h.into()).collect())
}

/// As `kvx_store_lookup` with `KVX_LOOKUP_LEASE`, for a data-only process: where the
/// store holds `keys[i]`, i < `n`, `present_out[i]` is 1 and `handles_out[i]` the handle to
/// read it with (`kvx_store_read_slots` in any process); else 0 and a zeroed handle. Each
/// hit stays leased (neither evicted nor its slot reused) until
/// `kvx_store_release_leases`. Owner only. `handles_out` and `present_out` hold `n`
/// elements, written only on `KVX_OK`.
#[no_mangle]
pub unsafe extern "C" fn kvx_store_lease_slots(
    s: *mut kvx_store,
    ks: *const kvx_key,
    n: usize,
    handles_out: *mut kvx_slot_handle,
    present_out: *mut u8,
) -> kvx_status {
    guard(
        || {
            let store = store(s)?;
            let keys = keys(ks, n)?;
            non_null(handles_out, "handles_out")?;
            non_null(present_out, "present_out")?;
            store.lease_slots(&keys)
        },
        |found| {
            // SAFETY: both checked non-NULL, with room for `n` elements, one per key.
            unsafe {
                write_all(present_out, found.iter().map(|h| h.is_some() as u8));
                write_all(handles_out, found.into_iter().map(|h| h.map(Into::into).unwrap_or_default()));
            }
        },
    )
}

/// Reserves a slot for each of `keys[i]`, i < `n`, not held, as a put would (evicting the
/// least recently used entry nothing holds), for a data-only process to write with
/// `kvx_store_write_slots`; `kvx_store_commit_slots` then makes them entries, or
/// `kvx_store_abort_slots` gives them back. `reservations_out[i]` is `KVX_RESERVED_WRITE`
/// (and `handles_out[i]` the handle to write with), `KVX_RESERVED_HELD`,
/// `KVX_RESERVED_IN_FLIGHT` or `KVX_RESERVED_NO_ROOM` (a zeroed handle for these). A
/// reservation neither committed nor aborted keeps its slot until the owner reopens the
/// store. Owner only. `handles_out` and `reservations_out` hold `n` elements, written
/// only on `KVX_OK`.
#[no_mangle]
pub unsafe extern "C" fn kvx_store_reserve_slots(
    s: *mut kvx_store,
    ks: *const kvx_key,
    n: usize,
    handles_out: *mut kvx_slot_handle,
    reservations_out: *mut u32,
) -> kvx_status {
    guard(
        || {
            let store = store(s)?;
            let keys = keys(ks, n)?;
            non_null(handles_out, "handles_out")?;
            non_null(reservations_out, "reservations_out")?;
            store.reserve_slots(&keys)
        },
        |reserved| {
            let kind = |r: &Reservation| match r {
                Reservation::Write(_) => KVX_RESERVED_WRITE,
                Reservation::Held => KVX_RESERVED_HELD,
                Reservation::InFlight => KVX_RESERVED_IN_FLIGHT,
                Reservation::NoRoom => KVX_RESERVED_NO_ROOM,
            };
            let handle = |r: Reservation| match r {
                Reservation::Write(h) => h.into(),
                _ => kvx_slot_handle::default(),
            };
            // SAFETY: both checked non-NULL, with room for `n` elements, one per key.
            unsafe {
                write_all(reservations_out, reserved.iter().map(kind));
                write_all(handles_out, reserved.into_iter().map(handle));
            }
        },
    )
}

/// Makes the slots of write handles `handles[i]`, i < `n`, entries once their writes
/// completed: `statuses_out[i]` is `KVX_OK`; `KVX_ERR_INVALID_ARG` for a handle this open
/// did not reserve (already committed or aborted, from an earlier open of the store, or
/// never handed out); `KVX_ERR_INTEGRITY` for a block not completely written through this
/// handle (its write did not finish, or another write of the slot landed on it: never an
/// entry over other bytes); `KVX_ERR_CANCELLED` for a key removed meanwhile. Owner only.
/// In a `KVX_STORE_DURABLE` store the blocks' data files are synced before their records
/// are written, whether or not the data process opened the store durable.
/// A handle of a slot past the capacity is `KVX_ERR_OUT_OF_RANGE` for the call.
/// `statuses_out` holds `n` statuses, written only on `KVX_OK`.
#[no_mangle]
pub unsafe extern "C" fn kvx_store_commit_slots(
    s: *mut kvx_store,
    handles: *const kvx_slot_handle,
    n: usize,
    statuses_out: *mut kvx_status,
) -> kvx_status {
    guard(
        || {
            let store = store(s)?;
            let handles = slot_handles(handles, n)?;
            non_null(statuses_out, "statuses_out")?;
            store.commit_slots(&handles)
        },
        // SAFETY: checked non-NULL, with room for `n` statuses, one per handle.
        |statuses| unsafe { write_all(statuses_out, statuses.into_iter().map(|st| st.code())) },
    )
}

/// Gives back the reserved slots of write handles `handles[i]`, i < `n`, unwritten (a
/// handle not reserved is skipped; one naming a slot past the capacity fails the call,
/// `KVX_ERR_OUT_OF_RANGE`, before any is given back). A write of one still in flight
/// cannot be committed under the key its slot goes to next. Owner only.
#[no_mangle]
pub unsafe extern "C" fn kvx_store_abort_slots(s: *mut kvx_store, handles: *const kvx_slot_handle, n: usize) -> kvx_status {
    status(|| store(s)?.abort_slots(&slot_handles(handles, n)?))
}

/// Loads the slots of read handles `handles[i]`, i < `n`, into block `dst_ids[i]` of
/// `dst`, asynchronously (in a data-only open, or the owner's). Per key: `KVX_OK`, or
/// `KVX_ERR_INTEGRITY` where the slot no longer holds the entry the handle names, or its
/// block fails its checksums (a miss); else the transfer's status. `opts` and `dst` as for
/// `kvx_store_get`. A handle of a slot past the capacity is `KVX_ERR_OUT_OF_RANGE`. On
/// success `*out_request` is the request; free it with `kvx_store_request_release`.
#[no_mangle]
pub unsafe extern "C" fn kvx_store_read_slots(
    s: *mut kvx_store,
    handles: *const kvx_slot_handle,
    n: usize,
    dst: *const kvx_layout,
    dst_ids: *const u64,
    opts: *const kvx_transfer_options,
    out_request: *mut *mut kvx_store_request,
) -> kvx_status {
    guard(
        || {
            let out = Out::new(out_request, "out_request")?;
            let store = store(s)?;
            let handles = slot_handles(handles, n)?;
            let dst = layout(dst, "dst")?;
            let ids = slice(dst_ids, n, "dst_ids")?;
            Ok((out, store.read_slots(&handles, &dst, ids, &store_options(opts)?)?))
        },
        |(o, r)| publish(o, r),
    )
}

/// Writes block `src_ids[i]` of `src` to the slot of write handle `handles[i]`, i < `n`,
/// asynchronously; the owner then commits (or aborts) the handles. Whole blocks only; a
/// handle is written once. Per key: `KVX_OK` once its block is written and sealed, else the
/// transfer's status. `opts` and `src` as for `kvx_store_put`. A handle of a slot past
/// the capacity is `KVX_ERR_OUT_OF_RANGE`; one that is no write handle (zeroed, as
/// `kvx_store_reserve_slots` leaves those of keys it gave no slot, or a read handle)
/// `KVX_ERR_INVALID_ARG`, and nothing is written. On success `*out_request` is the request; free
/// it with `kvx_store_request_release`.
#[no_mangle]
pub unsafe extern "C" fn kvx_store_write_slots(
    s: *mut kvx_store,
    src: *const kvx_layout,
    src_ids: *const u64,
    handles: *const kvx_slot_handle,
    n: usize,
    opts: *const kvx_transfer_options,
    out_request: *mut *mut kvx_store_request,
) -> kvx_status {
    guard(
        || {
            let out = Out::new(out_request, "out_request")?;
            let store = store(s)?;
            let src = layout(src, "src")?;
            let ids = slice(src_ids, n, "src_ids")?;
            let handles = slot_handles(handles, n)?;
            Ok((out, store.write_slots(&src, ids, &handles, &store_options(opts)?)?))
        },
        |(o, r)| publish(o, r),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_handle_is_48_bytes_and_round_trips() {
        assert_eq!(std::mem::size_of::<kvx_slot_handle>(), 48);
        let h = SlotHandle { slot: 7, generation: 9, key_digest: 3 << 100 | 5, key_len: 12, seal: 0xfeed, epoch: 0xabcd };
        assert_eq!(SlotHandle::from(kvx_slot_handle::from(h)), h);
    }
}
