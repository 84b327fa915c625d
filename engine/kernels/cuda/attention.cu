// Causal grouped-query attention over packed documents on tensor cores, with an optional
// sliding window and per-head sinks: FlashAttention-2 style tiles, bf16 mma.sync (m16n8k16)
// with fp32 accumulation and an fp32 online softmax. The forward keeps only the logsumexp
// (the sink's term included); the backward recomputes P from it.
//
// The one non-obvious decision: the backward is two kernels and no atomics. dq runs per
// query tile over its key tiles; dk/dv runs per (key tile, kv head) over the H/KV query
// heads of the group and the query tiles after it. Every output element is summed by one
// thread in a fixed order, so gradients are bit-reproducible, at the price of computing S
// and dP twice. Delta_i = dO_i.O_i is computed once, by a small kernel that runs first, and
// parked in dq's own storage (fp32, in the first 4 bytes of each (query, head) row), since
// launchers allocate no temporaries: dk/dv reads it from there, and each dq block reads
// its rows' deltas before it overwrites those rows with their dq.
//
// Tiles (see Tiles below): a warp owns 32 queries (16 for D > 128) in the forward and dq and
// 16 keys in dk/dv, and reads its operands from shared memory with ldmatrix; the tiles it
// streams through are double-buffered with cp.async. Head rows are zero-padded to kD = 64,
// 128 or 256 columns, with 8 bf16 of skew per row so that ldmatrix is free of bank
// conflicts. Query i sees keys lo_i <= j <= i, lo_i = doc_start[i], or with a window
// max(doc_start[i], i - window + 1); key tiles outside [lo of the first query, last query]
// of a query tile are skipped (dk/dv: query tiles past the keys' documents and windows), so
// a sliding layer costs ~n*window, and the mask is applied only on tiles that straddle an
// edge. The window and the sink are template flags: without them the kernels are the same
// code as before they existed, bit for bit.
//
// A sink is one more logit per head with no value: the forward folds exp(sink_h) into each
// row's sum at the end, and the backward needs only dsinks_h = -sum_i P_sink,i Delta_i, which
// a small kernel takes from the parked deltas and lse (per-block partials, then
// AddColumnSums in block order: no atomics) before the dq pass overwrites them.
//
// Shapes: q, o, dout, dq (n,H,D) bf16; k, v, dk, dv (n,KV,D) bf16; lse (n,H) f32, natural
// log of sum_j exp(scale q_i.k_j) + exp(sink_h) with scale 1/sqrt(D); doc_start (n) int32;
// sinks (H) bf16, dsinks (H) f32. Query head h reads kv head h / (H/KV).
// REQUIRES: D % 8 == 0, D <= 256, H % KV == 0, tensors 16-byte aligned, doc_start
// nondecreasing (documents are contiguous runs, as the packer makes them).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <initializer_list>

#include "engine/common/check.h"
#include "engine/kernels/cuda/common.cuh"
#include "engine/kernels/cuda/mma.cuh"
#include "engine/kernels/cuda/ops.h"

namespace megatrain::cuda {
namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr int kWarpRows = 16;   // rows of one mma tile
constexpr int kGroupWarps = 4;  // warps of a block (per column slice in dk/dv)
constexpr int kGroupThreads = 32 * kGroupWarps;

// Tile shapes per padded head size, sized so that two blocks fit on an SM where registers
// allow. kMT: 16-row mma tiles per warp in the forward and dq (two halve the shared-memory
// reads per mma, which bound these kernels; D = 256 has no registers for it), so those
// blocks hold 64 * kMT queries. kKeys, kDqKeys: their key tiles. dk/dv blocks hold 64 keys,
// 16 per warp; kQueries is their query tile, and kSplit warps share a row group, each
// accumulating kD/kSplit columns of dk and dv (keeps D = 256 within 255 registers).
template <int kD>
struct Tiles;
template <>
struct Tiles<64> {
  static constexpr int kMT = 2, kKeys = 64, kDqKeys = 64, kQueries = 64, kSplit = 1;
};
template <>
struct Tiles<128> {
  static constexpr int kMT = 2, kKeys = 32, kDqKeys = 32, kQueries = 32, kSplit = 1;
};
template <>
struct Tiles<256> {
  static constexpr int kMT = 1, kKeys = 32, kDqKeys = 16, kQueries = 32, kSplit = 2;
};

// acc (16*kMT x 8*kN) += A (16*kMT x kD) * B^T, with A the 16*kMT rows at a and B the 8*kN
// rows at b, both row-major with stride kD + 8 in shared memory (S = Q K^T, dP = dO V^T,
// ...). Accumulator layout (mma C fragment): acc[m][t][e] is row 16m + lane/4 + 8*(e/2),
// column 8t + 2*(lane%4) + e%2. Each B fragment read feeds kMT mmas.
template <int kD, int kMT, int kN>
__device__ __forceinline__ void MmaABt(float (&acc)[kMT][kN][4], const bf16* a, const bf16* b) {
  constexpr int kStride = kD + 8;
  static_assert(kN % 2 == 0, "pairs of 8-column tiles");
  const int lane = threadIdx.x % 32;
  const bf16* a_lane = a + (lane % 16) * kStride + (lane / 16) * 8;
  const bf16* b_lane = b + (lane % 8 + (lane / 16) * 8) * kStride + ((lane / 8) % 2) * 8;
#pragma unroll
  for (int ks = 0; ks < kD / 16; ++ks) {
    uint32_t af[kMT][4];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) LdMatrix(af[mt], a_lane + mt * 16 * kStride + ks * 16);
#pragma unroll
    for (int np = 0; np < kN / 2; ++np) {
      uint32_t bf[4];
      LdMatrix(bf, b_lane + np * 16 * kStride + ks * 16);
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        Mma(acc[mt][2 * np], af[mt], bf[0], bf[1]);
        Mma(acc[mt][2 * np + 1], af[mt], bf[2], bf[3]);
      }
    }
  }
}

// acc (16*kMT x 8*kN) += P (16*kMT x kK) * B, with P in registers in the accumulator layout
// of MmaABt (rounded to bf16 here) and B the kK rows at b, columns col0 .. col0 + 8*kN,
// row-major with stride kD + 8 (O += P V, dQ += dS K, dV += P^T dO, dK += dS^T Q).
template <int kD, int kMT, int kK, int kN>
__device__ __forceinline__ void MmaPB(float (&acc)[kMT][kN][4], const float (&p)[kMT][kK / 8][4],
                                      const bf16* b, int col0) {
  constexpr int kStride = kD + 8;
  static_assert(kN % 2 == 0 && kK % 16 == 0, "whole mma tiles");
  const int lane = threadIdx.x % 32;
  const bf16* b_lane = b + (lane % 8 + ((lane / 8) % 2) * 8) * kStride + col0 + (lane / 16) * 8;
#pragma unroll
  for (int kk = 0; kk < kK / 16; ++kk) {
    // The C fragments of two adjacent 8-column tiles are the A fragment of one 16-deep step.
    uint32_t af[kMT][4];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
      af[mt][0] = Pack(p[mt][2 * kk][0], p[mt][2 * kk][1]);
      af[mt][1] = Pack(p[mt][2 * kk][2], p[mt][2 * kk][3]);
      af[mt][2] = Pack(p[mt][2 * kk + 1][0], p[mt][2 * kk + 1][1]);
      af[mt][3] = Pack(p[mt][2 * kk + 1][2], p[mt][2 * kk + 1][3]);
    }
#pragma unroll
    for (int np = 0; np < kN / 2; ++np) {
      uint32_t bf[4];
      LdMatrixTrans(bf, b_lane + kk * 16 * kStride + np * 16);
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        Mma(acc[mt][2 * np], af[mt], bf[0], bf[1]);
        Mma(acc[mt][2 * np + 1], af[mt], bf[2], bf[3]);
      }
    }
  }
}

// Starts copying rows [row0, row0 + kRows) of head `head` of an (n, heads, D) tensor into
// s (kRows, kD + 8); rows >= n and columns >= D are stored as zeros. Visible after
// CpAsyncCommit, CpAsyncWaitAll and a barrier.
template <int kD, int kRows, int kThreads>
__device__ __forceinline__ void LoadRows(bf16* s, const bf16* x, int row0, int n, int heads,
                                         int head, int D) {
  constexpr int kChunks = kD / 8, kTotal = kRows * kChunks;
#pragma unroll
  for (int it = 0; it < (kTotal + kThreads - 1) / kThreads; ++it) {
    const int idx = it * kThreads + static_cast<int>(threadIdx.x);
    if (kTotal % kThreads == 0 || idx < kTotal) {
      const int r = idx / kChunks, c = idx % kChunks, row = row0 + r;
      bf16* dst = s + r * (kD + 8) + c * 8;
      if (row < n && c * 8 < D) {
        CpAsync16(dst, x + (static_cast<int64_t>(row) * heads + head) * D + c * 8);
      } else {
        *reinterpret_cast<uint4*>(dst) = make_uint4(0u, 0u, 0u, 0u);
      }
    }
  }
}

// The warp's accumulator (layout of MmaABt), row r of m-tile m times mul[m][r/8], as bf16
// into s (16*kMT rows, stride kD + 8), columns col0 .. col0 + 8*kN.
template <int kD, int kMT, int kN>
__device__ __forceinline__ void StageRows(bf16* s, const float (&acc)[kMT][kN][4],
                                          const float (&mul)[kMT][2], int col0) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
    bf16* lo = s + (mt * 16 + lane / 4) * (kD + 8) + col0 + (lane % 4) * 2;
    bf16* hi = lo + 8 * (kD + 8);
#pragma unroll
    for (int t = 0; t < kN; ++t) {
      *reinterpret_cast<uint32_t*>(lo + t * 8) =
          Pack(acc[mt][t][0] * mul[mt][0], acc[mt][t][1] * mul[mt][0]);
      *reinterpret_cast<uint32_t*>(hi + t * 8) =
          Pack(acc[mt][t][2] * mul[mt][1], acc[mt][t][3] * mul[mt][1]);
    }
  }
}

// Rows [row0, row0 + kRows) of s (kRows, kD + 8) to head `head` of y (n, heads, D), rows < n,
// columns < D, by `threads` threads numbered from `tid`.
template <int kD, int kRows>
__device__ __forceinline__ void StoreRows(bf16* y, const bf16* s, int row0, int n, int heads,
                                          int head, int D, int tid, int threads) {
  constexpr int kChunks = kD / 8;
  for (int idx = tid; idx < kRows * kChunks; idx += threads) {
    const int r = idx / kChunks, c = idx % kChunks, row = row0 + r;
    if (row < n && c * 8 < D) {
      *reinterpret_cast<uint4*>(y + (static_cast<int64_t>(row) * heads + head) * D + c * 8) =
          *reinterpret_cast<const uint4*>(s + r * (kD + 8) + c * 8);
    }
  }
}

// The warp's accumulator rows (16*kMT of them, times mul) to head `head` of y, rows from
// row0, through s_w: staging rows of shared memory that only this warp uses.
template <int kD, int kMT>
__device__ __forceinline__ void StoreWarpRows(bf16* y, bf16* s_w,
                                              const float (&acc)[kMT][kD / 8][4],
                                              const float (&mul)[kMT][2], int row0, int n,
                                              int heads, int head, int D) {
  __syncwarp();
  StageRows<kD, kMT, kD / 8>(s_w, acc, mul, 0);
  __syncwarp();
  StoreRows<kD, kWarpRows * kMT>(y, s_w, row0, n, heads, head, D, threadIdx.x % 32, 32);
}

// s_ds[r] = doc_start of query row0 + r (INT_MAX past n), and the min and max of doc_start
// over the valid rows, in every thread. Ends with __syncthreads(); the caller must sync
// between reading s_red and the next call. REQUIRES: kRows <= blockDim.x <= 1024.
template <int kRows>
__device__ __forceinline__ void LoadDocStarts(int* s_ds, int* s_red, const int32_t* doc_start,
                                              int row0, int n, int& ds_min, int& ds_max) {
  const int t = threadIdx.x, lane = t % 32, warp = t / 32;
  int lo = INT_MAX, hi = INT_MIN;
  if (t < kRows) {
    const int i = row0 + t;
    const int ds = i < n ? doc_start[i] : INT_MAX;
    s_ds[t] = ds;
    if (i < n) lo = hi = ds;
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    lo = min(lo, __shfl_xor_sync(0xffffffffu, lo, off));
    hi = max(hi, __shfl_xor_sync(0xffffffffu, hi, off));
  }
  if (lane == 0) {
    s_red[warp] = lo;
    s_red[32 + warp] = hi;
  }
  __syncthreads();
  ds_min = INT_MAX;
  ds_max = INT_MIN;
  for (int w = 0; w < static_cast<int>(blockDim.x) / 32; ++w) {
    ds_min = min(ds_min, s_red[w]);
    ds_max = max(ds_max, s_red[32 + w]);
  }
}

// Dot product of two vectors of 8 bf16, in fp32.
__device__ __forceinline__ float Dot8(uint4 a, uint4 b) {
  const __nv_bfloat162* a2 = reinterpret_cast<const __nv_bfloat162*>(&a);
  const __nv_bfloat162* b2 = reinterpret_cast<const __nv_bfloat162*>(&b);
  float sum = 0.0f;
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const float2 x = __bfloat1622float2(a2[e]), y = __bfloat1622float2(b2[e]);
    sum += x.x * y.x + x.y * y.y;
  }
  return sum;
}

// (query, head) rows of one 128-thread AttentionDeltaKernel block: kD/8 lanes (at most 32)
// take a row, one 8-wide chunk each.
template <int kD>
__host__ __device__ constexpr int DeltaRowsPerBlock() {
  return kGroupThreads / (kD / 8 < 32 ? kD / 8 : 32);
}

// Delta of (query i, head h) = dO . O in fp32, parked at dq + (i*H + h)*D as a float.
template <int kD>
__global__ void __launch_bounds__(kGroupThreads)
    AttentionDeltaKernel(bf16* __restrict__ dq, const bf16* __restrict__ dout,
                         const bf16* __restrict__ o, int64_t rows, int D) {
  constexpr int kRowsPerBlock = DeltaRowsPerBlock<kD>(), kLanes = kGroupThreads / kRowsPerBlock;
  const int sub = threadIdx.x % kLanes;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kLanes;
  float sum = 0.0f;
  if (row < rows && sub * 8 < D) {
    const int64_t off = row * D + sub * 8;
    sum = Dot8(__ldg(reinterpret_cast<const uint4*>(dout + off)),
               __ldg(reinterpret_cast<const uint4*>(o + off)));
  }
#pragma unroll
  for (int off = kLanes / 2; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  if (sub == 0 && row < rows) *reinterpret_cast<float*>(dq + row * D) = sum;
}

// The parked delta of query i, head h (AttentionDeltaKernel).
__device__ __forceinline__ const float* ParkedDelta(const bf16* dq, int i, int H, int h, int D) {
  return reinterpret_cast<const float*>(dq + (static_cast<int64_t>(i) * H + h) * D);
}

// Row b of partials (blocks, H) = -sum over the tokens i of [b*tokens, (b+1)*tokens) in
// order of exp(sink_h - lse_ih) Delta_ih, Delta parked in dq. grid (blocks), 128 threads,
// heads strided over the threads.
__global__ void __launch_bounds__(kGroupThreads)
    AttentionSinkGradKernel(float* __restrict__ partials, const bf16* __restrict__ dq,
                            const float* __restrict__ lse, const bf16* __restrict__ sinks, int n,
                            int H, int D, int tokens) {
  const int i_begin = static_cast<int>(blockIdx.x) * tokens, i_end = min(i_begin + tokens, n);
  for (int h = threadIdx.x; h < H; h += blockDim.x) {
    const float sink = __bfloat162float(sinks[h]);
    float sum = 0.0f;
    for (int i = i_begin; i < i_end; ++i) {
      sum += expf(sink - lse[static_cast<int64_t>(i) * H + h]) * *ParkedDelta(dq, i, H, h, D);
    }
    partials[static_cast<int64_t>(blockIdx.x) * H + h] = -sum;
  }
}

// The first query e >= j_last + 1 with e == n or doc_start[e] > j_last: with doc_start
// nondecreasing, queries [j0, e) are exactly those that see some key of [j0, j_last]. A
// blockDim-ary search (about log_blockDim(n) rounds). Every thread gets e.
__device__ __forceinline__ int QueryEnd(const int32_t* doc_start, int j_last, int n) {
  int lo = j_last + 1, hi = n;  // e lies in [lo, hi]
  while (lo < hi) {
    const int step = (hi - lo + blockDim.x - 1) / blockDim.x;
    const int p = lo + static_cast<int>(threadIdx.x) * step;
    // Probes lo, lo + step, ... below hi; the first c of them still see key j_last.
    const int c = __syncthreads_count(p < hi && doc_start[p] <= j_last);
    if (c == 0) {
      hi = lo;
    } else {
      const int next_lo = lo + (c - 1) * step + 1;
      hi = min(hi, lo + c * step);
      lo = next_lo;
    }
  }
  return lo;
}

template <int kD>
__host__ __device__ constexpr int QueryBlock() {
  return kWarpRows * Tiles<kD>::kMT * kGroupWarps;
}

template <int kD>
constexpr int ForwardSmemBytes() {
  return (QueryBlock<kD>() + 4 * Tiles<kD>::kKeys) * (kD + 8) * 2 + (QueryBlock<kD>() + 64) * 4;
}

// grid (ceil(n/kM), H), 128 threads: kM = 64*kMT queries of one head per block, 16*kMT per
// warp. Key and value tiles are double-buffered: the next streams in while one is used.
// kWindow: query i sees keys i - j < window too; kSink: sinks (H) join each row's sum.
template <int kD, bool kWindow, bool kSink>
__global__ void __launch_bounds__(kGroupThreads)
    AttentionKernel(bf16* __restrict__ o, float* __restrict__ lse, const bf16* __restrict__ q,
                    const bf16* __restrict__ k, const bf16* __restrict__ v,
                    const int32_t* __restrict__ doc_start, int n, int H, int KV, int D,
                    float scale_log2, const bf16* __restrict__ sinks, int window) {
  constexpr int kThreads = kGroupThreads, kStride = kD + 8, kMT = Tiles<kD>::kMT;
  constexpr int kKeys = Tiles<kD>::kKeys, kM = QueryBlock<kD>(), kTile = kKeys * kStride;
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* s_q = reinterpret_cast<bf16*>(smem);            // (kM, kStride)
  bf16* s_k = s_q + kM * kStride;                       // (2, kKeys, kStride)
  bf16* s_v = s_k + 2 * kTile;                          // (2, kKeys, kStride)
  int* s_ds = reinterpret_cast<int*>(s_v + 2 * kTile);  // (kM)
  int* s_red = s_ds + kM;                               // (64)

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int i0 = (gridDim.x - 1 - blockIdx.x) * kM;  // the longest query tiles start first
  const int h = blockIdx.y, kvh = h / (H / KV);
  const int w0 = warp * kWarpRows * kMT;  // the warp's first row in the block

  LoadRows<kD, kM, kThreads>(s_q, q, i0, n, H, h, D);
  int ds_min, ds_max;
  LoadDocStarts<kM>(s_ds, s_red, doc_start, i0, n, ds_min, ds_max);
  int qi[kMT][2], qds[kMT][2];  // this thread's queries and the first key each sees
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = w0 + mt * 16 + lane / 4 + 8 * r;
      qi[mt][r] = i0 + row;
      qds[mt][r] = s_ds[row];
      if constexpr (kWindow) qds[mt][r] = max(qds[mt][r], qi[mt][r] - window + 1);
    }
  }
  const int last = min(i0 + kM, n) - 1;
  if constexpr (kWindow) {  // first keys of the first and last queries (nondecreasing in i)
    ds_min = max(ds_min, i0 - window + 1);
    ds_max = max(ds_max, last - window + 1);
  }
  const int first = ds_min / kKeys * kKeys;
  const bf16* s_qw = s_q + w0 * kStride;
  LoadRows<kD, kKeys, kThreads>(s_k, k, first, n, KV, kvh, D);
  LoadRows<kD, kKeys, kThreads>(s_v, v, first, n, KV, kvh, D);
  CpAsyncCommit();

  float acc[kMT][kD / 8][4] = {};
  float m[kMT][2], l[kMT][2];  // running max (log2 units) and sum of each row
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
    m[mt][0] = m[mt][1] = -INFINITY;
    l[mt][0] = l[mt][1] = 0.0f;
  }
  for (int j0 = first, buf = 0; j0 <= last; j0 += kKeys, buf ^= 1) {
    CpAsyncWaitAll();
    __syncthreads();  // tile j0 is visible, and every warp is done with the other buffer
    if (j0 + kKeys <= last) {
      LoadRows<kD, kKeys, kThreads>(s_k + (buf ^ 1) * kTile, k, j0 + kKeys, n, KV, kvh, D);
      LoadRows<kD, kKeys, kThreads>(s_v + (buf ^ 1) * kTile, v, j0 + kKeys, n, KV, kvh, D);
    }
    CpAsyncCommit();
    float s[kMT][kKeys / 8][4] = {};
    MmaABt<kD, kMT, kKeys / 8>(s, s_qw, s_k + buf * kTile);
    const bool masked = !(j0 >= ds_max && j0 + kKeys - 1 <= i0);
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
      float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int t = 0; t < kKeys / 8; ++t) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = e / 2, j = j0 + t * 8 + (lane % 4) * 2 + e % 2;
          float x = s[mt][t][e] * scale_log2;
          if (masked && (j < qds[mt][r] || j > qi[mt][r])) x = -INFINITY;
          s[mt][t][e] = x;
          mx[r] = fmaxf(mx[r], x);
        }
      }
      float base[2], corr[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float m_new = fmaxf(m[mt][r], QuadMax(mx[r]));
        base[r] = m_new == -INFINITY ? 0.0f : m_new;  // a row with no key yet stays at 0
        corr[r] = exp2f(m[mt][r] - base[r]);
        m[mt][r] = m_new;
        l[mt][r] *= corr[r];
      }
#pragma unroll
      for (int t = 0; t < kKeys / 8; ++t) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float p = exp2f(s[mt][t][e] - base[e / 2]);
          s[mt][t][e] = p;
          l[mt][e / 2] += p;
        }
      }
#pragma unroll
      for (int t = 0; t < kD / 8; ++t) {
        acc[mt][t][0] *= corr[0];
        acc[mt][t][1] *= corr[0];
        acc[mt][t][2] *= corr[1];
        acc[mt][t][3] *= corr[1];
      }
    }
    MmaPB<kD, kMT, kKeys, kD / 8>(acc, s, s_v + buf * kTile, 0);
  }

  float inv[kMT][2];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float sum = QuadSum(l[mt][r]);
      if constexpr (kSink) {
        // One more term exp2(sink2 - m_new) in the sum; acc is still relative to m.
        const float sink2 = __bfloat162float(sinks[h]) * kLog2e;
        const float m_new = fmaxf(m[mt][r], sink2), corr = exp2f(m[mt][r] - m_new);
        const float total = sum * corr + exp2f(sink2 - m_new);
        inv[mt][r] = corr / total;
        if (lane % 4 == 0 && qi[mt][r] < n) {
          lse[static_cast<int64_t>(qi[mt][r]) * H + h] = m_new * kLn2 + logf(total);
        }
      } else {
        inv[mt][r] = sum > 0.0f ? 1.0f / sum : 0.0f;
        if (lane % 4 == 0 && qi[mt][r] < n) {
          lse[static_cast<int64_t>(qi[mt][r]) * H + h] = m[mt][r] * kLn2 + logf(sum);
        }
      }
    }
  }
  // The warp's own query rows of s_q are free now: stage o there for 16-byte stores.
  StoreWarpRows<kD, kMT>(o, s_q + w0 * kStride, acc, inv, i0 + w0, n, H, h, D);
}

template <int kD>
constexpr int DqSmemBytes() {
  return (2 * QueryBlock<kD>() + 4 * Tiles<kD>::kDqKeys) * (kD + 8) * 2 +
         (2 * QueryBlock<kD>() + 64) * 4;
}

// dq = scale * sum_j dS_ij k_j. grid (ceil(n/kM), H), 128 threads: kM = 64*kMT queries per
// block; key and value tiles double-buffered as in the forward. kWindow as in the forward.
template <int kD, bool kWindow>
__global__ void __launch_bounds__(kGroupThreads)
    AttentionDqKernel(bf16* __restrict__ dq, const bf16* __restrict__ dout,
                      const bf16* __restrict__ q, const bf16* __restrict__ k,
                      const bf16* __restrict__ v, const float* __restrict__ lse,
                      const int32_t* __restrict__ doc_start, int n, int H, int KV, int D,
                      float scale_log2, float scale, int window) {
  constexpr int kThreads = kGroupThreads, kStride = kD + 8, kMT = Tiles<kD>::kMT;
  constexpr int kKeys = Tiles<kD>::kDqKeys, kM = QueryBlock<kD>(), kTile = kKeys * kStride;
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* s_q = reinterpret_cast<bf16*>(smem);                   // (kM, kStride)
  bf16* s_do = s_q + kM * kStride;                             // (kM, kStride)
  bf16* s_k = s_do + kM * kStride;                             // (2, kKeys, kStride)
  bf16* s_v = s_k + 2 * kTile;                                 // (2, kKeys, kStride)
  float* s_delta = reinterpret_cast<float*>(s_v + 2 * kTile);  // (kM)
  int* s_ds = reinterpret_cast<int*>(s_delta + kM);            // (kM)
  int* s_red = s_ds + kM;                                      // (64)

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int i0 = (gridDim.x - 1 - blockIdx.x) * kM;
  const int h = blockIdx.y, kvh = h / (H / KV);
  const int w0 = warp * kWarpRows * kMT;

  LoadRows<kD, kM, kThreads>(s_q, q, i0, n, H, h, D);
  LoadRows<kD, kM, kThreads>(s_do, dout, i0, n, H, h, D);
  int ds_min, ds_max;
  LoadDocStarts<kM>(s_ds, s_red, doc_start, i0, n, ds_min, ds_max);
  const int last = min(i0 + kM, n) - 1;
  if constexpr (kWindow) {  // first keys of the first and last queries
    ds_min = max(ds_min, i0 - window + 1);
    ds_max = max(ds_max, last - window + 1);
  }
  const int first = ds_min / kKeys * kKeys;
  LoadRows<kD, kKeys, kThreads>(s_k, k, first, n, KV, kvh, D);
  LoadRows<kD, kKeys, kThreads>(s_v, v, first, n, KV, kvh, D);
  CpAsyncCommit();
  for (int r = threadIdx.x; r < kM; r += kThreads) {  // before this block overwrites them
    s_delta[r] = i0 + r < n ? *ParkedDelta(dq, i0 + r, H, h, D) : 0.0f;
  }
  __syncthreads();
  int qi[kMT][2], qds[kMT][2];
  float delta[kMT][2], lse2[kMT][2];  // lse in log2 units; +inf past n so that P is 0 there
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = w0 + mt * 16 + lane / 4 + 8 * r;
      qi[mt][r] = i0 + row;
      qds[mt][r] = s_ds[row];  // with a window: the first key the query sees
      if constexpr (kWindow) qds[mt][r] = max(qds[mt][r], qi[mt][r] - window + 1);
      delta[mt][r] = s_delta[row];
      lse2[mt][r] = i0 + row < n ? lse[static_cast<int64_t>(i0 + row) * H + h] * kLog2e : INFINITY;
    }
  }
  const bf16* s_qw = s_q + w0 * kStride;
  const bf16* s_dow = s_do + w0 * kStride;

  float acc[kMT][kD / 8][4] = {};
  for (int j0 = first, buf = 0; j0 <= last; j0 += kKeys, buf ^= 1) {
    CpAsyncWaitAll();
    __syncthreads();
    if (j0 + kKeys <= last) {
      LoadRows<kD, kKeys, kThreads>(s_k + (buf ^ 1) * kTile, k, j0 + kKeys, n, KV, kvh, D);
      LoadRows<kD, kKeys, kThreads>(s_v + (buf ^ 1) * kTile, v, j0 + kKeys, n, KV, kvh, D);
    }
    CpAsyncCommit();
    const bf16* s_kb = s_k + buf * kTile;
    float s[kMT][kKeys / 8][4] = {}, dp[kMT][kKeys / 8][4] = {};
    MmaABt<kD, kMT, kKeys / 8>(s, s_qw, s_kb);
    MmaABt<kD, kMT, kKeys / 8>(dp, s_dow, s_v + buf * kTile);
    const bool masked = !(j0 >= ds_max && j0 + kKeys - 1 <= i0);
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
      for (int t = 0; t < kKeys / 8; ++t) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = e / 2, j = j0 + t * 8 + (lane % 4) * 2 + e % 2;
          const bool off = masked && (j < qds[mt][r] || j > qi[mt][r]);
          const float p = off ? 0.0f : exp2f(s[mt][t][e] * scale_log2 - lse2[mt][r]);
          s[mt][t][e] = p * (dp[mt][t][e] - delta[mt][r]);  // dS
        }
      }
    }
    MmaPB<kD, kMT, kKeys, kD / 8>(acc, s, s_kb, 0);
  }

  float mul[kMT][2];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) mul[mt][0] = mul[mt][1] = scale;
  StoreWarpRows<kD, kMT>(dq, s_q + w0 * kStride, acc, mul, i0 + w0, n, H, h, D);
}

template <int kD>
constexpr int DkDvSmemBytes() {
  return (2 * kWarpRows * kGroupWarps + 4 * Tiles<kD>::kQueries) * (kD + 8) * 2 +
         6 * Tiles<kD>::kQueries * 4;
}

// dk = scale * sum_i dS_ij q_i, dv = sum_i P_ij dO_i over the query heads of kv head g.
// grid (ceil(ceil(n/64)/2), KV), 128 * kSplit threads: two 64-key blocks per block, one
// after the other (x and its mirror); warp w owns keys
// 16*(w%4) .. +15 and columns (w/4) * kD/kSplit .. + kD/kSplit of dk and dv. The block walks
// (head, query tile) in order, double-buffering q, dO, lse, delta (parked in dq) and
// doc_start of the tiles. kWindow: only queries i - j < window see key j.
template <int kD, bool kWindow>
__global__ void __launch_bounds__(kGroupThreads* Tiles<kD>::kSplit)
    AttentionDkDvKernel(bf16* __restrict__ dk, bf16* __restrict__ dv, const bf16* __restrict__ dout,
                        const bf16* __restrict__ q, const bf16* __restrict__ k,
                        const bf16* __restrict__ v, const bf16* __restrict__ dq,
                        const float* __restrict__ lse, const int32_t* __restrict__ doc_start, int n,
                        int H, int KV, int D, float scale_log2, float scale, int window) {
  constexpr int kSplit = Tiles<kD>::kSplit, kQ = Tiles<kD>::kQueries;
  constexpr int kN = kWarpRows * kGroupWarps;  // keys per block
  constexpr int kThreads = kGroupThreads * kSplit, kStride = kD + 8, kSlice = kD / kSplit;
  constexpr int kTile = kQ * kStride;
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* s_k = reinterpret_cast<bf16*>(smem);                  // (kN, kStride)
  bf16* s_v = s_k + kN * kStride;                             // (kN, kStride)
  bf16* s_q = s_v + kN * kStride;                             // (2, kQ, kStride)
  bf16* s_do = s_q + 2 * kTile;                               // (2, kQ, kStride)
  float* s_lse = reinterpret_cast<float*>(s_do + 2 * kTile);  // (2, kQ) natural log
  float* s_delta = s_lse + 2 * kQ;                            // (2, kQ)
  int* s_ds = reinterpret_cast<int*>(s_delta + 2 * kQ);       // (2, kQ)

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int rows = (warp % kGroupWarps) * kWarpRows, col0 = (warp / kGroupWarps) * kSlice;
  const int kvh = blockIdx.y, group = H / KV;
  const int key_blocks = (n + kN - 1) / kN;
  // Two key blocks, mirrored: x and key_blocks-1-x. A key block's work grows with the
  // queries after it in its document, so with documents of equal length the pair's work is
  // the same for every block, and no long block is left to run alone at the end.
  for (int pass = 0; pass < 2; ++pass) {
    const int x = static_cast<int>(blockIdx.x), xb = pass == 0 ? x : key_blocks - 1 - x;
    if (pass == 1 && xb <= x) break;
    if (pass == 1) __syncthreads();  // every warp is done with the first block's shared memory
    const int j0 = xb * kN;
    const int j_last = min(j0 + kN, n) - 1;
    const int kj[2] = {j0 + rows + lane / 4, j0 + rows + lane / 4 + 8};  // this thread's keys
    const int kw[2] = {kj[0] + window, kj[1] + window};  // their first queries past the window
    // Query tiles [j0, i_end) of each head of the group see our keys.
    int i_end = QueryEnd(doc_start, j_last, n);
    if constexpr (kWindow) i_end = min(i_end, j_last + window);
    const int q_tiles = (i_end - j0 + kQ - 1) / kQ;
    const int items = group * q_tiles;

    // Query tile `item` (head-major) into buffer b.
    auto load_item = [&](int item, int b) {
      const int h = kvh * group + item / q_tiles, i0 = j0 + (item % q_tiles) * kQ;
      LoadRows<kD, kQ, kThreads>(s_q + b * kTile, q, i0, n, H, h, D);
      LoadRows<kD, kQ, kThreads>(s_do + b * kTile, dout, i0, n, H, h, D);
      if (threadIdx.x < kQ) {
        const int i = i0 + threadIdx.x;
        if (i < n) {
          CpAsync4(s_lse + b * kQ + threadIdx.x, lse + static_cast<int64_t>(i) * H + h);
          CpAsync4(s_ds + b * kQ + threadIdx.x, doc_start + i);
          CpAsync4(s_delta + b * kQ + threadIdx.x, ParkedDelta(dq, i, H, h, D));
        } else {
          s_lse[b * kQ + threadIdx.x] = INFINITY;  // P = 0
          s_delta[b * kQ + threadIdx.x] = 0.0f;
          s_ds[b * kQ + threadIdx.x] = INT_MAX;  // sees no key
        }
      }
    };
    LoadRows<kD, kN, kThreads>(s_k, k, j0, n, KV, kvh, D);
    LoadRows<kD, kN, kThreads>(s_v, v, j0, n, KV, kvh, D);
    load_item(0, 0);
    CpAsyncCommit();
    const bf16* s_kw = s_k + rows * kStride;
    const bf16* s_vw = s_v + rows * kStride;

    float acc_k[1][kSlice / 8][4] = {}, acc_v[1][kSlice / 8][4] = {};
    for (int item = 0, buf = 0; item < items; ++item, buf ^= 1) {
      CpAsyncWaitAll();
      __syncthreads();  // this item's tiles are visible; every warp is done with the other buffer
      if (item + 1 < items) load_item(item + 1, buf ^ 1);
      CpAsyncCommit();
      const int i0 = j0 + (item % q_tiles) * kQ;
      const bf16* s_qb = s_q + buf * kTile;
      const bf16* s_dob = s_do + buf * kTile;
      const float* s_lseb = s_lse + buf * kQ;
      const float* s_deltab = s_delta + buf * kQ;
      const int* s_dsb = s_ds + buf * kQ;
      // doc_start is nondecreasing, so the tile's last valid query has the largest.
      bool masked = s_dsb[min(kQ, n - i0) - 1] > j0 || i0 < j_last;
      if constexpr (kWindow) masked = masked || i0 + min(kQ, n - i0) - 1 - j0 >= window;
      float s[1][kQ / 8][4] = {}, dp[1][kQ / 8][4] = {};  // S^T, dP^T: keys x queries
      MmaABt<kD, 1, kQ / 8>(s, s_kw, s_qb);
      MmaABt<kD, 1, kQ / 8>(dp, s_vw, s_dob);
#pragma unroll
      for (int t = 0; t < kQ / 8; ++t) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int c = t * 8 + (lane % 4) * 2 + e % 2, j = kj[e / 2];
          bool off = masked && (j < s_dsb[c] || j > i0 + c);
          if constexpr (kWindow) off = off || (masked && i0 + c >= kw[e / 2]);
          const float p = off ? 0.0f : exp2f(s[0][t][e] * scale_log2 - s_lseb[c] * kLog2e);
          s[0][t][e] = p;
          dp[0][t][e] = p * (dp[0][t][e] - s_deltab[c]);  // dS^T
        }
      }
      MmaPB<kD, 1, kQ, kSlice / 8>(acc_v, s, s_dob, col0);
      MmaPB<kD, 1, kQ, kSlice / 8>(acc_k, dp, s_qb, col0);
    }

    // Stage dk in s_k and dv in s_v (every warp is past its last read of both), then store.
    __syncthreads();
    const float mul_k[1][2] = {{scale, scale}}, mul_v[1][2] = {{1.0f, 1.0f}};
    StageRows<kD, 1, kSlice / 8>(s_k + rows * kStride, acc_k, mul_k, col0);
    StageRows<kD, 1, kSlice / 8>(s_v + rows * kStride, acc_v, mul_v, col0);
    __syncthreads();
    StoreRows<kD, kN>(dk, s_k, j0, n, KV, kvh, D, threadIdx.x, kThreads);
    StoreRows<kD, kN>(dv, s_v, j0, n, KV, kvh, D, threadIdx.x, kThreads);
  }
}

void CheckShapes(const char* op, int64_t n, int64_t H, int64_t KV, int64_t D,
                 std::initializer_list<const void*> tensors) {
  MT_CHECK_MSG(H > 0 && KV > 0 && H % KV == 0,
               "%s: %lld query heads must be a positive multiple of %lld kv heads", op,
               static_cast<long long>(H), static_cast<long long>(KV));
  MT_CHECK_MSG(D > 0 && D % 8 == 0 && D <= 256,
               "%s: head_dim %lld is unsupported; the CUDA kernel needs a multiple of 8 up to 256",
               op, static_cast<long long>(D));
  MT_CHECK_MSG(n >= 0 && n <= (int64_t{1} << 30) && H <= 65535 && KV <= 65535,
               "%s: %lld tokens x %lld heads exceed the kernel's int32 indexing", op,
               static_cast<long long>(n), static_cast<long long>(H));
  for (const void* p : tensors) {
    MT_CHECK_MSG(reinterpret_cast<uintptr_t>(p) % 16 == 0,
                 "%s: tensor at %p is not 16-byte aligned", op, p);
  }
}

template <typename Kernel>
void SetSmem(Kernel kernel, int bytes) {
  const cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  MT_CHECK_MSG(err == cudaSuccess, "attention: cannot give a kernel %d bytes of shared memory: %s",
               bytes, cudaGetErrorString(err));
}

template <int kD, bool kWindow, bool kSink>
void LaunchForward(bf16* o, float* lse, const bf16* q, const bf16* k, const bf16* v,
                   const int32_t* doc_start, const bf16* sinks, int window, int n, int H, int KV,
                   int D, cudaStream_t stream) {
  constexpr int kBytes = ForwardSmemBytes<kD>();
  SetSmem(AttentionKernel<kD, kWindow, kSink>, kBytes);
  const dim3 grid((n + QueryBlock<kD>() - 1) / QueryBlock<kD>(), H);
  const float scale_log2 = kLog2e / sqrtf(static_cast<float>(D));
  AttentionKernel<kD, kWindow, kSink><<<grid, kGroupThreads, kBytes, stream>>>(
      o, lse, q, k, v, doc_start, n, H, KV, D, scale_log2, sinks, window);
  MT_CUDA_LAUNCH_CHECK();
}

template <int kD>
void LaunchForward(bf16* o, float* lse, const bf16* q, const bf16* k, const bf16* v,
                   const int32_t* doc_start, const bf16* sinks, int window, int n, int H, int KV,
                   int D, cudaStream_t stream) {
  if (window > 0 && sinks != nullptr) {
    LaunchForward<kD, true, true>(o, lse, q, k, v, doc_start, sinks, window, n, H, KV, D, stream);
  } else if (window > 0) {
    LaunchForward<kD, true, false>(o, lse, q, k, v, doc_start, sinks, window, n, H, KV, D, stream);
  } else if (sinks != nullptr) {
    LaunchForward<kD, false, true>(o, lse, q, k, v, doc_start, sinks, window, n, H, KV, D, stream);
  } else {
    LaunchForward<kD, false, false>(o, lse, q, k, v, doc_start, sinks, window, n, H, KV, D, stream);
  }
}

// dsinks (H) += -sum_i exp(sink_h - lse_ih) Delta_ih, from the parked deltas: blocks of
// `tokens` tokens write rows of partials, AddColumnSums adds them in block order.
void LaunchSinkGrad(float* dsinks, const bf16* dq, const float* lse, const bf16* sinks, int n,
                    int H, int D, float* partials, int64_t partial_floats, cudaStream_t stream) {
  constexpr int64_t kMinTokens = 64, kMaxBlocks = 1024;  // few rows for AddColumnSums to add
  const int64_t max_blocks = std::min<int64_t>(kMaxBlocks, partial_floats / H);
  const int64_t tokens =
      std::max<int64_t>(kMinTokens, (n + max_blocks - 1) / max_blocks);  // per block
  const int64_t blocks = (n + tokens - 1) / tokens;
  AttentionSinkGradKernel<<<static_cast<unsigned>(blocks), kGroupThreads, 0, stream>>>(
      partials, dq, lse, sinks, n, H, D, static_cast<int>(tokens));
  MT_CUDA_LAUNCH_CHECK();
  AddColumnSums(dsinks, partials, blocks, H, H, stream);
}

template <int kD, bool kWindow>
void LaunchBackward(bf16* dq, bf16* dk, bf16* dv, float* dsinks, const bf16* dout, const bf16* q,
                    const bf16* k, const bf16* v, const bf16* o, const float* lse,
                    const int32_t* doc_start, const bf16* sinks, int window, int n, int H, int KV,
                    int D, float* partials, int64_t partial_floats, float* dq_sums,
                    int64_t dq_sum_floats, cudaStream_t stream) {
  const float scale = 1.0f / sqrtf(static_cast<float>(D)), scale_log2 = kLog2e * scale;
  const int query_tiles = (n + QueryBlock<kD>() - 1) / QueryBlock<kD>();
  const int key_tiles = (n + kWarpRows * kGroupWarps - 1) / (kWarpRows * kGroupWarps);
  const int key_pairs = (key_tiles + 1) / 2;         // each dk/dv block takes a tile and its mirror
  const int64_t rows = static_cast<int64_t>(n) * H;  // (query, head) pairs
  const int64_t delta_blocks = (rows + DeltaRowsPerBlock<kD>() - 1) / DeltaRowsPerBlock<kD>();
  AttentionDeltaKernel<kD>
      <<<static_cast<unsigned>(delta_blocks), kGroupThreads, 0, stream>>>(dq, dout, o, rows, D);
  MT_CUDA_LAUNCH_CHECK();
  if (dsinks != nullptr) {
    LaunchSinkGrad(dsinks, dq, lse, sinks, n, H, D, partials, partial_floats, stream);
  }
  if (HopperAttentionApplies(D)) {  // dk/dv, then dq over the parked deltas (or all at once)
    if (!HopperAttentionBackwardFused(dq, dk, dv, dout, q, k, v, lse, doc_start, window, n, H, KV,
                                      D, dq_sums, dq_sum_floats, stream)) {
      HopperAttentionDkDv(dk, dv, dq, dout, q, k, v, lse, doc_start, window, n, H, KV, D, stream);
      HopperAttentionDq(dq, dout, q, k, v, lse, doc_start, window, n, H, KV, D, stream);
    }
    return;
  }
  constexpr int kDkDvBytes = DkDvSmemBytes<kD>();
  SetSmem(AttentionDkDvKernel<kD, kWindow>, kDkDvBytes);
  AttentionDkDvKernel<kD, kWindow>
      <<<dim3(key_pairs, KV), kGroupThreads * Tiles<kD>::kSplit, kDkDvBytes, stream>>>(
          dk, dv, dout, q, k, v, dq, lse, doc_start, n, H, KV, D, scale_log2, scale, window);
  MT_CUDA_LAUNCH_CHECK();
  constexpr int kDqBytes = DqSmemBytes<kD>();  // last: it overwrites the parked deltas
  SetSmem(AttentionDqKernel<kD, kWindow>, kDqBytes);
  AttentionDqKernel<kD, kWindow><<<dim3(query_tiles, H), kGroupThreads, kDqBytes, stream>>>(
      dq, dout, q, k, v, lse, doc_start, n, H, KV, D, scale_log2, scale, window);
  MT_CUDA_LAUNCH_CHECK();
}

template <int kD>
void LaunchBackward(bf16* dq, bf16* dk, bf16* dv, float* dsinks, const bf16* dout, const bf16* q,
                    const bf16* k, const bf16* v, const bf16* o, const float* lse,
                    const int32_t* doc_start, const bf16* sinks, int window, int n, int H, int KV,
                    int D, float* partials, int64_t partial_floats, float* dq_sums,
                    int64_t dq_sum_floats, cudaStream_t stream) {
  if (window > 0) {
    LaunchBackward<kD, true>(dq, dk, dv, dsinks, dout, q, k, v, o, lse, doc_start, sinks, window, n,
                             H, KV, D, partials, partial_floats, dq_sums, dq_sum_floats, stream);
  } else {
    LaunchBackward<kD, false>(dq, dk, dv, dsinks, dout, q, k, v, o, lse, doc_start, sinks, window,
                              n, H, KV, D, partials, partial_floats, dq_sums, dq_sum_floats,
                              stream);
  }
}

// The window the kernels take: 0 when it hides no key of the batch (window >= n), as the
// unlimited path is cheaper and gives the same result.
int EffectiveWindow(const char* op, int64_t window, int64_t n) {
  MT_CHECK_MSG(window >= 0, "%s: sliding window %lld is negative (0 means none)", op,
               static_cast<long long>(window));
  return window >= n ? 0 : static_cast<int>(window);
}

}  // namespace

void Attention(bf16* o, float* lse, const bf16* q, const bf16* k, const bf16* v,
               const int32_t* doc_start, const bf16* sinks, int64_t window, int64_t n, int64_t H,
               int64_t KV, int64_t D, cudaStream_t stream) {
  CheckShapes("Attention", n, H, KV, D, {o, q, k, v});
  const int w = EffectiveWindow("Attention", window, n);
  if (n == 0) return;
  const int ni = static_cast<int>(n), Hi = static_cast<int>(H), KVi = static_cast<int>(KV);
  const int Di = static_cast<int>(D);
  if (HopperAttentionApplies(D)) {
    HopperAttention(o, lse, q, k, v, doc_start, sinks, w, ni, Hi, KVi, Di, stream);
  } else if (D <= 64) {
    LaunchForward<64>(o, lse, q, k, v, doc_start, sinks, w, ni, Hi, KVi, Di, stream);
  } else if (D <= 128) {
    LaunchForward<128>(o, lse, q, k, v, doc_start, sinks, w, ni, Hi, KVi, Di, stream);
  } else {
    LaunchForward<256>(o, lse, q, k, v, doc_start, sinks, w, ni, Hi, KVi, Di, stream);
  }
}

void AttentionBackward(bf16* dq, bf16* dk, bf16* dv, float* dsinks, const bf16* dout, const bf16* q,
                       const bf16* k, const bf16* v, const bf16* o, const float* lse,
                       const int32_t* doc_start, const bf16* sinks, int64_t window, int64_t n,
                       int64_t H, int64_t KV, int64_t D, float* partials, int64_t partial_floats,
                       cudaStream_t stream, float* dq_sums, int64_t dq_sum_floats) {
  CheckShapes("AttentionBackward", n, H, KV, D, {dq, dk, dv, dout, q, k, v, o});
  const int w = EffectiveWindow("AttentionBackward", window, n);
  MT_CHECK_MSG(dsinks == nullptr || sinks != nullptr,
               "AttentionBackward: a sink gradient needs the sinks");
  MT_CHECK_MSG(dsinks == nullptr || (partials != nullptr && partial_floats >= H),
               "AttentionBackward: a scratch of %lld floats cannot hold a row of %lld sinks",
               static_cast<long long>(partial_floats), static_cast<long long>(H));
  if (n == 0) return;
  const int ni = static_cast<int>(n), Hi = static_cast<int>(H), KVi = static_cast<int>(KV);
  const int Di = static_cast<int>(D);
  if (D <= 64) {
    LaunchBackward<64>(dq, dk, dv, dsinks, dout, q, k, v, o, lse, doc_start, sinks, w, ni, Hi, KVi,
                       Di, partials, partial_floats, dq_sums, dq_sum_floats, stream);
  } else if (D <= 128) {
    LaunchBackward<128>(dq, dk, dv, dsinks, dout, q, k, v, o, lse, doc_start, sinks, w, ni, Hi, KVi,
                        Di, partials, partial_floats, dq_sums, dq_sum_floats, stream);
  } else {
    LaunchBackward<256>(dq, dk, dv, dsinks, dout, q, k, v, o, lse, doc_start, sinks, w, ni, Hi, KVi,
                        Di, partials, partial_floats, dq_sums, dq_sum_floats, stream);
  }
}

}  // namespace megatrain::cuda
