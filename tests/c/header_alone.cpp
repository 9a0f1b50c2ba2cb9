/* The headers compile alone (and twice) as C++17 with -Wall -Wextra -Wpedantic -Werror. */
#include "kvxfer.h"
#include "kvxfer.h"
#include "kvxfer.hpp"
#include "kvxfer.hpp"

// kvx::layout_config is a kvx_layout_config filled by field name.
static kvx_layout_config named() {
  return kvx::layout_config().set_num_blocks(4).set_num_layers(2).set_outer_dim(2).set_page_size(8).set_inner_dim(64).set_dtype_bytes(2);
}

// The positional constructor still compiles (deprecated, for one release).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
static kvx_layout_config positional() { return kvx::layout_config(KVX_LAYOUT_FULLY_CONTIGUOUS, 4, 2, 2, 8, 64, 2); }
#pragma GCC diagnostic pop

// The store's classes compile with every method named (never run: no store is opened).
[[maybe_unused]] static kvx_store_counters store_calls(const kvx::Engine &e, const kvx::Layout &l) {
  auto c = kvx::store_config();
  const kvx_layout_config block = kvx::layout_config();
  c.block = &block;
  c.capacity_blocks = 4;
  const kvx::shared_config dir = kvx::shared_config::dir("shared", 1 << 30).set_flags(KVX_SHARED_WRITE_THROUGH).set_threads(4);
  const kvx::shared_config s3 = kvx::shared_config::s3("bucket", "prefix").set_timeout_ms(100).set_pending_puts(8);
  c.shared = block.num_blocks ? &s3 : &dir;
  kvx::Store s(e, "dir", c);
  const std::vector<std::string> bytes = {"a", "b"};
  const std::vector<kvx_key> keys = kvx::keys_of(bytes);
  kvx::Store::Lookup found = s.lookup(keys, KVX_LOOKUP_LEASE);
  s.release_leases(keys);
  kvx::StoreRequest put = s.put(l, {0, 1}, keys);
  put.wait();
  kvx_status polled = put.poll(), waited = put.wait_for(0), first = put.key_status(0);
  kvx::StoreRequest got = s.get(keys, l, {2, 3});
  std::string why = got.key_error(0) + got.error();
  std::vector<kvx_status> removed = s.remove(keys);
  kvx_store_counters k = s.stats();
  k.shared_hits += k.shared_requests;
  k.entries += found.leading_hits + found.present.size() + (uint64_t)polled + (uint64_t)waited + (uint64_t)first + why.size() +
               removed.size() + (s.get() != nullptr) + (got.get() != nullptr);
  k.entries += (uint64_t)e.completion_fd();
  return k;
}

int main(void) {
  kvx_layout_config a = named(), b = positional();
  return kvx_abi_version() == 0 || a.num_blocks != b.num_blocks || a.dtype_bytes != b.dtype_bytes;
}
