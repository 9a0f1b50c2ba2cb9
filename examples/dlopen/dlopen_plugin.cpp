// Loading kvxfer as a plugin: dlopen(RTLD_NOW | RTLD_LOCAL) by path, resolve only
// kvx_get_api, and do everything through the versioned function table — the way a
// runtime that must not link kvxfer at build time would.
//
// Build and run (`make dlopen-test` does both):
//   c++ -std=c++17 -Iinclude examples/dlopen/dlopen_plugin.cpp -ldl -o dlopen_plugin
//   ./dlopen_plugin target/release/libkvxfer.so [dir-for-files]
//
// It runs a disk -> device -> disk round trip and checks every byte, reads the table
// through the ABI 1.0 prefix of kvx_api (what a caller built against 1.0 sees), passes
// ABI 1.0-sized transfer options, and checks that kvx_get_api(2) is NULL.
#include <dlfcn.h>
#include <unistd.h>

#include <cstddef>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "kvxfer.h"

namespace {

int failures = 0;
#define EXPECT(cond, ...)                                               \
  do {                                                                  \
    if (!(cond)) {                                                      \
      failures++;                                                       \
      std::fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__);         \
      std::fprintf(stderr, __VA_ARGS__);                                \
      std::fprintf(stderr, "\n");                                       \
    }                                                                   \
  } while (0)

// The table as ABI 1.0 defined it. Append-only means a 1.0 caller can keep using this
// prefix of any later library's table.
struct kvx_api_v1_0 {
  uint32_t struct_size, abi_major, abi_minor;
  uint32_t (*abi_version)(void);
  const char *(*version_string)(void);
  const char *(*status_str)(kvx_status);
  const char *(*last_error)(void);
  void (*engine_config_init)(kvx_engine_config *);
  kvx_status (*engine_create)(const kvx_engine_config *, kvx_engine **);
  void (*engine_destroy)(kvx_engine *);
  kvx_status (*engine_device)(const kvx_engine *, int32_t *);
  void (*layout_config_init)(kvx_layout_config *);
  kvx_status (*layout_create_device)(kvx_engine *, const kvx_layout_config *, kvx_layout **);
  kvx_status (*layout_create_host)(kvx_engine *, const kvx_layout_config *, uint32_t, kvx_layout **);
  kvx_status (*layout_create_disk)(kvx_engine *, const kvx_layout_config *, const char *, uint32_t, kvx_layout **);
  kvx_status (*layout_register_device)(kvx_engine *, const kvx_layout_config *, const uint64_t *, size_t, kvx_layout **);
  kvx_status (*layout_register_host)(kvx_engine *, const kvx_layout_config *, void *const *, size_t, uint32_t, kvx_layout **);
  kvx_status (*layout_block_bytes)(const kvx_layout *, uint64_t *);
  kvx_status (*layout_base)(const kvx_layout *, uint64_t, uint64_t *);
  void (*layout_destroy)(kvx_layout *);
  void (*transfer_options_init)(kvx_transfer_options *);
  kvx_status (*transfer_submit)(kvx_engine *, const kvx_layout *, const uint64_t *, const kvx_layout *, const uint64_t *,
                                size_t, const kvx_transfer_options *, kvx_request **);
  kvx_status (*request_wait)(kvx_request *, uint64_t);
  kvx_status (*request_poll)(const kvx_request *);
  kvx_status (*request_cancel)(kvx_request *);
  const char *(*request_error)(const kvx_request *);
  void (*request_release)(kvx_request *);
  kvx_status (*engine_stats)(const kvx_engine *, kvx_stats *);
  kvx_status (*set_logger)(kvx_log_fn, void *, uint32_t);
};
static_assert(sizeof(kvx_api_v1_0) <= sizeof(kvx_api), "the 1.0 table is a prefix of today's");

const kvx_api_v1_0 *api;

void ok(kvx_status s, const char *what) {
  if (s != KVX_OK) {
    std::fprintf(stderr, "FATAL %s: %s: %s\n", what, api->status_str(s), api->last_error());
    std::exit(1);
  }
}

kvx_status move(kvx_engine *e, kvx_layout *src, kvx_layout *dst, const std::vector<uint64_t> &ids) {
  // Options of ABI 1.0's size (before wait_event was appended): still accepted.
  kvx_transfer_options o;
  api->transfer_options_init(&o);
  o.struct_size = offsetof(kvx_transfer_options, wait_event);
  kvx_request *r = nullptr;
  kvx_status s = api->transfer_submit(e, src, ids.data(), dst, ids.data(), ids.size(), &o, &r);
  if (s != KVX_OK) return s;
  s = api->request_wait(r, UINT64_MAX);
  api->request_release(r);
  return s;
}

}  // namespace

int main(int argc, char **argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s path/to/libkvxfer.so [dir]\n", argv[0]);
    return 2;
  }
  std::string dir = argc > 2 ? argv[2] : "/tmp";
  void *lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    std::fprintf(stderr, "dlopen: %s\n", dlerror());
    return 1;
  }
  using get_api_fn = const kvx_api *(*)(uint32_t);
  auto get_api = reinterpret_cast<get_api_fn>(dlsym(lib, "kvx_get_api"));
  if (!get_api) {
    std::fprintf(stderr, "kvx_get_api not found: %s\n", dlerror());
    return 1;
  }
  EXPECT(get_api(2) == nullptr, "kvx_get_api(2) must be NULL");
  const kvx_api *full = get_api(KVX_ABI_MAJOR);
  if (!full) {
    std::fprintf(stderr, "this library does not implement ABI %d\n", KVX_ABI_MAJOR);
    return 1;
  }
  api = reinterpret_cast<const kvx_api_v1_0 *>(full);
  EXPECT(api->struct_size >= sizeof(kvx_api_v1_0), "table of %u bytes is smaller than ABI 1.0's", api->struct_size);
  EXPECT(api->abi_major == KVX_ABI_MAJOR && api->abi_version() >> 16 == KVX_ABI_MAJOR, "ABI major");
  EXPECT((api->abi_version() & 0xffff) == api->abi_minor, "ABI minor");

  kvx_engine_config ec;
  api->engine_config_init(&ec);
  ec.device = KVX_DEVICE_EMULATED;
  ec.bounce_bytes = 1 << 20;
  ec.slot_bytes = 64 << 10;
  kvx_engine *e = nullptr;
  ok(api->engine_create(&ec, &e), "engine_create");
  kvx_layout_config c;
  api->layout_config_init(&c);
  c.kind = KVX_LAYOUT_FULLY_CONTIGUOUS;
  c.num_blocks = 8;
  c.num_layers = 4;
  c.outer_dim = 2;
  c.page_size = 16;
  c.inner_dim = 96;
  c.dtype_bytes = 2;
  std::string a = dir + "/kvx-plugin-a-" + std::to_string(getpid()), b = dir + "/kvx-plugin-b-" + std::to_string(getpid());
  kvx_layout *host = nullptr, *disk_a = nullptr, *device = nullptr, *disk_b = nullptr, *back = nullptr;
  ok(api->layout_create_host(e, &c, KVX_HOST_PINNED, &host), "host");
  ok(api->layout_create_host(e, &c, 0, &back), "back");
  ok(api->layout_create_disk(e, &c, a.c_str(), KVX_DISK_CREATE, &disk_a), "disk a");
  ok(api->layout_create_disk(e, &c, b.c_str(), KVX_DISK_CREATE, &disk_b), "disk b");
  c.kind = KVX_LAYOUT_LAYER_SEPARATE_BLOCK_FIRST;
  ok(api->layout_create_device(e, &c, &device), "device");
  uint64_t block = 0, h = 0, k = 0;
  ok(api->layout_block_bytes(host, &block), "block_bytes");
  ok(api->layout_base(host, 0, &h), "base");
  ok(api->layout_base(back, 0, &k), "base");
  auto *hp = reinterpret_cast<unsigned char *>(h);
  for (uint64_t i = 0; i < 8 * block; i++) hp[i] = (unsigned char)(i * 7 + 3);
  std::vector<uint64_t> ids = {0, 1, 2, 3, 4, 5, 6, 7};
  ok(move(e, host, disk_a, ids), "host -> disk");
  ok(move(e, disk_a, device, ids), "disk -> device");
  ok(move(e, device, disk_b, ids), "device -> disk");
  ok(move(e, disk_b, back, ids), "disk -> host");
  EXPECT(std::memcmp(hp, reinterpret_cast<void *>(k), 8 * block) == 0, "disk -> device -> disk changed the bytes");
  for (kvx_layout *l : {host, back, disk_a, disk_b, device}) api->layout_destroy(l);
  api->engine_destroy(e);
  dlclose(lib);
  std::printf("dlopen plugin: %s\n", failures ? "FAILED" : "disk -> device -> disk round trip through kvx_get_api(1) ok");
  return failures ? 1 : 0;
}
