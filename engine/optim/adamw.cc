// AdamW element loop. Scalars are hoisted and rounded to float exactly where PyTorch
// rounds them (a Python float passed to an fp32 tensor op becomes a float), so the loop
// body is plain fp32 math the compiler can vectorise.
#include "engine/optim/adamw.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "engine/common/check.h"

namespace megatrain {
namespace {

// Elements per OpenMP work item: large enough to amortise scheduling, small enough to
// balance across cores on a layer of a few million parameters.
constexpr int64_t kChunk = 1 << 14;

// FloatToBf16 without a branch, so the loop below stays vectorised; same bits.
inline uint16_t RoundToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (bits >> 16) | 0x40u;
  return static_cast<uint16_t>((bits & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

// The loop over [begin, end). kLerpSmall selects torch.lerp's branch for weight < 0.5.
// Compiled for AVX-512, AVX2 and the x86-64 baseline, picked at load time: the ops are
// IEEE adds, multiplies, divides and square roots (no contraction: -ffp-contract=off),
// so every width gives the same bits, and the wide ones run at memory bandwidth.
template <bool kLerpSmall>
// (Not under ThreadSanitizer: the load-time resolver would run before TSan is set up.)
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__SANITIZE_THREAD__)
__attribute__((target_clones("avx512f", "avx2", "default")))
#endif
void AdamWChunk(float* __restrict master, float* __restrict m, float* __restrict v,
                uint16_t* __restrict bf16_out, const float* __restrict grad, int64_t begin,
                int64_t end, float grad_scale, float decay, float lerp_weight,
                float one_minus_lerp_weight, float beta2, float one_minus_beta2,
                float bias_correction2_sqrt, float eps, float neg_step_size) {
#pragma omp simd
  for (int64_t i = begin; i < end; ++i) {
    const float g = grad[i] * grad_scale;
    float p = master[i] * decay;
    const float mi = m[i];
    const float m_new =
        kLerpSmall ? mi + lerp_weight * (g - mi) : g - (g - mi) * one_minus_lerp_weight;
    const float v_new = v[i] * beta2 + one_minus_beta2 * g * g;
    const float denom = std::sqrt(v_new) / bias_correction2_sqrt + eps;
    p = p + neg_step_size * m_new / denom;
    m[i] = m_new;
    v[i] = v_new;
    master[i] = p;
  }
  if (bf16_out != nullptr) {
#pragma omp simd
    for (int64_t i = begin; i < end; ++i) bf16_out[i] = RoundToBf16(master[i]);
  }
}

// Sum of squares of [begin, end) in double, lanes in a fixed order (the build's vector
// width: the same bits wherever this binary runs, unlike the dispatched update above).
double ChunkSumOfSquares(const float* __restrict g, int64_t begin, int64_t end) {
  double sum = 0.0;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = begin; i < end; ++i) sum += static_cast<double>(g[i]) * g[i];
  return sum;
}

}  // namespace

void AdamWUpdate(float* master, float* m, float* v, uint16_t* bf16_out, const float* grad,
                 int64_t n, int64_t step, double lr, double weight_decay, float grad_scale,
                 const AdamWHyper& hyper, double* grad_sum_squares) {
  MT_CHECK(n >= 0);
  MT_CHECK(step >= 1);
  if (n == 0) return;
  MT_CHECK(master != nullptr && m != nullptr && v != nullptr && grad != nullptr);

  // Python-side scalars, in double as torch/optim/adam.py computes them.
  const double bias_correction1 = 1.0 - std::pow(hyper.beta1, static_cast<double>(step));
  const double bias_correction2 = 1.0 - std::pow(hyper.beta2, static_cast<double>(step));
  const double step_size = lr / bias_correction1;
  const double lerp_weight = 1.0 - hyper.beta1;

  // Each becomes a float where it meets an fp32 tensor.
  const float decay = static_cast<float>(1.0 - lr * weight_decay);
  const float lerp_w = static_cast<float>(lerp_weight);
  const float one_minus_lerp_w = 1.0f - lerp_w;  // torch.lerp computes 1 - weight in fp32
  const float beta2 = static_cast<float>(hyper.beta2);
  const float one_minus_beta2 = static_cast<float>(1.0 - hyper.beta2);
  const float bc2_sqrt = static_cast<float>(std::sqrt(bias_correction2));
  const float eps = static_cast<float>(hyper.eps);
  const float neg_step_size = static_cast<float>(-step_size);
  const bool lerp_small = std::abs(lerp_w) < 0.5f;

  const int64_t num_chunks = (n + kChunk - 1) / kChunk;
  std::vector<double> partials(grad_sum_squares != nullptr ? num_chunks : 0);
  // Dynamic: a core that is busy with something else (a CUDA driver thread, the pipeline)
  // must not hold the whole team back, as a static split would.
#pragma omp parallel for schedule(dynamic, 8) if (num_chunks > 1)
  for (int64_t c = 0; c < num_chunks; ++c) {
    const int64_t begin = c * kChunk;
    const int64_t end = std::min(n, begin + kChunk);
    if (lerp_small) {
      AdamWChunk<true>(master, m, v, bf16_out, grad, begin, end, grad_scale, decay, lerp_w,
                       one_minus_lerp_w, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step_size);
    } else {
      AdamWChunk<false>(master, m, v, bf16_out, grad, begin, end, grad_scale, decay, lerp_w,
                        one_minus_lerp_w, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step_size);
    }
    if (grad_sum_squares != nullptr) partials[c] = ChunkSumOfSquares(grad, begin, end);
  }
  if (grad_sum_squares != nullptr) {
    double total = 0.0;
    for (double p : partials) total += p;
    *grad_sum_squares = total;
  }
}

}  // namespace megatrain
