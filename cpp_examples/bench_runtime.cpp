// The runtime-shaped modes (bench_runtime.h): per-request latency, layer-wise loads, many
// submitters and a replayed schedule.
#include "bench_runtime.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <thread>

namespace bench {

namespace {

// Counts per power-of-two bucket of microseconds, as "[lo,hi) us: n" lines.
void print_histogram(const char *what, const std::vector<double> &us) {
  std::map<int, size_t> buckets;
  for (double v : us) buckets[v < 1 ? 0 : 1 + (int)std::log2(v)]++;
  std::printf("    %s histogram:", what);
  for (auto &[b, n] : buckets) std::printf(" [%g,%g)us:%zu", b ? std::exp2(b - 1) : 0.0, std::exp2(b), n);
  std::printf("\n");
}

// Stamps the time its request completed (on kvxfer's thread).
struct Stamp {
  std::atomic<int64_t> ns{0};
  static void on_complete(void *user, kvx_request *, kvx_status) {
    static_cast<Stamp *>(user)->ns.store(Clock::now().time_since_epoch().count(), std::memory_order_release);
  }
};

double since_us(Clock::time_point t0, int64_t stamp_ns) {
  return std::chrono::duration<double, std::micro>(Clock::duration(stamp_ns) - t0.time_since_epoch()).count();
}

// One line of a trace, its blocks drawn.
struct TraceOp {
  bool onboard;
  std::vector<uint64_t> ids;
};

}  // namespace

void run_latency(kvx::Engine &e, const kvx::Layout &host, const kvx::Layout &device, RawCopy &raw, const Options &o,
                 uint64_t block_bytes) {
  const size_t n = (size_t)o.iterations * 100;
  const uint64_t bytes = block_bytes * o.blocks_per_batch;
  auto ids = request_ids(o.num_blocks, o.blocks_per_batch, n, o.random_blocks);
  std::printf("latency: %zu requests of %llu block(s), %.1f KiB each, one at a time (after %d warm-up requests)\n", n,
              (unsigned long long)o.blocks_per_batch, bytes / 1024.0, 50);
  std::printf("  %-15s %-12s %9s %9s %9s %9s %10s\n", "direction", "completion", "p50 us", "p99 us", "p99.9 us", "GB/s",
              "CPU s/GB");
  for (bool h2d : {true, false}) {
    if (o.direction != "all" && o.direction != (h2d ? "host-to-device" : "device-to-host")) continue;
    const kvx::Layout &src = h2d ? host : device, &dst = h2d ? device : host;
    const char *dir = h2d ? "host-to-device" : "device-to-host";
    // The raw copy: the same bytes, one copy from the start of each allocation.
    std::vector<double> raw_us;
    for (size_t i = 0; i < n + 50; i++) {
      auto t0 = Clock::now();
      raw.one(h2d, std::min(bytes, std::min(raw.host_base_bytes, raw.dev_base_bytes)));
      if (i >= 50) raw_us.push_back(us_since(t0));
    }
    auto rp = percentiles_us(raw_us);
    std::printf("  %-15s %-12s %9.1f %9.1f %9.1f %9.2f %10s\n", dir, "raw copy", rp.p50, rp.p99, rp.p999, bytes / rp.p50 / 1e3, "-");
    for (const char *how : {"wait", "poll", "on_complete"}) {
      std::vector<double> us;
      double cpu0 = 0, wall = 0;
      for (size_t i = 0; i < n + 50; i++) {
        if (i == 50) cpu0 = cpu_seconds();
        Stamp stamp;
        kvx_transfer_options opts;
        kvx_transfer_options_init(&opts);
        bool cb = std::strcmp(how, "on_complete") == 0;
        if (cb) opts.on_complete = Stamp::on_complete, opts.user_data = &stamp;
        auto &v = ids[i % n];
        auto t0 = Clock::now();
        kvx::Request r = e.submit(src, v, dst, v, &opts);
        double t;
        if (std::strcmp(how, "poll") == 0) {
          while (r.poll() == KVX_PENDING) {
          }
          t = us_since(t0);
        } else {
          r.wait();
          t = cb ? since_us(t0, stamp.ns.load(std::memory_order_acquire)) : us_since(t0);
        }
        if (i >= 50) us.push_back(t), wall += t;
      }
      double cpu = cpu_seconds() - cpu0;
      auto p = percentiles_us(us);
      std::printf("  %-15s %-12s %9.1f %9.1f %9.1f %9.2f %10.3f   p50 %+.1f us, p99 %+.1f us vs raw\n", dir, how, p.p50, p.p99,
                  p.p999, bytes * n / wall / 1e3, cpu / (bytes * n / 1e9), p.p50 - rp.p50, p.p99 - rp.p99);
      if (std::strcmp(how, "wait") == 0) print_histogram("wait", us);
      if (o.json)
        std::printf("{\"mode\": \"latency\", \"direction\": \"%s\", \"completion\": \"%s\", \"bytes\": %llu, \"random\": %s, "
                    "\"p50_us\": %.2f, \"p99_us\": %.2f, \"p999_us\": %.2f, \"raw_p50_us\": %.2f, \"raw_p99_us\": %.2f, "
                    "\"raw_p999_us\": %.2f, \"cpu_s_per_gb\": %.4f}\n",
                    dir, how, (unsigned long long)bytes, o.random_blocks ? "true" : "false", p.p50, p.p99, p.p999, rp.p50, rp.p99,
                    rp.p999, cpu / (bytes * n / 1e9));
    }
    print_histogram("raw copy", raw_us);
  }
}

void run_layerwise(kvx::Engine &e, const kvx::Layout &src, const kvx::Layout &dst, const char *dir, const Options &o,
                   const LayerFloor &floor) {
  auto v = request_ids(o.num_blocks, std::min(o.blocks_per_batch, o.num_blocks), 1, o.random_blocks)[0];
  // submit: how long each per-layer kvx_transfer_submit held the caller's thread, which a
  // runtime's scheduler pays once per layer per step.
  std::vector<double> whole, alone, first, last, submit;
  double cpu0 = cpu_seconds();
  kvx_transfer_options layer0;
  kvx_transfer_options_init(&layer0);
  layer0.layer_begin = 0, layer0.layer_end = 1;
  for (int it = 0; it < o.iterations + o.warmup; it++) {
    auto t0 = Clock::now();
    e.submit(src, v, dst, v).wait();
    double w = us_since(t0);
    // The first layer's own floor: its request on an idle engine.
    t0 = Clock::now();
    e.submit(src, v, dst, v, &layer0).wait();
    double a = us_since(t0);
    std::vector<Stamp> stamps(o.num_layers);
    std::vector<kvx::Request> reqs;
    t0 = Clock::now();
    for (uint64_t l = 0; l < o.num_layers; l++) {
      kvx_transfer_options opts;
      kvx_transfer_options_init(&opts);
      opts.layer_begin = (uint32_t)l, opts.layer_end = (uint32_t)l + 1;
      opts.on_complete = Stamp::on_complete, opts.user_data = &stamps[l];
      auto s0 = Clock::now();
      reqs.push_back(e.submit(src, v, dst, v, &opts));
      if (it >= o.warmup) submit.push_back(us_since(s0));
    }
    for (auto &r : reqs) r.wait();
    if (it < o.warmup) continue;
    whole.push_back(w);
    alone.push_back(a);
    first.push_back(since_us(t0, stamps[0].ns.load()));
    int64_t end = 0;
    for (auto &s : stamps) end = std::max<int64_t>(end, s.ns.load());
    last.push_back(since_us(t0, end));
  }
  double cpu = cpu_seconds() - cpu0;
  std::string how;
  double wake = 0;
  double raw_us = floor(v, how, wake) * 1e6;
  double w = percentile(whole, 0.5), f = percentile(first, 0.5), l = percentile(last, 0.5);
  std::printf("layerwise %s: %zu blocks x %llu layers, medians of %d: one request for all layers %.1f us; "
              "a request per layer: first layer %.1f us (%.3f of all, ideal %.3f; one layer alone %.1f us; "
              "raw floor of one layer %.1f us: %s), last layer %.1f us (%.2fx all); p99 / p99.9: last layer %.1f / %.1f us, "
              "all layers %.1f / %.1f us (p99 %.2fx); each submit p50 / p99 %.1f / %.1f us; CPU %.2f s\n",
              dir, v.size(), (unsigned long long)o.num_layers, o.iterations, w, f, f / w, 1.0 / o.num_layers,
              percentile(alone, 0.5), raw_us, how.c_str(), l, l / w, percentile(last, 0.99), percentile(last, 0.999),
              percentile(whole, 0.99), percentile(whole, 0.999), percentile(last, 0.99) / percentile(whole, 0.99),
              percentile(submit, 0.5), percentile(submit, 0.99), cpu);
  if (o.json)
    std::printf("{\"mode\": \"layerwise\", \"direction\": \"%s\", \"blocks\": %zu, \"layers\": %llu, \"whole_us\": %.2f, "
                "\"first_us\": %.2f, \"last_us\": %.2f, \"alone_us\": %.2f, \"raw_floor_us\": %.2f, \"raw_wake_us\": %.2f, "
                "\"p99_last_us\": %.2f, \"p999_last_us\": %.2f, \"p99_whole_us\": %.2f, \"p999_whole_us\": %.2f, "
                "\"submit_p50_us\": %.2f, \"submit_p99_us\": %.2f}\n",
                dir, v.size(), (unsigned long long)o.num_layers, w, f, l, percentile(alone, 0.5), raw_us, wake * 1e6,
                percentile(last, 0.99), percentile(last, 0.999), percentile(whole, 0.99), percentile(whole, 0.999),
                percentile(submit, 0.5), percentile(submit, 0.99));
}

void run_submitters(kvx::Engine &e, const kvx::Layout &host, const kvx::Layout &device, const kvx::Layout &back,
                    const Options &o, uint64_t block_bytes) {
  const unsigned n = o.submitters;
  const uint64_t per_thread = o.num_blocks / n;
  if (per_thread < o.blocks_per_batch) {
    std::fprintf(stderr, "bench: --submitters %u needs --num-blocks >= %u x --blocks-per-batch\n", n, n);
    std::exit(2);
  }
  const size_t reqs_per_thread = (size_t)o.iterations * 200;
  // The reference: one submitter, the same mix (half the blocks each way) in two requests.
  std::vector<uint64_t> up, down;
  for (uint64_t b = 0; b < per_thread * n; b++) ((b / per_thread) % 2 ? down : up).push_back(b);
  auto one_submitter = [&](const std::vector<uint64_t> &up, const std::vector<uint64_t> &down) {
    double best = 1e30;
    for (int it = 0; it < o.iterations + o.warmup; it++) {
      auto t0 = Clock::now();
      kvx::Request a = e.submit(host, up, device, up);
      kvx::Request b = down.empty() ? e.submit(host, up, device, up) : e.submit(device, down, back, down);
      a.wait(), b.wait();
      double s = std::chrono::duration<double>(Clock::now() - t0).count();
      if (it >= o.warmup) best = std::min(best, s);
    }
    return (up.size() + (down.empty() ? up.size() : down.size())) * block_bytes / best / 1e9;
  };
  double ref = one_submitter(up, down);
  // With random ids the threads' blocks are scattered, the reference's are runs of
  // consecutive blocks that join into long copies. So the same blocks are also moved in
  // a random order, still in two big requests: that shape's big-batch figure.
  double shape_ref = 0;
  if (o.random_blocks) {
    std::vector<uint64_t> su = up, sd = down;
    shuffle_fixed(su), shuffle_fixed(sd);
    shape_ref = one_submitter(su, sd);
  }
  std::vector<std::vector<double>> us(n);
  std::atomic<unsigned> ready{0};
  std::atomic<bool> go{false};
  std::vector<std::thread> pool;
  for (unsigned t = 0; t < n; t++) {
    pool.emplace_back([&, t] {
      auto ids = request_ids(per_thread, o.blocks_per_batch, reqs_per_thread, o.random_blocks);
      for (auto &v : ids)
        for (auto &b : v) b += t * per_thread;
      ready++;
      while (!go.load()) std::this_thread::yield();
      for (auto &v : ids) {
        auto t0 = Clock::now();
        if (t % 2 == 0) e.submit(host, v, device, v).wait();
        else e.submit(device, v, back, v).wait();
        us[t].push_back(us_since(t0));
      }
    });
  }
  while (ready.load() < n) std::this_thread::yield();
  double cpu0 = cpu_seconds();
  auto t0 = Clock::now();
  go = true;
  for (auto &th : pool) th.join();
  double wall = std::chrono::duration<double>(Clock::now() - t0).count(), cpu = cpu_seconds() - cpu0;
  uint64_t bytes = (uint64_t)n * reqs_per_thread * o.blocks_per_batch * block_bytes;
  double agg = bytes / wall / 1e9, lo = 1e30, hi = 0;
  std::printf("submitters: %u threads x %zu requests of %llu block(s) (%.1f KiB), mixed directions\n", n, reqs_per_thread,
              (unsigned long long)o.blocks_per_batch, o.blocks_per_batch * block_bytes / 1024.0);
  for (unsigned t = 0; t < n; t++) {
    auto p = percentiles_us(us[t]);
    lo = std::min(lo, p.p99), hi = std::max(hi, p.p99);
    std::printf("  thread %u (%s): p50 %.1f us, p99 %.1f us, p99.9 %.1f us, %.2f GB/s\n", t, t % 2 ? "device-to-host" : "host-to-device",
                p.p50, p.p99, p.p999, reqs_per_thread * o.blocks_per_batch * block_bytes / wall / 1e9);
  }
  std::printf("  aggregate %.2f GB/s; one submitter, same mix in two big requests, %.2f GB/s (%.1f%%); "
              "slowest/fastest thread p99 %.2fx; CPU %.3f s/GB\n",
              agg, ref, 100 * agg / ref, hi / lo, cpu / (bytes / 1e9));
  if (o.random_blocks)
    std::printf("  one submitter, the same blocks in random order in two big requests, %.2f GB/s (aggregate %.1f%% of it)\n",
                shape_ref, 100 * agg / shape_ref);
  if (o.json) {
    std::printf("{\"mode\": \"submitters\", \"threads\": %u, \"blocks_per_request\": %llu, \"random\": %s, \"aggregate_gbps\": %.3f, "
                "\"reference_gbps\": %.3f, \"shape_reference_gbps\": %.3f, \"p99_spread\": %.3f, \"cpu_s_per_gb\": %.4f, "
                "\"thread_p99_us\": [",
                n, (unsigned long long)o.blocks_per_batch, o.random_blocks ? "true" : "false", agg, ref, shape_ref, hi / lo,
                cpu / (bytes / 1e9));
    for (unsigned t = 0; t < n; t++) std::printf("%s%.2f", t ? ", " : "", percentiles_us(us[t]).p99);
    std::printf("]}\n");
  }
}

namespace {

// What a replay of the trace saw, every submitter together.
struct Replayed {
  std::vector<double> on_us, off_us;
  uint64_t bytes = 0;
  double wall = 0, cpu = 0;
};

// Each submitter's lines in order, one request at a time, all submitters at once; the
// offloads skipped unless `offloads`.
Replayed replay(kvx::Engine &e, const kvx::Layout &tier, const kvx::Layout &device, const std::vector<std::vector<TraceOp>> &by_thread,
                bool offloads, uint64_t block_bytes) {
  std::vector<Replayed> seen(by_thread.size());
  std::vector<std::thread> pool;
  std::atomic<bool> go{false};
  for (size_t t = 0; t < by_thread.size(); t++) {
    pool.emplace_back([&, t] {
      while (!go.load()) std::this_thread::yield();
      for (auto &op : by_thread[t]) {
        if (!op.onboard && !offloads) continue;
        auto t0 = Clock::now();
        if (op.onboard) e.submit(tier, op.ids, device, op.ids).wait();
        else e.submit(device, op.ids, tier, op.ids).wait();
        (op.onboard ? seen[t].on_us : seen[t].off_us).push_back(us_since(t0));
        seen[t].bytes += op.ids.size() * block_bytes;
      }
    });
  }
  Replayed all;
  double cpu0 = cpu_seconds();
  auto t0 = Clock::now();
  go = true;
  for (auto &th : pool) th.join();
  all.wall = std::chrono::duration<double>(Clock::now() - t0).count(), all.cpu = cpu_seconds() - cpu0;
  for (auto &s : seen) {
    all.on_us.insert(all.on_us.end(), s.on_us.begin(), s.on_us.end());
    all.off_us.insert(all.off_us.end(), s.off_us.begin(), s.off_us.end());
    all.bytes += s.bytes;
  }
  return all;
}

}  // namespace

void run_trace(kvx::Engine &e, const kvx::Layout &tier, const kvx::Layout &device, const Options &o, uint64_t block_bytes) {
  FILE *f = std::fopen(o.trace.c_str(), "r");
  if (!f) { std::perror(("bench: --trace " + o.trace).c_str()); std::exit(2); }
  std::map<unsigned, std::vector<TraceOp>> by_id;
  std::map<unsigned, uint64_t> rng;
  char line[256];
  for (int no = 1; std::fgets(line, sizeof line, f); no++) {
    if (line[0] == '#' || line[0] == '\n') continue;
    unsigned t;
    char op[32];
    unsigned long long n;
    if (std::sscanf(line, "%u %31s %llu", &t, op, &n) != 3 || (std::strcmp(op, "onboard") && std::strcmp(op, "offload")) || n == 0 ||
        n > o.num_blocks) {
      std::fprintf(stderr, "bench: %s:%d: expected `<submitter> onboard|offload <blocks>` with 1..%llu blocks\n", o.trace.c_str(), no,
                   (unsigned long long)o.num_blocks);
      std::exit(2);
    }
    // Each submitter's random blocks, drawn here so both replays move the same ones.
    uint64_t &x = rng.emplace(t, 0x9E3779B97F4A7C15ull * (t + 1)).first->second;
    TraceOp to{std::strcmp(op, "onboard") == 0, {}};
    while (to.ids.size() < n) {
      x ^= x << 13, x ^= x >> 7, x ^= x << 17;
      uint64_t b = x % o.num_blocks;
      if (std::find(to.ids.begin(), to.ids.end(), b) == to.ids.end()) to.ids.push_back(b);
    }
    by_id[t].push_back(std::move(to));
  }
  std::fclose(f);
  std::vector<std::vector<TraceOp>> by_thread;
  for (auto &kv : by_id) by_thread.push_back(std::move(kv.second));
  // The onboards' reference: the same trace with its offloads dropped. Each submitter is
  // closed-loop, so without the offloads its onboards also run closer to the others'.
  const Replayed alone = replay(e, tier, device, by_thread, false, block_bytes);
  const Replayed r = replay(e, tier, device, by_thread, true, block_bytes);
  auto a = percentiles_us(r.on_us), b = percentiles_us(r.off_us), ra = percentiles_us(alone.on_us);
  const double vs_alone = ra.p99 > 0 ? a.p99 / ra.p99 : 0;
  std::printf("trace %s: %zu submitters, %zu onboards (p50 %.1f us, p99 %.1f us, p99.9 %.1f us), %zu offloads (p50 %.1f us, "
              "p99 %.1f us, p99.9 %.1f us); %.2f GB/s aggregate over %.3f s; CPU %.3f s/GB\n",
              o.trace.c_str(), by_thread.size(), r.on_us.size(), a.p50, a.p99, a.p999, r.off_us.size(), b.p50, b.p99, b.p999,
              r.bytes / r.wall / 1e9, r.wall, r.cpu / (r.bytes / 1e9));
  std::printf("  the onboards alone (offloads dropped, same blocks): p50 %.1f us, p99 %.1f us, p99.9 %.1f us; "
              "with the offloads p99 %.2fx alone\n",
              ra.p50, ra.p99, ra.p999, vs_alone);
  if (o.json)
    std::printf("{\"mode\": \"trace\", \"submitters\": %zu, \"onboards\": %zu, \"onboard_p50_us\": %.2f, \"onboard_p99_us\": %.2f, "
                "\"onboard_p999_us\": %.2f, \"offloads\": %zu, \"offload_p50_us\": %.2f, \"offload_p99_us\": %.2f, "
                "\"offload_p999_us\": %.2f, \"gbps\": %.3f, \"cpu_s_per_gb\": %.4f, \"alone_onboard_p50_us\": %.2f, "
                "\"alone_onboard_p99_us\": %.2f, \"alone_onboard_p999_us\": %.2f, \"onboard_p99_vs_alone\": %.3f}\n",
                by_thread.size(), r.on_us.size(), a.p50, a.p99, a.p999, r.off_us.size(), b.p50, b.p99, b.p999, r.bytes / r.wall / 1e9,
                r.cpu / (r.bytes / 1e9), ra.p50, ra.p99, ra.p999, vs_alone);
}
}  // namespace bench
