// SwiGLU activation on the fused gate|up projection: out = silu(gate) * up, and its backward.
//
// Purely elementwise and memory-bound, so the only decision is the grid: x strides over
// rows (millions of tokens, past gridDim.y's 65535) and y over column tiles, so each thread
// reads its 8 gate and 8 up values with two 16-byte loads and there is no 64-bit division
// per element. sigmoid is 1 / (1 + exp(-g)) in fp32: exp overflowing to inf gives 0, not NaN.
//
// Shapes: gu, dgu (N, 2*I) rows [gate (I) | up (I)]; out, dout (N, I); all bf16.
#include <algorithm>
#include <cstdint>

#include "engine/kernels/cuda/common.cuh"
#include "engine/kernels/cuda/ops.h"

namespace megatrain::cuda {
namespace {

constexpr int64_t kMaxRowBlocks = 1 << 15;

__device__ __forceinline__ float Sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

template <int kWidth>
__global__ void SwiGluKernel(bf16* out, const bf16* gu, int64_t N, int64_t I) {
  const int64_t vecs = I / kWidth;
  for (int64_t r = blockIdx.x; r < N; r += gridDim.x) {
    const bf16* gate = gu + r * 2 * I;
    const bf16* up = gate + I;
    bf16* y = out + r * I;
    for (int64_t v = blockIdx.y * static_cast<int64_t>(blockDim.x) + threadIdx.x; v < vecs;
         v += static_cast<int64_t>(gridDim.y) * blockDim.x) {
      float g[kWidth], u[kWidth];
      Load<kWidth>(gate + v * kWidth, g);
      Load<kWidth>(up + v * kWidth, u);
#pragma unroll
      for (int i = 0; i < kWidth; ++i) g[i] = g[i] * Sigmoid(g[i]) * u[i];
      Store<kWidth>(y + v * kWidth, g);
    }
  }
}

// dgate = dy * u * sig(g) * (1 + g * (1 - sig(g))),  dup = dy * silu(g).
template <int kWidth>
__global__ void SwiGluBackwardKernel(bf16* dgu, const bf16* dout, const bf16* gu, int64_t N,
                                     int64_t I) {
  const int64_t vecs = I / kWidth;
  for (int64_t r = blockIdx.x; r < N; r += gridDim.x) {
    const bf16* gate = gu + r * 2 * I;
    const bf16* up = gate + I;
    const bf16* dy = dout + r * I;
    bf16* dgate = dgu + r * 2 * I;
    bf16* dup = dgate + I;
    for (int64_t v = blockIdx.y * static_cast<int64_t>(blockDim.x) + threadIdx.x; v < vecs;
         v += static_cast<int64_t>(gridDim.y) * blockDim.x) {
      float g[kWidth], u[kWidth], d[kWidth], dg[kWidth], du[kWidth];
      Load<kWidth>(gate + v * kWidth, g);
      Load<kWidth>(up + v * kWidth, u);
      Load<kWidth>(dy + v * kWidth, d);
#pragma unroll
      for (int i = 0; i < kWidth; ++i) {
        const float sig = Sigmoid(g[i]);
        dg[i] = d[i] * u[i] * sig * (1.0f + g[i] * (1.0f - sig));
        du[i] = d[i] * g[i] * sig;
      }
      Store<kWidth>(dgate + v * kWidth, dg);
      Store<kWidth>(dup + v * kWidth, du);
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

void SwiGlu(bf16* out, const bf16* gu, int64_t N, int64_t I, cudaStream_t stream) {
  if (N <= 0 || I <= 0) return;
  int threads = 0;
  dim3 grid;
  if (I % 8 == 0 && Aligned16(out) && Aligned16(gu)) {
    Shape(N, I / 8, &threads, &grid);
    SwiGluKernel<8><<<grid, threads, 0, stream>>>(out, gu, N, I);
  } else {
    Shape(N, I, &threads, &grid);
    SwiGluKernel<1><<<grid, threads, 0, stream>>>(out, gu, N, I);
  }
  MT_CUDA_LAUNCH_CHECK();
}

void SwiGluBackward(bf16* dgu, const bf16* dout, const bf16* gu, int64_t N, int64_t I,
                    cudaStream_t stream) {
  if (N <= 0 || I <= 0) return;
  int threads = 0;
  dim3 grid;
  if (I % 8 == 0 && Aligned16(dgu) && Aligned16(dout) && Aligned16(gu)) {
    Shape(N, I / 8, &threads, &grid);
    SwiGluBackwardKernel<8><<<grid, threads, 0, stream>>>(dgu, dout, gu, N, I);
  } else {
    Shape(N, I, &threads, &grid);
    SwiGluBackwardKernel<1><<<grid, threads, 0, stream>>>(dgu, dout, gu, N, I);
  }
  MT_CUDA_LAUNCH_CHECK();
}

}  // namespace megatrain::cuda
