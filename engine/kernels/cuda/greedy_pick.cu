// Greedy decoding's pick on the device: per row of the (B, V) bf16 logits, the lowest index
// of the maximum and its log-probability, -log(sum exp(x - max)), in one read of the row.
//
// A row is read by a cluster of up to 8 blocks (Hopper's thread block clusters), each a
// contiguous part of it. One block per row was 13 us on an H200 at B = 1 and at B = 64 alike:
// a 152K-entry row is 152K exponentials and as many dependent adds for one SM. Split, B = 64,
// V = 152064 takes 10 us, B = 1 5 us (kernel time, graph-launched; the read alone is 3.4 us).
//
// Each thread keeps an online (max, its lowest index, sum of exp(x - max)) over a fixed strided
// subset of its block's part: 16-byte vectors of 8 logits in the aligned middle, the next
// kBatch vectors loading while the current ones are used, and the unaligned head and tail
// (under 8 logits each, any V) one logit per thread. A warp combines its lanes in a fixed
// butterfly (the max, then each sum rescaled to it once and added), the block its warps, and
// block 0 of the cluster the blocks, read from their shared memory in rank order: the bits
// depend on the row, V and the device alone, never on timing. No scratch, any stream. Equal
// maxima resolve to the lower index at every step, which with each thread visiting its indices
// in increasing order gives the lowest.
//
// A NaN is not compared (fmaxf drops it) but poisons the sum; +inf becomes the max; a row of
// -inf keeps max -inf: the three broken cases show in the final (max, sum).
//
// Shapes: logits (B, V) bf16; ids (B) int32; logprobs (B) f32.
#include <cooperative_groups.h>

#include <algorithm>
#include <cstdint>

#include "engine/common/check.h"
#include "engine/kernels/cuda/common.cuh"
#include "engine/kernels/cuda/ops.h"

namespace megatrain::cuda {
namespace {

constexpr int kMaxThreads = 1024;
constexpr int kClusterThreads = 256;  // per block when a row is split: 4+ blocks per SM
constexpr int kMaxSplits = 8;         // the portable cluster size
constexpr int kBatch = 2;             // 16-byte vectors in flight per thread while others are used
constexpr int kMinVecsPerThread = 4;  // a row is split only while each thread keeps this many
constexpr float kLog2e = 1.4426950408889634f;
constexpr int32_t kNoIndex = INT32_MAX;  // a state that has seen only -inf or NaN

// A thread's (or a merged group's) view of part of a row.
struct Pick {
  float m;      // the largest logit seen (never NaN; -inf when none is larger)
  float s;      // sum of exp(x - m) over the logits seen; NaN once a NaN was seen
  int32_t idx;  // the lowest index holding m, kNoIndex while m is -inf
};

__device__ __forceinline__ Pick Empty() { return {-INFINITY, 0.0f, kNoIndex}; }

// The lanes' states combined; every lane gets the result. The max first, then each lane's sum
// rescaled to it once and the sums added, the lowest index among the lanes holding the max:
// a fixed butterfly, so the bits do not depend on timing (and are the same in every lane).
__device__ __forceinline__ Pick WarpCombine(Pick p) {
  float m = p.m;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  // All -inf: the sums are 0 or NaN and need no rescaling (nor (-inf) - (-inf)).
  float s = m == -INFINITY ? p.s : p.s * exp2f((p.m - m) * kLog2e);
  int32_t idx = p.m == m ? p.idx : kNoIndex;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    s += __shfl_xor_sync(0xffffffffu, s, o);
    idx = min(idx, __shfl_xor_sync(0xffffffffu, idx, o));
  }
  return {m, s, idx};
}

// v[0] = v[0] + ... + v[kWidth-1] (or max) in a fixed tree: 3 dependent steps for 8, not 7.
// REQUIRES: kWidth a power of 2.
template <int kWidth, typename Op>
__device__ __forceinline__ float Tree(float (&v)[kWidth], Op op) {
#pragma unroll
  for (int w = kWidth / 2; w >= 1; w /= 2) {
#pragma unroll
    for (int i = 0; i < w; ++i) v[i] = op(v[i], v[i + w]);
  }
  return v[0];
}

// Logits x[0 .. kWidth) at indices i0 .. i0+kWidth-1, all above the state's indices.
template <int kWidth>
__device__ __forceinline__ void Take(Pick& p, const float (&x)[kWidth], int32_t i0) {
  float t[kWidth];
#pragma unroll
  for (int i = 0; i < kWidth; ++i) t[i] = x[i];
  const float block_max = Tree(t, [](float a, float b) { return fmaxf(a, b); });
  if (block_max > p.m) {  // rare after the first vectors; strict: on a tie the state's stays
    int first = kWidth - 1;
#pragma unroll
    for (int i = kWidth - 2; i >= 0; --i) first = x[i] == block_max ? i : first;
    p.s *= exp2f((p.m - block_max) * kLog2e);
    p.m = block_max;
    p.idx = i0 + first;
  }
  // While m is -inf every logit seen is -inf or NaN: a reference of 0 adds 0 or NaN.
  const float m_ref = p.m == -INFINITY ? 0.0f : p.m;
#pragma unroll
  for (int i = 0; i < kWidth; ++i) t[i] = exp2f((x[i] - m_ref) * kLog2e);
  p.s += Tree(t, [](float a, float b) { return a + b; });
}

// The 8 bf16 logits of a 16-byte vector, widened.
__device__ __forceinline__ void Unpack(const uint4& raw, float (&v)[8]) {
  const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    v[2 * i] = __uint_as_float(words[i] << 16);  // bf16 is the high half of an f32
    v[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
  }
}

__device__ __forceinline__ void Take1(Pick& p, const bf16* x, int32_t i) {
  const float v[1] = {ToF(x[i])};
  Take<1>(p, v, i);
}

__device__ __forceinline__ void Finish(int32_t* ids, float* logprobs, int64_t row, Pick p) {
  const bool nan_seen = (__float_as_uint(p.s) & 0x7fffffffu) > 0x7f800000u;
  const bool broken = nan_seen || !(p.m > -INFINITY && p.m < INFINITY);
  ids[row] = broken ? -1 : p.idx;
  logprobs[row] = broken ? nanf("") : -logf(p.s);  // x[id] - lse = m - (m + log s)
}

// Grid: B * splits blocks; with splits > 1, clusters of `splits` blocks, one per row.
__global__ void __launch_bounds__(kMaxThreads)
    GreedyPickKernel(int32_t* ids, float* logprobs, const bf16* logits, int64_t V, int splits) {
  __shared__ Pick warp_picks[32];
  const int64_t row = blockIdx.x / splits;
  const int rank = static_cast<int>(blockIdx.x % splits);  // the block's rank in its cluster
  const bf16* x = logits + row * V;
  const int tid = threadIdx.x, threads = blockDim.x;
  // Logits before the first 16-byte boundary (rows start unaligned when V % 8 != 0).
  const int misaligned_bytes = static_cast<int>(reinterpret_cast<uintptr_t>(x) % 16);
  const int head_to_boundary = misaligned_bytes == 0 ? 0 : (16 - misaligned_bytes) / 2;
  const int head = V < head_to_boundary ? static_cast<int>(V) : head_to_boundary;
  const int32_t vecs = static_cast<int32_t>((V - head) / 8);
  const int32_t tail_start = head + 8 * vecs;
  const uint4* body = reinterpret_cast<const uint4*>(x + head);
  const int32_t chunk = (vecs + splits - 1) / splits;
  const int32_t v_end = min(vecs, (rank + 1) * chunk);

  Pick p = Empty();
  if (rank == 0 && tid < head) Take1(p, x, tid);
  // Software-pipelined: batch v1's loads are issued before batch v0 is used.
  int32_t v0 = rank * chunk + tid;
  uint4 next[kBatch];
#pragma unroll
  for (int j = 0; j < kBatch; ++j) {
    if (v0 + j * threads < v_end) next[j] = __ldcs(body + v0 + j * threads);
  }
  while (v0 < v_end) {
    uint4 raw[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) raw[j] = next[j];
    const int32_t v1 = v0 + kBatch * threads;
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      if (v1 + j * threads < v_end) next[j] = __ldcs(body + v1 + j * threads);
    }
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int32_t v = v0 + j * threads;
      if (v >= v_end) break;
      float xv[8];
      Unpack(raw[j], xv);
      Take<8>(p, xv, head + 8 * v);
    }
    v0 = v1;
  }
  if (rank == splits - 1 && tail_start + tid < V) Take1(p, x, tail_start + tid);

  const int lane = tid % 32, warp = tid / 32;
  p = WarpCombine(p);
  if (lane == 0) warp_picks[warp] = p;
  __syncthreads();
  if (warp == 0) p = WarpCombine(lane < threads / 32 ? warp_picks[lane] : Empty());
  if (splits == 1) {
    if (tid == 0) Finish(ids, logprobs, row, p);
    return;
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  __shared__ Pick block_pick;
  if (tid == 0) block_pick = p;
  cluster.sync();  // every block's block_pick written
  if (rank == 0 && warp == 0) {
    p = WarpCombine(lane < splits ? *cluster.map_shared_rank(&block_pick, lane) : Empty());
    if (lane == 0) Finish(ids, logprobs, row, p);
  }
  cluster.sync();  // the blocks' shared memory stays until block 0 has read it
#else
  __trap();  // a split launch of code built without clusters: Splits() must not allow it
#endif
}

// Blocks per row: as many as keep kMinVecsPerThread vectors per thread, at most kMaxSplits;
// one where the kernel this device runs was built without clusters (below sm_90, or a newer
// device running the sm_80 PTX).
int Splits(int64_t V) {
  cudaFuncAttributes attributes;
  MT_CUDA_CHECK(cudaFuncGetAttributes(&attributes, GreedyPickKernel));
  if (attributes.ptxVersion < 90) return 1;
  return static_cast<int>(
      std::clamp<int64_t>(V / 8 / (kClusterThreads * kMinVecsPerThread), 1, kMaxSplits));
}

}  // namespace

void GreedyPick(int32_t* ids, float* logprobs, const bf16* logits, int64_t B, int64_t V,
                cudaStream_t stream) {
  if (B <= 0) return;
  MT_CHECK_MSG(V >= 1 && V <= INT32_MAX - 8 && B <= INT32_MAX / kMaxSplits,
               "GreedyPick: B = %lld, V = %lld; needs V in [1, 2^31 - 9], B < 2^28",
               static_cast<long long>(B), static_cast<long long>(V));
  const int splits = Splits(V);
  if (splits == 1) {
    // About 8 vectors per thread; a whole number of warps, at least 8 threads for the head
    // and tail logits.
    const int threads =
        static_cast<int>(std::clamp<int64_t>((V / 8 / 8 + 31) / 32 * 32, 32, kMaxThreads));
    GreedyPickKernel<<<static_cast<unsigned>(B), threads, 0, stream>>>(ids, logprobs, logits, V, 1);
    MT_CUDA_LAUNCH_CHECK();
    return;
  }
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(B * splits));
  config.blockDim = dim3(kClusterThreads);
  config.stream = stream;
  cudaLaunchAttribute cluster;
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = static_cast<unsigned>(splits);
  cluster.val.clusterDim.y = 1;
  cluster.val.clusterDim.z = 1;
  config.attrs = &cluster;
  config.numAttrs = 1;
  MT_CUDA_CHECK(cudaLaunchKernelEx(&config, GreedyPickKernel, ids, logprobs, logits, V, splits));
}

}  // namespace megatrain::cuda
