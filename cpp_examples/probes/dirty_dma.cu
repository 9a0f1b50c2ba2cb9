// How fast the DMA engine reads pinned host memory that CPU threads have just written
// (a bounce slot right after an I/O worker's read into it), and what handing those
// lines on from the writers' caches first changes. No kvxfer.
//
//   nvcc -O2 -o dirty_dma cpp_examples/probes/dirty_dma.cu && ./dirty_dma [/dev/shm/file]
//
// For each piece size: N threads each pread pieces of a hot 12 MiB tmpfs file into
// their parts of a pinned buffer; then one host->device copy per piece on one stream,
// timed alone. Variants: the lines left as the reads wrote them; each thread evicts its
// pieces' lines (clflushopt), writes them back (clwb) or demotes them to L3 (cldemote,
// where the CPU has it) before the copy; each thread reads 64 KiB at a time into a
// buffer of its own that stays in its cache and streams that into the pinned buffer
// with non-temporal stores (staged), or streams straight from a mapping of the file
// (mapped); one thread reads the whole file; the buffer written long ago (clean, out of
// the caches). The read phase's time (slowest thread) is printed beside the copy's.
#include <cuda_runtime.h>
#include <fcntl.h>
#include <immintrin.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

using Clock = std::chrono::steady_clock;
static double us(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double, std::micro>(b - a).count(); }

#define CHECK(x)                                                                  \
  do {                                                                            \
    cudaError_t e = (x);                                                          \
    if (e != cudaSuccess) {                                                       \
      std::fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e));                \
      std::exit(1);                                                               \
    }                                                                             \
  } while (0)

enum Handoff { NONE, CLFLUSHOPT, CLWB, CLDEMOTE, STAGED, MAPPED, ONE_READER };
static const char *handoff_name[] = {"", ", clflushopt", ", clwb", ", cldemote", ", staged + NT stores", ", mapped + NT stores", ""};

// Copies n bytes (a multiple of 128, both ends 32-byte aligned) with non-temporal stores:
// the lines go to memory without staying modified in this core's cache.
__attribute__((target("avx2"))) static void stream_copy(char *dst, const char *src, size_t n) {
  for (size_t i = 0; i < n; i += 128) {
    __m256i a = _mm256_loadu_si256((const __m256i *)(src + i)), b = _mm256_loadu_si256((const __m256i *)(src + i + 32));
    __m256i c = _mm256_loadu_si256((const __m256i *)(src + i + 64)), d = _mm256_loadu_si256((const __m256i *)(src + i + 96));
    _mm256_stream_si256((__m256i *)(dst + i), a), _mm256_stream_si256((__m256i *)(dst + i + 32), b);
    _mm256_stream_si256((__m256i *)(dst + i + 64), c), _mm256_stream_si256((__m256i *)(dst + i + 96), d);
  }
  _mm_sfence();
}

__attribute__((target("clflushopt,clwb,cldemote"))) static void hand_on(Handoff how, char *p, size_t n) {
  switch (how) {
    case CLFLUSHOPT: for (size_t i = 0; i < n; i += 64) _mm_clflushopt(p + i); break;
    case CLWB: for (size_t i = 0; i < n; i += 64) _mm_clwb(p + i); break;
    case CLDEMOTE: for (size_t i = 0; i < n; i += 64) _cldemote(p + i); break;
    default: return;
  }
  _mm_sfence();
}

static bool cpu_has(const char *flag) {
  FILE *f = std::fopen("/proc/cpuinfo", "r");
  if (!f) return false;
  static char line[1 << 16];
  bool found = false;
  while (std::fgets(line, sizeof line, f))
    if (std::strncmp(line, "flags", 5) == 0) {
      for (char *t = std::strtok(line, " \t\n"); t; t = std::strtok(nullptr, " \t\n")) found |= std::strcmp(t, flag) == 0;
      break;
    }
  std::fclose(f);
  return found;
}

int main(int argc, char **argv) {
  const size_t total = 12u << 20;
  const char *path = argc > 1 ? argv[1] : "/dev/shm/dirty_dma.bin";
  {
    std::vector<char> data(total, 0x5a);
    int out = ::open(path, O_CREAT | O_TRUNC | O_WRONLY, 0644);
    if (out < 0 || ::write(out, data.data(), total) != (ssize_t)total) { std::perror("write file"); return 1; }
    ::close(out);
  }
  int fd = ::open(path, O_RDONLY);
  char *host;
  CHECK(cudaHostAlloc((void **)&host, total, cudaHostAllocPortable));
  std::memset(host, 1, total);
  void *dev;
  CHECK(cudaMalloc(&dev, total));
  cudaStream_t s;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  std::vector<char> evict(1u << 30, 0);
  const char *map = (const char *)::mmap(nullptr, total, PROT_READ, MAP_SHARED | MAP_POPULATE, fd, 0);
  if (map == MAP_FAILED) { std::perror("mmap"); return 1; }

  auto copy = [&](size_t piece) {
    auto t0 = Clock::now();
    for (size_t off = 0; off < total; off += piece)
      CHECK(cudaMemcpyAsync((char *)dev + off, host + off, piece, cudaMemcpyHostToDevice, s));
    CHECK(cudaStreamSynchronize(s));
    return us(t0, Clock::now());
  };
  // Threads read pieces round-robin, each handing its lines on after its read.
  // Returns the slowest thread's hand-on time and the read phase's wall time.
  auto read_by = [&](size_t piece, unsigned threads, Handoff how) {
    std::vector<std::thread> pool;
    std::vector<double> spent(threads, 0);
    auto r0 = Clock::now();
    for (unsigned t = 0; t < threads; t++)
      pool.emplace_back([&, t] {
        alignas(64) static thread_local char stage[64 << 10];
        for (size_t off = t * piece; off < total; off += threads * piece) {
          if (how == STAGED) {
            for (size_t at = 0; at < piece; at += sizeof stage) {
              if (::pread(fd, stage, sizeof stage, (off_t)(off + at)) != (ssize_t)sizeof stage) std::abort();
              stream_copy(host + off + at, stage, sizeof stage);
            }
            continue;
          }
          if (how == MAPPED) {
            stream_copy(host + off, map + off, piece);
            continue;
          }
          if (::pread(fd, host + off, piece, (off_t)off) != (ssize_t)piece) std::abort();
          auto a = Clock::now();
          hand_on(how, host + off, piece);
          spent[t] += us(a, Clock::now());
        }
      });
    for (auto &t : pool) t.join();
    return std::make_pair(*std::max_element(spent.begin(), spent.end()), us(r0, Clock::now()));
  };
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  const int reps = 30;
  copy(total);
  std::printf("12 MiB host->device, copy time alone (median of %d), after the source was written by:\n", reps);
  {
    std::vector<double> c;
    for (int i = 0; i < reps; i++) {
      std::memset(host, 2, total);
      std::memset(evict.data(), i, evict.size());  // pushes the buffer out of the caches
      c.push_back(copy(total));
    }
    double m = median(c);
    std::printf("  %-56s %7.1f us  %5.1f GB/s\n", "nobody lately (clean, one copy)", m, total / m / 1e3);
  }
  std::vector<Handoff> handoffs = {NONE, CLFLUSHOPT};
  if (cpu_has("clwb")) handoffs.push_back(CLWB);
  if (cpu_has("cldemote")) handoffs.push_back(CLDEMOTE);
  handoffs.push_back(STAGED);
  handoffs.push_back(MAPPED);
  handoffs.push_back(ONE_READER);
  for (size_t piece : {2u << 20, 1u << 20, 512u << 10, 256u << 10}) {
    unsigned threads = (unsigned)std::min<size_t>(12, total / piece);
    for (Handoff how : handoffs) {
      std::vector<double> c, spent, read;
      for (int i = 0; i < reps; i++) {
        if (how == ONE_READER) {
          auto r0 = Clock::now();
          if (::pread(fd, host, total, 0) != (ssize_t)total) std::abort();
          spent.push_back(0), read.push_back(us(r0, Clock::now()));
        } else {
          auto [h, r] = read_by(piece, threads, how);
          spent.push_back(h), read.push_back(r);
        }
        c.push_back(copy(piece));
      }
      double m = median(c);
      char what[96];
      if (how == ONE_READER) std::snprintf(what, sizeof what, "one thread reading it all");
      else std::snprintf(what, sizeof what, "%u threads reading %zu KiB pieces%s", threads, piece >> 10, handoff_name[how]);
      std::printf("  %-56s %7.1f us  %5.1f GB/s   (%zu KiB copies; read phase %.1f us", what, m, total / m / 1e3, piece >> 10,
                  median(read));
      if (how != NONE && how < STAGED) std::printf("; %.1f us per thread for that", median(spent));
      std::printf(")\n");
    }
  }
  ::munmap((void *)map, total);
  ::close(fd);
  ::unlink(path);
  return 0;
}
