// Token embedding: gather rows of the table (forward), scatter-add into an fp32 table
// gradient (backward).
//
// The backward needs no atomics: it walks the positions in TokenOrder (sorted by token,
// then position), where each token's positions form one run. A block takes a run, so each
// row of dtable has one writer, and sums the run's rows onto dtable's row in position
// order, as the reference does. The result is the reference's, bit for bit, on every run.
// A warp finds the run's end 32 positions at a time; the rows are read four at a time so
// that a frequent token's long run keeps several loads in flight.
//
// Shapes: tokens, order (n) int32, tokens in [0, V); table, dtable (V, C); out, dout (n, C).
// Grid: x strides over rows (sorted positions in the backward; no 65535 limit), y over
// tiles of kWidth-column vectors.
#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "engine/kernels/cuda/common.cuh"
#include "engine/kernels/cuda/ops.h"

namespace megatrain::cuda {
namespace {

constexpr int64_t kMaxRowBlocks = 1 << 15;

// Threads per block: one column vector per thread, at most 256, a whole number of warps.
int ThreadsFor(int64_t vecs) {
  return static_cast<int>(std::min<int64_t>(256, std::max<int64_t>(32, (vecs + 31) / 32 * 32)));
}

// out (n, C) = table[tokens] rows; kWidth bf16 per thread access (8 = one 16-byte load).
template <int kWidth>
__global__ void EmbeddingKernel(bf16* out, const int32_t* tokens, const bf16* table, int64_t n,
                                int64_t C) {
  using Vec = std::conditional_t<kWidth == 8, uint4, bf16>;
  const int64_t vecs = C / kWidth;
  for (int64_t i = blockIdx.x; i < n; i += gridDim.x) {
    const Vec* src = reinterpret_cast<const Vec*>(table + static_cast<int64_t>(tokens[i]) * C);
    Vec* dst = reinterpret_cast<Vec*>(out + i * C);
    for (int64_t v = blockIdx.y * static_cast<int64_t>(blockDim.x) + threadIdx.x; v < vecs;
         v += static_cast<int64_t>(gridDim.y) * blockDim.x) {
      dst[v] = src[v];
    }
  }
}

// dtable[t] += the rows of dout at t's positions, for the runs of TokenOrder that start
// at sorted indices blockIdx.x, blockIdx.x + gridDim.x, ...
template <int kWidth>
__global__ void EmbeddingBackwardKernel(float* dtable, const bf16* dout, const int32_t* tokens,
                                        const int32_t* order, int64_t n, int64_t C) {
  constexpr int kRows = 4;  // rows in flight per thread
  __shared__ int64_t s_end;
  const int64_t vecs = C / kWidth;
  for (int64_t i = blockIdx.x; i < n; i += gridDim.x) {
    const int32_t token = tokens[order[i]];
    if (i > 0 && tokens[order[i - 1]] == token) continue;  // inside a run: not ours
    if (threadIdx.x < 32) {
      int64_t end = n;
      for (int64_t j0 = i + 1; j0 < n; j0 += 32) {
        const int64_t j = j0 + threadIdx.x;
        const unsigned other = __ballot_sync(0xffffffffu, j >= n || tokens[order[j]] != token);
        if (other != 0) {
          end = j0 + __ffs(other) - 1;
          break;
        }
      }
      if (threadIdx.x == 0) s_end = end;
    }
    __syncthreads();
    const int64_t end = s_end;
    float* row = dtable + static_cast<int64_t>(token) * C;
    for (int64_t v = blockIdx.y * static_cast<int64_t>(blockDim.x) + threadIdx.x; v < vecs;
         v += static_cast<int64_t>(gridDim.y) * blockDim.x) {
      float acc[kWidth];
#pragma unroll
      for (int e = 0; e < kWidth; ++e) acc[e] = row[v * kWidth + e];
      for (int64_t j = i; j < end; j += kRows) {
        float g[kRows][kWidth];
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          if (j + r < end) Load<kWidth>(dout + static_cast<int64_t>(order[j + r]) * C + v * kWidth, g[r]);
        }
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          if (j + r < end) {
#pragma unroll
            for (int e = 0; e < kWidth; ++e) acc[e] += g[r][e];
          }
        }
      }
#pragma unroll
      for (int e = 0; e < kWidth; ++e) row[v * kWidth + e] = acc[e];
    }
    __syncthreads();  // every thread has read s_end before the next run sets it
  }
}

dim3 GridFor(int64_t rows, int64_t vecs, int threads) {
  const int64_t tiles = std::min<int64_t>((vecs + threads - 1) / threads, 65535);
  return dim3(static_cast<unsigned>(std::min(rows, kMaxRowBlocks)), static_cast<unsigned>(tiles));
}

}  // namespace

void Embedding(bf16* out, const int32_t* tokens, const bf16* table, int64_t n, int64_t C,
               cudaStream_t stream) {
  if (n <= 0 || C <= 0) return;
  if (C % 8 == 0 && Aligned16(out) && Aligned16(table)) {
    const int threads = ThreadsFor(C / 8);
    EmbeddingKernel<8>
        <<<GridFor(n, C / 8, threads), threads, 0, stream>>>(out, tokens, table, n, C);
  } else {
    const int threads = ThreadsFor(C);
    EmbeddingKernel<1><<<GridFor(n, C, threads), threads, 0, stream>>>(out, tokens, table, n, C);
  }
  MT_CUDA_LAUNCH_CHECK();
}

void EmbeddingBackward(float* dtable, const bf16* dout, const int32_t* tokens,
                       const int32_t* order, int64_t n, int64_t C, cudaStream_t stream) {
  if (n <= 0 || C <= 0) return;
  if (C % 8 == 0 && Aligned16(dout)) {  // 16-byte bf16 loads
    const int threads = ThreadsFor(C / 8);
    EmbeddingBackwardKernel<8>
        <<<GridFor(n, C / 8, threads), threads, 0, stream>>>(dtable, dout, tokens, order, n, C);
  } else {
    const int threads = ThreadsFor(C);
    EmbeddingBackwardKernel<1>
        <<<GridFor(n, C, threads), threads, 0, stream>>>(dtable, dout, tokens, order, n, C);
  }
  MT_CUDA_LAUNCH_CHECK();
}

}  // namespace megatrain::cuda
