/* The C compiler's view of every public struct must match the Rust side's (printed by
 * tests/tools/abi_layout.rs into abi_layout.h), so a layout change cannot slip through. */
#include <stddef.h>
#include <stdio.h>

#include "kvxfer.h"
#include "abi_layout.h"

static int failures = 0, checks = 0;
#define KVX_SAME(c, rust, what)                                                             \
  do {                                                                                      \
    checks++;                                                                               \
    if ((size_t)(c) != (size_t)(rust)) {                                                    \
      failures++;                                                                           \
      fprintf(stderr, "FAIL %s: C says %zu, Rust says %zu\n", what, (size_t)(c), (size_t)(rust)); \
    }                                                                                       \
  } while (0)

int main(void) {
  CHECK_kvx_engine_config();
  CHECK_kvx_layout_config();
  CHECK_kvx_transfer_options();
  CHECK_kvx_stats();
  CHECK_kvx_api();
  CHECK_kvx_key();
  CHECK_kvx_store_config();
  CHECK_kvx_store_counters();
  CHECK_kvx_slot_handle();
  CHECK_kvx_shared_config();
  printf("%d passed, %d failed\n", checks - failures, failures);
  return failures != 0;
}
