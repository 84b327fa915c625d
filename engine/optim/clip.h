// Global gradient-norm clipping, as torch.nn.utils.clip_grad_norm_ (norm_type 2).
//
// The caller sums squares over every gradient tensor of the step, takes the square root
// of the total, asks ClipCoefficient for the factor, and passes it to AdamWUpdate as
// grad_scale: gradients are scaled as they are read, never rewritten.
#pragma once

#include <cstdint>

namespace megatrain {

// Sum of g[i]^2 over n elements, accumulated in double.
//
// Deterministic: the elements are split into chunks whose bounds depend only on n, each
// chunk is summed in a fixed order, and the chunk sums are added in index order, so the
// result is the same for any number of OpenMP threads. REQUIRES: n >= 0.
double SumOfSquares(const float* g, int64_t n);

// The factor torch.nn.utils.clip_grad_norm_ multiplies gradients by:
//   min(1, max_norm / (total_norm + 1e-6)).
// max_norm <= 0 disables clipping (returns 1). total_norm = inf gives 0 and NaN gives
// NaN, as in PyTorch with error_if_nonfinite=False; callers that want to skip such a
// step check the norm themselves.
float ClipCoefficient(double total_norm, double max_norm);

}  // namespace megatrain
