// The attention of attention.cu on Hopper (sm_90a), head_dim 64 and 128: the same ops, the
// same masks (causal within documents, optional sliding window and per-head sinks) and the
// same outputs, on warpgroup MMA (wgmma) fed by the tensor memory accelerator (TMA).
//
// Forward, FlashAttention-3 style warp specialisation: a block is a producer warpgroup and
// two consumer warpgroups over 128 queries of one head (three over 192 at head_dim 64 without
// a window: ForwardTiles). The producer: one thread loads the block's Q once and then the K
// and V tiles (128 keys) of its key range into a two-stage ring of shared memory, each tile
// completing on its own "full" mbarrier, each stage's K and V reused once every consumer has
// arrived on its "empty" barriers. The consumers take 64 queries each:
// S = Q K^T by wgmma from shared memory, the online softmax in registers (fp32, exp2 domain),
// then O += P V by wgmma with P as the A operand straight from registers, so P never touches
// shared memory. A consumer issues the next tile's S with this tile's P V and runs the next
// softmax while P V runs: the tensor cores run one consumer's GEMMs while the other computes.
// (Making the two consumers take turns to issue, FlashAttention-3's ping-pong, measured 13-15%
// slower at head_dim 128 and 10% at 64 on an H200, so they issue freely.)
// Setmaxnreg gives the consumers the registers the producer does not need. Key tiles start at
// the first key the block's first query sees (not at a tile boundary: TMA takes any start row
// and fills rows past n with zeros), and a consumer skips the tiles its own queries cannot
// see, so a causal block costs about half its square; it tests the mask only in the tiles
// that cross the diagonal, a document's start or the window's edge (order::ForwardTileMasked),
// in loops of their own.
//
// Status: the default on sm_90 (MEGATRAIN_ATTENTION=mma, read by main, declines them, see
// ops.h), after the forward and the backward's dk/dv and dq passes (HopperDkDvKernel and
// HopperDqKernel below) passed gpu_test on H200s; Delta and dsinks stay on attention.cu's
// kernels. On an H200 (machine_bench; bench/run.sh attention), causal,
// 8K / 32K: head_dim 128 forward 576 / 607 TFLOP/s, backward 425 / 441; head_dim 64 forward
// 452 / 479.
//
// Numerics: each output is a fixed sequence of fp32 operations with no atomics, so the
// same inputs give the same bits. They differ from attention.cu's kernels in the order of
// the sums, within bf16 tolerance (the tests hold both to the CPU reference).
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstring>
#include <type_traits>

#include "engine/common/check.h"
#include "engine/common/engine_settings.h"
#include "engine/kernels/cuda/attention_order.h"
#include "engine/kernels/cuda/common.cuh"
#include "engine/kernels/cuda/hopper.cuh"
#include "engine/kernels/cuda/ops.h"

namespace megatrain::cuda {
namespace {

using namespace hopper;  // NOLINT: the building blocks of these kernels

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr int kWarpgroup = 128;
constexpr int kColumns = 64;  // bf16 columns of one 128-byte swizzled row

// Forward tiles: kM queries per block (kConsumers warpgroups of 64), kN keys per tile,
// kStages K/V tiles in flight. At head_dim 64 a tile's exponentials take the MUFU as long as
// its GEMMs take the tensor cores, and three consumers hide more of the softmax's latency
// than two (their registers fit in 160 each there, without a window: its bounds spill; at
// 128 they need 240). A window's block sees few tiles anyway.
template <int kD, bool kWindow>
struct ForwardTiles {
  static constexpr int kConsumers = kD == 64 && !kWindow ? 3 : 2;
  static constexpr int kThreads = (1 + kConsumers) * kWarpgroup;
  static constexpr int kConsumerRegisters = kConsumers == 3 ? 160 : 240;
  static constexpr int kM = 64 * kConsumers, kN = 128, kStages = 2;
  static constexpr int kQElems = kM * kD, kKvElems = kN * kD;
  static constexpr int kBarriers = 1 + 4 * kStages;  // q full; k full, v full, k empty, v empty
  static constexpr int kSmemBytes = 1024 + 2 * (kQElems + 2 * kStages * kKvElems) + 8 * kBarriers;
};

// Backward dq tiles: kM queries per block (two consumer warpgroups of 64) whose Q and dO stay
// in shared memory, kN keys per K/V tile (64: S, dP and dq are all in registers at once).
template <int kD>
struct DqTiles {
  static constexpr int kM = 128, kN = 64, kStages = 3;
  static constexpr int kQElems = kM * kD, kKvElems = kN * kD;
  static constexpr int kBarriers = 1 + 3 * kStages;  // q/dO full; k full, v full, k/v empty
  static constexpr int kSmemBytes =
      1024 + 2 * (2 * kQElems + 2 * kStages * kKvElems) + 8 * kBarriers;
};

// Backward dk/dv tiles: kN keys per block (two consumer warpgroups of 64) whose K and V stay
// in shared memory, kM queries per Q/dO tile of the ring.
template <int kD>
struct DkDvTiles {
  static constexpr int kN = 128, kM = 64, kStages = 3;
  static constexpr int kKvElems = kN * kD, kQElems = kM * kD;
  static constexpr int kBarriers = 1 + 2 * kStages;  // k/v full; q/dO full, q/dO empty
  // Per stage, its tile's queries' lse (log2), Delta and first key (the producer's second
  // warp writes them beside the TMA loads of Q and dO).
  static constexpr int kStatWords = kStages * 3 * kM;
  static constexpr int kSmemBytes =
      1024 + 2 * (2 * kKvElems + 2 * kStages * kQElems) + 8 * kBarriers + 4 * kStatWords;
  // The fused dq (kFusedDq): per consumer, a tile's dS (kM queries x 64 keys) for dq = dS K.
  static constexpr int kDsElems = kM * 64;
  static constexpr int kFusedSmemBytes = kSmemBytes + 2 * 2 * kDsElems;
};

using order::FirstKey;
using order::ForwardTileMasked;
using order::ForwardUnmaskedTiles;
using order::QueryEnd;

__device__ __forceinline__ uint32_t PackBf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  uint32_t u;
  memcpy(&u, &v, sizeof(u));
  return u;
}

// The 1024-byte-aligned start of the dynamic shared memory (the swizzle atoms need it).
__device__ __forceinline__ uint8_t* AlignedSmem(uint8_t* raw) {
  const uint32_t pad = (1024 - (Smem(raw) & 1023)) & 1023;
  return raw + pad;
}

// d (64 x kN) = A (64 x kD) . B^T, B (kN x kD): both K-major in shared memory, as the TMA
// loads write them (blocks of 64 columns of all of a tile's rows: a_rows and b_rows rows).
// Enqueued only: the caller commits and waits.
template <int kD, int kN>
__device__ __forceinline__ void RowsTimesRowsT(float (&d)[kN / 2], const bf16* a, int a_rows,
                                               const bf16* b, int b_rows) {
#pragma unroll
  for (int ks = 0; ks < kD / 16; ++ks) {
    const int block = ks / 4, col = (ks % 4) * 16;
    WgmmaSS<kN>(d, Desc(a + block * a_rows * kColumns + col),
                Desc(b + block * b_rows * kColumns + col), ks > 0);
  }
}

// acc (64 x kD) += A . B, A (64 x kK) as register fragments (PackFragments), B (kK x kD)
// a shared-memory tile of kK rows read transposed (MN-major). Enqueued only.
template <int kD, int kK>
__device__ __forceinline__ void AccumulateFragmentsTimesRows(float (&acc)[kD / 2],
                                                             const uint32_t (&a)[kK / 16][4],
                                                             const bf16* b) {
#pragma unroll
  for (int kk = 0; kk < kK / 16; ++kk) {
    WgmmaRS<kD>(acc, a[kk], Desc(b + kk * 16 * kColumns, 2 * kK * kColumns), 1);
  }
}

// An accumulator (64 x kN) as bf16 A fragments of kN / 16 wgmma k-steps.
template <int kN>
__device__ __forceinline__ void PackFragments(const float (&x)[kN / 2], uint32_t (&a)[kN / 16][4]) {
#pragma unroll
  for (int kk = 0; kk < kN / 16; ++kk) {
#pragma unroll
    for (int i = 0; i < 4; ++i) a[kk][i] = PackBf16(x[8 * kk + 2 * i], x[8 * kk + 2 * i + 1]);
  }
}

// Keeps A fragments alive (their registers unreused) until a wgmma reading them is done.
template <int kN>
__device__ __forceinline__ void FenceFragments(uint32_t (&a)[kN / 16][4]) {
#pragma unroll
  for (int kk = 0; kk < kN / 16; ++kk) {
#pragma unroll
    for (int i = 0; i < 4; ++i) asm volatile("" : "+r"(a[kk][i])::"memory");
  }
}

// The barriers of a block that loads one tile once (`once`) and streams K and V tiles
// through kStages stages, each released by all kConsumers consumer warpgroups: k_empty[s]
// and v_empty[s] may be the same barriers (K and V released together) or not.
template <int kStages, int kConsumers = 2>
__device__ __forceinline__ void InitKvRing(uint64_t* once, uint64_t* k_full, uint64_t* v_full,
                                           uint64_t* k_empty, uint64_t* v_empty) {
  if (threadIdx.x == 0) {
    BarrierInit(once, 1);
    for (int s = 0; s < kStages; ++s) {
      BarrierInit(&k_full[s], 1);
      BarrierInit(&v_full[s], 1);
      BarrierInit(&k_empty[s], kConsumers * kWarpgroup);
      if (v_empty != k_empty) BarrierInit(&v_empty[s], kConsumers * kWarpgroup);
    }
    BarrierInitFence();
  }
  __syncthreads();
}

// The producer's K/V ring (one thread): tile t, keys j_first + t kN, into stage t % kStages:
// its K once every consumer has released the stage's previous K, its V likewise.
template <int kD, int kN, int kStages>
__device__ __forceinline__ void LoadKvRing(bf16* s_k, bf16* s_v, uint64_t* k_full,
                                           uint64_t* v_full, uint64_t* k_empty,
                                           uint64_t* v_empty, const CUtensorMap* k_map,
                                           const CUtensorMap* v_map, int kvh, int j_first,
                                           int tiles) {
  constexpr int kElems = kN * kD, kBlocks = kD / kColumns;
  for (int t = 0; t < tiles; ++t) {
    const int s = t % kStages, use = t / kStages, j0 = j_first + t * kN;
    if (use > 0) BarrierWait(&k_empty[s], (use - 1) & 1);
    bf16* k_tile = s_k + s * kElems;
    bf16* v_tile = s_v + s * kElems;
    BarrierExpectBytes(&k_full[s], 2 * kElems);
#pragma unroll
    for (int b = 0; b < kBlocks; ++b) {
      TmaLoad3d(k_tile + b * kN * kColumns, k_map, &k_full[s], b * kColumns, kvh, j0);
    }
    if (use > 0 && v_empty != k_empty) BarrierWait(&v_empty[s], (use - 1) & 1);
    BarrierExpectBytes(&v_full[s], 2 * kElems);
#pragma unroll
    for (int b = 0; b < kBlocks; ++b) {
      TmaLoad3d(v_tile + b * kN * kColumns, v_map, &v_full[s], b * kColumns, kvh, j0);
    }
  }
}

// Calls f(std::true_type) when `masked`, else f(std::false_type): a tile's per-element code
// compiled twice, the mask's tests only in the copy for the tiles that need them (the dk/dv
// pass's; the forward and dq run their masked and unmasked tiles in loops of their own).
// Tested at run time in every tile, they cost ~4.6 instructions a score (the forward's code
// size with and without them), mostly on the ALU pipe: by Nsight Compute on an H200 at 8K,
// head_dim 128, the forward's ALU pipe went from 48% to 31% busy without them, its tensor
// cores from 51% to 67%.
template <typename F>
__device__ __forceinline__ void WithMask(bool masked, F&& f) {
  if (masked) {
    f(std::true_type{});
  } else {
    f(std::false_type{});
  }
}

// Scores of an S tile (64 x kN) of this thread's two rows outside [lo, qi] to -inf: for the
// tiles that cross the diagonal, a document's start or the window's edge only.
template <int kN>
__device__ __forceinline__ void MaskScores(float (&sc)[kN / 2], int j0, const int (&lo)[2],
                                           const int (&qi)[2], int c0) {
#pragma unroll
  for (int c = 0; c < kN / 8; ++c) {
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int j = j0 + 8 * c + c0 + e;
        if (j < lo[hr] || j > qi[hr]) sc[4 * c + 2 * hr + e] = -INFINITY;
      }
    }
  }
}

// The online softmax of one S tile (64 x kN, in exp2 units after scale_log2, masked already)
// of this thread's two rows: raises the running maxima m, rescales the running sums l, adds
// P's row sums to them and packs P as bf16 A fragments. alpha is each row's factor for the
// output accumulator (which the caller applies once no wgmma writes it).
template <int kN>
__device__ __forceinline__ void OnlineSoftmax(float (&sc)[kN / 2], uint32_t (&p)[kN / 16][4],
                                              float (&m)[2], float (&l)[2], float (&alpha)[2],
                                              float scale_log2) {
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    float mx = -INFINITY;
#pragma unroll
    for (int c = 0; c < kN / 8; ++c) {
#pragma unroll
      for (int e = 0; e < 2; ++e) mx = fmaxf(mx, sc[4 * c + 2 * hr + e]);
    }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(m[hr], mx * scale_log2);  // scale_log2 > 0
    const float base = m_new == -INFINITY ? 0.0f : m_new;
    alpha[hr] = exp2f(m[hr] - base);
    m[hr] = m_new;
    float sum = 0.0f;
#pragma unroll
    for (int c = 0; c < kN / 8; ++c) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int idx = 4 * c + 2 * hr + e;
        const float pe = exp2f(fmaf(sc[idx], scale_log2, -base));
        sum += pe;
        sc[idx] = pe;
      }
    }
    l[hr] = l[hr] * alpha[hr] + sum;
  }
  PackFragments<kN>(sc, p);
}

// q, o (n, H, kD); k, v (n, KV, kD) through their tensor maps (boxes of 64 columns, one head,
// kM or kN rows); lse (n, H). Grid: (query tiles, H), the tile of the most keys first.
//
// A consumer overlaps its softmax with its own GEMMs (FlashAttention-3's intra-warpgroup
// pipelining): with P of tile t in registers it issues S = Q K^T of tile t + 1 and O += P V of
// tile t together, runs tile t + 1's softmax once its S is done while P V still runs, then
// rescales O. K and V stages are released apart (K as soon as its S is done).
template <int kD, bool kWindow, bool kSink>
__global__ void __launch_bounds__(ForwardTiles<kD, kWindow>::kThreads, 1)
    HopperForwardKernel(const __grid_constant__ CUtensorMap q_map,
                        const __grid_constant__ CUtensorMap k_map,
                        const __grid_constant__ CUtensorMap v_map, bf16* __restrict__ o,
                        float* __restrict__ lse, const int32_t* __restrict__ doc_start,
                        const bf16* __restrict__ sinks, int window, int n, int H, int KV,
                        float scale_log2) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using T = ForwardTiles<kD, kWindow>;
  constexpr int kM = T::kM, kN = T::kN, kStages = T::kStages, kBlocks = kD / kColumns;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = AlignedSmem(smem_raw);
  bf16* s_q = reinterpret_cast<bf16*>(smem);
  bf16* s_k = s_q + T::kQElems;                 // kStages tiles
  bf16* s_v = s_k + kStages * T::kKvElems;      // kStages tiles
  uint64_t* bars = reinterpret_cast<uint64_t*>(s_v + kStages * T::kKvElems);
  uint64_t* q_full = bars;
  uint64_t* k_full = bars + 1;
  uint64_t* v_full = bars + 1 + kStages;
  uint64_t* k_empty = bars + 1 + 2 * kStages;
  uint64_t* v_empty = bars + 1 + 3 * kStages;

  const int tile = static_cast<int>(gridDim.x - 1 - blockIdx.x);
  const int h = static_cast<int>(blockIdx.y), kvh = h / (H / KV);
  const int q0 = tile * kM, q_last = min(q0 + kM, n) - 1;
  const int j_first = FirstKey<kWindow>(doc_start, q0, window);
  const int tiles = (q_last - j_first + kN) / kN;
  const int wg = static_cast<int>(threadIdx.x) / kWarpgroup;

  InitKvRing<kStages, T::kConsumers>(q_full, k_full, v_full, k_empty, v_empty);

  if (wg == 0) {  // producer
    RegistersDown<24>();
    if (threadIdx.x == 0) {
      TmaPrefetchMap(&q_map);
      TmaPrefetchMap(&k_map);
      TmaPrefetchMap(&v_map);
      BarrierExpectBytes(q_full, 2 * T::kQElems);
#pragma unroll
      for (int b = 0; b < kBlocks; ++b) {
        TmaLoad3d(s_q + b * kM * kColumns, &q_map, q_full, b * kColumns, h, q0);
      }
      LoadKvRing<kD, kN, kStages>(s_k, s_v, k_full, v_full, k_empty, v_empty, &k_map, &v_map,
                                  kvh, j_first, tiles);
    }
  } else {  // consumer: 64 queries
    RegistersUp<T::kConsumerRegisters>();
    const int cw = wg - 1, t = static_cast<int>(threadIdx.x) % kWarpgroup;
    const int lane = t % 32, r0 = 16 * (t / 32) + lane / 4, c0 = 2 * (lane % 4);
    const int qa = q0 + 64 * cw, qb = min(qa + 63, n - 1);
    const bool has_rows = qa < n;
    const int wg_lo = has_rows ? FirstKey<kWindow>(doc_start, qa, window) : INT_MAX;
    const int wg_last_lo = has_rows ? FirstKey<kWindow>(doc_start, qb, window) : INT_MAX;
    int qi[2], lo[2];
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      qi[hr] = qa + r0 + 8 * hr;
      lo[hr] = FirstKey<kWindow>(doc_start, min(qi[hr], n - 1), window);
    }
    // The ring tiles this warpgroup's queries see: [a0, a1), keys j_first + a kN onwards
    // (wg_lo >= j_first, and the last key any of them sees is qb).
    int a0 = 0, a1 = 0;
    if (has_rows) {
      const int before = wg_lo - j_first - kN + 1;
      a0 = before > 0 ? (before + kN - 1) / kN : 0;
      a1 = min(tiles, (qb - j_first) / kN + 1);
    }
    auto j0_of = [&](int it) { return j_first + it * kN; };
    auto masked = [&](int it) { return ForwardTileMasked(j_first, it, wg_last_lo, qa, kN); };
    auto stage = [](int it) { return it % kStages; };
    auto parity = [](int it) { return static_cast<uint32_t>((it / kStages) & 1); };

    auto skip = [&](int it) {  // a tile none of this warpgroup's queries sees
      BarrierWait(&k_full[stage(it)], parity(it));
      BarrierWait(&v_full[stage(it)], parity(it));
      BarrierArrive(&k_empty[stage(it)]);
      BarrierArrive(&v_empty[stage(it)]);
    };

    float acc[kD / 2];
#pragma unroll
    for (int i = 0; i < kD / 2; ++i) acc[i] = 0.0f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f}, alpha[2];
    const bf16* q_rows = s_q + cw * 64 * kColumns;
    uint32_t p[kN / 16][4];

    for (int it = 0; it < a0; ++it) skip(it);
    BarrierWait(q_full, 0);
    if (a0 < a1) {
      {  // the first tile's S and softmax
        float sc[kN / 2];
        BarrierWait(&k_full[stage(a0)], parity(a0));
          FenceRegisters(sc);
        WgmmaFence();
        RowsTimesRowsT<kD, kN>(sc, q_rows, kM, s_k + stage(a0) * T::kKvElems, kN);
        WgmmaCommit();
          WgmmaWait<0>();
        FenceRegisters(sc);
        BarrierArrive(&k_empty[stage(a0)]);
        if (masked(a0)) MaskScores<kN>(sc, j0_of(a0), lo, qi, c0);
        OnlineSoftmax<kN>(sc, p, m, l, alpha, scale_log2);
      }
      // One tile's P V beside the next tile's S and softmax (mask: whether that tile needs
      // the mask), a straight run of code from the wgmmas' issue to their wait: a branch
      // there made ptxas serialize them (C7513), so the masked and unmasked tiles run in
      // loops of their own. The unmasked tiles are [u_lo, u_hi): the keys from every query's
      // first key (wg_last_lo) to the first query (qa).
      auto step = [&](int it, auto mask) {
        float sc[kN / 2];
        BarrierWait(&k_full[stage(it + 1)], parity(it + 1));
        BarrierWait(&v_full[stage(it)], parity(it));
        FenceRegisters(sc);
        FenceRegisters(acc);
        WgmmaFence();
        RowsTimesRowsT<kD, kN>(sc, q_rows, kM, s_k + stage(it + 1) * T::kKvElems, kN);  // next S
        WgmmaCommit();
        AccumulateFragmentsTimesRows<kD, kN>(acc, p, s_v + stage(it) * T::kKvElems);  // O += P V
        WgmmaCommit();
        WgmmaWait<1>();
        FenceRegisters(sc);
        BarrierArrive(&k_empty[stage(it + 1)]);
        uint32_t p_next[kN / 16][4];
        if constexpr (decltype(mask)::value) MaskScores<kN>(sc, j0_of(it + 1), lo, qi, c0);
        OnlineSoftmax<kN>(sc, p_next, m, l, alpha, scale_log2);
        WgmmaWait<0>();
        FenceRegisters(acc);
        FenceFragments<kN>(p);
        BarrierArrive(&v_empty[stage(it)]);
#pragma unroll
        for (int c = 0; c < kD / 8; ++c) {
#pragma unroll
          for (int hr = 0; hr < 2; ++hr) {
            acc[4 * c + 2 * hr] *= alpha[hr];
            acc[4 * c + 2 * hr + 1] *= alpha[hr];
          }
        }
#pragma unroll
        for (int kk = 0; kk < kN / 16; ++kk) {
#pragma unroll
          for (int i = 0; i < 4; ++i) p[kk][i] = p_next[kk][i];
        }
      };
      int u_lo, u_hi;
      ForwardUnmaskedTiles(j_first, wg_last_lo, qa, kN, &u_lo, &u_hi);
      int pv = a0;  // the tile whose P V runs beside the next one's S and softmax
      for (; pv + 1 < min(a1, u_lo); ++pv) step(pv, std::true_type{});
      for (; pv + 1 < min(a1, u_hi); ++pv) step(pv, std::false_type{});
      for (; pv + 1 < a1; ++pv) step(pv, std::true_type{});
      {  // the last tile's P V
        const int it = a1 - 1;
        BarrierWait(&v_full[stage(it)], parity(it));
          FenceRegisters(acc);
        WgmmaFence();
        AccumulateFragmentsTimesRows<kD, kN>(acc, p, s_v + stage(it) * T::kKvElems);
        WgmmaCommit();
          WgmmaWait<0>();
        FenceRegisters(acc);
        FenceFragments<kN>(p);
        BarrierArrive(&v_empty[stage(it)]);
      }
    }
    for (int it = max(a1, a0); it < tiles; ++it) skip(it);

    const float sink = kSink ? __bfloat162float(sinks[h]) * kLog2e : 0.0f;
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      float sum = l[hr];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      if constexpr (kSink) sum += exp2f(sink - m[hr]);
      const float inv = 1.0f / sum;
      const int row = qi[hr];
      if (row < n) {
        bf16* out = o + (static_cast<int64_t>(row) * H + h) * kD + c0;
#pragma unroll
        for (int c = 0; c < kD / 8; ++c) {
          *reinterpret_cast<uint32_t*>(out + 8 * c) =
              PackBf16(acc[4 * c + 2 * hr] * inv, acc[4 * c + 2 * hr + 1] * inv);
        }
        if (lane % 4 == 0) lse[static_cast<int64_t>(row) * H + h] = (m[hr] + log2f(sum)) * kLn2;
      }
    }
  }
#endif
}

// dS = P (dP - Delta), P = exp(S - lse), of a dq tile (64 queries x kN keys from j0) of this
// thread's two rows, as bf16 A fragments; kMasked: the tile crosses the diagonal, a
// document's start or the window's edge (ForwardTileMasked).
template <int kN, bool kMasked>
__device__ __forceinline__ void DqTileDs(float (&sc)[kN / 2], const float (&dp)[kN / 2], int j0,
                                         const int (&lo)[2], const int (&qi)[2],
                                         const float (&lse2)[2], const float (&delta)[2], int c0,
                                         float scale_log2, uint32_t (&ds)[kN / 16][4]) {
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
#pragma unroll
    for (int c = 0; c < kN / 8; ++c) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int idx = 4 * c + 2 * hr + e, j = j0 + 8 * c + c0 + e;
        float p = exp2f(sc[idx] * scale_log2 - lse2[hr]);
        if (kMasked && (j < lo[hr] || j > qi[hr])) p = 0.0f;
        sc[idx] = p * (dp[idx] - delta[hr]);  // dS
      }
    }
  }
  PackFragments<kN>(sc, ds);
}

// dq of the backward, per block of 128 queries of one head (the layout of the forward: a
// producer warpgroup and two consumers of 64 queries). The producer loads the block's Q and
// dO once, then its K and V tiles (64 keys) into a three-stage ring. A consumer, per tile:
// S = Q K^T and dP = dO V^T by wgmma from shared memory, P = exp(S - lse) (lse saved by the
// forward, so no online softmax), dS = P (dP - Delta) in registers, then dq += dS K by
// wgmma with dS as the A operand from registers and K transposed, the forward's P V. As the
// forward's P V, a tile's dq += dS K runs beside the next tile's S, dP and dS (three stages:
// a consumer holds two tiles while the third loads). dq is scaled by 1/sqrt(D) and written at
// the end; each thread reads its rows' Delta (parked in dq's storage by AttentionDeltaKernel)
// before its warp writes those rows. The key tiles are visited in order, so the sums' order
// is fixed.
template <int kD, bool kWindow>
__global__ void __launch_bounds__(3 * kWarpgroup, 1)
    HopperDqKernel(const __grid_constant__ CUtensorMap q_map,
                   const __grid_constant__ CUtensorMap do_map,
                   const __grid_constant__ CUtensorMap k_map,
                   const __grid_constant__ CUtensorMap v_map, bf16* __restrict__ dq,
                   const float* __restrict__ lse, const int32_t* __restrict__ doc_start,
                   int window, int n, int H, int KV, float scale_log2, float scale) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using T = DqTiles<kD>;
  constexpr int kM = T::kM, kN = T::kN, kStages = T::kStages, kBlocks = kD / kColumns;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = AlignedSmem(smem_raw);
  bf16* s_q = reinterpret_cast<bf16*>(smem);
  bf16* s_do = s_q + T::kQElems;
  bf16* s_k = s_do + T::kQElems;                // kStages tiles
  bf16* s_v = s_k + kStages * T::kKvElems;      // kStages tiles
  uint64_t* bars = reinterpret_cast<uint64_t*>(s_v + kStages * T::kKvElems);
  uint64_t* q_full = bars;
  uint64_t* k_full = bars + 1;
  uint64_t* v_full = bars + 1 + kStages;
  uint64_t* kv_empty = bars + 1 + 2 * kStages;

  const int tile = static_cast<int>(gridDim.x - 1 - blockIdx.x);
  const int h = static_cast<int>(blockIdx.y), kvh = h / (H / KV);
  const int q0 = tile * kM, q_last = min(q0 + kM, n) - 1;
  const int j_first = FirstKey<kWindow>(doc_start, q0, window);
  const int tiles = (q_last - j_first + kN) / kN;
  const int wg = static_cast<int>(threadIdx.x) / kWarpgroup;

  InitKvRing<kStages>(q_full, k_full, v_full, kv_empty, kv_empty);

  if (wg == 0) {  // producer
    RegistersDown<40>();
    if (threadIdx.x == 0) {
      TmaPrefetchMap(&q_map);
      TmaPrefetchMap(&do_map);
      TmaPrefetchMap(&k_map);
      TmaPrefetchMap(&v_map);
      BarrierExpectBytes(q_full, 2 * 2 * T::kQElems);
#pragma unroll
      for (int b = 0; b < kBlocks; ++b) {
        TmaLoad3d(s_q + b * kM * kColumns, &q_map, q_full, b * kColumns, h, q0);
        TmaLoad3d(s_do + b * kM * kColumns, &do_map, q_full, b * kColumns, h, q0);
      }
      LoadKvRing<kD, kN, kStages>(s_k, s_v, k_full, v_full, kv_empty, kv_empty, &k_map, &v_map,
                                  kvh, j_first, tiles);
    }
  } else {  // consumer: 64 queries
    RegistersUp<232>();
    const int cw = wg - 1, t = static_cast<int>(threadIdx.x) % kWarpgroup;
    const int lane = t % 32, r0 = 16 * (t / 32) + lane / 4, c0 = 2 * (lane % 4);
    const int qa = q0 + 64 * cw, qb = min(qa + 63, n - 1);
    const bool has_rows = qa < n;
    const int wg_lo = has_rows ? FirstKey<kWindow>(doc_start, qa, window) : INT_MAX;
    const int wg_last_lo = has_rows ? FirstKey<kWindow>(doc_start, qb, window) : INT_MAX;
    int qi[2], lo[2];
    float lse2[2], delta[2];  // lse in log2 units (+inf past n: P is 0 there); Delta_i
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      qi[hr] = qa + r0 + 8 * hr;
      lo[hr] = FirstKey<kWindow>(doc_start, min(qi[hr], n - 1), window);
      const bool row = qi[hr] < n;
      const int64_t at = static_cast<int64_t>(row ? qi[hr] : 0) * H + h;
      lse2[hr] = row ? lse[at] * kLog2e : INFINITY;
      delta[hr] = row ? *reinterpret_cast<const float*>(dq + at * kD) : 0.0f;
    }
    float acc[kD / 2];
#pragma unroll
    for (int i = 0; i < kD / 2; ++i) acc[i] = 0.0f;
    const bf16* q_rows = s_q + cw * 64 * kColumns;
    const bf16* do_rows = s_do + cw * 64 * kColumns;

    // The tiles this warpgroup's queries see, [a0, a1) (as the forward's), and the stage,
    // parity and keys of tile it.
    int a0 = 0, a1 = 0;
    if (has_rows) {
      const int before = wg_lo - j_first - kN + 1;
      a0 = before > 0 ? (before + kN - 1) / kN : 0;
      a1 = min(tiles, (qb - j_first) / kN + 1);
    }
    auto stage = [](int it) { return it % kStages; };
    auto parity = [](int it) { return static_cast<uint32_t>((it / kStages) & 1); };
    auto k_tile = [&](int it) { return s_k + stage(it) * T::kKvElems; };
    auto v_tile = [&](int it) { return s_v + stage(it) * T::kKvElems; };
    auto wait_tile = [&](int it) {
      BarrierWait(&k_full[stage(it)], parity(it));
      BarrierWait(&v_full[stage(it)], parity(it));
    };
    auto masked = [&](int it) { return ForwardTileMasked(j_first, it, wg_last_lo, qa, kN); };
    auto skip = [&](int it) {  // a tile none of this warpgroup's queries sees
      wait_tile(it);
      BarrierArrive(&kv_empty[stage(it)]);
    };

    for (int it = 0; it < a0; ++it) skip(it);
    BarrierWait(q_full, 0);
    if (a0 < a1) {
      uint32_t ds[kN / 16][4];
      {  // the first tile's S, dP and dS
        float sc[kN / 2], dp[kN / 2];
        wait_tile(a0);
        FenceRegisters(sc);
        FenceRegisters(dp);
        WgmmaFence();
        RowsTimesRowsT<kD, kN>(sc, q_rows, kM, k_tile(a0), kN);   // S = Q K^T
        RowsTimesRowsT<kD, kN>(dp, do_rows, kM, v_tile(a0), kN);  // dP = dO V^T
        WgmmaCommit();
        WgmmaWait<0>();
        FenceRegisters(sc);
        FenceRegisters(dp);
        const int j0 = j_first + a0 * kN;
        if (masked(a0)) {
          DqTileDs<kN, true>(sc, dp, j0, lo, qi, lse2, delta, c0, scale_log2, ds);
        } else {
          DqTileDs<kN, false>(sc, dp, j0, lo, qi, lse2, delta, c0, scale_log2, ds);
        }
      }
      // One tile's dq += dS K beside the next tile's S, dP and dS (as the forward's P V
      // beside the next S and softmax: a straight run of code from the wgmmas' issue to their
      // wait, the masked and unmasked tiles in loops of their own). The sums' order is the
      // tiles' as before.
      auto step = [&](int it, auto mask) {
        float sc[kN / 2], dp[kN / 2];
        wait_tile(it + 1);
        FenceRegisters(sc);
        FenceRegisters(dp);
        FenceRegisters(acc);
        WgmmaFence();
        RowsTimesRowsT<kD, kN>(sc, q_rows, kM, k_tile(it + 1), kN);
        RowsTimesRowsT<kD, kN>(dp, do_rows, kM, v_tile(it + 1), kN);
        WgmmaCommit();
        AccumulateFragmentsTimesRows<kD, kN>(acc, ds, k_tile(it));  // dq += dS K
        WgmmaCommit();
        WgmmaWait<1>();
        FenceRegisters(sc);
        FenceRegisters(dp);
        uint32_t ds_next[kN / 16][4];
        DqTileDs<kN, decltype(mask)::value>(sc, dp, j_first + (it + 1) * kN, lo, qi, lse2, delta,
                                            c0, scale_log2, ds_next);
        WgmmaWait<0>();
        FenceRegisters(acc);
        FenceFragments<kN>(ds);
        BarrierArrive(&kv_empty[stage(it)]);
#pragma unroll
        for (int kk = 0; kk < kN / 16; ++kk) {
#pragma unroll
          for (int i = 0; i < 4; ++i) ds[kk][i] = ds_next[kk][i];
        }
      };
      int u_lo, u_hi;
      ForwardUnmaskedTiles(j_first, wg_last_lo, qa, kN, &u_lo, &u_hi);
      int it = a0;  // the tile whose dq += dS K runs beside the next one's S, dP and dS
      for (; it + 1 < min(a1, u_lo); ++it) step(it, std::true_type{});
      for (; it + 1 < min(a1, u_hi); ++it) step(it, std::false_type{});
      for (; it + 1 < a1; ++it) step(it, std::true_type{});
      {  // the last tile's dq += dS K
        FenceRegisters(acc);
        WgmmaFence();
        AccumulateFragmentsTimesRows<kD, kN>(acc, ds, k_tile(a1 - 1));
        WgmmaCommit();
        WgmmaWait<0>();
        FenceRegisters(acc);
        FenceFragments<kN>(ds);
        BarrierArrive(&kv_empty[stage(a1 - 1)]);
      }
    }
    for (int it = max(a1, a0); it < tiles; ++it) skip(it);

#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int row = qi[hr];
      if (row < n) {
        bf16* out = dq + (static_cast<int64_t>(row) * H + h) * kD + c0;
#pragma unroll
        for (int c = 0; c < kD / 8; ++c) {
          *reinterpret_cast<uint32_t*>(out + 8 * c) =
              PackBf16(acc[4 * c + 2 * hr] * scale, acc[4 * c + 2 * hr + 1] * scale);
        }
      }
    }
  }
#endif
}

// dk and dv of the backward, per block of 128 keys of one kv head: a producer warpgroup and
// two consumers of 64 keys. The producer loads the block's K and V once, then the Q and dO
// tiles (64 queries) of every query head of the group that sees these keys, head by head,
// into a three-stage ring; the producer's second warp stages each tile's queries' lse, Delta
// and first keys beside them, on the same full barrier, so a consumer's loop makes no global
// load. A consumer, per tile: S^T = K Q^T and dP^T = V dO^T by wgmma from shared memory,
// P^T = exp(S^T - lse) in registers, then dv += P^T dO by wgmma with P^T as the A operand
// from registers while dS^T = P^T (dP^T - Delta) is computed, then dk += dS^T Q; dO and Q
// transposed. dk is scaled by 1/sqrt(D) at the end. The tiles are visited in order,
// so the sums' order is fixed (order::DkDvItem: the tiles from the last down, the group's
// heads in turn at each). Delta is parked in dq's storage (AttentionDeltaKernel); dq's own
// pass runs after this one.
//
// kFusedDq: also dq, in the same pass (5 GEMMs a tile instead of the two passes' 7). A
// consumer stages its tile's dS in shared memory and adds dS K (64 queries x kD) into
// dq_acc, fp32 (n, kv_count * group, kD), the launch's kv heads kv_first... only, in a fixed
// order: a query tile's consumers add in ascending order of their 64 keys, each waiting for
// the tile's count (tile_counts, (kv_count * group, n / 64) ints, zeroed) to say that every
// consumer of lower keys that sees the tile has added. The consumers of a tile are exactly
// those whose keys some query of it sees, 64 c .. 64 c + 63 for c from the tile's first key
// / 64 up to its last query / 64, so the one of keys 64 c waits for c - first key / 64
// before it. A block takes its keys from a ticket (order::FusedBlock, `ticket` zeroed): the
// lowest keys first, so a block waits only for blocks that started before it and no wait
// can close a cycle; and as every block of a kv head visits the tiles from the last down,
// the block of the next keys reaches a tile just after the one it waits for. The adds are
// 16-byte vector reductions (a lane and its neighbour trade a row's halves).
template <int kD, bool kWindow, bool kFusedDq = false>
__global__ void __launch_bounds__(3 * kWarpgroup, 1)
    HopperDkDvKernel(const __grid_constant__ CUtensorMap k_map,
                     const __grid_constant__ CUtensorMap v_map,
                     const __grid_constant__ CUtensorMap q_map,
                     const __grid_constant__ CUtensorMap do_map, bf16* __restrict__ dk,
                     bf16* __restrict__ dv, const bf16* __restrict__ dq,
                     const float* __restrict__ lse, const int32_t* __restrict__ doc_start,
                     int window, int n, int H, int KV, float scale_log2, float scale,
                     float* __restrict__ dq_acc = nullptr, int* __restrict__ tile_counts = nullptr,
                     int kv_first = 0, int* __restrict__ ticket = nullptr) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using T = DkDvTiles<kD>;
  constexpr int kN = T::kN, kM = T::kM, kStages = T::kStages, kBlocks = kD / kColumns;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = AlignedSmem(smem_raw);
  bf16* s_k = reinterpret_cast<bf16*>(smem);
  bf16* s_v = s_k + T::kKvElems;
  bf16* s_q = s_v + T::kKvElems;                 // kStages tiles
  bf16* s_do = s_q + kStages * T::kQElems;       // kStages tiles
  bf16* s_ds = s_do + kStages * T::kQElems;      // kFusedDq: a tile's dS per consumer
  uint64_t* bars = reinterpret_cast<uint64_t*>(s_ds + (kFusedDq ? 2 * T::kDsElems : 0));
  uint64_t* kv_full = bars;
  uint64_t* q_full = bars + 1;
  uint64_t* q_empty = bars + 1 + kStages;
  float* s_stats = reinterpret_cast<float*>(bars + T::kBarriers);  // T::kStatWords

  [[maybe_unused]] __shared__ int s_ticket;  // kFusedDq
  if (threadIdx.x == 0) {
    if constexpr (kFusedDq) s_ticket = atomicAdd(ticket, 1);
    BarrierInit(kv_full, 1);
    for (int s = 0; s < kStages; ++s) {
      BarrierInit(&q_full[s], 1 + 32);  // the TMA thread's and the statistics warp's
      BarrierInit(&q_empty[s], 2 * kWarpgroup);
    }
    BarrierInitFence();
  }
  __syncthreads();

  int key_block = static_cast<int>(blockIdx.x), kvh = static_cast<int>(blockIdx.y);
  if constexpr (kFusedDq) {  // see above
    order::FusedBlock(s_ticket, static_cast<int>(gridDim.y), &key_block, &kvh);
    kvh += kv_first;
  }
  const int group = H / KV;
  const int j0 = key_block * kN, j_last = min(j0 + kN, n) - 1;
  // Queries [j0, i_end) see these keys.
  const int i_end = order::KeyBlockQueryEnd<kWindow>(doc_start, j_last, window, n);
  const int q_tiles = (i_end - j0 + kM - 1) / kM, items = group * q_tiles;
  const int wg = static_cast<int>(threadIdx.x) / kWarpgroup;

  if (wg == 0) {  // producer
    RegistersDown<24>();
    if (threadIdx.x == 0) {
      TmaPrefetchMap(&k_map);
      TmaPrefetchMap(&v_map);
      TmaPrefetchMap(&q_map);
      TmaPrefetchMap(&do_map);
      BarrierExpectBytes(kv_full, 2 * 2 * T::kKvElems);
#pragma unroll
      for (int b = 0; b < kBlocks; ++b) {
        TmaLoad3d(s_k + b * kN * kColumns, &k_map, kv_full, b * kColumns, kvh, j0);
        TmaLoad3d(s_v + b * kN * kColumns, &v_map, kv_full, b * kColumns, kvh, j0);
      }
      for (int t = 0; t < items; ++t) {
        const int s = t % kStages, use = t / kStages;
        int hg, i0;
        order::DkDvItem(t, group, q_tiles, j0, kM, &hg, &i0);
        const int h = kvh * group + hg;
        if (use > 0) BarrierWait(&q_empty[s], (use - 1) & 1);
        bf16* q_tile = s_q + s * T::kQElems;
        bf16* do_tile = s_do + s * T::kQElems;
        BarrierExpectBytes(&q_full[s], 2 * 2 * T::kQElems);
#pragma unroll
        for (int b = 0; b < kBlocks; ++b) {
          TmaLoad3d(q_tile + b * kM * kColumns, &q_map, &q_full[s], b * kColumns, h, i0);
          TmaLoad3d(do_tile + b * kM * kColumns, &do_map, &q_full[s], b * kColumns, h, i0);
        }
      }
    } else if (threadIdx.x / 32 == 1) {
      // The statistics warp: each tile's queries' lse (log2; +inf past n: P is 0 there),
      // Delta and first key into its stage, then an arrival on the stage's full barrier (a
      // release of these stores), so the consumers wait for them with Q and dO.
      // Two queries a lane, the addresses kept simple: this warpgroup has 24 registers.
      static_assert(kM == 64, "the statistics warp takes a tile's queries two a lane");
      const int lane = static_cast<int>(threadIdx.x) % 32;
      const float* lse_kv = lse + kvh * group;
      const float* delta_kv =  // Delta, parked in dq's storage: a float every kD / 2
          reinterpret_cast<const float*>(dq + static_cast<int64_t>(kvh) * group * kD);
      for (int t = 0; t < items; ++t) {
        const int s = t % kStages, use = t / kStages;
        int hg, i0;
        order::DkDvItem(t, group, q_tiles, j0, kM, &hg, &i0);
        if (use > 0) BarrierWait(&q_empty[s], (use - 1) & 1);
        float* stats = s_stats + s * 3 * kM + lane;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int i = i0 + lane + 32 * half;
          const bool in = i < n;
          const int64_t at = static_cast<int64_t>(in ? i : 0) * H + hg;
          const float lse_i = __ldg(lse_kv + at), delta = delta_kv[at * (kD / 2)];
          stats[32 * half] = in ? lse_i * kLog2e : INFINITY;
          stats[kM + 32 * half] = in ? delta : 0.0f;
          reinterpret_cast<int*>(stats)[2 * kM + 32 * half] =
              in ? FirstKey<kWindow>(doc_start, i, window) : INT_MAX;
        }
        BarrierArrive(&q_full[s]);
      }
    }
  } else {  // consumer: 64 keys
    RegistersUp<240>();
    const int cw = wg - 1, t = static_cast<int>(threadIdx.x) % kWarpgroup;
    const int lane = t % 32, r0 = 16 * (t / 32) + lane / 4, c0 = 2 * (lane % 4);
    const int ka = j0 + 64 * cw, kb = min(ka + 63, n - 1);
    const bool has_keys = ka < n;
    const int kj[2] = {ka + r0, ka + r0 + 8};  // this thread's keys (rows)
    float dk_acc[kD / 2], dv_acc[kD / 2];
#pragma unroll
    for (int i = 0; i < kD / 2; ++i) dk_acc[i] = dv_acc[i] = 0.0f;
    const bf16* k_rows = s_k + cw * 64 * kColumns;
    const bf16* v_rows = s_v + cw * 64 * kColumns;

    // kFusedDq: the count of the tile our last dq adds went to, to be raised once every
    // thread's adds are issued (a barrier, then a release by one thread). Raised late, beside
    // the next tile's first GEMMs, not on the way to them; never after a wait that another
    // consumer's progress could hold up (only after our next tile has landed, which needs no
    // more of the other consumer than the tile it waits at).
    [[maybe_unused]] int* pending = nullptr;
    [[maybe_unused]] int pending_count = 0;
    auto release_pending = [&] {
      if constexpr (kFusedDq) {
        if (pending != nullptr) {
          NamedBarrierSync(1 + cw, kWarpgroup);
          if (t == 0) StoreRelease(pending, pending_count);
          pending = nullptr;
        }
      }
    };
    BarrierWait(kv_full, 0);
    for (int it = 0; it < items; ++it) {
      const int s = it % kStages;
      const uint32_t parity = (it / kStages) & 1;
      int hg, i0;
      order::DkDvItem(it, group, q_tiles, j0, kM, &hg, &i0);
      [[maybe_unused]] const int h = kvh * group + hg;  // kFusedDq
      const int i_last = min(i0 + kM, n) - 1;
      const bf16* q_tile = s_q + s * T::kQElems;
      const bf16* do_tile = s_do + s * T::kQElems;
      // The tile's queries' statistics, staged with Q and dO by the statistics warp; from
      // them, whether some query of the tile may see some key of ours, and whether the tile
      // needs the mask, without a global load on the way to the GEMMs.
      const float* stats = s_stats + s * 3 * kM;
      const int* first_key = reinterpret_cast<const int*>(stats + 2 * kM);
      BarrierWait(&q_full[s], parity);
      const bool active = has_keys && order::TileMeetsKeys(first_key[0], i_last, ka, kb);
      if (active) {
        float st[kM / 2], dpt[kM / 2];  // S^T, dP^T: (64 keys, kM queries)
        FenceRegisters(st);
        FenceRegisters(dpt);
        WgmmaFence();
        RowsTimesRowsT<kD, kM>(st, k_rows, kN, q_tile, kM);    // S^T = K Q^T
        RowsTimesRowsT<kD, kM>(dpt, v_rows, kN, do_tile, kM);  // dP^T = V dO^T
        WgmmaCommit();
        release_pending();
        WgmmaWait<0>();
        FenceRegisters(st);
        FenceRegisters(dpt);
        const bool masked = i0 < kb || first_key[i_last - i0] > ka || i0 + kM > n;
        WithMask(masked, [&](auto mask) {
          constexpr bool kMasked = decltype(mask)::value;
#pragma unroll
          for (int c = 0; c < kM / 8; ++c) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int col = 8 * c + c0 + e, i = i0 + col;  // this column's query
              const float lse2 = stats[col];
              const int lo = kMasked ? first_key[col] : 0;
#pragma unroll
              for (int hr = 0; hr < 2; ++hr) {
                const int idx = 4 * c + 2 * hr + e, j = kj[hr];
                float p = exp2f(st[idx] * scale_log2 - lse2);
                if (kMasked && (j < lo || j > i)) p = 0.0f;
                st[idx] = p;  // P^T
              }
            }
          }
        });
        // dv += P^T dO runs while dS^T = P^T (dP^T - Delta) is computed and packed.
        uint32_t pt[kM / 16][4], dst[kM / 16][4];
        PackFragments<kM>(st, pt);
        FenceRegisters(dv_acc);
        WgmmaFence();
        AccumulateFragmentsTimesRows<kD, kM>(dv_acc, pt, do_tile);  // dv += P^T dO
        WgmmaCommit();
#pragma unroll
        for (int c = 0; c < kM / 8; ++c) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float delta = stats[kM + 8 * c + c0 + e];
#pragma unroll
            for (int hr = 0; hr < 2; ++hr) {
              const int idx = 4 * c + 2 * hr + e;
              dpt[idx] = st[idx] * (dpt[idx] - delta);  // dS^T
            }
          }
        }
        [[maybe_unused]] const bf16* ds_tile = s_ds + cw * T::kDsElems;
        if constexpr (kFusedDq) {
          // dS (queries x keys) into this consumer's tile as a TMA load would write it (query
          // row q, key column k in 16-byte chunk (k / 8) ^ (q % 8)), rounded as dst is.
          uint8_t* ds_bytes = reinterpret_cast<uint8_t*>(const_cast<bf16*>(ds_tile));
#pragma unroll
          for (int c = 0; c < kM / 8; ++c) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int q = 8 * c + c0 + e;
#pragma unroll
              for (int hr = 0; hr < 2; ++hr) {
                const int key = r0 + 8 * hr;
                *reinterpret_cast<bf16*>(ds_bytes + q * 128 + ((((key >> 3) ^ (q & 7))) << 4) +
                                         (key & 7) * 2) = __float2bfloat16_rn(dpt[4 * c + 2 * hr + e]);
              }
            }
          }
          FenceProxyAsyncShared();
          NamedBarrierSync(1 + cw, kWarpgroup);  // the whole tile is written
        }
        PackFragments<kM>(dpt, dst);
        // This tile's dS K (64 queries x kD); its first wgmma overwrites it.
        [[maybe_unused]] float dq_part[kFusedDq ? kD / 2 : 1];
        if constexpr (kFusedDq) FenceRegisters(dq_part);
        FenceRegisters(dk_acc);
        WgmmaFence();
        AccumulateFragmentsTimesRows<kD, kM>(dk_acc, dst, q_tile);  // dk += dS^T Q
        // dq = dS K over our 64 keys: with dk at head_dim 64; after it at 128, where dq's 64
        // accumulators beside P^T's and dS^T's fragments would make ptxas serialize the
        // wgmmas (C7512).
        auto issue_dq = [&] {  // after a wgmma fence
          if constexpr (kFusedDq) {
#pragma unroll
            for (int kk = 0; kk < 64 / 16; ++kk) {
              WgmmaSST<kD>(dq_part, Desc(ds_tile + kk * 16),
                           Desc(k_rows + kk * 16 * kColumns, 2 * kN * kColumns), kk > 0);
            }
          }
        };
        constexpr bool kDqBeside = kFusedDq && kD <= 64;
        if constexpr (kDqBeside) issue_dq();
        WgmmaCommit();
        WgmmaWait<0>();
        FenceRegisters(dv_acc);
        FenceRegisters(dk_acc);
        FenceFragments<kM>(pt);
        FenceFragments<kM>(dst);
        if constexpr (kFusedDq && !kDqBeside) {
          FenceRegisters(dq_part);
          WgmmaFence();
          issue_dq();
          WgmmaCommit();
          WgmmaWait<0>();
        }
        if constexpr (kFusedDq) {
          FenceRegisters(dq_part);
          // Our turn at the tile (see above), then the adds, then the next consumer's turn.
          const int heads = static_cast<int>(gridDim.y) * group;  // the launch's query heads
          const int lh = (kvh - kv_first) * group + (h - kvh * group);
          int* count = tile_counts + static_cast<int64_t>(lh) * ((n + 63) / 64) + i0 / 64;
          // (first_key[0] from shared memory here makes ptxas spill at head_dim 128.)
          const int before = order::DqAddsBefore(FirstKey<kWindow>(doc_start, i0, window), ka);
          if (t == 0) {
            while (LoadAcquire(count) != before) __nanosleep(32);
          }
          NamedBarrierSync(1 + cw, kWarpgroup);
          // A thread holds columns c0, c0 + 1 of every 8 of rows r0 and r0 + 8; with its
          // neighbour's (lane ^ 1: columns c0 ^ 2) an even lane adds 4 columns of row r0, an
          // odd one 4 of row r0 + 8.
          const bool even = (lane & 1) == 0;
          const int q = i0 + r0 + (even ? 0 : 8), col = c0 - (even ? 0 : 2);
          float* out = dq_acc + (static_cast<int64_t>(min(q, n - 1)) * heads + lh) * kD + col;
#pragma unroll
          for (int c = 0; c < kD / 8; ++c) {
            const float give0 = even ? dq_part[4 * c + 2] : dq_part[4 * c];
            const float give1 = even ? dq_part[4 * c + 3] : dq_part[4 * c + 1];
            const float got0 = __shfl_xor_sync(0xffffffffu, give0, 1);
            const float got1 = __shfl_xor_sync(0xffffffffu, give1, 1);
            if (q < n) {
              if (even) {
                RedAddV4(out + 8 * c, dq_part[4 * c], dq_part[4 * c + 1], got0, got1);
              } else {
                RedAddV4(out + 8 * c, got0, got1, dq_part[4 * c + 2], dq_part[4 * c + 3]);
              }
            }
          }
          pending = count;
          pending_count = before + 1;
        }
      } else {
        release_pending();
      }
      BarrierArrive(&q_empty[s]);
    }
    release_pending();

#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int row = kj[hr];
      if (row < n) {
        const int64_t base = (static_cast<int64_t>(row) * KV + kvh) * kD + c0;
#pragma unroll
        for (int c = 0; c < kD / 8; ++c) {
          *reinterpret_cast<uint32_t*>(dk + base + 8 * c) =
              PackBf16(dk_acc[4 * c + 2 * hr] * scale, dk_acc[4 * c + 2 * hr + 1] * scale);
          *reinterpret_cast<uint32_t*>(dv + base + 8 * c) =
              PackBf16(dv_acc[4 * c + 2 * hr], dv_acc[4 * c + 2 * hr + 1]);
        }
      }
    }
  }
#endif
}

// dq (n, H, kD) rows of the launch's heads h_first.. from the fused backward's fp32 sums
// (n, heads, kD), times 1/sqrt(kD): a thread per 4 values.
template <int kD>
__global__ void DqFromSumsKernel(bf16* __restrict__ dq, const float* __restrict__ sums, int n,
                                 int H, int h_first, int heads, float scale) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= static_cast<int64_t>(n) * heads * (kD / 4)) return;
  const int64_t row = i / (kD / 4);  // (query, launch head)
  const int64_t query = row / heads;
  const int head = h_first + static_cast<int>(row % heads), d = 4 * static_cast<int>(i % (kD / 4));
  const float4 x = reinterpret_cast<const float4*>(sums)[i];
  const uint2 out = {PackBf16(x.x * scale, x.y * scale), PackBf16(x.z * scale, x.w * scale)};
  *reinterpret_cast<uint2*>(dq + (query * H + head) * kD + d) = out;
}

// ---- host side

// cuTensorMapEncodeTiled, from the driver through the runtime (no link to libcuda).
PFN_cuTensorMapEncodeTiled_v12000 EncodeTiled() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult found{};
    const cudaError_t err = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000,
                                                             cudaEnableDefault, &found);
    MT_CHECK_MSG(err == cudaSuccess && found == cudaDriverEntryPointSuccess && f != nullptr,
                 "attention: the driver has no cuTensorMapEncodeTiled (%s)",
                 cudaGetErrorString(err));
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

// The tensor map of an (n, heads, D) bf16 tensor read in boxes of 64 columns of one head and
// `rows` rows, 128-byte swizzled.
CUtensorMap HeadMap(const bf16* x, int n, int heads, int D, int rows) {
  CUtensorMap map;
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(D), static_cast<cuuint64_t>(heads),
                              static_cast<cuuint64_t>(n)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(D) * 2,
                                 static_cast<cuuint64_t>(heads) * D * 2};
  const cuuint32_t box[3] = {kColumns, 1, static_cast<cuuint32_t>(rows)};
  const cuuint32_t steps[3] = {1, 1, 1};
  const CUresult r = EncodeTiled()(
      &map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, const_cast<bf16*>(x), dims, strides, box, steps,
      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  MT_CHECK_MSG(r == CUDA_SUCCESS, "attention: cannot describe a (%d, %d, %d) tensor to TMA: error %d",
               n, heads, D, static_cast<int>(r));
  return map;
}

template <typename Kernel>
void SetSmem(Kernel kernel, int bytes) {
  const cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  MT_CHECK_MSG(err == cudaSuccess,
               "attention: cannot give a Hopper kernel %d bytes of shared memory: %s", bytes,
               cudaGetErrorString(err));
}

template <int kD, bool kWindow, bool kSink>
void LaunchForward(bf16* o, float* lse, const bf16* q, const bf16* k, const bf16* v,
                   const int32_t* doc_start, const bf16* sinks, int window, int n, int H, int KV,
                   cudaStream_t stream) {
  using T = ForwardTiles<kD, kWindow>;
  const CUtensorMap q_map = HeadMap(q, n, H, kD, T::kM);
  const CUtensorMap k_map = HeadMap(k, n, KV, kD, T::kN);
  const CUtensorMap v_map = HeadMap(v, n, KV, kD, T::kN);
  auto kernel = HopperForwardKernel<kD, kWindow, kSink>;
  SetSmem(kernel, T::kSmemBytes);
  const dim3 grid((n + T::kM - 1) / T::kM, H);
  kernel<<<grid, T::kThreads, T::kSmemBytes, stream>>>(
      q_map, k_map, v_map, o, lse, doc_start, sinks, window, n, H, KV,
      kLog2e / sqrtf(static_cast<float>(kD)));
  MT_CUDA_LAUNCH_CHECK();
}

template <int kD>
void LaunchForward(bf16* o, float* lse, const bf16* q, const bf16* k, const bf16* v,
                   const int32_t* doc_start, const bf16* sinks, int window, int n, int H, int KV,
                   cudaStream_t stream) {
  if (window > 0 && sinks != nullptr) {
    LaunchForward<kD, true, true>(o, lse, q, k, v, doc_start, sinks, window, n, H, KV, stream);
  } else if (window > 0) {
    LaunchForward<kD, true, false>(o, lse, q, k, v, doc_start, sinks, window, n, H, KV, stream);
  } else if (sinks != nullptr) {
    LaunchForward<kD, false, true>(o, lse, q, k, v, doc_start, sinks, window, n, H, KV, stream);
  } else {
    LaunchForward<kD, false, false>(o, lse, q, k, v, doc_start, sinks, window, n, H, KV, stream);
  }
}

template <int kD, bool kWindow>
void LaunchDq(bf16* dq, const bf16* dout, const bf16* q, const bf16* k, const bf16* v,
              const float* lse, const int32_t* doc_start, int window, int n, int H, int KV,
              cudaStream_t stream) {
  using T = DqTiles<kD>;
  const CUtensorMap q_map = HeadMap(q, n, H, kD, T::kM);
  const CUtensorMap do_map = HeadMap(dout, n, H, kD, T::kM);
  const CUtensorMap k_map = HeadMap(k, n, KV, kD, T::kN);
  const CUtensorMap v_map = HeadMap(v, n, KV, kD, T::kN);
  SetSmem(HopperDqKernel<kD, kWindow>, T::kSmemBytes);
  const float scale = 1.0f / sqrtf(static_cast<float>(kD));
  const dim3 grid((n + T::kM - 1) / T::kM, H);
  HopperDqKernel<kD, kWindow><<<grid, 3 * kWarpgroup, T::kSmemBytes, stream>>>(
      q_map, do_map, k_map, v_map, dq, lse, doc_start, window, n, H, KV, kLog2e * scale, scale);
  MT_CUDA_LAUNCH_CHECK();
}

template <int kD, bool kWindow>
void LaunchDkDv(bf16* dk, bf16* dv, const bf16* dq, const bf16* dout, const bf16* q,
                const bf16* k, const bf16* v, const float* lse, const int32_t* doc_start,
                int window, int n, int H, int KV, cudaStream_t stream) {
  using T = DkDvTiles<kD>;
  const CUtensorMap k_map = HeadMap(k, n, KV, kD, T::kN);
  const CUtensorMap v_map = HeadMap(v, n, KV, kD, T::kN);
  const CUtensorMap q_map = HeadMap(q, n, H, kD, T::kM);
  const CUtensorMap do_map = HeadMap(dout, n, H, kD, T::kM);
  SetSmem(HopperDkDvKernel<kD, kWindow>, T::kSmemBytes);
  const float scale = 1.0f / sqrtf(static_cast<float>(kD));
  const dim3 grid((n + T::kN - 1) / T::kN, KV);
  HopperDkDvKernel<kD, kWindow><<<grid, 3 * kWarpgroup, T::kSmemBytes, stream>>>(
      k_map, v_map, q_map, do_map, dk, dv, dq, lse, doc_start, window, n, H, KV, kLog2e * scale,
      scale);
  MT_CUDA_LAUNCH_CHECK();
}

// HopperAttentionBackwardFused (ops.h), max_kv_heads > 0 capping a launch's kv heads.
template <int kD, bool kWindow>
bool LaunchFusedBackward(bf16* dq, bf16* dk, bf16* dv, const bf16* dout, const bf16* q,
                         const bf16* k, const bf16* v, const float* lse, const int32_t* doc_start,
                         int window, int n, int H, int KV, float* dq_sums, int64_t dq_sum_floats,
                         int max_kv_heads, cudaStream_t stream) {
  using T = DkDvTiles<kD>;
  const int group = H / KV;
  const int64_t count_words = (n + 63) / 64;  // a head's query tiles of 64
  const int64_t per_kv_head = static_cast<int64_t>(group) * (static_cast<int64_t>(n) * kD + count_words);
  // (Each launch's sums, counts and its ticket.)
  int kv_per_launch = static_cast<int>(std::min<int64_t>(KV, (dq_sum_floats - 1) / per_kv_head));
  if (max_kv_heads > 0) kv_per_launch = std::min(kv_per_launch, max_kv_heads);
  if (dq_sums == nullptr || kv_per_launch < 1) return false;
  const CUtensorMap k_map = HeadMap(k, n, KV, kD, T::kN);
  const CUtensorMap v_map = HeadMap(v, n, KV, kD, T::kN);
  const CUtensorMap q_map = HeadMap(q, n, H, kD, T::kM);
  const CUtensorMap do_map = HeadMap(dout, n, H, kD, T::kM);
  auto kernel = HopperDkDvKernel<kD, kWindow, true>;
  SetSmem(kernel, T::kFusedSmemBytes);
  const float scale = 1.0f / sqrtf(static_cast<float>(kD));
  for (int kv_first = 0; kv_first < KV; kv_first += kv_per_launch) {
    const int kv_count = std::min(kv_per_launch, KV - kv_first), heads = kv_count * group;
    const int64_t sum_floats = static_cast<int64_t>(heads) * n * kD;
    int* counts = reinterpret_cast<int*>(dq_sums + sum_floats);
    int* ticket = counts + heads * count_words;
    MT_CUDA_CHECK(cudaMemsetAsync(
        dq_sums, 0, (sum_floats + heads * count_words + 1) * sizeof(float), stream));
    kernel<<<dim3((n + T::kN - 1) / T::kN, kv_count), 3 * kWarpgroup, T::kFusedSmemBytes,
             stream>>>(k_map, v_map, q_map, do_map, dk, dv, dq, lse, doc_start, window, n, H, KV,
                       kLog2e * scale, scale, dq_sums, counts, kv_first, ticket);
    MT_CUDA_LAUNCH_CHECK();
    constexpr int kThreads = 256;
    const int64_t threads = sum_floats / 4;
    DqFromSumsKernel<kD><<<static_cast<unsigned>((threads + kThreads - 1) / kThreads), kThreads, 0,
                           stream>>>(dq, dq_sums, n, H, kv_first * group, heads, scale);
    MT_CUDA_LAUNCH_CHECK();
  }
  return true;
}

template <int kD>
bool LaunchFusedBackward(bf16* dq, bf16* dk, bf16* dv, const bf16* dout, const bf16* q,
                         const bf16* k, const bf16* v, const float* lse, const int32_t* doc_start,
                         int window, int n, int H, int KV, float* dq_sums, int64_t dq_sum_floats,
                         int max_kv_heads, cudaStream_t stream) {
  auto launch = window > 0 ? LaunchFusedBackward<kD, true> : LaunchFusedBackward<kD, false>;
  return launch(dq, dk, dv, dout, q, k, v, lse, doc_start, window, n, H, KV, dq_sums,
                dq_sum_floats, max_kv_heads, stream);
}

template <int kD>
void LaunchDq(bf16* dq, const bf16* dout, const bf16* q, const bf16* k, const bf16* v,
              const float* lse, const int32_t* doc_start, int window, int n, int H, int KV,
              cudaStream_t stream) {
  if (window > 0) {
    LaunchDq<kD, true>(dq, dout, q, k, v, lse, doc_start, window, n, H, KV, stream);
  } else {
    LaunchDq<kD, false>(dq, dout, q, k, v, lse, doc_start, window, n, H, KV, stream);
  }
}

// Whether the current device is compute capability 9.0 (the sm_90a code runs nowhere else).
bool DeviceIsHopper() {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> known[kMaxDevices];  // 0 unknown, 1 yes, 2 no
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= kMaxDevices) return false;
  int state = known[device].load(std::memory_order_relaxed);
  if (state == 0) {
    int major = 0, minor = 0;
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
    state = major == 9 && minor == 0 ? 1 : 2;
    known[device].store(state, std::memory_order_relaxed);
  }
  return state == 1;
}

}  // namespace

bool HopperAttentionApplies(int64_t D) {
  return (D == 64 || D == 128) && GetEngineSettings().attention.hopper && DeviceIsHopper();
}

void HopperAttention(bf16* o, float* lse, const bf16* q, const bf16* k, const bf16* v,
                     const int32_t* doc_start, const bf16* sinks, int window, int n, int H,
                     int KV, int D, cudaStream_t stream) {
  if (D == 64) {
    LaunchForward<64>(o, lse, q, k, v, doc_start, sinks, window, n, H, KV, stream);
  } else {
    MT_CHECK_MSG(D == 128, "HopperAttention: head_dim %d (64 or 128)", D);
    LaunchForward<128>(o, lse, q, k, v, doc_start, sinks, window, n, H, KV, stream);
  }
}

void HopperAttentionDq(bf16* dq, const bf16* dout, const bf16* q, const bf16* k, const bf16* v,
                       const float* lse, const int32_t* doc_start, int window, int n, int H,
                       int KV, int D, cudaStream_t stream) {
  if (D == 64) {
    LaunchDq<64>(dq, dout, q, k, v, lse, doc_start, window, n, H, KV, stream);
  } else {
    MT_CHECK_MSG(D == 128, "HopperAttentionDq: head_dim %d (64 or 128)", D);
    LaunchDq<128>(dq, dout, q, k, v, lse, doc_start, window, n, H, KV, stream);
  }
}

namespace {

// -1 unless the fused backward was asked for; else at most this many kv heads a launch
// (0: no cap).
int FusedBackwardMaxKvHeads() { return GetEngineSettings().attention.fused_backward_kv_heads; }

}  // namespace

bool HopperFusedBackwardRequested() { return FusedBackwardMaxKvHeads() >= 0; }

bool HopperAttentionBackwardFused(bf16* dq, bf16* dk, bf16* dv, const bf16* dout, const bf16* q,
                                  const bf16* k, const bf16* v, const float* lse,
                                  const int32_t* doc_start, int window, int n, int H, int KV, int D,
                                  float* dq_sums, int64_t dq_sum_floats, cudaStream_t stream) {
  const int max_kv_heads = FusedBackwardMaxKvHeads();
  if (max_kv_heads < 0) return false;
  MT_CHECK_MSG(D == 64 || D == 128, "HopperAttentionBackwardFused: head_dim %d (64 or 128)", D);
  auto launch = D == 64 ? LaunchFusedBackward<64> : LaunchFusedBackward<128>;
  return launch(dq, dk, dv, dout, q, k, v, lse, doc_start, window, n, H, KV, dq_sums,
                dq_sum_floats, max_kv_heads, stream);
}

void HopperAttentionDkDv(bf16* dk, bf16* dv, const bf16* dq, const bf16* dout, const bf16* q,
                         const bf16* k, const bf16* v, const float* lse, const int32_t* doc_start,
                         int window, int n, int H, int KV, int D, cudaStream_t stream) {
  MT_CHECK_MSG(D == 64 || D == 128, "HopperAttentionDkDv: head_dim %d (64 or 128)", D);
  if (D == 64 && window > 0) {
    LaunchDkDv<64, true>(dk, dv, dq, dout, q, k, v, lse, doc_start, window, n, H, KV, stream);
  } else if (D == 64) {
    LaunchDkDv<64, false>(dk, dv, dq, dout, q, k, v, lse, doc_start, window, n, H, KV, stream);
  } else if (window > 0) {
    LaunchDkDv<128, true>(dk, dv, dq, dout, q, k, v, lse, doc_start, window, n, H, KV, stream);
  } else {
    LaunchDkDv<128, false>(dk, dv, dq, dout, q, k, v, lse, doc_start, window, n, H, KV, stream);
  }
}

}  // namespace megatrain::cuda
