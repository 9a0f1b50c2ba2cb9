// The few CUDA driver calls the bench needs for its raw-copy baselines, resolved with
// dlopen so the bench builds and runs without CUDA headers or libraries.
#pragma once
#include <dlfcn.h>

#include <cstdint>
#include <cstdio>

namespace cuda_raw {

using CUresult = int;
using CUdeviceptr = unsigned long long;
using CUstream = void *;
using CUcontext = void *;

struct Api {
  CUresult (*cuInit)(unsigned);
  CUresult (*cuDeviceGet)(int *, int);
  CUresult (*cuDevicePrimaryCtxRetain)(CUcontext *, int);
  CUresult (*cuCtxSetCurrent)(CUcontext);
  CUresult (*cuStreamCreate)(CUstream *, unsigned);
  CUresult (*cuStreamSynchronize)(CUstream);
  CUresult (*cuMemcpyHtoDAsync_v2)(CUdeviceptr, const void *, size_t, CUstream);
  CUresult (*cuMemcpyDtoHAsync_v2)(void *, CUdeviceptr, size_t, CUstream);
  CUstream stream = nullptr;
  bool ok = false;

  // Loads the driver and makes device `ordinal`'s primary context current.
  bool open(int ordinal) {
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h) return false;
#define KVX_LOAD(f) f = reinterpret_cast<decltype(f)>(dlsym(h, #f)); if (!f) return false
    KVX_LOAD(cuInit); KVX_LOAD(cuDeviceGet); KVX_LOAD(cuDevicePrimaryCtxRetain); KVX_LOAD(cuCtxSetCurrent);
    KVX_LOAD(cuStreamCreate); KVX_LOAD(cuStreamSynchronize); KVX_LOAD(cuMemcpyHtoDAsync_v2); KVX_LOAD(cuMemcpyDtoHAsync_v2);
#undef KVX_LOAD
    int dev = 0;
    CUcontext ctx = nullptr;
    if (cuInit(0) || cuDeviceGet(&dev, ordinal) || cuDevicePrimaryCtxRetain(&ctx, dev) || cuCtxSetCurrent(ctx) ||
        cuStreamCreate(&stream, 1))
      return false;
    return ok = true;
  }
};

}  // namespace cuda_raw
