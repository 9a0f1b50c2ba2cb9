// Region copy kernel: one launch moves many small regions between device addresses.
// Used to scatter a contiguous staging area into a layer-separate layout (H2D) and to
// gather regions into one (D2H), so PCIe sees one large copy instead of thousands of
// small ones. Regenerate kernels.ptx with ./regen-ptx.sh (needs nvcc).

struct Region {
  unsigned long long dst;
  unsigned long long src;
  unsigned long long len;
};

// grid.y: one row per region; grid.x blocks share a region; 16-byte moves when the
// region allows it, bytes otherwise.
extern "C" __global__ void kvx_copy_regions(const Region *__restrict__ regions, unsigned int count) {
  unsigned int i = blockIdx.y;
  if (i >= count) return;
  const Region r = regions[i];
  unsigned long long tid = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
  unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
  if (((r.src | r.dst | r.len) & 15ull) == 0) {
    const uint4 *s = reinterpret_cast<const uint4 *>(r.src);
    uint4 *d = reinterpret_cast<uint4 *>(r.dst);
    unsigned long long n = r.len >> 4;
    for (unsigned long long k = tid; k < n; k += stride) d[k] = s[k];
  } else {
    const unsigned char *s = reinterpret_cast<const unsigned char *>(r.src);
    unsigned char *d = reinterpret_cast<unsigned char *>(r.dst);
    for (unsigned long long k = tid; k < r.len; k += stride) d[k] = s[k];
  }
}
