// The bench's runtime-shaped modes: per-request latency, layer-wise loads, many
// submitters and a replayed schedule — what an inference runtime sends, next to the raw
// copy measured in the same run. bench.cpp sets up the engine, the layouts and the raw
// baselines, then calls these.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "bench_common.h"
#include "kvxfer.hpp"

namespace bench {

// --latency: one request at a time, submit -> completion seen, three ways (wait, poll
// spinning, on_complete), beside one raw cuMemcpyAsync + synchronize of the same bytes.
void run_latency(kvx::Engine &e, const kvx::Layout &host, const kvx::Layout &device, RawCopy &raw, const Options &o,
                 uint64_t block_bytes);

// The first layer's floor outside kvxfer for the request's blocks, in seconds, and how
// it was measured (bench.cpp: the layer's raw reads and one raw copy of its bytes, with
// the reading threads already awake); `wake`: what waking those sleeping threads took,
// in seconds (0 where nothing was read), which an engine that sleeps when idle pays too.
using LayerFloor = std::function<double(const std::vector<uint64_t> &blocks, std::string &how, double &wake)>;

// --layerwise: a request per layer for the first --blocks-per-batch blocks, submitted back
// to back, against one request moving every layer; the first layer's and the last
// layer's completion times, beside `floor`.
void run_layerwise(kvx::Engine &e, const kvx::Layout &src, const kvx::Layout &dst, const char *dir, const Options &o,
                   const LayerFloor &floor);

// --submitters N: N threads, each moving its own blocks in requests of --blocks-per-batch
// back to back (even threads host->device, odd device->host); per-thread and aggregate
// figures against one submitter moving the same mix in two big requests.
void run_submitters(kvx::Engine &e, const kvx::Layout &host, const kvx::Layout &device, const kvx::Layout &back,
                    const Options &o, uint64_t block_bytes);

// --trace FILE: replays a runtime's schedule. Each line is `<submitter> <op> <blocks>`:
// op `onboard` moves that many random blocks from the tier (the disk file with --dir, as
// a prefix hit) to the device, `offload` from the device to the tier; `#` starts a
// comment. Each submitter thread runs its own lines in order, one request at a time, all
// submitters at once. cpp_examples/make_trace.py writes a vLLM-like schedule. The
// onboards' reference comes first: the same trace, the same blocks, its offloads dropped.
void run_trace(kvx::Engine &e, const kvx::Layout &tier, const kvx::Layout &device, const Options &o, uint64_t block_bytes);

}  // namespace bench
