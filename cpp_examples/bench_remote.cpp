// --remote (bench_remote.h): the serving peer and the puller.
#include "bench_remote.h"

#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace bench {

namespace {

// Reads or writes exactly `n` bytes of a pipe; false on EOF or error.
bool pipe_io(int fd, void *buf, size_t n, bool write) {
  auto *p = static_cast<uint8_t *>(buf);
  while (n > 0) {
    ssize_t k = write ? ::write(fd, p, n) : ::read(fd, p, n);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return false;
    p += k, n -= (size_t)k;
  }
  return true;
}

// The host layouts' bases and their bytes for a layout config.
std::pair<uint32_t, uint64_t> host_bases(const kvx_layout_config &hc, uint64_t total) {
  uint32_t n = hc.kind == KVX_LAYOUT_FULLY_CONTIGUOUS ? 1 : (uint32_t)hc.num_layers;
  return {n, total / n};
}

const uint64_t PEER_SALT = 0x5EED000000000000ull;  // the peer's bytes differ from ours

// The serving process: exports [device, pinned host] layouts holding its own pattern,
// sends the blob (length, bytes) on `blob_fd`, serves until `hold_fd` reaches EOF.
int serve_remote(const Options &o, int blob_fd, int hold_fd) {
  const kvx_engine_config ec = engine_config(o);
  kvx::Engine e(&ec);
  const auto [lc, hc] = layout_configs(o);
  kvx::Layout device = e.create_device_layout(lc);
  kvx::Layout host = e.create_host_layout(hc, KVX_HOST_PINNED);
  const auto [nbases, base_bytes] = host_bases(hc, device.block_bytes() * o.num_blocks);
  fill_pattern(host, nbases, base_bytes, PEER_SALT);
  run_pass(e, host, device, o);
  std::vector<uint8_t> blob = e.export_layouts({&device, &host});
  uint64_t n = blob.size();
  if (!pipe_io(blob_fd, &n, sizeof n, true) || !pipe_io(blob_fd, blob.data(), blob.size(), true)) return 1;
  ::close(blob_fd);
  char c;
  while (::read(hold_fd, &c, 1) > 0 || errno == EINTR) {
  }
  return 0;
}

// The serving child: it ends when the puller closes its end of the hold pipe (also when
// the puller dies), and is reaped here.
struct ServingPeer {
  pid_t pid = -1;
  int hold_fd = -1;
  ~ServingPeer() {
    if (hold_fd >= 0) ::close(hold_fd);
    int st = 0;
    if (pid > 0) ::waitpid(pid, &st, 0);
  }
};

// Forks the serving peer (`peer` then holds it) and reads the blob it sends. False
// (having said why) when the peer cannot be started or exits before sending it.
bool start_peer(const Options &o, ServingPeer &peer, std::vector<uint8_t> &blob) {
  int blob_pipe[2], hold_pipe[2];
  if (::pipe(blob_pipe) != 0 || ::pipe(hold_pipe) != 0) {
    std::perror("bench: pipe");
    return false;
  }
  std::fflush(stdout);
  pid_t pid = ::fork();
  if (pid < 0) {
    std::perror("bench: fork");
    return false;
  }
  if (pid == 0) {
    ::close(blob_pipe[0]), ::close(hold_pipe[1]);
    int rc = 1;
    try {
      rc = serve_remote(o, blob_pipe[1], hold_pipe[0]);
    } catch (const kvx::Error &err) {
      std::fprintf(stderr, "bench (serving process): %s\n", err.what());
    }
    std::fflush(stdout);
    std::_Exit(rc);
  }
  ::close(blob_pipe[1]), ::close(hold_pipe[0]);
  peer.pid = pid, peer.hold_fd = hold_pipe[1];
  uint64_t n = 0;
  bool got = pipe_io(blob_pipe[0], &n, sizeof n, false) && n < (1u << 30);
  if (got) blob.resize(n), got = pipe_io(blob_pipe[0], blob.data(), n, false);
  ::close(blob_pipe[0]);
  if (!got) {
    std::fprintf(stderr, "bench: the serving process exited before sending its blob (its message is above)\n");
    return false;
  }
  return true;
}

struct RemoteDirection {
  const char *name;
  const kvx::Layout &src, &dst;
};

// One direction's row (and --json object): batch GB/s over the timed passes, then `nreq`
// requests one at a time, submit -> completion seen by wait.
void measure_remote(kvx::Engine &e, const RemoteDirection &d, const Options &o, uint64_t block_bytes, size_t nreq) {
  for (int i = 0; i < o.warmup; i++) run_pass(e, d.src, d.dst, o);
  double secs = 0, cpu0 = cpu_seconds();
  std::vector<double> batch_ms;
  for (int i = 0; i < o.iterations; i++) {
    Result r = run_pass(e, d.src, d.dst, o);
    secs += r.seconds;
    batch_ms.insert(batch_ms.end(), r.batch_ms.begin(), r.batch_ms.end());
  }
  double cpu = cpu_seconds() - cpu0;
  std::vector<double> us;
  for (auto &v : request_ids(o.num_blocks, o.blocks_per_batch, nreq, o.random_blocks)) {
    auto t0 = Clock::now();
    kvx::Request r = e.submit(d.src, v, d.dst, v);
    r.wait();
    us.push_back(us_since(t0));
  }
  const uint64_t bytes = block_bytes * o.num_blocks * o.iterations;
  const Percentiles p = percentiles_us(us);
  std::printf("%-24s %9.2f %9.2f %9.2f %11.1f %11.1f %11.1f %9.3f\n", d.name, gbps(bytes, secs), percentile(batch_ms, 0.5),
              percentile(batch_ms, 0.99), p.p50, p.p99, p.p999, cpu / (bytes / 1e9));
  if (o.json)
    std::printf("{\"system\": \"kvxfer\", \"mode\": \"remote\", \"direction\": \"%s\", \"layout\": \"%s\", \"blocks_per_batch\": %llu, "
                "\"num_blocks\": %llu, \"block_bytes\": %llu, \"gbps\": %.3f, \"p50_ms\": %.3f, \"p99_ms\": %.3f, "
                "\"req_p50_us\": %.1f, \"req_p99_us\": %.1f, \"req_p999_us\": %.1f, \"cpu_s_per_gb\": %.4f}\n",
                d.name, o.layout.c_str(), (unsigned long long)o.blocks_per_batch, (unsigned long long)o.num_blocks,
                (unsigned long long)block_bytes, gbps(bytes, secs), percentile(batch_ms, 0.5), percentile(batch_ms, 0.99), p.p50,
                p.p99, p.p999, cpu / (bytes / 1e9));
}

// Our bytes to both remote layouts and back: a write that moved nothing leaves the
// peer's own bytes there, a read that moved nothing leaves zeros.
int verify_remote(kvx::Engine &e, const kvx::Layout &host, const kvx::Layout &device, const kvx::Layout &check_host,
                  const kvx::Layout &rdev, const kvx::Layout &rhost, const Options &o) {
  const auto [nbases, base_bytes] = host_bases(layout_configs(o).second, device.block_bytes() * o.num_blocks);
  run_pass(e, host, device, o);
  int rc = 0;
  for (const kvx::Layout *r : {&rdev, &rhost}) {
    run_pass(e, device, *r, o);
    for (uint32_t l = 0; l < nbases; l++) std::memset(reinterpret_cast<void *>(check_host.base(l)), 0, base_bytes);
    run_pass(e, *r, check_host, o);
    for (uint32_t l = 0; l < nbases && rc == 0; l++)
      if (std::memcmp(reinterpret_cast<void *>(host.base(l)), reinterpret_cast<void *>(check_host.base(l)), base_bytes) != 0) {
        std::fprintf(stderr, "bench: VERIFY FAILED: bytes read back from the remote %s layout differ from those written (base %u)\n",
                     r == &rdev ? "device" : "host", l);
        rc = 1;
      }
  }
  if (rc == 0) std::printf("verify: every byte written to the remote layouts read back the same\n");
  return rc;
}

}  // namespace

int run_remote(const Options &o) {
  ServingPeer peer;
  std::vector<uint8_t> blob;
  if (!start_peer(o, peer, blob)) return 1;

  const kvx_engine_config ec = engine_config(o);
  kvx::Engine e(&ec);
  const int32_t dev = e.device();
  const auto [lc, hc] = layout_configs(o);
  kvx::Layout device = e.create_device_layout(lc);
  kvx::Layout host = e.create_host_layout(hc, KVX_HOST_PINNED);
  kvx::Layout check_host = e.create_host_layout(hc, KVX_HOST_PINNED);
  const uint64_t block_bytes = device.block_bytes(), total = block_bytes * o.num_blocks;
  const auto [nbases, base_bytes] = host_bases(hc, total);
  fill_pattern(host, nbases, base_bytes, 0);
  run_pass(e, host, device, o);
  std::vector<kvx::Layout> remote = e.import_layouts(blob, 10000);  // [device, pinned host] of the peer
  const kvx::Layout &rdev = remote.at(0), &rhost = remote.at(1);

  std::printf("%s\n", kvx_version_string());
  std::printf("remote: peer process %d on this host (its blob: %zu B), device %s, layout %s (host %s)%s, %llu blocks x %.2f MB, "
              "%llu blocks/batch, %d iterations\n",
              (int)peer.pid, blob.size(), dev < 0 ? "emulated" : std::to_string(dev).c_str(), o.layout.c_str(), o.host_layout.c_str(),
              o.random_blocks ? ", random blocks" : "", (unsigned long long)o.num_blocks, block_bytes / 1e6,
              (unsigned long long)o.blocks_per_batch, o.iterations);
  std::printf("%-24s %9s %9s %9s %11s %11s %11s %9s\n", "direction", "GB/s", "p50 ms", "p99 ms", "req p50 us", "req p99 us",
              "req p99.9 us", "CPU s/GB");
  const RemoteDirection dirs[] = {{"remote-device-to-device", rdev, device},
                                  {"device-to-remote-device", device, rdev},
                                  {"remote-host-to-device", rhost, device},
                                  {"device-to-remote-host", device, rhost},
                                  {"remote-host-to-host", rhost, check_host},
                                  {"host-to-remote-host", host, rhost}};
  bool any = false;
  const size_t nreq = o.requests ? (size_t)o.requests : (size_t)o.iterations * 100;
  for (const RemoteDirection &d : dirs) {
    if (o.direction != "all" && o.direction != d.name) continue;
    any = true;
    measure_remote(e, d, o, block_bytes, nreq);
  }
  if (!any) {
    std::fprintf(stderr, "bench: --remote: unknown --direction %s\n", o.direction.c_str());
    return 2;
  }
  std::printf("GB/s = 1e9 B/s of payload; p50/p99 ms: batches of one pass submitted at once; req: %zu requests of %llu block(s) "
              "one at a time. The limit: cpp_examples/remote_limit.rs (NIXL directly, same descriptors).\n",
              nreq, (unsigned long long)o.blocks_per_batch);
  return o.verify ? verify_remote(e, host, device, check_host, rdev, rhost, o) : 0;
}

}  // namespace bench
