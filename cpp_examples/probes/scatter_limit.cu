// scatter_limit: how fast can this GPU move many small regions scattered over pinned host
// memory, and by which mechanism? The limit behind the bench's "scattered" lines (vLLM's
// 32 KiB regions at random block ids), measured without kvxfer:
//   contiguous  one cudaMemcpyAsync of the same bytes (PCIe)
//   per-region  one cudaMemcpyAsync per region
//   batch       one cudaMemcpyBatchAsync for all regions (CUDA 12.8+)
//   kernel      one kernel: SMs load/store the pinned host memory directly (zero-copy),
//               swept over the number of thread blocks
//   bulk        Hopper (sm_90) only: one thread per block moves each region through
//               shared memory with the bulk copy engine (cp.async.bulk), host -> shared ->
//               device, so the host side sees the TMA's large reads, not the SMs' 16-byte
//               loads; swept over piece size, pieces in flight and blocks
//   both ways   host-to-device and device-to-host at once on two streams (what mixed
//               submitters do): DMA both ways, kernels both ways, and one of each
// Build on the GPU machine: nvcc -O2 -std=c++17 -arch=native -o scatter_limit cpp_examples/probes/scatter_limit.cu (native: the
// bulk shape needs sm_90 code, and runs only where the GPU has it)
// Run: ./scatter_limit [region_bytes=32768] [regions=2048] [pool_regions=65536]
#include <cuda_runtime.h>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#define CK(x)                                                                                   \
  do {                                                                                          \
    cudaError_t e_ = (x);                                                                       \
    if (e_ != cudaSuccess) {                                                                    \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                             \
    }                                                                                           \
  } while (0)

struct Region {
  unsigned long long dst, src, len;
};

// Each block takes regions in turn; 16-byte moves, four in flight per thread so that a
// block keeps enough PCIe reads outstanding.
__global__ void copy_regions(const Region *__restrict__ regions, unsigned count) {
  for (unsigned i = blockIdx.x; i < count; i += gridDim.x) {
    const Region r = regions[i];
    const uint4 *s = reinterpret_cast<const uint4 *>(r.src);
    uint4 *d = reinterpret_cast<uint4 *>(r.dst);
    unsigned long long n = r.len >> 4;
    unsigned long long k = threadIdx.x;
    for (; k + 3 * blockDim.x < n; k += 4 * blockDim.x) {
      uint4 a = s[k], b = s[k + blockDim.x], c = s[k + 2 * blockDim.x], e = s[k + 3 * blockDim.x];
      d[k] = a, d[k + blockDim.x] = b, d[k + 2 * blockDim.x] = c, d[k + 3 * blockDim.x] = e;
    }
    for (; k < n; k += blockDim.x) d[k] = s[k];
  }
}

// The bulk copy engine: thread 0 of each block walks its regions in pieces of `P` bytes;
// each piece is loaded into shared memory by one cp.async.bulk (completion counted on an
// mbarrier) and stored from there by another, `S` pieces in flight.
struct Cursor {
  unsigned i;
  unsigned long long off;
  __device__ bool next(const Region *t, unsigned count, unsigned P, unsigned long long &src, unsigned long long &dst, unsigned &len) {
    while (i < count) {
      Region r = t[i];
      if (off < r.len) {
        src = r.src + off, dst = r.dst + off;
        len = (unsigned)min((unsigned long long)P, r.len - off);
        off += len;
        return true;
      }
      i += gridDim.x, off = 0;
    }
    return false;
  }
};

template <unsigned P, unsigned S>
__global__ void bulk_regions(const Region *__restrict__ regions, unsigned count) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(128) unsigned char buf[];
  __shared__ __align__(8) unsigned long long bar[S];
  if (threadIdx.x != 0) return;
  unsigned sbuf = (unsigned)__cvta_generic_to_shared(buf), sbar = (unsigned)__cvta_generic_to_shared(bar);
  for (unsigned k = 0; k < S; k++) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(sbar + 8 * k));
  asm volatile("fence.mbarrier_init.release.cluster;\n\tfence.proxy.async.shared::cta;" ::: "memory");
  Cursor lc{blockIdx.x, 0}, sc{blockIdx.x, 0};
  unsigned long long loaded = 0, stored = 0, src, dst;
  unsigned len;
  auto load = [&](unsigned st) {
    if (!lc.next(regions, count, P, src, dst, len)) return false;
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(sbar + 8 * st), "r"(len) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(sbuf + st * P), "l"(src),
                 "r"(len), "r"(sbar + 8 * st)
                 : "memory");
    return true;
  };
  while (loaded < S && load((unsigned)loaded)) loaded++;
  while (stored < loaded) {
    unsigned st = (unsigned)(stored % S), parity = (unsigned)((stored / S) & 1);
    asm volatile(
        "{\n\t.reg .pred p;\n"
        "WAIT:\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n\t@!p bra WAIT;\n}" ::"r"(sbar + 8 * st),
        "r"(parity)
        : "memory");
    sc.next(regions, count, P, src, dst, len);
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(sbuf + st * P), "r"(len) : "memory");
    asm volatile("cp.async.bulk.commit_group;\n\tcp.async.bulk.wait_group.read 0;" ::: "memory");
    stored++;
    if (load(st)) loaded++;
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
#endif
}

template <unsigned P, unsigned S>
static void bulk(unsigned blocks, const Region *t, unsigned n, cudaStream_t s) {
  CK(cudaFuncSetAttribute(bulk_regions<P, S>, cudaFuncAttributeMaxDynamicSharedMemorySize, P * S));
  bulk_regions<P, S><<<blocks, 32, P * S, s>>>(t, n);
}

template <class F>
static double gbps(size_t bytes, cudaStream_t s, F f) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  f();  // warm-up
  CK(cudaStreamSynchronize(s));
  std::vector<float> ms;
  for (int it = 0; it < 9; it++) {
    CK(cudaEventRecord(a, s));
    f();
    CK(cudaEventRecord(b, s));
    CK(cudaEventSynchronize(b));
    float m;
    CK(cudaEventElapsedTime(&m, a, b));
    ms.push_back(m);
  }
  std::sort(ms.begin(), ms.end());
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  return bytes / (ms[ms.size() / 2] * 1e6);
}

int main(int argc, char **argv) {
  size_t rb = argc > 1 ? std::strtoull(argv[1], 0, 0) : 32768;
  size_t n = argc > 2 ? std::strtoull(argv[2], 0, 0) : 2048;
  size_t pool = argc > 3 ? std::strtoull(argv[3], 0, 0) : 65536;
  size_t bytes = rb * n, pool_bytes = rb * pool;
  char *host, *dev;
  CK(cudaHostAlloc(&host, pool_bytes, cudaHostAllocPortable));
  CK(cudaMalloc(&dev, pool_bytes));
  // A pattern in every word, so the byte checks below can fail.
  for (size_t i = 0; i < pool_bytes; i += 8) *(unsigned long long *)(host + i) = i * 0x9E3779B97F4A7C15ull;
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  std::mt19937_64 rng(1);
  std::vector<size_t> ids(pool);
  for (size_t i = 0; i < pool; i++) ids[i] = i;
  std::shuffle(ids.begin(), ids.end(), rng);
  Region *table, *dtable;
  CK(cudaHostAlloc(&table, n * sizeof(Region), 0));
  CK(cudaMalloc(&dtable, n * sizeof(Region)));
  std::printf("%zu regions of %zu KiB at random places in %zu MiB, %.1f MiB per transfer\n", n, rb >> 10, pool_bytes >> 20,
              bytes / 1048576.0);
  for (int h2d = 1; h2d >= 0; h2d--) {
    std::vector<void *> dsts(n), srcs(n);
    std::vector<size_t> sizes(n, rb);
    for (size_t i = 0; i < n; i++) {
      char *hp = host + ids[i] * rb, *dp = dev + ids[(i * 7919) % pool] * rb;
      srcs[i] = h2d ? (void *)hp : (void *)dp;
      dsts[i] = h2d ? (void *)dp : (void *)hp;
      table[i] = {(unsigned long long)dsts[i], (unsigned long long)srcs[i], rb};
    }
    CK(cudaMemcpy(dtable, table, n * sizeof(Region), cudaMemcpyHostToDevice));
    const char *dir = h2d ? "host-to-device" : "device-to-host";
    double lim = gbps(bytes, s, [&] { CK(cudaMemcpyAsync(h2d ? dev : host, h2d ? host : dev, bytes, cudaMemcpyDefault, s)); });
    std::printf("%s contiguous        %6.2f GB/s\n", dir, lim);
    double per = gbps(bytes, s, [&] {
      for (size_t i = 0; i < n; i++) CK(cudaMemcpyAsync(dsts[i], srcs[i], rb, cudaMemcpyDefault, s));
    });
    std::printf("%s per-region        %6.2f GB/s (%.2f of contiguous)\n", dir, per, per / lim);
#if CUDART_VERSION >= 12080
    cudaMemcpyAttributes attr = {};
    attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
    size_t idx0 = 0;
    double batch = gbps(bytes, s, [&] {
#if CUDART_VERSION >= 13000
      CK(cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), n, &attr, &idx0, 1, s));
#else
      size_t fail;
      CK(cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), n, &attr, &idx0, 1, &fail, s));
#endif
    });
    std::printf("%s batch             %6.2f GB/s (%.2f of contiguous)\n", dir, batch, batch / lim);
#endif
    for (unsigned threads : {256u, 512u, 1024u})
      for (unsigned blocks : {8u, 16u, 32u, 66u, 132u, 264u}) {
        double k = gbps(bytes, s, [&] { copy_regions<<<blocks, threads, 0, s>>>(dtable, (unsigned)n); });
        CK(cudaGetLastError());
        std::printf("%s kernel %4u x %4u %6.2f GB/s (%.2f of contiguous)\n", dir, blocks, threads, k, k / lim);
      }
    cudaFuncAttributes built;  // the bulk shape's body exists only in sm_90 code
    CK(cudaFuncGetAttributes(&built, bulk_regions<8192, 4>));
    if (built.ptxVersion >= 90) {
      using Launch = void (*)(unsigned, const Region *, unsigned, cudaStream_t);
      struct { const char *name; Launch f; } shapes[] = {{"8K x 4", bulk<8192, 4>}, {"16K x 2", bulk<16384, 2>}, {"16K x 4", bulk<16384, 4>},
                                                          {"32K x 2", bulk<32768, 2>}, {"32K x 3", bulk<32768, 3>}};
      for (auto &sh : shapes)
        for (unsigned blocks : {132u, 264u, 528u}) {
          double k = gbps(bytes, s, [&] { sh.f(blocks, dtable, (unsigned)n, s); });
          CK(cudaGetLastError());
          std::printf("%s bulk %-7s x %4u %6.2f GB/s (%.2f of contiguous)\n", dir, sh.name, blocks, k, k / lim);
        }
      if (h2d) {  // the bulk path's bytes: zero a region's device copy, move it again, compare
        CK(cudaMemset(dsts[7], 0, rb));
        bulk<16384, 4>(264, dtable, (unsigned)n, s);
        CK(cudaStreamSynchronize(s));
        std::vector<char> got(rb);
        CK(cudaMemcpy(got.data(), dsts[7], rb, cudaMemcpyDeviceToHost));
        std::printf("bulk check: %s\n", std::equal(got.begin(), got.end(), (char *)srcs[7]) ? "bytes match" : "MISMATCH");
      }
    }
  }
  // Check the kernel moved the right bytes (last direction: device-to-host).
  std::vector<char> want(rb);
  CK(cudaMemcpy(want.data(), dev + ids[(5 * 7919) % pool] * rb, rb, cudaMemcpyDeviceToHost));
  bool ok = std::equal(want.begin(), want.end(), host + ids[5] * rb);
  std::printf("kernel check: %s\n", ok ? "bytes match" : "MISMATCH");
  // Both directions at once, on disjoint regions: H2D from host ids[i], D2H to host
  // ids[n + i] (7919 is odd, so i -> i * 7919 mod pool never repeats a device region).
  {
    cudaStream_t s2;
    CK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
    Region *t2, *dt[2];
    CK(cudaHostAlloc(&t2, 2 * n * sizeof(Region), 0));
    std::vector<void *> d[2], sr[2];
    std::vector<size_t> sizes(n, rb);
    for (int k = 0; k < 2; k++) {
      CK(cudaMalloc(&dt[k], n * sizeof(Region)));
      for (size_t i = 0; i < n; i++) {
        size_t j = k * n + i;
        char *hp = host + ids[j] * rb, *dp = dev + ids[(j * 7919) % pool] * rb;
        sr[k].push_back(k == 0 ? (void *)hp : (void *)dp);
        d[k].push_back(k == 0 ? (void *)dp : (void *)hp);
        t2[j] = {(unsigned long long)d[k][i], (unsigned long long)sr[k][i], rb};
      }
      CK(cudaMemcpy(dt[k], t2 + k * n, n * sizeof(Region), cudaMemcpyHostToDevice));
    }
    cudaStream_t st[2] = {s, s2};
    auto both = [&](auto f) {  // wall time of both directions, median of 9
      std::vector<double> v;
      for (int it = 0; it < 10; it++) {
        auto t0 = std::chrono::steady_clock::now();
        f(0), f(1);
        CK(cudaStreamSynchronize(s));
        CK(cudaStreamSynchronize(s2));
        if (it) v.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      }
      std::sort(v.begin(), v.end());
      return 2.0 * bytes / v[v.size() / 2] / 1e9;
    };
    auto dma = [&](int k) {
      CK(cudaMemcpyAsync(k == 0 ? dev : host + bytes * 2, k == 0 ? host : dev + bytes * 2, bytes, cudaMemcpyDefault, st[k]));
    };
    auto kernel = [&](int k, unsigned blocks) { copy_regions<<<blocks, 512, 0, st[k]>>>(dt[k], (unsigned)n); };
    std::printf("both ways contiguous DMA      %6.2f GB/s\n", both(dma));
    for (unsigned b : {33u, 66u, 132u}) std::printf("both ways kernels %3u blocks   %6.2f GB/s\n", b, both([&](int k) { kernel(k, b); }));
#if CUDART_VERSION >= 12080
    cudaMemcpyAttributes attr = {};
    attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
    size_t idx0 = 0;
    auto batch = [&](int k) {
#if CUDART_VERSION >= 13000
      CK(cudaMemcpyBatchAsync(d[k].data(), sr[k].data(), sizes.data(), n, &attr, &idx0, 1, st[k]));
#else
      size_t fail;
      CK(cudaMemcpyBatchAsync(d[k].data(), sr[k].data(), sizes.data(), n, &attr, &idx0, 1, &fail, st[k]));
#endif
    };
    std::printf("both ways batch DMA           %6.2f GB/s\n", both(batch));
    std::printf("kernel H2D + batch DMA D2H    %6.2f GB/s\n", both([&](int k) { k == 0 ? kernel(0, 132) : batch(1); }));
    std::printf("batch DMA H2D + kernel D2H    %6.2f GB/s\n", both([&](int k) { k == 0 ? batch(0) : kernel(1, 132); }));
#endif
  }
  return ok ? 0 : 1;
}
