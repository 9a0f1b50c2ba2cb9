// --mix (bench_mix.h). The device layout holds 2 × --num-blocks blocks: onboards fill the
// first half (block b of the hot file into device block b), the background offloads the
// second half (device block --num-blocks + i into block i of the background file), so the
// two never touch the same memory. The background is open-loop: a pacing thread issues
// request k when it is due, k / rate after the start, whether or not earlier ones have
// completed, so an engine that slows the background shows as a background below its
// rate, not as fewer requests offered. With --background-threads it is also closed-loop
// (ClosedLoop): threads that each offload back to back, as a saturated runtime does, and
// the onboards then alternate plain and critical, so both meet the same background. With
// --store the same closed-loop levels run on the store: the onboards are gets of keys put
// (and leased, so never evicted) before, the background puts new keys. Alone, each size's onboards also stand beside
// their limit without kvxfer (RawOnboard: the same blocks of the same file read and
// copied by threads of the bench's own) and beside the same onboards from a second hot
// file mapped with KVX_DISK_MAPPED.
#include "bench_mix.h"

#include <fcntl.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <functional>
#include <iterator>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace bench {

namespace {

// The share of its target rate a background must reach to have kept it.
constexpr double KEPT = 0.95;
// A closed-loop level: the p99 over alone a critical onboard is to stay within, and the
// share of its GB/s alone the background is to keep.
constexpr double CLOSED_P99_TARGET = 1.5;
constexpr double CLOSED_KEPT = 0.25;
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
// The onboard limit's sweep: thread counts (each up to a request's pieces), the I/O size
// tried beside whole blocks, and the counted requests of each setting; the best setting
// (by p50) is then timed over as many requests as kvxfer's onboards alone.
constexpr unsigned LIMIT_THREADS[] = {1, 2, 4, 8, 16};
constexpr uint64_t LIMIT_PIECE_BYTES = 512 << 10;
constexpr size_t LIMIT_TRIAL_ONBOARDS = 20;
// The share of its limit a lone onboard is to reach: the limit's p50 over the onboards'.
constexpr double LIMIT_TARGET = 0.9;
// Pinned buffers per thread of the limit: a read fills one while the other's copy runs.
constexpr unsigned LIMIT_BUFFERS = 2;

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

  // Submits the offload of ring slot `slot` (< slots()); its failure is counted.
  kvx::Request submit(uint64_t slot);

  uint64_t completed() const { return completed_.load(std::memory_order_acquire); }
  uint64_t failed() const { return failed_.load(); }
  uint64_t slots() const { return slots_; }
  uint64_t per_request() const { return per_request_; }
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

void Background::submit_next() { in_flight_.push_back(submit(next_++ % slots_)); }

kvx::Request Background::submit(uint64_t slot) {
  std::vector<uint64_t> src(per_request_), dst(per_request_);
  for (uint64_t j = 0; j < per_request_; j++) dst[j] = slot * per_request_ + j, src[j] = first_ + dst[j];
  kvx_transfer_options opts;
  kvx_transfer_options_init(&opts);
  opts.on_complete = on_complete, opts.user_data = this;
  return e_.submit(device_, src, file_, dst, &opts);
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

// One onboard of blocks `ids` (the same ids in its source and in the device layout) with
// `opts`, waited for; a failure throws.
using OnboardFn = std::function<void(const std::vector<uint64_t> &ids, const kvx_transfer_options &opts)>;

// Onboards one at a time by `run`, cycling through `ids`, the i-th marked
// KVX_XFER_CRITICAL where kinds[i % kinds.size()] is: after the warm-up, `count` of each
// kind and as many more as fill `min_window_s`. One Level per entry of `kinds`: its
// latencies, and the wall time and background completions (`completed`) over them all.
std::vector<Level> onboards(const OnboardFn &run, const std::vector<std::vector<uint64_t>> &ids, size_t count, double min_window_s,
                            const std::function<uint64_t()> &completed, const std::vector<bool> &kinds) {
  std::vector<Level> levels(kinds.size());
  std::vector<kvx_transfer_options> opts(kinds.size());
  for (size_t k = 0; k < kinds.size(); k++) {
    levels[k].critical = kinds[k];
    kvx_transfer_options_init(&opts[k]);
    opts[k].flags = kinds[k] ? KVX_XFER_CRITICAL : 0;
  }
  Clock::time_point t0;
  uint64_t c0 = 0;
  for (size_t i = 0;; i++) {
    if (i == WARMUP_ONBOARDS) t0 = Clock::now(), c0 = completed();
    if (i >= WARMUP_ONBOARDS + count * kinds.size() && seconds_since(t0) >= min_window_s) break;
    const auto &v = ids[i % ids.size()];
    const size_t k = i % kinds.size();
    auto s = Clock::now();
    run(v, opts[k]);
    if (i >= WARMUP_ONBOARDS) levels[k].us.push_back(us_since(s));
  }
  for (Level &l : levels) l.window_s = seconds_since(t0), l.completed = completed() - c0;
  return levels;
}

// Onboards from the disk layout `hot`, all of one kind (`critical`: KVX_XFER_CRITICAL),
// beside the open-loop background `bg` (onboards()).
Level onboard(kvx::Engine &e, const kvx::Layout &hot, const kvx::Layout &device, const std::vector<std::vector<uint64_t>> &ids,
              size_t count, double min_window_s, const Background &bg, bool critical) {
  const OnboardFn run = [&](const std::vector<uint64_t> &v, const kvx_transfer_options &opts) { e.submit(hot, v, device, v, &opts).wait(); };
  return onboards(run, ids, count, min_window_s, [&] { return bg.completed(); }, {critical})[0];
}

// A closed-loop background: threads that each run `offload` back to back, each call
// waiting for its request before the next, until stop(). Thread t of n offloads ring
// slots t, t + n, t + 2n, ... (`slots` of them in all), so no two requests in flight
// write the same blocks.
class ClosedLoop {
 public:
  using OffloadFn = std::function<void(uint64_t slot)>;
  ClosedLoop(uint64_t slots, OffloadFn offload) : slots_(slots), offload_(std::move(offload)) {}
  ~ClosedLoop() { stop(); }
  ClosedLoop(const ClosedLoop &) = delete;
  ClosedLoop &operator=(const ClosedLoop &) = delete;

  // Starts `threads` (at most slots) offloading.
  void start(unsigned threads);
  // Stops the threads after their request in flight.
  void stop();
  // Requests completed per second with `threads` alone, over `seconds` after a warm-up.
  double alone_rate(unsigned threads, double seconds);

  uint64_t completed() const { return completed_.load(std::memory_order_acquire); }
  uint64_t failed() const { return failed_.load(); }

 private:
  const uint64_t slots_;
  const OffloadFn offload_;
  std::vector<std::thread> threads_;
  std::atomic<bool> stopping_{false};
  std::atomic<uint64_t> completed_{0}, failed_{0};
};

void ClosedLoop::start(unsigned threads) {
  stop();
  stopping_ = false;
  const uint64_t per_thread = slots_ / threads;
  for (unsigned t = 0; t < threads; t++)
    threads_.emplace_back([this, t, threads, per_thread] {
      try {
        for (uint64_t k = 0; !stopping_.load(); k++) {
          offload_(t + threads * (k % per_thread));
          completed_.fetch_add(1, std::memory_order_release);
        }
      } catch (const kvx::Error &err) {  // counted, and this thread stops
        std::fprintf(stderr, "bench: closed-loop offload: %s\n", err.what());
        failed_.fetch_add(1);
      }
    });
}

void ClosedLoop::stop() {
  stopping_ = true;
  for (auto &t : threads_) t.join();
  threads_.clear();
}

double ClosedLoop::alone_rate(unsigned threads, double seconds) {
  start(threads);
  std::this_thread::sleep_for(std::chrono::duration<double>(seconds / 4));
  const uint64_t c0 = completed();
  const auto t0 = Clock::now();
  std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
  const double rate = (completed() - c0) / seconds_since(t0);
  stop();
  return rate;
}

// A CUDA call of the onboard limit that must succeed: on failure the bench says which and exits.
void cu_check(int r, const char *what) {
  if (r) {
    std::fprintf(stderr, "bench: onboard limit: %s failed (CUresult %d)\n", what, r);
    std::exit(1);
  }
}

// The limit for a lone onboard without kvxfer: the same blocks of the same hot file read
// with pread by threads of the bench's own into pinned buffers, each read followed by its
// copy to the device on the thread's own stream. A thread has LIMIT_BUFFERS buffers and
// waits for a buffer's last copy only when it comes round again, so its reads run while
// its copies do. The bytes land contiguous in a device scratch. kvxfer additionally
// scatters them into the device layout, but that is done on the device and is cheap
// beside the reads and the link: this is the hardware's limit for moving the same bytes.
class RawOnboard {
 public:
  struct Setting {
    unsigned threads;
    uint64_t io;  // bytes per pread and per copy: a whole block or a piece of it
  };

  // Opens `path` (blocks `stride` apart) and allocates, on `cuda`'s current context, a
  // stream, events and pinned buffers for each of up to the largest of LIMIT_THREADS and
  // a scratch for `max_blocks` blocks.
  RawOnboard(const cuda_raw::Api &cuda, const std::string &path, uint64_t stride, uint64_t block_bytes, uint64_t max_blocks);
  ~RawOnboard();
  RawOnboard(const RawOnboard &) = delete;
  RawOnboard &operator=(const RawOnboard &) = delete;

  // The setting of the sweep with the lowest p50 over LIMIT_TRIAL_ONBOARDS requests.
  Setting best(const std::vector<std::vector<uint64_t>> &ids);
  // Latencies of requests cycling through `ids`, timed like the kvxfer onboards: from
  // the start of a request until every thread's last copy is synchronised; the first
  // WARMUP_ONBOARDS not counted (they also absorb the threads' start), then `count`.
  std::vector<double> time(const std::vector<std::vector<uint64_t>> &ids, size_t count, Setting s);

 private:
  struct Piece {
    uint64_t file_offset, scratch_offset, bytes;
  };
  // One thread's stream, buffers and the events that say each buffer's copy is done.
  struct Lane {
    cuda_raw::CUstream stream = nullptr;
    void *buf[LIMIT_BUFFERS] = {};
    cuda_raw::CUevent copied[LIMIT_BUFFERS] = {};
  };
  // A request's blocks as pieces of `io` bytes, in the order they land in the scratch.
  void plan(const std::vector<uint64_t> &blocks, uint64_t io);
  // A thread of time(): takes the next piece of each request until none is left.
  void work(Lane &lane);

  const cuda_raw::Api &cuda_;
  const int fd_;
  const uint64_t stride_, block_bytes_;
  cuda_raw::CUdeviceptr scratch_ = 0;
  std::vector<Lane> lanes_;
  std::vector<Piece> pieces_;
  // The main thread bumps `generation_` to start a request (pieces_ written before);
  // the threads take pieces by `next_` and count themselves `done_`.
  std::atomic<uint64_t> generation_{0};
  std::atomic<size_t> next_{0};
  std::atomic<unsigned> done_{0};
  std::atomic<bool> stopping_{false};
};

RawOnboard::RawOnboard(const cuda_raw::Api &cuda, const std::string &path, uint64_t stride, uint64_t block_bytes, uint64_t max_blocks)
    : cuda_(cuda), fd_(::open(path.c_str(), O_RDONLY)), stride_(stride), block_bytes_(block_bytes),
      lanes_(*std::max_element(std::begin(LIMIT_THREADS), std::end(LIMIT_THREADS))) {
  if (fd_ < 0) {
    std::perror("bench: onboard limit: open the hot file");
    std::exit(1);
  }
  cu_check(cuda_.cuMemAlloc_v2(&scratch_, max_blocks * block_bytes_), "cuMemAlloc (scratch)");
  for (Lane &l : lanes_) {
    cu_check(cuda_.cuStreamCreate(&l.stream, 1), "cuStreamCreate");
    for (unsigned b = 0; b < LIMIT_BUFFERS; b++) {
      cu_check(cuda_.cuMemHostAlloc(&l.buf[b], block_bytes_, 0), "cuMemHostAlloc");
      cu_check(cuda_.cuEventCreate(&l.copied[b], 2 /* CU_EVENT_DISABLE_TIMING */), "cuEventCreate");
    }
  }
}

RawOnboard::~RawOnboard() {
  for (Lane &l : lanes_) {
    for (unsigned b = 0; b < LIMIT_BUFFERS; b++) cuda_.cuEventDestroy_v2(l.copied[b]), cuda_.cuMemFreeHost(l.buf[b]);
    cuda_.cuStreamDestroy_v2(l.stream);
  }
  cuda_.cuMemFree_v2(scratch_);
  ::close(fd_);
}

void RawOnboard::plan(const std::vector<uint64_t> &blocks, uint64_t io) {
  pieces_.clear();
  for (size_t j = 0; j < blocks.size(); j++)
    for (uint64_t at = 0; at < block_bytes_; at += io)
      pieces_.push_back({blocks[j] * stride_ + at, j * block_bytes_ + at, std::min(io, block_bytes_ - at)});
}

void RawOnboard::work(Lane &lane) {
  cu_check(cuda_.cuCtxSetCurrent(cuda_.ctx), "cuCtxSetCurrent");
  for (uint64_t seen = 0;;) {
    uint64_t g;
    // Spinning, not sleeping: a request is not charged the wake-up of a parked thread.
    while ((g = generation_.load(std::memory_order_acquire)) == seen && !stopping_.load()) std::this_thread::yield();
    if (g == seen) return;
    seen = g;
    for (size_t k = 0;; k++) {
      const size_t i = next_.fetch_add(1);
      if (i >= pieces_.size()) break;
      const Piece &p = pieces_[i];
      const unsigned b = k % LIMIT_BUFFERS;
      if (k >= LIMIT_BUFFERS) cu_check(cuda_.cuEventSynchronize(lane.copied[b]), "cuEventSynchronize");
      if (::pread(fd_, lane.buf[b], p.bytes, (off_t)p.file_offset) != (ssize_t)p.bytes) {
        std::perror("bench: onboard limit: pread of the hot file");
        std::exit(1);
      }
      cu_check(cuda_.cuMemcpyHtoDAsync_v2(scratch_ + p.scratch_offset, lane.buf[b], p.bytes, lane.stream), "cuMemcpyHtoDAsync");
      cu_check(cuda_.cuEventRecord(lane.copied[b], lane.stream), "cuEventRecord");
    }
    cu_check(cuda_.cuStreamSynchronize(lane.stream), "cuStreamSynchronize");
    done_.fetch_add(1, std::memory_order_acq_rel);
  }
}

std::vector<double> RawOnboard::time(const std::vector<std::vector<uint64_t>> &ids, size_t count, Setting s) {
  generation_ = 0;  // no thread runs yet: each starts having seen generation 0
  std::vector<std::thread> threads;
  for (unsigned t = 0; t < s.threads; t++) threads.emplace_back([this, t] { work(lanes_[t]); });
  std::vector<double> us;
  for (size_t i = 0; i < WARMUP_ONBOARDS + count; i++) {
    const auto t0 = Clock::now();
    plan(ids[i % ids.size()], s.io);
    next_ = 0, done_ = 0;
    generation_.fetch_add(1, std::memory_order_release);
    while (done_.load(std::memory_order_acquire) < s.threads) std::this_thread::yield();
    if (i >= WARMUP_ONBOARDS) us.push_back(us_since(t0));
  }
  stopping_ = true;
  for (auto &t : threads) t.join();
  stopping_ = false;
  return us;
}

RawOnboard::Setting RawOnboard::best(const std::vector<std::vector<uint64_t>> &ids) {
  Setting b{1, block_bytes_};
  double best_p50 = 1e300;
  std::vector<uint64_t> ios{block_bytes_};
  if (LIMIT_PIECE_BYTES < block_bytes_) ios.push_back(LIMIT_PIECE_BYTES);
  for (uint64_t io : ios) {
    const uint64_t pieces = ids[0].size() * ((block_bytes_ + io - 1) / io);
    for (unsigned t : LIMIT_THREADS) {
      if (t > pieces) break;  // a thread with no piece to take
      const double p50 = percentile(time(ids, LIMIT_TRIAL_ONBOARDS, {t, io}), 0.5);
      if (p50 < best_p50) best_p50 = p50, b = {t, io};
    }
  }
  return b;
}

// --stages: the engine's stage records (KVX_STAGE_TIMES; src/engine/stages.rs), logged at
// debug level on STAGE_TARGET, caught by the bench's log callback. Only the onboards'
// (disk to device) are kept; every other record at warn or worse goes to stderr, as
// kvxfer's own logger would have.
constexpr const char *STAGE_TARGET = "kvxfer::engine::stages";
// A record's stages, in its order: microseconds since the submit, NaN where never reached;
// then the bench's own, `woken`: when the onboard's wait returned (its latency), where
// the record could be matched to its onboard.
constexpr const char *STAGE_NAMES[] = {"slot", "io_queued", "io_start", "io_done", "copy_issued", "copy_done", "last_io_done",
                                       "last_copy_done", "completed", "woken"};
constexpr size_t STAGES = sizeof STAGE_NAMES / sizeof *STAGE_NAMES - 1;
constexpr size_t WOKEN = STAGES;
// The gaps printed, in an onboard's order (-1: the submit): from stage a to stage b.
constexpr std::pair<int, int> STAGE_GAPS[] = {{-1, 0}, {0, 1}, {1, 2}, {2, 3}, {3, 4}, {4, 5}, {5, 8}, {8, WOKEN}};
// Printed as their time since the submit.
constexpr int STAGE_SINCE_SUBMIT[] = {6, 7, 8};

struct StageRecord {
  bool critical;
  std::array<double, STAGES + 1> us;
};

class StageLog {
 public:
  // Turns the engine's stage times on (before any engine exists: read once) and catches them.
  void install() {
    ::setenv("KVX_STAGE_TIMES", "1", 1);
    if (kvx_set_logger(&StageLog::on_log, this, 4) != KVX_OK) {
      std::fprintf(stderr, "bench: --stages: kvx_set_logger refused\n");
      std::exit(1);
    }
  }
  ~StageLog() { kvx_set_logger(nullptr, nullptr, 2); }
  // The records since the last take.
  std::vector<StageRecord> take() {
    std::vector<std::string> lines;
    {
      std::lock_guard<std::mutex> g(mu_);
      lines.swap(lines_);
    }
    std::vector<StageRecord> out;
    for (const std::string &l : lines) {
      std::istringstream in(l);
      std::string cls, dir, blocks, field;
      in >> cls >> dir >> blocks;
      StageRecord r{cls == "critical", {}};
      r.us[WOKEN] = NAN;
      for (size_t i = 0; i < STAGES && in >> field; i++) {
        const size_t eq = field.find('=');
        const std::string v = eq == std::string::npos ? "-" : field.substr(eq + 1);
        r.us[i] = v == "-" ? NAN : std::strtod(v.c_str(), nullptr);
      }
      out.push_back(r);
    }
    return out;
  }

 private:
  static void on_log(void *user, uint32_t level, const char *target, const char *message) {
    auto *self = static_cast<StageLog *>(user);
    if (std::strcmp(target, STAGE_TARGET) == 0) {
      if (std::strstr(message, " disk->device ")) {
        std::lock_guard<std::mutex> g(self->mu_);
        self->lines_.emplace_back(message);
      }
    } else if (level <= 2) {
      std::fprintf(stderr, "kvxfer %s: %s\n", target, message);
    }
  }
  std::mutex mu_;
  std::vector<std::string> lines_;
};

class MixRun {
 public:
  // `stages`: where --stages' records come (installed before the engine starts), or null.
  MixRun(const Options &o, StageLog *stages)
      : o_(o), stages_(stages), ec_(engine_config(o)), e_(&ec_), dev_(e_.device()), lc_(layout_configs(o).first) {
    kvx_layout_config lc = lc_;
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
    if (o.store) {
      open_store(stem + ".store");
      return;
    }
    // The mapped file is a reference beside the run, not its subject: where it cannot be
    // made (not on tmpfs, or with --checksum) its row says why and the run goes on.
    try {
      mapped_ = e_.create_disk_layout(fc, stem + ".mapped.kv", KVX_DISK_CREATE | KVX_DISK_MAPPED | checksum);
    } catch (const kvx::Error &err) {
      mapped_why_ = err.what();
    }
    open_limit(stem + ".hot.kv");
  }

  ~MixRun() {
    store_.reset();
    std::error_code ec;
    if (!store_dir_.empty()) std::filesystem::remove_all(store_dir_, ec);
  }
  MixRun(const MixRun &) = delete;
  MixRun &operator=(const MixRun &) = delete;

  int run();

 private:
  // --store: makes the store (capacity 2 × --num-blocks), puts the device layout's first
  // half under generation 0's keys and leases them, so the background's puts never evict
  // what the onboards get.
  void open_store(const std::string &dir);
  // One onboard of the foreground: from the hot file, or (--store) a get of the keys.
  OnboardFn foreground();
  // The closed-loop levels of onboards of `size`: alone, then beside each of
  // --background-threads, the onboards alternating fifo and critical.
  void closed_levels(uint64_t size, const std::vector<std::vector<uint64_t>> &ids, ClosedLoop &bg);
  void print_closed_row(uint64_t size, unsigned threads, const Level &l, const Level &alone, double alone_rps) const;
  // --stages: p50/p99 of each gap between the stages of the onboards in `records`, plain
  // and critical apart.
  void print_stages(uint64_t size, unsigned threads, const std::vector<StageRecord> &records) const;
  // Whether the background of level `l` moved at least KEPT of its target over the window.
  bool kept(const Level &l) const { return l.share == 0 || l.completed / l.window_s >= KEPT * l.share * alone_rps_; }
  void print_row(uint64_t size, const Level &l, const Level &alone) const;
  // The onboard limit on the hot file at `path`, or (on the emulated device, or without
  // the driver) why there is none.
  void open_limit(const std::string &path);
  // Beside the onboards of `size` alone (`alone`: one Level per class, fifo first): the
  // same onboards from the mapped file and their limit, each a row, and what share of
  // the limit each reaches.
  void references(uint64_t size, const std::vector<std::vector<uint64_t>> &ids, const std::vector<Level> &alone, const Background &bg);
  void print_reference(uint64_t size, const char *name, const std::vector<double> &us, const std::string &what) const;

  const Options &o_;
  StageLog *const stages_;
  const kvx_engine_config ec_;
  kvx::Engine e_;
  const int32_t dev_;
  const kvx_layout_config lc_;
  kvx::Layout device_{nullptr}, hot_{nullptr}, background_file_{nullptr}, mapped_{nullptr};
  // After the engine and the layouts, so it is closed first.
  std::unique_ptr<kvx::Store> store_;
  std::string store_dir_;
  // Requests per second of each closed-loop level alone (--background-threads' order).
  std::vector<double> closed_alone_rps_;
  uint64_t block_bytes_ = 0;
  double alone_rps_ = 0;
  std::string mapped_why_, limit_why_;
  cuda_raw::Api cuda_;
  std::unique_ptr<RawOnboard> limit_;
};

void MixRun::print_row(uint64_t size, const Level &l, const Level &alone) const {
  const auto p = percentiles_us(l.us);
  const double alone_p99 = percentile(alone.us, 0.99), request_bytes = (double)o_.background_blocks * block_bytes_;
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
                p.p99 / alone_p99, (unsigned long long)o_.background_blocks, o_.background_depth, alone_rps_ * request_bytes / 1e9,
                target, l.share > 0 ? achieved : 0.0, kept(l) ? "true" : "false", percentile(l.lag_us, 0.99),
                o_.buffered ? "true" : "false", io_backend_name(e_.io_backend()));
  std::fflush(stdout);
}

void MixRun::open_limit(const std::string &path) {
  if (dev_ < 0) {
    limit_why_ = "the emulated device has no DMA to measure";
    return;
  }
  if (!cuda_.open(dev_)) {
    limit_why_ = "cannot load the CUDA driver";
    return;
  }
  struct stat st {};
  ::stat(path.c_str(), &st);
  const uint64_t largest = *std::max_element(o_.onboard_sizes.begin(), o_.onboard_sizes.end());
  limit_ = std::make_unique<RawOnboard>(cuda_, path, (uint64_t)st.st_size / o_.num_blocks, block_bytes_, largest);
}

void MixRun::print_reference(uint64_t size, const char *name, const std::vector<double> &us, const std::string &what) const {
  const auto p = percentiles_us(us);
  std::printf("  %7llu %-8s %9zu %9.1f %9.1f %9.1f %9.2f %9s  %s\n", (unsigned long long)size, name, us.size(), p.p50, p.p99, p.p999,
              size * block_bytes_ / p.p50 / 1e3, "-", what.c_str());
}

// A JSON number with `decimals` digits after the point, or null where it was not measured.
std::string json_number(bool measured, double x, int decimals = 3) {
  if (!measured) return "null";
  char text[32];
  std::snprintf(text, sizeof text, "%.*f", decimals, x);
  return text;
}

// ", name 0.93": the limit's p50 over that of `us`, where both were measured.
std::string of_limit(const char *name, double raw_p50, const std::vector<double> &us) {
  if (us.empty()) return "";
  char text[48];
  std::snprintf(text, sizeof text, ", %s %.2f", name, raw_p50 / percentile(us, 0.5));
  return text;
}

void MixRun::references(uint64_t size, const std::vector<std::vector<uint64_t>> &ids, const std::vector<Level> &alone,
                        const Background &bg) {
  std::vector<double> mapped, raw;
  if (mapped_) {
    mapped = onboard(e_, mapped_, device_, ids, o_.onboards, MIN_WINDOW_SECONDS, bg, false).us;
    print_reference(size, "mapped", mapped, "none; the same onboards from a KVX_DISK_MAPPED copy of the file");
  } else {
    std::printf("  %7llu %-8s skipped: %s\n", (unsigned long long)size, "mapped", mapped_why_.c_str());
  }
  RawOnboard::Setting s{};
  if (limit_) {
    s = limit_->best(ids);
    raw = limit_->time(ids, alone[0].us.size(), s);
    char what[160];
    std::snprintf(what, sizeof what, "none; the limit, no kvxfer: pread by %u thread(s), %.0f KiB at a time, each then a copy", s.threads,
                  s.io / 1024.0);
    print_reference(size, "raw", raw, what);
  } else {
    std::printf("  %7llu %-8s skipped: %s\n", (unsigned long long)size, "raw", limit_why_.c_str());
  }
  const std::vector<double> none, &critical = alone.size() > 1 ? alone[1].us : none;
  const double raw_p50 = percentile(raw, 0.5), p50 = percentile(alone[0].us, 0.5);
  if (!raw.empty())
    std::printf("  %7s %-8s raw p50 / p50 (target >= %.2f): fifo %.2f%s%s\n", "", "limit", LIMIT_TARGET, raw_p50 / p50,
                of_limit("critical", raw_p50, critical).c_str(), of_limit("mapped", raw_p50, mapped).c_str());
  if (o_.json) {
    const bool has_raw = !raw.empty(), has_mapped = !mapped.empty(), has_critical = !critical.empty();
    std::printf("{\"mode\": \"onboard_limit\", \"onboard_blocks\": %llu, \"block_bytes\": %llu, \"onboards\": %zu, \"p50_us\": %.2f, "
                "\"critical_p50_us\": %s, \"mapped_onboards\": %zu, \"mapped_p50_us\": %s, \"mapped_p99_us\": %s, "
                "\"mapped_p999_us\": %s, \"raw_onboards\": %zu, \"raw_threads\": %s, \"raw_io_bytes\": %s, \"raw_p50_us\": %s, "
                "\"raw_p99_us\": %s, \"raw_p999_us\": %s, \"of_limit\": %s, \"critical_of_limit\": %s, \"mapped_of_limit\": %s, "
                "\"target\": %.2f, \"io_backend\": \"%s\"}\n",
                (unsigned long long)size, (unsigned long long)block_bytes_, alone[0].us.size(), p50,
                json_number(has_critical, percentile(critical, 0.5)).c_str(), mapped.size(),
                json_number(has_mapped, percentile(mapped, 0.5)).c_str(), json_number(has_mapped, percentile(mapped, 0.99)).c_str(),
                json_number(has_mapped, percentile(mapped, 0.999)).c_str(), raw.size(), json_number(has_raw, s.threads, 0).c_str(), json_number(has_raw, (double)s.io, 0).c_str(),
                json_number(has_raw, raw_p50).c_str(), json_number(has_raw, percentile(raw, 0.99)).c_str(),
                json_number(has_raw, percentile(raw, 0.999)).c_str(), json_number(has_raw, raw_p50 / p50).c_str(),
                json_number(has_raw && has_critical, raw_p50 / percentile(critical, 0.5)).c_str(),
                json_number(has_raw && has_mapped, raw_p50 / percentile(mapped, 0.5)).c_str(), LIMIT_TARGET,
                io_backend_name(e_.io_backend()));
  }
  std::fflush(stdout);
}

void MixRun::open_store(const std::string &dir) {
  store_dir_ = dir;
  std::filesystem::remove_all(dir);
  kvx::store_config c;
  c.flags = KVX_STORE_CREATE | (o_.buffered ? KVX_STORE_BUFFERED : 0);
  c.block = &lc_;
  c.capacity_blocks = 2 * o_.num_blocks;
  c.shards = o_.shards;
  store_ = std::make_unique<kvx::Store>(e_, dir, c);
  std::vector<uint64_t> all(o_.num_blocks);
  std::vector<std::string> bytes;
  for (uint64_t b = 0; b < o_.num_blocks; b++) all[b] = b, bytes.push_back(key_of(0, b));
  const auto keys = kvx::keys_of(bytes);
  store_->put(device_, all, keys).wait();
  store_->lease(keys);  // held until the store closes
}

OnboardFn MixRun::foreground() {
  if (!store_)
    return [this](const std::vector<uint64_t> &v, const kvx_transfer_options &opts) { e_.submit(hot_, v, device_, v, &opts).wait(); };
  return [this](const std::vector<uint64_t> &v, const kvx_transfer_options &opts) {
    std::vector<std::string> bytes;
    bytes.reserve(v.size());
    for (uint64_t b : v) bytes.push_back(key_of(0, b));
    store_->get(kvx::keys_of(bytes), device_, v, &opts).wait();
  };
}

void MixRun::print_closed_row(uint64_t size, unsigned threads, const Level &l, const Level &alone, double alone_rps) const {
  const auto p = percentiles_us(l.us);
  const double alone_p99 = percentile(alone.us, 0.99), request_bytes = (double)o_.background_blocks * block_bytes_;
  const double alone_gbps = alone_rps * request_bytes / 1e9, gbps = threads ? l.completed / l.window_s * request_bytes / 1e9 : 0;
  const bool kept = threads == 0 || gbps >= CLOSED_KEPT * alone_gbps, met = !l.critical || p.p99 / alone_p99 <= CLOSED_P99_TARGET;
  char background[160] = "none";
  if (threads)
    std::snprintf(background, sizeof background, "%2u thread(s): %.2f of %.2f GB/s alone (%.0f%%) %s%s", threads, gbps, alone_gbps,
                  100 * gbps / alone_gbps, kept ? "kept" : "STARVED", met ? "" : "; p99 target MISSED");
  std::printf("  %7llu %-8s %9zu %9.1f %9.1f %9.1f %9.2f %8.2fx  %s\n", (unsigned long long)size, l.critical ? "critical" : "fifo",
              l.us.size(), p.p50, p.p99, p.p999, size * block_bytes_ / p.p50 / 1e3, p.p99 / alone_p99, background);
  if (o_.json)
    std::printf("{\"mode\": \"mix_closed\", \"store\": %s, \"onboard_blocks\": %llu, \"critical\": %s, \"block_bytes\": %llu, "
                "\"onboards\": %zu, \"background_threads\": %u, \"background_blocks\": %llu, \"p50_us\": %.2f, \"p99_us\": %.2f, "
                "\"p999_us\": %.2f, \"alone_p99_us\": %.2f, \"p99_vs_alone\": %.3f, \"p99_target\": %.2f, \"background_alone_gbps\": %.3f, "
                "\"background_gbps\": %.3f, \"background_of_alone\": %s, \"background_kept\": %s, \"buffered\": %s, \"io_backend\": \"%s\"}\n",
                store_ ? "true" : "false", (unsigned long long)size, l.critical ? "true" : "false", (unsigned long long)block_bytes_,
                l.us.size(), threads, (unsigned long long)o_.background_blocks, p.p50, p.p99, p.p999, alone_p99, p.p99 / alone_p99,
                CLOSED_P99_TARGET, alone_gbps, gbps, json_number(threads > 0, gbps / alone_gbps).c_str(), kept ? "true" : "false",
                o_.buffered ? "true" : "false", io_backend_name(e_.io_backend()));
  std::fflush(stdout);
}

void MixRun::closed_levels(uint64_t size, const std::vector<std::vector<uint64_t>> &ids, ClosedLoop &bg) {
  const OnboardFn run = foreground();
  const auto completed = [&] { return bg.completed(); };
  const std::vector<bool> both{false, true};
  // The onboards of one level, with their stage records where --stages asks for them.
  const auto level = [&](unsigned threads) {
    if (stages_) stages_->take();  // the records of what ran before
    auto levels = onboards(run, ids, o_.onboards, MIN_WINDOW_SECONDS, completed, both);
    if (stages_) {
      auto records = stages_->take();
      // One record per onboard, in their order (each completes before the next is
      // submitted; a store get may make more): onboard i is of kind i % 2, and after the
      // warm-up (an even count) it is level[i % 2]'s ((i - warm-up) / 2)-th.
      if (records.size() == WARMUP_ONBOARDS + levels[0].us.size() + levels[1].us.size())
        for (size_t i = WARMUP_ONBOARDS; i < records.size(); i++)
          if (records[i].critical == both[i % 2]) records[i].us[WOKEN] = levels[i % 2].us[(i - WARMUP_ONBOARDS) / 2];
      print_stages(size, threads, records);
    }
    return levels;
  };
  const std::vector<Level> alone = level(0);
  for (const Level &l : alone) print_closed_row(size, 0, l, l, 0);
  for (size_t i = 0; i < o_.background_threads.size(); i++) {
    const unsigned n = o_.background_threads[i];
    bg.start(n);
    std::this_thread::sleep_for(std::chrono::duration<double>(RAMP_SECONDS));
    const std::vector<Level> beside = level(n);
    bg.stop();
    for (size_t k = 0; k < beside.size(); k++) print_closed_row(size, n, beside[k], alone[k], closed_alone_rps_[i]);
  }
}

void MixRun::print_stages(uint64_t size, unsigned threads, const std::vector<StageRecord> &records) const {
  const auto name = [](int stage) { return stage < 0 ? "submit" : STAGE_NAMES[stage]; };
  for (bool critical : {false, true}) {
    // Microseconds from stage a to stage b of each record of this kind that reached both.
    const auto gap = [&](int a, int b) {
      std::vector<double> v;
      for (const StageRecord &r : records) {
        const double from = a < 0 ? 0 : r.us[a], to = r.us[b];
        if (r.critical == critical && !std::isnan(from) && !std::isnan(to)) v.push_back(to - from);
      }
      return v;
    };
    const size_t n = std::count_if(records.begin(), records.end(), [&](const StageRecord &r) { return r.critical == critical; });
    std::string text, gaps, since;
    char item[128];
    for (auto [a, b] : STAGE_GAPS) {
      const auto v = gap(a, b);
      if (v.empty()) continue;
      std::snprintf(item, sizeof item, "%s%s>%s %.1f/%.1f", text.empty() ? "" : ", ", name(a), name(b), percentile(v, 0.5), percentile(v, 0.99));
      text += item;
      std::snprintf(item, sizeof item, "%s\"%s>%s\": [%.2f, %.2f]", gaps.empty() ? "" : ", ", name(a), name(b), percentile(v, 0.5),
                    percentile(v, 0.99));
      gaps += item;
    }
    text += "; since submit:";
    for (int b : STAGE_SINCE_SUBMIT) {
      const auto v = gap(-1, b);
      if (v.empty()) continue;
      std::snprintf(item, sizeof item, " %s %.1f/%.1f", name(b), percentile(v, 0.5), percentile(v, 0.99));
      text += item;
      std::snprintf(item, sizeof item, "%s\"%s\": [%.2f, %.2f]", since.empty() ? "" : ", ", name(b), percentile(v, 0.5), percentile(v, 0.99));
      since += item;
    }
    std::printf("  %7llu %-8s stages of %zu, %s, p50/p99 us: %s\n", (unsigned long long)size, critical ? "critical" : "fifo", n,
                threads ? ("beside " + std::to_string(threads) + " thread(s)").c_str() : "alone", text.c_str());
    if (o_.json)
      std::printf("{\"mode\": \"mix_stages\", \"store\": %s, \"onboard_blocks\": %llu, \"critical\": %s, \"background_threads\": %u, "
                  "\"records\": %zu, \"gaps_us\": {%s}, \"since_submit_us\": {%s}}\n",
                  store_ ? "true" : "false", (unsigned long long)size, critical ? "true" : "false", threads, n, gaps.c_str(), since.c_str());
  }
  std::fflush(stdout);
}

int MixRun::run() {
  // The hot file holds every block and sits in the page cache (--store: the store holds
  // them already).
  std::vector<uint64_t> all(o_.num_blocks);
  for (uint64_t b = 0; b < o_.num_blocks; b++) all[b] = b;
  if (!store_) e_.submit(device_, all, hot_, all).wait();
  if (mapped_) e_.submit(device_, all, mapped_, all).wait();

  Background bg(e_, device_, background_file_, o_.num_blocks, o_.num_blocks, o_.background_blocks);
  // Closed-loop offloads: to the background file, or (--store) puts of new keys.
  std::atomic<uint64_t> generation{1};
  ClosedLoop closed(bg.slots(), [&](uint64_t slot) {
    if (!store_) return bg.submit(slot).wait();
    const uint64_t gen = generation.fetch_add(1);
    std::vector<uint64_t> src(o_.background_blocks);
    std::vector<std::string> bytes;
    for (uint64_t j = 0; j < src.size(); j++) src[j] = o_.num_blocks + slot * src.size() + j, bytes.push_back(key_of(gen, src[j]));
    store_->put(device_, src, kvx::keys_of(bytes)).wait();
  });
  // Open-loop levels, each size's onboards alone and their references, unless only the
  // closed-loop ones are asked for.
  const bool open_loop = !store_ && !(o_.background_shares.empty() && !o_.background_threads.empty());
  const unsigned depth = (unsigned)std::min<uint64_t>(o_.background_depth, bg.slots());
  std::printf("%s\n", kvx_version_string());
  if (store_)
    std::printf("mix: device %s, %.2f MB blocks; store gets one at a time of %llu held keys (%u shard(s), %s), %zu of each size "
                "(after %zu not counted), and as many more as fill %.1f s; background store puts of %llu new key(s), disk I/O by %s\n",
                dev_ < 0 ? "emulated" : std::to_string(dev_).c_str(), block_bytes_ / 1e6, (unsigned long long)o_.num_blocks, o_.shards,
                o_.buffered ? "buffered" : "O_DIRECT", o_.onboards, WARMUP_ONBOARDS, MIN_WINDOW_SECONDS,
                (unsigned long long)o_.background_blocks, io_backend_name(e_.io_backend()));
  else
    std::printf("mix: device %s, %.2f MB blocks; onboards one at a time from a hot buffered file of %llu blocks, %zu of each size "
                "(after %zu not counted), and as many more as fill %.1f s; background offloads of %llu block(s) to a file (%s), disk I/O by %s\n",
                dev_ < 0 ? "emulated" : std::to_string(dev_).c_str(), block_bytes_ / 1e6, (unsigned long long)o_.num_blocks, o_.onboards,
                WARMUP_ONBOARDS, MIN_WINDOW_SECONDS, (unsigned long long)o_.background_blocks, o_.buffered ? "buffered" : "O_DIRECT",
                io_backend_name(e_.io_backend()));
  const double request_bytes = (double)o_.background_blocks * block_bytes_;
  if (open_loop && o_.background_shares.empty()) {
    std::printf("background: none (--no-background): the onboards alone only\n");
  } else if (open_loop) {
    alone_rps_ = bg.alone_rate(depth, ALONE_SECONDS);
    if (!(alone_rps_ > 0)) {
      std::fprintf(stderr, "bench: no background offload completed in %.1f s alone; nothing to pace\n", ALONE_SECONDS);
      return 1;
    }
    std::printf("background alone: %u request(s) in flight back to back, %.0f requests/s = %.2f GB/s over %.1f s\n", depth, alone_rps_,
                alone_rps_ * request_bytes / 1e9, ALONE_SECONDS);
  }
  for (unsigned n : o_.background_threads) {
    closed_alone_rps_.push_back(closed.alone_rate(n, ALONE_SECONDS));
    if (!(closed_alone_rps_.back() > 0)) {
      std::fprintf(stderr, "bench: no closed-loop offload completed in %.1f s alone with %u thread(s)\n", ALONE_SECONDS, n);
      return 1;
    }
    std::printf("closed-loop background alone: %u thread(s), each a request at a time, %.0f requests/s = %.2f GB/s over %.1f s\n", n,
                closed_alone_rps_.back(), closed_alone_rps_.back() * request_bytes / 1e9, ALONE_SECONDS);
  }

  bool all_kept = true;
  if (open_loop) {
    std::printf("  %7s %-8s %9s %9s %9s %9s %9s %9s  %s\n", "blocks", "onboard", "onboards", "p50 us", "p99 us", "p99.9 us", "GB/s p50",
                "p99/alone", "background: share of its alone rate, achieved of target");
    // fifo: onboards served in arrival order with the offloads; critical: KVX_XFER_CRITICAL.
    std::vector<bool> classes{false};
    if (o_.critical) classes.push_back(true);
    for (uint64_t size : o_.onboard_sizes) {
      const auto ids = request_ids(o_.num_blocks, size, WARMUP_ONBOARDS + o_.onboards, true);
      std::vector<Level> alone;
      for (bool critical : classes) {
        alone.push_back(onboard(e_, hot_, device_, ids, o_.onboards, MIN_WINDOW_SECONDS, bg, critical));
        print_row(size, alone.back(), alone.back());
      }
      references(size, ids, alone, bg);
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
    std::printf("mapped: the same onboards from a copy of the file made with KVX_DISK_MAPPED; raw: their limit without kvxfer, the same "
                "blocks of the hot file read by threads of the bench (pread into pinned buffers, each read then a copy to the device, "
                "reads beside copies, into a contiguous scratch), the lowest p50 of 1 to %u threads and whole blocks or %llu KiB pieces; limit: "
                "its p50 over the onboards' alone\n",
                *std::max_element(std::begin(LIMIT_THREADS), std::end(LIMIT_THREADS)), (unsigned long long)LIMIT_PIECE_BYTES >> 10);
  }
  if (!o_.background_threads.empty()) {
    std::printf("closed-loop: %s alternating fifo and critical, alone and beside each closed-loop background\n",
                store_ ? "store gets" : "onboards");
    std::printf("  %7s %-8s %9s %9s %9s %9s %9s %9s  %s\n", "blocks", "onboard", "onboards", "p50 us", "p99 us", "p99.9 us", "GB/s p50",
                "p99/alone", "background: GB/s beside of alone");
    for (uint64_t size : o_.onboard_sizes)
      closed_levels(size, request_ids(o_.num_blocks, size, WARMUP_ONBOARDS + o_.onboards, true), closed);
    std::printf("closed-loop p99/alone: over the p99 alone of the same kind, the two kinds alternating in each level; a critical "
                "onboard's target is %.2fx or less, and the background is to keep %.0f%% or more of its GB/s alone\n",
                CLOSED_P99_TARGET, 100 * CLOSED_KEPT);
  }
  if (!all_kept)
    std::printf("a background MISSED its rate (its lines above): beside the onboards it did not move what it was offered\n");
  if (bg.failed() || closed.failed()) {
    std::fprintf(stderr, "bench: %llu background offload(s) failed\n", (unsigned long long)(bg.failed() + closed.failed()));
    return 1;
  }
  return 0;
}

}  // namespace

int run_mix(const Options &o) {
  const uint64_t largest = *std::max_element(o.onboard_sizes.begin(), o.onboard_sizes.end());
  if (largest > o.num_blocks || o.background_blocks > o.num_blocks) {
    std::fprintf(stderr, "bench: --mix needs --num-blocks >= the largest of --onboard-sizes (%llu) and --background-blocks (%llu)\n",
                 (unsigned long long)largest, (unsigned long long)o.background_blocks);
    return 2;
  }
  const unsigned most_threads = o.background_threads.empty() ? 0 : *std::max_element(o.background_threads.begin(), o.background_threads.end());
  if ((uint64_t)most_threads * o.background_blocks > o.num_blocks) {
    std::fprintf(stderr, "bench: --background-threads %u × --background-blocks %llu offloads in flight need --num-blocks >= %llu\n",
                 most_threads, (unsigned long long)o.background_blocks, (unsigned long long)most_threads * o.background_blocks);
    return 2;
  }
  if (o.store && o.background_threads.empty()) {
    std::fprintf(stderr, "bench: --mix --store runs the closed-loop levels only: give --background-threads N,N,..\n");
    return 2;
  }
  // Before the engine: the engine reads KVX_STAGE_TIMES once, and logs until it is gone.
  std::unique_ptr<StageLog> stages;
  if (o.stages) stages = std::make_unique<StageLog>(), stages->install();
  MixRun r(o, stages.get());
  return r.run();
}

}  // namespace bench
