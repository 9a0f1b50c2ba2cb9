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
using CUevent = void *;

struct Api {
  CUresult (*cuInit)(unsigned);
  CUresult (*cuDeviceGet)(int *, int);
  CUresult (*cuDevicePrimaryCtxRetain)(CUcontext *, int);
  CUresult (*cuCtxSetCurrent)(CUcontext);
  CUresult (*cuStreamCreate)(CUstream *, unsigned);
  CUresult (*cuStreamSynchronize)(CUstream);
  CUresult (*cuMemcpyHtoDAsync_v2)(CUdeviceptr, const void *, size_t, CUstream);
  CUresult (*cuMemcpyDtoHAsync_v2)(void *, CUdeviceptr, size_t, CUstream);
  // --mix's onboard limit: pinned buffers, a device scratch, and a stream and events per
  // reading thread (which makes `ctx` current first).
  CUresult (*cuMemHostAlloc)(void **, size_t, unsigned);
  CUresult (*cuMemFreeHost)(void *);
  CUresult (*cuMemAlloc_v2)(CUdeviceptr *, size_t);
  CUresult (*cuMemFree_v2)(CUdeviceptr);
  CUresult (*cuStreamDestroy_v2)(CUstream);
  CUresult (*cuEventCreate)(CUevent *, unsigned);
  CUresult (*cuEventRecord)(CUevent, CUstream);
  CUresult (*cuEventSynchronize)(CUevent);
  CUresult (*cuEventDestroy_v2)(CUevent);
  CUcontext ctx = nullptr;
  CUstream stream = nullptr;
  bool ok = false;

  // Loads the driver and makes device `ordinal`'s primary context current.
  bool open(int ordinal) {
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h) return false;
#define KVX_LOAD(f) f = reinterpret_cast<decltype(f)>(dlsym(h, #f)); if (!f) return false
    KVX_LOAD(cuInit); KVX_LOAD(cuDeviceGet); KVX_LOAD(cuDevicePrimaryCtxRetain); KVX_LOAD(cuCtxSetCurrent);
    KVX_LOAD(cuStreamCreate); KVX_LOAD(cuStreamSynchronize); KVX_LOAD(cuMemcpyHtoDAsync_v2); KVX_LOAD(cuMemcpyDtoHAsync_v2);
    KVX_LOAD(cuMemHostAlloc); KVX_LOAD(cuMemFreeHost); KVX_LOAD(cuMemAlloc_v2); KVX_LOAD(cuMemFree_v2);
    KVX_LOAD(cuStreamDestroy_v2); KVX_LOAD(cuEventCreate); KVX_LOAD(cuEventRecord); KVX_LOAD(cuEventSynchronize);
    KVX_LOAD(cuEventDestroy_v2);
#undef KVX_LOAD
    int dev = 0;
    if (cuInit(0) || cuDeviceGet(&dev, ordinal) || cuDevicePrimaryCtxRetain(&ctx, dev) || cuCtxSetCurrent(ctx) ||
        cuStreamCreate(&stream, 1))
      return false;
    return ok = true;
  }
};

}  // namespace cuda_raw
