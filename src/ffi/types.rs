//! The C ABI's types and constants. `#[repr(C)]` structs start with `struct_size` and
//! only grow at their end; opaque handles are declared here and defined in Rust.

use std::ffi::{c_char, c_void};

/// Outcome of a call: `KVX_OK` or one of the `KVX_ERR_*` codes (never reused).
pub type kvx_status = u32;

pub const KVX_OK: kvx_status = 0;
/// The request has not completed yet.
pub const KVX_PENDING: kvx_status = 1;
/// NULL, zero sizes, mismatched counts, bad enum value, too-small `struct_size`.
pub const KVX_ERR_INVALID_ARG: kvx_status = 2;
/// Block id ≥ num_blocks, or a layer range outside the layout.
pub const KVX_ERR_OUT_OF_RANGE: kvx_status = 3;
/// Source and destination layouts differ in block geometry.
pub const KVX_ERR_INCOMPATIBLE: kvx_status = 4;
/// Asked for a backend or feature that this machine or build lacks.
pub const KVX_ERR_UNSUPPORTED: kvx_status = 5;
pub const KVX_ERR_NO_DEVICE: kvx_status = 6;
pub const KVX_ERR_CUDA: kvx_status = 7;
pub const KVX_ERR_IO: kvx_status = 8;
pub const KVX_ERR_NO_MEMORY: kvx_status = 9;
pub const KVX_ERR_TIMEOUT: kvx_status = 10;
pub const KVX_ERR_CANCELLED: kvx_status = 11;
pub const KVX_ERR_SHUTDOWN: kvx_status = 12;
/// `max_inflight` requests are already admitted; retry after one completes.
pub const KVX_ERR_BUSY: kvx_status = 13;
/// Data read back is not what was written (checksum).
pub const KVX_ERR_INTEGRITY: kvx_status = 14;
pub const KVX_ERR_VERSION: kvx_status = 15;
pub const KVX_ERR_INTERNAL: kvx_status = 16;
/// A remote peer (an imported layout's engine) failed a transfer, did not answer within
/// the import's timeout, or exited; or its import was closed by such a transfer or
/// replaced; or too many bounce slots are held by such transfers (`slots_quarantined`)
/// for a remote ↔ disk chunk to take one. Local work is unaffected. Re-import its blob
/// once it is back. (1.3)
pub const KVX_ERR_REMOTE: kvx_status = 17;
/// A key the store does not hold: a key's status after a get or a remove, never a whole
/// call's. (1.4)
pub const KVX_ERR_NOT_FOUND: kvx_status = 18;

pub const KVX_ABI_MAJOR: u32 = 1;
/// 1.1: `kvx_transfer_options.wait_event`, the stage timers of `kvx_stats`,
/// `KVX_DISK_CHECKSUM`, `kvx_engine_io_backend`, `kvx_engine_config_get`.
/// 1.2: `KVX_DISK_MAPPED`.
/// 1.3: remote layouts: `kvx_engine_export`, `kvx_blob_*`, `kvx_engine_import`, `KVX_ERR_REMOTE`.
/// 1.4: `kvx_stats.slots_quarantined`; the store: `kvx_store_*`, `kvx_key`,
/// `kvx_store_config`, `kvx_store_counters`, `kvx_store_request_*`, `KVX_STORE_*`,
/// `KVX_LOOKUP_LEASE`, `KVX_ERR_NOT_FOUND`.
/// 1.5: `kvx_engine_completion_fd`, `KVX_XFER_CRITICAL`; slot handles: `kvx_slot_handle`,
/// `KVX_STORE_DATA_ONLY`, `KVX_RESERVED_*`, `kvx_store_lease_slots`, `_reserve_slots`,
/// `_commit_slots`, `_abort_slots`, `_read_slots`, `_write_slots`.
/// 1.6: lease tokens: `kvx_store_lease`, `kvx_store_release`.
/// 1.7: the shared tier: `kvx_shared_config`, `kvx_shared_config_init`, `KVX_SHARED_*`,
/// `kvx_store_config.shared`, the `shared_*` counters of `kvx_store_counters`.
pub const KVX_ABI_MINOR: u32 = 7;

/// `kvx_engine_config.device`: GPU 0 when a CUDA driver and device exist, else emulated.
pub const KVX_DEVICE_AUTO: i32 = -2;
/// `kvx_engine_config.device`: host memory stands in for the GPU (same pipeline, memcpy copies).
pub const KVX_DEVICE_EMULATED: i32 = -1;

/// `kvx_engine_config.io_backend`: probe and take the fastest that works here (GDS with
/// nvidia-fs, else io_uring, else POSIX); the log says the choice and why not the others.
pub const KVX_IO_AUTO: u32 = 0;
/// pread/pwrite on the I/O workers.
pub const KVX_IO_POSIX: u32 = 1;
/// One io_uring per I/O worker, the bounce slots registered as fixed buffers.
pub const KVX_IO_URING: u32 = 2;
/// NIXL's POSIX plugin; `libnixl_capi.so` must be on the library path at run time.
pub const KVX_IO_NIXL: u32 = 3;
/// cuFile (GPUDirect Storage) between file and device memory, after a start-up probe.
pub const KVX_IO_GDS: u32 = 4;

/// `kvx_layout_config.kind` values.
pub const KVX_LAYOUT_FULLY_CONTIGUOUS: u32 = 0;
pub const KVX_LAYOUT_LAYER_SEPARATE_BLOCK_FIRST: u32 = 1;
pub const KVX_LAYOUT_LAYER_SEPARATE_OUTER_FIRST: u32 = 2;

/// Host layout flag: page-locked memory (allocated pinned; for registered memory: the
/// caller already pinned it).
pub const KVX_HOST_PINNED: u32 = 1;

/// Disk layout flag: create the file, sized for the layout. A regular file found at the
/// path is replaced by a new file with its owner and mode (whoever still has the old one
/// open reads it intact); a symbolic link's target, a special file, a file with other
/// names or another user's is truncated in place instead, and kept on destroy.
pub const KVX_DISK_CREATE: u32 = 1;
/// Disk layout flag: keep the file on destroy (by default a file kvxfer created is removed).
pub const KVX_DISK_KEEP: u32 = 2;
/// Disk layout flag: buffered I/O instead of O_DIRECT.
pub const KVX_DISK_BUFFERED: u32 = 4;
/// Disk layout flag: every write request is durable (fdatasync) before it completes. After
/// a failed sync, every later write request to the file fails until it is opened again
/// (the kernel reports lost pages to one sync only).
pub const KVX_DISK_SYNC: u32 = 8;
/// Disk layout flag (ABI 1.1): store a checksum per region and a seal per block in a
/// sidecar (`<path>.kvxsum`), written with the data and verified on every read. A
/// mismatch, a write torn by a crash, or a block never (completely) written fails the
/// request with `KVX_ERR_INTEGRITY` naming the block, never returns wrong bytes. A block
/// counts as written once a write request covering it completed; reading a block whose
/// layers were never all written is an integrity error too. Needs `slot_bytes` larger
/// than a region plus 8 KiB.
pub const KVX_DISK_CHECKSUM: u32 = 16;
/// Disk layout flag (ABI 1.2): map the file and page-lock it for the device while the
/// layout lives, so blocks move by DMA straight between the file's pages and device
/// memory (no bounce slot, one pass over host memory). For a file on tmpfs or hugetlbfs
/// (e.g. `/dev/shm`), holding all of it in memory; elsewhere, or with
/// `KVX_DISK_CHECKSUM`, layout creation fails and says why. The file format is the same
/// as without it, so the same file can be opened either way. The file must not be
/// truncated while the layout lives.
pub const KVX_DISK_MAPPED: u32 = 32;

/// `kvx_store_config.flags` (1.4): make the store in the directory where none is yet.
/// Without it, opening a directory that holds no store is `KVX_ERR_INVALID_ARG`.
pub const KVX_STORE_CREATE: u32 = 1;
/// `kvx_store_config.flags` (1.4): survive power loss: every put is synced (data,
/// checksums, record) before its key reports `KVX_OK`, every removal before
/// `kvx_store_remove` returns.
pub const KVX_STORE_DURABLE: u32 = 2;
/// `kvx_store_config.flags` (1.4): page-cache I/O for the data files instead of
/// `O_DIRECT` (a tmpfs or page-cache tier).
pub const KVX_STORE_BUFFERED: u32 = 4;
/// `kvx_store_config.flags` (1.4): on open, drop every entry whose record does not match
/// its block's seal (one 8-byte read per entry; no block is read).
pub const KVX_STORE_VERIFY_ON_OPEN: u32 = 8;

/// `kvx_store_lookup` flag (1.4): lease each hit, so it is neither evicted nor reused
/// until a get of it (which spends the lease) or `kvx_store_release_leases`.
pub const KVX_LOOKUP_LEASE: u32 = 1;

/// `kvx_transfer_options.flags` (1.5): latency-critical, a transfer its caller waits for
/// (an onboard before a request's first token). The engine serves it ahead of transfers
/// without the flag at every stage they share (the dispatcher, hence the bounce slots,
/// the I/O workers, the copy thread and the device's streams), while those keep at least
/// one turn in four, so they never starve. Without it (flags 0, as every caller before
/// 1.5 passes) transfers are served in the order they came. A library older than 1.5
/// refuses the flag with `KVX_ERR_INVALID_ARG`.
pub const KVX_XFER_CRITICAL: u32 = 1;

/// `kvx_store_config.flags` (1.5): open a store another process owns, to move the slots
/// its owner hands out (`kvx_store_read_slots`, `kvx_store_write_slots`): no lock, nothing
/// written but those slots' data, `KVX_STORE_CREATE` ignored; the calls that touch keys
/// (lookup, put, get, remove, leases, reserve, commit, abort) are `KVX_ERR_INVALID_ARG`.
pub const KVX_STORE_DATA_ONLY: u32 = 16;

/// `kvx_store_reserve_slots` (1.5): the key has a slot to write; its handle is set.
pub const KVX_RESERVED_WRITE: u32 = 1;
/// `kvx_store_reserve_slots` (1.5): the store holds the key already; nothing to write.
pub const KVX_RESERVED_HELD: u32 = 2;
/// `kvx_store_reserve_slots` (1.5): another put of the key is in flight; look it up once
/// that has ended.
pub const KVX_RESERVED_IN_FLIGHT: u32 = 3;
/// `kvx_store_reserve_slots` (1.5): full, and every entry is held; the key fails alone
/// (as `KVX_ERR_BUSY` for a put).
pub const KVX_RESERVED_NO_ROOM: u32 = 4;

/// `kvx_shared_config.kind` (1.7): a directory many processes open at once (on one host,
/// or on many over NFS, Lustre or CephFS), named by `path`.
pub const KVX_SHARED_DIR: u32 = 1;
/// `kvx_shared_config.kind` (1.7): an S3-compatible bucket, named by `endpoint`, `region`,
/// `bucket` and `prefix`.
pub const KVX_SHARED_S3: u32 = 2;
/// `kvx_shared_config.flags` (1.7): a put's keys report once their objects are published
/// in the shared tier too (write-through). Without it a put's keys report once the local
/// store holds them, and their objects are written after (written behind).
pub const KVX_SHARED_WRITE_THROUGH: u32 = 1;
/// `kvx_shared_config.flags` (1.7): a block a get loads from the shared tier is not also
/// put into the local store (by default it is).
pub const KVX_SHARED_NO_ADMIT: u32 = 2;

/// An engine: its threads, bounce ring and device. Create with `kvx_engine_create`,
/// free with `kvx_engine_destroy`.
pub struct kvx_engine {
    _opaque: [u8; 0],
}

/// A layout: block geometry plus the memory or file holding it. Reference counted inside
/// kvxfer: `kvx_layout_destroy` drops the caller's reference, requests hold their own.
pub struct kvx_layout {
    _opaque: [u8; 0],
}

/// A submitted transfer. Free with `kvx_request_release` (the transfer still completes).
pub struct kvx_request {
    _opaque: [u8; 0],
}

/// Bytes an engine exported (`kvx_engine_export`): read them with `kvx_blob_bytes`,
/// free with `kvx_blob_destroy`. (1.3)
pub struct kvx_blob {
    _opaque: [u8; 0],
}

/// A store of KV blocks keyed by the runtime's keys, in one directory (1.4). Open with
/// `kvx_store_open`, close with `kvx_store_close`.
pub struct kvx_store {
    _opaque: [u8; 0],
}

/// A store put or get (1.4): one status per key. Not a `kvx_request`: one store call may
/// be several transfers, and a key is settled only once its record is written or checked.
/// Free with `kvx_store_request_release` (the call still completes).
pub struct kvx_store_request {
    _opaque: [u8; 0],
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct kvx_engine_config {
    pub struct_size: u32,
    /// CUDA ordinal, `KVX_DEVICE_AUTO` or `KVX_DEVICE_EMULATED`.
    pub device: i32,
    /// I/O worker threads; 0 = default (three quarters of the CPUs, clamped to 4..16).
    pub io_threads: u32,
    /// `KVX_IO_*`.
    pub io_backend: u32,
    /// Pinned bounce memory in total; 0 = default (64 MiB). A multiple of `slot_bytes`.
    pub bounce_bytes: u64,
    /// One bounce slot; 0 = default (2 MiB). A power of two ≥ 64 KiB.
    pub slot_bytes: u64,
    /// Requests admitted at once before submit says `KVX_ERR_BUSY`; 0 = default (1024).
    pub max_inflight: u32,
    /// None defined yet; must be 0.
    pub flags: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct kvx_layout_config {
    pub struct_size: u32,
    /// `KVX_LAYOUT_*`.
    pub kind: u32,
    pub num_blocks: u64,
    pub num_layers: u64,
    /// 2 for separate K and V, 1 for MLA.
    pub outer_dim: u64,
    /// Tokens per block.
    pub page_size: u64,
    /// Elements per token (kv_heads × head_dim).
    pub inner_dim: u64,
    pub dtype_bytes: u64,
}

/// Called once when a request completes, with its final status, on a kvxfer thread (or
/// inside `kvx_request_cancel` for a request that had not started). It must not block,
/// must not throw, and must not destroy the engine; it may submit, poll and release.
/// `kvx_request_wait`/`kvx_request_poll` report completion only after it returned, except
/// inside it: there they return `status` for `req` at once. A wait with a non-zero timeout
/// on another request of the same engine fails with `KVX_ERR_INVALID_ARG` from inside a
/// callback (it could hold up the thread that completes that request); poll instead.
pub type kvx_completion_fn = Option<unsafe extern "C" fn(user_data: *mut c_void, req: *mut kvx_request, status: kvx_status)>;

#[repr(C)]
#[derive(Clone, Copy)]
pub struct kvx_transfer_options {
    pub struct_size: u32,
    /// First layer to move.
    pub layer_begin: u32,
    /// One past the last layer to move; 0 means all layers.
    pub layer_end: u32,
    /// `KVX_XFER_*`, or 0.
    pub flags: u32,
    /// Optional completion callback.
    pub on_complete: kvx_completion_fn,
    pub user_data: *mut c_void,
    /// ABI 1.1. Optional `CUevent` of the engine's device. Ordering: every device copy of
    /// this transfer starts after the work the event marks *when kvx_transfer_submit is
    /// called* (re-recording it later does not matter), so a runtime can record it right
    /// after the kernels that wrote the KV blocks and submit the offload without
    /// synchronising. Completion (callback, wait, poll) means every byte has arrived:
    /// device memory written by an onboarding transfer is ready for any stream then.
    /// NULL: no wait. It must be a valid event of the engine's device (the driver cannot
    /// check arbitrary pointers); on the emulated device any non-NULL value is
    /// `KVX_ERR_INVALID_ARG`.
    pub wait_event: *mut c_void,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct kvx_stats {
    pub struct_size: u32,
    pub requests_completed: u64,
    pub requests_failed: u64,
    pub requests_cancelled: u64,
    pub bytes_disk_read: u64,
    pub bytes_disk_written: u64,
    pub bytes_host_to_device: u64,
    pub bytes_device_to_host: u64,
    /// ABI 1.1: busy time per pipeline stage in nanoseconds, summed over the threads doing
    /// it — divide by wall time for a stage's utilisation. Disk reads, disk writes, host
    /// memcpy (pageable/pinned ↔ bounce slot), device copies from issue to completion,
    /// and time the dispatcher waited for a free bounce slot.
    pub disk_read_ns: u64,
    pub disk_write_ns: u64,
    pub host_copy_ns: u64,
    pub device_copy_ns: u64,
    pub slot_wait_ns: u64,
    /// ABI 1.4: bounce slots held out of the ring now, because a remote ↔ disk
    /// transfer through each timed out or failed and NIXL has not reported it ended (it
    /// may still read or write the slot). Such a slot comes back when NIXL reports the
    /// transfer ended (a stalled peer that resumes); it stays out for good when NIXL
    /// reported the transfer failed, its post failed, or the peer was imported again
    /// first. At most all slots but one are held: past that, remote ↔ disk chunks end
    /// with `KVX_ERR_REMOTE` while local work goes on.
    pub slots_quarantined: u64,
}

/// Log sink: `level` is 1 error, 2 warn, 3 info, 4 debug, 5 trace; `target` and
/// `message` are valid only during the call. Runs on any thread; must not block and must
/// not call `kvx_set_logger` (refused); records kvxfer makes during the call are dropped.
pub type kvx_log_fn = Option<unsafe extern "C" fn(user_data: *mut c_void, level: u32, target: *const c_char, message: *const c_char)>;

/// A store key (1.4): 1 to 64 opaque bytes naming a block's content (the same key always
/// means the same bytes). `bytes` stays the caller's; it is read during the call only.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct kvx_key {
    pub bytes: *const u8,
    pub len: u32,
}

/// How a store is opened (1.4). The block geometry, capacity, shard count and namespace
/// are fixed when the store is made; reopening with others is `KVX_ERR_INCOMPATIBLE`
/// naming which.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct kvx_store_config {
    pub struct_size: u32,
    /// `KVX_STORE_*`; `kvx_store_config_init` sets `KVX_STORE_CREATE`.
    pub flags: u32,
    /// The geometry of one block (its `kind` and `num_blocks` are ignored: blocks are
    /// stored contiguous, `capacity_blocks` of them). The caller's; read during
    /// `kvx_store_open` only. Must be set.
    pub block: *const kvx_layout_config,
    /// Blocks the store holds at most (1 to 2^26); must be set.
    pub capacity_blocks: u64,
    /// Everything that makes two blocks with equal keys differ (model, dtype, layout,
    /// TP/PP rank…), at most 256 bytes; NULL with `namespace_len` 0 is the empty one. The
    /// caller's; read during `kvx_store_open` only.
    pub namespace_bytes: *const u8,
    pub namespace_len: u32,
    /// Data files the blocks are spread over (1 to `capacity_blocks`); 1 by default.
    pub shards: u32,
    /// ABI 1.7. A shared tier under the store: what the local store misses, a get loads
    /// from it, and puts publish to it. NULL (the default): none. Not fixed when the store
    /// is made: each open may name another, or none. The caller's; read during
    /// `kvx_store_open` only. Refused with `KVX_STORE_DATA_ONLY`.
    pub shared: *const kvx_shared_config,
}

/// A shared tier under a store (1.7): KV blocks shared by any number of processes on any
/// number of hosts, one object per block, verified on every read. Fill it with
/// `kvx_shared_config_init`, then set `kind` and its location. Every string is the
/// caller's, NUL-terminated, and read during `kvx_store_open` only.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct kvx_shared_config {
    pub struct_size: u32,
    /// `KVX_SHARED_DIR` or `KVX_SHARED_S3`; 0 after `kvx_shared_config_init`: must be set.
    pub kind: u32,
    /// `KVX_SHARED_DIR`: the shared directory (any bytes); made where missing, and this
    /// process must be able to write in it. Must be set.
    pub path: *const c_char,
    /// `KVX_SHARED_DIR`: past this many bytes of objects, writers evict the least recently
    /// used ones; 0 (the default): unbounded.
    pub capacity_bytes: u64,
    /// `KVX_SHARED_S3`: `http(s)://host:port`; NULL or "": `AWS_ENDPOINT_URL`, else AWS's
    /// own endpoint for the region.
    pub endpoint: *const c_char,
    /// `KVX_SHARED_S3`: NULL or "": `AWS_REGION`, else `AWS_DEFAULT_REGION`, else
    /// `us-east-1`.
    pub region: *const c_char,
    /// `KVX_SHARED_S3`: the bucket; must be set. Credentials come from the standard AWS
    /// environment variables and files, never from here.
    pub bucket: *const c_char,
    /// `KVX_SHARED_S3`: prepended to every object's name; NULL or "": none.
    pub prefix: *const c_char,
    /// Threads that run the backend's calls (1 to 256); 0 (the default): 16.
    pub threads: u32,
    /// The longest a lookup or get waits for the shared tier, in milliseconds; past it,
    /// its keys are misses (counted in `shared_timeouts`). 0 (the default): 5000.
    pub timeout_ms: u32,
    /// `KVX_SHARED_WRITE_THROUGH`, `KVX_SHARED_NO_ADMIT`, or 0 (written behind, admitted).
    pub flags: u32,
    /// Blocks waiting to be written behind, at most; past it, a put's objects are dropped
    /// (counted in `shared_puts_dropped`). 0 (the default): 1024.
    pub pending_puts: u32,
}

/// What a store holds and has done since it was opened (1.4).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct kvx_store_counters {
    pub struct_size: u32,
    pub entries: u64,
    pub capacity: u64,
    /// Keys gets loaded.
    pub hits: u64,
    /// Keys gets did not load: not held, or a failed check.
    pub misses: u64,
    pub evictions: u64,
    /// Failed checks and damage: damaged records found on open, the entries of a shard
    /// found damaged on open (made anew), and gets whose block did not match its record or
    /// its checksums or lay past the end of a file cut short (each also a miss).
    pub integrity_failures: u64,
    /// Blocks written by puts.
    pub puts: u64,
    /// Keys of puts that were held already (nothing written).
    pub dedups: u64,
    pub removes: u64,
    /// Bytes of the blocks held (`entries` × block bytes).
    pub bytes: u64,
    /// ABI 1.7: the shared tier's counters (all 0 without one). A key a get loads from
    /// the shared tier counts in `hits` too; one it misses there counts in `misses` once.
    /// Blocks read from the shared tier and checked.
    pub shared_hits: u64,
    /// Shared-tier reads that found no object.
    pub shared_misses: u64,
    /// Shared-tier objects that failed a check (damaged, cut short, of another namespace
    /// or key): each a miss.
    pub shared_integrity_failures: u64,
    /// Shared-tier calls whose caller stopped waiting at `timeout_ms`.
    pub shared_timeouts: u64,
    /// Shared-tier calls that failed (the backend's error).
    pub shared_errors: u64,
    /// Objects published to the shared tier.
    pub shared_puts: u64,
    /// Objects not written: more were waiting than `pending_puts`, or the write failed.
    pub shared_puts_dropped: u64,
    /// Calls made to the shared tier's backend (existence checks, reads, writes): what a
    /// bucket bills.
    pub shared_requests: u64,
}

/// A slot handle (1.5): a slot of a store that its owner hands to a process which opened
/// the store `KVX_STORE_DATA_ONLY`, to read (`kvx_store_lease_slots`) or to write
/// (`kvx_store_reserve_slots`). Plain bytes of a fixed size (48) and layout for ABI 1:
/// copy it, ship it to another process of the same host, pass it back unchanged.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct kvx_slot_handle {
    /// The key's digest (xxh3-128, little-endian).
    pub key_digest: [u8; 16],
    /// The entry's generation (a read handle) or the reservation's (a write handle).
    pub generation: u64,
    /// The block's seal in a read handle; 0 in a write handle.
    pub seal: u64,
    /// The owner's open that handed it out.
    pub epoch: u64,
    pub slot: u32,
    /// The key's length in bytes.
    pub key_len: u32,
}
