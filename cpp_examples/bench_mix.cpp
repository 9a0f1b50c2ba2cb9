// --mix (bench_mix.h). The device layout holds 2 × --num-blocks blocks: onboards fill the
// first half (block b of the hot file into device block b), the background offloads the
// second half (device block --num-blocks + i into block i of the background file), so the
// two never touch the same memory. The background is open-loop: a pacing thread issues
// request k when it is due, k / rate after the start, whether or not earlier ones have
// completed, so an engine that slows the background shows as a background below its
// rate, not as fewer requests offered.
#include "bench_mix.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <deque>
#include <string>
#include <thread>
#include <vector>

namespace bench {

namespace {

// The share of its target rate a background must reach to have kept it.
constexpr double KEPT = 0.95;
// How long the background's rate alone is measured, after a warm-up of a quarter of that.
constexpr double ALONE_SECONDS = 1.0;
// How long the background runs at its rate before the counted onboards start.
constexpr double RAMP_SECONDS = 0.1;
// Onboards of each level before the counted ones.
constexpr size_t WARMUP_ONBOARDS = 10;
// The shortest run of counted onboards at each level: they go on past --onboards until it
// has passed, so a background of a few hundred requests a second is not judged on a
// handful of them, and the onboards alone are counted over as long as beside it.
constexpr double MIN_WINDOW_SECONDS = 1.0;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// Offloads of `per_request` blocks from the device layout's second half to the background
// file, issued back to back or on a schedule by a thread of their own. The file is a ring
// of `slots` requests' blocks and at most that many requests are in flight, so no two
// running requests write the same block.
class Background {
 public:
  Background(kvx::Engine &e, const kvx::Layout &device, const kvx::Layout &file, uint64_t first_device_block, uint64_t file_blocks,
             uint64_t per_request)
      : e_(e), device_(device), file_(file), first_(first_device_block), per_request_(per_request), slots_(file_blocks / per_request) {}
  ~Background() { stop(); }
  Background(const Background &) = delete;
  Background &operator=(const Background &) = delete;

  // Requests per second with `depth` in flight back to back (a new one as soon as the
  // oldest completes), over `seconds` after a warm-up; every request completed on return.
  double alone_rate(unsigned depth, double seconds);
  // Starts issuing `rate` requests per second from now on.
  void start(double rate);
  // Stops issuing and waits for every issued request.
  void stop();

  uint64_t completed() const { return completed_.load(std::memory_order_acquire); }
  uint64_t failed() const { return failed_.load(); }
  uint64_t slots() const { return slots_; }
  // How late each request of the last start() was issued against its due time, µs
  // (read after stop()).
  const std::vector<double> &lag_us() const { return lag_us_; }

 private:
  static void on_complete(void *user, kvx_request *, kvx_status s) {
    auto *b = static_cast<Background *>(user);
    if (s != KVX_OK) b->failed_.fetch_add(1);
    b->completed_.fetch_add(1, std::memory_order_release);
  }
  // Drops the completed requests at the front, then waits for the oldest while `limit`
  // or more are in flight.
  void retire(size_t limit);
  void submit_next();
  void pace(double rate);
  void drain() { retire(1); }

  kvx::Engine &e_;
  const kvx::Layout &device_, &file_;
  const uint64_t first_, per_request_, slots_;
  uint64_t next_ = 0;
  std::deque<kvx::Request> in_flight_;
  std::vector<double> lag_us_;
  std::thread pacer_;
  std::atomic<bool> stopping_{false};
  std::atomic<uint64_t> completed_{0}, failed_{0};
};

void Background::retire(size_t limit) {
  while (!in_flight_.empty() && in_flight_.front().poll() != KVX_PENDING) in_flight_.pop_front();
  while (in_flight_.size() >= limit && !in_flight_.empty()) {
    in_flight_.front().wait_for(UINT64_MAX);  // a failure is counted by on_complete
    in_flight_.pop_front();
  }
}

void Background::submit_next() {
  const uint64_t slot = next_++ % slots_;
  std::vector<uint64_t> src(per_request_), dst(per_request_);
  for (uint64_t j = 0; j < per_request_; j++) dst[j] = slot * per_request_ + j, src[j] = first_ + dst[j];
  kvx_transfer_options opts;
  kvx_transfer_options_init(&opts);
  opts.on_complete = on_complete, opts.user_data = this;
  in_flight_.push_back(e_.submit(device_, src, file_, dst, &opts));
}

double Background::alone_rate(unsigned depth, double seconds) {
  const size_t d = std::min<uint64_t>(depth, slots_);
  auto t0 = Clock::now();
  uint64_t c0 = 0;
  bool counting = false;
  for (;;) {
    double t = seconds_since(t0);
    if (!counting && t >= seconds / 4) counting = true, c0 = completed(), t0 = Clock::now(), t = 0;
    if (counting && t >= seconds) break;
    retire(d);
    submit_next();
  }
  const double rate = (completed() - c0) / seconds_since(t0);
  drain();
  return rate;
}

void Background::pace(double rate) {
  const auto start = Clock::now();
  const std::chrono::duration<double> interval(1.0 / rate);
  for (uint64_t k = 0; !stopping_.load(); k++) {
    const auto due = start + std::chrono::duration_cast<Clock::duration>(interval * (double)k);
    std::this_thread::sleep_until(due);
    if (stopping_.load()) break;
    // At the ring's limit the oldest request is waited for: the schedule slips, which
    // the lag and the achieved rate then show.
    retire(slots_);
    lag_us_.push_back(std::chrono::duration<double, std::micro>(Clock::now() - due).count());
    submit_next();
  }
}

void Background::start(double rate) {
  stop();
  lag_us_.clear();
  stopping_ = false;
  pacer_ = std::thread([this, rate] {
    try {
      pace(rate);
    } catch (const kvx::Error &err) {  // a refused submit: counted, and the background stops
      std::fprintf(stderr, "bench: background offload: %s\n", err.what());
      failed_.fetch_add(1);
    }
  });
}

void Background::stop() {
  stopping_ = true;
  if (pacer_.joinable()) pacer_.join();
  drain();
}

// One level of one size: its onboards' latencies, and what the background did meanwhile.
struct Level {
  double share = 0;  // 0: alone
  bool critical = false;  // the onboards were KVX_XFER_CRITICAL
  std::vector<double> us;
  double window_s = 0;
  uint64_t completed = 0;
  std::vector<double> lag_us;
};

// Onboards from the hot file, one at a time, cycling through `ids`: after the warm-up,
// `count` of them and as many more as fill `min_window_s`. Their latencies, and the wall
// time and background completions over them. `critical`: marked KVX_XFER_CRITICAL.
Level onboard(kvx::Engine &e, const kvx::Layout &hot, const kvx::Layout &device, const std::vector<std::vector<uint64_t>> &ids,
              size_t count, double min_window_s, const Background &bg, bool critical) {
  Level l;
  l.critical = critical;
  kvx_transfer_options opts;
  kvx_transfer_options_init(&opts);
  opts.flags = critical ? KVX_XFER_CRITICAL : 0;
  Clock::time_point t0;
  uint64_t c0 = 0;
  for (size_t i = 0;; i++) {
    if (i == WARMUP_ONBOARDS) t0 = Clock::now(), c0 = bg.completed();
    if (i >= WARMUP_ONBOARDS + count && seconds_since(t0) >= min_window_s) break;
    const auto &v = ids[i % ids.size()];
    auto s = Clock::now();
    e.submit(hot, v, device, v, &opts).wait();
    if (i >= WARMUP_ONBOARDS) l.us.push_back(us_since(s));
  }
  l.window_s = seconds_since(t0);
  l.completed = bg.completed() - c0;
  return l;
}

class MixRun {
 public:
  explicit MixRun(const Options &o) : o_(o), ec_(engine_config(o)), e_(&ec_), dev_(e_.device()) {
    kvx_layout_config lc = layout_configs(o).first;
    lc.num_blocks = 2 * o.num_blocks;
    device_ = e_.create_device_layout(lc);
    block_bytes_ = device_.block_bytes();
    kvx_layout_config fc = lc;
    fc.kind = KVX_LAYOUT_FULLY_CONTIGUOUS;
    fc.num_blocks = o.num_blocks;
    // Created without KVX_DISK_KEEP: each file goes when its layout and requests are gone.
    const std::string stem = o.dir + "/kvx-bench-" + std::to_string(::getpid());
    const uint32_t checksum = o.checksum ? KVX_DISK_CHECKSUM : 0;
    hot_ = e_.create_disk_layout(fc, stem + ".hot.kv", KVX_DISK_CREATE | KVX_DISK_BUFFERED | checksum);
    background_file_ = e_.create_disk_layout(fc, stem + ".background.kv", KVX_DISK_CREATE | (o.buffered ? KVX_DISK_BUFFERED : 0) | checksum);
  }

  int run();

 private:
  // Whether the background of level `l` moved at least KEPT of its target over the window.
  bool kept(const Level &l) const { return l.share == 0 || l.completed / l.window_s >= KEPT * l.share * alone_rps_; }
  void print_row(uint64_t size, const Level &l, const Level &alone) const;

  const Options &o_;
  const kvx_engine_config ec_;
  kvx::Engine e_;
  const int32_t dev_;
  kvx::Layout device_{nullptr}, hot_{nullptr}, background_file_{nullptr};
  uint64_t block_bytes_ = 0;
  double alone_rps_ = 0;
};

void MixRun::print_row(uint64_t size, const Level &l, const Level &alone) const {
  const auto p = percentiles_us(l.us);
  const double alone_p99 = percentile(alone.us, 0.99), request_bytes = (double)o_.blocks_per_batch * block_bytes_;
  const double target = l.share * alone_rps_ * request_bytes / 1e9, achieved = l.completed / l.window_s * request_bytes / 1e9;
  char background[200] = "none";
  if (l.share > 0)
    std::snprintf(background, sizeof background, "%3.0f%%: %.2f of %.2f GB/s (%.1f%%) %s; issue lag p99 %.0f us, max %.0f us", 100 * l.share,
                  achieved, target, 100 * achieved / target, kept(l) ? "kept" : "MISSED", percentile(l.lag_us, 0.99),
                  percentile(l.lag_us, 1.0));
  std::printf("  %7llu %-8s %9zu %9.1f %9.1f %9.1f %9.2f %8.2fx  %s\n", (unsigned long long)size, l.critical ? "critical" : "fifo",
              l.us.size(), p.p50, p.p99, p.p999, size * block_bytes_ / p.p50 / 1e3, p.p99 / alone_p99, background);
  if (o_.json)
    std::printf("{\"mode\": \"mix\", \"onboard_blocks\": %llu, \"critical\": %s, \"block_bytes\": %llu, \"onboards\": %zu, "
                "\"background_share\": %.3f, "
                "\"p50_us\": %.2f, \"p99_us\": %.2f, \"p999_us\": %.2f, \"p99_vs_alone\": %.3f, \"background_blocks\": %llu, "
                "\"background_depth\": %u, \"background_alone_gbps\": %.3f, \"background_target_gbps\": %.3f, "
                "\"background_gbps\": %.3f, \"background_kept\": %s, \"background_lag_p99_us\": %.2f, \"buffered\": %s, "
                "\"io_backend\": \"%s\"}\n",
                (unsigned long long)size, l.critical ? "true" : "false", (unsigned long long)block_bytes_, l.us.size(), l.share, p.p50,
                p.p99, p.p999,
                p.p99 / alone_p99, (unsigned long long)o_.blocks_per_batch, o_.background_depth, alone_rps_ * request_bytes / 1e9,
                target, l.share > 0 ? achieved : 0.0, kept(l) ? "true" : "false", percentile(l.lag_us, 0.99),
                o_.buffered ? "true" : "false", io_backend_name(e_.io_backend()));
  std::fflush(stdout);
}

int MixRun::run() {
  // The hot file holds every block and sits in the page cache.
  std::vector<uint64_t> all(o_.num_blocks);
  for (uint64_t b = 0; b < o_.num_blocks; b++) all[b] = b;
  e_.submit(device_, all, hot_, all).wait();

  Background bg(e_, device_, background_file_, o_.num_blocks, o_.num_blocks, o_.blocks_per_batch);
  const unsigned depth = (unsigned)std::min<uint64_t>(o_.background_depth, bg.slots());
  std::printf("%s\n", kvx_version_string());
  std::printf("mix: device %s, %.2f MB blocks; onboards one at a time from a hot buffered file of %llu blocks, %zu of each size "
              "(after %zu not counted), and as many more as fill %.1f s; background offloads of %llu block(s) to a file (%s), disk I/O by %s\n",
              dev_ < 0 ? "emulated" : std::to_string(dev_).c_str(), block_bytes_ / 1e6, (unsigned long long)o_.num_blocks, o_.onboards,
              WARMUP_ONBOARDS, MIN_WINDOW_SECONDS, (unsigned long long)o_.blocks_per_batch, o_.buffered ? "buffered" : "O_DIRECT",
              io_backend_name(e_.io_backend()));
  alone_rps_ = bg.alone_rate(depth, ALONE_SECONDS);
  if (!(alone_rps_ > 0)) {
    std::fprintf(stderr, "bench: no background offload completed in %.1f s alone; nothing to pace\n", ALONE_SECONDS);
    return 1;
  }
  const double request_bytes = (double)o_.blocks_per_batch * block_bytes_;
  std::printf("background alone: %u request(s) in flight back to back, %.0f requests/s = %.2f GB/s over %.1f s\n", depth, alone_rps_,
              alone_rps_ * request_bytes / 1e9, ALONE_SECONDS);
  std::printf("  %7s %-8s %9s %9s %9s %9s %9s %9s  %s\n", "blocks", "onboard", "onboards", "p50 us", "p99 us", "p99.9 us", "GB/s p50",
              "p99/alone", "background: share of its alone rate, achieved of target");

  // fifo: onboards served in arrival order with the offloads; critical: KVX_XFER_CRITICAL.
  std::vector<bool> classes{false};
  if (o_.critical) classes.push_back(true);
  bool all_kept = true;
  for (uint64_t size : o_.onboard_sizes) {
    const auto ids = request_ids(o_.num_blocks, size, WARMUP_ONBOARDS + o_.onboards, true);
    std::vector<Level> alone;
    for (bool critical : classes) {
      alone.push_back(onboard(e_, hot_, device_, ids, o_.onboards, MIN_WINDOW_SECONDS, bg, critical));
      print_row(size, alone.back(), alone.back());
    }
    for (double share : o_.background_shares) {
      for (size_t c = 0; c < classes.size(); c++) {
        bg.start(share * alone_rps_);
        std::this_thread::sleep_for(std::chrono::duration<double>(RAMP_SECONDS));
        Level l = onboard(e_, hot_, device_, ids, o_.onboards, MIN_WINDOW_SECONDS, bg, classes[c]);
        bg.stop();
        l.share = share;
        l.lag_us = bg.lag_us();
        all_kept &= kept(l);
        print_row(size, l, alone[c]);
      }
    }
  }
  std::printf("p99/alone: the onboards' p99 beside the background over their p99 alone (of the same kind: fifo or critical), same "
              "blocks, same process; a background keeps its rate at %.0f%% of its target or more\n",
              100 * KEPT);
  if (!all_kept)
    std::printf("a background MISSED its rate (its lines above): beside the onboards it did not move what it was offered\n");
  if (bg.failed()) {
    std::fprintf(stderr, "bench: %llu background offload(s) failed\n", (unsigned long long)bg.failed());
    return 1;
  }
  return 0;
}

}  // namespace

int run_mix(const Options &o) {
  const uint64_t largest = *std::max_element(o.onboard_sizes.begin(), o.onboard_sizes.end());
  if (largest > o.num_blocks || o.blocks_per_batch > o.num_blocks) {
    std::fprintf(stderr, "bench: --mix needs --num-blocks >= the largest of --onboard-sizes (%llu) and --blocks-per-batch (%llu)\n",
                 (unsigned long long)largest, (unsigned long long)o.blocks_per_batch);
    return 2;
  }
  MixRun r(o);
  return r.run();
}

}  // namespace bench
