// RoPE inverse frequencies, as Hugging Face transformers computes them.
//
// The table is computed in float32 step by step in the order PyTorch evaluates HF's
// expressions (`1.0 / base ** (arange(0, D, 2).float() / D)`, then the llama3 blend), so a
// checkpoint trained here sees the same rotation angles as under transformers. Two PyTorch
// details matter: Python scalars are cast to float32 before they meet a float32 tensor,
// and `scalar / tensor` evaluates as `tensor.reciprocal() * scalar`, not as one division.
// pow is the one step that may differ by an ulp: PyTorch's vectorised powf is not
// correctly rounded; we round the exact double result of the same float inputs.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "engine/common/check.h"

namespace megatrain::ref {

// inv_freq (D/2) float. theta is the RoPE base (rope_theta). When llama3 is set, applies
// HF's `_compute_llama3_parameters` with the given rope_scaling fields.
// REQUIRES: D even and > 0; with llama3, factor > 0 and high_freq_factor > low_freq_factor.
inline void RopeInvFreq(float* inv_freq, int64_t D, double theta, bool llama3, double factor,
                        double low_freq_factor, double high_freq_factor, int64_t original_max_pos) {
  MT_CHECK(D > 0 && D % 2 == 0);
  const float base = static_cast<float>(theta);
  const float dim = static_cast<float>(D);
  for (int64_t j = 0; j < D / 2; ++j) {
    const float exponent = static_cast<float>(2 * j) / dim;
    const float power =
        static_cast<float>(std::pow(static_cast<double>(base), static_cast<double>(exponent)));
    inv_freq[j] = (1.0f / power) * 1.0f;  // 1.0 / tensor == tensor.reciprocal() * 1.0
  }
  if (!llama3) return;

  MT_CHECK(factor > 0.0 && high_freq_factor > low_freq_factor && original_max_pos > 0);
  // Python-side scalars (double), each cast to float where it meets the float tensor.
  const double old_context_len = static_cast<double>(original_max_pos);
  const float low_freq_wavelen = static_cast<float>(old_context_len / low_freq_factor);
  const float high_freq_wavelen = static_cast<float>(old_context_len / high_freq_factor);
  const float two_pi = static_cast<float>(2.0 * 3.141592653589793);  // 2 * math.pi
  const float factor_f = static_cast<float>(factor);
  const float low_f = static_cast<float>(low_freq_factor);
  const float band_f = static_cast<float>(high_freq_factor - low_freq_factor);
  const float old_len_f = static_cast<float>(old_context_len);
  for (int64_t j = 0; j < D / 2; ++j) {
    const float inv = inv_freq[j];
    const float wavelen = (1.0f / inv) * two_pi;
    if (wavelen > low_freq_wavelen) {
      inv_freq[j] = inv / factor_f;  // Low frequency: fully interpolated.
    } else if (wavelen < high_freq_wavelen) {
      inv_freq[j] = inv;  // High frequency: unchanged.
    } else {
      const float smooth = ((1.0f / wavelen) * old_len_f - low_f) / band_f;
      inv_freq[j] = (1.0f - smooth) * inv / factor_f + smooth * inv;
    }
  }
}

// inv_freq (D/2) float by HF's `_compute_yarn_parameters` (the float32 steps in PyTorch's
// order): a linear ramp between the dimensions that rotate beta_fast and beta_slow times
// over original_max_pos blends the extrapolated (base) and interpolated (base / factor)
// frequencies. The attention factor (cos/sin scale) is applied by QkvPrepare.
// REQUIRES: D even and > 0; factor > 0; original_max_pos > 0.
inline void RopeYarnInvFreq(float* inv_freq, int64_t D, double theta, double factor,
                            double beta_fast, double beta_slow, int64_t original_max_pos,
                            bool truncate) {
  MT_CHECK(D > 0 && D % 2 == 0 && factor > 0.0 && original_max_pos > 0);
  const float base = static_cast<float>(theta);
  const float dim = static_cast<float>(D);
  const float factor_f = static_cast<float>(factor);
  // find_correction_range, in Python doubles.
  const double pi = 3.141592653589793;
  auto correction_dim = [&](double rotations) {
    return (static_cast<double>(D) *
            std::log(static_cast<double>(original_max_pos) / (rotations * 2 * pi))) /
           (2 * std::log(theta));
  };
  double low = correction_dim(beta_fast), high = correction_dim(beta_slow);
  if (truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, static_cast<double>(D - 1));
  if (low == high) high += 0.001;  // linear_ramp_factor's guard against a zero range
  const float low_f = static_cast<float>(low);
  const float range_f = static_cast<float>(high - low);
  for (int64_t j = 0; j < D / 2; ++j) {
    const float exponent = static_cast<float>(2 * j) / dim;
    const float pos_freq =
        static_cast<float>(std::pow(static_cast<double>(base), static_cast<double>(exponent)));
    const float extrapolation = (1.0f / pos_freq) * 1.0f;
    const float interpolation = (1.0f / (factor_f * pos_freq)) * 1.0f;
    const float ramp = std::min(std::max((static_cast<float>(j) - low_f) / range_f, 0.0f), 1.0f);
    const float extrapolation_factor = 1.0f - ramp;
    inv_freq[j] = interpolation * (1.0f - extrapolation_factor) +
                  extrapolation * extrapolation_factor;
  }
}

}  // namespace megatrain::ref
