// Ordered column sums of per-block partials: the last step of the deterministic weight
// gradients (RMSNorm, QK-norm). A kernel's blocks write one row of partials each instead
// of adding to the gradient with atomics; this adds the rows in block order, so the sum is
// the same bits on every run.
//
// Shapes: partials (blocks, stride) f32, columns [0, count) used; dst (count) f32.
// Also RoundToBf16: fp32 master weights, uploaded as they are, rounded on the device.
#include <cstdint>

#include "engine/common/check.h"
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

// out[i] = in[i] rounded to bf16, nearest even (__float2bfloat16_rn: FloatToBf16's bits).
// Eight elements a thread: two 16-byte loads, one 16-byte store.
__global__ void __launch_bounds__(kThreads)
    RoundToBf16Kernel(bf16* __restrict__ out, const float* __restrict__ in, int64_t n) {
  const int64_t i = (blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x) * 8;
  if (i + 8 <= n) {
    const float4 a = *reinterpret_cast<const float4*>(in + i);
    const float4 b = *reinterpret_cast<const float4*>(in + i + 4);
    const float v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
    Store<8>(out + i, v);
  } else {
    for (int64_t j = i; j < n; ++j) out[j] = __float2bfloat16_rn(in[j]);
  }
}

}  // namespace

void RoundToBf16(bf16* out, const float* in, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  MT_CHECK_MSG(Aligned16(out) && Aligned16(in), "RoundToBf16: buffers must be 16-byte aligned");
  const int64_t grid = (n + 8 * kThreads - 1) / (8 * kThreads);
  RoundToBf16Kernel<<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(out, in, n);
  MT_CUDA_LAUNCH_CHECK();
}

void AddColumnSums(float* dst, const float* partials, int64_t blocks, int64_t count,
                   int64_t stride, cudaStream_t stream) {
  if (blocks <= 0 || count <= 0) return;
  const int64_t grid = (count + kThreads - 1) / kThreads;
  AddColumnSumsKernel<<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(dst, partials, blocks,
                                                                          count, stride);
  MT_CUDA_LAUNCH_CHECK();
}

}  // namespace megatrain::cuda
