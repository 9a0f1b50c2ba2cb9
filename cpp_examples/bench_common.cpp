// The bench's shared parts (bench_common.h): options, the timed pass, statistics, the
// layouts' configs and the raw-copy baseline.
#include "bench_common.h"

#include <sys/resource.h>

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>

namespace bench {

namespace {

struct Pending {
  kvx::Request req;
  Clock::time_point submitted;
};

[[noreturn]] void usage(int code) {
  std::printf(
      "usage: bench [options]\n"
      "  --num-layers N (24)  --inner-dim N (4096)  --page-size N (32)  --outer-dim 1|2 (2)\n"
      "  --dtype-bytes N (2)  --num-blocks N (16)  --blocks-per-batch N (4)\n"
      "  --iterations N (5)   --warmup N (1)\n"
      "  --layout contiguous|layer-block-first|layer-outer-first (contiguous)   the device's layout\n"
      "  --host-layout KIND   the pinned host layouts' kind (default: same as --layout)\n"
      "  --random-blocks      each batch moves randomly chosen blocks (same ids on both sides)\n"
      "  --direction disk-to-device|device-to-disk|host-to-device|device-to-host|all (all)\n"
      "  --device auto|emulated|N (auto)   --dir PATH (.) where the disk file lives\n"
      "  --io-threads N  --bounce-bytes N  --slot-bytes N   (0 = library defaults)\n"
      "  --io-backend auto|posix|uring|nixl|gds (auto)\n"
      "  --cold          drop the page cache before every timed pass (needs root; says why not)\n"
      "  --checksum      KVX_DISK_CHECKSUM on the disk file (per-region hashes, verified on read)\n"
      "  --mapped        KVX_DISK_MAPPED: the file (on tmpfs, e.g. --dir /dev/shm) is mapped and pinned,\n"
      "                  its blocks move by DMA straight from and to its pages\n"
      "  --buffered      page-cache I/O instead of O_DIRECT (the file is then hot)\n"
      "  --no-verify     skip the byte check after the timed runs\n"
      "  --json          also print one JSON object per result (compare.py, runtime_figures.py)\n"
      "runtime-shaped modes (instead of the batch table):\n"
      "  --latency       one request of --blocks-per-batch blocks at a time, host<->device: p50/p99/p99.9 and a\n"
      "                  histogram of submit -> completion seen by wait, by poll spinning and by on_complete,\n"
      "                  beside one raw cuMemcpyAsync + synchronize of the same bytes\n"
      "  --layerwise     a request per layer for --blocks-per-batch blocks, back to back, against one request of\n"
      "                  all layers (first- and last-layer completion; the first layer's request alone, and its\n"
      "                  raw floor: its reads by the best thread count plus one copy); --direction picks host- or\n"
      "                  disk-to-device\n"
      "  --submitters N  N threads submitting --blocks-per-batch-block requests back to back, mixed directions\n"
      "  --trace FILE    replay a schedule of `<submitter> onboard|offload <blocks>` lines against the disk file\n"
      "                  (cpp_examples/make_trace.py writes a vLLM-like one); latency percentiles and GB/s\n"
      "  --remote        a second bench process on this host exports a device and a pinned host layout; this one\n"
      "                  imports them (NIXL's UCX backend) and moves blocks to and from them: batch GB/s and\n"
      "                  per-request latency (--requests N one at a time, default 100 per iteration); --direction\n"
      "                  remote-device-to-device|device-to-remote-device|remote-host-to-device|device-to-remote-host|\n"
      "                  remote-host-to-host|host-to-remote-host|all (host: pinned)\n"
      "  --store         the store (kvx_store_*) beside plain transfers of the same blocks to and from disk\n"
      "                  layouts on --shards files: put and get (device and pinned host), durable put, lookup\n"
      "                  of 1,000 keys in one call (p50/p99/p99.9 us), open of a store holding --num-blocks\n"
      "                  entries; --buffered (both), --checksum (the plain files; the store's always are)\n"
      "  --shards N (1)  the store's data files, and the plain files it is measured against\n"
      "  --shared        with --store: also gets from a shared tier (a directory under --dir) against the local store's gets\n"
      "  --shared-s3 URL with --store: also puts through and gets from a shared tier in an S3 bucket at URL (it must\n"
      "                  exist: --s3-bucket B, default kvx-bench), to and from the device and pinned host, beside the S3\n"
      "                  client driven alone (--s3-limit PATH, default s3_limit beside the bench or in\n"
      "                  target/release/examples) on the same server and object size, the best of its concurrency\n"
      "                  sweep: GB/s, p50/p99/p99.9 and CPU s/GB of each, and the ratio\n"
      "  --s3-server PATH  instead of --shared-s3: start PATH (s3s-fs) on a free loopback port, its data under --dir\n"
      "  --s3-threads N  the shared tier's threads (default: its own default, 16)\n"
      "  --mix           one submitter onboards --onboard-sizes blocks at a time from a hot buffered file, --onboards\n"
      "                  of each, alone and while offloads of --background-blocks blocks to a second file (O_DIRECT\n"
      "                  unless --buffered) run open-loop at each of --background-shares of the rate they reach alone\n"
      "                  with --background-depth requests in flight: onboard p50/p99/p99.9 us, p99 over alone, and the\n"
      "                  background's achieved rate against its target. Alone, each size also from a second file\n"
      "                  made with KVX_DISK_MAPPED (where it can be: tmpfs, no --checksum) and its limit without\n"
      "                  kvxfer: the same blocks read by the bench's own threads into pinned buffers, each read then a\n"
      "                  copy to the device (the best of a sweep of threads and I/O sizes; not on the emulated device)\n"
      "  --onboard-sizes N,N,.. (4,32,256)  --onboards N (200; more where they take under a second)\n"
      "  --background-shares F,F,.. (0.5,0.9)  --background-depth N (4)\n"
      "  --background-blocks N  blocks per background offload (default: --blocks-per-batch)\n"
      "  --no-background --mix: no open-loop level (nor its rate alone); without --background-threads, the onboards\n"
      "                  alone only\n"
      "  --critical      --mix: each level twice, onboards in arrival order (fifo) and marked KVX_XFER_CRITICAL\n"
      "  --background-threads N,N,..  --mix: also closed-loop levels, one per count: that many threads each offloading\n"
      "                  --background-blocks blocks back to back, each waiting for its request before the next; the\n"
      "                  onboards alternate fifo and critical, alone first and then beside each level: p50/p99/p99.9,\n"
      "                  p99 over alone (target <= 1.5 for critical) and the background's GB/s beside over alone (keeps\n"
      "                  >= 1/4). With --store: store gets onboard from the store beside store puts offloading to it\n"
      "  --stages        --mix: where the closed-loop levels' onboards spend their time, from the engine's stage times\n"
      "                  (KVX_STAGE_TIMES): p50/p99 us of each gap between stages (the last: completion to the\n"
      "                  bench's wait returning), alone and beside each level\n");
  std::exit(code);
}

uint32_t io_backend_of(const std::string &s) {
  if (s == "auto") return KVX_IO_AUTO;
  if (s == "posix") return KVX_IO_POSIX;
  if (s == "uring") return KVX_IO_URING;
  if (s == "nixl") return KVX_IO_NIXL;
  if (s == "gds") return KVX_IO_GDS;
  std::fprintf(stderr, "bench: unknown --io-backend %s\n", s.c_str());
  std::exit(2);
}

uint32_t layout_kind(const std::string &s) {
  if (s == "contiguous") return KVX_LAYOUT_FULLY_CONTIGUOUS;
  if (s == "layer-block-first") return KVX_LAYOUT_LAYER_SEPARATE_BLOCK_FIRST;
  if (s == "layer-outer-first") return KVX_LAYOUT_LAYER_SEPARATE_OUTER_FIRST;
  std::fprintf(stderr, "bench: unknown --layout %s\n", s.c_str());
  std::exit(2);
}

// A comma-separated list of positive numbers ("4,32,256"); exits naming `flag` otherwise.
template <typename T>
std::vector<T> list_of(const char *flag, const char *v) {
  std::vector<T> out;
  for (const char *p = v; *p;) {
    char *end = nullptr;
    double x = std::strtod(p, &end);
    if (end == p || !(x > 0) || (*end && *end != ',')) {
      std::fprintf(stderr, "bench: %s wants a comma-separated list of positive numbers, got %s\n", flag, v);
      std::exit(2);
    }
    out.push_back((T)x);
    p = *end ? end + 1 : end;
  }
  if (out.empty()) {
    std::fprintf(stderr, "bench: %s wants at least one value\n", flag);
    std::exit(2);
  }
  return out;
}

int32_t device_of(const std::string &s) {
  if (s == "auto") return KVX_DEVICE_AUTO;
  if (s == "emulated") return KVX_DEVICE_EMULATED;
  return (int32_t)std::atoi(s.c_str());
}

}  // namespace

const char *io_backend_name(uint32_t b) {
  switch (b) {
    case KVX_IO_POSIX: return "pread/pwrite";
    case KVX_IO_URING: return "io_uring";
    case KVX_IO_NIXL: return "NIXL POSIX plugin";
    case KVX_IO_GDS: return "cuFile (GDS)";
    default: return "?";
  }
}

Options parse(int argc, char **argv) {
  Options o;
  bool no_background = false;
  std::map<std::string, std::function<void(const char *)>> flags = {
      {"--num-layers", [&](const char *v) { o.num_layers = std::strtoull(v, nullptr, 0); }},
      {"--inner-dim", [&](const char *v) { o.inner_dim = std::strtoull(v, nullptr, 0); }},
      {"--page-size", [&](const char *v) { o.page_size = std::strtoull(v, nullptr, 0); }},
      {"--outer-dim", [&](const char *v) { o.outer_dim = std::strtoull(v, nullptr, 0); }},
      {"--dtype-bytes", [&](const char *v) { o.dtype_bytes = std::strtoull(v, nullptr, 0); }},
      {"--num-blocks", [&](const char *v) { o.num_blocks = std::strtoull(v, nullptr, 0); }},
      {"--blocks-per-batch", [&](const char *v) { o.blocks_per_batch = std::strtoull(v, nullptr, 0); }},
      {"--iterations", [&](const char *v) { o.iterations = std::atoi(v); }},
      {"--warmup", [&](const char *v) { o.warmup = std::atoi(v); }},
      {"--layout", [&](const char *v) { o.layout = v; }},
      {"--host-layout", [&](const char *v) { o.host_layout = v; }},
      {"--direction", [&](const char *v) { o.direction = v; }},
      {"--device", [&](const char *v) { o.device = v; }},
      {"--dir", [&](const char *v) { o.dir = v; }},
      {"--io-threads", [&](const char *v) { o.io_threads = (uint32_t)std::strtoul(v, nullptr, 0); }},
      {"--io-backend", [&](const char *v) { o.io_backend = io_backend_of(v); }},
      {"--bounce-bytes", [&](const char *v) { o.bounce_bytes = std::strtoull(v, nullptr, 0); }},
      {"--slot-bytes", [&](const char *v) { o.slot_bytes = std::strtoull(v, nullptr, 0); }},
      {"--submitters", [&](const char *v) { o.submitters = (unsigned)std::strtoul(v, nullptr, 0); }},
      {"--trace", [&](const char *v) { o.trace = v; }},
      {"--requests", [&](const char *v) { o.requests = std::strtoull(v, nullptr, 0); }},
      {"--shards", [&](const char *v) { o.shards = (uint32_t)std::strtoul(v, nullptr, 0); }},
      {"--shared-s3", [&](const char *v) { o.shared_s3 = v; }},
      {"--s3-bucket", [&](const char *v) { o.s3_bucket = v; }},
      {"--s3-server", [&](const char *v) { o.s3_server = v; }},
      {"--s3-limit", [&](const char *v) { o.s3_limit = v; }},
      {"--s3-threads", [&](const char *v) { o.s3_threads = (uint32_t)std::strtoul(v, nullptr, 0); }},
      {"--onboard-sizes", [&](const char *v) { o.onboard_sizes = list_of<uint64_t>("--onboard-sizes", v); }},
      {"--background-shares", [&](const char *v) { o.background_shares = list_of<double>("--background-shares", v); }},
      {"--onboards", [&](const char *v) { o.onboards = std::strtoull(v, nullptr, 0); }},
      {"--background-depth", [&](const char *v) { o.background_depth = (unsigned)std::strtoul(v, nullptr, 0); }},
      {"--background-threads", [&](const char *v) { o.background_threads = list_of<unsigned>("--background-threads", v); }},
      {"--background-blocks", [&](const char *v) { o.background_blocks = std::strtoull(v, nullptr, 0); }},
  };
  for (int i = 1; i < argc; i++) {
    std::string a = argv[i];
    if (a == "--help" || a == "-h") usage(0);
    if (a == "--buffered") { o.buffered = true; continue; }
    if (a == "--no-verify") { o.verify = false; continue; }
    if (a == "--random-blocks") { o.random_blocks = true; continue; }
    if (a == "--json") { o.json = true; continue; }
    if (a == "--cold") { o.cold = true; continue; }
    if (a == "--checksum") { o.checksum = true; continue; }
    if (a == "--mapped") { o.mapped = true; continue; }
    if (a == "--latency") { o.latency = true; continue; }
    if (a == "--layerwise") { o.layerwise = true; continue; }
    if (a == "--remote") { o.remote = true; continue; }
    if (a == "--store") { o.store = true; continue; }
    if (a == "--shared") { o.shared = true; continue; }
    if (a == "--mix") { o.mix = true; continue; }
    if (a == "--critical") { o.critical = true; continue; }
    if (a == "--no-background") { no_background = true; continue; }
    if (a == "--stages") { o.stages = true; continue; }
    auto f = flags.find(a);
    if (f == flags.end() || i + 1 >= argc) {
      std::fprintf(stderr, "bench: unknown option or missing value: %s\n", a.c_str());
      usage(2);
    }
    f->second(argv[++i]);
  }
  if (o.host_layout.empty()) o.host_layout = o.layout;
  // Applied after every flag, so it wins over --background-shares wherever it stands.
  if (no_background) o.background_shares.clear();
  if (o.background_blocks == 0) o.background_blocks = o.blocks_per_batch;
  if (o.blocks_per_batch == 0 || o.num_blocks == 0 || o.iterations <= 0 || o.shards == 0 || o.onboards == 0 ||
      o.background_depth == 0) {
    std::fprintf(stderr, "bench: --num-blocks, --blocks-per-batch, --iterations, --shards, --onboards and --background-depth "
                         "must be positive\n");
    std::exit(2);
  }
  return o;
}

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  size_t i = (size_t)(p * (v.size() - 1) + 0.5);
  return v[std::min(i, v.size() - 1)];
}

double cpu_seconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_utime.tv_sec + u.ru_stime.tv_sec + 1e-6 * (u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}

void shuffle_fixed(std::vector<uint64_t> &v) {
  uint64_t x = 0x9E3779B97F4A7C15ull;
  for (size_t i = v.size(); i > 1; i--) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    std::swap(v[i - 1], v[x % i]);
  }
}

std::string key_of(uint64_t gen, uint64_t b) {
  char k[33];
  std::snprintf(k, sizeof k, "%016" PRIx64 "%016" PRIx64, (uint64_t)(gen * 0x9E3779B97F4A7C15ull), (uint64_t)(b ^ (gen << 40)));
  return std::string(k, 32);
}

std::vector<std::vector<uint64_t>> request_ids(uint64_t num_blocks, uint64_t per_request, size_t count, bool random) {
  std::vector<std::vector<uint64_t>> out;
  uint64_t x = 0x2545F4914F6CDD1Dull, next = 0;
  for (size_t i = 0; i < count; i++) {
    std::vector<uint64_t> v;
    while (v.size() < per_request) {
      uint64_t b;
      if (random) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        b = x % num_blocks;
      } else {
        b = next++ % num_blocks;
      }
      if (std::find(v.begin(), v.end(), b) == v.end()) v.push_back(b);
    }
    out.push_back(std::move(v));
  }
  return out;
}

Result run_pass(kvx::Engine &e, const kvx::Layout &src, const kvx::Layout &dst, const Options &o) {
  Result r;
  std::vector<Pending> pending;
  std::vector<uint64_t> order(o.num_blocks);
  for (uint64_t b = 0; b < o.num_blocks; b++) order[b] = b;
  if (o.random_blocks) shuffle_fixed(order);
  std::vector<std::vector<uint64_t>> ids;
  for (uint64_t b = 0; b < o.num_blocks; b += o.blocks_per_batch)
    ids.emplace_back(order.begin() + b, order.begin() + std::min(o.num_blocks, b + o.blocks_per_batch));
  auto t0 = Clock::now();
  for (auto &v : ids) {
    auto ts = Clock::now();
    pending.push_back({e.submit(src, v, dst, v), ts});
  }
  for (auto &p : pending) {
    p.req.wait();
    r.batch_ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - p.submitted).count());
  }
  r.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  return r;
}

kvx_engine_config engine_config(const Options &o) {
  kvx_engine_config ec;
  kvx_engine_config_init(&ec);
  ec.device = device_of(o.device);
  ec.io_threads = o.io_threads;
  ec.io_backend = o.io_backend;
  ec.bounce_bytes = o.bounce_bytes;
  ec.slot_bytes = o.slot_bytes;
  return ec;
}

std::pair<kvx_layout_config, kvx_layout_config> layout_configs(const Options &o) {
  const kvx_layout_config lc = kvx::layout_config()
                                    .set_kind(layout_kind(o.layout))
                                    .set_num_blocks(o.num_blocks)
                                    .set_num_layers(o.num_layers)
                                    .set_outer_dim(o.outer_dim)
                                    .set_page_size(o.page_size)
                                    .set_inner_dim(o.inner_dim)
                                    .set_dtype_bytes(o.dtype_bytes);
  kvx_layout_config hc = lc;
  hc.kind = layout_kind(o.host_layout);
  return {lc, hc};
}

void fill_pattern(const kvx::Layout &host, uint32_t nbases, uint64_t base_bytes, uint64_t salt) {
  for (uint32_t l = 0; l < nbases; l++) {
    auto *p = reinterpret_cast<uint64_t *>(host.base(l));
    for (uint64_t i = 0; i < base_bytes / 8; i++) p[i] = (i * 0x9E3779B97F4A7C15ull) ^ l ^ salt;
  }
}

double RawCopy::pass(bool h2d, bool per_region) {
  auto t0 = Clock::now();
  for (uint64_t pos = 0; pos < total;) {
    uint64_t ho = pos % host_base_bytes, dof = pos % dev_base_bytes;
    uint64_t step = std::min(host_base_bytes - ho, dev_base_bytes - dof);
    if (per_region) step = std::min(step, region_bytes);
    void *h = reinterpret_cast<void *>(host_bases[pos / host_base_bytes] + ho);
    uint64_t d = dev_bases[pos / dev_base_bytes] + dof;
    pos += step;
    if (cuda.ok) {
      int r = h2d ? cuda.cuMemcpyHtoDAsync_v2(d, h, step, cuda.stream) : cuda.cuMemcpyDtoHAsync_v2(h, d, step, cuda.stream);
      if (r) { std::fprintf(stderr, "bench: raw copy failed (CUresult %d)\n", r); std::exit(1); }
    } else if (h2d) {
      std::memcpy(reinterpret_cast<void *>(d), h, step);
    } else {
      std::memcpy(h, reinterpret_cast<void *>(d), step);
    }
  }
  if (cuda.ok) cuda.cuStreamSynchronize(cuda.stream);
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

void RawCopy::one(bool h2d, uint64_t bytes) {
  void *h = reinterpret_cast<void *>(host_bases[0]);
  uint64_t d = dev_bases[0];
  if (!cuda.ok) {
    h2d ? (void)std::memcpy(reinterpret_cast<void *>(d), h, bytes) : (void)std::memcpy(h, reinterpret_cast<void *>(d), bytes);
    return;
  }
  int r = h2d ? cuda.cuMemcpyHtoDAsync_v2(d, h, bytes, cuda.stream) : cuda.cuMemcpyDtoHAsync_v2(h, d, bytes, cuda.stream);
  if (r || cuda.cuStreamSynchronize(cuda.stream)) { std::fprintf(stderr, "bench: raw copy failed (CUresult %d)\n", r); std::exit(1); }
}

}  // namespace bench
