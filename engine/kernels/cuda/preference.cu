// DPO's per-token coefficients (kernels/reference/preference.h) in one block: each warp
// sums its sequences' -log p values (lanes stride the tokens, a fixed shuffle tree adds
// the lanes: the same bits run to run) into shared memory, then every thread writes its
// tokens' row_scale from its pair's two sums. Each warp reads the token indices once per
// sequence of its (S / 32 of them): a few reads a thread for a 4K-token pair a row, about
// 130K for kMaxPreferenceSequences short sequences in a 32K-token micro-batch (a fraction
// of a millisecond), small either way beside the head's GEMMs over the same tokens.
#include <cstdint>

#include "engine/common/preference_math.h"
#include "engine/kernels/cuda/common.cuh"
#include "engine/kernels/cuda/ops.h"

namespace megatrain::cuda {
namespace {

constexpr int kThreads = 1024;

__global__ void __launch_bounds__(kThreads)
    PreferenceRowScaleKernel(float* row_scale, const float* values, const int32_t* sequence,
                             const double* info, int64_t N, int64_t S, PreferenceLoss kind,
                             double beta, double label_smoothing) {
  __shared__ double logp[kMaxPreferenceSequences];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  for (int64_t s = warp; s < S; s += warps) {
    double sum = 0;
    for (int64_t i = lane; i < N; i += 32) {
      if (sequence[i] == s) sum -= static_cast<double>(values[i]);
    }
    for (int offset = 16; offset > 0; offset /= 2) {
      sum += __shfl_down_sync(0xffffffffu, sum, offset);
    }
    if (lane == 0) logp[s] = sum;
  }
  __syncthreads();
  for (int64_t i = threadIdx.x; i < N; i += blockDim.x) {
    const int32_t s = sequence[i];
    if (s < 0 || s >= S) {
      row_scale[i] = 0.0f;
      continue;
    }
    const int64_t k = s / 2;
    const double* c = info + 2 * k * kPrefFields;
    const double* r = c + kPrefFields;
    const PairLossTerms t = PreferencePairTerms(
        kind, beta, label_smoothing, logp[2 * k] - c[kPrefRefLogp],
        logp[2 * k + 1] - r[kPrefRefLogp], c[kPrefTokens], r[kPrefTokens]);
    const double* mine = info + s * kPrefFields;
    const double d = s % 2 == 0 ? t.d_chosen : t.d_rejected;
    row_scale[i] = static_cast<float>(mine[kPrefNllWeight] - mine[kPrefPairWeight] * d);
  }
}

}  // namespace

void PreferenceRowScale(float* row_scale, const float* values, const int32_t* sequence,
                        const double* info, int64_t N, int64_t S, PreferenceLoss kind,
                        double beta, double label_smoothing, cudaStream_t stream) {
  if (N <= 0) return;
  PreferenceRowScaleKernel<<<1, kThreads, 0, stream>>>(row_scale, values, sequence, info, N,
                                                       S, kind, beta, label_smoothing);
  MT_CUDA_LAUNCH_CHECK();
}

}  // namespace megatrain::cuda
