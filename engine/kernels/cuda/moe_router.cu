// The mixture-of-experts router on the device: softmax and top-k of the router logits, its
// backward through the top-k weights and the softmax, and the load-balancing statistics.
// The math of each is kernels/reference/moe.h's.
//
// One warp holds a token's row of up to 256 experts (8 per lane), so the max, the sum and
// each of the k argmax rounds are warp shuffles with no shared memory. The argmax orders by
// (probability descending, expert ascending), a total order: every lane agrees on the
// winner and equal probabilities go to the lower index, as in the reference. The column
// sums of the probabilities go through per-block partials and AddColumnSums (no float
// atomics), so they are the same bits on every run.
//
// Shapes: logits, dlogits (n, E) bf16; probs (n, E) f32; idx (n, k) int32; w, dw (n, k) f32;
// counts (E) int32; prob_sum (E) f32.
#include <algorithm>
#include <cstdint>

#include "engine/common/check.h"
#include "engine/kernels/cuda/common.cuh"
#include "engine/kernels/cuda/ops.h"

namespace megatrain::cuda {
namespace {

constexpr int kMaxExperts = 256;  // a warp holds a row, 8 experts per lane
constexpr int kMaxTopK = 8;
constexpr int kRouterWarps = 8;        // tokens per block
constexpr int kStatsTile = 16 * 1024;  // choices counted per block
constexpr int kStatsThreads = 256;
constexpr int64_t kMinStatsRows = 64;  // rows per block of the probability sums, at least
constexpr int64_t kMaxStatsBlocks = 1024;

unsigned WarpBlocks(int64_t n) {
  return static_cast<unsigned>(
      std::min<int64_t>((n + kRouterWarps - 1) / kRouterWarps, int64_t{1} << 20));
}

// One warp per token; lane holds experts e = i*32 + lane, i < kPer (invalid ones -1).
// probs = exp(l - max) / sum; then k rounds of a warp argmax under (p desc, e asc), a total
// order, so every lane agrees on the winner and equal probabilities go to the lower index.
template <int kPer>
__global__ void MoeRouteKernel(float* probs, int32_t* idx, float* w, const bf16* logits, int64_t n,
                               int E, int k, bool renorm) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x / 32) + threadIdx.x / 32; t < n;
       t += warps) {
    const bf16* l = logits + t * E;
    float p[kPer];
    float mx = -INFINITY;
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int e = i * 32 + lane;
      p[i] = e < E ? ToF(l[e]) : -INFINITY;
      mx = fmaxf(mx, p[i]);
    }
    mx = WarpMax(mx);
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      p[i] = i * 32 + lane < E ? __expf(p[i] - mx) : 0.0f;
      sum += p[i];
    }
    const float inv = 1.0f / WarpSum(sum);
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int e = i * 32 + lane;
      if (e < E) {
        p[i] *= inv;
        probs[t * E + e] = p[i];
      } else {
        p[i] = -1.0f;  // below every probability: never chosen while k <= E
      }
    }
    int my_e = 0;
    float my_p = 0.0f, chosen = 0.0f;
#pragma unroll 1
    for (int j = 0; j < k; ++j) {
      float bp = p[0];
      int be = lane;
#pragma unroll
      for (int i = 1; i < kPer; ++i) {
        if (p[i] > bp) {  // strict: the lower index keeps a tie
          bp = p[i];
          be = i * 32 + lane;
        }
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
        const float op = __shfl_xor_sync(0xffffffffu, bp, o);
        const int oe = __shfl_xor_sync(0xffffffffu, be, o);
        if (op > bp || (op == bp && oe < be)) {
          bp = op;
          be = oe;
        }
      }
      chosen += bp;
      if (lane == j) {
        my_e = be;
        my_p = bp;
      }
#pragma unroll
      for (int i = 0; i < kPer; ++i) {
        if (i * 32 + lane == be) p[i] = -2.0f;  // taken
      }
    }
    if (lane < k) {
      idx[t * k + lane] = my_e;
      w[t * k + lane] = renorm ? my_p / chosen : my_p;
    }
  }
}

// One warp per token: g_e = aux * counts[e] + (renorm ? (dw_j - sum w dw) / sum p_chosen
// : dw_j) at e = idx_j; dlogit_e = p_e (g_e - sum_f p_f g_f). Lane j < k loads choice j.
template <int kPer>
__global__ void MoeRouteBackwardKernel(bf16* dlogits, const float* probs, const int32_t* idx,
                                       const float* w, const float* dw, const int32_t* counts,
                                       float aux_scale, int64_t n, int E, int k, bool renorm) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x / 32) + threadIdx.x / 32; t < n;
       t += warps) {
    const float* p = probs + t * E;
    float pv[kPer], g[kPer];
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int e = i * 32 + lane;
      pv[i] = e < E ? p[e] : 0.0f;
      g[i] = counts != nullptr && e < E ? aux_scale * static_cast<float>(counts[e]) : 0.0f;
    }
    int my_e = 0;
    float my_p = 0.0f, my_w = 0.0f, my_d = 0.0f;
    if (lane < k) {
      my_e = idx[t * k + lane];
      my_w = w[t * k + lane];
      my_d = dw[t * k + lane];
      my_p = p[my_e];
    }
    float chosen = 0.0f, wdw = 0.0f;
    for (int j = 0; j < k; ++j) {
      chosen += __shfl_sync(0xffffffffu, my_p, j);
      wdw += __shfl_sync(0xffffffffu, my_w, j) * __shfl_sync(0xffffffffu, my_d, j);
    }
    for (int j = 0; j < k; ++j) {
      const int e = __shfl_sync(0xffffffffu, my_e, j);
      const float d = __shfl_sync(0xffffffffu, my_d, j);
      const float add = renorm ? (d - wdw) / chosen : d;
#pragma unroll
      for (int i = 0; i < kPer; ++i) {
        if (i * 32 + lane == e) g[i] += add;
      }
    }
    float pg = 0.0f;
#pragma unroll
    for (int i = 0; i < kPer; ++i) pg += pv[i] * g[i];
    pg = WarpSum(pg);
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int e = i * 32 + lane;
      if (e < E) dlogits[t * E + e] = ToB(pv[i] * (g[i] - pg));
    }
  }
}

// counts[e] += the choices of e among idx entries [b * kStatsTile, ...) of block b (R).
__global__ void MoeCountKernel(int32_t* counts, const int32_t* idx, int64_t R, int E) {
  extern __shared__ int32_t s_count[];  // (E)
  const int64_t f0 = blockIdx.x * static_cast<int64_t>(kStatsTile);
  CountExperts(s_count, idx, f0, min(f0 + kStatsTile, R), E);
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    if (s_count[e] != 0) atomicAdd(&counts[e], s_count[e]);
  }
}

// Block b: partials[b * E + e] = sum of probs[r, e] over its rows [b * rows_per_block, ...).
// `groups` thread groups of E take every groups-th row; their sums are added in group order.
__global__ void MoeProbSumKernel(float* partials, const float* probs, int64_t n, int E,
                                 int64_t rows_per_block) {
  extern __shared__ float s_sum[];  // (groups, E)
  const int groups = E <= static_cast<int>(blockDim.x) ? blockDim.x / E : 1;
  const int64_t r0 = blockIdx.x * rows_per_block, r1 = min(r0 + rows_per_block, n);
  for (int s = threadIdx.x; s < groups * E; s += blockDim.x) {
    const int g = s / E, e = s % E;
    float acc = 0.0f;
    for (int64_t r = r0 + g; r < r1; r += groups) acc += probs[r * E + e];
    s_sum[s] = acc;
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    float acc = 0.0f;
    for (int g = 0; g < groups; ++g) acc += s_sum[g * E + e];
    partials[static_cast<int64_t>(blockIdx.x) * E + e] = acc;
  }
}

void CheckRouter(const char* op, int64_t n, int64_t E, int64_t k) {
  MT_CHECK_MSG(E >= 1 && E <= kMaxExperts && k >= 1 && k <= std::min<int64_t>(E, kMaxTopK),
               "%s: %lld experts, top-%lld; the CUDA kernel takes 1..%d experts, k <= %d", op,
               static_cast<long long>(E), static_cast<long long>(k), kMaxExperts, kMaxTopK);
  MT_CHECK_MSG(n >= 0 && n * k < (int64_t{1} << 31), "%s: %lld tokens x %lld choices exceed int32",
               op, static_cast<long long>(n), static_cast<long long>(k));
}

// The kernel of the fewest experts per lane that hold E.
template <typename Kernel>
Kernel ByExperts(int64_t E, Kernel k1, Kernel k2, Kernel k4, Kernel k8) {
  return E <= 32 ? k1 : E <= 64 ? k2 : E <= 128 ? k4 : k8;
}

}  // namespace

void MoeRoute(float* probs, int32_t* idx, float* w, const bf16* logits, int64_t n, int64_t E,
              int64_t k, bool renorm, cudaStream_t stream) {
  CheckRouter("MoeRoute", n, E, k);
  if (n == 0) return;
  auto* kernel =
      ByExperts(E, MoeRouteKernel<1>, MoeRouteKernel<2>, MoeRouteKernel<4>, MoeRouteKernel<8>);
  kernel<<<WarpBlocks(n), 32 * kRouterWarps, 0, stream>>>(
      probs, idx, w, logits, n, static_cast<int>(E), static_cast<int>(k), renorm);
  MT_CUDA_LAUNCH_CHECK();
}

void MoeRouteBackward(bf16* dlogits, const float* probs, const int32_t* idx, const float* w,
                      const float* dw, const int32_t* counts, float aux_scale, int64_t n, int64_t E,
                      int64_t k, bool renorm, cudaStream_t stream) {
  CheckRouter("MoeRouteBackward", n, E, k);
  if (n == 0) return;
  auto* kernel = ByExperts(E, MoeRouteBackwardKernel<1>, MoeRouteBackwardKernel<2>,
                           MoeRouteBackwardKernel<4>, MoeRouteBackwardKernel<8>);
  kernel<<<WarpBlocks(n), 32 * kRouterWarps, 0, stream>>>(dlogits, probs, idx, w, dw, counts,
                                                          aux_scale, n, static_cast<int>(E),
                                                          static_cast<int>(k), renorm);
  MT_CUDA_LAUNCH_CHECK();
}

void MoeRouterStats(int32_t* counts, float* prob_sum, const float* probs, const int32_t* idx,
                    int64_t n, int64_t E, int64_t k, float* partials, int64_t partial_floats,
                    cudaStream_t stream) {
  CheckRouter("MoeRouterStats", n, E, k);
  MT_CHECK_MSG(partials != nullptr && partial_floats >= E,
               "MoeRouterStats: a scratch of %lld floats cannot hold a row of %lld",
               static_cast<long long>(partial_floats), static_cast<long long>(E));
  if (n == 0) return;
  const int64_t R = n * k;
  const int e = static_cast<int>(E);
  MoeCountKernel<<<static_cast<unsigned>((R + kStatsTile - 1) / kStatsTile), kStatsThreads,
                   E * sizeof(int32_t), stream>>>(counts, idx, R, e);
  MT_CUDA_LAUNCH_CHECK();
  // The blocks depend only on n, E and the scratch, never on the device: the same tree of
  // sums on every run.
  const int64_t blocks = std::min<int64_t>(
      {(n + kMinStatsRows - 1) / kMinStatsRows, kMaxStatsBlocks, partial_floats / E});
  const int64_t rows_per_block = (n + blocks - 1) / blocks;
  const int64_t used_blocks = (n + rows_per_block - 1) / rows_per_block;
  const int groups = E <= kStatsThreads ? kStatsThreads / e : 1;
  MoeProbSumKernel<<<static_cast<unsigned>(used_blocks), kStatsThreads, groups * E * sizeof(float),
                     stream>>>(partials, probs, n, e, rows_per_block);
  MT_CUDA_LAUNCH_CHECK();
  AddColumnSums(prob_sum, partials, used_blocks, E, E, stream);
}

}  // namespace megatrain::cuda
