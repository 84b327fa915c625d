// GPT-OSS's clamped SwiGLU on the fused gate|up projection and its backward; the math is
// kernels/reference/clamped_swiglu.h's, in fp32.
//
// The grid is swiglu.cu's: x strides over rows, y over column tiles; a thread's 8 outputs
// read 16 interleaved gate/up values with two 16-byte loads. The clamps are comparisons,
// not fminf/fmaxf, so a NaN propagates as in the reference (fminf would turn it into the
// limit), and the backward's masks test the unclamped input, boundaries included, as
// torch's clamp does.
//
// Shapes: gu, dgu (N, 2*I) rows [gate_0, up_0, gate_1, up_1, ...] (transformers' GPT-OSS
// interleaving); out, dout (N, I); all bf16.
#include <algorithm>
#include <cstdint>

#include "engine/kernels/cuda/common.cuh"
#include "engine/kernels/cuda/ops.h"

namespace megatrain::cuda {
namespace {

constexpr int64_t kMaxRowBlocks = 1 << 15;

__device__ __forceinline__ float Sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float ClampGate(float x, float limit) { return x > limit ? limit : x; }
__device__ __forceinline__ float ClampUp(float x, float limit) {
  return x > limit ? limit : (x < -limit ? -limit : x);
}

// out = (u + 1) * g * sig(alpha * g), g and u the clamped gate and up.
// g, u (kWidth) from the 2 * kWidth interleaved values at p.
template <int kWidth>
__device__ __forceinline__ void LoadPairs(const bf16* p, float (&g)[kWidth], float (&u)[kWidth]) {
  float lo[kWidth], hi[kWidth];
  Load<kWidth>(p, lo);
  Load<kWidth>(p + kWidth, hi);
#pragma unroll
  for (int i = 0; i < kWidth; ++i) {  // value v of the 2 * kWidth is lo[v] or hi[v - kWidth]
    g[i] = 2 * i < kWidth ? lo[2 * i] : hi[2 * i - kWidth];
    u[i] = 2 * i + 1 < kWidth ? lo[2 * i + 1] : hi[2 * i + 1 - kWidth];
  }
}

// The 2 * kWidth interleaved values at p from g, u (kWidth).
template <int kWidth>
__device__ __forceinline__ void StorePairs(bf16* p, const float (&g)[kWidth],
                                           const float (&u)[kWidth]) {
  float lo[kWidth], hi[kWidth];
#pragma unroll
  for (int i = 0; i < kWidth; ++i) {
    (2 * i < kWidth ? lo[2 * i] : hi[2 * i - kWidth]) = g[i];
    (2 * i + 1 < kWidth ? lo[2 * i + 1] : hi[2 * i + 1 - kWidth]) = u[i];
  }
  Store<kWidth>(p, lo);
  Store<kWidth>(p + kWidth, hi);
}

template <int kWidth>
__global__ void ClampedSwiGluKernel(bf16* out, const bf16* gu, int64_t N, int64_t I, float alpha,
                                    float limit) {
  const int64_t vecs = I / kWidth;
  for (int64_t r = blockIdx.x; r < N; r += gridDim.x) {
    const bf16* row = gu + r * 2 * I;
    bf16* y = out + r * I;
    for (int64_t v = blockIdx.y * static_cast<int64_t>(blockDim.x) + threadIdx.x; v < vecs;
         v += static_cast<int64_t>(gridDim.y) * blockDim.x) {
      float g[kWidth], u[kWidth];
      LoadPairs<kWidth>(row + 2 * v * kWidth, g, u);
#pragma unroll
      for (int i = 0; i < kWidth; ++i) {
        const float gc = ClampGate(g[i], limit);
        g[i] = (ClampUp(u[i], limit) + 1.0f) * gc * Sigmoid(alpha * gc);
      }
      Store<kWidth>(y + v * kWidth, g);
    }
  }
}

// dgate = dy * (u + 1) * sig * (1 + alpha * g * (1 - sig)) where gate <= limit, else 0;
// dup = dy * g * sig where -limit <= up <= limit, else 0; sig = sigmoid(alpha * g).
template <int kWidth>
__global__ void ClampedSwiGluBackwardKernel(bf16* dgu, const bf16* dout, const bf16* gu, int64_t N,
                                            int64_t I, float alpha, float limit) {
  const int64_t vecs = I / kWidth;
  for (int64_t r = blockIdx.x; r < N; r += gridDim.x) {
    const bf16* row = gu + r * 2 * I;
    const bf16* dy = dout + r * I;
    bf16* drow = dgu + r * 2 * I;
    for (int64_t v = blockIdx.y * static_cast<int64_t>(blockDim.x) + threadIdx.x; v < vecs;
         v += static_cast<int64_t>(gridDim.y) * blockDim.x) {
      float g[kWidth], u[kWidth], d[kWidth], dg[kWidth], du[kWidth];
      LoadPairs<kWidth>(row + 2 * v * kWidth, g, u);
      Load<kWidth>(dy + v * kWidth, d);
#pragma unroll
      for (int i = 0; i < kWidth; ++i) {
        const float gc = ClampGate(g[i], limit), uc = ClampUp(u[i], limit);
        const float sig = Sigmoid(alpha * gc);
        const bool gate_passes = g[i] <= limit, up_passes = u[i] >= -limit && u[i] <= limit;
        dg[i] = gate_passes ? d[i] * (uc + 1.0f) * sig * (1.0f + alpha * gc * (1.0f - sig)) : 0.0f;
        du[i] = up_passes ? d[i] * gc * sig : 0.0f;
      }
      StorePairs<kWidth>(drow + 2 * v * kWidth, dg, du);
    }
  }
}

// Rows on x (grid-strided), tiles of `threads` column vectors on y.
void Shape(int64_t N, int64_t vecs, int* threads, dim3* grid) {
  *threads = static_cast<int>(std::min<int64_t>(256, std::max<int64_t>(32, (vecs + 31) / 32 * 32)));
  const int64_t tiles = std::min<int64_t>((vecs + *threads - 1) / *threads, 65535);
  *grid = dim3(static_cast<unsigned>(std::min(N, kMaxRowBlocks)), static_cast<unsigned>(tiles));
}

}  // namespace

void ClampedSwiGlu(bf16* out, const bf16* gu, int64_t N, int64_t I, float alpha, float limit,
                   cudaStream_t stream) {
  if (N <= 0 || I <= 0) return;
  int threads = 0;
  dim3 grid;
  if (I % 8 == 0 && Aligned16(out) && Aligned16(gu)) {
    Shape(N, I / 8, &threads, &grid);
    ClampedSwiGluKernel<8><<<grid, threads, 0, stream>>>(out, gu, N, I, alpha, limit);
  } else {
    Shape(N, I, &threads, &grid);
    ClampedSwiGluKernel<1><<<grid, threads, 0, stream>>>(out, gu, N, I, alpha, limit);
  }
  MT_CUDA_LAUNCH_CHECK();
}

void ClampedSwiGluBackward(bf16* dgu, const bf16* dout, const bf16* gu, int64_t N, int64_t I,
                           float alpha, float limit, cudaStream_t stream) {
  if (N <= 0 || I <= 0) return;
  int threads = 0;
  dim3 grid;
  if (I % 8 == 0 && Aligned16(dgu) && Aligned16(dout) && Aligned16(gu)) {
    Shape(N, I / 8, &threads, &grid);
    ClampedSwiGluBackwardKernel<8><<<grid, threads, 0, stream>>>(dgu, dout, gu, N, I, alpha, limit);
  } else {
    Shape(N, I, &threads, &grid);
    ClampedSwiGluBackwardKernel<1><<<grid, threads, 0, stream>>>(dgu, dout, gu, N, I, alpha, limit);
  }
  MT_CUDA_LAUNCH_CHECK();
}

}  // namespace megatrain::cuda
