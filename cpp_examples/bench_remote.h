// --remote: two bench processes on this host. The serving one exports a device and a
// pinned host layout (kvx_engine_export); this one imports them (NIXL's UCX backend
// underneath) and moves blocks to and from them through kvx_transfer_submit, as a runtime
// pulls KV blocks from a prefill worker or a shared host tier. cpp_examples/remote_limit.rs
// measures NIXL driven directly with the same descriptors: that is the limit these
// figures are read against.
#pragma once

#include "bench_common.h"

namespace bench {

// Forks the serving peer (before this process touches CUDA or NIXL), imports its layouts
// and prints the remote table; the exit status of the bench.
int run_remote(const Options &o);

}  // namespace bench
