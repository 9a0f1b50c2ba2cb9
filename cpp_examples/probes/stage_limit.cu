// stage_limit: what a stream of staged scatter chunks costs the copy engine, measured
// without kvxfer. The shape is kvxfer's for a KVX_DISK_MAPPED file into vLLM's layout:
// each 2 MiB chunk is one DMA of a dense host span into a device staging area, then one
// kvx_copy_regions-like launch scatters its 64 regions of 32 KiB to random places; chunks
// alternate two streams by slot parity, so one chunk's kernel runs beside the next DMA.
//   one copy       the whole buffer in one cudaMemcpyAsync (PCIe)
//   spans          the chunks' DMAs alone
//   table copy     each chunk's region table copied to the device before its DMA
//   mapped table   the kernel reads the table from pinned host memory the device maps
//   + fences       the mapped table with 32 slots recycled by a fence thread per stream,
//                  asleep in cudaEventSynchronize (blocking-sync events) or looking with
//                  cudaEventQuery
// Host memory is a registered /dev/shm mapping, as for a mapped file; chunks are taken
// in random order, as random block ids are.
// Build on the GPU machine: nvcc -O2 -std=c++17 -o stage_limit cpp_examples/probes/stage_limit.cu
// Run: ./stage_limit [GiB=2]
#include <cuda_runtime.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

struct Region { unsigned long long dst, src, len; };

__global__ void copy_regions(const Region *t, unsigned count) {
  unsigned i = blockIdx.y;
  if (i >= count) return;
  Region r = t[i];
  const uint4 *s = (const uint4 *)r.src;
  uint4 *d = (uint4 *)r.dst;
  for (unsigned long long k = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; k < r.len / 16;
       k += (unsigned long long)gridDim.x * blockDim.x)
    d[k] = s[k];
}

#define CK(x) do { cudaError_t e_ = (x); if (e_) { std::printf("%s: %s\n", #x, cudaGetErrorString(e_)); std::exit(1); } } while (0)

struct Queue {
  std::mutex m;
  std::condition_variable cv;
  std::deque<int> q;
  void push(int v) { { std::lock_guard<std::mutex> g(m); q.push_back(v); } cv.notify_one(); }
  int pop() { std::unique_lock<std::mutex> g(m); cv.wait(g, [&] { return !q.empty(); }); int v = q.front(); q.pop_front(); return v; }
};

enum Mode { ONE_COPY, SPANS, TABLE_COPY, MAPPED_TABLE, FENCES_ASLEEP, FENCES_LOOKING };
const char *names[] = {"one copy", "spans", "table copy", "mapped table", "+ fences asleep", "+ fences looking"};

int main(int argc, char **argv) {
  const size_t total = (argc > 1 ? std::strtoull(argv[1], nullptr, 0) : 2) << 30;
  const size_t region = 32 << 10, chunk = 2 << 20, per = chunk / region, nch = total / chunk;
  const int SLOTS = 32;
  int fd = open("/dev/shm/stage_limit", O_RDWR | O_CREAT | O_TRUNC, 0600);
  if (fd < 0 || ftruncate(fd, total)) { std::perror("/dev/shm/stage_limit"); return 1; }
  char *host = (char *)mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  unlink("/dev/shm/stage_limit");
  for (size_t i = 0; i < total; i += 4096) host[i] = (char)i;
  CK(cudaHostRegister(host, total, cudaHostRegisterPortable | cudaHostRegisterMapped));
  char *dev, *staging;
  CK(cudaMalloc(&dev, total));
  CK(cudaMalloc(&staging, SLOTS * chunk));
  Region *htab, *dtab;
  CK(cudaHostAlloc(&htab, SLOTS * per * sizeof(Region), cudaHostAllocPortable | cudaHostAllocMapped));
  CK(cudaMalloc(&dtab, SLOTS * per * sizeof(Region)));
  cudaStream_t st[2];
  for (auto &s : st) CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  std::vector<cudaEvent_t> ev(SLOTS);
  for (auto &e : ev) CK(cudaEventCreateWithFlags(&e, cudaEventBlockingSync | cudaEventDisableTiming));
  std::vector<size_t> dst(total / region), order(nch);
  for (size_t i = 0; i < dst.size(); i++) dst[i] = i;
  for (size_t i = 0; i < nch; i++) order[i] = i;
  std::shuffle(dst.begin(), dst.end(), std::mt19937(1));
  std::shuffle(order.begin(), order.end(), std::mt19937(2));

  auto run = [&](Mode mode) -> double {
    CK(cudaDeviceSynchronize());
    const bool fenced = mode >= FENCES_ASLEEP;
    Queue free_slots, lane[2];
    for (int i = 0; i < SLOTS; i++) free_slots.push(i);
    std::vector<std::thread> fences;
    if (fenced)
      for (int l = 0; l < 2; l++)
        fences.emplace_back([&, l] {
          for (int s; (s = lane[l].pop()) >= 0; free_slots.push(s)) {
            if (mode == FENCES_ASLEEP) CK(cudaEventSynchronize(ev[s]));
            else while (cudaEventQuery(ev[s]) == cudaErrorNotReady) std::this_thread::yield();
          }
        });
    auto t0 = std::chrono::steady_clock::now();
    if (mode == ONE_COPY) CK(cudaMemcpyAsync(dev, host, total, cudaMemcpyHostToDevice, st[0]));
    for (size_t c = 0; mode != ONE_COPY && c < nch; c++) {
      int slot = fenced ? free_slots.pop() : (int)(c % SLOTS);
      cudaStream_t s = st[slot % 2];
      char *sg = staging + slot * chunk;
      Region *t = htab + slot * per;
      for (size_t k = 0; k < per; k++) t[k] = Region{(unsigned long long)(dev + dst[c * per + k] * region), (unsigned long long)(sg + k * region), region};
      if (mode == TABLE_COPY) cudaMemcpyAsync(dtab + slot * per, t, per * sizeof(Region), cudaMemcpyHostToDevice, s);
      cudaMemcpyAsync(sg, host + order[c] * chunk, chunk, cudaMemcpyHostToDevice, s);
      if (mode != SPANS) copy_regions<<<dim3(1, per), 256, 0, s>>>(mode == TABLE_COPY ? dtab + slot * per : t, per);
      if (fenced) { cudaEventRecord(ev[slot], s); lane[slot % 2].push(slot); }
    }
    CK(cudaDeviceSynchronize());
    double gbps = total / std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / 1e9;
    for (int l = 0; fenced && l < 2; l++) lane[l].push(-1);
    for (auto &f : fences) f.join();
    return gbps;
  };
  std::printf("%zu GiB, 2 MiB chunks of 64 random 32 KiB regions, two streams by slot parity\n", total >> 30);
  for (Mode m : {ONE_COPY, SPANS, TABLE_COPY, MAPPED_TABLE, FENCES_ASLEEP, FENCES_LOOKING}) {
    std::vector<double> v;
    for (int i = 0; i < 5; i++) v.push_back(run(m));
    std::sort(v.begin(), v.end());
    std::printf("%-18s median %6.2f  best %6.2f GB/s\n", names[m], v[2], v[4]);
  }
  CK(cudaGetLastError());
  return 0;
}
