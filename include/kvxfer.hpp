// kvxfer.hpp — header-only C++17 wrapper over the C ABI in kvxfer.h.
//
// Ownership: kvx::Engine, kvx::Layout, kvx::Request, kvx::Store and kvx::StoreRequest own
// their handle (std::unique_ptr with the C destroy/close/release function) and are
// move-only.
// Errors: every failing call throws kvx::Error, which carries the kvx_status and the
// library's message (kvx_last_error() or the request's own). The exceptions to throwing
// are Request::wait_for() and StoreRequest::wait_for(), which return the status so
// callers can poll and handle KVX_ERR_TIMEOUT without exceptions.
// Threads: as in C, every call is thread-safe; a Request may be waited on from any thread.
#ifndef KVXFER_HPP
#define KVXFER_HPP

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "kvxfer.h"

namespace kvx {

class Error : public std::runtime_error {
 public:
  Error(kvx_status status, const std::string &what)
      : std::runtime_error(std::string(kvx_status_str(status)) + ": " + what), status_(status) {}
  kvx_status status() const noexcept { return status_; }

 private:
  kvx_status status_;
};

// Throws kvx::Error unless `s` is KVX_OK, with this thread's last error as the message.
inline void check(kvx_status s) {
  if (s != KVX_OK) throw Error(s, kvx_last_error());
}

namespace detail {
struct EngineDelete { void operator()(kvx_engine *e) const noexcept { kvx_engine_destroy(e); } };
struct LayoutDelete { void operator()(kvx_layout *l) const noexcept { kvx_layout_destroy(l); } };
struct RequestDelete { void operator()(kvx_request *r) const noexcept { kvx_request_release(r); } };
struct StoreDelete { void operator()(kvx_store *s) const noexcept { kvx_store_close(s); } };
struct StoreRequestDelete { void operator()(kvx_store_request *r) const noexcept { kvx_store_request_release(r); } };
}  // namespace detail

// A kvx_layout_config filled by field name, member by member or chained:
//   kvx::layout_config c;  // kind KVX_LAYOUT_FULLY_CONTIGUOUS, every dimension 0
//   c.num_blocks = 1024;
// or
//   auto c = kvx::layout_config().set_num_blocks(1024).set_num_layers(24).set_outer_dim(2)
//                .set_page_size(32).set_inner_dim(4096).set_dtype_bytes(2);
// It is a kvx_layout_config (public base), so it goes wherever one is taken.
struct layout_config : kvx_layout_config {
  layout_config() noexcept : kvx_layout_config() { kvx_layout_config_init(this); }
  // Six integers in a row compile with two of them swapped; name the fields instead.
  [[deprecated("set the fields by name: kvx::layout_config().set_num_blocks(n).set_num_layers(l)...")]]
  layout_config(uint32_t kind_, uint64_t num_blocks_, uint64_t num_layers_, uint64_t outer_dim_, uint64_t page_size_,
                uint64_t inner_dim_, uint64_t dtype_bytes_) noexcept
      : layout_config() {
    set_kind(kind_).set_num_blocks(num_blocks_).set_num_layers(num_layers_).set_outer_dim(outer_dim_);
    set_page_size(page_size_).set_inner_dim(inner_dim_).set_dtype_bytes(dtype_bytes_);
  }
  // A KVX_LAYOUT_* value.
  layout_config &set_kind(uint32_t v) noexcept { kind = v; return *this; }
  layout_config &set_num_blocks(uint64_t v) noexcept { num_blocks = v; return *this; }
  layout_config &set_num_layers(uint64_t v) noexcept { num_layers = v; return *this; }
  // 2 for separate K and V, 1 for MLA.
  layout_config &set_outer_dim(uint64_t v) noexcept { outer_dim = v; return *this; }
  // Tokens per block.
  layout_config &set_page_size(uint64_t v) noexcept { page_size = v; return *this; }
  // Elements per token (kv_heads x head_dim).
  layout_config &set_inner_dim(uint64_t v) noexcept { inner_dim = v; return *this; }
  layout_config &set_dtype_bytes(uint64_t v) noexcept { dtype_bytes = v; return *this; }
};

class Layout {
 public:
  explicit Layout(kvx_layout *l) : h_(l) {}
  kvx_layout *get() const noexcept { return h_.get(); }
  explicit operator bool() const noexcept { return h_ != nullptr; }
  uint64_t block_bytes() const {
    uint64_t v = 0;
    check(kvx_layout_block_bytes(h_.get(), &v));
    return v;
  }
  // Base address of one layer's allocation (layer 0 for fully contiguous).
  uint64_t base(uint64_t layer = 0) const {
    uint64_t v = 0;
    check(kvx_layout_base(h_.get(), layer, &v));
    return v;
  }

 private:
  std::unique_ptr<kvx_layout, detail::LayoutDelete> h_;
};

class Request {
 public:
  explicit Request(kvx_request *r) : h_(r) {}
  kvx_request *get() const noexcept { return h_.get(); }
  // Waits for completion; throws kvx::Error if the transfer failed or was cancelled.
  void wait() const {
    kvx_status s = kvx_request_wait(h_.get(), UINT64_MAX);
    if (s != KVX_OK) throw Error(s, kvx_request_error(h_.get()));
  }
  // Waits up to `timeout_ns`; the final status, or KVX_ERR_TIMEOUT. Never throws.
  kvx_status wait_for(uint64_t timeout_ns) const noexcept { return kvx_request_wait(h_.get(), timeout_ns); }
  kvx_status poll() const noexcept { return kvx_request_poll(h_.get()); }
  void cancel() const { check(kvx_request_cancel(h_.get())); }
  std::string error() const { return kvx_request_error(h_.get()); }

 private:
  std::unique_ptr<kvx_request, detail::RequestDelete> h_;
};

class Engine {
 public:
  // Defaults (automatic device) when `cfg` is null.
  explicit Engine(const kvx_engine_config *cfg = nullptr) {
    kvx_engine *e = nullptr;
    check(kvx_engine_create(cfg, &e));
    h_.reset(e);
  }
  kvx_engine *get() const noexcept { return h_.get(); }
  // CUDA ordinal, or -1 for the emulated device.
  int32_t device() const {
    int32_t d = 0;
    check(kvx_engine_device(h_.get(), &d));
    return d;
  }
  /// The disk I/O backend in use (KVX_IO_POSIX, _URING, _NIXL or _GDS).
  uint32_t io_backend() const {
    uint32_t b = 0;
    check(kvx_engine_io_backend(h_.get(), &b));
    return b;
  }
  /// The settings in effect: defaults filled in, io_backend resolved.
  kvx_engine_config config() const {
    kvx_engine_config c{};
    c.struct_size = sizeof c;
    check(kvx_engine_config_get(h_.get(), &c));
    return c;
  }
  kvx_stats stats() const {
    kvx_stats s{};
    s.struct_size = sizeof s;
    check(kvx_engine_stats(h_.get(), &s));
    return s;
  }
  /// The engine's completion eventfd (ABI 1.5): readable once a request has ended since
  /// it was last read; read 8 bytes to reset it, then poll. The engine owns and closes it.
  int completion_fd() const {
    int32_t fd = -1;
    check(kvx_engine_completion_fd(h_.get(), &fd));
    return fd;
  }
  Layout create_device_layout(const kvx_layout_config &c) {
    return make([&](kvx_layout **out) { return kvx_layout_create_device(h_.get(), &c, out); });
  }
  Layout create_host_layout(const kvx_layout_config &c, uint32_t flags = KVX_HOST_PINNED) {
    return make([&](kvx_layout **out) { return kvx_layout_create_host(h_.get(), &c, flags, out); });
  }
  Layout create_disk_layout(const kvx_layout_config &c, const std::string &path, uint32_t flags = KVX_DISK_CREATE) {
    return make([&](kvx_layout **out) { return kvx_layout_create_disk(h_.get(), &c, path.c_str(), flags, out); });
  }
  Layout register_device_layout(const kvx_layout_config &c, const std::vector<uint64_t> &bases) {
    return make([&](kvx_layout **out) { return kvx_layout_register_device(h_.get(), &c, bases.data(), bases.size(), out); });
  }
  Layout register_host_layout(const kvx_layout_config &c, const std::vector<void *> &bases, uint32_t flags = 0) {
    return make(
        [&](kvx_layout **out) { return kvx_layout_register_host(h_.get(), &c, bases.data(), bases.size(), flags, out); });
  }
  // The blob another engine imports to reach exactly `layouts` (ABI 1.3); its bytes are
  // the caller's to send (a socket, a file, the runtime's control plane).
  std::vector<uint8_t> export_layouts(const std::vector<const Layout *> &layouts) {
    std::vector<const kvx_layout *> handles;
    for (const Layout *l : layouts) handles.push_back(l->get());
    kvx_blob *b = nullptr;
    check(kvx_engine_export(h_.get(), handles.data(), handles.size(), &b));
    size_t n = 0;
    const uint8_t *p = kvx_blob_bytes(b, &n);
    std::vector<uint8_t> out(p, p + n);
    kvx_blob_destroy(b);
    return out;
  }
  // A peer's layouts, in its export order; `timeout_ms` bounds each transfer with it
  // (0: the library's default).
  std::vector<Layout> import_layouts(const std::vector<uint8_t> &blob, uint32_t timeout_ms = 0) {
    size_t n = 0;
    check(kvx_engine_import(h_.get(), blob.data(), blob.size(), timeout_ms, nullptr, 0, &n));
    std::vector<kvx_layout *> raw(n);
    check(kvx_engine_import(h_.get(), blob.data(), blob.size(), timeout_ms, raw.data(), raw.size(), &n));
    std::vector<Layout> out;
    for (size_t i = 0; i < n; i++) out.emplace_back(raw[i]);
    return out;
  }
  // Submits src_blocks[i] -> dst_blocks[i]; `opts` may be null (all layers, no callback).
  Request submit(const Layout &src, const std::vector<uint64_t> &src_blocks, const Layout &dst,
                 const std::vector<uint64_t> &dst_blocks, const kvx_transfer_options *opts = nullptr) {
    if (src_blocks.size() != dst_blocks.size())
      throw Error(KVX_ERR_INVALID_ARG, "src_blocks and dst_blocks differ in length");
    kvx_request *r = nullptr;
    check(kvx_transfer_submit(h_.get(), src.get(), src_blocks.data(), dst.get(), dst_blocks.data(), src_blocks.size(),
                              opts, &r));
    return Request(r);
  }

 private:
  template <class F>
  static Layout make(F create) {
    kvx_layout *l = nullptr;
    check(create(&l));
    return Layout(l);
  }
  std::unique_ptr<kvx_engine, detail::EngineDelete> h_;
};

// A kvx_store_config with the defaults of kvx_store_config_init (KVX_STORE_CREATE, one
// shard, no namespace, no shared tier); `block` and `capacity_blocks` must then be set. It
// is a kvx_store_config (public base), so it goes wherever one is taken.
struct store_config : kvx_store_config {
  store_config() noexcept : kvx_store_config() { kvx_store_config_init(this); }
};

// A kvx_shared_config (1.7) with the defaults of kvx_shared_config_init, for
// kvx_store_config::shared; made by where its objects live, then tuned by field name:
//   auto sh = kvx::shared_config::dir("/mnt/shared/kv").set_flags(KVX_SHARED_WRITE_THROUGH);
//   auto c = kvx::store_config();
//   c.shared = &sh;
// Its strings are the caller's (not copied): they must outlive the kvx::Store
// constructor that opens the store with it. It is a kvx_shared_config (public base).
struct shared_config : kvx_shared_config {
  shared_config() noexcept : kvx_shared_config() { kvx_shared_config_init(this); }
  // A directory many processes (or hosts, over a shared file system) open at once; past
  // `capacity_bytes` (0: unbounded) writers evict the least recently used objects.
  static shared_config dir(const char *path, uint64_t capacity_bytes = 0) noexcept {
    shared_config c;
    c.kind = KVX_SHARED_DIR;
    c.path = path;
    c.capacity_bytes = capacity_bytes;
    return c;
  }
  // An S3-compatible bucket; a null or empty endpoint or region: the AWS_* variables'.
  static shared_config s3(const char *bucket, const char *prefix = nullptr, const char *endpoint = nullptr,
                          const char *region = nullptr) noexcept {
    shared_config c;
    c.kind = KVX_SHARED_S3;
    c.bucket = bucket;
    c.prefix = prefix;
    c.endpoint = endpoint;
    c.region = region;
    return c;
  }
  // Backend threads (1 to 256); 0: 16.
  shared_config &set_threads(uint32_t v) noexcept { threads = v; return *this; }
  // The longest a lookup or get waits for the tier; 0: 5000 ms.
  shared_config &set_timeout_ms(uint32_t v) noexcept { timeout_ms = v; return *this; }
  // KVX_SHARED_WRITE_THROUGH, KVX_SHARED_NO_ADMIT, or 0.
  shared_config &set_flags(uint32_t v) noexcept { flags = v; return *this; }
  // Blocks waiting to be written behind, at most; 0: 1024.
  shared_config &set_pending_puts(uint32_t v) noexcept { pending_puts = v; return *this; }
};

// Keys viewing `bytes` (each 1 to 64 bytes); they are valid while `bytes` is unchanged.
inline std::vector<kvx_key> keys_of(const std::vector<std::string> &bytes) {
  std::vector<kvx_key> out;
  out.reserve(bytes.size());
  for (const std::string &b : bytes) out.push_back({reinterpret_cast<const uint8_t *>(b.data()), (uint32_t)b.size()});
  return out;
}

// A store put or get: every key gets a status of its own.
class StoreRequest {
 public:
  explicit StoreRequest(kvx_store_request *r) : h_(r) {}
  kvx_store_request *get() const noexcept { return h_.get(); }
  // Waits until every key has its status; throws kvx::Error (the first failed key's
  // status and message) unless every key is KVX_OK.
  void wait() const {
    kvx_status s = kvx_store_request_wait(h_.get(), UINT64_MAX);
    if (s != KVX_OK) throw Error(s, kvx_store_request_error(h_.get()));
  }
  // Waits up to `timeout_ns`; the request's status, or KVX_ERR_TIMEOUT. Never throws.
  kvx_status wait_for(uint64_t timeout_ns) const noexcept { return kvx_store_request_wait(h_.get(), timeout_ns); }
  // KVX_PENDING until every key has its status, then the request's status.
  kvx_status poll() const noexcept { return kvx_store_request_poll(h_.get()); }
  // Key `i`'s status: KVX_PENDING, KVX_OK or why it alone failed (a get's key not held:
  // KVX_ERR_NOT_FOUND). Throws kvx::Error for `i` past the request's keys.
  kvx_status key_status(size_t i) const {
    kvx_status v = KVX_PENDING;
    check(kvx_store_request_key_status(h_.get(), i, &v));
    return v;
  }
  // Why key `i` failed, once the request is done; "" otherwise.
  std::string key_error(size_t i) const { return kvx_store_request_key_error(h_.get(), i); }
  // The first failed key's message, once the request is done; "" otherwise.
  std::string error() const { return kvx_store_request_error(h_.get()); }

 private:
  std::unique_ptr<kvx_store_request, detail::StoreRequestDelete> h_;
};

// The store in a directory, opened (or made, with KVX_STORE_CREATE) through an engine;
// closed when the object goes (its puts and gets in flight end first). Declare it after
// its engine so it is closed first. A layout a put or get moves is held until the request
// is done; caller memory behind a registered layout must outlive it.
class Store {
 public:
  struct Lookup {
    std::vector<uint8_t> present;  // 1 where the store holds the key
    size_t leading_hits = 0;       // the leading keys held (a prefix's hits)
  };

  Store(const Engine &e, const std::string &dir, const kvx_store_config &cfg) {
    kvx_store *s = nullptr;
    check(kvx_store_open(e.get(), dir.c_str(), &cfg, &s));
    h_.reset(s);
  }
  kvx_store *get() const noexcept { return h_.get(); }
  // `flags`: 0 or KVX_LOOKUP_LEASE (each hit leased until a get of it or release_leases).
  Lookup lookup(const std::vector<kvx_key> &keys, uint32_t flags = 0) {
    Lookup l;
    l.present.resize(keys.size());
    check(kvx_store_lookup(h_.get(), keys.data(), keys.size(), flags, l.present.data(), &l.leading_hits));
    return l;
  }
  void release_leases(const std::vector<kvx_key> &keys) {
    check(kvx_store_release_leases(h_.get(), keys.data(), keys.size()));
  }
  struct Leases {
    std::vector<uint64_t> tokens;  // the lease of each hit (0 for a miss), the caller's alone
    size_t leading_hits = 0;       // the leading keys held (a prefix's hits)
  };
  // (ABI 1.6) Leases each hit for the caller alone, until release(tokens): no get, and no
  // other caller's release, spends it. Get a leased hit, then release its lease.
  Leases lease(const std::vector<kvx_key> &keys) {
    Leases l;
    l.tokens.resize(keys.size());
    check(kvx_store_lease(h_.get(), keys.data(), keys.size(), l.tokens.data(), &l.leading_hits));
    return l;
  }
  // (ABI 1.6) Gives back leases from lease() (0s skipped); all or none.
  void release(const std::vector<uint64_t> &tokens) { check(kvx_store_release(h_.get(), tokens.data(), tokens.size())); }
  // Stores block src_ids[i] of `src` under keys[i]; `src` must outlive the request.
  StoreRequest put(const Layout &src, const std::vector<uint64_t> &src_ids, const std::vector<kvx_key> &keys,
                   const kvx_transfer_options *opts = nullptr) {
    if (src_ids.size() != keys.size()) throw Error(KVX_ERR_INVALID_ARG, "src_ids and keys differ in length");
    kvx_store_request *r = nullptr;
    check(kvx_store_put(h_.get(), src.get(), src_ids.data(), keys.data(), keys.size(), opts, &r));
    return StoreRequest(r);
  }
  // Loads keys[i]'s block into block dst_ids[i] of `dst`; `dst` must outlive the request.
  StoreRequest get(const std::vector<kvx_key> &keys, const Layout &dst, const std::vector<uint64_t> &dst_ids,
                   const kvx_transfer_options *opts = nullptr) {
    if (dst_ids.size() != keys.size()) throw Error(KVX_ERR_INVALID_ARG, "keys and dst_ids differ in length");
    kvx_store_request *r = nullptr;
    check(kvx_store_get(h_.get(), keys.data(), keys.size(), dst.get(), dst_ids.data(), opts, &r));
    return StoreRequest(r);
  }
  // Each key's status: KVX_OK once its removal is recorded, KVX_ERR_NOT_FOUND if not held.
  std::vector<kvx_status> remove(const std::vector<kvx_key> &keys) {
    std::vector<kvx_status> out(keys.size(), KVX_OK);
    check(kvx_store_remove(h_.get(), keys.data(), keys.size(), out.data()));
    return out;
  }
  kvx_store_counters stats() const {
    kvx_store_counters c{};
    c.struct_size = sizeof c;
    check(kvx_store_stats(h_.get(), &c));
    return c;
  }

  // Slot handles (1.5): the owner hands slots to a process that opened the store with
  // KVX_STORE_DATA_ONLY (kvx_slot_handle is plain bytes: copy it there as it is).
  struct Leased {
    std::vector<uint8_t> present;          // 1 where the store holds the key
    std::vector<kvx_slot_handle> handles;  // the handle to read it, where present
  };
  struct Reserved {
    std::vector<uint32_t> kinds;           // KVX_RESERVED_WRITE, _HELD, _IN_FLIGHT or _NO_ROOM
    std::vector<kvx_slot_handle> handles;  // the handle to write, where KVX_RESERVED_WRITE
  };
  // Owner: leases each hit (until release_leases) and hands out its handle to read.
  Leased lease_slots(const std::vector<kvx_key> &keys) {
    Leased l;
    l.present.resize(keys.size());
    l.handles.resize(keys.size());
    check(kvx_store_lease_slots(h_.get(), keys.data(), keys.size(), l.handles.data(), l.present.data()));
    return l;
  }
  // Owner: reserves a slot for each key not held, to be written, then committed or aborted.
  Reserved reserve_slots(const std::vector<kvx_key> &keys) {
    Reserved r;
    r.kinds.resize(keys.size());
    r.handles.resize(keys.size());
    check(kvx_store_reserve_slots(h_.get(), keys.data(), keys.size(), r.handles.data(), r.kinds.data()));
    return r;
  }
  // Owner: each handle's status: KVX_OK (an entry now), KVX_ERR_INTEGRITY (not completely
  // written through this handle), KVX_ERR_INVALID_ARG (not reserved by this open),
  // KVX_ERR_CANCELLED (the key was removed meanwhile).
  std::vector<kvx_status> commit_slots(const std::vector<kvx_slot_handle> &handles) {
    std::vector<kvx_status> out(handles.size(), KVX_OK);
    check(kvx_store_commit_slots(h_.get(), handles.data(), handles.size(), out.data()));
    return out;
  }
  // Owner: gives the reserved slots back unwritten.
  void abort_slots(const std::vector<kvx_slot_handle> &handles) {
    check(kvx_store_abort_slots(h_.get(), handles.data(), handles.size()));
  }
  // Data: loads the slot of handles[i] into block dst_ids[i] of `dst`.
  StoreRequest read_slots(const std::vector<kvx_slot_handle> &handles, const Layout &dst, const std::vector<uint64_t> &dst_ids,
                          const kvx_transfer_options *opts = nullptr) {
    if (dst_ids.size() != handles.size()) throw Error(KVX_ERR_INVALID_ARG, "handles and dst_ids differ in length");
    kvx_store_request *r = nullptr;
    check(kvx_store_read_slots(h_.get(), handles.data(), handles.size(), dst.get(), dst_ids.data(), opts, &r));
    return StoreRequest(r);
  }
  // Data: writes block src_ids[i] of `src` to the slot of handles[i] (whole blocks).
  StoreRequest write_slots(const Layout &src, const std::vector<uint64_t> &src_ids, const std::vector<kvx_slot_handle> &handles,
                           const kvx_transfer_options *opts = nullptr) {
    if (src_ids.size() != handles.size()) throw Error(KVX_ERR_INVALID_ARG, "src_ids and handles differ in length");
    kvx_store_request *r = nullptr;
    check(kvx_store_write_slots(h_.get(), src.get(), src_ids.data(), handles.data(), handles.size(), opts, &r));
    return StoreRequest(r);
  }

 private:
  std::unique_ptr<kvx_store, detail::StoreDelete> h_;
};

}  // namespace kvx

#endif  // KVXFER_HPP
