/* kvxfer — move LLM KV-cache blocks between GPU memory, host memory and disk.
 *
 * Generated from src/ffi by build.rs (cbindgen); do not edit. `make header` rewrites it,
 * and `make test` fails when it differs from the Rust code.
 *
 * Conventions: every fallible call returns kvx_status (KVX_OK = 0) and writes its outputs
 * only on KVX_OK; kvx_last_error() then holds the calling thread's message. Structs
 * passed by pointer start with struct_size: fill them with their kvx_*_init() first.
 * All functions are thread-safe. Handles are freed by their destroy/release call, which
 * accepts NULL. */

#ifndef KVXFER_H
#define KVXFER_H

#include <stddef.h>
#include <stdint.h>


#define KVX_ABI_MAJOR 1

// 1.1: `kvx_transfer_options.wait_event`, the stage timers of `kvx_stats`,
// `KVX_DISK_CHECKSUM`, `kvx_engine_io_backend`, `kvx_engine_config_get`.
// 1.2: `KVX_DISK_MAPPED`.
// 1.3: remote layouts: `kvx_engine_export`, `kvx_blob_*`, `kvx_engine_import`, `KVX_ERR_REMOTE`.
// 1.4: `kvx_stats.slots_quarantined`; the store: `kvx_store_*`, `kvx_key`,
// `kvx_store_config`, `kvx_store_counters`, `kvx_store_request_*`, `KVX_STORE_*`,
// `KVX_LOOKUP_LEASE`, `KVX_ERR_NOT_FOUND`.
// 1.5: `kvx_engine_completion_fd`, `KVX_XFER_CRITICAL`; slot handles: `kvx_slot_handle`,
// `KVX_STORE_DATA_ONLY`, `KVX_RESERVED_*`, `kvx_store_lease_slots`, `_reserve_slots`,
// `_commit_slots`, `_abort_slots`, `_read_slots`, `_write_slots`.
// 1.6: lease tokens: `kvx_store_lease`, `kvx_store_release`.
// 1.7: the shared tier: `kvx_shared_config`, `kvx_shared_config_init`, `KVX_SHARED_*`,
// `kvx_store_config.shared`, the `shared_*` counters of `kvx_store_counters`.
#define KVX_ABI_MINOR 7

// `kvx_engine_config.device`: GPU 0 when a CUDA driver and device exist, else emulated.
#define KVX_DEVICE_AUTO -2

// `kvx_engine_config.device`: host memory stands in for the GPU (same pipeline, memcpy copies).
#define KVX_DEVICE_EMULATED -1

// `kvx_engine_config.io_backend`: probe and take the fastest that works here (GDS with
// nvidia-fs, else io_uring, else POSIX); the log says the choice and why not the others.
#define KVX_IO_AUTO 0

// pread/pwrite on the I/O workers.
#define KVX_IO_POSIX 1

// One io_uring per I/O worker, the bounce slots registered as fixed buffers.
#define KVX_IO_URING 2

// NIXL's POSIX plugin; `libnixl_capi.so` must be on the library path at run time.
#define KVX_IO_NIXL 3

// cuFile (GPUDirect Storage) between file and device memory, after a start-up probe.
#define KVX_IO_GDS 4

// `kvx_layout_config.kind` values.
#define KVX_LAYOUT_FULLY_CONTIGUOUS 0

#define KVX_LAYOUT_LAYER_SEPARATE_BLOCK_FIRST 1

#define KVX_LAYOUT_LAYER_SEPARATE_OUTER_FIRST 2

// Host layout flag: page-locked memory (allocated pinned; for registered memory: the
// caller already pinned it).
#define KVX_HOST_PINNED 1

// Disk layout flag: create the file, sized for the layout. A regular file found at the
// path is replaced by a new file with its owner and mode (whoever still has the old one
// open reads it intact); a symbolic link's target, a special file, a file with other
// names or another user's is truncated in place instead, and kept on destroy.
#define KVX_DISK_CREATE 1

// Disk layout flag: keep the file on destroy (by default a file kvxfer created is removed).
#define KVX_DISK_KEEP 2

// Disk layout flag: buffered I/O instead of O_DIRECT.
#define KVX_DISK_BUFFERED 4

// Disk layout flag: every write request is durable (fdatasync) before it completes. After
// a failed sync, every later write request to the file fails until it is opened again
// (the kernel reports lost pages to one sync only).
#define KVX_DISK_SYNC 8

// Disk layout flag (ABI 1.1): store a checksum per region and a seal per block in a
// sidecar (`<path>.kvxsum`), written with the data and verified on every read. A
// mismatch, a write torn by a crash, or a block never (completely) written fails the
// request with `KVX_ERR_INTEGRITY` naming the block, never returns wrong bytes. A block
// counts as written once a write request covering it completed; reading a block whose
// layers were never all written is an integrity error too. Needs `slot_bytes` larger
// than a region plus 8 KiB.
#define KVX_DISK_CHECKSUM 16

// Disk layout flag (ABI 1.2): map the file and page-lock it for the device while the
// layout lives, so blocks move by DMA straight between the file's pages and device
// memory (no bounce slot, one pass over host memory). For a file on tmpfs or hugetlbfs
// (e.g. `/dev/shm`), holding all of it in memory; elsewhere, or with
// `KVX_DISK_CHECKSUM`, layout creation fails and says why. The file format is the same
// as without it, so the same file can be opened either way. The file must not be
// truncated while the layout lives.
#define KVX_DISK_MAPPED 32

// `kvx_store_config.flags` (1.4): make the store in the directory where none is yet.
// Without it, opening a directory that holds no store is `KVX_ERR_INVALID_ARG`.
#define KVX_STORE_CREATE 1

// `kvx_store_config.flags` (1.4): survive power loss: every put is synced (data,
// checksums, record) before its key reports `KVX_OK`, every removal before
// `kvx_store_remove` returns.
#define KVX_STORE_DURABLE 2

// `kvx_store_config.flags` (1.4): page-cache I/O for the data files instead of
// `O_DIRECT` (a tmpfs or page-cache tier).
#define KVX_STORE_BUFFERED 4

// `kvx_store_config.flags` (1.4): on open, drop every entry whose record does not match
// its block's seal (one 8-byte read per entry; no block is read).
#define KVX_STORE_VERIFY_ON_OPEN 8

// `kvx_store_lookup` flag (1.4): lease each hit, so it is neither evicted nor reused
// until a get of it (which spends the lease) or `kvx_store_release_leases`.
#define KVX_LOOKUP_LEASE 1

// `kvx_transfer_options.flags` (1.5): latency-critical, a transfer its caller waits for
// (an onboard before a request's first token). The engine serves it ahead of transfers
// without the flag at every stage they share (the dispatcher, hence the bounce slots,
// the I/O workers, the copy thread and the device's streams), while those keep at least
// one turn in four, so they never starve. Without it (flags 0, as every caller before
// 1.5 passes) transfers are served in the order they came. A library older than 1.5
// refuses the flag with `KVX_ERR_INVALID_ARG`.
#define KVX_XFER_CRITICAL 1

// `kvx_store_config.flags` (1.5): open a store another process owns, to move the slots
// its owner hands out (`kvx_store_read_slots`, `kvx_store_write_slots`): no lock, nothing
// written but those slots' data, `KVX_STORE_CREATE` ignored; the calls that touch keys
// (lookup, put, get, remove, leases, reserve, commit, abort) are `KVX_ERR_INVALID_ARG`.
#define KVX_STORE_DATA_ONLY 16

// `kvx_store_reserve_slots` (1.5): the key has a slot to write; its handle is set.
#define KVX_RESERVED_WRITE 1

// `kvx_store_reserve_slots` (1.5): the store holds the key already; nothing to write.
#define KVX_RESERVED_HELD 2

// `kvx_store_reserve_slots` (1.5): another put of the key is in flight; look it up once
// that has ended.
#define KVX_RESERVED_IN_FLIGHT 3

// `kvx_store_reserve_slots` (1.5): full, and every entry is held; the key fails alone
// (as `KVX_ERR_BUSY` for a put).
#define KVX_RESERVED_NO_ROOM 4

// `kvx_shared_config.kind` (1.7): a directory many processes open at once (on one host,
// or on many over NFS, Lustre or CephFS), named by `path`.
#define KVX_SHARED_DIR 1

// `kvx_shared_config.kind` (1.7): an S3-compatible bucket, named by `endpoint`, `region`,
// `bucket` and `prefix`.
#define KVX_SHARED_S3 2

// `kvx_shared_config.flags` (1.7): a put's keys report once their objects are published
// in the shared tier too (write-through). Without it a put's keys report once the local
// store holds them, and their objects are written after (written behind).
#define KVX_SHARED_WRITE_THROUGH 1

// `kvx_shared_config.flags` (1.7): a block a get loads from the shared tier is not also
// put into the local store (by default it is).
#define KVX_SHARED_NO_ADMIT 2

// Bytes an engine exported (`kvx_engine_export`): read them with `kvx_blob_bytes`,
// free with `kvx_blob_destroy`. (1.3)
typedef struct kvx_blob kvx_blob;

// An engine: its threads, bounce ring and device. Create with `kvx_engine_create`,
// free with `kvx_engine_destroy`.
typedef struct kvx_engine kvx_engine;

// A layout: block geometry plus the memory or file holding it. Reference counted inside
// kvxfer: `kvx_layout_destroy` drops the caller's reference, requests hold their own.
typedef struct kvx_layout kvx_layout;

// A submitted transfer. Free with `kvx_request_release` (the transfer still completes).
typedef struct kvx_request kvx_request;

// A store of KV blocks keyed by the runtime's keys, in one directory (1.4). Open with
// `kvx_store_open`, close with `kvx_store_close`.
typedef struct kvx_store kvx_store;

// A store put or get (1.4): one status per key. Not a `kvx_request`: one store call may
// be several transfers, and a key is settled only once its record is written or checked.
// Free with `kvx_store_request_release` (the call still completes).
typedef struct kvx_store_request kvx_store_request;

typedef struct kvx_engine_config {
  uint32_t struct_size;
  // CUDA ordinal, `KVX_DEVICE_AUTO` or `KVX_DEVICE_EMULATED`.
  int32_t device;
  // I/O worker threads; 0 = default (three quarters of the CPUs, clamped to 4..16).
  uint32_t io_threads;
  // `KVX_IO_*`.
  uint32_t io_backend;
  // Pinned bounce memory in total; 0 = default (64 MiB). A multiple of `slot_bytes`.
  uint64_t bounce_bytes;
  // One bounce slot; 0 = default (2 MiB). A power of two ≥ 64 KiB.
  uint64_t slot_bytes;
  // Requests admitted at once before submit says `KVX_ERR_BUSY`; 0 = default (1024).
  uint32_t max_inflight;
  // None defined yet; must be 0.
  uint32_t flags;
} kvx_engine_config;

// Outcome of a call: `KVX_OK` or one of the `KVX_ERR_*` codes (never reused).
typedef uint32_t kvx_status;

typedef struct kvx_stats {
  uint32_t struct_size;
  uint64_t requests_completed;
  uint64_t requests_failed;
  uint64_t requests_cancelled;
  uint64_t bytes_disk_read;
  uint64_t bytes_disk_written;
  uint64_t bytes_host_to_device;
  uint64_t bytes_device_to_host;
  // ABI 1.1: busy time per pipeline stage in nanoseconds, summed over the threads doing
  // it — divide by wall time for a stage's utilisation. Disk reads, disk writes, host
  // memcpy (pageable/pinned ↔ bounce slot), device copies from issue to completion,
  // and time the dispatcher waited for a free bounce slot.
  uint64_t disk_read_ns;
  uint64_t disk_write_ns;
  uint64_t host_copy_ns;
  uint64_t device_copy_ns;
  uint64_t slot_wait_ns;
  // ABI 1.4: bounce slots held out of the ring now, because a remote ↔ disk
  // transfer through each timed out or failed and NIXL has not reported it ended (it
  // may still read or write the slot). Such a slot comes back when NIXL reports the
  // transfer ended (a stalled peer that resumes); it stays out for good when NIXL
  // reported the transfer failed, its post failed, or the peer was imported again
  // first. At most all slots but one are held: past that, remote ↔ disk chunks end
  // with `KVX_ERR_REMOTE` while local work goes on.
  uint64_t slots_quarantined;
} kvx_stats;

typedef struct kvx_layout_config {
  uint32_t struct_size;
  // `KVX_LAYOUT_*`.
  uint32_t kind;
  uint64_t num_blocks;
  uint64_t num_layers;
  // 2 for separate K and V, 1 for MLA.
  uint64_t outer_dim;
  // Tokens per block.
  uint64_t page_size;
  // Elements per token (kv_heads × head_dim).
  uint64_t inner_dim;
  uint64_t dtype_bytes;
} kvx_layout_config;

// Called once when a request completes, with its final status, on a kvxfer thread (or
// inside `kvx_request_cancel` for a request that had not started). It must not block,
// must not throw, and must not destroy the engine; it may submit, poll and release.
// `kvx_request_wait`/`kvx_request_poll` report completion only after it returned, except
// inside it: there they return `status` for `req` at once. A wait with a non-zero timeout
// on another request of the same engine fails with `KVX_ERR_INVALID_ARG` from inside a
// callback (it could hold up the thread that completes that request); poll instead.
typedef void (*kvx_completion_fn)(void *user_data, struct kvx_request *req, kvx_status status);

typedef struct kvx_transfer_options {
  uint32_t struct_size;
  // First layer to move.
  uint32_t layer_begin;
  // One past the last layer to move; 0 means all layers.
  uint32_t layer_end;
  // `KVX_XFER_*`, or 0.
  uint32_t flags;
  // Optional completion callback.
  kvx_completion_fn on_complete;
  void *user_data;
  // ABI 1.1. Optional `CUevent` of the engine's device. Ordering: every device copy of
  // this transfer starts after the work the event marks *when kvx_transfer_submit is
  // called* (re-recording it later does not matter), so a runtime can record it right
  // after the kernels that wrote the KV blocks and submit the offload without
  // synchronising. Completion (callback, wait, poll) means every byte has arrived:
  // device memory written by an onboarding transfer is ready for any stream then.
  // NULL: no wait. It must be a valid event of the engine's device (the driver cannot
  // check arbitrary pointers); on the emulated device any non-NULL value is
  // `KVX_ERR_INVALID_ARG`.
  void *wait_event;
} kvx_transfer_options;

// Log sink: `level` is 1 error, 2 warn, 3 info, 4 debug, 5 trace; `target` and
// `message` are valid only during the call. Runs on any thread; must not block and must
// not call `kvx_set_logger` (refused); records kvxfer makes during the call are dropped.
typedef void (*kvx_log_fn)(void *user_data, uint32_t level, const char *target, const char *message);

// A shared tier under a store (1.7): KV blocks shared by any number of processes on any
// number of hosts, one object per block, verified on every read. Fill it with
// `kvx_shared_config_init`, then set `kind` and its location. Every string is the
// caller's, NUL-terminated, and read during `kvx_store_open` only.
typedef struct kvx_shared_config {
  uint32_t struct_size;
  // `KVX_SHARED_DIR` or `KVX_SHARED_S3`; 0 after `kvx_shared_config_init`: must be set.
  uint32_t kind;
  // `KVX_SHARED_DIR`: the shared directory (any bytes); made where missing, and this
  // process must be able to write in it. Must be set.
  const char *path;
  // `KVX_SHARED_DIR`: past this many bytes of objects, writers evict the least recently
  // used ones; 0 (the default): unbounded.
  uint64_t capacity_bytes;
  // `KVX_SHARED_S3`: `http(s)://host:port`; NULL or "": `AWS_ENDPOINT_URL`, else AWS's
  // own endpoint for the region.
  const char *endpoint;
  // `KVX_SHARED_S3`: NULL or "": `AWS_REGION`, else `AWS_DEFAULT_REGION`, else
  // `us-east-1`.
  const char *region;
  // `KVX_SHARED_S3`: the bucket; must be set. Credentials come from the standard AWS
  // environment variables and files, never from here.
  const char *bucket;
  // `KVX_SHARED_S3`: prepended to every object's name; NULL or "": none.
  const char *prefix;
  // Threads that run the backend's calls (1 to 256); 0 (the default): 16.
  uint32_t threads;
  // The longest a lookup or get waits for the shared tier, in milliseconds; past it,
  // its keys are misses (counted in `shared_timeouts`). 0 (the default): 5000.
  uint32_t timeout_ms;
  // `KVX_SHARED_WRITE_THROUGH`, `KVX_SHARED_NO_ADMIT`, or 0 (written behind, admitted).
  uint32_t flags;
  // Blocks waiting to be written behind, at most; past it, a put's objects are dropped
  // (counted in `shared_puts_dropped`). 0 (the default): 1024.
  uint32_t pending_puts;
} kvx_shared_config;

// How a store is opened (1.4). The block geometry, capacity, shard count and namespace
// are fixed when the store is made; reopening with others is `KVX_ERR_INCOMPATIBLE`
// naming which.
typedef struct kvx_store_config {
  uint32_t struct_size;
  // `KVX_STORE_*`; `kvx_store_config_init` sets `KVX_STORE_CREATE`.
  uint32_t flags;
  // The geometry of one block (its `kind` and `num_blocks` are ignored: blocks are
  // stored contiguous, `capacity_blocks` of them). The caller's; read during
  // `kvx_store_open` only. Must be set.
  const struct kvx_layout_config *block;
  // Blocks the store holds at most (1 to 2^26); must be set.
  uint64_t capacity_blocks;
  // Everything that makes two blocks with equal keys differ (model, dtype, layout,
  // TP/PP rank…), at most 256 bytes; NULL with `namespace_len` 0 is the empty one. The
  // caller's; read during `kvx_store_open` only.
  const uint8_t *namespace_bytes;
  uint32_t namespace_len;
  // Data files the blocks are spread over (1 to `capacity_blocks`); 1 by default.
  uint32_t shards;
  // ABI 1.7. A shared tier under the store: what the local store misses, a get loads
  // from it, and puts publish to it. NULL (the default): none. Not fixed when the store
  // is made: each open may name another, or none. The caller's; read during
  // `kvx_store_open` only. Refused with `KVX_STORE_DATA_ONLY`.
  const struct kvx_shared_config *shared;
} kvx_store_config;

// A store key (1.4): 1 to 64 opaque bytes naming a block's content (the same key always
// means the same bytes). `bytes` stays the caller's; it is read during the call only.
typedef struct kvx_key {
  const uint8_t *bytes;
  uint32_t len;
} kvx_key;

// What a store holds and has done since it was opened (1.4).
typedef struct kvx_store_counters {
  uint32_t struct_size;
  uint64_t entries;
  uint64_t capacity;
  // Keys gets loaded.
  uint64_t hits;
  // Keys gets did not load: not held, or a failed check.
  uint64_t misses;
  uint64_t evictions;
  // Failed checks and damage: damaged records found on open, the entries of a shard
  // found damaged on open (made anew), and gets whose block did not match its record or
  // its checksums or lay past the end of a file cut short (each also a miss).
  uint64_t integrity_failures;
  // Blocks written by puts.
  uint64_t puts;
  // Keys of puts that were held already (nothing written).
  uint64_t dedups;
  uint64_t removes;
  // Bytes of the blocks held (`entries` × block bytes).
  uint64_t bytes;
  // ABI 1.7: the shared tier's counters (all 0 without one). A key a get loads from
  // the shared tier counts in `hits` too; one it misses there counts in `misses` once.
  // Blocks read from the shared tier and checked.
  uint64_t shared_hits;
  // Shared-tier reads that found no object.
  uint64_t shared_misses;
  // Shared-tier objects that failed a check (damaged, cut short, of another namespace
  // or key): each a miss.
  uint64_t shared_integrity_failures;
  // Shared-tier calls whose caller stopped waiting at `timeout_ms`.
  uint64_t shared_timeouts;
  // Shared-tier calls that failed (the backend's error).
  uint64_t shared_errors;
  // Objects published to the shared tier.
  uint64_t shared_puts;
  // Objects not written: more were waiting than `pending_puts`, or the write failed.
  uint64_t shared_puts_dropped;
  // Calls made to the shared tier's backend (existence checks, reads, writes): what a
  // bucket bills.
  uint64_t shared_requests;
} kvx_store_counters;

// A slot handle (1.5): a slot of a store that its owner hands to a process which opened
// the store `KVX_STORE_DATA_ONLY`, to read (`kvx_store_lease_slots`) or to write
// (`kvx_store_reserve_slots`). Plain bytes of a fixed size (48) and layout for ABI 1:
// copy it, ship it to another process of the same host, pass it back unchanged.
typedef struct kvx_slot_handle {
  // The key's digest (xxh3-128, little-endian).
  uint8_t key_digest[16];
  // The entry's generation (a read handle) or the reservation's (a write handle).
  uint64_t generation;
  // The block's seal in a read handle; 0 in a write handle.
  uint64_t seal;
  // The owner's open that handed it out.
  uint64_t epoch;
  uint32_t slot;
  // The key's length in bytes.
  uint32_t key_len;
} kvx_slot_handle;

// Every function of ABI 1: the 1.0 functions, then each minor's additions
// (`docs/c-api.md#loading-kvxfer-as-a-plugin`). Append-only: new functions go at the end
// and raise `struct_size`; a caller built against an older table reads only its prefix.
typedef struct kvx_api {
  uint32_t struct_size;
  uint32_t abi_major;
  uint32_t abi_minor;
  uint32_t (*abi_version)(void);
  const char *(*version_string)(void);
  const char *(*status_str)(kvx_status);
  const char *(*last_error)(void);
  void (*engine_config_init)(struct kvx_engine_config*);
  kvx_status (*engine_create)(const struct kvx_engine_config*, struct kvx_engine**);
  void (*engine_destroy)(struct kvx_engine*);
  kvx_status (*engine_device)(const struct kvx_engine*, int32_t*);
  void (*layout_config_init)(struct kvx_layout_config*);
  kvx_status (*layout_create_device)(struct kvx_engine*,
                                     const struct kvx_layout_config*,
                                     struct kvx_layout**);
  kvx_status (*layout_create_host)(struct kvx_engine*,
                                   const struct kvx_layout_config*,
                                   uint32_t,
                                   struct kvx_layout**);
  kvx_status (*layout_create_disk)(struct kvx_engine*,
                                   const struct kvx_layout_config*,
                                   const char*,
                                   uint32_t,
                                   struct kvx_layout**);
  kvx_status (*layout_register_device)(struct kvx_engine*,
                                       const struct kvx_layout_config*,
                                       const uint64_t*,
                                       size_t,
                                       struct kvx_layout**);
  kvx_status (*layout_register_host)(struct kvx_engine*,
                                     const struct kvx_layout_config*,
                                     void*const *,
                                     size_t,
                                     uint32_t,
                                     struct kvx_layout**);
  kvx_status (*layout_block_bytes)(const struct kvx_layout*, uint64_t*);
  kvx_status (*layout_base)(const struct kvx_layout*, uint64_t, uint64_t*);
  void (*layout_destroy)(struct kvx_layout*);
  void (*transfer_options_init)(struct kvx_transfer_options*);
  kvx_status (*transfer_submit)(struct kvx_engine*,
                                const struct kvx_layout*,
                                const uint64_t*,
                                const struct kvx_layout*,
                                const uint64_t*,
                                size_t,
                                const struct kvx_transfer_options*,
                                struct kvx_request**);
  kvx_status (*request_wait)(struct kvx_request*, uint64_t);
  kvx_status (*request_poll)(const struct kvx_request*);
  kvx_status (*request_cancel)(struct kvx_request*);
  const char *(*request_error)(const struct kvx_request*);
  void (*request_release)(struct kvx_request*);
  kvx_status (*engine_stats)(const struct kvx_engine*, struct kvx_stats*);
  kvx_status (*set_logger)(kvx_log_fn, void*, uint32_t);
  // ABI 1.1.
  kvx_status (*engine_io_backend)(const struct kvx_engine*, uint32_t*);
  // ABI 1.1.
  kvx_status (*engine_config_get)(const struct kvx_engine*, struct kvx_engine_config*);
  // ABI 1.3.
  kvx_status (*engine_export)(struct kvx_engine*,
                              const struct kvx_layout*const *,
                              size_t,
                              struct kvx_blob**);
  // ABI 1.3.
  const uint8_t *(*blob_bytes)(const struct kvx_blob*, size_t*);
  // ABI 1.3.
  void (*blob_destroy)(struct kvx_blob*);
  // ABI 1.3.
  kvx_status (*engine_import)(struct kvx_engine*,
                              const uint8_t*,
                              size_t,
                              uint32_t,
                              struct kvx_layout**,
                              size_t,
                              size_t*);
  // ABI 1.4.
  void (*store_config_init)(struct kvx_store_config*);
  // ABI 1.4.
  kvx_status (*store_open)(struct kvx_engine*,
                           const char*,
                           const struct kvx_store_config*,
                           struct kvx_store**);
  // ABI 1.4.
  void (*store_close)(struct kvx_store*);
  // ABI 1.4.
  kvx_status (*store_lookup)(struct kvx_store*,
                             const struct kvx_key*,
                             size_t,
                             uint32_t,
                             uint8_t*,
                             size_t*);
  // ABI 1.4.
  kvx_status (*store_release_leases)(struct kvx_store*, const struct kvx_key*, size_t);
  // ABI 1.4.
  kvx_status (*store_put)(struct kvx_store*,
                          const struct kvx_layout*,
                          const uint64_t*,
                          const struct kvx_key*,
                          size_t,
                          const struct kvx_transfer_options*,
                          struct kvx_store_request**);
  // ABI 1.4.
  kvx_status (*store_get)(struct kvx_store*,
                          const struct kvx_key*,
                          size_t,
                          const struct kvx_layout*,
                          const uint64_t*,
                          const struct kvx_transfer_options*,
                          struct kvx_store_request**);
  // ABI 1.4.
  kvx_status (*store_remove)(struct kvx_store*, const struct kvx_key*, size_t, kvx_status*);
  // ABI 1.4.
  kvx_status (*store_stats)(struct kvx_store*, struct kvx_store_counters*);
  // ABI 1.4.
  kvx_status (*store_request_wait)(struct kvx_store_request*, uint64_t);
  // ABI 1.4.
  kvx_status (*store_request_poll)(const struct kvx_store_request*);
  // ABI 1.4.
  kvx_status (*store_request_key_status)(const struct kvx_store_request*, size_t, kvx_status*);
  // ABI 1.4.
  const char *(*store_request_key_error)(const struct kvx_store_request*, size_t);
  // ABI 1.4.
  const char *(*store_request_error)(const struct kvx_store_request*);
  // ABI 1.4.
  void (*store_request_release)(struct kvx_store_request*);
  // ABI 1.5.
  kvx_status (*engine_completion_fd)(const struct kvx_engine*, int32_t*);
  // ABI 1.5.
  kvx_status (*store_lease_slots)(struct kvx_store*,
                                  const struct kvx_key*,
                                  size_t,
                                  struct kvx_slot_handle*,
                                  uint8_t*);
  // ABI 1.5.
  kvx_status (*store_reserve_slots)(struct kvx_store*,
                                    const struct kvx_key*,
                                    size_t,
                                    struct kvx_slot_handle*,
                                    uint32_t*);
  // ABI 1.5.
  kvx_status (*store_commit_slots)(struct kvx_store*,
                                   const struct kvx_slot_handle*,
                                   size_t,
                                   kvx_status*);
  // ABI 1.5.
  kvx_status (*store_abort_slots)(struct kvx_store*, const struct kvx_slot_handle*, size_t);
  // ABI 1.5.
  kvx_status (*store_read_slots)(struct kvx_store*,
                                 const struct kvx_slot_handle*,
                                 size_t,
                                 const struct kvx_layout*,
                                 const uint64_t*,
                                 const struct kvx_transfer_options*,
                                 struct kvx_store_request**);
  // ABI 1.5.
  kvx_status (*store_write_slots)(struct kvx_store*,
                                  const struct kvx_layout*,
                                  const uint64_t*,
                                  const struct kvx_slot_handle*,
                                  size_t,
                                  const struct kvx_transfer_options*,
                                  struct kvx_store_request**);
  // ABI 1.6.
  kvx_status (*store_lease)(struct kvx_store*, const struct kvx_key*, size_t, uint64_t*, size_t*);
  // ABI 1.6.
  kvx_status (*store_release)(struct kvx_store*, const uint64_t*, size_t);
  // ABI 1.7.
  void (*shared_config_init)(struct kvx_shared_config*);
} kvx_api;

#define KVX_OK 0

// The request has not completed yet.
#define KVX_PENDING 1

// NULL, zero sizes, mismatched counts, bad enum value, too-small `struct_size`.
#define KVX_ERR_INVALID_ARG 2

// Block id ≥ num_blocks, or a layer range outside the layout.
#define KVX_ERR_OUT_OF_RANGE 3

// Source and destination layouts differ in block geometry.
#define KVX_ERR_INCOMPATIBLE 4

// Asked for a backend or feature that this machine or build lacks.
#define KVX_ERR_UNSUPPORTED 5

#define KVX_ERR_NO_DEVICE 6

#define KVX_ERR_CUDA 7

#define KVX_ERR_IO 8

#define KVX_ERR_NO_MEMORY 9

#define KVX_ERR_TIMEOUT 10

#define KVX_ERR_CANCELLED 11

#define KVX_ERR_SHUTDOWN 12

// `max_inflight` requests are already admitted; retry after one completes.
#define KVX_ERR_BUSY 13

// Data read back is not what was written (checksum).
#define KVX_ERR_INTEGRITY 14

#define KVX_ERR_VERSION 15

#define KVX_ERR_INTERNAL 16

// A remote peer (an imported layout's engine) failed a transfer, did not answer within
// the import's timeout, or exited; or its import was closed by such a transfer or
// replaced; or too many bounce slots are held by such transfers (`slots_quarantined`)
// for a remote ↔ disk chunk to take one. Local work is unaffected. Re-import its blob
// once it is back. (1.3)
#define KVX_ERR_REMOTE 17

// A key the store does not hold: a key's status after a get or a remove, never a whole
// call's. (1.4)
#define KVX_ERR_NOT_FOUND 18

#ifdef __cplusplus
extern "C" {
#endif // __cplusplus

// Fills `cfg` with `struct_size` and the defaults (automatic device, default sizes).
// NULL is ignored.
void kvx_engine_config_init(struct kvx_engine_config *cfg);

// Starts an engine: resolves the device, allocates the pinned bounce ring and starts its
// threads. `cfg` may be NULL for defaults. On success `*out` owns the engine; free it
// with `kvx_engine_destroy`.
kvx_status kvx_engine_create(const struct kvx_engine_config *cfg, struct kvx_engine **out);

// Cancels requests that have not started, waits for those that have, joins the threads
// and frees the engine. Layouts and requests made from it must not be used afterwards,
// except that they may still be destroyed/released. NULL is a no-op. Should not be
// called from one of this engine's own completion callbacks: there it cannot wait for
// its threads, so it returns at once and the shutdown finishes in the background.
// Close the engine's stores first: a store still open keeps the engine's memory until
// `kvx_store_close`, its puts and gets in flight end (cancelled where they had not
// started), and every later call on it but `kvx_store_close` is `KVX_ERR_SHUTDOWN`.
void kvx_engine_destroy(struct kvx_engine *e);

// The device the engine resolved: a CUDA ordinal, or -1 for the emulated device.
kvx_status kvx_engine_device(const struct kvx_engine *e, int32_t *device_out);

// ABI 1.1. The disk I/O backend the engine uses: `KVX_IO_POSIX`, `KVX_IO_URING`,
// `KVX_IO_NIXL` or `KVX_IO_GDS` (`KVX_IO_AUTO` resolves to one of them; the log says
// which and why the others were not taken).
kvx_status kvx_engine_io_backend(const struct kvx_engine *e, uint32_t *backend_out);

// ABI 1.1. The settings the engine runs with, defaults filled in and `io_backend`
// resolved (what `KVX_IO_AUTO` chose), so a caller can size its own work (a benchmark's
// baselines, say) to match. Set `out->struct_size` first (to `sizeof(kvx_engine_config)`).
kvx_status kvx_engine_config_get(const struct kvx_engine *e, struct kvx_engine_config *out);

// Copies the engine's counters into `*out`. Set `out->struct_size` first (to
// `sizeof(kvx_stats)`); fields beyond it are not written.
kvx_status kvx_engine_stats(const struct kvx_engine *e, struct kvx_stats *out);

// (1.5) The engine's completion fd: an eventfd (non-blocking, close-on-exec) that
// becomes readable once a request of this engine has ended since it was last read — a
// transfer, or a put, get, slot read or slot write of a store on this engine. For a
// caller that waits on many things at once (poll, epoll, an event loop): when it is
// readable, read 8 bytes from it (the count of ends, which resets it), then poll the
// requests it waits for. A request ends (its status is final) before it makes the fd
// readable, so one that ends after the read makes it readable again: no end is missed.
// The fd is made by the first call, and ends before that are not counted: poll the
// requests submitted before it once. Each call returns the same fd.
// The engine owns it: do not close it; `kvx_engine_destroy` closes it (unregister it
// from your poller first). `KVX_ERR_SHUTDOWN` once the engine is shutting down.
kvx_status kvx_engine_completion_fd(const struct kvx_engine *e, int32_t *fd_out);

// Fills `cfg` with `struct_size`, kind `KVX_LAYOUT_FULLY_CONTIGUOUS` and zero dimensions
// (every dimension must then be set). NULL is ignored.
void kvx_layout_config_init(struct kvx_layout_config *cfg);

// Allocates device memory for the layout (kvxfer owns and frees it). `*out` is freed
// with `kvx_layout_destroy`.
kvx_status kvx_layout_create_device(struct kvx_engine *e,
                                    const struct kvx_layout_config *c,
                                    struct kvx_layout **out);

// Allocates host memory for the layout, page-locked with `KVX_HOST_PINNED` (kvxfer owns
// and frees it). `*out` is freed with `kvx_layout_destroy`.
kvx_status kvx_layout_create_host(struct kvx_engine *e,
                                  const struct kvx_layout_config *c,
                                  uint32_t flags,
                                  struct kvx_layout **out);

// A disk layout in the file at `path` (UTF-8 or any bytes, NUL-terminated), always fully
// contiguous with each block padded to the direct-I/O alignment (`kind` is ignored).
// `flags` are `KVX_DISK_*`: without `KVX_DISK_CREATE` the file must exist and be large
// enough, and is never truncated. `*out` is freed with `kvx_layout_destroy`.
kvx_status kvx_layout_create_disk(struct kvx_engine *e,
                                  const struct kvx_layout_config *c,
                                  const char *path,
                                  uint32_t flags,
                                  struct kvx_layout **out);

// Wraps caller-owned device memory (e.g. the runtime's KV pool): one base for fully
// contiguous, `num_layers` bases for layer-separate kinds. kvxfer never frees it; it must
// outlive every request that uses the layout.
kvx_status kvx_layout_register_device(struct kvx_engine *e,
                                      const struct kvx_layout_config *c,
                                      const uint64_t *bases,
                                      size_t num_bases,
                                      struct kvx_layout **out);

// Wraps caller-owned host memory; `KVX_HOST_PINNED` says it is already page-locked.
// Bases as for `kvx_layout_register_device`. kvxfer never frees it.
kvx_status kvx_layout_register_host(struct kvx_engine *e,
                                    const struct kvx_layout_config *c,
                                    void *const *bases,
                                    size_t num_bases,
                                    uint32_t flags,
                                    struct kvx_layout **out);

// Bytes of one block (all layers, K and V): `num_layers × outer_dim × page_size ×
// inner_dim × dtype_bytes`.
kvx_status kvx_layout_block_bytes(const struct kvx_layout *l, uint64_t *out);

// Base address of one layer's allocation (layer 0 for fully contiguous): a device
// pointer, or a host pointer for host and emulated-device layouts, and for a
// `KVX_DISK_MAPPED` layout the file's mapping (blocks at the file's offsets). Other disk
// layouts have none (`KVX_ERR_UNSUPPORTED`).
kvx_status kvx_layout_base(const struct kvx_layout *l, uint64_t layer, uint64_t *addr_out);

// Drops the caller's reference. Memory kvxfer allocated (and a file it created without
// `KVX_DISK_KEEP`) goes away once no request uses the layout. NULL is a no-op.
void kvx_layout_destroy(struct kvx_layout *l);

// Fills `o` with `struct_size` and the defaults: all layers, no flags, no callback.
// NULL is ignored.
void kvx_transfer_options_init(struct kvx_transfer_options *o);

// Moves blocks `src_blocks[i]` of `src` to `dst_blocks[i]` of `dst`, i < `num_blocks`,
// asynchronously. Everything that can be checked is checked before anything starts
// (counts, ids, duplicate destinations, geometry, layer range). `opts` may be NULL.
// On success `*out` is the request; free it with `kvx_request_release`.
kvx_status kvx_transfer_submit(struct kvx_engine *e,
                               const struct kvx_layout *src,
                               const uint64_t *src_blocks,
                               const struct kvx_layout *dst,
                               const uint64_t *dst_blocks,
                               size_t num_blocks,
                               const struct kvx_transfer_options *opts,
                               struct kvx_request **out);

// Waits up to `timeout_ns` (`UINT64_MAX`: forever) and returns the request's final
// status, or `KVX_ERR_TIMEOUT` if it is still running. 0 polls. From inside a completion
// callback: the callback's own request returns its status at once; another request of
// the same engine is `KVX_ERR_INVALID_ARG` unless `timeout_ns` is 0.
kvx_status kvx_request_wait(struct kvx_request *r, uint64_t timeout_ns);

// `KVX_PENDING` until the request completes, then its final status.
kvx_status kvx_request_poll(const struct kvx_request *r);

// Asks the request to stop: stages not yet started are skipped and its final status is
// `KVX_ERR_CANCELLED` (unless it already completed or failed). Does not wait; the
// destination's contents are then unspecified.
kvx_status kvx_request_cancel(struct kvx_request *r);

// The failure message of a failed or cancelled request, "" otherwise (never NULL).
// Valid until `kvx_request_release`.
const char *kvx_request_error(const struct kvx_request *r);

// Drops the caller's reference; a running transfer still completes (and its callback
// still runs). NULL is a no-op.
void kvx_request_release(struct kvx_request *r);

// Sends kvxfer's log records at or below `max_level` (1 error … 5 trace; 0 off) to `log_fn`,
// which runs on any kvxfer thread and must not block. When this returns, the callback
// it replaced has returned everywhere and is never called again. It must not be called
// from the log callback (`KVX_ERR_INVALID_ARG`). `log_fn` NULL restores the default:
// stderr, filtered by the `KVX_LOG` environment variable (default warn) and `max_level`.
kvx_status kvx_set_logger(kvx_log_fn log_fn, void *user_data, uint32_t max_level);

// Exports `layouts` (device, pinned or host memory layouts of `engine`) as one blob
// that another engine — in this process, another one, or on another host — imports
// with `kvx_engine_import` to reach exactly these layouts (and no other memory of this
// engine). Moving the bytes to the peer is the caller's business (a socket, a file,
// the runtime's control plane). Each export is newer than the last: a peer importing
// it replaces what it imported from this engine before. The layouts stay reachable
// while they live. `*out` is freed with `kvx_blob_destroy`. `KVX_ERR_UNSUPPORTED` with
// the reason when NIXL or its UCX plugin is not found at run time. (1.3)
kvx_status kvx_engine_export(struct kvx_engine *e,
                             const struct kvx_layout *const *layouts,
                             size_t num_layouts,
                             struct kvx_blob **out);

// The blob's bytes and, in `*len`, their count. Valid until `kvx_blob_destroy`.
// NULL (and `*len` 0) for a NULL blob.
const uint8_t *kvx_blob_bytes(const struct kvx_blob *blob, size_t *len);

// Frees a blob; NULL is a no-op.
void kvx_blob_destroy(struct kvx_blob *blob);

// Imports a peer's blob (`blob_len` bytes): writes one layout handle per exported
// layout, in export order, to `layouts[0..*num_layouts]` (at most `capacity`; with
// `layouts` NULL and `capacity` 0 it only sets `*num_layouts`, after the same checks,
// and imports nothing).
// The handles are used in `kvx_transfer_submit` like local ones, with a local memory
// or disk layout on the other side; each is freed with `kvx_layout_destroy`.
// `timeout_ms`: how long one transfer with this peer may take before its request ends
// with `KVX_ERR_REMOTE` (0: 10 000). A transfer that times out or fails also closes
// the import: later submits with its handles fail with `KVX_ERR_REMOTE` until the
// peer's blob is imported again. A newer blob of the same peer (or the same blob
// again) replaces the older import: transfers with the older handles are then
// refused, and those still running end with `KVX_ERR_REMOTE`. `KVX_ERR_INVALID_ARG`
// with the reason for a damaged, truncated or foreign blob, one of another ABI major,
// an older export than the one imported, or this engine's own blob;
// `KVX_ERR_UNSUPPORTED` without NIXL/UCX; `KVX_ERR_REMOTE` when NIXL fails to load
// metadata it had accepted on a checking agent, or fails to start (import again). (1.3)
kvx_status kvx_engine_import(struct kvx_engine *e,
                             const uint8_t *blob,
                             size_t blob_len,
                             uint32_t timeout_ms,
                             struct kvx_layout **layouts,
                             size_t capacity,
                             size_t *num_layouts);

// Fills `cfg` with `struct_size` and the defaults: `KVX_STORE_CREATE`, one shard, no
// namespace, no shared tier; `block` and `capacity_blocks` must then be set. NULL is
// ignored.
void kvx_store_config_init(struct kvx_store_config *cfg);

// Fills `cfg` with `struct_size` and the defaults (1.7): every field 0 and every string
// NULL, which mean 16 threads, a 5000 ms bound, written behind, admitted, 1024 pending
// puts, an unbounded directory; `kind` and its location must then be set. NULL is
// ignored.
void kvx_shared_config_init(struct kvx_shared_config *cfg);

// Opens the store in the directory `dir` (UTF-8 or any bytes, NUL-terminated), or makes
// it there with `KVX_STORE_CREATE`. The process then owns the store until
// `kvx_store_close`: a second open of it, here or in another process, is
// `KVX_ERR_BUSY` naming the owner's pid; `KVX_STORE_DATA_ONLY` (1.5) opens a store
// another process owns, to move the slots it hands out. A store made with another geometry, capacity,
// shard count or namespace is `KVX_ERR_INCOMPATIBLE` naming which. The store keeps the
// engine's memory alive until it is closed (see `kvx_engine_destroy`). With
// `cfg->shared` (1.7) the store opens over the shared tier it names: a kind, flag or
// location that is not set or not known is `KVX_ERR_INVALID_ARG` saying which; a shared
// directory that cannot be made or written `KVX_ERR_IO`; a kind this build lacks
// `KVX_ERR_UNSUPPORTED`. `cfg`, `dir` and what they point to are read during the call
// only. On success `*out` is the store; close it with `kvx_store_close`.
kvx_status kvx_store_open(struct kvx_engine *e,
                          const char *dir,
                          const struct kvx_store_config *cfg,
                          struct kvx_store **out);

// Waits for the store's puts and gets in flight, stops its thread, gives up the
// directory and frees the store; its requests may still be polled and released. NULL
// is a no-op. The store must not be used afterwards, and must not be closed from a
// completion callback (it waits for transfers that such a thread completes).
void kvx_store_close(struct kvx_store *s);

// Looks up `keys[i]`, i < `n`: `present_out[i]` is 1 where the store holds the key, else
// 0, and `*leading_hits_out` the number of leading keys held (a prefix's hits).
// `flags`: 0 or `KVX_LOOKUP_LEASE`, which leases each hit (released by a get of the key
// or `kvx_store_release_leases`). Reads no block. `present_out` holds `n` bytes;
// outputs are written only on `KVX_OK`.
kvx_status kvx_store_lookup(struct kvx_store *s,
                            const struct kvx_key *ks,
                            size_t n,
                            uint32_t flags,
                            uint8_t *present_out,
                            size_t *leading_hits_out);

// Gives back the oldest lease taken by key (`KVX_LOOKUP_LEASE`, `kvx_store_lease_slots`)
// of each of `keys[i]`, i < `n` (a key without one is skipped). Leases taken by key
// belong to the key, not to a caller: any get of the key spends one on the slot it
// loads. Several holders of one key use `kvx_store_lease` instead.
kvx_status kvx_store_release_leases(struct kvx_store *s, const struct kvx_key *ks, size_t n);

// Leases each hit of `keys[i]`, i < `n`, for the caller alone (1.6): `leases_out[i]` is
// the lease's token (never 0) where the store holds the key, else 0, and
// `*leading_hits_out` the number of leading keys held. A leased hit stays loadable
// (neither evicted nor its slot reused) until its token is given back with
// `kvx_store_release`; no get, and no other caller's release, spends it. To load a leased
// hit, submit its get, then release the lease (the get holds the slot from its submit).
// Owner only. `leases_out` holds `n` elements; outputs are written only on `KVX_OK`.
kvx_status kvx_store_lease(struct kvx_store *s,
                           const struct kvx_key *ks,
                           size_t n,
                           uint64_t *leases_out,
                           size_t *leading_hits_out);

// Gives back the leases `leases[i]`, i < `n`, from `kvx_store_lease` (1.6); a 0 is
// skipped. All or none: a token not held (given back already, listed twice, or of another
// open of the store) is `KVX_ERR_INVALID_ARG`, naming it, and nothing is given back.
kvx_status kvx_store_release(struct kvx_store *s, const uint64_t *leases, size_t n);

// Stores block `src_ids[i]` of `src` under `keys[i]`, i < `n`, asynchronously. Whole
// blocks only (a layer range in `opts` is refused); `opts` may be NULL and takes no
// completion callback. Everything that can be checked is checked before anything starts
// (key lengths, ids, geometry). Per key (`kvx_store_request_key_status`): `KVX_OK` once
// its block and record are written (synced with `KVX_STORE_DURABLE`), also for a key
// held already (nothing written); `KVX_ERR_BUSY` when the store is full of held entries;
// `KVX_ERR_CANCELLED` when it was removed while its put was in flight; else the
// transfer's status. `src` must stay valid until the request is done (the store holds a
// reference to it; caller memory a registered layout wraps must outlive it). On success
// `*out_request` is the request; free it with `kvx_store_request_release`.
kvx_status kvx_store_put(struct kvx_store *s,
                         const struct kvx_layout *src,
                         const uint64_t *src_ids,
                         const struct kvx_key *ks,
                         size_t n,
                         const struct kvx_transfer_options *opts,
                         struct kvx_store_request **out_request);

// Loads the block of `keys[i]` into block `dst_ids[i]` of `dst`, i < `n`,
// asynchronously; `opts` may be NULL and takes no completion callback. Per key:
// `KVX_OK` once its bytes are in `dst` and checked against the record they were stored
// with; `KVX_ERR_NOT_FOUND` for a key not held; `KVX_ERR_INTEGRITY` for a block that
// failed a check (a miss: the entry is dropped, the other keys still load); else the
// transfer's status. A destination block of a key that did not load holds unspecified
// bytes. `dst` as `src` of `kvx_store_put`. On success `*out_request` is the request;
// free it with `kvx_store_request_release`.
kvx_status kvx_store_get(struct kvx_store *s,
                         const struct kvx_key *ks,
                         size_t n,
                         const struct kvx_layout *dst,
                         const uint64_t *dst_ids,
                         const struct kvx_transfer_options *opts,
                         struct kvx_store_request **out_request);

// Removes `keys[i]`, i < `n`: `statuses_out[i]` is `KVX_OK` once its removal is recorded
// (synced with `KVX_STORE_DURABLE`), so it never comes back, or `KVX_ERR_NOT_FOUND` for
// a key not held. A leased key, or one a get is loading, leaves the index at once; its
// slot is reused only after those leases and gets end. `statuses_out` holds `n`
// statuses, written only on `KVX_OK`.
kvx_status kvx_store_remove(struct kvx_store *s,
                            const struct kvx_key *ks,
                            size_t n,
                            kvx_status *statuses_out);

// Copies the store's counters into `*out`. Set `out->struct_size` first (to
// `sizeof(kvx_store_counters)`); fields beyond it are not written.
kvx_status kvx_store_stats(struct kvx_store *s, struct kvx_store_counters *out);

// Waits up to `timeout_ns` (`UINT64_MAX`: forever; 0 polls) until every key has its
// status, and returns the request's: `KVX_OK` when every key is `KVX_OK`, else the status
// of the first key (by index) that is not, its message (naming the key) as the last
// error; `KVX_ERR_TIMEOUT` while keys are still pending. From inside a completion callback
// of the store's engine it is `KVX_ERR_INVALID_ARG` unless `timeout_ns` is 0 (the callback
// may hold the thread the request needs).
kvx_status kvx_store_request_wait(struct kvx_store_request *r, uint64_t timeout_ns);

// `KVX_PENDING` until every key has its status, then the request's status (as
// `kvx_store_request_wait`).
kvx_status kvx_store_request_poll(const struct kvx_store_request *r);

// Key `i`'s status into `*status_out`: `KVX_PENDING` until its part is done, then
// `KVX_OK` or why it alone failed. `KVX_ERR_OUT_OF_RANGE` for `i` past the request's keys.
kvx_status kvx_store_request_key_status(const struct kvx_store_request *r,
                                        size_t i,
                                        kvx_status *status_out);

// Why key `i` failed, once the whole request is done; "" before, for a key that
// succeeded, or for `i` past the keys (never NULL). Valid until
// `kvx_store_request_release`.
const char *kvx_store_request_key_error(const struct kvx_store_request *r, size_t i);

// The first failed key's message, naming its index, once the request is done; ""
// before or when every key succeeded (never NULL). Valid until
// `kvx_store_request_release`.
const char *kvx_store_request_error(const struct kvx_store_request *r);

// Frees the handle; the put or get still completes (a store close waits for it). NULL is
// a no-op.
void kvx_store_request_release(struct kvx_store_request *r);

// As `kvx_store_lookup` with `KVX_LOOKUP_LEASE`, for a data-only process: where the
// store holds `keys[i]`, i < `n`, `present_out[i]` is 1 and `handles_out[i]` the handle to
// read it with (`kvx_store_read_slots` in any process); else 0 and a zeroed handle. Each
// hit stays leased (neither evicted nor its slot reused) until
// `kvx_store_release_leases`. Owner only. `handles_out` and `present_out` hold `n`
// elements, written only on `KVX_OK`.
kvx_status kvx_store_lease_slots(struct kvx_store *s,
                                 const struct kvx_key *ks,
                                 size_t n,
                                 struct kvx_slot_handle *handles_out,
                                 uint8_t *present_out);

// Reserves a slot for each of `keys[i]`, i < `n`, not held, as a put would (evicting the
// least recently used entry nothing holds), for a data-only process to write with
// `kvx_store_write_slots`; `kvx_store_commit_slots` then makes them entries, or
// `kvx_store_abort_slots` gives them back. `reservations_out[i]` is `KVX_RESERVED_WRITE`
// (and `handles_out[i]` the handle to write with), `KVX_RESERVED_HELD`,
// `KVX_RESERVED_IN_FLIGHT` or `KVX_RESERVED_NO_ROOM` (a zeroed handle for these). A
// reservation neither committed nor aborted keeps its slot until the owner reopens the
// store. Owner only. `handles_out` and `reservations_out` hold `n` elements, written
// only on `KVX_OK`.
kvx_status kvx_store_reserve_slots(struct kvx_store *s,
                                   const struct kvx_key *ks,
                                   size_t n,
                                   struct kvx_slot_handle *handles_out,
                                   uint32_t *reservations_out);

// Makes the slots of write handles `handles[i]`, i < `n`, entries once their writes
// completed: `statuses_out[i]` is `KVX_OK`; `KVX_ERR_INVALID_ARG` for a handle this open
// did not reserve (already committed or aborted, from an earlier open of the store, or
// never handed out); `KVX_ERR_INTEGRITY` for a block not completely written through this
// handle (its write did not finish, or another write of the slot landed on it: never an
// entry over other bytes); `KVX_ERR_CANCELLED` for a key removed meanwhile. Owner only.
// In a `KVX_STORE_DURABLE` store the blocks' data files are synced before their records
// are written, whether or not the data process opened the store durable.
// A handle of a slot past the capacity is `KVX_ERR_OUT_OF_RANGE` for the call.
// `statuses_out` holds `n` statuses, written only on `KVX_OK`.
kvx_status kvx_store_commit_slots(struct kvx_store *s,
                                  const struct kvx_slot_handle *handles,
                                  size_t n,
                                  kvx_status *statuses_out);

// Gives back the reserved slots of write handles `handles[i]`, i < `n`, unwritten (a
// handle not reserved is skipped; one naming a slot past the capacity fails the call,
// `KVX_ERR_OUT_OF_RANGE`, before any is given back). A write of one still in flight
// cannot be committed under the key its slot goes to next. Owner only.
kvx_status kvx_store_abort_slots(struct kvx_store *s,
                                 const struct kvx_slot_handle *handles,
                                 size_t n);

// Loads the slots of read handles `handles[i]`, i < `n`, into block `dst_ids[i]` of
// `dst`, asynchronously (in a data-only open, or the owner's). Per key: `KVX_OK`, or
// `KVX_ERR_INTEGRITY` where the slot no longer holds the entry the handle names, or its
// block fails its checksums (a miss); else the transfer's status. `opts` and `dst` as for
// `kvx_store_get`. A handle of a slot past the capacity is `KVX_ERR_OUT_OF_RANGE`. On
// success `*out_request` is the request; free it with `kvx_store_request_release`.
kvx_status kvx_store_read_slots(struct kvx_store *s,
                                const struct kvx_slot_handle *handles,
                                size_t n,
                                const struct kvx_layout *dst,
                                const uint64_t *dst_ids,
                                const struct kvx_transfer_options *opts,
                                struct kvx_store_request **out_request);

// Writes block `src_ids[i]` of `src` to the slot of write handle `handles[i]`, i < `n`,
// asynchronously; the owner then commits (or aborts) the handles. Whole blocks only; a
// handle is written once. Per key: `KVX_OK` once its block is written and sealed, else the
// transfer's status. `opts` and `src` as for `kvx_store_put`. A handle of a slot past
// the capacity is `KVX_ERR_OUT_OF_RANGE`; one that is no write handle (zeroed, as
// `kvx_store_reserve_slots` leaves those of keys it gave no slot, or a read handle)
// `KVX_ERR_INVALID_ARG`, and nothing is written. On success `*out_request` is the request; free
// it with `kvx_store_request_release`.
kvx_status kvx_store_write_slots(struct kvx_store *s,
                                 const struct kvx_layout *src,
                                 const uint64_t *src_ids,
                                 const struct kvx_slot_handle *handles,
                                 size_t n,
                                 const struct kvx_transfer_options *opts,
                                 struct kvx_store_request **out_request);

// `(KVX_ABI_MAJOR << 16) | KVX_ABI_MINOR` of the loaded library.
uint32_t kvx_abi_version(void);

// e.g. "kvxfer 1.4.0 abi 1.4 (cuda: driver 13.0)" or "... (cuda: none)". Static; never NULL.
const char *kvx_version_string(void);

// The constant's name ("KVX_ERR_IO"), or "KVX_UNKNOWN_STATUS". Static; never NULL.
const char *kvx_status_str(kvx_status s);

// The calling thread's message for its last failed call; "" when there was none. Never
// NULL; valid until this thread's next failing kvxfer call.
const char *kvx_last_error(void);

// The function table for ABI major `abi_major`, or NULL for any other major (the caller
// should then refuse to load this library). Static; never freed.
const struct kvx_api *kvx_get_api(uint32_t abi_major);

#ifdef __cplusplus
}  // extern "C"
#endif  // __cplusplus

#endif  /* KVXFER_H */
