// Mixture-of-experts permutation on the device: the stable counting sort of the (token,
// choice) pairs by expert, the weighted combine
// back into token order, and their backwards. The math of each is kernels/reference/moe.h's.
//
// Every result is the same bits on every run: no float atomics. The sort is four kernels:
// per-tile histograms (integer atomics in shared memory: the totals do not depend on
// order), a scan over tiles per expert, a scan over experts, and a scatter where one warp
// per tile walks its entries in flat order, 32 at a time, ranking equal experts within a
// chunk with __match_any_sync. Its output is the reference's permutation exactly. Sums over
// a token's k choices run in j order in one thread; the combine backward's dot products
// are a fixed tree that depends only on C.
//
// Shapes: idx (n, k) int32; offsets (E+1), slot_of (R = n*k), row_token (R) int32;
// scratch (ceil(R / kMoeSortTile), E) int32; w, dw (n, k) f32; h, dh, out, dout (n, C) bf16;
// xe, dxe, ye, dye (R, C) bf16. Vector path (8 bf16 = 16 bytes per access) when C % 8 == 0
// and pointers are aligned.
#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "engine/common/check.h"
#include "engine/kernels/cuda/common.cuh"
#include "engine/kernels/cuda/ops.h"
#include "engine/kernels/moe_scratch.h"

namespace megatrain::cuda {
namespace {

constexpr int kSortTile = static_cast<int>(kMoeSortTile);  // entries per tile (moe_scratch.h)
static_assert(kSortTile % 32 == 0, "a sort tile is whole chunks of 32 entries");
constexpr int kSortThreads = 256;                          // the histogram's and the scans' blocks
constexpr int kMaxSortExperts = 4096;                      // a tile's cursors live in shared memory
constexpr int kMaxTopK = 8;  // the combine's backward keeps k dot products a thread
constexpr int64_t kMaxRowBlocks = 1 << 15;

// Threads per block: one column vector per thread, at most 256, a whole number of warps.
int ThreadsFor(int64_t vecs) {
  return static_cast<int>(std::min<int64_t>(256, std::max<int64_t>(32, (vecs + 31) / 32 * 32)));
}

// Rows on x (grid-strided), tiles of `threads` column vectors on y.
dim3 GridFor(int64_t rows, int64_t vecs, int threads) {
  const int64_t tiles = std::min<int64_t>((vecs + threads - 1) / threads, 65535);
  return dim3(static_cast<unsigned>(std::min(rows, kMaxRowBlocks)), static_cast<unsigned>(tiles));
}

// ---- sort ----

// Exclusive prefix sum over the block; *total gets the block's sum. warp_sums: 32 ints.
// REQUIRES: blockDim.x is a multiple of 32; all threads call it.
__device__ __forceinline__ int BlockExclusiveScan(int v, int* total, int* warp_sums) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int incl = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int u = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += u;
  }
  __syncthreads();  // the previous call's readers are done
  if (lane == 31) warp_sums[warp] = incl;
  __syncthreads();
  int base = 0, sum = 0;
  for (int q = 0; q < static_cast<int>(blockDim.x / 32); ++q) {
    const int s = warp_sums[q];
    base += q < warp ? s : 0;
    sum += s;
  }
  *total = sum;
  return base + incl - v;
}

// Block b: scratch[b * E + e] = the entries of expert e in tile b of idx (R).
__global__ void MoeSortCountKernel(int32_t* scratch, const int32_t* idx, int64_t R, int E) {
  extern __shared__ int32_t s_count[];  // (E)
  const int64_t f0 = blockIdx.x * static_cast<int64_t>(kSortTile);
  CountExperts(s_count, idx, f0, min(f0 + kSortTile, R), E);
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    scratch[static_cast<int64_t>(blockIdx.x) * E + e] = s_count[e];
  }
}

// Block e: scratch[t * E + e] (tiles) becomes the tile's first row within expert e (an
// exclusive scan over tiles); offsets[e + 1] gets the expert's row count.
__global__ void MoeSortScanTilesKernel(int32_t* offsets, int32_t* scratch, int64_t tiles, int E) {
  __shared__ int warp_sums[32];
  const int e = blockIdx.x;
  int carry = 0;
  for (int64_t t0 = 0; t0 < tiles; t0 += blockDim.x) {
    const int64_t t = t0 + threadIdx.x;
    const int v = t < tiles ? scratch[t * E + e] : 0;
    int total = 0;
    const int ex = BlockExclusiveScan(v, &total, warp_sums);
    if (t < tiles) scratch[t * E + e] = carry + ex;
    carry += total;
  }
  if (threadIdx.x == 0) {
    offsets[e + 1] = carry;
    if (e == 0) offsets[0] = 0;
  }
}

// One block: offsets[1..E] from counts to their inclusive prefix sums.
__global__ void MoeSortScanExpertsKernel(int32_t* offsets, int E) {
  __shared__ int warp_sums[32];
  int carry = 0;
  for (int e0 = 0; e0 < E; e0 += blockDim.x) {
    const int e = e0 + threadIdx.x;
    const int v = e < E ? offsets[e + 1] : 0;
    int total = 0;
    const int ex = BlockExclusiveScan(v, &total, warp_sums);
    if (e < E) offsets[e + 1] = carry + ex + v;
    carry += total;
  }
}

// One warp per tile, entries in flat order, 32 at a time: the entries of one expert in a
// chunk are ranked by lane, and their leader (lowest lane) advances the expert's cursor.
__global__ void __launch_bounds__(32)
    MoeSortScatterKernel(int32_t* slot_of, int32_t* row_token, const int32_t* scratch,
                         const int32_t* offsets, const int32_t* idx, int64_t R, int E, int k) {
  extern __shared__ int32_t s_cursor[];  // (E): the next row of each expert
  const int lane = threadIdx.x;
  const int64_t tile = blockIdx.x;
  for (int e = lane; e < E; e += 32) s_cursor[e] = offsets[e] + scratch[tile * E + e];
  const int64_t f0 = tile * kSortTile;
  constexpr int kChunks = kSortTile / 32;
  int ids[kChunks];  // all loads in flight before the serial walk
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
    const int64_t f = f0 + i * 32 + lane;
    ids[i] = f < R ? idx[f] : -1;
  }
  __syncwarp();
  const unsigned below = (1u << lane) - 1;
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
    const int e = ids[i];
    const unsigned peers = __match_any_sync(0xffffffffu, e);
    const int leader = __ffs(peers) - 1;
    int base = lane == leader && e >= 0 ? s_cursor[e] : 0;
    base = __shfl_sync(0xffffffffu, base, leader);
    if (lane == leader && e >= 0) s_cursor[e] = base + __popc(peers);
    __syncwarp();  // the next chunk's leader of e may be another lane
    if (e >= 0) {
      const int f = static_cast<int>(f0) + i * 32 + lane;
      const int r = base + __popc(peers & below);
      slot_of[f] = r;
      row_token[r] = f / k;
    }
  }
}

// ---- permutation and combine ----

// out[t] = (kWeighted ? out[t] : 0) + sum_j (kWeighted ? w[t,j] : 1) * rows[slot_of[t,j]],
// j in order in fp32: the combine (kWeighted) and the gather's backward.
template <int kWidth, bool kWeighted>
__global__ void MoeCombineKernel(bf16* out, const bf16* rows, const int32_t* slot_of,
                                 const float* w, int64_t n, int k, int64_t C) {
  const int64_t vecs = C / kWidth;
  for (int64_t t = blockIdx.x; t < n; t += gridDim.x) {
    bf16* o = out + t * C;
    for (int64_t v = blockIdx.y * static_cast<int64_t>(blockDim.x) + threadIdx.x; v < vecs;
         v += static_cast<int64_t>(gridDim.y) * blockDim.x) {
      float acc[kWidth];
      if constexpr (kWeighted) {
        Load<kWidth>(o + v * kWidth, acc);
      } else {
#pragma unroll
        for (int i = 0; i < kWidth; ++i) acc[i] = 0.0f;
      }
#pragma unroll 4
      for (int j = 0; j < k; ++j) {
        const int64_t r = slot_of[t * k + j];
        float y[kWidth];
        Load<kWidth>(rows + r * C + v * kWidth, y);
        const float wj = kWeighted ? w[t * k + j] : 1.0f;
#pragma unroll
        for (int i = 0; i < kWidth; ++i) acc[i] += wj * y[i];
      }
      Store<kWidth>(o + v * kWidth, acc);
    }
  }
}

// One block per token (grid-strided): dye[slot_of[t,j]] = w[t,j] dout[t] and
// dw[t,j] = dot(dout[t], ye[slot_of[t,j]]): each thread sums its columns in order, then
// warps by butterfly and warp sums in warp order (the tree depends only on C).
template <int kWidth>
__global__ void MoeCombineBackwardKernel(bf16* dye, float* dw, const bf16* dout, const bf16* ye,
                                         const int32_t* slot_of, const float* w, int64_t n, int k,
                                         int64_t C) {
  using Raw = std::conditional_t<kWidth == 8, uint4, bf16>;
  __shared__ float s_dot[kMaxTopK][32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t vecs = C / kWidth;
  for (int64_t t = blockIdx.x; t < n; t += gridDim.x) {
    int32_t r[kMaxTopK];
    float wj[kMaxTopK], dot[kMaxTopK];
#pragma unroll
    for (int j = 0; j < kMaxTopK; ++j) {
      r[j] = j < k ? slot_of[t * k + j] : 0;
      wj[j] = j < k ? w[t * k + j] : 0.0f;
      dot[j] = 0.0f;
    }
    for (int64_t v = threadIdx.x; v < vecs; v += blockDim.x) {
      // The k rows' loads all in flight before the first store (which may alias for all the
      // compiler knows), kept as raw bf16 to spare registers.
      Raw raw[kMaxTopK];
#pragma unroll
      for (int j = 0; j < kMaxTopK; ++j) {
        const bf16* y = ye + static_cast<int64_t>(r[j]) * C + v * kWidth;
        if (j < k) raw[j] = *reinterpret_cast<const Raw*>(y);
      }
      float g[kWidth];
      Load<kWidth>(dout + t * C + v * kWidth, g);
#pragma unroll
      for (int j = 0; j < kMaxTopK; ++j) {
        if (j < k) {
          float y[kWidth], d[kWidth];
          Load<kWidth>(reinterpret_cast<const bf16*>(&raw[j]), y);
#pragma unroll
          for (int i = 0; i < kWidth; ++i) {
            dot[j] += g[i] * y[i];
            d[i] = wj[j] * g[i];
          }
          Store<kWidth>(dye + static_cast<int64_t>(r[j]) * C + v * kWidth, d);
        }
      }
    }
    __syncthreads();  // the previous token's s_dot is read
#pragma unroll
    for (int j = 0; j < kMaxTopK; ++j) {
      if (j < k) {
        const float s = WarpSum(dot[j]);
        if (lane == 0) s_dot[j][warp] = s;
      }
    }
    __syncthreads();
    if (threadIdx.x < k) {
      float s = 0.0f;
      for (int q = 0; q < static_cast<int>(blockDim.x / 32); ++q) s += s_dot[threadIdx.x][q];
      dw[t * k + threadIdx.x] = s;
    }
  }
}

bool AllAligned16(std::initializer_list<const void*> ps) {
  for (const void* p : ps) {
    if (!Aligned16(p)) return false;
  }
  return true;
}

}  // namespace

void MoeSort(int32_t* offsets, int32_t* slot_of, int32_t* row_token, int32_t* scratch,
             const int32_t* idx, int64_t n, int64_t E, int64_t k, cudaStream_t stream) {
  MT_CHECK_MSG(E >= 1 && E <= kMaxSortExperts && k >= 1,
               "MoeSort: %lld experts, top-%lld; the CUDA kernel takes 1..%d experts",
               static_cast<long long>(E), static_cast<long long>(k), kMaxSortExperts);
  const int64_t R = n * k;
  MT_CHECK_MSG(n >= 0 && R < (int64_t{1} << 31), "MoeSort: %lld rows exceed int32",
               static_cast<long long>(R));
  if (R == 0) {
    MT_CUDA_CHECK(cudaMemsetAsync(offsets, 0, (E + 1) * sizeof(int32_t), stream));
    return;
  }
  const int64_t tiles = (R + kSortTile - 1) / kSortTile;
  const int e = static_cast<int>(E);
  const size_t smem_bytes = E * sizeof(int32_t);
  MoeSortCountKernel<<<static_cast<unsigned>(tiles), kSortThreads, smem_bytes, stream>>>(scratch,
                                                                                         idx, R, e);
  MT_CUDA_LAUNCH_CHECK();
  MoeSortScanTilesKernel<<<e, kSortThreads, 0, stream>>>(offsets, scratch, tiles, e);
  MT_CUDA_LAUNCH_CHECK();
  MoeSortScanExpertsKernel<<<1, 1024, 0, stream>>>(offsets, e);
  MT_CUDA_LAUNCH_CHECK();
  MoeSortScatterKernel<<<static_cast<unsigned>(tiles), 32, smem_bytes, stream>>>(
      slot_of, row_token, scratch, offsets, idx, R, e, static_cast<int>(k));
  MT_CUDA_LAUNCH_CHECK();
}

void MoeGatherBackward(bf16* dh, const bf16* dxe, const int32_t* slot_of, int64_t n, int64_t k,
                       int64_t C, cudaStream_t stream) {
  if (n <= 0 || C <= 0) return;
  MT_CHECK_MSG(k >= 1 && n * k < (int64_t{1} << 31), "MoeGatherBackward: top-%lld of %lld",
               static_cast<long long>(k), static_cast<long long>(n));
  const int kk = static_cast<int>(k);
  if (C % 8 == 0 && AllAligned16({dh, dxe})) {
    const int threads = ThreadsFor(C / 8);
    MoeCombineKernel<8, false>
        <<<GridFor(n, C / 8, threads), threads, 0, stream>>>(dh, dxe, slot_of, nullptr, n, kk, C);
  } else {
    const int threads = ThreadsFor(C);
    MoeCombineKernel<1, false>
        <<<GridFor(n, C, threads), threads, 0, stream>>>(dh, dxe, slot_of, nullptr, n, kk, C);
  }
  MT_CUDA_LAUNCH_CHECK();
}

void MoeCombine(bf16* out, const bf16* ye, const int32_t* slot_of, const float* w, int64_t n,
                int64_t k, int64_t C, cudaStream_t stream) {
  if (n <= 0 || C <= 0) return;
  MT_CHECK_MSG(k >= 1 && n * k < (int64_t{1} << 31), "MoeCombine: top-%lld of %lld",
               static_cast<long long>(k), static_cast<long long>(n));
  const int kk = static_cast<int>(k);
  if (C % 8 == 0 && AllAligned16({out, ye})) {
    const int threads = ThreadsFor(C / 8);
    MoeCombineKernel<8, true>
        <<<GridFor(n, C / 8, threads), threads, 0, stream>>>(out, ye, slot_of, w, n, kk, C);
  } else {
    const int threads = ThreadsFor(C);
    MoeCombineKernel<1, true>
        <<<GridFor(n, C, threads), threads, 0, stream>>>(out, ye, slot_of, w, n, kk, C);
  }
  MT_CUDA_LAUNCH_CHECK();
}

void MoeCombineBackward(bf16* dye, float* dw, const bf16* dout, const bf16* ye,
                        const int32_t* slot_of, const float* w, int64_t n, int64_t k, int64_t C,
                        cudaStream_t stream) {
  if (n <= 0) return;
  MT_CHECK_MSG(k >= 1 && k <= kMaxTopK && n * k < (int64_t{1} << 31) && C >= 1,
               "MoeCombineBackward: top-%lld of %lld tokens, C = %lld; the CUDA kernel takes "
               "k <= %d",
               static_cast<long long>(k), static_cast<long long>(n), static_cast<long long>(C),
               kMaxTopK);
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(n, int64_t{1} << 20));
  const int kk = static_cast<int>(k);
  if (C % 8 == 0 && AllAligned16({dye, dout, ye})) {
    MoeCombineBackwardKernel<8>
        <<<blocks, ThreadsFor(C / 8), 0, stream>>>(dye, dw, dout, ye, slot_of, w, n, kk, C);
  } else {
    MoeCombineBackwardKernel<1>
        <<<blocks, ThreadsFor(C), 0, stream>>>(dye, dw, dout, ye, slot_of, w, n, kk, C);
  }
  MT_CUDA_LAUNCH_CHECK();
}

}  // namespace megatrain::cuda
