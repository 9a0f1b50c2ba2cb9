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

int main(void) {
  kvx_layout_config a = named(), b = positional();
  return kvx_abi_version() == 0 || a.num_blocks != b.num_blocks || a.dtype_bytes != b.dtype_bytes;
}
