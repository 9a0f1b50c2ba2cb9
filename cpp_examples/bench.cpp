// kvxfer bench: how fast KV blocks move between disk, host and device through kvxfer,
// next to the physical limit measured in the same run (raw reads/writes of the same
// file with the same O_DIRECT setting, raw_file.h; writes go to a scratch file of the
// same size beside the layout's file, so the blocks kvxfer wrote stay intact).
//
//   ./cpp_examples/bench                       # Dynamo KVBM-like defaults
//   ./cpp_examples/bench --num-blocks 86 --direction disk-to-device   # ~1 GiB, cold O_DIRECT
//   ./cpp_examples/bench --help
//
// This file is the batch table (the default mode) and main; the runtime-shaped modes are
// in bench_runtime.cpp, --remote in bench_remote.cpp, --store in bench_store.cpp, --mix in
// bench_mix.cpp, what they share in bench_common.h.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "bench_common.h"
#include "bench_mix.h"
#include "bench_remote.h"
#include "bench_runtime.h"
#include "bench_store.h"
#include "kvxfer.hpp"
#include "raw_file.h"

namespace bench {
namespace {

// Files up to this size get their raw I/O limit swept over thread counts and I/O sizes.
constexpr uint64_t SWEEP_FILE_BYTES = 64ull << 20;

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

// One row of the batch table: which layouts the blocks move between.
struct Direction {
  const char *name;
  const kvx::Layout &src, &dst;
  enum { DISK_WRITE, DISK_READ, H2D, D2H } kind;

  bool disk() const { return kind == DISK_WRITE || kind == DISK_READ; }
  bool to_device() const { return kind == DISK_READ || kind == H2D; }
};

// What one direction's timed passes measured, in seconds summed over the passes.
struct Measured {
  double kvx_s = 0, limit_s = 0, link_s = 0, loop_s = 0, cpu_s = 0;
  std::vector<double> lat;  // each batch's submit -> completion, ms
  kvx_stats before{}, after{};
  RawFilePool::Best raw_io{0, 0, 0};
};

// The engine, the layouts and the raw baselines of one run, set up step by step in the
// order the run needs them; the scratch file goes with it.
class Run {
 public:
  explicit Run(const Options &o)
      : o_(o), ec_(engine_config(o)), e_(&ec_), dev_(e_.device()), lc_(layout_configs(o).first), hc_(layout_configs(o).second) {
    device_ = e_.create_device_layout(lc_);
    host_ = e_.create_host_layout(hc_, KVX_HOST_PINNED);
    if (o.verify || o.submitters || o.direction == "all" || o.direction == "device-to-host")
      check_host_ = e_.create_host_layout(hc_, KVX_HOST_PINNED);
    block_bytes_ = device_.block_bytes();
    total_ = block_bytes_ * o.num_blocks;
    dev_nbases_ = lc_.kind == KVX_LAYOUT_FULLY_CONTIGUOUS ? 1 : (uint32_t)o.num_layers;
    nbases_ = hc_.kind == KVX_LAYOUT_FULLY_CONTIGUOUS ? 1 : (uint32_t)o.num_layers;
    base_bytes_ = total_ / nbases_;
    want_disk_ = o.direction == "all" || o.direction.find("disk") != std::string::npos || !o.trace.empty();
    path_ = o.dir + "/kvx-bench-" + std::to_string(::getpid()) + ".kv";
  }
  ~Run() {
    if (scratch_made_) ::unlink(scratch_.c_str());
  }
  Run(const Run &) = delete;
  Run &operator=(const Run &) = delete;

  bool open_disk();
  void plan_raw_baselines();
  bool fill_blocks();
  void print_setup();
  int run_runtime_modes();
  int run_table();
  int verify();

 private:
  double layer_floor(const std::vector<uint64_t> &blocks, bool from_disk, std::string &how, double &wake);
  Measured measure(const Direction &d, bool per_region);
  void report(const Direction &d, const Measured &m);

  const Options &o_;
  const kvx_engine_config ec_;
  kvx::Engine e_;
  const int32_t dev_;
  const kvx_layout_config lc_, hc_;
  kvx::Layout device_{nullptr}, host_{nullptr}, check_host_{nullptr}, disk_{nullptr};
  uint64_t block_bytes_ = 0, total_ = 0, base_bytes_ = 0;
  uint32_t dev_nbases_ = 0, nbases_ = 0;
  bool want_disk_ = false;
  std::string path_, scratch_;
  bool scratch_made_ = false;
  uint64_t file_bytes_ = 0;
  // The disk baseline uses the engine's own thread count and I/O size.
  uint32_t threads_ = 0;
  uint64_t chunk_ = 0;
  std::unique_ptr<RawFilePool> raw_files_;
  RawCopy raw_;
};

// The disk layout and, beside its file, a scratch file of the same size for the raw
// writes. False (having said why) when the scratch file cannot be made.
bool Run::open_disk() {
  if (!want_disk_) return true;
  kvx_layout_config dc = lc_;
  dc.kind = KVX_LAYOUT_FULLY_CONTIGUOUS;
  disk_ = e_.create_disk_layout(dc, path_, KVX_DISK_CREATE | (o_.buffered ? KVX_DISK_BUFFERED : 0) | (o_.checksum ? KVX_DISK_CHECKSUM : 0) |
                                               (o_.mapped ? KVX_DISK_MAPPED : 0));
  struct stat st {};
  ::stat(path_.c_str(), &st);
  file_bytes_ = (uint64_t)st.st_size;
  scratch_ = path_ + ".raw";
  int fd = ::open(scratch_.c_str(), O_CREAT | O_TRUNC | O_WRONLY, 0644);
  if (fd < 0 || ::posix_fallocate(fd, 0, (off_t)file_bytes_) != 0) {
    std::fprintf(stderr, "bench: cannot create %s\n", scratch_.c_str());
    return false;
  }
  ::close(fd);
  scratch_made_ = true;
  return true;
}

// The raw file pool (at the engine's thread count and slot size) and the raw copy's view
// of the host and device allocations.
void Run::plan_raw_baselines() {
  const kvx_engine_config eff = e_.config();
  threads_ = eff.io_threads;
  chunk_ = eff.slot_bytes;
  if (want_disk_ && !o_.mapped)
    raw_files_ = std::make_unique<RawFilePool>(threads_, file_bytes_ <= SWEEP_FILE_BYTES ? std::max(chunk_, file_bytes_) : chunk_);
  raw_.host_base_bytes = base_bytes_;
  raw_.dev_base_bytes = total_ / dev_nbases_;
  raw_.total = total_;
  raw_.region_bytes = o_.page_size * o_.inner_dim * o_.dtype_bytes;
  for (uint32_t l = 0; l < dev_nbases_; l++) raw_.dev_bases.push_back(device_.base(l));
  for (uint32_t l = 0; l < nbases_; l++) raw_.host_bases.push_back(host_.base(l));
}

// Known bytes in every block: fill pinned host memory, move it to the device. False
// (having said why) when the raw copy's CUDA driver cannot be loaded.
bool Run::fill_blocks() {
  fill_pattern(host_, nbases_, base_bytes_, 0);
  if (dev_ >= 0 && !raw_.cuda.open(dev_)) {
    std::fprintf(stderr, "bench: cannot load the CUDA driver for the raw-copy baseline\n");
    return false;
  }
  run_pass(e_, host_, device_, o_);
  return true;
}

void Run::print_setup() {
  std::printf("%s\n", kvx_version_string());
  std::printf("device %s, layout %s (host %s)%s, %llu blocks x %.2f MB (%llu layers x %llu x %llu tokens x %llu x %llu B; %.1f KiB regions), "
              "%llu blocks/batch, %d iterations",
              dev_ < 0 ? "emulated" : std::to_string(dev_).c_str(), o_.layout.c_str(), o_.host_layout.c_str(),
              o_.random_blocks ? ", random blocks" : "", (unsigned long long)o_.num_blocks,
              block_bytes_ / 1e6, (unsigned long long)o_.num_layers, (unsigned long long)o_.outer_dim,
              (unsigned long long)o_.page_size, (unsigned long long)o_.inner_dim, (unsigned long long)o_.dtype_bytes,
              raw_.region_bytes / 1024.0, (unsigned long long)o_.blocks_per_batch, o_.iterations);
  if (want_disk_)
    std::printf(", file %s (%s%s), disk I/O by %s", path_.c_str(),
                o_.mapped ? "mapped and pinned: moved by DMA, no file I/O" : o_.buffered ? "buffered" : "O_DIRECT",
                o_.checksum ? ", checksummed" : "", o_.mapped ? "none" : io_backend_name(e_.io_backend()));
  std::printf("\n");
}

// --layerwise's floor: one layer of the request's blocks read from the file (layer 0
// leads each block's stride there) by the best of a sweep of thread counts, then one copy
// of its bytes; best of 5 each. Without a file (or where O_DIRECT cannot read a layer
// alone), the copy only.
double Run::layer_floor(const std::vector<uint64_t> &blocks, bool from_disk, std::string &how, double &wake) {
  const uint64_t layer_bytes = o_.outer_dim * raw_.region_bytes;
  const uint64_t bytes = blocks.size() * layer_bytes;
  double copy = 1e30;
  for (int i = 0; i < 5; i++) {
    auto t0 = Clock::now();
    raw_.one(true, bytes);
    copy = std::min(copy, std::chrono::duration<double>(Clock::now() - t0).count());
  }
  char text[160];
  bool readable = raw_files_ && (o_.buffered || layer_bytes % 4096 == 0);
  if (!from_disk || !readable) {
    std::snprintf(text, sizeof text, "one copy of %.0f KiB%s", bytes / 1024.0,
                  from_disk && !o_.mapped ? " (the reads not measured: unaligned for O_DIRECT)" : "");
    how = text;
    return copy;
  }
  RawFilePool::Extents ext;
  const uint64_t stride = file_bytes_ / o_.num_blocks;
  for (uint64_t b : blocks)
    for (uint64_t at = 0; at < layer_bytes; at += chunk_) ext.push_back({b * stride + at, std::min(chunk_, layer_bytes - at)});
  RawFilePool::Best rd = raw_files_->best_extents(path_, ext, o_.buffered, 5);
  wake = rd.wake_seconds;
  std::snprintf(text, sizeof text, "read %.1f us by %u threads + one copy %.1f us; waking those threads %.1f us, not counted",
                rd.seconds * 1e6, rd.threads, copy * 1e6, wake * 1e6);
  how = text;
  return rd.seconds + copy;
}

// --latency, --layerwise, --submitters and --trace, in that order, instead of the table.
int Run::run_runtime_modes() {
  if (o_.latency) run_latency(e_, host_, device_, raw_, o_, block_bytes_);
  if (o_.layerwise) {
    bool from_disk = o_.direction == "disk-to-device";
    if (from_disk) run_pass(e_, device_, disk_, o_);  // the file must hold the blocks
    run_layerwise(e_, from_disk ? disk_ : host_, device_, from_disk ? "disk-to-device" : "host-to-device", o_,
                  [&](const std::vector<uint64_t> &blocks, std::string &how, double &wake) {
                    return layer_floor(blocks, from_disk, how, wake);
                  });
  }
  if (o_.submitters) run_submitters(e_, host_, device_, check_host_, o_, block_bytes_);
  if (!o_.trace.empty()) {
    run_pass(e_, device_, disk_, o_);  // the tier holds every block
    run_trace(e_, disk_, device_, o_, block_bytes_);
  }
  return 0;
}

// The warm-up and timed passes of one direction, each beside its limit: the raw file I/O
// (and the raw copy) for the disk, the raw copy for host and device, and the naive copy
// per region where the layouts or the block order scatter the bytes.
Measured Run::measure(const Direction &d, bool per_region) {
  Measured m;
  const bool is_disk = d.disk(), h2d = d.to_device();
  // A mapped file moves by DMA alone (no file I/O): its limit is the link's.
  const bool file_io = is_disk && !o_.mapped;
  // A small file's raw I/O is swept (threads, I/O size) once, and its best setting
  // timed in every pass; a large one's at the engine's own (docs/benchmarks.md#method).
  const bool w = d.kind == Direction::DISK_WRITE;
  const std::string &raw_path = w ? scratch_ : path_;
  m.raw_io = RawFilePool::Best{0, threads_, chunk_};
  if (file_io && file_bytes_ <= SWEEP_FILE_BYTES) m.raw_io = raw_files_->best(raw_path, file_bytes_, chunk_, o_.buffered, w, 3);
  auto limit_pass = [&]() {
    if (file_io) return raw_files_->pass(raw_path, file_bytes_, m.raw_io.threads, m.raw_io.io, o_.buffered, w);
    return raw_.pass(h2d, false);
  };
  for (int i = 0; i < o_.warmup; i++) {
    run_pass(e_, d.src, d.dst, o_);
    limit_pass();
  }
  m.before = e_.stats();
  const bool tty = isatty(STDOUT_FILENO);
  for (int i = 0; i < o_.iterations; i++) {
    if (tty) std::printf("\r%-16s pass %d/%d ...", d.name, i + 1, o_.iterations), std::fflush(stdout);
    if (o_.cold && is_disk) drop_page_cache();
    double cpu0 = cpu_seconds();
    Result r = run_pass(e_, d.src, d.dst, o_);
    m.cpu_s += cpu_seconds() - cpu0;
    m.kvx_s += r.seconds;
    m.lat.insert(m.lat.end(), r.batch_ms.begin(), r.batch_ms.end());
    m.limit_s += limit_pass();
    if (file_io) m.link_s += raw_.pass(h2d, false);
    if (!is_disk && per_region) m.loop_s += raw_.pass(h2d, true);
  }
  if (tty) std::printf("\r%60s\r", "");
  m.after = e_.stats();
  return m;
}

// One direction's row of the table, its detail lines and (--json) its JSON object.
void Run::report(const Direction &d, const Measured &m) {
  const bool is_disk = d.disk(), file_io = is_disk && !o_.mapped;
  uint64_t bytes = total_ * o_.iterations;
  double kvx = gbps(bytes, m.kvx_s), limit = gbps(bytes, m.limit_s);
  const char *how = file_io  ? (o_.buffered ? "raw buffered file I/O" : "raw O_DIRECT file I/O")
                    : is_disk ? (dev_ >= 0 ? "PCIe (raw pinned copy; the mapped file needs no file I/O)" : "raw memcpy")
                              : (dev_ >= 0 ? "cuMemcpyAsync, one per allocation" : "memcpy, one per allocation");
  if (is_disk && m.link_s > 0 && gbps(bytes, m.link_s) < limit) {
    limit = gbps(bytes, m.link_s);
    how = dev_ >= 0 ? "PCIe (raw pinned copy)" : "raw memcpy";
  }
  std::printf("%-16s %10.2f %9.2f %9.2f %12.2f %10.1f%% %9.3f  %s\n", d.name, kvx, percentile(m.lat, 0.5), percentile(m.lat, 0.99), limit,
              limit > 0 ? 100.0 * kvx / limit : 0.0, m.cpu_s / (bytes / 1e9), how);
  if (is_disk && m.link_s > 0)
    std::printf("%-16s per pass: kvxfer %.3f ms; raw file I/O %.3f ms, raw copy %.3f ms: kvxfer / max %.2f, / sum %.2f\n", "",
                1e3 * m.kvx_s / o_.iterations, 1e3 * m.limit_s / o_.iterations, 1e3 * m.link_s / o_.iterations,
                m.kvx_s / std::max(m.limit_s, m.link_s), m.kvx_s / (m.limit_s + m.link_s));
  if (file_io)
    std::printf("%-16s raw file I/O: %u threads, %llu KiB per I/O (%s)\n", "", m.raw_io.threads, (unsigned long long)(m.raw_io.io >> 10),
                file_bytes_ <= SWEEP_FILE_BYTES ? "the best of a sweep of thread counts and I/O sizes" : "the engine's thread count and slot size");
  // Where the time went: each stage's busy time over the wall time of kvxfer's passes
  // (above 100% means several threads were busy at once).
  auto util = [&](uint64_t a, uint64_t b) { return 100.0 * (double)(b - a) / 1e9 / m.kvx_s; };
  std::printf("%-16s stages busy: disk read %.0f%%, disk write %.0f%%, host memcpy %.0f%%, device copy %.0f%%, "
              "waiting for a slot %.0f%%\n", "", util(m.before.disk_read_ns, m.after.disk_read_ns),
              util(m.before.disk_write_ns, m.after.disk_write_ns), util(m.before.host_copy_ns, m.after.host_copy_ns),
              util(m.before.device_copy_ns, m.after.device_copy_ns), util(m.before.slot_wait_ns, m.after.slot_wait_ns));
  if (o_.json)
    std::printf("{\"system\": \"kvxfer\", \"direction\": \"%s\", \"layout\": \"%s\", \"blocks_per_batch\": %llu, "
                "\"num_blocks\": %llu, \"block_bytes\": %llu, \"io_backend\": \"%s\", \"gbps\": %.3f, \"limit_gbps\": %.3f, \"p50_ms\": %.3f, "
                "\"p99_ms\": %.3f, \"loop_gbps\": %.3f, \"cpu_s_per_gb\": %.4f, \"mode\": \"batch\", \"random\": %s, "
                "\"mapped\": %s, \"buffered\": %s, \"host_layout\": \"%s\", \"pass_ms\": %.4f, \"raw_io_pass_ms\": %.4f, "
                "\"raw_copy_pass_ms\": %.4f}\n",
                d.name, o_.layout.c_str(), (unsigned long long)o_.blocks_per_batch, (unsigned long long)o_.num_blocks,
                (unsigned long long)block_bytes_, io_backend_name(e_.io_backend()), kvx, limit, percentile(m.lat, 0.5), percentile(m.lat, 0.99),
                m.loop_s > 0 ? gbps(bytes, m.loop_s) : 0.0, m.cpu_s / (bytes / 1e9), o_.random_blocks ? "true" : "false",
                o_.mapped ? "true" : "false", o_.buffered ? "true" : "false", o_.host_layout.empty() ? o_.layout.c_str() : o_.host_layout.c_str(),
                1e3 * m.kvx_s / o_.iterations, file_io ? 1e3 * m.limit_s / o_.iterations : 0.0,
                // The raw copy's time: beside file I/O it is measured on its own, else it is the limit.
                1e3 * (m.link_s > 0 ? m.link_s : file_io ? 0.0 : m.limit_s) / o_.iterations);
  if (m.loop_s > 0)
    std::printf("%-16s %10.2f %9s %9s %12s %11s  naive: one %s per %.1f KiB region (kvxfer: %.2fx)\n", "  per-region loop",
                gbps(bytes, m.loop_s), "", "", "", "", dev_ >= 0 ? "cuMemcpyAsync" : "memcpy", raw_.region_bytes / 1024.0,
                kvx / gbps(bytes, m.loop_s));
}

// The batch table: each direction --direction picks, measured and reported in turn.
int Run::run_table() {
  std::printf("%-16s %10s %9s %9s %12s %11s %9s  %s\n", "direction", "GB/s", "p50 ms", "p99 ms", "limit GB/s", "% of limit",
              "CPU s/GB", "limit measured as");
  std::vector<Direction> dirs;
  auto want = [&](const char *d) { return o_.direction == "all" || o_.direction == d; };
  // device→disk first, so disk→device reads real data.
  if (want("device-to-disk")) dirs.push_back({"device-to-disk", device_, disk_, Direction::DISK_WRITE});
  if (want("disk-to-device")) dirs.push_back({"disk-to-device", disk_, device_, Direction::DISK_READ});
  if (want("host-to-device")) dirs.push_back({"host-to-device", host_, device_, Direction::H2D});
  if (want("device-to-host")) dirs.push_back({"device-to-host", device_, check_host_, Direction::D2H});
  if (dirs.empty()) {
    std::fprintf(stderr, "bench: unknown --direction %s\n", o_.direction.c_str());
    return 2;
  }
  if (dirs[0].kind == Direction::DISK_READ) run_pass(e_, device_, disk_, o_);  // the file must hold the blocks

  const bool per_region = lc_.kind != KVX_LAYOUT_FULLY_CONTIGUOUS || hc_.kind != KVX_LAYOUT_FULLY_CONTIGUOUS || o_.random_blocks;
  for (auto &d : dirs) report(d, measure(d, per_region));
  std::printf("GB/s = 1e9 B/s of payload (all layers, K and V).\n");
  std::fflush(stdout);
  return 0;
}

// Every byte must survive host -> device -> (disk ->) host. The device is written again
// first: the raw baselines copied over it.
int Run::verify() {
  run_pass(e_, host_, device_, o_);
  if (disk_) {
    run_pass(e_, device_, disk_, o_);
    run_pass(e_, disk_, check_host_, o_);
  } else {
    run_pass(e_, device_, check_host_, o_);
  }
  for (uint32_t l = 0; l < nbases_; l++) {
    uint64_t a = host_.base(l), b = check_host_.base(l);
    if (std::memcmp(reinterpret_cast<void *>(a), reinterpret_cast<void *>(b), base_bytes_) != 0) {
      std::fprintf(stderr, "bench: VERIFY FAILED: bytes read back differ from those written (base %u)\n", l);
      return 1;
    }
  }
  std::printf("verify: every byte read back matches what was written\n");
  return 0;
}

// The bench without --remote: set up, then the runtime-shaped modes or the batch table
// and its byte check.
int run(const Options &o) {
  Run r(o);
  if (!r.open_disk()) return 1;
  r.plan_raw_baselines();
  if (!r.fill_blocks()) return 1;
  r.print_setup();
  if (o.latency || o.layerwise || o.submitters || !o.trace.empty()) return r.run_runtime_modes();
  if (int rc = r.run_table()) return rc;
  return o.verify ? r.verify() : 0;
}

}  // namespace
}  // namespace bench

int main(int argc, char **argv) {
  bench::Options o = bench::parse(argc, argv);
  try {
    // Forks its serving peer before this process touches CUDA or NIXL.
    if (o.remote) return bench::run_remote(o);
    if (o.mix) return bench::run_mix(o);  // with --store too: the mix of store gets and puts
    if (o.store) return bench::run_store(o);
    return bench::run(o);
  } catch (const kvx::Error &err) {
    std::fprintf(stderr, "bench: %s\n", err.what());
    return 1;
  }
}
