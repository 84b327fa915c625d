// Device helpers shared by the CUDA kernels: bf16 conversions, warp and block reductions,
// and the launch check. Included only by .cu files.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "engine/common/cuda_check.h"  // MT_CUDA_LAUNCH_CHECK

namespace megatrain::cuda {

using bf16 = __nv_bfloat16;

__device__ __forceinline__ float ToF(bf16 x) { return __bfloat162float(x); }
__device__ __forceinline__ bf16 ToB(float x) { return __float2bfloat16(x); }

__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float WarpMax(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the block; every thread gets the result. `scratch` holds >= 32 floats.
// REQUIRES: blockDim.x is a multiple of 32; all threads call it.
__device__ __forceinline__ float BlockSum(float v, float* scratch) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  v = WarpSum(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  const int warps = blockDim.x / 32;
  v = lane < warps ? scratch[lane] : 0.0f;
  return WarpSum(v);
}

__device__ __forceinline__ float BlockMax(float v, float* scratch) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  v = WarpMax(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  const int warps = blockDim.x / 32;
  v = lane < warps ? scratch[lane] : -INFINITY;
  return WarpMax(v);
}

// s_count (E) in shared memory = how many of idx [f0, f1) name each expert (shared-memory
// integer atomics: the counts do not depend on order). Every thread of the block calls it;
// the counts are complete when it returns.
__device__ __forceinline__ void CountExperts(int32_t* s_count, const int32_t* idx, int64_t f0,
                                             int64_t f1, int E) {
  for (int e = threadIdx.x; e < E; e += blockDim.x) s_count[e] = 0;
  __syncthreads();
  for (int64_t f = f0 + threadIdx.x; f < f1; f += blockDim.x) atomicAdd(&s_count[idx[f]], 1);
  __syncthreads();
}

inline bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// kWidth bf16 values from p into fp32 registers: one 16-byte load when kWidth == 8.
// REQUIRES (kWidth == 8): p is 16-byte aligned.
template <int kWidth>
__device__ __forceinline__ void Load(const bf16* p, float (&v)[kWidth]) {
  if constexpr (kWidth == 8) {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __bfloat1622float2(h[i]);
      v[2 * i] = f.x;
      v[2 * i + 1] = f.y;
    }
  } else {
#pragma unroll
    for (int i = 0; i < kWidth; ++i) v[i] = ToF(p[i]);
  }
}

// kWidth fp32 values rounded to bf16 into p (one 16-byte store when kWidth == 8).
template <int kWidth>
__device__ __forceinline__ void Store(bf16* p, const float (&v)[kWidth]) {
  if constexpr (kWidth == 8) {
    uint4 raw;
    __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
    *reinterpret_cast<uint4*>(p) = raw;
  } else {
#pragma unroll
    for (int i = 0; i < kWidth; ++i) p[i] = ToB(v[i]);
  }
}

}  // namespace megatrain::cuda

