/* kvxfer from C: an engine on the default device (GPU 0, or the emulated device where
 * there is none), a host layout and a disk layout; four blocks are written to the file,
 * read back through the device into four other host blocks, and compared.
 * Build and run from the repository root, after `cargo build --release`:
 *   cc -Iinclude examples/c/transfer.c -Ltarget/release -Wl,-rpath,$PWD/target/release -lkvxfer -o transfer && ./transfer
 */
#include <stdio.h>
#include <string.h>
#include "kvxfer.h"

/* Every call returns a kvx_status; on failure kvx_last_error() says why. */
#define CHECK(call) do { if ((call) != KVX_OK) { fprintf(stderr, "%s: %s\n", #call, kvx_last_error()); return 1; } } while (0)

/* Moves src_ids[i] of `src` to dst_ids[i] of `dst` and waits; a failed request says why. */
static int move(kvx_engine *e, kvx_layout *src, const uint64_t *src_ids, kvx_layout *dst, const uint64_t *dst_ids) {
  kvx_request *r = NULL;
  CHECK(kvx_transfer_submit(e, src, src_ids, dst, dst_ids, 4, NULL, &r));
  kvx_status s = kvx_request_wait(r, UINT64_MAX);
  if (s != KVX_OK) fprintf(stderr, "transfer: %s\n", kvx_request_error(r));
  kvx_request_release(r);
  return s != KVX_OK;
}

int main(int argc, char **argv) {
  char path[4096]; /* the file, in the folder given or the current one */
  snprintf(path, sizeof path, "%s/kvx-example-c.kv", argc > 1 ? argv[1] : ".");
  kvx_layout_config c;
  kvx_layout_config_init(&c); /* a contiguous layout; every dimension is then set */
  c.num_blocks = 8, c.num_layers = 2, c.outer_dim = 2, c.page_size = 16, c.inner_dim = 128, c.dtype_bytes = 2;
  kvx_engine *e = NULL;
  kvx_layout *host = NULL, *disk = NULL, *dev = NULL;
  CHECK(kvx_engine_create(NULL, &e)); /* NULL: the default settings */
  CHECK(kvx_layout_create_host(e, &c, KVX_HOST_PINNED, &host));
  CHECK(kvx_layout_create_disk(e, &c, path, KVX_DISK_CREATE, &disk)); /* the file goes with the layout */
  CHECK(kvx_layout_create_device(e, &c, &dev));
  uint64_t base = 0, block = 0;
  CHECK(kvx_layout_base(host, 0, &base));
  CHECK(kvx_layout_block_bytes(host, &block));
  unsigned char *bytes = (unsigned char *)(uintptr_t)base;
  for (uint64_t i = 0; i < 4 * block; i++) bytes[i] = (unsigned char)(i * 7 + 1);
  const uint64_t first[] = {0, 1, 2, 3}, other[] = {4, 5, 6, 7};
  if (move(e, host, first, disk, first) || /* host blocks 0-3 to the file's 0-3 */
      move(e, disk, first, dev, other) ||   /* the file's 0-3 to device blocks 4-7 */
      move(e, dev, other, host, other))     /* and to host blocks 4-7 */
    return 1;
  int same = memcmp(bytes, bytes + 4 * block, 4 * block) == 0;
  printf("transfer.c (%s): 4 blocks to disk and back, %s\n", kvx_version_string(), same ? "every byte the same" : "BYTES DIFFER");
  kvx_layout_destroy(dev), kvx_layout_destroy(disk), kvx_layout_destroy(host), kvx_engine_destroy(e);
  return same ? 0 : 1;
}
