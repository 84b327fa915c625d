// AdamW on the device (common/adamw_math.h): one thread an element, every operation an
// IEEE-rounded intrinsic (__fmul_rn, __fadd_rn, __fdiv_rn, __fsqrt_rn: no fused
// multiply-add, no flush of subnormals; the file is built without fast math), so the
// master, moments and bf16 weights are the host optimizer's bits.
#include <algorithm>
#include <cstdint>

#include "engine/common/adamw_math.h"
#include "engine/kernels/cuda/common.cuh"
#include "engine/kernels/cuda/ops.h"

namespace megatrain::cuda {
namespace {

constexpr int kThreads = 256;

template <bool kLerpSmall>
__global__ void __launch_bounds__(kThreads)
    AdamWKernel(float* master, float* m, float* v, uint16_t* bf16_out, const float* grad,
                int64_t n, AdamWScalars scalars, float grad_scale) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    float p = master[i], mi = m[i], vi = v[i];
    AdamWElement<kLerpSmall>(scalars, grad[i], grad_scale, &p, &mi, &vi);
    master[i] = p;
    m[i] = mi;
    v[i] = vi;
    if (bf16_out != nullptr) bf16_out[i] = AdamWRoundToBf16(p);
  }
}

}  // namespace

void AdamW(float* master, float* m, float* v, uint16_t* bf16_out, const float* grad, int64_t n,
           const AdamWScalars& scalars, float grad_scale, cudaStream_t stream) {
  if (n <= 0) return;
  const int64_t blocks = std::min<int64_t>((n + kThreads - 1) / kThreads, 65536);
  if (scalars.lerp_small) {
    AdamWKernel<true><<<static_cast<int>(blocks), kThreads, 0, stream>>>(
        master, m, v, bf16_out, grad, n, scalars, grad_scale);
  } else {
    AdamWKernel<false><<<static_cast<int>(blocks), kThreads, 0, stream>>>(
        master, m, v, bf16_out, grad, n, scalars, grad_scale);
  }
  MT_CUDA_LAUNCH_CHECK();
}

}  // namespace megatrain::cuda
