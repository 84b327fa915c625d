// AdamW on fp32 master weights held in host RAM, with the bf16 copy the device streams.
//
// The arithmetic is torch.optim.AdamW's single-tensor path (amsgrad=False,
// maximize=False) operation by operation: scalars are computed in double as Python does
// and become floats where they meet an fp32 tensor; every element op rounds to fp32 in
// PyTorch's order, with no fused multiply-adds. (PyTorch's own vectorised CPU lerp uses
// an FMA, so a PyTorch run can differ from ours in the last bit of m.)
#pragma once

#include <cstdint>
#include <vector>

#include "engine/store/host_store.h"  // MomentDType, UnitMoments, kMomentBlock

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

// AdamWUpdate on several ranges of the same arrays in one pass of the thread team: element
// i of master, m, v and bf16_out with grad[i - grad_begin], each range with weight_decay
// if its `decay` says so, else none. A unit of many small tensors (Qwen3-MoE's 384 experts
// a layer) would otherwise start a team per tensor that a few threads finish alone. The
// same bits as AdamWUpdate on each range in turn; grad_sum_squares the same sum as adding
// those calls' sums in range order.
struct ElementRange {  // elements [begin, end), with weight decay or without
  int64_t begin = 0;
  int64_t end = 0;
  bool decay = false;
};
void AdamWUpdateRanges(float* master, float* m, float* v, uint16_t* bf16_out, const float* grad,
                       int64_t grad_begin, const std::vector<ElementRange>& ranges, int64_t step,
                       double lr, double weight_decay, float grad_scale, const AdamWHyper& hyper,
                       double* grad_sum_squares = nullptr);

// The same update of elements [begin, end) of one unit whose moments are stored as bf16 or
// int8 (UnitMoments: the unit's own pointers, indexed from its first element). Each block
// of kMomentBlock elements is decoded to fp32, updated by exactly the fp32 arithmetic
// above (so the master and bf16 weights see the same operations), and encoded again:
//   bf16: each moment rounded stochastically to a neighbouring bf16 (unbiased: rounding to
//         nearest would lose v's 0.1% steps and never let it decay);
//   int8: per block, m as sign * (q/127)^2 * max|m| with q in 0..127, and v as
//         (q/255)^4 * max v with q in 0..255 (square and fourth-power code spacing: fine
//         steps near zero, like 8-bit Adam's dynamic code), q chosen stochastically
//         between the two codes around the value so that the code is unbiased; a nonzero
//         v never becomes 0 (its smallest code is kept), so m / sqrt(v) stays bounded.
// The random bits are a hash of (key, element index): the same bits on every run and for
// every thread count. key: the caller's per (unit, step) value. tensors: the unit's ranges
// of elements to update (its tensors: sorted, disjoint), each with or without weight
// decay; elements between them (alignment padding) are left as they are, and their moments
// stay zero, so they never move a block's scale.
// REQUIRES: begin % kMomentBlock == 0; end is a multiple of kMomentBlock or the unit's
// end (the unit has `unit_elements`); grad points at element `begin`.
void AdamWUpdateQuantized(float* master, const UnitMoments& moments, uint16_t* bf16_out,
                          const float* grad, int64_t begin, int64_t end, int64_t unit_elements,
                          const std::vector<ElementRange>& tensors, int64_t step, double lr,
                          double weight_decay, float grad_scale, const AdamWHyper& hyper,
                          uint32_t key, double* grad_sum_squares = nullptr);

// The moments of elements [begin, end) of a unit as fp32 (checkpoint tests, inspection).
void DecodeMoments(const UnitMoments& moments, int64_t begin, int64_t end, float* m, float* v);

// The random key of a (unit, step) for AdamWUpdateQuantized.
uint32_t MomentRoundingKey(int64_t unit, int64_t step);

}  // namespace megatrain
