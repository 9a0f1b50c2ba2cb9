/* The store from C: four blocks of a host layout are put under their keys (a runtime's
 * prefix hashes), looked up, loaded through the device (GPU 0, or the emulated device)
 * into a host layout by key, compared, and removed.
 *   cc -Iinclude examples/c/store.c -Ltarget/release -Wl,-rpath,$PWD/target/release -lkvxfer && ./a.out */
#include <stdio.h>
#include <string.h>
#include "kvxfer.h"

#define CHECK(call) if ((call) != KVX_OK) { fprintf(stderr, "%s: %s\n", #call, kvx_last_error()); return 1; }

int main(void) {
  kvx_engine *e; kvx_layout *host, *dev; kvx_store *st; kvx_store_request *r;
  kvx_layout_config c; kvx_layout_config_init(&c);
  c.num_blocks = 8, c.num_layers = 2, c.outer_dim = 2, c.page_size = 16, c.inner_dim = 128, c.dtype_bytes = 2;
  CHECK(kvx_engine_create(NULL, &e));
  CHECK(kvx_layout_create_host(e, &c, KVX_HOST_PINNED, &host));
  CHECK(kvx_layout_create_device(e, &c, &dev));
  kvx_store_config sc; kvx_store_config_init(&sc);  /* KVX_STORE_CREATE, one shard */
  const char ns[] = "example-model bf16 tp0/1 page16";  /* what makes equal keys differ */
  sc.block = &c, sc.capacity_blocks = 64, sc.namespace_bytes = (const uint8_t *)ns, sc.namespace_len = sizeof ns - 1;
  CHECK(kvx_store_open(e, "kvx-example-store", &sc, &st));  /* a directory: made, or reopened */
  uint64_t base, block, a[] = {0, 1, 2, 3}, b[] = {4, 5, 6, 7};
  CHECK(kvx_layout_base(host, 0, &base)); CHECK(kvx_layout_block_bytes(host, &block));
  unsigned char *bytes = (unsigned char *)(uintptr_t)base;
  for (uint64_t i = 0; i < 4 * block; i++) bytes[i] = (unsigned char)(i * 7 + 1);
  kvx_key keys[4] = {{(const uint8_t *)"hash-a", 6}, {(const uint8_t *)"hash-b", 6}, {(const uint8_t *)"hash-c", 6},
                     {(const uint8_t *)"hash-d", 6}};
  CHECK(kvx_store_put(st, host, a, keys, 4, NULL, &r));  /* host blocks 0-3 under the four keys */
  CHECK(kvx_store_request_wait(r, UINT64_MAX)); kvx_store_request_release(r);
  uint8_t present[4]; size_t hits;
  CHECK(kvx_store_lookup(st, keys, 4, KVX_LOOKUP_LEASE, present, &hits));  /* leased until loaded */
  CHECK(kvx_store_get(st, keys, hits, dev, b, NULL, &r));  /* the hits to device blocks 4-7 */
  kvx_status s = kvx_store_request_wait(r, UINT64_MAX);  /* KVX_OK only if every key loaded */
  if (s != KVX_OK) { fprintf(stderr, "get: %s\n", kvx_store_request_error(r)); return 1; }
  kvx_store_request_release(r);
  kvx_request *t;
  CHECK(kvx_transfer_submit(e, dev, b, host, b, 4, NULL, &t));  /* and to host 4-7 */
  CHECK(kvx_request_wait(t, UINT64_MAX)); kvx_request_release(t);
  int same = hits == 4 && memcmp(bytes, bytes + 4 * block, 4 * block) == 0;
  kvx_status removed[4];
  CHECK(kvx_store_remove(st, keys, 4, removed));
  kvx_store_counters k; memset(&k, 0, sizeof k); k.struct_size = sizeof k;
  CHECK(kvx_store_stats(st, &k));
  printf("store.c: %zu of 4 keys held, %s; %llu entries left\n", hits, same ? "every byte the same" : "BYTES DIFFER",
         (unsigned long long)k.entries);
  kvx_store_close(st);  /* before the engine */
  kvx_layout_destroy(dev); kvx_layout_destroy(host); kvx_engine_destroy(e);
  return same ? 0 : 1;
}
