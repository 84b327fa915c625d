// AdamW on n fp32 elements, the CPU backend's Backend::AdamW: AdamWElement
// (common/adamw_math.h) element by element, and the new master's bf16 bits. The host
// optimizer's vectorised AdamWUpdate (optim/adamw.h) computes the same bits.
#pragma once

#include <cstdint>

#include "engine/common/adamw_math.h"

namespace megatrain::ref {

inline void AdamW(float* master, float* m, float* v, uint16_t* bf16_out, const float* grad,
                  int64_t n, const AdamWScalars& scalars, float grad_scale) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    if (scalars.lerp_small) {
      AdamWElement<true>(scalars, grad[i], grad_scale, &master[i], &m[i], &v[i]);
    } else {
      AdamWElement<false>(scalars, grad[i], grad_scale, &master[i], &m[i], &v[i]);
    }
    if (bf16_out != nullptr) bf16_out[i] = AdamWRoundToBf16(master[i]);
  }
}

}  // namespace megatrain::ref
