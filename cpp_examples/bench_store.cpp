// --store (bench_store.h): the store's put, get, durable put, lookup and open, each beside
// plain transfers of the same blocks in the same run. The plain files are laid out as the
// store's shards are (block b in file b % shards, at b / shards), so the two move the same
// bytes between the same memory and as many files; what differs is the store's own work:
// keys, records, checksums, its thread.
#include "bench_store.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace bench {

namespace {

// Keys per lookup call.
constexpr size_t LOOKUP_KEYS = 1000;

// Every timed put uses a new generation of keys (key_of), so it writes every block rather
// than finding them held already; generation 0 is never put (the lookup's misses).

// Key bytes and the kvx_key views of them, one batch each (moving it moves no string, so
// the views stay valid).
struct Batches {
  std::vector<std::vector<uint64_t>> ids;
  std::vector<std::vector<std::string>> bytes;
  std::vector<std::vector<kvx_key>> keys;
};

// What one operation's timed passes measured, summed over the passes.
struct Timed {
  double seconds = 0, cpu_s = 0;
  std::vector<double> batch_ms;
};

class StoreRun {
 public:
  explicit StoreRun(const Options &o)
      : o_(o), ec_(engine_config(o)), e_(&ec_), dev_(e_.device()), lc_(layout_configs(o).first), hc_(layout_configs(o).second) {
    device_ = e_.create_device_layout(lc_);
    host_ = e_.create_host_layout(hc_, KVX_HOST_PINNED);
    check_host_ = e_.create_host_layout(hc_, KVX_HOST_PINNED);
    block_bytes_ = device_.block_bytes();
    const std::string stem = o.dir + "/kvx-bench-" + std::to_string(::getpid());
    dir_ = stem + ".store";
    durable_dir_ = stem + ".store-durable";
    std::filesystem::remove_all(dir_);
    std::filesystem::remove_all(durable_dir_);
    kvx_layout_config fc = lc_;
    fc.kind = KVX_LAYOUT_FULLY_CONTIGUOUS;
    fc.num_blocks = (o.num_blocks + o.shards - 1) / o.shards;
    const uint32_t flags = (o.buffered ? KVX_DISK_BUFFERED : 0) | (o.checksum ? KVX_DISK_CHECKSUM : 0);
    for (uint32_t k = 0; k < o.shards; k++) {
      paths_.push_back(stem + ".shard" + std::to_string(k) + ".kv");
      files_.push_back(e_.create_disk_layout(fc, paths_.back(), KVX_DISK_CREATE | flags));
    }
    // The same files, every write synced: the durable put's plain counterpart.
    for (uint32_t k = 0; k < o.shards; k++) sync_files_.push_back(e_.create_disk_layout(fc, paths_[k], KVX_DISK_SYNC | flags));
    file_config_ = fc;
    file_flags_ = flags;
  }
  ~StoreRun() {
    store_.reset();
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
    std::filesystem::remove_all(durable_dir_, ec);
  }
  StoreRun(const StoreRun &) = delete;
  StoreRun &operator=(const StoreRun &) = delete;

  int run();

 private:
  kvx_store_config store_config(bool durable) const;
  Batches batches(uint64_t gen) const;
  Timed plain_pass(const kvx::Layout &mem, bool to_files, const std::vector<kvx::Layout> &files);
  Timed put_pass(kvx::Store &s, const kvx::Layout &src, uint64_t &gen) const;
  Timed get_pass(kvx::Store &s, const kvx::Layout &dst, uint64_t gen) const;
  void transfer_row(const char *op, const char *direction, const Timed &st, const Timed &pl, bool durable) const;
  void lookup_row(kvx::Store &s, uint64_t gen);
  void open_row();
  int shared_rows();
  int s3_rows();
  int verify_get(kvx::Store &s, const kvx::Layout &dst, uint64_t gen, const char *from);
  void measure(const char *op, const char *direction, bool durable, const std::function<Timed()> &store_pass,
               const std::function<Timed()> &plain);

  const Options &o_;
  const kvx_engine_config ec_;
  kvx::Engine e_;
  const int32_t dev_;
  const kvx_layout_config lc_, hc_;
  kvx::Layout device_{nullptr}, host_{nullptr}, check_host_{nullptr};
  uint64_t block_bytes_ = 0;
  std::string dir_, durable_dir_;
  std::vector<std::string> paths_;
  std::vector<kvx::Layout> files_, sync_files_;
  kvx_layout_config file_config_{};
  uint32_t file_flags_ = 0;
  std::unique_ptr<kvx::Store> store_;
};

kvx_store_config StoreRun::store_config(bool durable) const {
  kvx::store_config c;
  c.flags = KVX_STORE_CREATE | (durable ? KVX_STORE_DURABLE : 0) | (o_.buffered ? KVX_STORE_BUFFERED : 0);
  c.block = &lc_;
  c.capacity_blocks = o_.num_blocks;
  c.shards = o_.shards;
  return c;
}

// The blocks in batches of --blocks-per-batch (shuffled with --random-blocks), with the
// keys of generation `gen`.
Batches StoreRun::batches(uint64_t gen) const {
  Batches b;
  std::vector<uint64_t> order(o_.num_blocks);
  for (uint64_t i = 0; i < o_.num_blocks; i++) order[i] = i;
  if (o_.random_blocks) shuffle_fixed(order);
  for (uint64_t i = 0; i < o_.num_blocks; i += o_.blocks_per_batch)
    b.ids.emplace_back(order.begin() + i, order.begin() + std::min(o_.num_blocks, i + o_.blocks_per_batch));
  for (const auto &v : b.ids) {
    b.bytes.emplace_back();
    for (uint64_t id : v) b.bytes.back().push_back(key_of(gen, id));
  }
  for (const auto &v : b.bytes) b.keys.push_back(kvx::keys_of(v));
  return b;
}

// Batches in flight at once in a pass: every batch of a small run, and for a run of many
// small blocks few enough that a batch's requests (one per shard) stay under the engine's
// max_inflight (1024 by default).
static constexpr size_t kWindow = 128;

// One plain pass: each batch's blocks as one request per file they fall in, up to
// kWindow batches in flight, waited for in order (a batch is done with its last).
Timed StoreRun::plain_pass(const kvx::Layout &mem, bool to_files, const std::vector<kvx::Layout> &files) {
  const Batches b = batches(0);
  struct Part {
    std::vector<kvx::Request> reqs;
    Clock::time_point submitted;
  };
  std::vector<Part> parts;
  Timed t;
  const double cpu0 = cpu_seconds();
  const auto t0 = Clock::now();
  size_t waited = 0;
  auto wait_next = [&] {
    for (auto &r : parts[waited].reqs) r.wait();
    t.batch_ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - parts[waited].submitted).count());
    parts[waited++].reqs.clear();
  };
  for (const auto &ids : b.ids) {
    if (parts.size() - waited == kWindow) wait_next();
    Part p{{}, Clock::now()};
    for (uint32_t k = 0; k < o_.shards; k++) {
      std::vector<uint64_t> mem_ids, file_ids;
      for (uint64_t id : ids)
        if (id % o_.shards == k) mem_ids.push_back(id), file_ids.push_back(id / o_.shards);
      if (mem_ids.empty()) continue;
      p.reqs.push_back(to_files ? e_.submit(mem, mem_ids, files[k], file_ids) : e_.submit(files[k], file_ids, mem, mem_ids));
    }
    parts.push_back(std::move(p));
  }
  while (waited < parts.size()) wait_next();
  t.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  t.cpu_s = cpu_seconds() - cpu0;
  return t;
}

// Submits the batches of `b` with `submit(i)`, up to kWindow in flight, and waits for
// them in order: one pass.
template <typename Submit>
static Timed store_pass(const Batches &b, Submit submit) {
  std::vector<std::pair<kvx::StoreRequest, Clock::time_point>> reqs;
  Timed t;
  const double cpu0 = cpu_seconds();
  const auto t0 = Clock::now();
  size_t waited = 0;
  auto wait_next = [&] {
    auto &[r, ts] = reqs[waited++];
    r.wait();
    t.batch_ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - ts).count());
    r = kvx::StoreRequest(nullptr);  // its keys and statuses freed as the pass goes
  };
  for (size_t i = 0; i < b.ids.size(); i++) {
    if (reqs.size() - waited == kWindow) wait_next();
    const auto ts = Clock::now();
    reqs.emplace_back(submit(i), ts);
  }
  while (waited < reqs.size()) wait_next();
  t.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  t.cpu_s = cpu_seconds() - cpu0;
  return t;
}

// One put pass: the blocks of `src` under a new generation's keys, the previous one's
// removed first (not timed) so every block is written to a free slot.
Timed StoreRun::put_pass(kvx::Store &s, const kvx::Layout &src, uint64_t &gen) const {
  if (gen)
    for (const auto &k : batches(gen).keys) s.remove(k);
  const Batches b = batches(++gen);
  return store_pass(b, [&](size_t i) { return s.put(src, b.ids[i], b.keys[i]); });
}

// One get pass: every block of generation `gen` into the same block of `dst`.
Timed StoreRun::get_pass(kvx::Store &s, const kvx::Layout &dst, uint64_t gen) const {
  const Batches b = batches(gen);
  return store_pass(b, [&](size_t i) { return s.get(b.keys[i], dst, b.ids[i]); });
}

void StoreRun::transfer_row(const char *op, const char *direction, const Timed &st, const Timed &pl, bool durable) const {
  const uint64_t bytes = block_bytes_ * o_.num_blocks * o_.iterations;
  const double g = gbps(bytes, st.seconds), pg = gbps(bytes, pl.seconds);
  const double cpu = st.cpu_s / (bytes / 1e9), pcpu = pl.cpu_s / (bytes / 1e9);
  std::printf("%-12s %-16s %9.2f %9.3f %9.3f %11.2f %8.2f %9.3f %10.3f\n", op, direction, g, percentile(st.batch_ms, 0.5),
              percentile(st.batch_ms, 0.99), pg, pg > 0 ? g / pg : 0.0, cpu, pcpu);
  if (o_.json)
    std::printf("{\"system\": \"kvxfer\", \"mode\": \"store\", \"op\": \"%s\", \"direction\": \"%s\", \"durable\": %s, "
                "\"shards\": %u, \"num_blocks\": %llu, \"block_bytes\": %llu, \"blocks_per_batch\": %llu, \"gbps\": %.3f, "
                "\"p50_ms\": %.3f, \"p99_ms\": %.3f, \"plain_gbps\": %.3f, \"plain_p50_ms\": %.3f, \"ratio\": %.4f, "
                "\"cpu_s_per_gb\": %.4f, \"plain_cpu_s_per_gb\": %.4f, \"buffered\": %s, \"io_backend\": \"%s\"}\n",
                op, direction, durable ? "true" : "false", o_.shards, (unsigned long long)o_.num_blocks,
                (unsigned long long)block_bytes_, (unsigned long long)o_.blocks_per_batch, g, percentile(st.batch_ms, 0.5),
                percentile(st.batch_ms, 0.99), pg, percentile(pl.batch_ms, 0.5), pg > 0 ? g / pg : 0.0, cpu, pcpu,
                o_.buffered ? "true" : "false", io_backend_name(e_.io_backend()));
}

static void add_to(Timed &into, const Timed &t) {
  into.seconds += t.seconds, into.cpu_s += t.cpu_s;
  into.batch_ms.insert(into.batch_ms.end(), t.batch_ms.begin(), t.batch_ms.end());
}

// --warmup untimed passes of each, then --iterations timed ones, store and plain taking
// turns, and the row.
void StoreRun::measure(const char *op, const char *direction, bool durable, const std::function<Timed()> &store_pass,
                       const std::function<Timed()> &plain) {
  for (int i = 0; i < o_.warmup; i++) store_pass(), plain();
  Timed st, pl;
  for (int i = 0; i < o_.iterations; i++) {
    add_to(st, store_pass());
    add_to(pl, plain());
  }
  transfer_row(op, direction, st, pl, durable);
}

// 1,000 keys per call: the held ones first (up to --num-blocks of them), then keys never
// put; 1,000 calls per iteration, each timed alone.
void StoreRun::lookup_row(kvx::Store &s, uint64_t gen) {
  std::vector<std::string> bytes;
  for (size_t i = 0; i < LOOKUP_KEYS; i++) bytes.push_back(key_of(i < o_.num_blocks ? gen : 0, i));
  const std::vector<kvx_key> keys = kvx::keys_of(bytes);
  std::vector<uint8_t> present(keys.size());
  size_t leading = 0;
  // The C call into one buffer: a vector made per call (kvx::Store::lookup) is not the store's time.
  auto call = [&]() { kvx::check(kvx_store_lookup(s.get(), keys.data(), keys.size(), 0, present.data(), &leading)); };
  for (int i = 0; i < 100 * o_.warmup; i++) call();
  const size_t calls = 1000 * (size_t)o_.iterations;
  std::vector<double> us;
  us.reserve(calls);
  const double cpu0 = cpu_seconds();
  for (size_t i = 0; i < calls; i++) {
    const auto t0 = Clock::now();
    call();
    us.push_back(us_since(t0));
  }
  const double cpu_us = 1e6 * (cpu_seconds() - cpu0) / (double)calls;
  const size_t hits = (size_t)std::count(present.begin(), present.end(), 1);
  const Percentiles p = percentiles_us(us);
  std::printf("lookup: %zu keys in one call (%zu held), %zu calls: p50 %.1f us, p99 %.1f us, p99.9 %.1f us; "
              "CPU %.1f us per call (no bytes move: CPU s/GB does not apply)\n",
              keys.size(), hits, calls, p.p50, p.p99, p.p999, cpu_us);
  if (o_.json)
    std::printf("{\"system\": \"kvxfer\", \"mode\": \"store\", \"op\": \"lookup\", \"keys\": %zu, \"held\": %zu, \"calls\": %zu, "
                "\"p50_us\": %.3f, \"p99_us\": %.3f, \"p999_us\": %.3f, \"cpu_us_per_call\": %.3f}\n",
                keys.size(), hits, calls, p.p50, p.p99, p.p999, cpu_us);
}

// The store closed and opened again, --iterations times, holding --num-blocks entries,
// beside opening the plain disk layouts on as many existing files.
void StoreRun::open_row() {
  const kvx_store_config c = store_config(false);
  const uint64_t entries = store_->stats().entries;
  std::vector<double> ms, plain_ms;
  double cpu = 0, plain_cpu = 0;
  for (int i = 0; i < o_.warmup + o_.iterations; i++) {
    store_.reset();
    double cpu0 = cpu_seconds();
    auto t0 = Clock::now();
    store_ = std::make_unique<kvx::Store>(e_, dir_, c);
    const double t = us_since(t0) / 1e3, tc = cpu_seconds() - cpu0;
    std::vector<kvx::Layout> opened;
    cpu0 = cpu_seconds();
    t0 = Clock::now();
    for (const std::string &p : paths_) opened.push_back(e_.create_disk_layout(file_config_, p, file_flags_));
    const double pt = us_since(t0) / 1e3, ptc = cpu_seconds() - cpu0;
    opened.clear();
    if (i < o_.warmup) continue;
    ms.push_back(t), plain_ms.push_back(pt), cpu += tc, plain_cpu += ptc;
  }
  const double p50 = percentile(ms, 0.5), plain_p50 = percentile(plain_ms, 0.5);
  const double cpu_ms = 1e3 * cpu / o_.iterations, plain_cpu_ms = 1e3 * plain_cpu / o_.iterations;
  std::printf("open: a store holding %llu entries on %u shard(s): p50 %.3f ms; plain: %u disk layout(s) opened on the files "
              "p50 %.3f ms; store / plain %.2f; CPU %.3f ms per open, plain %.3f ms (no bytes move: CPU s/GB "
              "does not apply)\n",
              (unsigned long long)entries, o_.shards, p50, o_.shards, plain_p50, plain_p50 > 0 ? p50 / plain_p50 : 0.0, cpu_ms,
              plain_cpu_ms);
  if (o_.json)
    std::printf("{\"system\": \"kvxfer\", \"mode\": \"store\", \"op\": \"open\", \"entries\": %llu, \"shards\": %u, "
                "\"p50_ms\": %.4f, \"plain_p50_ms\": %.4f, \"ratio\": %.4f, \"cpu_ms_per_open\": %.4f, \"plain_cpu_ms_per_open\": %.4f}\n",
                (unsigned long long)entries, o_.shards, p50, plain_p50, plain_p50 > 0 ? p50 / plain_p50 : 0.0, cpu_ms, plain_cpu_ms);
}

// --shared: a store puts every block through to a shared directory beside its own; a
// second store, its local store empty and admitting nothing, gets them from the shared
// tier each pass. Against: the first store's own gets of the same blocks, on the same disk.
int StoreRun::shared_rows() {
  const std::string shared_dir = dir_ + "-shared", pub_dir = dir_ + "-pub", rd_dir = dir_ + "-rd";
  kvx_shared_config sh;
  kvx_shared_config_init(&sh);
  sh.kind = KVX_SHARED_DIR;
  sh.path = shared_dir.c_str();
  sh.flags = KVX_SHARED_WRITE_THROUGH | KVX_SHARED_NO_ADMIT;
  kvx_store_config c = store_config(false);
  c.shared = &sh;
  uint64_t gen = 0;
  int rc = 0;
  {
    kvx::Store pub(e_, pub_dir, c);
    put_pass(pub, host_, gen);
    kvx::Store rd(e_, rd_dir, c);
    measure("shared get", "shared-to-device", false, [&] { return get_pass(rd, device_, gen); },
            [&] { return get_pass(pub, device_, gen); });
    measure("shared get", "shared-to-host", false, [&] { return get_pass(rd, check_host_, gen); },
            [&] { return get_pass(pub, check_host_, gen); });
    get_pass(rd, check_host_, gen);
    const uint32_t nbases = hc_.kind == KVX_LAYOUT_FULLY_CONTIGUOUS ? 1 : (uint32_t)o_.num_layers;
    const uint64_t base_bytes = block_bytes_ * o_.num_blocks / nbases;
    for (uint32_t l = 0; l < nbases; l++)
      if (std::memcmp(reinterpret_cast<void *>(host_.base(l)), reinterpret_cast<void *>(check_host_.base(l)), base_bytes) != 0) {
        std::fprintf(stderr, "bench: VERIFY FAILED: bytes got from the shared tier differ from those put (base %u)\n", l);
        rc = 1;
      }
    const kvx_store_counters k = rd.stats();
    std::printf("shared get: / plain = over the local store's gets of the same blocks; the reader's shared tier: %llu hits, "
                "%llu misses, %llu failed checks, %llu requests\n",
                (unsigned long long)k.shared_hits, (unsigned long long)k.shared_misses,
                (unsigned long long)k.shared_integrity_failures, (unsigned long long)k.shared_requests);
  }
  std::error_code ec;
  for (const std::string &d : {shared_dir, pub_dir, rd_dir}) std::filesystem::remove_all(d, ec);
  return rc;
}

// Every block of generation `gen` got from `s` into `dst`, which held zeros before, then
// compared with what was put (host_'s bytes): 0, or 1 having said which base differs.
int StoreRun::verify_get(kvx::Store &s, const kvx::Layout &dst, uint64_t gen, const char *from) {
  const uint32_t nbases = hc_.kind == KVX_LAYOUT_FULLY_CONTIGUOUS ? 1 : (uint32_t)o_.num_layers;
  const uint64_t base_bytes = block_bytes_ * o_.num_blocks / nbases;
  for (uint32_t l = 0; l < nbases; l++) std::memset(reinterpret_cast<void *>(check_host_.base(l)), 0, base_bytes);
  if (&dst != &check_host_) run_pass(e_, check_host_, dst, o_);
  get_pass(s, dst, gen);
  if (&dst != &check_host_) run_pass(e_, dst, check_host_, o_);
  for (uint32_t l = 0; l < nbases; l++)
    if (std::memcmp(reinterpret_cast<void *>(host_.base(l)), reinterpret_cast<void *>(check_host_.base(l)), base_bytes) != 0) {
      std::fprintf(stderr, "bench: VERIFY FAILED: bytes got from %s into the %s layout differ from those put (base %u)\n", from,
                   &dst == &device_ ? "device" : "host", l);
      return 1;
    }
  return 0;
}

// A server of the S3 API the bench starts (s3s-fs, whose buckets are the folders of its
// root) on a free loopback port; stopped, and its root removed, at the end.
struct S3Server {
  pid_t pid = -1;
  std::string endpoint, root;
  S3Server() = default;
  S3Server(const S3Server &) = delete;
  S3Server &operator=(const S3Server &) = delete;
  ~S3Server() {
    if (pid > 0) {
      int st = 0;
      ::kill(pid, SIGTERM);
      ::waitpid(pid, &st, 0);
    }
    std::error_code ec;
    if (!root.empty()) std::filesystem::remove_all(root, ec);
  }
};

// A loopback port nothing listens on, as the kernel hands them out; 0 if none.
static uint16_t free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t n = sizeof a;
  uint16_t port = 0;
  if (fd >= 0 && ::bind(fd, reinterpret_cast<sockaddr *>(&a), sizeof a) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr *>(&a), &n) == 0)
    port = ntohs(a.sin_port);
  if (fd >= 0) ::close(fd);
  return port;
}

static bool answers(uint16_t port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(port);
  const bool ok = fd >= 0 && ::connect(fd, reinterpret_cast<sockaddr *>(&a), sizeof a) == 0;
  if (fd >= 0) ::close(fd);
  return ok;
}

// Starts `bin` (s3s-fs) with bucket `bucket` made in `root`, taking the credentials of
// AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (set to a pair of its own where unset, for
// the tier and the limit too), and waits up to 30 s for it to answer.
static bool start_s3_server(const std::string &bin, const std::string &root, const std::string &bucket, S3Server &s) {
  std::error_code ec;
  std::filesystem::remove_all(root, ec);
  std::filesystem::create_directories(root + "/" + bucket, ec);
  s.root = root;
  if (ec) {
    std::fprintf(stderr, "bench: making the S3 server's folder %s: %s\n", root.c_str(), ec.message().c_str());
    return false;
  }
  ::setenv("AWS_ACCESS_KEY_ID", "kvx-bench", 0);
  ::setenv("AWS_SECRET_ACCESS_KEY", "kvx-bench", 0);
  const uint16_t port = free_port();
  const std::string port_s = std::to_string(port);
  std::fflush(stdout);
  s.pid = ::fork();
  if (s.pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // the server goes with the bench, however it ends
    ::execl(bin.c_str(), bin.c_str(), "--host", "127.0.0.1", "--port", port_s.c_str(), "--access-key",
            std::getenv("AWS_ACCESS_KEY_ID"), "--secret-key", std::getenv("AWS_SECRET_ACCESS_KEY"), root.c_str(), nullptr);
    std::fprintf(stderr, "bench: starting the S3 server %s: %s\n", bin.c_str(), std::strerror(errno));
    std::_Exit(127);
  }
  for (int i = 0; s.pid > 0 && i < 300; i++) {
    if (answers(port)) {
      s.endpoint = "http://127.0.0.1:" + port_s;
      return true;
    }
    int st = 0;
    if (::waitpid(s.pid, &st, WNOHANG) == s.pid) {
      s.pid = -1;
      break;
    }
    ::usleep(100000);
  }
  std::fprintf(stderr, "bench: the S3 server %s did not answer on port %u (its message is above); build it with make s3-bench-server\n",
               bin.c_str(), (unsigned)port);
  return false;
}

// `s` as one word of a POSIX shell command line.
static std::string shell_word(const std::string &s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

// The S3 limit's binary: --s3-limit, else s3_limit beside the bench, else where cargo
// builds it from the bench's folder in the repository.
static std::string s3_limit_path(const Options &o) {
  if (!o.s3_limit.empty()) return o.s3_limit;
  std::error_code ec;
  const std::filesystem::path here = std::filesystem::read_symlink("/proc/self/exe", ec).parent_path();
  for (const auto &p : {here / "s3_limit", here / "../target/release/examples/s3_limit"})
    if (std::filesystem::exists(p, ec)) return p.string();
  return (here / "s3_limit").string();
}

// The best point of the S3 client alone, for one op.
struct S3Limit {
  double gbps = 0, p50 = 0, p99 = 0, p999 = 0, cpu = 0, inflight = 0;
};

// The number after "key": in one of the limit's JSON lines; 0 if absent.
static double json_number(const std::string &line, const std::string &key) {
  const size_t at = line.find("\"" + key + "\": ");
  return at == std::string::npos ? 0 : std::strtod(line.c_str() + at + key.size() + 4, nullptr);
}

// --shared-s3 / --s3-server: a store puts every block through to an S3 bucket (a put ends
// once its objects are published), from the device then the pinned host; a second store,
// its local store empty and admitting nothing, gets them from the bucket each pass, into
// the device then the host, every byte checked after. Then the S3 client alone
// (cpp_examples/s3_limit.rs: the tier's own client, no kvxfer request path) PUTs and GETs
// --num-blocks objects of the same size on the same server at each concurrency of its
// sweep; each row is read against its best.
int StoreRun::s3_rows() {
  S3Server server;
  std::string endpoint = o_.shared_s3;
  if (!o_.s3_server.empty()) {
    if (!start_s3_server(o_.s3_server, dir_ + "-s3", o_.s3_bucket, server)) return 1;
    endpoint = server.endpoint;
  }
  const std::string prefix = "kvx-bench-" + std::to_string(::getpid());
  kvx::shared_config sh = kvx::shared_config::s3(o_.s3_bucket.c_str(), prefix.c_str(), endpoint.c_str());
  sh.set_threads(o_.s3_threads).set_flags(KVX_SHARED_WRITE_THROUGH | KVX_SHARED_NO_ADMIT);
  kvx_store_config c = store_config(false);
  c.shared = &sh;
  const std::string pub_dir = dir_ + "-s3put", rd_dir = dir_ + "-s3get";
  struct Row {
    const char *op, *direction;
    Timed t;
  };
  std::vector<Row> rows;
  auto passes = [&](const std::function<Timed()> &pass) {
    for (int i = 0; i < o_.warmup; i++) pass();
    Timed t;
    for (int i = 0; i < o_.iterations; i++) add_to(t, pass());
    return t;
  };
  int rc = 0;
  uint32_t threads = 0;
  kvx_store_counters k{};
  {
    kvx::Store put(e_, pub_dir, c);
    uint64_t gen = 0;
    rows.push_back({"put", "device-to-s3", passes([&] { return put_pass(put, device_, gen); })});
    rows.push_back({"put", "host-to-s3", passes([&] { return put_pass(put, host_, gen); })});
    kvx::Store get(e_, rd_dir, c);
    rows.push_back({"get", "s3-to-device", passes([&] { return get_pass(get, device_, gen); })});
    rows.push_back({"get", "s3-to-host", passes([&] { return get_pass(get, check_host_, gen); })});
    rc = verify_get(get, device_, gen, "the S3 tier") | verify_get(get, check_host_, gen, "the S3 tier");
    k = get.stats();
    threads = sh.threads ? sh.threads : 16;  // 0: the tier's default, 16 (kvx_shared_config.threads)
  }
  std::error_code ec;
  for (const std::string &d : {pub_dir, rd_dir}) std::filesystem::remove_all(d, ec);
  if (rc != 0) return rc;

  const std::string limit = s3_limit_path(o_);
  const std::string cmd = shell_word(limit) + " --endpoint " + shell_word(endpoint) + " --bucket " + shell_word(o_.s3_bucket) +
                          " --prefix " + shell_word(prefix + "-limit") + " --block-bytes " + std::to_string(block_bytes_) +
                          " --objects " + std::to_string(o_.num_blocks) + " --iterations " + std::to_string(o_.iterations) +
                          " --warmup " + std::to_string(o_.warmup) + " --json";
  std::fflush(stdout);
  FILE *p = ::popen(cmd.c_str(), "r");
  S3Limit best[2];  // put, get
  bool got[2] = {false, false};
  if (p) {
    char buf[4096];
    while (std::fgets(buf, sizeof buf, p)) {
      const std::string line = buf;
      if (line[0] != '{') {
        std::printf("  %s", line.c_str());
        continue;
      }
      if (o_.json) std::printf("%s", line.c_str());
      if (line.find("\"best\": true") == std::string::npos) continue;
      const int i = line.find("\"op\": \"put\"") != std::string::npos ? 0 : 1;
      best[i] = {json_number(line, "gbps"), json_number(line, "req_p50_ms"), json_number(line, "req_p99_ms"),
                 json_number(line, "req_p999_ms"), json_number(line, "cpu_s_per_gb"), json_number(line, "inflight")};
      got[i] = true;
    }
  }
  const int limit_rc = p ? ::pclose(p) : -1;
  if (!got[0] || !got[1] || limit_rc != 0) {
    std::fprintf(stderr, "bench: the S3 limit %s gave no result (its message is above); build it with cargo build --release "
                         "--example s3_limit, or name it with --s3-limit\n", limit.c_str());
    return 1;
  }

  std::printf("shared tier over S3: s3://%s/%s at %s, %u tier threads, write-through puts, gets not admitted; the limit: "
              "the tier's S3 client alone on %llu objects of the same size, its best concurrency\n",
              o_.s3_bucket.c_str(), prefix.c_str(), endpoint.c_str(), threads, (unsigned long long)o_.num_blocks);
  std::printf("%-5s %-13s %8s %8s %8s %9s %11s %8s %8s %9s %10s\n", "op", "direction", "GB/s", "p50 ms", "p99 ms", "p99.9 ms",
              "limit GB/s", "inflight", "/ limit", "CPU s/GB", "limit s/GB");
  const uint64_t bytes = block_bytes_ * o_.num_blocks * o_.iterations;
  for (const Row &r : rows) {
    const S3Limit &l = best[r.op[0] == 'p' ? 0 : 1];
    const double g = gbps(bytes, r.t.seconds), cpu = r.t.cpu_s / (bytes / 1e9);
    const double p50 = percentile(r.t.batch_ms, 0.5), p99 = percentile(r.t.batch_ms, 0.99), p999 = percentile(r.t.batch_ms, 0.999);
    std::printf("%-5s %-13s %8.3f %8.2f %8.2f %9.2f %11.3f %8.0f %8.2f %9.3f %10.3f\n", r.op, r.direction, g, p50, p99, p999,
                l.gbps, l.inflight, l.gbps > 0 ? g / l.gbps : 0.0, cpu, l.cpu);
    if (o_.json)
      std::printf("{\"system\": \"kvxfer\", \"mode\": \"store\", \"op\": \"shared %s\", \"direction\": \"%s\", \"shared\": \"s3\", "
                  "\"num_blocks\": %llu, \"block_bytes\": %llu, \"blocks_per_batch\": %llu, \"tier_threads\": %u, \"gbps\": %.4f, "
                  "\"p50_ms\": %.3f, \"p99_ms\": %.3f, \"p999_ms\": %.3f, \"cpu_s_per_gb\": %.4f, \"limit_gbps\": %.4f, "
                  "\"limit_inflight\": %.0f, \"limit_req_p50_ms\": %.3f, \"limit_req_p99_ms\": %.3f, \"limit_req_p999_ms\": %.3f, "
                  "\"limit_cpu_s_per_gb\": %.4f, \"ratio\": %.4f}\n",
                  r.op, r.direction, (unsigned long long)o_.num_blocks, (unsigned long long)block_bytes_,
                  (unsigned long long)o_.blocks_per_batch, threads, g, p50, p99, p999, cpu, l.gbps, l.inflight, l.p50, l.p99,
                  l.p999, l.cpu, l.gbps > 0 ? g / l.gbps : 0.0);
  }
  std::printf("p50/p99/p99.9 ms: ours per batch of %llu block(s) (%zu batches in flight at most), the limit's per request at "
              "its best concurrency (put: p50 %.2f, p99 %.2f, p99.9 %.2f; get: p50 %.2f, p99 %.2f, p99.9 %.2f); CPU s/GB: each "
              "process's own (the server's is neither's). The reader's tier: %llu hits, %llu misses, %llu failed checks, %llu "
              "requests\n",
              (unsigned long long)o_.blocks_per_batch, kWindow, best[0].p50, best[0].p99, best[0].p999, best[1].p50, best[1].p99,
              best[1].p999, (unsigned long long)k.shared_hits, (unsigned long long)k.shared_misses,
              (unsigned long long)k.shared_integrity_failures, (unsigned long long)k.shared_requests);
  return 0;
}

int StoreRun::run() {
  const uint32_t nbases = hc_.kind == KVX_LAYOUT_FULLY_CONTIGUOUS ? 1 : (uint32_t)o_.num_layers;
  const uint64_t base_bytes = block_bytes_ * o_.num_blocks / nbases;
  fill_pattern(host_, nbases, base_bytes, 0);
  run_pass(e_, host_, device_, o_);
  std::printf("%s\n", kvx_version_string());
  std::printf("store: device %s, layout %s (host %s), %llu blocks x %.2f MB, %llu blocks/batch, %d iterations, %u shard%s "
              "in %s (%s), disk I/O by %s; plain: the same blocks to and from %u disk layout%s%s\n",
              dev_ < 0 ? "emulated" : std::to_string(dev_).c_str(), o_.layout.c_str(), o_.host_layout.c_str(),
              (unsigned long long)o_.num_blocks, block_bytes_ / 1e6, (unsigned long long)o_.blocks_per_batch, o_.iterations,
              o_.shards, o_.shards == 1 ? "" : "s", dir_.c_str(), o_.buffered ? "buffered" : "O_DIRECT",
              io_backend_name(e_.io_backend()), o_.shards, o_.shards == 1 ? "" : "s",
              o_.checksum ? " (checksummed, as the store's are)" : " (not checksummed; the store's are: --checksum for both)");
  std::printf("%-12s %-16s %9s %9s %9s %11s %8s %9s %10s\n", "op", "direction", "GB/s", "p50 ms", "p99 ms", "plain GB/s",
              "/ plain", "CPU s/GB", "plain s/GB");

  const kvx_store_config c = store_config(false);
  store_ = std::make_unique<kvx::Store>(e_, dir_, c);
  uint64_t gen = 0;
  kvx::Store &s = *store_;
  measure("put", "device-to-store", false, [&] { return put_pass(s, device_, gen); },
          [&] { return plain_pass(device_, true, files_); });
  measure("get", "store-to-device", false, [&] { return get_pass(s, device_, gen); },
          [&] { return plain_pass(device_, false, files_); });
  measure("put", "host-to-store", false, [&] { return put_pass(s, host_, gen); },
          [&] { return plain_pass(host_, true, files_); });
  measure("get", "store-to-host", false, [&] { return get_pass(s, check_host_, gen); },
          [&] { return plain_pass(check_host_, false, files_); });
  {
    kvx::Store durable(e_, durable_dir_, store_config(true));
    uint64_t dgen = 0;
    measure("durable put", "device-to-store", true, [&] { return put_pass(durable, device_, dgen); },
            [&] { return plain_pass(device_, true, sync_files_); });
  }
  if (o_.shared && shared_rows() != 0) return 1;
  if ((!o_.shared_s3.empty() || !o_.s3_server.empty()) && s3_rows() != 0) return 1;
  std::printf("GB/s = 1e9 B/s of payload; / plain = the store's GB/s over the plain transfers'; plain s/GB = their CPU s/GB\n");

  // Every byte the store gave back must be what was put: the last get was of host_'s
  // blocks, into check_host_ (after the plain reads into it, which hold the same bytes).
  get_pass(s, check_host_, gen);
  for (uint32_t l = 0; l < nbases; l++)
    if (std::memcmp(reinterpret_cast<void *>(host_.base(l)), reinterpret_cast<void *>(check_host_.base(l)), base_bytes) != 0) {
      std::fprintf(stderr, "bench: VERIFY FAILED: bytes got from the store differ from those put (base %u)\n", l);
      return 1;
    }
  lookup_row(s, gen);
  open_row();
  const kvx_store_counters k = store_->stats();
  std::printf("store since the last open: %llu entries, %llu puts, %llu dedups, %llu evictions, %llu integrity failures\n",
              (unsigned long long)k.entries, (unsigned long long)k.puts, (unsigned long long)k.dedups,
              (unsigned long long)k.evictions, (unsigned long long)k.integrity_failures);
  std::printf("verify: every byte got from the store matches what was put\n");
  std::fflush(stdout);
  return 0;
}

}  // namespace

int run_store(const Options &o) {
  StoreRun r(o);
  return r.run();
}

}  // namespace bench
