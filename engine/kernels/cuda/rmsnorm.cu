// RMSNorm forward and backward: out = x * rstd * w, rstd = rsqrt(mean(x^2) + eps) per row.
//
// The backward's weight gradient is a column sum over rows. Each block walks a contiguous
// chunk of rows and keeps its partial dw in shared memory, one slot per column, owned by
// the thread that handles that column (so no shared atomics), and writes it to its row of
// the caller's partials; AddColumnSums then adds the rows to dw in block order. No atomics:
// the gradient is the same bits on every run.
// With C = 16384 that slab is 64 KiB, above the default 48 KiB, so the launcher raises the
// kernel's dynamic shared memory limit when needed.
//
// Shapes: in, out, dout, din (rows, C) bf16; w (C) bf16; rstd (rows) f32; dw (C) f32.
// Vector path (8 bf16 = 16 bytes per access) when C % 8 == 0 and pointers are aligned.
#include <algorithm>
#include <cstdint>

#include "engine/common/check.h"
#include "engine/kernels/cuda/common.cuh"
#include "engine/kernels/cuda/ops.h"

namespace megatrain::cuda {
namespace {

void CheckCuda(cudaError_t err, const char* what) {
  MT_CHECK_MSG(err == cudaSuccess, "%s: %s", what, cudaGetErrorString(err));
}

// One block per row (grid-strided): sum of squares, then a second pass (L1/L2-resident).
template <int kWidth>
__global__ void RmsNormKernel(bf16* out, float* rstd, const bf16* in, const bf16* w, int64_t rows,
                              int64_t C, float eps) {
  __shared__ float scratch[32];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const bf16* x = in + r * C;
    bf16* y = out + r * C;
    float sum_sq = 0.0f;
    for (int64_t c = threadIdx.x * kWidth; c < C; c += blockDim.x * kWidth) {
      float xv[kWidth];
      Load<kWidth>(x + c, xv);
#pragma unroll
      for (int i = 0; i < kWidth; ++i) sum_sq += xv[i] * xv[i];
    }
    sum_sq = BlockSum(sum_sq, scratch);
    const float s = rsqrtf(sum_sq / static_cast<float>(C) + eps);
    if (threadIdx.x == 0) rstd[r] = s;
    for (int64_t c = threadIdx.x * kWidth; c < C; c += blockDim.x * kWidth) {
      float xv[kWidth], wv[kWidth];
      Load<kWidth>(x + c, xv);
      Load<kWidth>(w + c, wv);
#pragma unroll
      for (int i = 0; i < kWidth; ++i) xv[i] = xv[i] * s * wv[i];
      Store<kWidth>(y + c, xv);
    }
  }
}

// Block b owns rows [b * rows_per_block, ...). Per row: dot = sum_k dy w x (block sum), then
//   din += s * (dy w - x s^2 dot / C),  dw_partial += dy x s.
// dw_partial (C floats, dynamic shared memory) stores element i of column vector v at
// i * (C / kWidth) + v, so a warp's accesses hit consecutive words: no bank conflicts.
template <int kWidth>
__global__ void RmsNormBackwardKernel(bf16* din, float* dw, const bf16* dout, const bf16* in,
                                      const bf16* w, const float* rstd, int64_t rows, int64_t C,
                                      int64_t rows_per_block, float* partials) {
  extern __shared__ float dw_partial[];  // (kWidth, C / kWidth)
  __shared__ float scratch[32];
  const int64_t vecs = C / kWidth;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) dw_partial[c] = 0.0f;
  __syncthreads();
  const int64_t r0 = blockIdx.x * rows_per_block;
  const int64_t r1 = r0 + rows_per_block < rows ? r0 + rows_per_block : rows;
  const float inv_c = 1.0f / static_cast<float>(C);
  for (int64_t r = r0; r < r1; ++r) {
    const bf16* x = in + r * C;
    const bf16* g = dout + r * C;
    bf16* dx = din + r * C;
    const float s = rstd[r];
    float dot = 0.0f;
    for (int64_t v = threadIdx.x; v < vecs; v += blockDim.x) {
      float xv[kWidth], gv[kWidth], wv[kWidth];
      Load<kWidth>(x + v * kWidth, xv);
      Load<kWidth>(g + v * kWidth, gv);
      Load<kWidth>(w + v * kWidth, wv);
#pragma unroll
      for (int i = 0; i < kWidth; ++i) {
        dot += gv[i] * wv[i] * xv[i];
        dw_partial[i * vecs + v] += gv[i] * xv[i] * s;
      }
    }
    dot = BlockSum(dot, scratch);
    const float coef = s * s * dot * inv_c;
    for (int64_t v = threadIdx.x; v < vecs; v += blockDim.x) {
      float xv[kWidth], gv[kWidth], wv[kWidth], dv[kWidth];
      Load<kWidth>(x + v * kWidth, xv);
      Load<kWidth>(g + v * kWidth, gv);
      Load<kWidth>(w + v * kWidth, wv);
      Load<kWidth>(dx + v * kWidth, dv);
#pragma unroll
      for (int i = 0; i < kWidth; ++i) dv[i] += s * (gv[i] * wv[i] - xv[i] * coef);
      Store<kWidth>(dx + v * kWidth, dv);
    }
  }
  __syncthreads();
  // Coalesced writes of the block's row; the strided shared reads happen once per block.
  float* row = partials + blockIdx.x * C;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    row[c] = dw_partial[(c % kWidth) * vecs + c / kWidth];
  }
}

// A whole number of warps, about one vector per thread, at most max_threads.
int ThreadsFor(int64_t vecs, int max_threads) {
  return static_cast<int>(
      std::min<int64_t>(max_threads, std::max<int64_t>(32, (vecs + 31) / 32 * 32)));
}

template <int kWidth>
void LaunchBackward(bf16* din, float* dw, const bf16* dout, const bf16* in, const bf16* w,
                    const float* rstd, int64_t rows, int64_t C, float* partials,
                    int64_t partial_floats, cudaStream_t stream) {
  const int threads = ThreadsFor(C / kWidth, 512);
  const size_t smem_bytes = static_cast<size_t>(C) * sizeof(float);
  auto* kernel = RmsNormBackwardKernel<kWidth>;
  if (smem_bytes > 48 * 1024) {
    CheckCuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   static_cast<int>(smem_bytes)),
              "raising RmsNormBackward's shared memory limit");
  }
  int device = 0, sms = 0, blocks_per_sm = 0;
  CheckCuda(cudaGetDevice(&device), "cudaGetDevice");
  CheckCuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device),
            "reading the SM count");
  CheckCuda(
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks_per_sm, kernel, threads, smem_bytes),
      "RmsNormBackward occupancy");
  // One full wave: enough blocks to fill the GPU, as few as possible to bound the partials,
  // and no more than the scratch holds.
  const int64_t blocks = std::min<int64_t>(
      {rows, static_cast<int64_t>(sms) * std::max(1, blocks_per_sm), partial_floats / C});
  const int64_t rows_per_block = (rows + blocks - 1) / blocks;
  const int64_t used_blocks = (rows + rows_per_block - 1) / rows_per_block;
  kernel<<<static_cast<unsigned>(used_blocks), threads, smem_bytes, stream>>>(
      din, dw, dout, in, w, rstd, rows, C, rows_per_block, partials);
  MT_CUDA_LAUNCH_CHECK();
  AddColumnSums(dw, partials, used_blocks, C, C, stream);
}

}  // namespace

void RmsNorm(bf16* out, float* rstd, const bf16* in, const bf16* w, int64_t rows, int64_t C,
             float eps, cudaStream_t stream) {
  if (rows <= 0 || C <= 0) return;
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(rows, 1 << 30));
  if (C % 8 == 0 && Aligned16(out) && Aligned16(in) && Aligned16(w)) {
    const int threads = ThreadsFor(C / 8, 512);
    RmsNormKernel<8><<<blocks, threads, 0, stream>>>(out, rstd, in, w, rows, C, eps);
  } else {
    const int threads = ThreadsFor(C, 512);
    RmsNormKernel<1><<<blocks, threads, 0, stream>>>(out, rstd, in, w, rows, C, eps);
  }
  MT_CUDA_LAUNCH_CHECK();
}

void RmsNormBackward(bf16* din, float* dw, const bf16* dout, const bf16* in, const bf16* w,
                     const float* rstd, int64_t rows, int64_t C, float* partials,
                     int64_t partial_floats, cudaStream_t stream) {
  if (rows <= 0 || C <= 0) return;
  MT_CHECK_MSG(partials != nullptr && partial_floats >= C,
               "RmsNormBackward: a scratch of %lld floats cannot hold a row of %lld",
               static_cast<long long>(partial_floats), static_cast<long long>(C));
  if (C % 8 == 0 && Aligned16(din) && Aligned16(dout) && Aligned16(in) && Aligned16(w)) {
    LaunchBackward<8>(din, dw, dout, in, w, rstd, rows, C, partials, partial_floats, stream);
  } else {
    LaunchBackward<1>(din, dw, dout, in, w, rstd, rows, C, partials, partial_floats, stream);
  }
}

}  // namespace megatrain::cuda
