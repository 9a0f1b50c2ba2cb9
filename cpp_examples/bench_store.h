// --store: the store (kvx_store_*) next to plain transfers of the same blocks between the
// same layouts and disk layouts on as many files as the store has shards, in the same run:
// put and get (from and to the device and the pinned host layout), a durable put, a
// lookup of 1,000 keys in one call, and the open of a store holding --num-blocks entries.
#pragma once

#include "bench_common.h"

namespace bench {

// Sets up its own engine, layouts, store directories and plain files under --dir (all
// removed at the end), prints the store table; the exit status of the bench.
int run_store(const Options &o);

}  // namespace bench
