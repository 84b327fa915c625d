// QKV prepare: split the fused QKV rows into per-head q, k, v, apply the optional per-head
// RMS QK-norm (Qwen3) to q and k, rotate them with RoPE; and the backward through all three.
//
// The one non-obvious decision: a warp owns one head at a time and each lane always owns the
// same features, the bf16 pairs (2w, 2w+1) and their RoPE partners (2w+D/2, 2w+1+D/2) for
// w = lane, lane + 32. So the norm-weight gradients collect in registers over every head and
// token a warp visits; at the end the block folds its warps' partials in warp order into
// one row of the caller's partials, and AddColumnSums adds the rows in block order. No
// atomics: the gradients are the same bits on every run. The RoPE angle float(pos) * inv_freq[j] is
// rounded to float like the reference; its cos/sin are taken in double, once per token.
//
// Shapes: qkv, dqkv (n, (H+2*KV)*D) bf16, rows [q (H*D) | k (KV*D) | v (KV*D)]; q, dq (n,H,D);
// k, v, dk, dv (n,KV,D); rstd_q (n*H), rstd_k (n*KV) f32; q_norm_w, k_norm_w (D) bf16 or null;
// dq_norm_w, dk_norm_w (D) f32; pos (n) int32; inv_freq (D/2) f32.
// REQUIRES: D % 8 == 0, D <= 256, bf16 tensors 16-byte aligned.
#include <algorithm>
#include <cstdint>
#include <initializer_list>

#include "engine/common/check.h"
#include "engine/kernels/cuda/common.cuh"
#include "engine/kernels/cuda/ops.h"

namespace megatrain::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxD = 256;
constexpr int kLaneWords = kMaxD / 4 / 32;  // bf16 pairs per lane in each half of a head
constexpr int64_t kMaxBackwardBlocks = 1024;    // blocks of the backward, each loops over tokens

// cos_t, sin_t (D/2) for one position, written by the block, times rope_scale (as
// transformers scales its float cos/sin by YaRN's attention factor).
__device__ __forceinline__ void RopeTable(float* cos_t, float* sin_t, int32_t pos,
                                          const float* inv_freq, float rope_scale, int half) {
  for (int j = threadIdx.x; j < half; j += blockDim.x) {
    const float angle = __fmul_rn(static_cast<float>(pos), inv_freq[j]);
    double s, c;
    sincos(static_cast<double>(angle), &s, &c);
    cos_t[j] = __fmul_rn(static_cast<float>(c), rope_scale);
    sin_t[j] = __fmul_rn(static_cast<float>(s), rope_scale);
  }
}

__device__ __forceinline__ float2 Load2(const bf16* p) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(p));
}

__device__ __forceinline__ void Store2(bf16* p, float x, float y) {
  *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(x, y);
}

// One warp: y (D) = rope(norm(x (D))). norm_w null: no norm and rstd untouched.
__device__ __forceinline__ void HeadForward(bf16* y, float* rstd, const bf16* x,
                                            const bf16* norm_w, const float* cos_t,
                                            const float* sin_t, int D, float eps) {
  const int lane = threadIdx.x % 32, half = D / 2;
  float2 a[kLaneWords], b[kLaneWords];  // features (2w, 2w+1) and (2w+half, 2w+1+half)
#pragma unroll
  for (int it = 0; it < kLaneWords; ++it) {
    const int j = 2 * (lane + 32 * it);
    a[it] = b[it] = make_float2(0.0f, 0.0f);
    if (j < half) {
      a[it] = Load2(x + j);
      b[it] = Load2(x + j + half);
    }
  }
  if (norm_w != nullptr) {
    float ss = 0.0f;
#pragma unroll
    for (int it = 0; it < kLaneWords; ++it) {
      ss += a[it].x * a[it].x + a[it].y * a[it].y + b[it].x * b[it].x + b[it].y * b[it].y;
    }
    const float s = 1.0f / sqrtf(WarpSum(ss) / static_cast<float>(D) + eps);
    if (lane == 0) *rstd = s;
#pragma unroll
    for (int it = 0; it < kLaneWords; ++it) {
      const int j = 2 * (lane + 32 * it);
      if (j < half) {
        const float2 wa = Load2(norm_w + j), wb = Load2(norm_w + j + half);
        a[it] = make_float2(a[it].x * s * wa.x, a[it].y * s * wa.y);
        b[it] = make_float2(b[it].x * s * wb.x, b[it].y * s * wb.y);
      }
    }
  }
#pragma unroll
  for (int it = 0; it < kLaneWords; ++it) {
    const int j = 2 * (lane + 32 * it);
    if (j < half) {
      const float c0 = cos_t[j], s0 = sin_t[j], c1 = cos_t[j + 1], s1 = sin_t[j + 1];
      Store2(y + j, a[it].x * c0 - b[it].x * s0, a[it].y * c1 - b[it].y * s1);
      Store2(y + j + half, b[it].x * c0 + a[it].x * s0, b[it].y * c1 + a[it].y * s1);
    }
  }
}

// One warp: dx (D) from dy (D) through the inverse rotation and the norm. With a norm,
// dw_a/dw_b (the lane's features, layout of HeadForward) += dy_norm * x * rstd.
__device__ __forceinline__ void HeadBackward(bf16* dx, float2 (&dw_a)[kLaneWords],
                                             float2 (&dw_b)[kLaneWords], const bf16* dy,
                                             const bf16* x, const bf16* norm_w, float rstd,
                                             const float* cos_t, const float* sin_t, int D) {
  const int lane = threadIdx.x % 32, half = D / 2;
  float2 ga[kLaneWords], gb[kLaneWords];  // gradient w.r.t. the normalised, unrotated head
#pragma unroll
  for (int it = 0; it < kLaneWords; ++it) {
    const int j = 2 * (lane + 32 * it);
    ga[it] = gb[it] = make_float2(0.0f, 0.0f);
    if (j < half) {
      const float2 da = Load2(dy + j), db = Load2(dy + j + half);
      const float c0 = cos_t[j], s0 = sin_t[j], c1 = cos_t[j + 1], s1 = sin_t[j + 1];
      ga[it] = make_float2(da.x * c0 + db.x * s0, da.y * c1 + db.y * s1);
      gb[it] = make_float2(db.x * c0 - da.x * s0, db.y * c1 - da.y * s1);
    }
  }
  if (norm_w == nullptr) {
#pragma unroll
    for (int it = 0; it < kLaneWords; ++it) {
      const int j = 2 * (lane + 32 * it);
      if (j < half) {
        Store2(dx + j, ga[it].x, ga[it].y);
        Store2(dx + j + half, gb[it].x, gb[it].y);
      }
    }
    return;
  }
  // xn = u * w with u = x * rstd:  dw += g * u;  du = g * w;  dx = rstd * (du - u * mean(du * u)).
  float2 ua[kLaneWords], ub[kLaneWords];
  float dot = 0.0f;
#pragma unroll
  for (int it = 0; it < kLaneWords; ++it) {
    const int j = 2 * (lane + 32 * it);
    ua[it] = ub[it] = make_float2(0.0f, 0.0f);
    if (j < half) {
      const float2 xa = Load2(x + j), xb = Load2(x + j + half);
      const float2 wa = Load2(norm_w + j), wb = Load2(norm_w + j + half);
      ua[it] = make_float2(xa.x * rstd, xa.y * rstd);
      ub[it] = make_float2(xb.x * rstd, xb.y * rstd);
      dw_a[it].x += ga[it].x * ua[it].x;
      dw_a[it].y += ga[it].y * ua[it].y;
      dw_b[it].x += gb[it].x * ub[it].x;
      dw_b[it].y += gb[it].y * ub[it].y;
      ga[it] = make_float2(ga[it].x * wa.x, ga[it].y * wa.y);  // du
      gb[it] = make_float2(gb[it].x * wb.x, gb[it].y * wb.y);
      dot += ga[it].x * ua[it].x + ga[it].y * ua[it].y + gb[it].x * ub[it].x +
             gb[it].y * ub[it].y;
    }
  }
  const float mean = WarpSum(dot) / static_cast<float>(D);
#pragma unroll
  for (int it = 0; it < kLaneWords; ++it) {
    const int j = 2 * (lane + 32 * it);
    if (j < half) {
      Store2(dx + j, rstd * (ga[it].x - ua[it].x * mean), rstd * (ga[it].y - ua[it].y * mean));
      Store2(dx + j + half, rstd * (gb[it].x - ub[it].x * mean),
             rstd * (gb[it].y - ub[it].y * mean));
    }
  }
}

// 16-byte copy of count8 * 8 bf16.
__device__ __forceinline__ void CopyRow(bf16* dst, const bf16* src, int count8) {
  for (int c = threadIdx.x; c < count8; c += blockDim.x) {
    reinterpret_cast<uint4*>(dst)[c] = __ldg(reinterpret_cast<const uint4*>(src) + c);
  }
}

// grid (n), kThreads: one token per block, one head per warp at a time.
__global__ void __launch_bounds__(kThreads) QkvPrepareKernel(
    bf16* __restrict__ q, bf16* __restrict__ k, bf16* __restrict__ v, float* __restrict__ rstd_q,
    float* __restrict__ rstd_k, const bf16* __restrict__ qkv, const bf16* __restrict__ q_norm_w,
    const bf16* __restrict__ k_norm_w, const int32_t* __restrict__ pos,
    const float* __restrict__ inv_freq, float rope_scale, int H, int KV, int D, float eps) {
  __shared__ float cos_t[kMaxD / 2], sin_t[kMaxD / 2];
  const int64_t i = blockIdx.x;
  const bf16* row = qkv + i * (H + 2 * KV) * D;
  RopeTable(cos_t, sin_t, pos[i], inv_freq, rope_scale, D / 2);
  __syncthreads();
  for (int hd = threadIdx.x / 32; hd < H + KV; hd += kWarps) {
    if (hd < H) {
      HeadForward(q + (i * H + hd) * D, q_norm_w ? rstd_q + i * H + hd : nullptr, row + hd * D,
                  q_norm_w, cos_t, sin_t, D, eps);
    } else {
      const int g = hd - H;
      HeadForward(k + (i * KV + g) * D, k_norm_w ? rstd_k + i * KV + g : nullptr,
                  row + (H + g) * D, k_norm_w, cos_t, sin_t, D, eps);
    }
  }
  CopyRow(v + i * KV * D, row + (H + KV) * D, KV * D / 8);
}

// grid (min(n, kMaxBackwardBlocks, rows of the scratch)), kThreads: each block loops over
// tokens, one head per warp at a time, and writes its norm-weight partials once at the end.
__global__ void __launch_bounds__(kThreads) QkvPrepareBackwardKernel(
    bf16* __restrict__ dqkv, const bf16* __restrict__ dq, const bf16* __restrict__ dk, const bf16* __restrict__ dv,
    const bf16* __restrict__ qkv, const bf16* __restrict__ q_norm_w,
    const bf16* __restrict__ k_norm_w, const float* __restrict__ rstd_q,
    const float* __restrict__ rstd_k, const int32_t* __restrict__ pos,
    const float* __restrict__ inv_freq, float rope_scale, int64_t n, int H, int KV, int D,
    float* __restrict__ partials) {
  __shared__ float cos_t[kMaxD / 2], sin_t[kMaxD / 2];
  __shared__ float s_dw[kWarps][2][kMaxD];  // each warp's dq_norm_w, dk_norm_w partials
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, half = D / 2;
  const int64_t width = static_cast<int64_t>(H + 2 * KV) * D;
  float2 dwq_a[kLaneWords] = {}, dwq_b[kLaneWords] = {};
  float2 dwk_a[kLaneWords] = {}, dwk_b[kLaneWords] = {};

  for (int64_t i = blockIdx.x; i < n; i += gridDim.x) {
    __syncthreads();  // the previous token's reads of the table are done
    RopeTable(cos_t, sin_t, pos[i], inv_freq, rope_scale, half);
    __syncthreads();
    const bf16* row = qkv + i * width;
    bf16* drow = dqkv + i * width;
    for (int hd = threadIdx.x / 32; hd < H + KV; hd += kWarps) {
      if (hd < H) {
        HeadBackward(drow + hd * D, dwq_a, dwq_b, dq + (i * H + hd) * D, row + hd * D, q_norm_w,
                     q_norm_w ? rstd_q[i * H + hd] : 1.0f, cos_t, sin_t, D);
      } else {
        const int g = hd - H;
        HeadBackward(drow + (H + g) * D, dwk_a, dwk_b, dk + (i * KV + g) * D, row + (H + g) * D,
                     k_norm_w, k_norm_w ? rstd_k[i * KV + g] : 1.0f, cos_t, sin_t, D);
      }
    }
    CopyRow(drow + (H + KV) * D, dv + i * KV * D, KV * D / 8);
  }

  if (q_norm_w == nullptr && k_norm_w == nullptr) return;
#pragma unroll
  for (int it = 0; it < kLaneWords; ++it) {
    const int j = 2 * (lane + 32 * it);
    if (j < half) {
      float* q_w = s_dw[warp][0];
      float* k_w = s_dw[warp][1];
      q_w[j] = dwq_a[it].x, q_w[j + 1] = dwq_a[it].y;
      q_w[j + half] = dwq_b[it].x, q_w[j + 1 + half] = dwq_b[it].y;
      k_w[j] = dwk_a[it].x, k_w[j + 1] = dwk_a[it].y;
      k_w[j + half] = dwk_b[it].x, k_w[j + 1 + half] = dwk_b[it].y;
    }
  }
  __syncthreads();
  // Row blockIdx.x of partials: [q features (D) | k features (D)], warps added in order.
  for (int f = threadIdx.x; f < 2 * D; f += kThreads) {
    const int which = f / D, d = f % D;
    float sum = 0.0f;
    for (int w = 0; w < kWarps; ++w) sum += s_dw[w][which][d];
    partials[static_cast<int64_t>(blockIdx.x) * 2 * D + f] = sum;
  }
}

void CheckShapes(const char* op, int64_t n, int64_t H, int64_t KV, int64_t D,
                 std::initializer_list<const void*> tensors) {
  MT_CHECK_MSG(H > 0 && KV > 0 && H + 2 * KV <= 65535,
               "%s: %lld query heads and %lld kv heads are out of range", op,
               static_cast<long long>(H), static_cast<long long>(KV));
  MT_CHECK_MSG(D > 0 && D % 8 == 0 && D <= kMaxD,
               "%s: head_dim %lld is unsupported; the CUDA kernel needs a multiple of 8 up to %d",
               op, static_cast<long long>(D), kMaxD);
  MT_CHECK_MSG(n >= 0 && n < (int64_t{1} << 31), "%s: %lld tokens exceed the grid", op,
               static_cast<long long>(n));
  for (const void* p : tensors) {
    MT_CHECK_MSG(reinterpret_cast<uintptr_t>(p) % 16 == 0,
                 "%s: tensor at %p is not 16-byte aligned", op, p);
  }
}

// Norm weights are read two bf16 at a time.
void CheckNormWeights(const char* op, const bf16* q_norm_w, const bf16* k_norm_w) {
  MT_CHECK_MSG(reinterpret_cast<uintptr_t>(q_norm_w) % 4 == 0 &&
                   reinterpret_cast<uintptr_t>(k_norm_w) % 4 == 0,
               "%s: norm weights %p, %p are not 4-byte aligned", op,
               static_cast<const void*>(q_norm_w), static_cast<const void*>(k_norm_w));
}

}  // namespace

void QkvPrepare(bf16* q, bf16* k, bf16* v, float* rstd_q, float* rstd_k, const bf16* qkv,
                const bf16* q_norm_w, const bf16* k_norm_w, const int32_t* pos,
                const float* inv_freq, float rope_scale, int64_t n, int64_t H, int64_t KV,
                int64_t D, float eps, cudaStream_t stream) {
  CheckShapes("QkvPrepare", n, H, KV, D, {q, k, v, qkv});
  MT_CHECK_MSG(q_norm_w == nullptr || rstd_q != nullptr, "QkvPrepare: q norm without rstd_q");
  MT_CHECK_MSG(k_norm_w == nullptr || rstd_k != nullptr, "QkvPrepare: k norm without rstd_k");
  CheckNormWeights("QkvPrepare", q_norm_w, k_norm_w);
  if (n == 0) return;
  QkvPrepareKernel<<<static_cast<unsigned>(n), kThreads, 0, stream>>>(
      q, k, v, rstd_q, rstd_k, qkv, q_norm_w, k_norm_w, pos, inv_freq, rope_scale,
      static_cast<int>(H),
      static_cast<int>(KV), static_cast<int>(D), eps);
  MT_CUDA_LAUNCH_CHECK();
}

void QkvPrepareBackward(bf16* dqkv, float* dq_norm_w, float* dk_norm_w, const bf16* dq,
                        const bf16* dk, const bf16* dv, const bf16* qkv, const bf16* q_norm_w,
                        const bf16* k_norm_w, const float* rstd_q, const float* rstd_k,
                        const int32_t* pos, const float* inv_freq, float rope_scale, int64_t n,
                        int64_t H, int64_t KV, int64_t D, float* partials,
                        int64_t partial_floats, cudaStream_t stream) {
  CheckShapes("QkvPrepareBackward", n, H, KV, D, {dqkv, dq, dk, dv, qkv});
  MT_CHECK_MSG(partials != nullptr && partial_floats >= 2 * D,
               "QkvPrepareBackward: a scratch of %lld floats cannot hold a row of %lld",
               static_cast<long long>(partial_floats), static_cast<long long>(2 * D));
  MT_CHECK_MSG((q_norm_w == nullptr) == (dq_norm_w == nullptr) &&
                   (k_norm_w == nullptr) == (dk_norm_w == nullptr),
               "QkvPrepareBackward: a norm-weight gradient must be given exactly with its weight");
  MT_CHECK_MSG((q_norm_w == nullptr || rstd_q != nullptr) &&
                   (k_norm_w == nullptr || rstd_k != nullptr),
               "QkvPrepareBackward: a norm weight without its saved rstd");
  CheckNormWeights("QkvPrepareBackward", q_norm_w, k_norm_w);
  if (n == 0) return;
  const int64_t blocks = std::min<int64_t>({n, kMaxBackwardBlocks, partial_floats / (2 * D)});
  QkvPrepareBackwardKernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      dqkv, dq, dk, dv, qkv, q_norm_w, k_norm_w, rstd_q, rstd_k, pos,
      inv_freq, rope_scale, n, static_cast<int>(H), static_cast<int>(KV), static_cast<int>(D),
      partials);
  MT_CUDA_LAUNCH_CHECK();
  if (dq_norm_w != nullptr) AddColumnSums(dq_norm_w, partials, blocks, D, 2 * D, stream);
  if (dk_norm_w != nullptr) AddColumnSums(dk_norm_w, partials + D, blocks, D, 2 * D, stream);
}

}  // namespace megatrain::cuda
