// Fused softmax cross-entropy: per row, loss = logsumexp(x) - x[target] and
// dlogits = scale * (softmax(x) - onehot(target)), written over the logits when they alias;
// each row's times row_scale[row] when given.
//
// One block per row (V up to 256K). The first pass keeps an online (max, sum of exp) per
// thread, so the row is read twice in all (statistics, then gradient) rather than three
// times; both reads of an element, and the target logit, happen before the block barrier
// that precedes any write, which is what makes aliasing safe. Targets equal to -100 give
// loss 0 and a zero gradient row (the reference's ignore index). A target outside [0, V)
// is a bug the reference aborts on; here it gives loss NaN (visible in the step's loss)
// and a zero gradient row, never an out-of-bounds read.
//
// Shapes: logits, dlogits (N, V) bf16 (dlogits may be null: loss only); targets (N) int32;
// loss (N) f32.
#include <algorithm>
#include <cstdint>

#include "engine/kernels/cuda/common.cuh"
#include "engine/kernels/cuda/ops.h"

namespace megatrain::cuda {
namespace {

constexpr int32_t kIgnoreIndex = -100;
constexpr int kMaxThreads = 1024;
constexpr float kLog2e = 1.4426950408889634f;

// Running softmax statistics: max m and sum of exp(x - m).
struct MaxSum {
  float m;
  float s;
};

__device__ __forceinline__ MaxSum Merge(MaxSum a, MaxSum b) {
  const float m = fmaxf(a.m, b.m);
  if (m == -INFINITY) return {m, 0.0f};  // both empty: avoid (-inf) - (-inf)
  return {m, a.s * exp2f((a.m - m) * kLog2e) + b.s * exp2f((b.m - m) * kLog2e)};
}

// Block-wide merge; every thread gets the result. REQUIRES: blockDim.x % 32 == 0.
__device__ __forceinline__ MaxSum BlockMerge(MaxSum v, MaxSum* scratch) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    v = Merge(v, {__shfl_xor_sync(0xffffffffu, v.m, o), __shfl_xor_sync(0xffffffffu, v.s, o)});
  }
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < static_cast<int>(blockDim.x / 32) ? scratch[lane] : MaxSum{-INFINITY, 0.0f};
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    v = Merge(v, {__shfl_xor_sync(0xffffffffu, v.m, o), __shfl_xor_sync(0xffffffffu, v.s, o)});
  }
  return v;
}

template <int kWidth>
__global__ void __launch_bounds__(kMaxThreads)
    CrossEntropyKernel(bf16* dlogits, float* loss, const bf16* logits, const int32_t* targets,
                       int64_t N, int64_t V, float scale, const float* row_scale) {
  __shared__ MaxSum scratch[32];
  const int64_t vecs = V / kWidth;
  for (int64_t row = blockIdx.x; row < N; row += gridDim.x) {
    const bf16* x = logits + row * V;
    bf16* dx = dlogits != nullptr ? dlogits + row * V : nullptr;
    const int32_t t = targets[row];
    if (t == kIgnoreIndex || t < 0 || t >= V) {
      if (threadIdx.x == 0) loss[row] = t == kIgnoreIndex ? 0.0f : nanf("");
      if (dx != nullptr) {
        const float zero[kWidth] = {};
        for (int64_t v = threadIdx.x; v < vecs; v += blockDim.x) {
          Store<kWidth>(dx + v * kWidth, zero);
        }
      }
      continue;
    }
    const float x_target = ToF(x[t]);  // read before the barrier in BlockMerge
    MaxSum acc{-INFINITY, 0.0f};
#pragma unroll 4
    for (int64_t v = threadIdx.x; v < vecs; v += blockDim.x) {
      float xv[kWidth];
      Load<kWidth>(x + v * kWidth, xv);
      float m = acc.m;
#pragma unroll
      for (int i = 0; i < kWidth; ++i) m = fmaxf(m, xv[i]);
      if (m == -INFINITY) continue;
      float s = acc.s * exp2f((acc.m - m) * kLog2e);
#pragma unroll
      for (int i = 0; i < kWidth; ++i) s += exp2f((xv[i] - m) * kLog2e);
      acc = {m, s};
    }
    acc = BlockMerge(acc, scratch);
    const float lse = acc.m + logf(acc.s);
    if (threadIdx.x == 0) loss[row] = lse - x_target;
    if (dx == nullptr) continue;
    const float coef = row_scale != nullptr ? scale * row_scale[row] : scale;
    for (int64_t v = threadIdx.x; v < vecs; v += blockDim.x) {
      float xv[kWidth];
      Load<kWidth>(x + v * kWidth, xv);  // same thread, same elements: read before written
#pragma unroll
      for (int i = 0; i < kWidth; ++i) {
        const float p = exp2f((xv[i] - lse) * kLog2e);
        xv[i] = coef * (v * kWidth + i == t ? p - 1.0f : p);
      }
      Store<kWidth>(dx + v * kWidth, xv);
    }
  }
}

}  // namespace

void CrossEntropy(bf16* dlogits, float* loss, const bf16* logits, const int32_t* targets, int64_t N,
                  int64_t V, float scale, const float* row_scale, cudaStream_t stream) {
  if (N <= 0 || V <= 0) return;
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(N, 1 << 30));
  const bool vec = V % 8 == 0 && Aligned16(logits) && (dlogits == nullptr || Aligned16(dlogits));
  const int64_t vecs = vec ? V / 8 : V;
  // About 8 vectors per thread: enough loads in flight per thread, a whole number of warps.
  const int threads = static_cast<int>(
      std::min<int64_t>(kMaxThreads, std::max<int64_t>(32, (vecs / 8 + 31) / 32 * 32)));
  if (vec) {
    CrossEntropyKernel<8>
        <<<blocks, threads, 0, stream>>>(dlogits, loss, logits, targets, N, V, scale,
                                                  row_scale);
  } else {
    CrossEntropyKernel<1>
        <<<blocks, threads, 0, stream>>>(dlogits, loss, logits, targets, N, V, scale,
                                                  row_scale);
  }
  MT_CUDA_LAUNCH_CHECK();
}

}  // namespace megatrain::cuda
