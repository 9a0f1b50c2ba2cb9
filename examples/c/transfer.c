/* kvxfer from C: four blocks of a host layout go to a file, come back through the device
 * (GPU 0, or the emulated device where there is none) into four other blocks, compared.
 *   cc -Iinclude examples/c/transfer.c -Ltarget/release -Wl,-rpath,$PWD/target/release -lkvxfer && ./a.out */
#include <stdio.h>
#include <string.h>
#include "kvxfer.h"

/* Every call returns a kvx_status; kvx_last_error() says why one failed. */
#define CHECK(call) if ((call) != KVX_OK) { fprintf(stderr, "%s: %s\n", #call, kvx_last_error()); return 1; }

int main(void) {
  kvx_engine *e; kvx_layout *host, *disk, *dev; kvx_request *r;
  kvx_layout_config c; kvx_layout_config_init(&c);
  c.num_blocks = 8, c.num_layers = 2, c.outer_dim = 2, c.page_size = 16, c.inner_dim = 128, c.dtype_bytes = 2;
  CHECK(kvx_engine_create(NULL, &e));  /* NULL: default settings */
  CHECK(kvx_layout_create_host(e, &c, KVX_HOST_PINNED, &host));
  CHECK(kvx_layout_create_disk(e, &c, "kvx-example-c.kv", KVX_DISK_CREATE, &disk));  /* the file goes with the layout */
  CHECK(kvx_layout_create_device(e, &c, &dev));
  uint64_t base, block, a[] = {0, 1, 2, 3}, b[] = {4, 5, 6, 7};
  CHECK(kvx_layout_base(host, 0, &base)); CHECK(kvx_layout_block_bytes(host, &block));
  unsigned char *bytes = (unsigned char *)(uintptr_t)base;
  for (uint64_t i = 0; i < 4 * block; i++) bytes[i] = (unsigned char)(i * 7 + 1);
  struct { kvx_layout *src; uint64_t *from; kvx_layout *dst; uint64_t *to; } hops[] = {
      {host, a, disk, a}, {disk, a, dev, b}, {dev, b, host, b}};  /* host 0-3 → file → device 4-7 → host 4-7 */
  for (int h = 0; h < 3; h++) {
    CHECK(kvx_transfer_submit(e, hops[h].src, hops[h].from, hops[h].dst, hops[h].to, 4, NULL, &r));
    kvx_status s = kvx_request_wait(r, UINT64_MAX);  /* the final status; a failed request says why */
    if (s != KVX_OK) { fprintf(stderr, "transfer: %s\n", kvx_request_error(r)); return 1; }
    kvx_request_release(r);
  }
  int same = memcmp(bytes, bytes + 4 * block, 4 * block) == 0;
  printf("transfer.c: 4 blocks to disk and back, %s\n", same ? "every byte the same" : "BYTES DIFFER");
  kvx_layout_destroy(dev), kvx_layout_destroy(disk), kvx_layout_destroy(host), kvx_engine_destroy(e);
  return !same;
}
