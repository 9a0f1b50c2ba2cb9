// --mix: what an onboard a runtime waits for costs while offloads nobody waits for run
// beside it. One submitter onboards fixed sizes one at a time from a hot file, alone and
// while background offloads to a second file run open-loop at set shares of the rate they
// reach alone, all measured in the same process; with --critical, each level also with the
// onboards marked latency-critical (KVX_XFER_CRITICAL).
#pragma once

#include "bench_common.h"

namespace bench {

// Sets up its own engine, device layout and two files under --dir (removed at the end),
// prints the table; the exit status of the bench.
int run_mix(const Options &o);

}  // namespace bench
