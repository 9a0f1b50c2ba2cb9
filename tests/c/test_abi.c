/* The C ABI from C: a disk -> device -> disk round trip, a store round trip, the version
 * macros against the library, the dlopen table, and bad calls, each checked for its exact status, a
 * non-empty kvx_last_error() and untouched outputs. Built with -Wall -Wextra -Werror. */
#include "kvxfer.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <stddef.h>
#include <unistd.h>

static int failures = 0;
static int checks = 0;

#define EXPECT(cond, ...)                                  \
  do {                                                     \
    checks++;                                              \
    if (!(cond)) {                                         \
      failures++;                                          \
      fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
      fprintf(stderr, __VA_ARGS__);                        \
      fprintf(stderr, "\n");                               \
    }                                                      \
  } while (0)

#define OK(call)                                                                             \
  do {                                                                                       \
    kvx_status s_ = (call);                                                                  \
    if (s_ != KVX_OK) {                                                                      \
      fprintf(stderr, "FATAL %s:%d: %s -> %s: %s\n", __FILE__, __LINE__, #call, kvx_status_str(s_), \
              kvx_last_error());                                                             \
      exit(1);                                                                               \
    }                                                                                        \
  } while (0)

static int bad_calls = 0;

/* A call that must fail with `want` and leave a message. */
static void expect_fail(kvx_status got, kvx_status want, const char *what) {
  const char *msg = kvx_last_error();
  bad_calls++;
  EXPECT(got == want, "%s: got %s, want %s (%s)", what, kvx_status_str(got), kvx_status_str(want), msg);
  EXPECT(msg != NULL && msg[0] != '\0', "%s: kvx_last_error() is empty", what);
}

static kvx_layout_config geometry(uint64_t blocks) {
  kvx_layout_config c;
  kvx_layout_config_init(&c);
  c.num_blocks = blocks;
  c.num_layers = 3;
  c.outer_dim = 2;
  c.page_size = 5; /* 5 x 7 x 2 = 70-byte regions: nothing aligned */
  c.inner_dim = 7;
  c.dtype_bytes = 2;
  return c;
}

static kvx_status move_blocks(kvx_engine *e, kvx_layout *src, kvx_layout *dst, const uint64_t *ids, size_t n) {
  kvx_request *r = NULL;
  kvx_status s = kvx_transfer_submit(e, src, ids, dst, ids, n, NULL, &r);
  if (s != KVX_OK) return s;
  s = kvx_request_wait(r, UINT64_MAX);
  kvx_request_release(r);
  return s;
}

static void round_trip(kvx_engine *e, const char *dir) {
  enum { N = 6 };
  kvx_layout_config c = geometry(N);
  char a_path[512], b_path[512];
  snprintf(a_path, sizeof a_path, "%s/kvx-c-a-%d.kv", dir, (int)getpid());
  snprintf(b_path, sizeof b_path, "%s/kvx-c-b-%d.kv", dir, (int)getpid());
  kvx_layout *host = NULL, *disk_a = NULL, *device = NULL, *disk_b = NULL, *back = NULL;
  OK(kvx_layout_create_host(e, &c, 0, &host));
  OK(kvx_layout_create_disk(e, &c, a_path, KVX_DISK_CREATE, &disk_a));
  c.kind = KVX_LAYOUT_LAYER_SEPARATE_OUTER_FIRST;
  OK(kvx_layout_create_device(e, &c, &device));
  c.kind = KVX_LAYOUT_FULLY_CONTIGUOUS;
  OK(kvx_layout_create_disk(e, &c, b_path, KVX_DISK_CREATE, &disk_b));
  OK(kvx_layout_create_host(e, &c, KVX_HOST_PINNED, &back));

  uint64_t block_bytes = 0, h = 0, b = 0;
  OK(kvx_layout_block_bytes(host, &block_bytes));
  EXPECT(block_bytes == 3 * 2 * 5 * 7 * 2, "block_bytes %llu", (unsigned long long)block_bytes);
  OK(kvx_layout_base(host, 0, &h));
  OK(kvx_layout_base(back, 0, &b));
  unsigned char *hp = (unsigned char *)(uintptr_t)h, *bp = (unsigned char *)(uintptr_t)b;
  for (uint64_t i = 0; i < N * block_bytes; i++) hp[i] = (unsigned char)(i * 131 + 7);

  uint64_t ids[N] = {0, 1, 2, 3, 4, 5};
  OK(move_blocks(e, host, disk_a, ids, N));
  OK(move_blocks(e, disk_a, device, ids, N));
  OK(move_blocks(e, device, disk_b, ids, N));
  OK(move_blocks(e, disk_b, back, ids, N));
  EXPECT(memcmp(hp, bp, N * block_bytes) == 0, "disk -> device -> disk round trip changed the bytes");

  kvx_stats st;
  memset(&st, 0, sizeof st);
  st.struct_size = sizeof st;
  OK(kvx_engine_stats(e, &st));
  EXPECT(st.requests_completed >= 4, "requests_completed %llu", (unsigned long long)st.requests_completed);
  EXPECT(st.bytes_host_to_device == N * block_bytes, "bytes_host_to_device %llu", (unsigned long long)st.bytes_host_to_device);
  EXPECT(st.bytes_disk_read >= 2 * N * block_bytes, "bytes_disk_read %llu", (unsigned long long)st.bytes_disk_read);
  EXPECT(st.struct_size == sizeof st && st.slots_quarantined == 0, "struct_size %u, slots_quarantined %llu", st.struct_size,
         (unsigned long long)st.slots_quarantined);
  /* A 1.3 caller's struct ends before slots_quarantined: filled up to there, nothing after. */
  kvx_stats older;
  memset(&older, 0xab, sizeof older);
  older.struct_size = offsetof(kvx_stats, slots_quarantined);
  OK(kvx_engine_stats(e, &older));
  EXPECT(older.struct_size == offsetof(kvx_stats, slots_quarantined) && older.requests_completed == st.requests_completed &&
             older.slots_quarantined == 0xababababababababULL,
         "a 1.3-sized kvx_stats: struct_size %u", older.struct_size);

  kvx_layout_destroy(back);
  kvx_layout_destroy(disk_b);
  kvx_layout_destroy(device);
  kvx_layout_destroy(disk_a);
  kvx_layout_destroy(host);
  EXPECT(access(a_path, F_OK) != 0, "a file kvxfer created without KVX_DISK_KEEP was not removed");
}

/* What a completion callback saw of its own request and of another one. */
struct looked {
  kvx_request *other;
  kvx_status given, polled, waited, other_waited, other_polled;
  char message[256];
};

static void look(void *user_data, kvx_request *req, kvx_status status) {
  struct looked *l = (struct looked *)user_data;
  l->given = status;
  l->polled = kvx_request_poll(req);
  l->waited = kvx_request_wait(req, 5ull * 1000 * 1000 * 1000); /* before: waited for this very callback */
  l->other_waited = kvx_request_wait(l->other, UINT64_MAX);
  snprintf(l->message, sizeof l->message, "%s", kvx_last_error());
  l->other_polled = kvx_request_wait(l->other, 0);
}

/* What a completion callback saw waiting on a store request of its engine. */
struct store_looked {
  kvx_store_request *req;
  kvx_status waited, polled;
  char message[256];
};

static void look_at_store_request(void *user_data, kvx_request *req, kvx_status status) {
  struct store_looked *l = (struct store_looked *)user_data;
  (void)req;
  (void)status;
  l->waited = kvx_store_request_wait(l->req, UINT64_MAX);
  snprintf(l->message, sizeof l->message, "%s", kvx_last_error());
  l->polled = kvx_store_request_wait(l->req, 0);
}

/* Inside its callback a request is done (poll and wait give the callback's status at
 * once); a blocking wait there on another request of the engine is refused. */
static void waits_in_callbacks(kvx_engine *e) {
  kvx_layout_config c = geometry(2);
  kvx_layout *a = NULL, *b = NULL;
  OK(kvx_layout_create_host(e, &c, 0, &a));
  OK(kvx_layout_create_host(e, &c, 0, &b));
  uint64_t ids[2] = {0, 1};
  struct looked l;
  memset(&l, 0, sizeof l);
  OK(kvx_transfer_submit(e, a, ids, b, ids, 1, NULL, &l.other));
  OK(kvx_request_wait(l.other, UINT64_MAX));
  kvx_transfer_options o;
  kvx_transfer_options_init(&o);
  o.on_complete = look;
  o.user_data = &l;
  kvx_request *r = NULL;
  OK(kvx_transfer_submit(e, a, ids + 1, b, ids + 1, 1, &o, &r));
  EXPECT(kvx_request_wait(r, 10ull * 1000 * 1000 * 1000) == KVX_OK, "request with a looking callback");
  EXPECT(l.given == KVX_OK && l.polled == KVX_OK && l.waited == KVX_OK, "inside its callback: given %s, poll %s, wait %s",
         kvx_status_str(l.given), kvx_status_str(l.polled), kvx_status_str(l.waited));
  EXPECT(l.other_waited == KVX_ERR_INVALID_ARG && strstr(l.message, "callback") != NULL,
         "wait on another request from a callback: %s (%s)", kvx_status_str(l.other_waited), l.message);
  EXPECT(l.other_polled == KVX_OK, "wait 0 on another request from a callback: %s", kvx_status_str(l.other_polled));
  kvx_request_release(r);
  kvx_request_release(l.other);
  kvx_layout_destroy(b);
  kvx_layout_destroy(a);
}

static void bad_calls_suite(kvx_engine *e, const char *dir) {
  kvx_layout *sentinel = (kvx_layout *)(uintptr_t)0x1234;
  kvx_layout *out = sentinel;
  kvx_engine *eout = NULL;
  kvx_engine_config ec;
  kvx_layout_config c = geometry(4), z;
  kvx_layout *a = NULL, *b = NULL, *odd = NULL, *disk = NULL;
  OK(kvx_layout_create_host(e, &c, 0, &a));
  OK(kvx_layout_create_device(e, &c, &b));
  kvx_layout_config oc = c;
  oc.inner_dim = 8;
  OK(kvx_layout_create_device(e, &oc, &odd));
  char path[512];
  snprintf(path, sizeof path, "%s/kvx-c-bad-%d.kv", dir, (int)getpid());
  OK(kvx_layout_create_disk(e, &c, path, KVX_DISK_CREATE, &disk));
  uint64_t ids[2] = {0, 1}, dup[2] = {3, 3}, far[1] = {4};
  kvx_request *req = (kvx_request *)(uintptr_t)0x5678;

  expect_fail(kvx_engine_create(NULL, NULL), KVX_ERR_INVALID_ARG, "engine_create out NULL");
  kvx_engine_config_init(&ec);
  ec.struct_size = 8;
  expect_fail(kvx_engine_create(&ec, &eout), KVX_ERR_INVALID_ARG, "engine config struct_size too small");
  EXPECT(eout == NULL, "output written on failure");
  kvx_engine_config_init(&ec);
  ec.device = -7;
  expect_fail(kvx_engine_create(&ec, &eout), KVX_ERR_INVALID_ARG, "device -7");
  kvx_engine_config_init(&ec);
  ec.device = KVX_DEVICE_EMULATED;
  ec.slot_bytes = 1000;
  expect_fail(kvx_engine_create(&ec, &eout), KVX_ERR_INVALID_ARG, "slot_bytes 1000");
  kvx_engine_config_init(&ec);
  ec.io_backend = 77;
  expect_fail(kvx_engine_create(&ec, &eout), KVX_ERR_INVALID_ARG, "io_backend 77");
  EXPECT(strstr(kvx_last_error(), "KVX_IO_") != NULL, "the refusal names the known values: %s", kvx_last_error());
  kvx_engine_config_init(&ec);
  ec.flags = 2;
  expect_fail(kvx_engine_create(&ec, &eout), KVX_ERR_INVALID_ARG, "unknown engine flags");
  kvx_engine_config_init(&ec);
  ec.device = KVX_DEVICE_EMULATED;
  ec.io_backend = KVX_IO_GDS;
  expect_fail(kvx_engine_create(&ec, &eout), KVX_ERR_UNSUPPORTED, "GDS on the emulated device");
  EXPECT(strstr(kvx_last_error(), "KVX_IO_POSIX") != NULL, "the GDS refusal names the way out: %s", kvx_last_error());

  kvx_layout_config_init(&z);
  expect_fail(kvx_layout_create_host(e, &z, 0, &out), KVX_ERR_INVALID_ARG, "zero-sized layout config");
  EXPECT(out == sentinel, "output written on failure");
  z = c;
  z.outer_dim = 3;
  expect_fail(kvx_layout_create_host(e, &z, 0, &out), KVX_ERR_INVALID_ARG, "outer_dim 3");
  z = c;
  z.kind = 9;
  expect_fail(kvx_layout_create_device(e, &z, &out), KVX_ERR_INVALID_ARG, "layout kind 9");
  z = c;
  z.struct_size = 4;
  expect_fail(kvx_layout_create_device(e, &z, &out), KVX_ERR_INVALID_ARG, "layout config struct_size too small");
  expect_fail(kvx_layout_create_host(NULL, &c, 0, &out), KVX_ERR_INVALID_ARG, "engine NULL");
  expect_fail(kvx_layout_create_host(e, &c, 0x80, &out), KVX_ERR_INVALID_ARG, "unknown host flag");
  expect_fail(kvx_layout_create_disk(e, &c, NULL, KVX_DISK_CREATE, &out), KVX_ERR_INVALID_ARG, "disk path NULL");
  expect_fail(kvx_layout_create_disk(e, &c, "/nonexistent-dir/x.kv", 0, &out), KVX_ERR_IO, "missing file");
  expect_fail(kvx_layout_create_disk(e, &c, "/nonexistent-dir/x.kv", KVX_DISK_CREATE | KVX_DISK_MAPPED | KVX_DISK_CHECKSUM, &out),
              KVX_ERR_INVALID_ARG, "KVX_DISK_MAPPED with KVX_DISK_CHECKSUM");
  expect_fail(kvx_layout_create_disk(e, &c, "/nonexistent-dir/x.kv", 0x40, &out), KVX_ERR_INVALID_ARG, "unknown disk flag");
  void *one_base[1] = {(void *)&c};
  c.kind = KVX_LAYOUT_LAYER_SEPARATE_BLOCK_FIRST;
  expect_fail(kvx_layout_register_host(e, &c, one_base, 1, 0, &out), KVX_ERR_INVALID_ARG, "1 base for 3 layers");
  expect_fail(kvx_layout_register_host(e, &c, one_base, SIZE_MAX / 2, 0, &out), KVX_ERR_INVALID_ARG,
              "num_bases SIZE_MAX/2");
  c.kind = KVX_LAYOUT_FULLY_CONTIGUOUS;
  uint64_t zero_base = 0;
  expect_fail(kvx_layout_register_device(e, &c, &zero_base, 1, &out), KVX_ERR_INVALID_ARG, "NULL device base");
  uint64_t addr = 42;
  expect_fail(kvx_layout_base(disk, 0, &addr), KVX_ERR_UNSUPPORTED, "base of a disk layout");
  expect_fail(kvx_layout_base(b, 1, &addr), KVX_ERR_OUT_OF_RANGE, "base of layer 1 of a contiguous layout");
  EXPECT(addr == 42, "output written on failure");
  EXPECT(out == sentinel, "output written on failure");

  expect_fail(kvx_transfer_submit(e, a, NULL, b, ids, 2, NULL, &req), KVX_ERR_INVALID_ARG, "src_blocks NULL");
  expect_fail(kvx_transfer_submit(e, a, ids, b, ids, 0, NULL, &req), KVX_ERR_INVALID_ARG, "num_blocks 0");
  /* A count whose array could not exist (more bytes than a pointer can span) is refused
   * before anything reads the array. */
  expect_fail(kvx_transfer_submit(e, a, ids, b, ids, SIZE_MAX / 4, NULL, &req), KVX_ERR_INVALID_ARG,
              "num_blocks SIZE_MAX/4");
  expect_fail(kvx_transfer_submit(e, a, ids, b, ids, SIZE_MAX, NULL, &req), KVX_ERR_INVALID_ARG, "num_blocks SIZE_MAX");
  expect_fail(kvx_transfer_submit(e, NULL, ids, b, ids, 2, NULL, &req), KVX_ERR_INVALID_ARG, "src NULL");
  expect_fail(kvx_transfer_submit(e, a, far, b, ids, 1, NULL, &req), KVX_ERR_OUT_OF_RANGE, "block id 4 of 4");
  expect_fail(kvx_transfer_submit(e, a, ids, b, dup, 2, NULL, &req), KVX_ERR_INVALID_ARG, "duplicate destination ids");
  expect_fail(kvx_transfer_submit(e, a, ids, odd, ids, 2, NULL, &req), KVX_ERR_INCOMPATIBLE, "mismatched geometry");
  kvx_transfer_options to;
  kvx_transfer_options_init(&to);
  to.struct_size = 4;
  expect_fail(kvx_transfer_submit(e, a, ids, b, ids, 2, &to, &req), KVX_ERR_INVALID_ARG, "options struct_size too small");
  kvx_transfer_options_init(&to);
  to.layer_end = 4;
  expect_fail(kvx_transfer_submit(e, a, ids, b, ids, 2, &to, &req), KVX_ERR_OUT_OF_RANGE, "layer_end 4 of 3");
  to.layer_begin = 2;
  to.layer_end = 1;
  expect_fail(kvx_transfer_submit(e, a, ids, b, ids, 2, &to, &req), KVX_ERR_INVALID_ARG, "empty layer range");
  kvx_transfer_options_init(&to);
  to.flags = 8;
  expect_fail(kvx_transfer_submit(e, a, ids, b, ids, 2, &to, &req), KVX_ERR_INVALID_ARG, "unknown transfer flags");
  EXPECT(strstr(kvx_last_error(), "transfer flags 0x8") != NULL, "the refusal names the bits: %s", kvx_last_error());
  to.flags = KVX_XFER_CRITICAL | 8;
  expect_fail(kvx_transfer_submit(e, a, ids, b, ids, 2, &to, &req), KVX_ERR_INVALID_ARG, "a known flag beside unknown bits");
  EXPECT(strstr(kvx_last_error(), "transfer flags 0x8") != NULL, "the refusal names only the unknown bits: %s", kvx_last_error());
  EXPECT(req == (kvx_request *)(uintptr_t)0x5678, "request written on failure");
  to.flags = KVX_XFER_CRITICAL;
  OK(kvx_transfer_submit(e, a, ids, b, ids, 2, &to, &req));
  OK(kvx_request_wait(req, UINT64_MAX));
  kvx_request_release(req);
  req = (kvx_request *)(uintptr_t)0x5678;

  expect_fail(kvx_request_wait(NULL, 0), KVX_ERR_INVALID_ARG, "wait NULL");
  expect_fail(kvx_request_poll(NULL), KVX_ERR_INVALID_ARG, "poll NULL");
  expect_fail(kvx_request_cancel(NULL), KVX_ERR_INVALID_ARG, "cancel NULL");
  kvx_stats st;
  st.struct_size = 4;
  expect_fail(kvx_engine_stats(e, &st), KVX_ERR_INVALID_ARG, "stats struct_size too small");
  expect_fail(kvx_engine_device(e, NULL), KVX_ERR_INVALID_ARG, "device_out NULL");
  expect_fail(kvx_set_logger(NULL, NULL, 9), KVX_ERR_INVALID_ARG, "log level 9");

  /* NULL handles are no-ops for destroy/release; request_error never returns NULL. */
  kvx_engine_destroy(NULL);
  kvx_layout_destroy(NULL);
  kvx_request_release(NULL);
  EXPECT(kvx_request_error(NULL) != NULL && kvx_request_error(NULL)[0] == '\0', "request_error(NULL)");

  kvx_layout_destroy(a);
  kvx_layout_destroy(b);
  kvx_layout_destroy(odd);
  kvx_layout_destroy(disk);
}

/* The files a store makes in its directory (docs/store.md), removed after a test. */
static void remove_store_dir(const char *dir) {
  const char *names[] = {"lock", "owner", "meta", "records", "order", "data-0", "data-0.kvxsum", "data-1", "data-1.kvxsum"};
  char p[600];
  for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
    snprintf(p, sizeof p, "%s/%s", dir, names[i]);
    unlink(p);
  }
  rmdir(dir);
}

/* Four keys "block-0".."block-3", as kvx_keys over `bytes`. */
static void make_keys(char bytes[4][16], kvx_key keys[4]) {
  for (int i = 0; i < 4; i++) {
    snprintf(bytes[i], 16, "block-%d", i);
    keys[i].bytes = (const uint8_t *)bytes[i];
    keys[i].len = (uint32_t)strlen(bytes[i]);
  }
}

/* Two host layouts of `block` (8 blocks), the destination's with `dst_flags`: the source
 * filled with the bytes i * mul + add, the destination zeroed. */
struct host_pair {
  kvx_layout *src, *dst;
  unsigned char *sp, *dp;
  uint64_t block_bytes;
};

static struct host_pair host_pair(kvx_engine *e, const kvx_layout_config *block, uint32_t dst_flags, unsigned mul, unsigned add) {
  struct host_pair p = {NULL, NULL, NULL, NULL, 0};
  uint64_t sa = 0, da = 0;
  OK(kvx_layout_create_host(e, block, 0, &p.src));
  OK(kvx_layout_create_host(e, block, dst_flags, &p.dst));
  OK(kvx_layout_block_bytes(p.src, &p.block_bytes));
  OK(kvx_layout_base(p.src, 0, &sa));
  OK(kvx_layout_base(p.dst, 0, &da));
  p.sp = (unsigned char *)(uintptr_t)sa;
  p.dp = (unsigned char *)(uintptr_t)da;
  for (uint64_t i = 0; i < 8 * p.block_bytes; i++) p.sp[i] = (unsigned char)(i * mul + add);
  memset(p.dp, 0, 8 * p.block_bytes);
  return p;
}

/* A store made in KVX_TEST_DIR: 4 blocks put from one host layout, looked up, got into
 * another and compared byte for byte, a miss, removed, counted. */
static void store_round_trip(kvx_engine *e, const char *dir) {
  char sdir[512];
  snprintf(sdir, sizeof sdir, "%s/kvx-c-store-%d", dir, (int)getpid());
  remove_store_dir(sdir);
  kvx_layout_config block = geometry(8);
  kvx_store_config sc;
  kvx_store_config_init(&sc);
  EXPECT(sc.struct_size == sizeof sc && sc.flags == KVX_STORE_CREATE && sc.shards == 1, "kvx_store_config_init defaults");
  const char ns[] = "c-test model bf16 tp0/1";
  sc.block = &block;
  sc.capacity_blocks = 16;
  sc.namespace_bytes = (const uint8_t *)ns;
  sc.namespace_len = (uint32_t)strlen(ns);
  sc.shards = 2;
  kvx_store *st = NULL;
  OK(kvx_store_open(e, sdir, &sc, &st));

  struct host_pair hp = host_pair(e, &block, KVX_HOST_PINNED, 37, 11);
  kvx_layout *src = hp.src, *dst = hp.dst;
  unsigned char *sp = hp.sp, *dp = hp.dp;
  uint64_t block_bytes = hp.block_bytes;

  char kb[4][16];
  kvx_key keys[4];
  make_keys(kb, keys);
  uint64_t src_ids[4] = {1, 3, 5, 7}, dst_ids[4] = {0, 2, 4, 6};
  kvx_store_request *put = NULL;
  OK(kvx_store_put(st, src, src_ids, keys, 4, NULL, &put));
  OK(kvx_store_request_wait(put, UINT64_MAX));
  for (size_t i = 0; i < 4; i++) {
    kvx_status ks = 99;
    OK(kvx_store_request_key_status(put, i, &ks));
    EXPECT(ks == KVX_OK, "put key %zu: %s", i, kvx_status_str(ks));
  }
  EXPECT(strcmp(kvx_store_request_error(put), "") == 0, "a put that succeeded has no message");
  /* From a completion callback of the store's engine a blocking wait on a store request
   * is refused (the callback may hold the thread the request needs); a wait of 0 polls. */
  struct store_looked sl;
  memset(&sl, 0, sizeof sl);
  sl.req = put;
  kvx_transfer_options lo;
  kvx_transfer_options_init(&lo);
  lo.on_complete = look_at_store_request;
  lo.user_data = &sl;
  uint64_t spare_src = 0, spare_dst = 7;
  kvx_request *t = NULL;
  OK(kvx_transfer_submit(e, src, &spare_src, dst, &spare_dst, 1, &lo, &t));
  OK(kvx_request_wait(t, UINT64_MAX));
  kvx_request_release(t);
  EXPECT(sl.waited == KVX_ERR_INVALID_ARG && strstr(sl.message, "callback") != NULL,
         "wait on a store request from a callback: %s (%s)", kvx_status_str(sl.waited), sl.message);
  EXPECT(sl.polled == KVX_OK, "wait 0 on a store request from a callback: %s", kvx_status_str(sl.polled));
  kvx_store_request_release(put);

  /* A lookup of the four and one more, with a lease. */
  kvx_key five[5];
  memcpy(five, keys, sizeof keys);
  five[4].bytes = (const uint8_t *)"never put";
  five[4].len = 9;
  uint8_t present[5] = {7, 7, 7, 7, 7};
  size_t leading = 99;
  OK(kvx_store_lookup(st, five, 5, KVX_LOOKUP_LEASE, present, &leading));
  EXPECT(present[0] == 1 && present[1] == 1 && present[2] == 1 && present[3] == 1 && present[4] == 0 && leading == 4,
         "lookup: %u %u %u %u %u, leading %zu", present[0], present[1], present[2], present[3], present[4], leading);
  OK(kvx_store_release_leases(st, five, 5));

  kvx_store_request *get = NULL;
  OK(kvx_store_get(st, keys, 4, dst, dst_ids, NULL, &get));
  OK(kvx_store_request_wait(get, UINT64_MAX));
  kvx_store_request_release(get);
  for (int i = 0; i < 4; i++) {
    EXPECT(memcmp(sp + src_ids[i] * block_bytes, dp + dst_ids[i] * block_bytes, block_bytes) == 0, "key %d: got other bytes", i);
  }

  /* A get of a key never put: that key alone is NOT_FOUND, the request says so. */
  kvx_key two[2] = {keys[0], five[4]};
  uint64_t two_ids[2] = {1, 3};
  OK(kvx_store_get(st, two, 2, dst, two_ids, NULL, &get));
  expect_fail(kvx_store_request_wait(get, UINT64_MAX), KVX_ERR_NOT_FOUND, "get of a key never put");
  EXPECT(strstr(kvx_store_request_error(get), "key 1") != NULL, "request error names the key: %s", kvx_store_request_error(get));
  kvx_status k0 = 99, k1 = 99;
  OK(kvx_store_request_key_status(get, 0, &k0));
  OK(kvx_store_request_key_status(get, 1, &k1));
  EXPECT(k0 == KVX_OK && k1 == KVX_ERR_NOT_FOUND, "per key: %s, %s", kvx_status_str(k0), kvx_status_str(k1));
  EXPECT(kvx_store_request_key_error(get, 1)[0] != '\0' && kvx_store_request_key_error(get, 0)[0] == '\0', "per-key messages");
  EXPECT(kvx_store_request_poll(get) == KVX_ERR_NOT_FOUND, "poll after the end");
  kvx_status untouched = 77;
  expect_fail(kvx_store_request_key_status(get, 2, &untouched), KVX_ERR_OUT_OF_RANGE, "key_status past the keys");
  EXPECT(untouched == 77, "key_status past the keys wrote its output");
  kvx_store_request_release(get);
  EXPECT(memcmp(sp + 1 * block_bytes, dp + 1 * block_bytes, block_bytes) == 0, "the hit of a batch with a miss loaded");

  kvx_status removed[5] = {99, 99, 99, 99, 99};
  OK(kvx_store_remove(st, five, 5, removed));
  EXPECT(removed[0] == KVX_OK && removed[3] == KVX_OK && removed[4] == KVX_ERR_NOT_FOUND, "remove: %s %s",
         kvx_status_str(removed[0]), kvx_status_str(removed[4]));
  OK(kvx_store_lookup(st, keys, 4, 0, present, &leading));
  EXPECT(leading == 0 && present[0] == 0, "a removed key is not found");

  kvx_store_counters c;
  memset(&c, 0, sizeof c);
  c.struct_size = sizeof c;
  OK(kvx_store_stats(st, &c));
  EXPECT(c.struct_size == sizeof c && c.entries == 0 && c.capacity == 16 && c.puts == 4 && c.hits == 5 && c.misses == 1 &&
             c.removes == 4 && c.bytes == 0,
         "stats: entries %llu puts %llu hits %llu misses %llu removes %llu", (unsigned long long)c.entries,
         (unsigned long long)c.puts, (unsigned long long)c.hits, (unsigned long long)c.misses, (unsigned long long)c.removes);
  EXPECT(strcmp(kvx_status_str(KVX_ERR_NOT_FOUND), "KVX_ERR_NOT_FOUND") == 0, "status_str NOT_FOUND");
  const kvx_api *api = kvx_get_api(KVX_ABI_MAJOR);
  EXPECT(api->store_open == kvx_store_open && api->store_put == kvx_store_put && api->store_request_release == kvx_store_request_release,
         "table entries for the store");

  /* A second open of the store this process owns is refused, naming the pid. */
  kvx_store *again = NULL;
  expect_fail(kvx_store_open(e, sdir, &sc, &again), KVX_ERR_BUSY, "second open of an owned store");
  EXPECT(again == NULL, "a refused open wrote its output");
  kvx_store_close(st);
  kvx_store_close(NULL);
  kvx_layout_destroy(dst);
  kvx_layout_destroy(src);
  remove_store_dir(sdir);
}

/* Bad store calls: each its exact status, a message, outputs untouched. */
static void store_bad_calls(kvx_engine *e, const char *dir) {
  char sdir[512];
  snprintf(sdir, sizeof sdir, "%s/kvx-c-store-bad-%d", dir, (int)getpid());
  remove_store_dir(sdir);
  kvx_layout_config block = geometry(4);
  kvx_store_config sc;
  kvx_store_config_init(&sc);
  sc.block = &block;
  sc.capacity_blocks = 4;
  kvx_store *st = (kvx_store *)(uintptr_t)0x1;
  expect_fail(kvx_store_open(e, NULL, &sc, &st), KVX_ERR_INVALID_ARG, "store_open NULL dir");
  expect_fail(kvx_store_open(e, sdir, NULL, &st), KVX_ERR_INVALID_ARG, "store_open NULL config");
  expect_fail(kvx_store_open(NULL, sdir, &sc, &st), KVX_ERR_INVALID_ARG, "store_open NULL engine");
  kvx_store_config small = sc;
  small.struct_size = 8;
  expect_fail(kvx_store_open(e, sdir, &small, &st), KVX_ERR_INVALID_ARG, "store_open small struct_size");
  kvx_store_config nob = sc;
  nob.block = NULL;
  expect_fail(kvx_store_open(e, sdir, &nob, &st), KVX_ERR_INVALID_ARG, "store_open NULL block");
  kvx_store_config flags = sc;
  flags.flags |= 0x100;
  expect_fail(kvx_store_open(e, sdir, &flags, &st), KVX_ERR_INVALID_ARG, "store_open unknown flag");
  kvx_store_config zero = sc;
  zero.capacity_blocks = 0;
  expect_fail(kvx_store_open(e, sdir, &zero, &st), KVX_ERR_INVALID_ARG, "store_open capacity 0");
  uint8_t longns[300] = {0};
  kvx_store_config ns = sc;
  ns.namespace_bytes = longns;
  ns.namespace_len = sizeof longns;
  expect_fail(kvx_store_open(e, sdir, &ns, &st), KVX_ERR_INVALID_ARG, "store_open namespace of 300 bytes");
  kvx_store_config nocreate = sc;
  nocreate.flags = 0;
  expect_fail(kvx_store_open(e, sdir, &nocreate, &st), KVX_ERR_INVALID_ARG, "store_open without CREATE where no store is");
  EXPECT(st == (kvx_store *)(uintptr_t)0x1, "failed opens wrote their output");
  OK(kvx_store_open(e, sdir, &sc, &st));

  kvx_layout *host = NULL;
  OK(kvx_layout_create_host(e, &block, 0, &host));
  char kb[4][16];
  kvx_key keys[4];
  make_keys(kb, keys);
  uint8_t longkey[65];
  memset(longkey, 'k', sizeof longkey);
  kvx_key empty = {(const uint8_t *)"x", 0}, too_long = {longkey, 65}, null_bytes = {NULL, 3};
  uint8_t present[4] = {7, 7, 7, 7};
  size_t leading = 99;
  expect_fail(kvx_store_lookup(NULL, keys, 4, 0, present, &leading), KVX_ERR_INVALID_ARG, "lookup NULL store");
  expect_fail(kvx_store_lookup(st, NULL, 4, 0, present, &leading), KVX_ERR_INVALID_ARG, "lookup NULL keys, n 4");
  expect_fail(kvx_store_lookup(st, keys, 0, 0, present, &leading), KVX_ERR_INVALID_ARG, "lookup of no keys");
  expect_fail(kvx_store_lookup(st, &empty, 1, 0, present, &leading), KVX_ERR_INVALID_ARG, "lookup key of 0 bytes");
  expect_fail(kvx_store_lookup(st, &too_long, 1, 0, present, &leading), KVX_ERR_INVALID_ARG, "lookup key of 65 bytes");
  expect_fail(kvx_store_lookup(st, &null_bytes, 1, 0, present, &leading), KVX_ERR_INVALID_ARG, "lookup key with NULL bytes");
  expect_fail(kvx_store_lookup(st, keys, SIZE_MAX, 0, present, &leading), KVX_ERR_INVALID_ARG, "lookup n SIZE_MAX");
  expect_fail(kvx_store_lookup(st, keys, 4, 2, present, &leading), KVX_ERR_INVALID_ARG, "lookup unknown flag");
  expect_fail(kvx_store_lookup(st, keys, 4, 0, NULL, &leading), KVX_ERR_INVALID_ARG, "lookup NULL present_out");
  expect_fail(kvx_store_lookup(st, keys, 4, 0, present, NULL), KVX_ERR_INVALID_ARG, "lookup NULL leading_hits_out");
  EXPECT(present[0] == 7 && present[3] == 7 && leading == 99, "failed lookups wrote their outputs");
  expect_fail(kvx_store_release_leases(st, &too_long, 1), KVX_ERR_INVALID_ARG, "release_leases key of 65 bytes");

  uint64_t ids[4] = {0, 1, 2, 3}, bad_ids[4] = {0, 1, 2, 9};
  kvx_store_request *req = (kvx_store_request *)(uintptr_t)0x1;
  expect_fail(kvx_store_put(NULL, host, ids, keys, 4, NULL, &req), KVX_ERR_INVALID_ARG, "put NULL store");
  expect_fail(kvx_store_put(st, NULL, ids, keys, 4, NULL, &req), KVX_ERR_INVALID_ARG, "put NULL src");
  expect_fail(kvx_store_put(st, host, NULL, keys, 4, NULL, &req), KVX_ERR_INVALID_ARG, "put NULL src_ids");
  expect_fail(kvx_store_put(st, host, ids, NULL, 4, NULL, &req), KVX_ERR_INVALID_ARG, "put NULL keys, n 4");
  expect_fail(kvx_store_put(st, host, ids, keys, SIZE_MAX, NULL, &req), KVX_ERR_INVALID_ARG, "put n SIZE_MAX");
  expect_fail(kvx_store_put(st, host, ids, &too_long, 1, NULL, &req), KVX_ERR_INVALID_ARG, "put key of 65 bytes");
  expect_fail(kvx_store_put(st, host, bad_ids, keys, 4, NULL, &req), KVX_ERR_OUT_OF_RANGE, "put block id past the layout");
  expect_fail(kvx_store_put(st, host, ids, keys, 4, NULL, NULL), KVX_ERR_INVALID_ARG, "put NULL out_request");
  kvx_transfer_options o;
  kvx_transfer_options_init(&o);
  o.layer_begin = 1;
  expect_fail(kvx_store_put(st, host, ids, keys, 4, &o, &req), KVX_ERR_INVALID_ARG, "put of a layer range");
  kvx_transfer_options_init(&o);
  o.on_complete = look;
  expect_fail(kvx_store_put(st, host, ids, keys, 4, &o, &req), KVX_ERR_INVALID_ARG, "put with a completion callback");
  kvx_transfer_options_init(&o);
  o.struct_size = 4;
  expect_fail(kvx_store_put(st, host, ids, keys, 4, &o, &req), KVX_ERR_INVALID_ARG, "put options of a small struct_size");
  kvx_layout_config other = geometry(4);
  other.page_size = 6;
  kvx_layout *wrong = NULL;
  OK(kvx_layout_create_host(e, &other, 0, &wrong));
  expect_fail(kvx_store_put(st, wrong, ids, keys, 4, NULL, &req), KVX_ERR_INCOMPATIBLE, "put from a layout of another geometry");
  expect_fail(kvx_store_get(st, keys, 4, wrong, ids, NULL, &req), KVX_ERR_INCOMPATIBLE, "get into a layout of another geometry");
  kvx_layout_destroy(wrong);
  expect_fail(kvx_store_get(NULL, keys, 4, host, ids, NULL, &req), KVX_ERR_INVALID_ARG, "get NULL store");
  expect_fail(kvx_store_get(st, NULL, 4, host, ids, NULL, &req), KVX_ERR_INVALID_ARG, "get NULL keys, n 4");
  expect_fail(kvx_store_get(st, &empty, 1, host, ids, NULL, &req), KVX_ERR_INVALID_ARG, "get key of 0 bytes");
  expect_fail(kvx_store_get(st, keys, 4, host, bad_ids, NULL, &req), KVX_ERR_OUT_OF_RANGE, "get block id past the layout");
  uint64_t twice[4] = {0, 1, 1, 2};
  expect_fail(kvx_store_get(st, keys, 4, host, twice, NULL, &req), KVX_ERR_INVALID_ARG, "get into one block twice");
  EXPECT(req == (kvx_store_request *)(uintptr_t)0x1, "failed puts and gets wrote their output");

  kvx_status statuses[4] = {99, 99, 99, 99};
  expect_fail(kvx_store_remove(NULL, keys, 4, statuses), KVX_ERR_INVALID_ARG, "remove NULL store");
  expect_fail(kvx_store_remove(st, NULL, 4, statuses), KVX_ERR_INVALID_ARG, "remove NULL keys, n 4");
  expect_fail(kvx_store_remove(st, keys, 4, NULL), KVX_ERR_INVALID_ARG, "remove NULL statuses_out");
  expect_fail(kvx_store_remove(st, &too_long, 1, statuses), KVX_ERR_INVALID_ARG, "remove key of 65 bytes");
  EXPECT(statuses[0] == 99, "failed removes wrote their output");

  kvx_store_counters c;
  memset(&c, 0xab, sizeof c);
  c.struct_size = 4;
  expect_fail(kvx_store_stats(st, &c), KVX_ERR_INVALID_ARG, "stats small struct_size");
  expect_fail(kvx_store_stats(st, NULL), KVX_ERR_INVALID_ARG, "stats NULL");
  expect_fail(kvx_store_stats(NULL, &c), KVX_ERR_INVALID_ARG, "stats NULL store");
  EXPECT(c.entries == 0xababababababababULL, "failed stats wrote their output");

  kvx_status ks = 77;
  expect_fail(kvx_store_request_wait(NULL, 0), KVX_ERR_INVALID_ARG, "store request wait NULL");
  expect_fail(kvx_store_request_poll(NULL), KVX_ERR_INVALID_ARG, "store request poll NULL");
  expect_fail(kvx_store_request_key_status(NULL, 0, &ks), KVX_ERR_INVALID_ARG, "store request key_status NULL");
  EXPECT(ks == 77, "key_status of NULL wrote its output");
  EXPECT(strcmp(kvx_store_request_error(NULL), "") == 0 && strcmp(kvx_store_request_key_error(NULL, 0), "") == 0,
         "messages of NULL are empty");
  kvx_store_request_release(NULL);

  kvx_store_close(st);
  kvx_layout_destroy(host);
  remove_store_dir(sdir);
}

/* Slot handles (1.5): the owner reserves slots that a data-only open writes and the owner
 * commits; leases slots that the data-only open reads back byte for byte; handles copied as
 * plain bytes. Then bad calls: each its status, outputs untouched. */
/* Removes a directory and everything under it (a shared tier's directory). */
static void remove_tree(const char *dir) {
  DIR *d = opendir(dir);
  if (d != NULL) {
    struct dirent *ent;
    char p[1024];
    while ((ent = readdir(d)) != NULL) {
      if (strcmp(ent->d_name, ".") == 0 || strcmp(ent->d_name, "..") == 0) continue;
      snprintf(p, sizeof p, "%s/%s", dir, ent->d_name);
      if (unlink(p) != 0) remove_tree(p);
    }
    closedir(d);
  }
  rmdir(dir);
}

static kvx_store_counters store_counters(kvx_store *st) {
  kvx_store_counters c;
  memset(&c, 0, sizeof c);
  c.struct_size = sizeof c;
  OK(kvx_store_stats(st, &c));
  return c;
}

/* The shared tier (1.7): two stores over one shared directory. Four blocks put into one,
 * written through, load bit-exact into the other, which never held them; each side's
 * counters say so. A 1.4-sized kvx_store_config still opens (its `shared` is never read),
 * and bad shared configs are refused with the reason. */
static void store_shared_tier(kvx_engine *e, const char *dir) {
  char shared[512], adir[512], bdir[512], cdir[512];
  snprintf(shared, sizeof shared, "%s/kvx-c-shared-%d", dir, (int)getpid());
  snprintf(adir, sizeof adir, "%s/kvx-c-shared-a-%d", dir, (int)getpid());
  snprintf(bdir, sizeof bdir, "%s/kvx-c-shared-b-%d", dir, (int)getpid());
  snprintf(cdir, sizeof cdir, "%s/kvx-c-shared-c-%d", dir, (int)getpid());
  remove_tree(shared);
  remove_store_dir(adir);
  remove_store_dir(bdir);
  remove_store_dir(cdir);

  kvx_shared_config sh;
  memset(&sh, 0x5a, sizeof sh);
  kvx_shared_config_init(&sh);
  EXPECT(sh.struct_size == sizeof sh && sh.kind == 0 && sh.path == NULL && sh.capacity_bytes == 0 && sh.endpoint == NULL &&
             sh.region == NULL && sh.bucket == NULL && sh.prefix == NULL && sh.threads == 0 && sh.timeout_ms == 0 &&
             sh.flags == 0 && sh.pending_puts == 0,
         "kvx_shared_config_init defaults");
  kvx_store_config_init(NULL);
  kvx_shared_config_init(NULL);
  EXPECT(kvx_get_api(KVX_ABI_MAJOR)->shared_config_init == kvx_shared_config_init, "table entry for 1.7");
  sh.kind = KVX_SHARED_DIR;
  sh.path = shared;
  sh.flags = KVX_SHARED_WRITE_THROUGH;

  kvx_layout_config block = geometry(8);
  kvx_store_config sc;
  kvx_store_config_init(&sc);
  EXPECT(sc.shared == NULL, "kvx_store_config_init: no shared tier");
  const char ns[] = "c-test shared model bf16";
  sc.block = &block;
  sc.capacity_blocks = 16;
  sc.namespace_bytes = (const uint8_t *)ns;
  sc.namespace_len = (uint32_t)strlen(ns);
  sc.shared = &sh;
  kvx_store *a = NULL, *b = NULL;
  OK(kvx_store_open(e, adir, &sc, &a));
  OK(kvx_store_open(e, bdir, &sc, &b));

  struct host_pair hp = host_pair(e, &block, 0, 29, 3);
  kvx_layout *src = hp.src, *dst = hp.dst;
  unsigned char *sp = hp.sp, *dp = hp.dp;
  uint64_t block_bytes = hp.block_bytes;
  char kb[4][16];
  kvx_key keys[4];
  make_keys(kb, keys);
  uint64_t src_ids[4] = {0, 2, 4, 6}, dst_ids[4] = {7, 5, 3, 1};

  kvx_store_request *r = NULL;
  OK(kvx_store_put(a, src, src_ids, keys, 4, NULL, &r));
  OK(kvx_store_request_wait(r, UINT64_MAX));
  kvx_store_request_release(r);
  kvx_store_counters ca = store_counters(a);
  EXPECT(ca.puts == 4 && ca.shared_puts == 4 && ca.shared_puts_dropped == 0 && ca.shared_requests >= 4,
         "written through: puts %llu, shared_puts %llu, dropped %llu, requests %llu", (unsigned long long)ca.puts,
         (unsigned long long)ca.shared_puts, (unsigned long long)ca.shared_puts_dropped, (unsigned long long)ca.shared_requests);

  OK(kvx_store_get(b, keys, 4, dst, dst_ids, NULL, &r));
  OK(kvx_store_request_wait(r, UINT64_MAX));
  kvx_store_request_release(r);
  for (int i = 0; i < 4; i++) {
    EXPECT(memcmp(sp + src_ids[i] * block_bytes, dp + dst_ids[i] * block_bytes, block_bytes) == 0,
           "key %d: the other store loaded other bytes", i);
  }
  kvx_store_counters cb = store_counters(b);
  EXPECT(cb.hits == 4 && cb.misses == 0 && cb.shared_hits == 4 && cb.shared_misses == 0 && cb.shared_integrity_failures == 0 &&
             cb.shared_timeouts == 0 && cb.shared_errors == 0 && cb.shared_requests >= 4,
         "loaded from the shared tier: hits %llu, shared_hits %llu, shared_misses %llu, errors %llu, requests %llu",
         (unsigned long long)cb.hits, (unsigned long long)cb.shared_hits, (unsigned long long)cb.shared_misses,
         (unsigned long long)cb.shared_errors, (unsigned long long)cb.shared_requests);
  /* A caller of 1.4 passes a smaller counters struct: only its fields are written. */
  kvx_store_counters old_c;
  memset(&old_c, 0x77, sizeof old_c);
  old_c.struct_size = offsetof(kvx_store_counters, shared_hits);
  OK(kvx_store_stats(b, &old_c));
  EXPECT(old_c.struct_size == offsetof(kvx_store_counters, shared_hits) && old_c.hits == 4 &&
             old_c.shared_hits == 0x7777777777777777ULL,
         "a 1.4-sized kvx_store_counters: size %u, hits %llu", old_c.struct_size, (unsigned long long)old_c.hits);

  /* A 1.4-sized config: `shared` lies past its struct_size, so it is not read (here it
   * points nowhere) and the store has no shared tier: the keys are misses. */
  kvx_store_config old = sc;
  old.struct_size = offsetof(kvx_store_config, shared);
  old.shared = (const kvx_shared_config *)(uintptr_t)0x1;
  kvx_store *c = NULL;
  OK(kvx_store_open(e, cdir, &old, &c));
  OK(kvx_store_get(c, keys, 4, dst, dst_ids, NULL, &r));
  expect_fail(kvx_store_request_wait(r, UINT64_MAX), KVX_ERR_NOT_FOUND, "get from a store opened without a shared tier");
  kvx_store_request_release(r);
  EXPECT(store_counters(c).shared_requests == 0, "a store without a shared tier made shared-tier calls");
  kvx_store_close(c);

  /* Bad shared configs: each refused with its reason, nothing opened. */
  struct {
    const char *what, *says;
    kvx_status want;
    uint32_t kind, flags, struct_size, store_flags;
    const char *path;
  } bad[] = {
      {"kind not set", "KVX_SHARED_DIR", KVX_ERR_INVALID_ARG, 0, 0, sizeof sh, 0, shared},
      {"unknown kind", "kind is 9", KVX_ERR_INVALID_ARG, 9, 0, sizeof sh, 0, shared},
      {"unknown flag", "KVX_SHARED_WRITE_THROUGH|NO_ADMIT", KVX_ERR_INVALID_ARG, KVX_SHARED_DIR, 8, sizeof sh, 0, shared},
      {"no path", "path is empty", KVX_ERR_INVALID_ARG, KVX_SHARED_DIR, 0, sizeof sh, 0, NULL},
      {"empty path", "path is empty", KVX_ERR_INVALID_ARG, KVX_SHARED_DIR, 0, sizeof sh, 0, ""},
      {"small struct_size", "kvx_shared_config_init", KVX_ERR_INVALID_ARG, KVX_SHARED_DIR, 0, 8, 0, shared},
      {"no bucket", "bucket is empty", KVX_ERR_INVALID_ARG, KVX_SHARED_S3, 0, sizeof sh, 0, NULL},
      {"with DATA_ONLY", "DATA_ONLY", KVX_ERR_INVALID_ARG, KVX_SHARED_DIR, 0, sizeof sh, KVX_STORE_DATA_ONLY, shared},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    kvx_shared_config x = sh;
    x.kind = bad[i].kind, x.flags = bad[i].flags, x.struct_size = bad[i].struct_size, x.path = bad[i].path;
    kvx_store_config y = sc;
    y.shared = &x;
    y.flags |= bad[i].store_flags;
    kvx_store *st = (kvx_store *)(uintptr_t)0x1;
    expect_fail(kvx_store_open(e, cdir, &y, &st), bad[i].want, bad[i].what);
    EXPECT(strstr(kvx_last_error(), bad[i].says) != NULL, "%s: the message lacks \"%s\": %s", bad[i].what, bad[i].says,
           kvx_last_error());
    EXPECT(st == (kvx_store *)(uintptr_t)0x1, "%s: a failed open wrote its output", bad[i].what);
  }

  kvx_store_close(a);
  kvx_store_close(b);
  kvx_layout_destroy(dst);
  kvx_layout_destroy(src);
  remove_store_dir(adir);
  remove_store_dir(bdir);
  remove_store_dir(cdir);
  remove_tree(shared);
}

static void store_slots(kvx_engine *e, const char *dir) {
  char sdir[512];
  snprintf(sdir, sizeof sdir, "%s/kvx-c-store-slots-%d", dir, (int)getpid());
  remove_store_dir(sdir);
  kvx_layout_config block = geometry(8);
  kvx_store_config sc;
  kvx_store_config_init(&sc);
  sc.block = &block;
  sc.capacity_blocks = 4;
  kvx_store *owner = NULL, *data = NULL;
  OK(kvx_store_open(e, sdir, &sc, &owner));
  kvx_store_config dc = sc;
  dc.flags = KVX_STORE_DATA_ONLY;
  OK(kvx_store_open(e, sdir, &dc, &data));

  struct host_pair hp = host_pair(e, &block, 0, 13, 5);
  kvx_layout *src = hp.src, *dst = hp.dst;
  unsigned char *sp = hp.sp, *dp = hp.dp;
  uint64_t block_bytes = hp.block_bytes;

  char kb[4][16];
  kvx_key keys[4];
  make_keys(kb, keys);
  kvx_slot_handle w[4];
  uint32_t kinds[4] = {0, 0, 0, 0};
  EXPECT(sizeof(kvx_slot_handle) == 48, "a slot handle is 48 bytes");
  OK(kvx_store_reserve_slots(owner, keys, 4, w, kinds));
  for (int i = 0; i < 4; i++) EXPECT(kinds[i] == KVX_RESERVED_WRITE, "reserve key %d: %u", i, kinds[i]);
  unsigned char shipped[sizeof w];
  memcpy(shipped, w, sizeof w); /* as a runtime ships them to the data process */
  kvx_slot_handle got[4];
  memcpy(got, shipped, sizeof got);
  uint64_t src_ids[4] = {1, 3, 5, 7}, dst_ids[4] = {0, 2, 4, 6};
  kvx_store_request *req = NULL;
  OK(kvx_store_write_slots(data, src, src_ids, got, 4, NULL, &req));
  OK(kvx_store_request_wait(req, UINT64_MAX));
  kvx_store_request_release(req);
  kvx_status st[4] = {99, 99, 99, 99};
  OK(kvx_store_commit_slots(owner, w, 4, st));
  for (int i = 0; i < 4; i++) EXPECT(st[i] == KVX_OK, "commit %d: %s", i, kvx_status_str(st[i]));
  OK(kvx_store_commit_slots(owner, w, 1, st));
  EXPECT(st[0] == KVX_ERR_INVALID_ARG, "a second commit: %s", kvx_status_str(st[0]));
  OK(kvx_store_reserve_slots(owner, keys, 1, w, kinds));
  EXPECT(kinds[0] == KVX_RESERVED_HELD, "reserve of a held key: %u", kinds[0]);

  kvx_key two[2] = {keys[2], {(const uint8_t *)"never put", 9}};
  kvx_slot_handle r[2];
  uint8_t present[2] = {7, 7};
  OK(kvx_store_lease_slots(owner, two, 2, r, present));
  EXPECT(present[0] == 1 && present[1] == 0 && r[1].slot == 0 && r[1].generation == 0, "lease: %u %u", present[0], present[1]);
  OK(kvx_store_read_slots(data, r, 1, dst, dst_ids, NULL, &req));
  OK(kvx_store_request_wait(req, UINT64_MAX));
  kvx_store_request_release(req);
  EXPECT(memcmp(sp + 5 * block_bytes, dp, block_bytes) == 0, "a leased slot read back with other bytes");
  OK(kvx_store_release_leases(owner, two, 1));
  /* Lease tokens (1.6): each hit leased for its caller; given back once, all or none. */
  uint64_t tok[2] = {9, 9};
  size_t lead = 9;
  OK(kvx_store_lease(owner, two, 2, tok, &lead));
  EXPECT(tok[0] != 0 && tok[1] == 0 && lead == 1, "lease tokens: %llu %llu, leading %zu", (unsigned long long)tok[0],
         (unsigned long long)tok[1], lead);
  uint64_t twice[2] = {tok[0], tok[0]};
  expect_fail(kvx_store_release(owner, twice, 2), KVX_ERR_INVALID_ARG, "a lease listed twice");
  OK(kvx_store_release(owner, tok, 2));
  expect_fail(kvx_store_release(owner, tok, 1), KVX_ERR_INVALID_ARG, "a lease given back twice");
  expect_fail(kvx_store_lease(NULL, two, 2, tok, &lead), KVX_ERR_INVALID_ARG, "lease NULL store");
  expect_fail(kvx_store_lease(owner, two, 2, NULL, &lead), KVX_ERR_INVALID_ARG, "lease NULL leases_out");
  expect_fail(kvx_store_lease(owner, two, 2, tok, NULL), KVX_ERR_INVALID_ARG, "lease NULL leading_hits_out");
  expect_fail(kvx_store_release(owner, NULL, 1), KVX_ERR_INVALID_ARG, "release NULL leases");
  expect_fail(kvx_store_release(data, tok, 1), KVX_ERR_INVALID_ARG, "release in a data-only open");
  /* A reservation aborted: no entry. */
  kvx_key other = {(const uint8_t *)"other", 5};
  OK(kvx_store_remove(owner, keys, 1, st));
  OK(kvx_store_reserve_slots(owner, &other, 1, w, kinds));
  EXPECT(kinds[0] == KVX_RESERVED_WRITE, "reserve: %u", kinds[0]);
  OK(kvx_store_abort_slots(owner, w, 1));
  size_t leading = 99;
  OK(kvx_store_lookup(owner, &other, 1, 0, present, &leading));
  EXPECT(present[0] == 0, "an aborted reservation is no entry");
  const kvx_api *api = kvx_get_api(KVX_ABI_MAJOR);
  EXPECT(api->store_lease_slots == kvx_store_lease_slots && api->store_reserve_slots == kvx_store_reserve_slots &&
             api->store_commit_slots == kvx_store_commit_slots && api->store_abort_slots == kvx_store_abort_slots &&
             api->store_read_slots == kvx_store_read_slots && api->store_write_slots == kvx_store_write_slots &&
             api->store_lease == kvx_store_lease && api->store_release == kvx_store_release,
         "table entries for the slot and lease calls");

  /* Bad calls. */
  kvx_slot_handle untouched[2];
  memset(untouched, 0xab, sizeof untouched);
  uint32_t k2[2] = {77, 77};
  expect_fail(kvx_store_reserve_slots(NULL, keys, 2, untouched, k2), KVX_ERR_INVALID_ARG, "reserve_slots NULL store");
  expect_fail(kvx_store_reserve_slots(owner, NULL, 2, untouched, k2), KVX_ERR_INVALID_ARG, "reserve_slots NULL keys, n 2");
  expect_fail(kvx_store_reserve_slots(owner, keys, 0, untouched, k2), KVX_ERR_INVALID_ARG, "reserve_slots of no keys");
  expect_fail(kvx_store_reserve_slots(owner, keys, 2, NULL, k2), KVX_ERR_INVALID_ARG, "reserve_slots NULL handles_out");
  expect_fail(kvx_store_reserve_slots(owner, keys, 2, untouched, NULL), KVX_ERR_INVALID_ARG, "reserve_slots NULL reservations_out");
  expect_fail(kvx_store_reserve_slots(data, keys, 2, untouched, k2), KVX_ERR_INVALID_ARG, "reserve_slots on a data-only store");
  expect_fail(kvx_store_lease_slots(owner, keys, 2, NULL, present), KVX_ERR_INVALID_ARG, "lease_slots NULL handles_out");
  expect_fail(kvx_store_lease_slots(owner, keys, 2, untouched, NULL), KVX_ERR_INVALID_ARG, "lease_slots NULL present_out");
  expect_fail(kvx_store_lease_slots(owner, keys, 0, untouched, present), KVX_ERR_INVALID_ARG, "lease_slots of no keys");
  expect_fail(kvx_store_lease_slots(data, keys, 2, untouched, present), KVX_ERR_INVALID_ARG, "lease_slots on a data-only store");
  EXPECT(k2[0] == 77 && untouched[0].slot == 0xababababu, "failed reserves and leases wrote their outputs");
  kvx_slot_handle past = r[0];
  past.slot = 4;
  kvx_status s2[2] = {77, 77};
  expect_fail(kvx_store_commit_slots(NULL, r, 1, s2), KVX_ERR_INVALID_ARG, "commit_slots NULL store");
  expect_fail(kvx_store_commit_slots(owner, NULL, 1, s2), KVX_ERR_INVALID_ARG, "commit_slots NULL handles, n 1");
  expect_fail(kvx_store_commit_slots(owner, r, 0, s2), KVX_ERR_INVALID_ARG, "commit_slots of no handles");
  expect_fail(kvx_store_commit_slots(owner, r, 1, NULL), KVX_ERR_INVALID_ARG, "commit_slots NULL statuses_out");
  expect_fail(kvx_store_commit_slots(owner, &past, 1, s2), KVX_ERR_OUT_OF_RANGE, "commit_slots slot past the capacity");
  expect_fail(kvx_store_commit_slots(data, r, 1, s2), KVX_ERR_INVALID_ARG, "commit_slots on a data-only store");
  EXPECT(s2[0] == 77, "failed commits wrote their output");
  expect_fail(kvx_store_abort_slots(owner, NULL, 1), KVX_ERR_INVALID_ARG, "abort_slots NULL handles, n 1");
  expect_fail(kvx_store_abort_slots(owner, r, 0), KVX_ERR_INVALID_ARG, "abort_slots of no handles");
  expect_fail(kvx_store_abort_slots(owner, &past, 1), KVX_ERR_OUT_OF_RANGE, "abort_slots slot past the capacity");
  expect_fail(kvx_store_abort_slots(data, r, 1), KVX_ERR_INVALID_ARG, "abort_slots on a data-only store");
  req = (kvx_store_request *)(uintptr_t)0x1;
  expect_fail(kvx_store_read_slots(NULL, r, 1, dst, dst_ids, NULL, &req), KVX_ERR_INVALID_ARG, "read_slots NULL store");
  expect_fail(kvx_store_read_slots(data, NULL, 1, dst, dst_ids, NULL, &req), KVX_ERR_INVALID_ARG, "read_slots NULL handles, n 1");
  expect_fail(kvx_store_read_slots(data, r, 0, dst, dst_ids, NULL, &req), KVX_ERR_INVALID_ARG, "read_slots of no handles");
  expect_fail(kvx_store_read_slots(data, r, 1, NULL, dst_ids, NULL, &req), KVX_ERR_INVALID_ARG, "read_slots NULL dst");
  expect_fail(kvx_store_read_slots(data, r, 1, dst, NULL, NULL, &req), KVX_ERR_INVALID_ARG, "read_slots NULL dst_ids");
  expect_fail(kvx_store_read_slots(data, r, 1, dst, dst_ids, NULL, NULL), KVX_ERR_INVALID_ARG, "read_slots NULL out_request");
  expect_fail(kvx_store_read_slots(data, &past, 1, dst, dst_ids, NULL, &req), KVX_ERR_OUT_OF_RANGE, "read_slots slot past the capacity");
  expect_fail(kvx_store_write_slots(NULL, src, src_ids, got, 1, NULL, &req), KVX_ERR_INVALID_ARG, "write_slots NULL store");
  expect_fail(kvx_store_write_slots(data, NULL, src_ids, got, 1, NULL, &req), KVX_ERR_INVALID_ARG, "write_slots NULL src");
  expect_fail(kvx_store_write_slots(data, src, NULL, got, 1, NULL, &req), KVX_ERR_INVALID_ARG, "write_slots NULL src_ids");
  expect_fail(kvx_store_write_slots(data, src, src_ids, NULL, 1, NULL, &req), KVX_ERR_INVALID_ARG, "write_slots NULL handles, n 1");
  expect_fail(kvx_store_write_slots(data, src, src_ids, got, 0, NULL, &req), KVX_ERR_INVALID_ARG, "write_slots of no handles");
  expect_fail(kvx_store_write_slots(data, src, src_ids, &past, 1, NULL, &req), KVX_ERR_OUT_OF_RANGE, "write_slots slot past the capacity");
  kvx_transfer_options o;
  kvx_transfer_options_init(&o);
  o.layer_end = 1;
  expect_fail(kvx_store_write_slots(data, src, src_ids, got, 1, &o, &req), KVX_ERR_INVALID_ARG, "write_slots of a layer range");
  EXPECT(req == (kvx_store_request *)(uintptr_t)0x1, "failed reads and writes wrote their output");
  /* The key calls of a data-only store are refused. */
  expect_fail(kvx_store_lookup(data, keys, 1, 0, present, &leading), KVX_ERR_INVALID_ARG, "lookup on a data-only store");
  expect_fail(kvx_store_put(data, src, src_ids, keys, 1, NULL, &req), KVX_ERR_INVALID_ARG, "put on a data-only store");
  expect_fail(kvx_store_get(data, keys, 1, dst, dst_ids, NULL, &req), KVX_ERR_INVALID_ARG, "get on a data-only store");
  expect_fail(kvx_store_remove(data, keys, 1, st), KVX_ERR_INVALID_ARG, "remove on a data-only store");

  kvx_store_close(data);
  kvx_store_close(owner);
  kvx_layout_destroy(dst);
  kvx_layout_destroy(src);
  remove_store_dir(sdir);
}

/* A store whose engine is destroyed first: its calls are KVX_ERR_SHUTDOWN, its close
 * still works, nothing leaks. */
static void store_outlives_engine(const char *dir) {
  char sdir[512];
  snprintf(sdir, sizeof sdir, "%s/kvx-c-store-orphan-%d", dir, (int)getpid());
  remove_store_dir(sdir);
  kvx_engine_config ec;
  kvx_engine_config_init(&ec);
  ec.device = KVX_DEVICE_EMULATED;
  ec.bounce_bytes = 1 << 20;
  ec.slot_bytes = 64 << 10;
  kvx_engine *e = NULL;
  OK(kvx_engine_create(&ec, &e));
  kvx_layout_config block = geometry(4);
  kvx_store_config sc;
  kvx_store_config_init(&sc);
  sc.block = &block;
  sc.capacity_blocks = 4;
  kvx_store *st = NULL;
  OK(kvx_store_open(e, sdir, &sc, &st));
  kvx_layout *host = NULL;
  OK(kvx_layout_create_host(e, &block, 0, &host));
  char kb[4][16];
  kvx_key keys[4];
  make_keys(kb, keys);
  uint64_t ids[4] = {0, 1, 2, 3};
  kvx_store_request *put = NULL;
  OK(kvx_store_put(st, host, ids, keys, 4, NULL, &put));
  kvx_engine_destroy(e);
  /* The put ends with the engine (its keys stored or cancelled); the minute is a hang guard. */
  kvx_status ended = kvx_store_request_wait(put, 60ull * 1000 * 1000 * 1000);
  EXPECT(ended == KVX_OK || ended == KVX_ERR_CANCELLED || ended == KVX_ERR_SHUTDOWN, "a put whose engine was destroyed: %s",
         kvx_status_str(ended));
  kvx_store_request_release(put);
  uint8_t present[4] = {7, 7, 7, 7};
  size_t leading = 99;
  expect_fail(kvx_store_lookup(st, keys, 4, 0, present, &leading), KVX_ERR_SHUTDOWN, "lookup after the engine was destroyed");
  kvx_store_request *get = NULL;
  expect_fail(kvx_store_get(st, keys, 4, host, ids, NULL, &get), KVX_ERR_SHUTDOWN, "get after the engine was destroyed");
  EXPECT(present[0] == 7 && leading == 99 && get == NULL, "refused calls wrote their outputs");
  kvx_store_close(st);
  kvx_layout_destroy(host);
  remove_store_dir(sdir);
}

static void versions_and_table(void) {
  EXPECT(kvx_abi_version() == ((KVX_ABI_MAJOR << 16) | KVX_ABI_MINOR), "kvx_abi_version %#x", kvx_abi_version());
  char abi[32];
  snprintf(abi, sizeof abi, "abi %d.%d ", KVX_ABI_MAJOR, KVX_ABI_MINOR);
  EXPECT(strstr(kvx_version_string(), abi) != NULL, "version string %s lacks %s", kvx_version_string(), abi);
#ifdef CARGO_VERSION
  /* Cargo.toml is the one source of the versions (the Makefile passes them in). */
  EXPECT(KVX_ABI_MAJOR == CARGO_ABI_MAJOR && KVX_ABI_MINOR == CARGO_ABI_MINOR, "header ABI %d.%d, Cargo.toml %d.%d",
         KVX_ABI_MAJOR, KVX_ABI_MINOR, CARGO_ABI_MAJOR, CARGO_ABI_MINOR);
  char pkg[64];
  snprintf(pkg, sizeof pkg, "kvxfer %s ", CARGO_VERSION);
  EXPECT(strncmp(kvx_version_string(), pkg, strlen(pkg)) == 0, "version string %s does not start with %s", kvx_version_string(), pkg);
#endif
  EXPECT(strcmp(kvx_status_str(KVX_ERR_IO), "KVX_ERR_IO") == 0, "status_str");
  EXPECT(strcmp(kvx_status_str(KVX_OK), "KVX_OK") == 0, "status_str OK");
  EXPECT(strcmp(kvx_status_str(999), "KVX_UNKNOWN_STATUS") == 0, "status_str unknown");
  const kvx_api *api = kvx_get_api(KVX_ABI_MAJOR);
  EXPECT(api != NULL && api->struct_size == sizeof(kvx_api), "kvx_get_api(1)");
  EXPECT(api != NULL && api->abi_major == KVX_ABI_MAJOR && api->abi_minor == KVX_ABI_MINOR, "table version");
  EXPECT(api != NULL && api->transfer_submit == kvx_transfer_submit && api->set_logger == kvx_set_logger, "table entries");
  EXPECT(kvx_get_api(2) == NULL, "kvx_get_api(2) must be NULL");
  EXPECT(kvx_last_error()[0] != '\0', "kvx_get_api(2) leaves a message");
}

/* Remote layouts (1.3): the import path refuses what is not a whole blob of this ABI
 * major; export works with NIXL on the library path and says why not without it. */
static void remote_calls(kvx_engine *e) {
  const kvx_api *api = kvx_get_api(KVX_ABI_MAJOR);
  EXPECT(api->engine_export == kvx_engine_export && api->engine_import == kvx_engine_import &&
             api->blob_bytes == kvx_blob_bytes && api->blob_destroy == kvx_blob_destroy,
         "table entries for 1.3");
  kvx_layout_config lc;
  kvx_layout_config_init(&lc);
  lc.num_blocks = 4; lc.num_layers = 2; lc.outer_dim = 2; lc.page_size = 4; lc.inner_dim = 16; lc.dtype_bytes = 2;
  kvx_layout *host = NULL;
  OK(kvx_layout_create_host(e, &lc, 1, &host));
  kvx_layout *got[4] = {NULL, NULL, NULL};
  size_t n = 77;
  const uint8_t garbage[] = "KVXBLOB not really";
  expect_fail(kvx_engine_import(e, garbage, sizeof garbage, 0, got, 4, &n), KVX_ERR_INVALID_ARG, "import garbage");
  expect_fail(kvx_engine_import(e, NULL, 10, 0, got, 4, &n), KVX_ERR_INVALID_ARG, "import NULL blob");
  expect_fail(kvx_engine_import(e, garbage, SIZE_MAX, 0, got, 4, &n), KVX_ERR_INVALID_ARG, "import blob_len SIZE_MAX");
  expect_fail(kvx_engine_import(e, garbage, sizeof garbage, 0, NULL, 4, &n), KVX_ERR_INVALID_ARG, "import NULL layouts, capacity 4");
  expect_fail(kvx_engine_import(e, garbage, sizeof garbage, 0, got, 4, NULL), KVX_ERR_INVALID_ARG, "import NULL num_layouts");
  EXPECT(n == 77 && got[0] == NULL, "outputs untouched by failed imports");
  expect_fail(kvx_engine_export(e, NULL, 1, NULL), KVX_ERR_INVALID_ARG, "export NULL out");
  size_t len = 5;
  EXPECT(kvx_blob_bytes(NULL, &len) == NULL && len == 0, "kvx_blob_bytes(NULL)");
  kvx_blob_destroy(NULL);
  kvx_blob *blob = NULL;
  const kvx_layout *shared[1] = {host};
  kvx_status s = kvx_engine_export(e, shared, 1, &blob);
  if (s == KVX_OK) {
    const uint8_t *bytes = kvx_blob_bytes(blob, &len);
    EXPECT(bytes != NULL && len > 64, "blob of %zu bytes", len);
    uint8_t *copy = malloc(len);
    memcpy(copy, bytes, len);
    expect_fail(kvx_engine_import(e, copy, len, 0, got, 4, &n), KVX_ERR_INVALID_ARG, "import own blob");
    expect_fail(kvx_engine_import(e, copy, len - 1, 0, got, 4, &n), KVX_ERR_INVALID_ARG, "import truncated blob");
    copy[8] ^= 0x7f; /* the ABI major */
    expect_fail(kvx_engine_import(e, copy, len, 0, got, 4, &n), KVX_ERR_INVALID_ARG, "import blob of another ABI major");
    free(copy);
    kvx_blob_destroy(blob);
  } else {
    EXPECT(s == KVX_ERR_UNSUPPORTED && strstr(kvx_last_error(), "NIXL") != NULL, "export without NIXL: %s: %s", kvx_status_str(s),
           kvx_last_error());
    bad_calls++;
  }
  kvx_layout_destroy(host);
}

/* Whether `fd` becomes readable within `ms` milliseconds. */
static int readable_within(int fd, int ms) {
  struct pollfd p = {fd, POLLIN, 0};
  return poll(&p, 1, ms) == 1 && (p.revents & POLLIN);
}

/* The completion fd (1.5): unreadable until a request ends, readable after, reset by a
 * read, the same fd on each call, closed by kvx_engine_destroy; its bad calls. */
static void completion_fd(void) {
  kvx_engine_config ec;
  kvx_engine_config_init(&ec);
  ec.device = KVX_DEVICE_EMULATED;
  ec.bounce_bytes = 1 << 20;
  ec.slot_bytes = 64 << 10;
  kvx_engine *e = NULL;
  OK(kvx_engine_create(&ec, &e));
  int32_t fd = -7, again = -7;
  OK(kvx_engine_completion_fd(e, &fd));
  OK(kvx_engine_completion_fd(e, &again));
  EXPECT(fd >= 0 && again == fd, "completion fd %d, then %d", fd, again);
  EXPECT(!readable_within(fd, 0), "readable before any request ended");
  kvx_layout_config c = geometry(2);
  kvx_layout *a = NULL, *b = NULL;
  OK(kvx_layout_create_host(e, &c, 0, &a));
  OK(kvx_layout_create_host(e, &c, 0, &b));
  const uint64_t ids[2] = {0, 1};
  OK(move_blocks(e, a, b, ids, 2));
  EXPECT(readable_within(fd, 60000), "a transfer ended and the fd never became readable");
  uint64_t ends = 0;
  EXPECT(read(fd, &ends, sizeof ends) == (ssize_t)sizeof ends && ends == 1, "one end counted, read %llu", (unsigned long long)ends);
  EXPECT(!readable_within(fd, 0), "readable after the read reset it");

  int32_t untouched = -7;
  expect_fail(kvx_engine_completion_fd(NULL, &untouched), KVX_ERR_INVALID_ARG, "completion_fd NULL engine");
  expect_fail(kvx_engine_completion_fd(e, NULL), KVX_ERR_INVALID_ARG, "completion_fd NULL fd_out");
  EXPECT(untouched == -7, "a failed completion_fd wrote its output");
  EXPECT(kvx_get_api(KVX_ABI_MAJOR)->engine_completion_fd == kvx_engine_completion_fd, "table entry completion_fd");

  kvx_layout_destroy(a);
  kvx_layout_destroy(b);
  kvx_engine_destroy(e);
  errno = 0;
  EXPECT(fcntl(fd, F_GETFD) == -1 && errno == EBADF, "the completion fd outlived its engine");
}

int main(void) {
  const char *dir = getenv("KVX_TEST_DIR") ? getenv("KVX_TEST_DIR") : "/tmp";
  kvx_engine_config ec;
  kvx_engine_config_init(&ec);
  ec.device = KVX_DEVICE_EMULATED;
  ec.bounce_bytes = 1 << 20;
  ec.slot_bytes = 64 << 10;
  kvx_engine *e = NULL;
  OK(kvx_engine_create(&ec, &e));
  int32_t dev = 0;
  OK(kvx_engine_device(e, &dev));
  EXPECT(dev == -1, "emulated device reports %d", dev);
  uint32_t backend = 99;
  OK(kvx_engine_io_backend(e, &backend));
  EXPECT(backend == KVX_IO_POSIX || backend == KVX_IO_URING, "KVX_IO_AUTO resolves to %u", backend);
  EXPECT(kvx_get_api(1)->engine_io_backend == kvx_engine_io_backend, "table entry");
  kvx_engine_config got;
  memset(&got, 0, sizeof got);
  got.struct_size = sizeof got;
  OK(kvx_engine_config_get(e, &got));
  EXPECT(got.struct_size == sizeof got && got.device == -1 && got.io_backend == backend, "effective config: device %d, backend %u",
         got.device, got.io_backend);
  EXPECT(got.io_threads >= 4 && got.io_threads <= 16, "effective io_threads %u", got.io_threads);
  EXPECT(got.slot_bytes == (64 << 10) && got.bounce_bytes == (1 << 20) && got.max_inflight == 1024, "effective sizes %llu/%llu/%u",
         (unsigned long long)got.slot_bytes, (unsigned long long)got.bounce_bytes, got.max_inflight);
  got.struct_size = 4;
  expect_fail(kvx_engine_config_get(e, &got), KVX_ERR_INVALID_ARG, "config_get struct_size too small");
  expect_fail(kvx_engine_config_get(e, NULL), KVX_ERR_INVALID_ARG, "config_get NULL");
  EXPECT(kvx_get_api(1)->engine_config_get == kvx_engine_config_get, "table entry config_get");
  versions_and_table();
  round_trip(e, dir);
  waits_in_callbacks(e);
  bad_calls_suite(e, dir);
  remote_calls(e);
  store_round_trip(e, dir);
  store_bad_calls(e, dir);
  store_slots(e, dir);
  store_shared_tier(e, dir);
  kvx_engine_destroy(e);
  completion_fd();
  store_outlives_engine(dir);
  EXPECT(bad_calls >= 15, "only %d bad calls", bad_calls);
  printf("%d passed, %d failed\n", checks - failures, failures);
  return failures ? 1 : 0;
}
