// AdamW on fp32 master weights held in host RAM, with the bf16 copy the device streams.
//
// The arithmetic is torch.optim.AdamW's single-tensor path (amsgrad=False,
// maximize=False) operation by operation: scalars are computed in double as Python does
// and become floats where they meet an fp32 tensor; every element op rounds to fp32 in
// PyTorch's order, with no fused multiply-adds. (PyTorch's own vectorised CPU lerp uses
// an FMA, so a PyTorch run can differ from ours in the last bit of m.)
#pragma once

#include <cstdint>

namespace megatrain {

struct AdamWHyper {
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
};

// One AdamW step on n elements; for each i:
//   g = grad[i] * grad_scale              (grad_scale: the clip coefficient, or 1)
//   p = p * (1 - lr * weight_decay)       (decoupled weight decay)
//   m = m + (1 - beta1) * (g - m)         (torch.lerp; its other branch when beta1 < 0.5)
//   v = v * beta2 + (1 - beta2) * g * g
//   step_size = lr / (1 - beta1^step)
//   denom = sqrt(v) / sqrt(1 - beta2^step) + eps
//   p = p - step_size * m / denom          (computed as p + (-step_size * m) / denom)
//   bf16_out[i] = FloatToBf16(p)
//
// master, m, v: (n) fp32, updated in place. bf16_out: (n) bf16 bits, or null to skip.
// grad: (n) fp32, read only. step: 1-based count of steps including this one.
// REQUIRES: n >= 0, step >= 1; the arrays do not overlap.
//
// Runs on the OpenMP thread pool; every element is computed independently, so results
// do not depend on the number of threads. Not safe to call concurrently on the same
// arrays.
//
// grad_sum_squares: if not null, receives the sum of grad[i]^2 (unscaled, in double) from
// the same pass, while each chunk of the gradient is still in cache: the norm without a
// second read of the gradient. Its summation order depends on n alone.
void AdamWUpdate(float* master, float* m, float* v, uint16_t* bf16_out, const float* grad,
                 int64_t n, int64_t step, double lr, double weight_decay, float grad_scale,
                 const AdamWHyper& hyper, double* grad_sum_squares = nullptr);

}  // namespace megatrain
