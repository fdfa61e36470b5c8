// One GPU API for both vendors: the HIP names, mapped onto CUDA when nvcc compiles the sources.
//
// Every device source (hip/kernels/**.hip) includes this header first and uses only the names
// below for runtime calls, warp collectives and math, so the same file builds
//   - for AMD with hipcc or clang (-x hip): the HIP runtime headers, wave64 (CDNA: gfx90a,
//     gfx942, gfx950; RDNA's wave32 is not a target);
//   - for NVIDIA with nvcc (-x cu): cuda_runtime.h, warp32.
//   - on the host with HIP-CPU (ROCm's header-only CPU implementation of the HIP API) when
//     KVTIER_HIP_CPU is defined: for stepping through the kernels without a GPU (development).
// Included by a plain C++ compiler (the CPU implementations, the bindings) it defines only
// KVTIER_HD and no GPU names, so shared host/device helpers compile on any host.
// Kernels are launched with hipLaunchKernelGGL (HIP_KERNEL_NAME around template arguments) and
// take dynamic shared memory through KVTIER_DYNAMIC_SHARED, so all three builds share the source.
#pragma once

#if defined(KVTIER_HIP_CPU)
#define KVTIER_GPU_HIP 1
#elif defined(__CUDACC__) && !defined(__HIP__)
#define KVTIER_GPU_CUDA 1
#elif defined(__HIP__) || defined(__HIPCC__)
#define KVTIER_GPU_HIP 1
#endif

#if defined(KVTIER_GPU_CUDA) || defined(KVTIER_GPU_HIP)
#define KVTIER_HD __host__ __device__
#else
#define KVTIER_HD
#endif

#if defined(KVTIER_GPU_HIP)
#include <hip/hip_runtime.h>

#if defined(KVTIER_HIP_CPU)
#define KVTIER_DYNAMIC_SHARED(type, name) HIP_DYNAMIC_SHARED(type, name)
#define KVTIER_DEVICE_INLINE __device__ inline
#else
#define KVTIER_DYNAMIC_SHARED(type, name) extern __shared__ type name[]
#define KVTIER_DEVICE_INLINE __device__ __forceinline__
#endif

namespace kvtier {
// Lanes per wavefront on CDNA; the launchers check the device's warpSize against it. HIP-CPU runs
// 64-lane warps whose shuffles take a width, so KVTIER_HIP_CPU_WARP_SIZE=32 steps through the
// NVIDIA launch shapes there too.
#if defined(KVTIER_HIP_CPU) && defined(KVTIER_HIP_CPU_WARP_SIZE)
constexpr int kWarpSize = KVTIER_HIP_CPU_WARP_SIZE;
#else
constexpr int kWarpSize = 64;
#endif
constexpr const char* kGpuPlatform = "hip";

KVTIER_DEVICE_INLINE float warp_shfl_xor(float v, int lane_mask) { return __shfl_xor(v, lane_mask, kWarpSize); }
}  // namespace kvtier

#elif defined(KVTIER_GPU_CUDA)
#include <cuda_runtime.h>

// HIP runtime names used by the kernels' launchers, as their CUDA equivalents.
using hipError_t = cudaError_t;
using hipStream_t = cudaStream_t;
using hipDeviceProp_t = cudaDeviceProp;
#define hipSuccess cudaSuccess
#define hipErrorInvalidValue cudaErrorInvalidValue
#define hipGetLastError cudaGetLastError
#define hipGetErrorString cudaGetErrorString
#define hipGetDevice cudaGetDevice
#define hipDeviceGetAttribute cudaDeviceGetAttribute
#define hipDeviceAttributeWarpSize cudaDevAttrWarpSize
#define hipRuntimeGetVersion cudaRuntimeGetVersion
#define HIP_KERNEL_NAME(...) __VA_ARGS__
#define hipLaunchKernelGGL(kernel, grid, block, shared_bytes, stream, ...) \
  kernel<<<(grid), (block), (shared_bytes), (stream)>>>(__VA_ARGS__)
#define KVTIER_DYNAMIC_SHARED(type, name) extern __shared__ type name[]
#define KVTIER_DEVICE_INLINE __device__ __forceinline__

namespace kvtier {
constexpr int kWarpSize = 32;
constexpr const char* kGpuPlatform = "cuda";

KVTIER_DEVICE_INLINE float warp_shfl_xor(float v, int lane_mask) {
  return __shfl_xor_sync(0xffffffffu, v, lane_mask, kWarpSize);
}
}  // namespace kvtier
#endif

#if defined(KVTIER_GPU_CUDA) || defined(KVTIER_GPU_HIP)
#include <stdexcept>
#include <string>

namespace kvtier {

// exp2 / log2 in fp32: the hardware instructions on both vendors (v_exp_f32 / ex2.approx).
KVTIER_DEVICE_INLINE float fast_exp2(float x) {
#if defined(KVTIER_GPU_HIP)
  return __builtin_exp2f(x);
#else
  return exp2f(x);
#endif
}

KVTIER_DEVICE_INLINE float fast_log2(float x) {
#if defined(KVTIER_GPU_HIP)
  return __builtin_log2f(x);
#else
  return log2f(x);
#endif
}

// Sum over all lanes of the warp (butterfly: every lane ends with the total).
KVTIER_DEVICE_INLINE float warp_allreduce_sum(float v) {
#pragma unroll
  for (int mask = kWarpSize / 2; mask > 0; mask >>= 1) v += warp_shfl_xor(v, mask);
  return v;
}

// Throws std::runtime_error naming `what` when the last launch failed.
inline void check_launch(const char* what) {
  hipError_t err = hipGetLastError();
  if (err != hipSuccess) throw std::runtime_error(std::string(what) + ": " + hipGetErrorString(err));
}

// Throws unless the current device runs kWarpSize lanes per warp (e.g. an RDNA GPU in wave32).
inline void check_warp_size(const char* what) {
#if defined(KVTIER_HIP_CPU)
  (void)what;  // HIP-CPU emulates wave64
#else
  int device = 0, warp = 0;
  hipError_t err = hipGetDevice(&device);
  if (err == hipSuccess) err = hipDeviceGetAttribute(&warp, hipDeviceAttributeWarpSize, device);
  if (err != hipSuccess) throw std::runtime_error(std::string(what) + ": " + hipGetErrorString(err));
  if (warp != kWarpSize)
    throw std::runtime_error(std::string(what) + ": built for warp size " + std::to_string(kWarpSize) +
                             ", the device has " + std::to_string(warp));
#endif
}

}  // namespace kvtier
#endif
