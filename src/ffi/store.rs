//! `kvx_store_*` and `kvx_store_request_*` (ABI 1.4): the store (`crate::store`) through
//! the C ABI. A `kvx_store*` owns its `Store` and a reference to its engine; a
//! `kvx_store_request*` owns one reference to a `StoreRequest` (the store holds others
//! until every key is settled) and the key messages C reads once it is done.

use super::boundary::*;
use super::handle::{ArcHandle, BoxHandle, Handle};
use super::layout::layout;
use super::transfer::options;
use super::types::*;
use crate::engine::{Engine, TransferOptions};
use crate::error::{bail, Error, Result, Status};
use crate::layout::LayoutConfig;
use crate::shared::{Location, S3Location, SharedConfig, WriteMode};
use crate::store::{Lease, Store, StoreConfig, StoreFlags, StoreRequest, MAX_KEY_BYTES};
use std::ffi::{c_char, CStr, CString, OsStr};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

/// What a `kvx_store*` stands for: the store and the engine it moves blocks with.
pub struct StoreHandle {
    store: Store,
    engine: Arc<Engine>,
}

impl StoreHandle {
    /// The store, unless its engine was destroyed (then every call but close is refused).
    fn live(&self) -> Result<&Store> {
        if self.engine.is_shut_down() {
            bail!(Shutdown, "the engine of the store in {} was destroyed; close the store (kvx_store_close)", self.store.dir().display());
        }
        Ok(&self.store)
    }
}

/// What a `kvx_store_request*` stands for: the request and, once it is done, its keys'
/// messages as C strings (valid until the handle is released).
pub struct StoreCall {
    req: Arc<StoreRequest>,
    messages: OnceLock<Messages>,
}

struct Messages {
    /// The first failed key's message, naming the key's index ("" when every key is Ok).
    first: CString,
    keys: Vec<CString>,
}

fn c_string(s: String) -> CString {
    CString::new(s.replace('\0', " ")).unwrap_or_default()
}

impl StoreCall {
    /// The keys' messages once every key has its status; `None` before.
    fn messages(&self) -> Option<&Messages> {
        if let Some(m) = self.messages.get() {
            return Some(m);
        }
        if self.req.poll() == Status::Pending {
            return None;
        }
        let n = self.req.len();
        let keys: Vec<CString> = (0..n).map(|i| c_string(self.req.key_message(i))).collect();
        let first = (0..n)
            .find(|&i| self.req.key_status(i) != Some(Status::Ok))
            .map_or_else(CString::default, |i| c_string(format!("key {i}: {}", self.req.key_message(i))));
        Some(self.messages.get_or_init(|| Messages { first, keys }))
    }
}

impl Versioned for kvx_store_config {
    const NAME: &'static str = "kvx_store_config";
    const V1_SIZE: usize = std::mem::offset_of!(kvx_store_config, shared);
    fn defaults() -> Self {
        kvx_store_config {
            struct_size: std::mem::size_of::<kvx_store_config>() as u32,
            flags: KVX_STORE_CREATE,
            block: std::ptr::null(),
            capacity_blocks: 0,
            namespace_bytes: std::ptr::null(),
            namespace_len: 0,
            shards: 1,
            shared: std::ptr::null(),
        }
    }
}

impl Versioned for kvx_shared_config {
    const NAME: &'static str = "kvx_shared_config";
    const V1_SIZE: usize = std::mem::size_of::<kvx_shared_config>();
    fn defaults() -> Self {
        kvx_shared_config {
            struct_size: std::mem::size_of::<kvx_shared_config>() as u32,
            kind: 0,
            path: std::ptr::null(),
            capacity_bytes: 0,
            endpoint: std::ptr::null(),
            region: std::ptr::null(),
            bucket: std::ptr::null(),
            prefix: std::ptr::null(),
            threads: 0,
            timeout_ms: 0,
            flags: 0,
            pending_puts: 0,
        }
    }
}

impl Versioned for kvx_store_counters {
    const NAME: &'static str = "kvx_store_counters";
    const V1_SIZE: usize = std::mem::offset_of!(kvx_store_counters, shared_hits);
    fn defaults() -> Self {
        kvx_store_counters {
            struct_size: std::mem::size_of::<kvx_store_counters>() as u32,
            entries: 0,
            capacity: 0,
            hits: 0,
            misses: 0,
            evictions: 0,
            integrity_failures: 0,
            puts: 0,
            dedups: 0,
            removes: 0,
            bytes: 0,
            shared_hits: 0,
            shared_misses: 0,
            shared_integrity_failures: 0,
            shared_timeouts: 0,
            shared_errors: 0,
            shared_puts: 0,
            shared_puts_dropped: 0,
            shared_requests: 0,
        }
    }
}

const STORE_FLAGS: [(u32, StoreFlags); 5] = [
    (KVX_STORE_CREATE, StoreFlags::CREATE),
    (KVX_STORE_DURABLE, StoreFlags::DURABLE),
    (KVX_STORE_BUFFERED, StoreFlags::BUFFERED),
    (KVX_STORE_VERIFY_ON_OPEN, StoreFlags::VERIFY_ON_OPEN),
    (KVX_STORE_DATA_ONLY, StoreFlags::DATA_ONLY),
];

fn store_flags(bits: u32) -> Result<StoreFlags> {
    let mut flags = StoreFlags::NONE;
    let mut left = bits;
    for &(c, f) in &STORE_FLAGS {
        if bits & c != 0 {
            flags = flags | f;
            left &= !c;
        }
    }
    if left != 0 {
        bail!(InvalidArg, "unknown store flags {left:#x}; known: KVX_STORE_CREATE|DURABLE|BUFFERED|VERIFY_ON_OPEN|DATA_ONLY");
    }
    Ok(flags)
}

/// The bytes of an optional C string: NULL is empty.
///
/// # Safety
/// A non-NULL `p` must point to a NUL-terminated string.
unsafe fn c_bytes<'a>(p: *const c_char) -> &'a [u8] {
    if p.is_null() {
        &[]
    } else {
        CStr::from_ptr(p).to_bytes()
    }
}

/// An optional C string that must be UTF-8 (a URL, a region, a bucket, a prefix).
///
/// # Safety
/// As `c_bytes`.
unsafe fn c_text(p: *const c_char, name: &str) -> Result<String> {
    match std::str::from_utf8(c_bytes(p)) {
        Ok(s) => Ok(s.to_string()),
        Err(e) => bail!(InvalidArg, "kvx_shared_config.{name} is not UTF-8 ({e}); pass it as UTF-8"),
    }
}

const SHARED_FLAGS: u32 = KVX_SHARED_WRITE_THROUGH | KVX_SHARED_NO_ADMIT;

/// A caller's shared tier config, its kind, flags and strings checked (the rest is the
/// tier's, at open).
///
/// # Safety
/// As `read_versioned`; its strings as their fields say.
unsafe fn shared_config(p: *const kvx_shared_config) -> Result<SharedConfig> {
    let c = read_versioned(p)?;
    let location = match c.kind {
        KVX_SHARED_DIR => Location::Dir { path: PathBuf::from(OsStr::from_bytes(c_bytes(c.path))), capacity_bytes: c.capacity_bytes },
        KVX_SHARED_S3 => Location::S3(S3Location {
            endpoint: c_text(c.endpoint, "endpoint")?,
            region: c_text(c.region, "region")?,
            bucket: c_text(c.bucket, "bucket")?,
            prefix: c_text(c.prefix, "prefix")?,
        }),
        k => bail!(InvalidArg, "kvx_shared_config.kind is {k}; set it to KVX_SHARED_DIR (1) or KVX_SHARED_S3 (2)"),
    };
    if c.flags & !SHARED_FLAGS != 0 {
        bail!(InvalidArg, "unknown kvx_shared_config.flags {:#x}; known: KVX_SHARED_WRITE_THROUGH|NO_ADMIT", c.flags & !SHARED_FLAGS);
    }
    Ok(SharedConfig {
        threads: c.threads,
        timeout: Duration::from_millis(c.timeout_ms as u64),
        write: if c.flags & KVX_SHARED_WRITE_THROUGH != 0 { WriteMode::Through } else { WriteMode::Behind },
        admit: c.flags & KVX_SHARED_NO_ADMIT == 0,
        pending_puts: c.pending_puts,
        ..SharedConfig::new(location)
    })
}

/// A caller's store config, every pointer and code checked (the rest is `Store::open`'s).
///
/// # Safety
/// As `read_versioned`; `block`, `namespace_bytes` and `shared` as their fields say.
unsafe fn store_config(cfg: *const kvx_store_config) -> Result<StoreConfig> {
    let c = read_versioned(cfg)?;
    let b = read_versioned(c.block).map_err(|e| Error::new(e.status, format!("kvx_store_config.block: {}", e.message)))?;
    let block = LayoutConfig {
        num_blocks: c.capacity_blocks,
        num_layers: b.num_layers,
        outer_dim: b.outer_dim,
        page_size: b.page_size,
        inner_dim: b.inner_dim,
        dtype_bytes: b.dtype_bytes,
    };
    let ns = slice(c.namespace_bytes, c.namespace_len as usize, "kvx_store_config.namespace_bytes")?;
    Ok(StoreConfig {
        block,
        capacity_blocks: c.capacity_blocks,
        namespace: ns.to_vec(),
        flags: store_flags(c.flags)?,
        shards: c.shards,
        shared: match c.shared.is_null() {
            true => None,
            false => Some(shared_config(c.shared).map_err(|e| Error::new(e.status, format!("kvx_store_config.shared: {}", e.message)))?),
        },
    })
}

/// The store behind a handle, unless its engine was destroyed.
///
/// # Safety
/// A non-NULL `s` must come from `kvx_store_open` and not be closed.
pub(super) unsafe fn store<'a>(s: *const kvx_store) -> Result<&'a Store> {
    kvx_store::borrow(s, "store")?.live()
}

/// The keys of a call, each checked for its length before its bytes are read.
///
/// # Safety
/// A non-NULL `p` must point to `n` `kvx_key`s, each `bytes` to `len` readable bytes.
pub(super) unsafe fn keys<'a>(p: *const kvx_key, n: usize) -> Result<Vec<&'a [u8]>> {
    slice(p, n, "keys")?
        .iter()
        .enumerate()
        .map(|(i, k)| {
            if k.len == 0 || k.len as usize > MAX_KEY_BYTES {
                bail!(InvalidArg, "keys[{i}] is {} bytes; keys are 1 to {MAX_KEY_BYTES} bytes (hash a longer one)", k.len);
            }
            if k.bytes.is_null() {
                bail!(InvalidArg, "keys[{i}].bytes is NULL");
            }
            Ok(std::slice::from_raw_parts(k.bytes, k.len as usize))
        })
        .collect()
}

/// A put's or get's transfer options: the caller's, without a completion callback (a
/// store request has none: wait for it or poll it).
///
/// # Safety
/// As `read_versioned`; NULL gives the defaults.
pub(super) unsafe fn store_options(opts: *const kvx_transfer_options) -> Result<TransferOptions> {
    let o = if opts.is_null() { kvx_transfer_options::defaults() } else { read_versioned(opts)? };
    if o.on_complete.is_some() {
        bail!(
            InvalidArg,
            "a store request takes no completion callback; set on_complete to NULL and wait for or poll the kvx_store_request"
        );
    }
    options(&o)
}

pub(super) fn publish(out: Out<*mut kvx_store_request>, req: Arc<StoreRequest>) {
    out.write(kvx_store_request::into_c(StoreCall { req, messages: OnceLock::new() }))
}

/// Fills `cfg` with `struct_size` and the defaults: `KVX_STORE_CREATE`, one shard, no
/// namespace, no shared tier; `block` and `capacity_blocks` must then be set. NULL is
/// ignored.
#[no_mangle]
pub unsafe extern "C" fn kvx_store_config_init(cfg: *mut kvx_store_config) {
    if !cfg.is_null() {
        cfg.write(kvx_store_config::defaults());
    }
}

/// Fills `cfg` with `struct_size` and the defaults (1.7): every field 0 and every string
/// NULL, which mean 16 threads, a 5000 ms bound, written behind, admitted, 1024 pending
/// puts, an unbounded directory; `kind` and its location must then be set. NULL is
/// ignored.
#[no_mangle]
pub unsafe extern "C" fn kvx_shared_config_init(cfg: *mut kvx_shared_config) {
    if !cfg.is_null() {
        cfg.write(kvx_shared_config::defaults());
    }
}

/// Opens the store in the directory `dir` (UTF-8 or any bytes, NUL-terminated), or makes
/// it there with `KVX_STORE_CREATE`. The process then owns the store until
/// `kvx_store_close`: a second open of it, here or in another process, is
/// `KVX_ERR_BUSY` naming the owner's pid; `KVX_STORE_DATA_ONLY` (1.5) opens a store
/// another process owns, to move the slots it hands out. A store made with another geometry, capacity,
/// shard count or namespace is `KVX_ERR_INCOMPATIBLE` naming which. The store keeps the
/// engine's memory alive until it is closed (see `kvx_engine_destroy`). With
/// `cfg->shared` (1.7) the store opens over the shared tier it names: a kind, flag or
/// location that is not set or not known is `KVX_ERR_INVALID_ARG` saying which; a shared
/// directory that cannot be made or written `KVX_ERR_IO`; a kind this build lacks
/// `KVX_ERR_UNSUPPORTED`. `cfg`, `dir` and what they point to are read during the call
/// only. On success `*out` is the store; close it with `kvx_store_close`.
#[no_mangle]
pub unsafe extern "C" fn kvx_store_open(
    e: *mut kvx_engine,
    dir: *const c_char,
    cfg: *const kvx_store_config,
    out: *mut *mut kvx_store,
) -> kvx_status {
    guard(
        || {
            let out = Out::new(out, "out")?;
            let engine = kvx_engine::clone_arc(e, "engine")?;
            if engine.is_shut_down() {
                bail!(Shutdown, "the engine is shutting down");
            }
            let bytes = CStr::from_ptr(non_null(dir, "dir")?).to_bytes();
            if bytes.is_empty() {
                bail!(InvalidArg, "dir is empty");
            }
            let cfg = store_config(non_null(cfg, "cfg")?)?;
            let store = Store::open(&engine, Path::new(OsStr::from_bytes(bytes)), &cfg)?;
            Ok((out, StoreHandle { store, engine }))
        },
        |(out, h)| out.write(kvx_store::into_c(h)),
    )
}

/// Waits for the store's puts and gets in flight, stops its thread, gives up the
/// directory and frees the store; its requests may still be polled and released. NULL
/// is a no-op. The store must not be used afterwards, and must not be closed from a
/// completion callback (it waits for transfers that such a thread completes).
#[no_mangle]
pub unsafe extern "C" fn kvx_store_close(s: *mut kvx_store) {
    if !s.is_null() {
        infallible((), || kvx_store::free(s));
    }
}

/// Looks up `keys[i]`, i < `n`: `present_out[i]` is 1 where the store holds the key, else
/// 0, and `*leading_hits_out` the number of leading keys held (a prefix's hits).
/// `flags`: 0 or `KVX_LOOKUP_LEASE`, which leases each hit (released by a get of the key
/// or `kvx_store_release_leases`). Reads no block. `present_out` holds `n` bytes;
/// outputs are written only on `KVX_OK`.
#[no_mangle]
pub unsafe extern "C" fn kvx_store_lookup(
    s: *mut kvx_store,
    ks: *const kvx_key,
    n: usize,
    flags: u32,
    present_out: *mut u8,
    leading_hits_out: *mut usize,
) -> kvx_status {
    guard(
        || {
            let store = store(s)?;
            let keys = keys(ks, n)?;
            if flags & !KVX_LOOKUP_LEASE != 0 {
                bail!(InvalidArg, "unknown lookup flags {:#x}; the only one is KVX_LOOKUP_LEASE", flags & !KVX_LOOKUP_LEASE);
            }
            non_null(present_out, "present_out")?;
            let leading = Out::new(leading_hits_out, "leading_hits_out")?;
            let (found, hits) = store.lookup(&keys, flags & KVX_LOOKUP_LEASE != 0)?;
            Ok((leading, found, hits))
        },
        |(leading, found, hits)| {
            for (i, f) in found.into_iter().enumerate() {
                // SAFETY: checked non-NULL; the caller gave `n` bytes, one per key.
                unsafe { present_out.add(i).write(f as u8) };
            }
            leading.write(hits)
        },
    )
}

/// Gives back the oldest lease taken by key (`KVX_LOOKUP_LEASE`, `kvx_store_lease_slots`)
/// of each of `keys[i]`, i < `n` (a key without one is skipped). Leases taken by key
/// belong to the key, not to a caller: any get of the key spends one on the slot it
/// loads. Several holders of one key use `kvx_store_lease` instead.
#[no_mangle]
pub unsafe extern "C" fn kvx_store_release_leases(s: *mut kvx_store, ks: *const kvx_key, n: usize) -> kvx_status {
    status(|| store(s)?.release_leases(&keys(ks, n)?))
}

/// Leases each hit of `keys[i]`, i < `n`, for the caller alone (1.6): `leases_out[i]` is
/// the lease's token (never 0) where the store holds the key, else 0, and
/// `*leading_hits_out` the number of leading keys held. A leased hit stays loadable
/// (neither evicted nor its slot reused) until its token is given back with
/// `kvx_store_release`; no get, and no other caller's release, spends it. To load a leased
/// hit, submit its get, then release the lease (the get holds the slot from its submit).
/// Owner only. `leases_out` holds `n` elements; outputs are written only on `KVX_OK`.
#[no_mangle]
pub unsafe extern "C" fn kvx_store_lease(
    s: *mut kvx_store,
    ks: *const kvx_key,
    n: usize,
    leases_out: *mut u64,
    leading_hits_out: *mut usize,
) -> kvx_status {
    guard(
        || {
            let store = store(s)?;
            let keys = keys(ks, n)?;
            non_null(leases_out, "leases_out")?;
            let leading = Out::new(leading_hits_out, "leading_hits_out")?;
            let (leases, hits) = store.lease(&keys)?;
            Ok((leading, leases, hits))
        },
        |(leading, leases, hits)| {
            // SAFETY: checked non-NULL, with room for `n` elements, one per key.
            unsafe { write_all(leases_out, leases.into_iter().map(|l| l.map_or(0, |l| l.0))) };
            leading.write(hits)
        },
    )
}

/// Gives back the leases `leases[i]`, i < `n`, from `kvx_store_lease` (1.6); a 0 is
/// skipped. All or none: a token not held (given back already, listed twice, or of another
/// open of the store) is `KVX_ERR_INVALID_ARG`, naming it, and nothing is given back.
#[no_mangle]
pub unsafe extern "C" fn kvx_store_release(s: *mut kvx_store, leases: *const u64, n: usize) -> kvx_status {
    status(|| {
        let store = store(s)?;
        // SAFETY: the caller gives `n` tokens at `leases`; `slice` checks NULL and the count.
        let tokens = unsafe { slice(leases, n, "leases") }?;
        let held: Vec<Lease> = tokens.iter().filter(|&&t| t != 0).map(|&t| Lease(t)).collect();
        store.release(&held)
    })
}

/// Stores block `src_ids[i]` of `src` under `keys[i]`, i < `n`, asynchronously. Whole
/// blocks only (a layer range in `opts` is refused); `opts` may be NULL and takes no
/// completion callback. Everything that can be checked is checked before anything starts
/// (key lengths, ids, geometry). Per key (`kvx_store_request_key_status`): `KVX_OK` once
/// its block and record are written (synced with `KVX_STORE_DURABLE`), also for a key
/// held already (nothing written); `KVX_ERR_BUSY` when the store is full of held entries;
/// `KVX_ERR_CANCELLED` when it was removed while its put was in flight; else the
/// transfer's status. `src` must stay valid until the request is done (the store holds a
/// reference to it; caller memory a registered layout wraps must outlive it). On success
/// `*out_request` is the request; free it with `kvx_store_request_release`.
#[no_mangle]
pub unsafe extern "C" fn kvx_store_put(
    s: *mut kvx_store,
    src: *const kvx_layout,
    src_ids: *const u64,
    ks: *const kvx_key,
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
            let keys = keys(ks, n)?;
            Ok((out, store.put(&src, ids, &keys, &store_options(opts)?)?))
        },
        |(o, r)| publish(o, r),
    )
}

/// Loads the block of `keys[i]` into block `dst_ids[i]` of `dst`, i < `n`,
/// asynchronously; `opts` may be NULL and takes no completion callback. Per key:
/// `KVX_OK` once its bytes are in `dst` and checked against the record they were stored
/// with; `KVX_ERR_NOT_FOUND` for a key not held; `KVX_ERR_INTEGRITY` for a block that
/// failed a check (a miss: the entry is dropped, the other keys still load); else the
/// transfer's status. A destination block of a key that did not load holds unspecified
/// bytes. `dst` as `src` of `kvx_store_put`. On success `*out_request` is the request;
/// free it with `kvx_store_request_release`.
#[no_mangle]
pub unsafe extern "C" fn kvx_store_get(
    s: *mut kvx_store,
    ks: *const kvx_key,
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
            let keys = keys(ks, n)?;
            let dst = layout(dst, "dst")?;
            let ids = slice(dst_ids, n, "dst_ids")?;
            Ok((out, store.get(&keys, &dst, ids, &store_options(opts)?)?))
        },
        |(o, r)| publish(o, r),
    )
}

/// Removes `keys[i]`, i < `n`: `statuses_out[i]` is `KVX_OK` once its removal is recorded
/// (synced with `KVX_STORE_DURABLE`), so it never comes back, or `KVX_ERR_NOT_FOUND` for
/// a key not held. A leased key, or one a get is loading, leaves the index at once; its
/// slot is reused only after those leases and gets end. `statuses_out` holds `n`
/// statuses, written only on `KVX_OK`.
#[no_mangle]
pub unsafe extern "C" fn kvx_store_remove(s: *mut kvx_store, ks: *const kvx_key, n: usize, statuses_out: *mut kvx_status) -> kvx_status {
    guard(
        || {
            let store = store(s)?;
            let keys = keys(ks, n)?;
            non_null(statuses_out, "statuses_out")?;
            store.remove(&keys)
        },
        |statuses| {
            for (i, st) in statuses.into_iter().enumerate() {
                // SAFETY: checked non-NULL; the caller gave room for `n` statuses.
                unsafe { statuses_out.add(i).write(st.code()) };
            }
        },
    )
}

/// Copies the store's counters into `*out`. Set `out->struct_size` first (to
/// `sizeof(kvx_store_counters)`); fields beyond it are not written.
#[no_mangle]
pub unsafe extern "C" fn kvx_store_stats(s: *mut kvx_store, out: *mut kvx_store_counters) -> kvx_status {
    status(|| {
        let st = store(s)?.stats();
        write_versioned(
            out,
            kvx_store_counters {
                struct_size: 0,
                entries: st.entries,
                capacity: st.capacity,
                hits: st.hits,
                misses: st.misses,
                evictions: st.evictions,
                integrity_failures: st.integrity_failures,
                puts: st.puts,
                dedups: st.dedups,
                removes: st.removes,
                bytes: st.bytes,
                shared_hits: st.shared.hits,
                shared_misses: st.shared.misses,
                shared_integrity_failures: st.shared.integrity_failures,
                shared_timeouts: st.shared.timeouts,
                shared_errors: st.shared.errors,
                shared_puts: st.shared.puts,
                shared_puts_dropped: st.shared.puts_dropped,
                shared_requests: st.shared.requests,
            },
        )
    })
}

/// The request behind a handle.
///
/// # Safety
/// A non-NULL `r` must come from `kvx_store_put` or `kvx_store_get` and not be released.
unsafe fn call<'a>(r: *const kvx_store_request) -> Result<&'a StoreCall> {
    kvx_store_request::borrow(r, "request")
}

/// The request's status as this call's result: its first failed key's message becomes
/// the last error.
fn report(c: &StoreCall, st: Status) -> kvx_status {
    if st != Status::Ok && st != Status::Pending {
        if let Some(m) = c.messages() {
            set_last_error(&m.first.to_string_lossy());
        }
    }
    st.code()
}

/// Waits up to `timeout_ns` (`UINT64_MAX`: forever; 0 polls) until every key has its
/// status, and returns the request's: `KVX_OK` when every key is `KVX_OK`, else the status
/// of the first key (by index) that is not, its message (naming the key) as the last
/// error; `KVX_ERR_TIMEOUT` while keys are still pending. From inside a completion callback
/// of the store's engine it is `KVX_ERR_INVALID_ARG` unless `timeout_ns` is 0 (the callback
/// may hold the thread the request needs).
#[no_mangle]
pub unsafe extern "C" fn kvx_store_request_wait(r: *mut kvx_store_request, timeout_ns: u64) -> kvx_status {
    let mut result = KVX_ERR_INTERNAL;
    let s = guard(
        || {
            let c = call(r)?;
            let t = (timeout_ns != u64::MAX).then(|| Duration::from_nanos(timeout_ns));
            Ok((c, c.req.try_wait(t)?))
        },
        |(c, st)| {
            result = match st {
                Status::Timeout => {
                    set_last_error(&format!("the store request did not complete within {timeout_ns} ns"));
                    KVX_ERR_TIMEOUT
                }
                st => report(c, st),
            }
        },
    );
    if s == KVX_OK {
        result
    } else {
        s
    }
}

/// `KVX_PENDING` until every key has its status, then the request's status (as
/// `kvx_store_request_wait`).
#[no_mangle]
pub unsafe extern "C" fn kvx_store_request_poll(r: *const kvx_store_request) -> kvx_status {
    let mut result = KVX_ERR_INTERNAL;
    let s = guard(|| call(r).map(|c| (c, c.req.poll())), |(c, st)| result = report(c, st));
    if s == KVX_OK {
        result
    } else {
        s
    }
}

/// Key `i`'s status into `*status_out`: `KVX_PENDING` until its part is done, then
/// `KVX_OK` or why it alone failed. `KVX_ERR_OUT_OF_RANGE` for `i` past the request's keys.
#[no_mangle]
pub unsafe extern "C" fn kvx_store_request_key_status(r: *const kvx_store_request, i: usize, status_out: *mut kvx_status) -> kvx_status {
    guard(
        || {
            let out = Out::new(status_out, "status_out")?;
            let c = call(r)?;
            match c.req.key_status(i) {
                Some(st) => Ok((out, st.code())),
                None => bail!(OutOfRange, "key index {i} is past the request's {} keys", c.req.len()),
            }
        },
        |(o, st)| o.write(st),
    )
}

/// Why key `i` failed, once the whole request is done; "" before, for a key that
/// succeeded, or for `i` past the keys (never NULL). Valid until
/// `kvx_store_request_release`.
#[no_mangle]
pub unsafe extern "C" fn kvx_store_request_key_error(r: *const kvx_store_request, i: usize) -> *const c_char {
    infallible(c"".as_ptr(), || match call(r).ok().and_then(|c| c.messages()).and_then(|m| m.keys.get(i)) {
        Some(m) => m.as_ptr(),
        None => c"".as_ptr(),
    })
}

/// The first failed key's message, naming its index, once the request is done; ""
/// before or when every key succeeded (never NULL). Valid until
/// `kvx_store_request_release`.
#[no_mangle]
pub unsafe extern "C" fn kvx_store_request_error(r: *const kvx_store_request) -> *const c_char {
    infallible(c"".as_ptr(), || match call(r).ok().and_then(|c| c.messages()) {
        Some(m) => m.first.as_ptr(),
        None => c"".as_ptr(),
    })
}

/// Frees the handle; the put or get still completes (a store close waits for it). NULL is
/// a no-op.
#[no_mangle]
pub unsafe extern "C" fn kvx_store_request_release(r: *mut kvx_store_request) {
    if !r.is_null() {
        infallible((), || kvx_store_request::free(r));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn store_flags_round_trip_and_unknown_ones_are_refused() {
        let all = STORE_FLAGS.iter().fold(0, |a, (c, _)| a | c);
        let f = store_flags(all).unwrap();
        for (_, one) in STORE_FLAGS {
            assert!(f.contains(one));
        }
        let err = store_flags(all | 32).unwrap_err();
        assert_eq!(err.status, Status::InvalidArg);
        assert!(err.message.contains("0x20"), "{}", err.message);
    }

    #[test]
    fn a_shared_config_maps_every_field_and_defaults_to_none() {
        let s3 = unsafe {
            shared_config(&kvx_shared_config {
                kind: KVX_SHARED_S3,
                endpoint: c"http://127.0.0.1:9000".as_ptr(),
                region: c"eu-west-3".as_ptr(),
                bucket: c"kv".as_ptr(),
                prefix: c"model-a/".as_ptr(),
                path: c"ignored for S3".as_ptr(),
                threads: 4,
                timeout_ms: 250,
                flags: KVX_SHARED_WRITE_THROUGH | KVX_SHARED_NO_ADMIT,
                pending_puts: 7,
                ..kvx_shared_config::defaults()
            })
        }
        .unwrap();
        let want = S3Location {
            endpoint: "http://127.0.0.1:9000".into(),
            region: "eu-west-3".into(),
            bucket: "kv".into(),
            prefix: "model-a/".into(),
        };
        assert_eq!(s3.location, Location::S3(want));
        assert_eq!(
            (s3.threads, s3.timeout, s3.write, s3.admit, s3.pending_puts),
            (4, Duration::from_millis(250), WriteMode::Through, false, 7)
        );

        // NULL strings are empty: the documented defaults (AWS_* variables) apply.
        let bare = unsafe { shared_config(&kvx_shared_config { kind: KVX_SHARED_S3, ..kvx_shared_config::defaults() }) }.unwrap();
        assert_eq!(bare.location, Location::S3(S3Location::default()));

        let path = c"/mnt/kv\xff-shared";
        let dir = unsafe {
            shared_config(&kvx_shared_config {
                kind: KVX_SHARED_DIR,
                path: path.as_ptr(),
                capacity_bytes: 1 << 30,
                ..kvx_shared_config::defaults()
            })
        }
        .unwrap();
        let want = PathBuf::from(OsStr::from_bytes(path.to_bytes()));
        assert_eq!(dir.location, Location::Dir { path: want, capacity_bytes: 1 << 30 });
        // Flags 0 and the zeros of the init: written behind, admitted, the tier's defaults.
        assert_eq!((dir.threads, dir.timeout, dir.write, dir.admit, dir.pending_puts), (0, Duration::ZERO, WriteMode::Behind, true, 0));

        // A store config without `shared` (NULL, or a 1.4-sized struct) has no shared tier.
        let block = kvx_layout_config {
            struct_size: std::mem::size_of::<kvx_layout_config>() as u32,
            kind: 0,
            num_blocks: 0,
            num_layers: 1,
            outer_dim: 1,
            page_size: 1,
            inner_dim: 8,
            dtype_bytes: 2,
        };
        let mut old = kvx_store_config { block: &block, capacity_blocks: 4, shared: std::ptr::dangling(), ..kvx_store_config::defaults() };
        old.struct_size = kvx_store_config::V1_SIZE as u32; // the dangling `shared` lies past it: never read
        assert!(unsafe { store_config(&old) }.unwrap().shared.is_none());
        let with = kvx_shared_config { kind: KVX_SHARED_DIR, path: c"/mnt/kv".as_ptr(), ..kvx_shared_config::defaults() };
        let new = kvx_store_config { block: &block, capacity_blocks: 4, shared: &with, ..kvx_store_config::defaults() };
        assert!(matches!(unsafe { store_config(&new) }.unwrap().shared, Some(SharedConfig { location: Location::Dir { .. }, .. })));
    }

    #[test]
    fn a_shared_config_without_a_known_kind_or_with_unknown_flags_is_refused() {
        for kind in [0, 3] {
            let c = kvx_shared_config { kind, path: c"/mnt/kv".as_ptr(), ..kvx_shared_config::defaults() };
            let err = unsafe { shared_config(&c) }.unwrap_err();
            assert_eq!(err.status, Status::InvalidArg);
            assert!(err.message.contains(&format!("kind is {kind}")) && err.message.contains("KVX_SHARED_DIR"), "{}", err.message);
        }
        let c = kvx_shared_config {
            kind: KVX_SHARED_DIR,
            path: c"/mnt/kv".as_ptr(),
            flags: 4 | KVX_SHARED_NO_ADMIT,
            ..kvx_shared_config::defaults()
        };
        let err = unsafe { shared_config(&c) }.unwrap_err();
        assert_eq!(err.status, Status::InvalidArg);
        assert!(err.message.contains("0x4") && err.message.contains("WRITE_THROUGH|NO_ADMIT"), "{}", err.message);
        let bad = [b'k', 0xff, 0];
        let c = kvx_shared_config { kind: KVX_SHARED_S3, bucket: bad.as_ptr() as *const c_char, ..kvx_shared_config::defaults() };
        let err = unsafe { shared_config(&c) }.unwrap_err();
        assert!(err.message.contains("bucket is not UTF-8"), "{}", err.message);
    }

    #[test]
    fn keys_are_refused_by_length_before_their_bytes_are_read() {
        let b = [1u8; 65];
        let dangling = 8 as *const u8; // never read: its length is refused first
        for (k, what) in [
            (kvx_key { bytes: b.as_ptr(), len: 0 }, "0 bytes"),
            (kvx_key { bytes: dangling, len: 65 }, "65 bytes"),
            (kvx_key { bytes: std::ptr::null(), len: 3 }, "NULL"),
        ] {
            let err = unsafe { keys(&k, 1) }.unwrap_err();
            assert_eq!(err.status, Status::InvalidArg, "{what}");
            assert!(err.message.contains(what) && err.message.contains("keys[0]"), "{}", err.message);
        }
        let ok = [kvx_key { bytes: b.as_ptr(), len: 64 }, kvx_key { bytes: b.as_ptr(), len: 1 }];
        assert_eq!(unsafe { keys(ok.as_ptr(), 2) }.unwrap(), vec![&b[..64], &b[..1]]);
    }
}
