// kvxfer bench: how fast KV blocks move between disk, host and device through kvxfer,
// next to the physical limit measured in the same run (raw reads/writes of the same
// file with the same O_DIRECT setting, raw_file.h; writes go to a scratch file of the
// same size beside the layout's file, so the blocks kvxfer wrote stay intact).
//
//   ./cpp_examples/bench                       # Dynamo KVBM-like defaults
//   ./cpp_examples/bench --num-blocks 86 --direction disk-to-device   # ~1 GiB, cold O_DIRECT
//   ./cpp_examples/bench --help
#include "kvxfer.hpp"
#include "cuda_raw.h"
#include "raw_file.h"

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

// Files up to this size get their raw I/O limit swept over thread counts and I/O sizes.
constexpr uint64_t SWEEP_FILE_BYTES = 64ull << 20;

struct Options {
  uint64_t num_layers = 24, inner_dim = 4096, page_size = 32, outer_dim = 2, dtype_bytes = 2;
  uint64_t num_blocks = 16, blocks_per_batch = 4;
  int iterations = 5, warmup = 1;
  std::string layout = "contiguous", host_layout, direction = "all", device = "auto", dir = ".";
  uint32_t io_threads = 0, io_backend = KVX_IO_AUTO;
  uint64_t bounce_bytes = 0, slot_bytes = 0;
  bool buffered = false, verify = true, random_blocks = false, json = false, cold = false, checksum = false, mapped = false;
  bool latency = false, layerwise = false, remote = false;
  unsigned submitters = 0;
  uint64_t requests = 0;  // --remote's one-at-a-time requests (0: 100 per iteration)
  std::string trace;
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
      "                  remote-host-to-host|host-to-remote-host|all (host: pinned)\n");
  std::exit(code);
}

const char *io_backend_name(uint32_t b) {
  switch (b) {
    case KVX_IO_POSIX: return "pread/pwrite";
    case KVX_IO_URING: return "io_uring";
    case KVX_IO_NIXL: return "NIXL POSIX plugin";
    case KVX_IO_GDS: return "cuFile (GDS)";
    default: return "?";
  }
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

// Empties the page cache so the next pass reads from the device. Returns false (and says
// why, once) when that is not possible.
bool drop_page_cache() {
  static bool warned = false;
  ::sync();
  FILE *f = std::fopen("/proc/sys/vm/drop_caches", "w");
  if (f && std::fputs("3", f) >= 0 && std::fclose(f) == 0) return true;
  if (f) std::fclose(f);
  if (!warned) std::fprintf(stderr, "bench: --cold: cannot drop the page cache (%s); passes may be warm\n",
                            geteuid() == 0 ? "writing /proc/sys/vm/drop_caches failed" : "not root");
  warned = true;
  return false;
}

Options parse(int argc, char **argv) {
  Options o;
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
    auto f = flags.find(a);
    if (f == flags.end() || i + 1 >= argc) {
      std::fprintf(stderr, "bench: unknown option or missing value: %s\n", a.c_str());
      usage(2);
    }
    f->second(argv[++i]);
  }
  if (o.host_layout.empty()) o.host_layout = o.layout;
  if (o.blocks_per_batch == 0 || o.num_blocks == 0 || o.iterations <= 0) {
    std::fprintf(stderr, "bench: --num-blocks, --blocks-per-batch and --iterations must be positive\n");
    std::exit(2);
  }
  return o;
}

double gbps(uint64_t bytes, double seconds) { return seconds > 0 ? bytes / seconds / 1e9 : 0; }

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  size_t i = (size_t)(p * (v.size() - 1) + 0.5);
  return v[std::min(i, v.size() - 1)];
}

struct Result {
  double seconds = 0;
  std::vector<double> batch_ms;
};

struct Pending {
  kvx::Request req;
  Clock::time_point submitted;
};

// Puts `v` in a random order, the same one on every call (fixed seed: every pass, and the
// submitters' reference, move the same blocks in the same order).
inline void shuffle_fixed(std::vector<uint64_t> &v) {
  uint64_t x = 0x9E3779B97F4A7C15ull;
  for (size_t i = v.size(); i > 1; i--) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    std::swap(v[i - 1], v[x % i]);
  }
}

// One timed pass: every batch submitted at once, then all waited for.
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

uint32_t layout_kind(const std::string &s) {
  if (s == "contiguous") return KVX_LAYOUT_FULLY_CONTIGUOUS;
  if (s == "layer-block-first") return KVX_LAYOUT_LAYER_SEPARATE_BLOCK_FIRST;
  if (s == "layer-outer-first") return KVX_LAYOUT_LAYER_SEPARATE_OUTER_FIRST;
  std::fprintf(stderr, "bench: unknown --layout %s\n", s.c_str());
  std::exit(2);
}

int32_t device_of(const std::string &s) {
  if (s == "auto") return KVX_DEVICE_AUTO;
  if (s == "emulated") return KVX_DEVICE_EMULATED;
  return (int32_t)std::atoi(s.c_str());
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

// The device layout's config and the pinned host layouts' (same geometry, --host-layout's kind).
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

// Known bytes in every block of a host layout: word i of base l is a hash of i, l and `salt`.
void fill_pattern(const kvx::Layout &host, uint32_t nbases, uint64_t base_bytes, uint64_t salt) {
  for (uint32_t l = 0; l < nbases; l++) {
    auto *p = reinterpret_cast<uint64_t *>(host.base(l));
    for (uint64_t i = 0; i < base_bytes / 8; i++) p[i] = (i * 0x9E3779B97F4A7C15ull) ^ l ^ salt;
  }
}

// Copies of the same bytes between the pinned host layout's and the device layout's
// allocations outside kvxfer: the link's limit (as few copies as the allocations allow)
// or the naive way (one copy per region).
struct RawCopy {
  cuda_raw::Api cuda;  // unused (ok == false) on the emulated device
  std::vector<uint64_t> host_bases, dev_bases;
  uint64_t host_base_bytes = 0, dev_base_bytes = 0, region_bytes = 0, total = 0;

  double pass(bool h2d, bool per_region) {
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

  // One copy of `bytes` from the start of the first allocations, synchronised.
  void one(bool h2d, uint64_t bytes) {
    void *h = reinterpret_cast<void *>(host_bases[0]);
    uint64_t d = dev_bases[0];
    if (!cuda.ok) {
      h2d ? (void)std::memcpy(reinterpret_cast<void *>(d), h, bytes) : (void)std::memcpy(h, reinterpret_cast<void *>(d), bytes);
      return;
    }
    int r = h2d ? cuda.cuMemcpyHtoDAsync_v2(d, h, bytes, cuda.stream) : cuda.cuMemcpyDtoHAsync_v2(h, d, bytes, cuda.stream);
    if (r || cuda.cuStreamSynchronize(cuda.stream)) { std::fprintf(stderr, "bench: raw copy failed (CUresult %d)\n", r); std::exit(1); }
  }
};

#include "bench_runtime.h"
#include "bench_remote.h"

}  // namespace

int run(const Options &o);

int main(int argc, char **argv) {
  Options o = parse(argc, argv);
  try {
    // Forks its serving peer before this process touches CUDA or NIXL.
    if (o.remote) return run_remote(o);
    return run(o);
  } catch (const kvx::Error &err) {
    std::fprintf(stderr, "bench: %s\n", err.what());
    return 1;
  }
}

int run(const Options &o) {
  const kvx_engine_config ec = engine_config(o);
  kvx::Engine e(&ec);
  const int32_t dev = e.device();

  const auto [lc, hc] = layout_configs(o);
  kvx::Layout device = e.create_device_layout(lc);
  kvx::Layout host = e.create_host_layout(hc, KVX_HOST_PINNED);
  kvx::Layout check_host(nullptr), disk(nullptr);
  if (o.verify || o.submitters || o.direction == "all" || o.direction == "device-to-host") check_host = e.create_host_layout(hc, KVX_HOST_PINNED);
  const uint64_t block_bytes = device.block_bytes();
  const uint64_t total = block_bytes * o.num_blocks;
  const uint32_t dev_nbases = lc.kind == KVX_LAYOUT_FULLY_CONTIGUOUS ? 1 : (uint32_t)o.num_layers;
  const uint32_t nbases = hc.kind == KVX_LAYOUT_FULLY_CONTIGUOUS ? 1 : (uint32_t)o.num_layers;
  const uint64_t base_bytes = total / nbases;

  bool want_disk = o.direction == "all" || o.direction.find("disk") != std::string::npos || !o.trace.empty();
  std::string path = o.dir + "/kvx-bench-" + std::to_string(::getpid()) + ".kv";
  const std::string scratch = path + ".raw";
  uint64_t file_bytes = 0;
  if (want_disk) {
    kvx_layout_config dc = lc;
    dc.kind = KVX_LAYOUT_FULLY_CONTIGUOUS;
    disk = e.create_disk_layout(dc, path, KVX_DISK_CREATE | (o.buffered ? KVX_DISK_BUFFERED : 0) | (o.checksum ? KVX_DISK_CHECKSUM : 0) |
                                               (o.mapped ? KVX_DISK_MAPPED : 0));
    struct stat st {};
    ::stat(path.c_str(), &st);
    file_bytes = (uint64_t)st.st_size;
    int fd = ::open(scratch.c_str(), O_CREAT | O_TRUNC | O_WRONLY, 0644);
    if (fd < 0 || ::posix_fallocate(fd, 0, (off_t)file_bytes) != 0) {
      std::fprintf(stderr, "bench: cannot create %s\n", scratch.c_str());
      return 1;
    }
    ::close(fd);
  }
  // The disk baseline uses the engine's own thread count and I/O size.
  const kvx_engine_config eff = e.config();
  const uint32_t threads = eff.io_threads;
  const uint64_t chunk = eff.slot_bytes;
  std::unique_ptr<RawFilePool> raw_files;
  if (want_disk && !o.mapped) raw_files = std::make_unique<RawFilePool>(threads, file_bytes <= SWEEP_FILE_BYTES ? std::max(chunk, file_bytes) : chunk);

  // Known bytes in every block: fill pinned host memory, move it to the device.
  RawCopy raw;
  raw.host_base_bytes = base_bytes;
  raw.dev_base_bytes = total / dev_nbases;
  raw.total = total;
  raw.region_bytes = o.page_size * o.inner_dim * o.dtype_bytes;
  for (uint32_t l = 0; l < dev_nbases; l++) raw.dev_bases.push_back(device.base(l));
  for (uint32_t l = 0; l < nbases; l++) raw.host_bases.push_back(host.base(l));
  fill_pattern(host, nbases, base_bytes, 0);
  if (dev >= 0 && !raw.cuda.open(dev)) {
    std::fprintf(stderr, "bench: cannot load the CUDA driver for the raw-copy baseline\n");
    return 1;
  }
  run_pass(e, host, device, o);

  std::printf("%s\n", kvx_version_string());
  std::printf("device %s, layout %s (host %s)%s, %llu blocks x %.2f MB (%llu layers x %llu x %llu tokens x %llu x %llu B; %.1f KiB regions), "
              "%llu blocks/batch, %d iterations",
              dev < 0 ? "emulated" : std::to_string(dev).c_str(), o.layout.c_str(), o.host_layout.c_str(),
              o.random_blocks ? ", random blocks" : "", (unsigned long long)o.num_blocks,
              block_bytes / 1e6, (unsigned long long)o.num_layers, (unsigned long long)o.outer_dim,
              (unsigned long long)o.page_size, (unsigned long long)o.inner_dim, (unsigned long long)o.dtype_bytes,
              raw.region_bytes / 1024.0, (unsigned long long)o.blocks_per_batch, o.iterations);
  if (want_disk)
    std::printf(", file %s (%s%s), disk I/O by %s", path.c_str(),
                o.mapped ? "mapped and pinned: moved by DMA, no file I/O" : o.buffered ? "buffered" : "O_DIRECT",
                o.checksum ? ", checksummed" : "", o.mapped ? "none" : io_backend_name(e.io_backend()));
  std::printf("\n");
  if (o.latency || o.layerwise || o.submitters || !o.trace.empty()) {
    if (o.latency) run_latency(e, host, device, raw, o, block_bytes);
    if (o.layerwise) {
      bool from_disk = o.direction == "disk-to-device";
      if (from_disk) run_pass(e, device, disk, o);  // the file must hold the blocks
      // One layer of the request's blocks: read from the file (layer 0 leads each block's
      // stride there) by the best of a sweep of thread counts, then one copy of its bytes;
      // best of 5 each.
      const uint64_t layer_bytes = o.outer_dim * raw.region_bytes;
      auto floor = [&](const std::vector<uint64_t> &blocks, std::string &how, double &wake) {
        const uint64_t bytes = blocks.size() * layer_bytes;
        double copy = 1e30;
        for (int i = 0; i < 5; i++) {
          auto t0 = Clock::now();
          raw.one(true, bytes);
          copy = std::min(copy, std::chrono::duration<double>(Clock::now() - t0).count());
        }
        char text[160];
        bool readable = raw_files && (o.buffered || layer_bytes % 4096 == 0);
        if (!from_disk || !readable) {
          std::snprintf(text, sizeof text, "one copy of %.0f KiB%s", bytes / 1024.0,
                        from_disk && !o.mapped ? " (the reads not measured: unaligned for O_DIRECT)" : "");
          how = text;
          return copy;
        }
        RawFilePool::Extents ext;
        const uint64_t stride = file_bytes / o.num_blocks;
        for (uint64_t b : blocks)
          for (uint64_t at = 0; at < layer_bytes; at += chunk) ext.push_back({b * stride + at, std::min(chunk, layer_bytes - at)});
        RawFilePool::Best rd = raw_files->best_extents(path, ext, o.buffered, 5);
        wake = rd.wake_seconds;
        std::snprintf(text, sizeof text, "read %.1f us by %u threads + one copy %.1f us; waking those threads %.1f us, not counted",
                      rd.seconds * 1e6, rd.threads, copy * 1e6, wake * 1e6);
        how = text;
        return rd.seconds + copy;
      };
      run_layerwise(e, from_disk ? disk : host, device, from_disk ? "disk-to-device" : "host-to-device", o, floor);
    }
    if (o.submitters) run_submitters(e, host, device, check_host, o, block_bytes);
    if (!o.trace.empty()) {
      run_pass(e, device, disk, o);  // the tier holds every block
      run_trace(e, disk, device, o, block_bytes);
    }
    if (want_disk) ::unlink(scratch.c_str());
    return 0;
  }
  std::printf("%-16s %10s %9s %9s %12s %11s %9s  %s\n", "direction", "GB/s", "p50 ms", "p99 ms", "limit GB/s", "% of limit",
              "CPU s/GB", "limit measured as");

  struct Dir {
    const char *name;
    const kvx::Layout &src, &dst;
    enum { DISK_WRITE, DISK_READ, H2D, D2H } kind;
  };
  std::vector<Dir> dirs;
  auto want = [&](const char *d) { return o.direction == "all" || o.direction == d; };
  // device→disk first, so disk→device reads real data.
  if (want("device-to-disk")) dirs.push_back({"device-to-disk", device, disk, Dir::DISK_WRITE});
  if (want("disk-to-device")) dirs.push_back({"disk-to-device", disk, device, Dir::DISK_READ});
  if (want("host-to-device")) dirs.push_back({"host-to-device", host, device, Dir::H2D});
  if (want("device-to-host")) dirs.push_back({"device-to-host", device, check_host, Dir::D2H});
  if (dirs.empty()) {
    std::fprintf(stderr, "bench: unknown --direction %s\n", o.direction.c_str());
    return 2;
  }
  if (dirs[0].kind == Dir::DISK_READ) run_pass(e, device, disk, o);  // the file must hold the blocks

  const bool per_region = lc.kind != KVX_LAYOUT_FULLY_CONTIGUOUS || hc.kind != KVX_LAYOUT_FULLY_CONTIGUOUS || o.random_blocks;
  for (auto &d : dirs) {
    bool is_disk = d.kind == Dir::DISK_WRITE || d.kind == Dir::DISK_READ;
    bool h2d = d.kind == Dir::DISK_READ || d.kind == Dir::H2D;
    // A mapped file moves by DMA alone (no file I/O): its limit is the link's.
    bool file_io = is_disk && !o.mapped;
    // A small file's raw I/O is swept (threads, I/O size) once, and its best setting
    // timed in every pass; a large one's at the engine's own (sweeps in docs/results).
    const bool w = d.kind == Dir::DISK_WRITE;
    const std::string &raw_path = w ? scratch : path;
    RawFilePool::Best raw_io{0, threads, chunk};
    if (file_io && file_bytes <= SWEEP_FILE_BYTES) raw_io = raw_files->best(raw_path, file_bytes, chunk, o.buffered, w, 3);
    auto limit_pass = [&]() {
      if (file_io) return raw_files->pass(raw_path, file_bytes, raw_io.threads, raw_io.io, o.buffered, w);
      return raw.pass(h2d, false);
    };
    for (int i = 0; i < o.warmup; i++) {
      run_pass(e, d.src, d.dst, o);
      limit_pass();
    }
    double kvx_s = 0, limit_s = 0, link_s = 0, loop_s = 0;
    std::vector<double> lat;
    const kvx_stats before = e.stats();
    const bool tty = isatty(STDOUT_FILENO);
    double cpu_s = 0;
    for (int i = 0; i < o.iterations; i++) {
      if (tty) std::printf("\r%-16s pass %d/%d ...", d.name, i + 1, o.iterations), std::fflush(stdout);
      if (o.cold && is_disk) drop_page_cache();
      double cpu0 = cpu_seconds();
      Result r = run_pass(e, d.src, d.dst, o);
      cpu_s += cpu_seconds() - cpu0;
      kvx_s += r.seconds;
      lat.insert(lat.end(), r.batch_ms.begin(), r.batch_ms.end());
      limit_s += limit_pass();
      if (file_io) link_s += raw.pass(h2d, false);
      if (!is_disk && per_region) loop_s += raw.pass(h2d, true);
    }
    if (tty) std::printf("\r%60s\r", "");
    const kvx_stats after = e.stats();
    uint64_t bytes = total * o.iterations;
    double kvx = gbps(bytes, kvx_s), limit = gbps(bytes, limit_s);
    const char *how = file_io  ? (o.buffered ? "raw buffered file I/O" : "raw O_DIRECT file I/O")
                      : is_disk ? (dev >= 0 ? "PCIe (raw pinned copy; the mapped file needs no file I/O)" : "raw memcpy")
                                : (dev >= 0 ? "cuMemcpyAsync, one per allocation" : "memcpy, one per allocation");
    if (is_disk && link_s > 0 && gbps(bytes, link_s) < limit) {
      limit = gbps(bytes, link_s);
      how = dev >= 0 ? "PCIe (raw pinned copy)" : "raw memcpy";
    }
    std::printf("%-16s %10.2f %9.2f %9.2f %12.2f %10.1f%% %9.3f  %s\n", d.name, kvx, percentile(lat, 0.5), percentile(lat, 0.99), limit,
                limit > 0 ? 100.0 * kvx / limit : 0.0, cpu_s / (bytes / 1e9), how);
    if (is_disk && link_s > 0)
      std::printf("%-16s per pass: kvxfer %.3f ms; raw file I/O %.3f ms, raw copy %.3f ms: kvxfer / max %.2f, / sum %.2f\n", "",
                  1e3 * kvx_s / o.iterations, 1e3 * limit_s / o.iterations, 1e3 * link_s / o.iterations,
                  kvx_s / std::max(limit_s, link_s), kvx_s / (limit_s + link_s));
    if (file_io)
      std::printf("%-16s raw file I/O: %u threads, %llu KiB per I/O (%s)\n", "", raw_io.threads, (unsigned long long)(raw_io.io >> 10),
                  file_bytes <= SWEEP_FILE_BYTES ? "the best of a sweep of thread counts and I/O sizes" : "the engine's thread count and slot size");
    // Where the time went: each stage's busy time over the wall time of kvxfer's passes
    // (above 100% means several threads were busy at once).
    auto util = [&](uint64_t a, uint64_t b) { return 100.0 * (double)(b - a) / 1e9 / kvx_s; };
    std::printf("%-16s stages busy: disk read %.0f%%, disk write %.0f%%, host memcpy %.0f%%, device copy %.0f%%, "
                "waiting for a slot %.0f%%\n", "", util(before.disk_read_ns, after.disk_read_ns),
                util(before.disk_write_ns, after.disk_write_ns), util(before.host_copy_ns, after.host_copy_ns),
                util(before.device_copy_ns, after.device_copy_ns), util(before.slot_wait_ns, after.slot_wait_ns));
    if (o.json)
      std::printf("{\"system\": \"kvxfer\", \"direction\": \"%s\", \"layout\": \"%s\", \"blocks_per_batch\": %llu, "
                  "\"num_blocks\": %llu, \"block_bytes\": %llu, \"io_backend\": \"%s\", \"gbps\": %.3f, \"limit_gbps\": %.3f, \"p50_ms\": %.3f, "
                  "\"p99_ms\": %.3f, \"loop_gbps\": %.3f, \"cpu_s_per_gb\": %.4f, \"mode\": \"batch\", \"random\": %s, "
                  "\"mapped\": %s, \"buffered\": %s, \"host_layout\": \"%s\", \"pass_ms\": %.4f, \"raw_io_pass_ms\": %.4f, "
                  "\"raw_copy_pass_ms\": %.4f}\n",
                  d.name, o.layout.c_str(), (unsigned long long)o.blocks_per_batch, (unsigned long long)o.num_blocks,
                  (unsigned long long)block_bytes, io_backend_name(e.io_backend()), kvx, limit, percentile(lat, 0.5), percentile(lat, 0.99),
                  loop_s > 0 ? gbps(bytes, loop_s) : 0.0, cpu_s / (bytes / 1e9), o.random_blocks ? "true" : "false",
                  o.mapped ? "true" : "false", o.buffered ? "true" : "false", o.host_layout.empty() ? o.layout.c_str() : o.host_layout.c_str(),
                  1e3 * kvx_s / o.iterations, file_io ? 1e3 * limit_s / o.iterations : 0.0,
                  // The raw copy's time: beside file I/O it is measured on its own, else it is the limit.
                  1e3 * (link_s > 0 ? link_s : file_io ? 0.0 : limit_s) / o.iterations);
    if (loop_s > 0)
      std::printf("%-16s %10.2f %9s %9s %12s %11s  naive: one %s per %.1f KiB region (kvxfer: %.2fx)\n", "  per-region loop",
                  gbps(bytes, loop_s), "", "", "", "", dev >= 0 ? "cuMemcpyAsync" : "memcpy", raw.region_bytes / 1024.0,
                  kvx / gbps(bytes, loop_s));
  }
  std::printf("GB/s = 1e9 B/s of payload (all layers, K and V).\n");
  std::fflush(stdout);
  if (want_disk) ::unlink(scratch.c_str());

  int rc = 0;
  if (o.verify) {
    // Every byte must survive host -> device -> (disk ->) host. The device is written again
    // first: the raw baselines copied over it.
    run_pass(e, host, device, o);
    if (disk) {
      run_pass(e, device, disk, o);
      run_pass(e, disk, check_host, o);
    } else {
      run_pass(e, device, check_host, o);
    }
    for (uint32_t l = 0; l < nbases && rc == 0; l++) {
      uint64_t a = host.base(l), b = check_host.base(l);
      if (std::memcmp(reinterpret_cast<void *>(a), reinterpret_cast<void *>(b), base_bytes) != 0) {
        std::fprintf(stderr, "bench: VERIFY FAILED: bytes read back differ from those written (base %u)\n", l);
        rc = 1;
      }
    }
    if (rc == 0) std::printf("verify: every byte read back matches what was written\n");
  }
  return rc;
}
