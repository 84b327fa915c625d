// Ordered column sums of per-block partials: the last step of the deterministic weight
// gradients (RMSNorm, QK-norm). A kernel's blocks write one row of partials each instead
// of adding to the gradient with atomics; this adds the rows in block order, so the sum is
// the same bits on every run.
//
// Shapes: partials (blocks, stride) f32, columns [0, count) used; dst (count) f32.
#include <cstdint>

#include "engine/kernels/cuda/common.cuh"
#include "engine/kernels/cuda/ops.h"

namespace megatrain::cuda {
namespace {

constexpr int kThreads = 256;

// Thread c sums column c over the rows in order; a warp reads 32 adjacent words of a row.
__global__ void __launch_bounds__(kThreads)
    AddColumnSumsKernel(float* dst, const float* partials, int64_t blocks, int64_t count,
                        int64_t stride) {
  const int64_t c = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x;
  if (c >= count) return;
  float sum = 0.0f;
  for (int64_t b = 0; b < blocks; ++b) sum += partials[b * stride + c];
  dst[c] += sum;
}

}  // namespace

void AddColumnSums(float* dst, const float* partials, int64_t blocks, int64_t count,
                   int64_t stride, cudaStream_t stream) {
  if (blocks <= 0 || count <= 0) return;
  const int64_t grid = (count + kThreads - 1) / kThreads;
  AddColumnSumsKernel<<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(dst, partials, blocks,
                                                                          count, stride);
  MT_CUDA_LAUNCH_CHECK();
}

}  // namespace megatrain::cuda
