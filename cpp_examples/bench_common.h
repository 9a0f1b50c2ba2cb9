// What every mode of the bench shares: its options, the timed pass, the statistics, the
// layouts' configs and the raw-copy baseline. Each mode is a translation unit of its own
// (bench.cpp: the batch table and main; bench_runtime.cpp: the runtime-shaped modes;
// bench_remote.cpp: --remote; bench_store.cpp: --store; bench_mix.cpp: --mix); this header
// is all they share.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "cuda_raw.h"
#include "kvxfer.hpp"

namespace bench {

using Clock = std::chrono::steady_clock;

struct Options {
  uint64_t num_layers = 24, inner_dim = 4096, page_size = 32, outer_dim = 2, dtype_bytes = 2;
  uint64_t num_blocks = 16, blocks_per_batch = 4;
  int iterations = 5, warmup = 1;
  std::string layout = "contiguous", host_layout, direction = "all", device = "auto", dir = ".";
  uint32_t io_threads = 0, io_backend = KVX_IO_AUTO;
  uint64_t bounce_bytes = 0, slot_bytes = 0;
  bool buffered = false, verify = true, random_blocks = false, json = false, cold = false, checksum = false, mapped = false;
  bool latency = false, layerwise = false, remote = false, store = false;
  uint32_t shards = 1;  // --store's data files (and the plain files beside them)
  // --store --shared: gets through a shared tier in a directory under --dir, beside the
  // local store's gets of the same blocks on the same disk.
  bool shared = false;
  // --store --shared-s3 URL (or --s3-server PATH, a server the bench starts): the shared
  // rows over bucket --s3-bucket of an S3 server instead, put through it and got from it,
  // beside the S3 client alone (the --s3-limit binary, cpp_examples/s3_limit.rs) on the same
  // server and object size. --s3-threads: the tier's threads (0: its default).
  std::string shared_s3, s3_bucket = "kvx-bench", s3_server, s3_limit;
  uint32_t s3_threads = 0;
  unsigned submitters = 0;
  uint64_t requests = 0;  // --remote's one-at-a-time requests (0: 100 per iteration)
  std::string trace;
  // --mix: onboards of each size, one at a time, alone and beside background offloads at
  // each share of the rate those reach alone with `background_depth` requests in flight
  // (none: --no-background, the onboards alone only).
  bool mix = false;
  std::vector<uint64_t> onboard_sizes{4, 32, 256};
  std::vector<double> background_shares{0.5, 0.9};
  size_t onboards = 200;
  unsigned background_depth = 4;
  // --critical: each level also with the onboards marked KVX_XFER_CRITICAL, beside the
  // plain ones (served in arrival order).
  bool critical = false;
  // --background-threads: closed-loop levels beside the open-loop ones, one per count:
  // that many threads each offloading back to back, waiting for each request before the
  // next, while the onboards alternate fifo and critical. --background-blocks: blocks per
  // background offload, both kinds (0: --blocks-per-batch).
  std::vector<unsigned> background_threads;
  uint64_t background_blocks = 0;
  // --stages: the closed-loop levels' onboards split by the engine's stage times.
  bool stages = false;
};

// The command line as Options; prints the usage and exits on --help or a bad flag.
Options parse(int argc, char **argv);

// The name of a KVX_IO_* backend, as the bench prints it.
const char *io_backend_name(uint32_t b);

// The engine's settings from the options (device, I/O threads and backend, slot sizes).
kvx_engine_config engine_config(const Options &o);

// The device layout's config and the pinned host layouts' (same geometry, --host-layout's kind).
std::pair<kvx_layout_config, kvx_layout_config> layout_configs(const Options &o);

// Known bytes in every block of a host layout: word i of base l is a hash of i, l and `salt`.
void fill_pattern(const kvx::Layout &host, uint32_t nbases, uint64_t base_bytes, uint64_t salt);

inline double gbps(uint64_t bytes, double seconds) { return seconds > 0 ? bytes / seconds / 1e9 : 0; }

// The value below which a share `p` (0..1) of `v` lies (the nearest rank).
double percentile(std::vector<double> v, double p);

struct Percentiles {
  double p50, p99, p999;
};

inline Percentiles percentiles_us(const std::vector<double> &us) {
  return {percentile(us, 0.5), percentile(us, 0.99), percentile(us, 0.999)};
}

// CPU seconds (user + sys) this process has used so far.
double cpu_seconds();

inline double us_since(Clock::time_point t0) { return std::chrono::duration<double, std::micro>(Clock::now() - t0).count(); }

// Puts `v` in a random order, the same one on every call (fixed seed: every pass, and the
// submitters' reference, move the same blocks in the same order).
void shuffle_fixed(std::vector<uint64_t> &v);

// A 32-byte key (a runtime's prefix hash stands here) for block `b` of generation `gen`:
// keys of distinct (gen, b) differ.
std::string key_of(uint64_t gen, uint64_t b);

// Requests of `per_request` blocks each, `count` of them, one after the other.
std::vector<std::vector<uint64_t>> request_ids(uint64_t num_blocks, uint64_t per_request, size_t count, bool random);

struct Result {
  double seconds = 0;
  std::vector<double> batch_ms;
};

// One timed pass: every batch submitted at once, then all waited for.
Result run_pass(kvx::Engine &e, const kvx::Layout &src, const kvx::Layout &dst, const Options &o);

// Copies of the same bytes between the pinned host layout's and the device layout's
// allocations outside kvxfer: the link's limit (as few copies as the allocations allow)
// or the naive way (one copy per region).
struct RawCopy {
  cuda_raw::Api cuda;  // unused (ok == false) on the emulated device
  std::vector<uint64_t> host_bases, dev_bases;
  uint64_t host_base_bytes = 0, dev_base_bytes = 0, region_bytes = 0, total = 0;

  // Seconds for `total` bytes one way, as few copies as the allocations allow or one per region.
  double pass(bool h2d, bool per_region);
  // One copy of `bytes` from the start of the first allocations, synchronised.
  void one(bool h2d, uint64_t bytes);
};

}  // namespace bench
