// Token embedding: gather rows of the table (forward), scatter-add into an fp32 table
// gradient (backward).
//
// The backward uses fp32 atomics rather than the reference's position-ordered sums: the
// GPU result is therefore not bit-identical across runs (sums of the same terms in another
// order), which is accepted for a gradient. On sm_90 each 8-column slice is added with two
// 16-byte float4 atomics instead of eight scalar ones.
//
// Shapes: tokens (n) int32 in [0, V); table, dtable (V, C); out, dout (n, C).
// Grid: x strides over rows (no 65535 limit), y over tiles of kWidth-column vectors.
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

// dtable[tokens[i]] += dout[i] with fp32 atomics.
template <int kWidth>
__global__ void EmbeddingBackwardKernel(float* dtable, const bf16* dout, const int32_t* tokens,
                                        int64_t n, int64_t C) {
  const int64_t vecs = C / kWidth;
  for (int64_t i = blockIdx.x; i < n; i += gridDim.x) {
    float* row = dtable + static_cast<int64_t>(tokens[i]) * C;
    const bf16* g = dout + i * C;
    for (int64_t v = blockIdx.y * static_cast<int64_t>(blockDim.x) + threadIdx.x; v < vecs;
         v += static_cast<int64_t>(gridDim.y) * blockDim.x) {
      if constexpr (kWidth == 8) {
        const uint4 raw = reinterpret_cast<const uint4*>(g)[v];
        const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
        const float2 a = __bfloat1622float2(h[0]), b = __bfloat1622float2(h[1]);
        const float2 c = __bfloat1622float2(h[2]), d = __bfloat1622float2(h[3]);
        float* dst = row + v * 8;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        atomicAdd(reinterpret_cast<float4*>(dst), make_float4(a.x, a.y, b.x, b.y));
        atomicAdd(reinterpret_cast<float4*>(dst) + 1, make_float4(c.x, c.y, d.x, d.y));
#else
        atomicAdd(dst + 0, a.x), atomicAdd(dst + 1, a.y), atomicAdd(dst + 2, b.x);
        atomicAdd(dst + 3, b.y), atomicAdd(dst + 4, c.x), atomicAdd(dst + 5, c.y);
        atomicAdd(dst + 6, d.x), atomicAdd(dst + 7, d.y);
#endif
      } else {
        atomicAdd(row + v, ToF(g[v]));
      }
    }
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

void EmbeddingBackward(float* dtable, const bf16* dout, const int32_t* tokens, int64_t n, int64_t C,
                       cudaStream_t stream) {
  if (n <= 0 || C <= 0) return;
  // float4 atomics need 16-byte aligned fp32 rows (C % 4 == 0), the bf16 loads C % 8 == 0.
  if (C % 8 == 0 && Aligned16(dtable) && Aligned16(dout)) {
    const int threads = ThreadsFor(C / 8);
    EmbeddingBackwardKernel<8>
        <<<GridFor(n, C / 8, threads), threads, 0, stream>>>(dtable, dout, tokens, n, C);
  } else {
    const int threads = ThreadsFor(C);
    EmbeddingBackwardKernel<1>
        <<<GridFor(n, C, threads), threads, 0, stream>>>(dtable, dout, tokens, n, C);
  }
  MT_CUDA_LAUNCH_CHECK();
}

}  // namespace megatrain::cuda
