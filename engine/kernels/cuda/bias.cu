// Bias of a linear layer: add it to every output row (forward), sum dout's columns into
// the fp32 bias gradient (backward).
//
// BiasGrad is a column reduction over up to millions of rows. A block is 32 column vectors
// wide (x) by 8 row lanes (y): each warp reads 32 adjacent 16-byte vectors of one row, the
// 8 lanes interleave over the block's chunk of rows, a shared-memory pass folds the lanes,
// and one fp32 atomic per column per block lands in dbias. Row chunks (grid.y, at most
// 65535) are sized so the grid fills the GPU about once.
//
// Shapes: out, dout (N, OC) bf16; bias (OC) bf16; dbias (OC) f32.
#include <algorithm>
#include <cstdint>

#include "engine/common/check.h"
#include "engine/kernels/cuda/common.cuh"
#include "engine/kernels/cuda/ops.h"

namespace megatrain::cuda {
namespace {

constexpr int64_t kMaxRowBlocks = 1 << 15;
constexpr int kColLanes = 32;  // column vectors per BiasGrad block
constexpr int kRowLanes = 8;   // rows summed side by side per BiasGrad block
constexpr int kGradThreads = kColLanes * kRowLanes;

// Rows on grid.x (grid-strided), tiles of blockDim.x column vectors on grid.y.
template <int kWidth>
__global__ void AddBiasKernel(bf16* out, const bf16* bias, int64_t N, int64_t OC) {
  const int64_t vecs = OC / kWidth;
  for (int64_t r = blockIdx.x; r < N; r += gridDim.x) {
    bf16* y = out + r * OC;
    for (int64_t v = blockIdx.y * static_cast<int64_t>(blockDim.x) + threadIdx.x; v < vecs;
         v += static_cast<int64_t>(gridDim.y) * blockDim.x) {
      float yv[kWidth], bv[kWidth];
      Load<kWidth>(y + v * kWidth, yv);
      Load<kWidth>(bias + v * kWidth, bv);
#pragma unroll
      for (int i = 0; i < kWidth; ++i) yv[i] += bv[i];
      Store<kWidth>(y + v * kWidth, yv);
    }
  }
}

// Block (kColLanes, kRowLanes) sums rows [blockIdx.y * rows_per_chunk, ...) of the
// kColLanes column vectors starting at blockIdx.x * kColLanes.
template <int kWidth>
__global__ void __launch_bounds__(kGradThreads)
    BiasGradKernel(float* dbias, const bf16* dout, int64_t N, int64_t OC, int64_t rows_per_chunk) {
  // Element i of lane x's vector at [y][i * kColLanes + x]: conflict-free in both passes.
  __shared__ float partial[kRowLanes][kColLanes * kWidth];
  const int64_t vecs = OC / kWidth;
  const int64_t v = static_cast<int64_t>(blockIdx.x) * kColLanes + threadIdx.x;
  const int64_t r0 = blockIdx.y * rows_per_chunk;
  const int64_t r1 = r0 + rows_per_chunk < N ? r0 + rows_per_chunk : N;
  float acc[kWidth] = {};
  if (v < vecs) {
#pragma unroll 4
    for (int64_t r = r0 + threadIdx.y; r < r1; r += kRowLanes) {
      float xv[kWidth];
      Load<kWidth>(dout + r * OC + v * kWidth, xv);
#pragma unroll
      for (int i = 0; i < kWidth; ++i) acc[i] += xv[i];
    }
  }
#pragma unroll
  for (int i = 0; i < kWidth; ++i) partial[threadIdx.y][i * kColLanes + threadIdx.x] = acc[i];
  __syncthreads();
  // Thread f folds slot f over the row lanes; slot (i, x) is column (tile + x) * kWidth + i.
  const int f = threadIdx.y * kColLanes + threadIdx.x;
  if (f < kColLanes * kWidth) {
    const int i = f / kColLanes, x = f % kColLanes;
    const int64_t vx = static_cast<int64_t>(blockIdx.x) * kColLanes + x;
    if (vx < vecs) {
      float sum = 0.0f;
#pragma unroll
      for (int y = 0; y < kRowLanes; ++y) sum += partial[y][f];
      atomicAdd(dbias + vx * kWidth + i, sum);
    }
  }
}

template <int kWidth>
void LaunchAddBias(bf16* out, const bf16* bias, int64_t N, int64_t OC, cudaStream_t stream) {
  const int64_t vecs = OC / kWidth;
  const int threads =
      static_cast<int>(std::min<int64_t>(256, std::max<int64_t>(32, (vecs + 31) / 32 * 32)));
  const int64_t tiles = std::min<int64_t>((vecs + threads - 1) / threads, 65535);
  const dim3 grid(static_cast<unsigned>(std::min(N, kMaxRowBlocks)), static_cast<unsigned>(tiles));
  AddBiasKernel<kWidth><<<grid, threads, 0, stream>>>(out, bias, N, OC);
  MT_CUDA_LAUNCH_CHECK();
}

template <int kWidth>
void LaunchBiasGrad(float* dbias, const bf16* dout, int64_t N, int64_t OC, cudaStream_t stream) {
  int device = 0, sms = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess)
    err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  MT_CHECK_MSG(err == cudaSuccess, "reading the SM count: %s", cudaGetErrorString(err));
  const int64_t col_tiles = (OC / kWidth + kColLanes - 1) / kColLanes;
  // About 8 blocks of 256 threads per SM in all, at least 4 rows per row lane.
  const int64_t want_chunks = (static_cast<int64_t>(sms) * 8 + col_tiles - 1) / col_tiles;
  const int64_t max_chunks = std::min<int64_t>(65535, (N + 4 * kRowLanes - 1) / (4 * kRowLanes));
  const int64_t chunks = std::max<int64_t>(1, std::min(want_chunks, max_chunks));
  const int64_t rows_per_chunk = (N + chunks - 1) / chunks;
  const dim3 grid(static_cast<unsigned>(col_tiles),
                  static_cast<unsigned>((N + rows_per_chunk - 1) / rows_per_chunk));
  BiasGradKernel<kWidth>
      <<<grid, dim3(kColLanes, kRowLanes), 0, stream>>>(dbias, dout, N, OC, rows_per_chunk);
  MT_CUDA_LAUNCH_CHECK();
}

}  // namespace

void AddBias(bf16* out, const bf16* bias, int64_t N, int64_t OC, cudaStream_t stream) {
  if (N <= 0 || OC <= 0) return;
  if (OC % 8 == 0 && Aligned16(out) && Aligned16(bias)) {
    LaunchAddBias<8>(out, bias, N, OC, stream);
  } else {
    LaunchAddBias<1>(out, bias, N, OC, stream);
  }
}

void BiasGrad(float* dbias, const bf16* dout, int64_t N, int64_t OC, cudaStream_t stream) {
  if (N <= 0 || OC <= 0) return;
  if (OC % 8 == 0 && Aligned16(dout)) {
    LaunchBiasGrad<8>(dbias, dout, N, OC, stream);
  } else {
    LaunchBiasGrad<1>(dbias, dout, N, OC, stream);
  }
}

}  // namespace megatrain::cuda
