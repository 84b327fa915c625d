// LoRA's low-rank path beside a frozen projection y = x W^T (Hu et al. 2021,
// arXiv 2106.09685), on BLAS GEMMs:
//
//   t   = scale * x A^T          (N, r)
//   y  += t B^T                  (N, OC), rows ld_y apart: a column slice of a fused output
//                                (q of q|k|v, gate of gate|up) or a whole one
//
// and its backward, from dy (N, OC) rows ld_dy apart (the same slice of dL/dy), with t
// computed again from x (N r IC multiply-adds: cheaper than keeping it per layer):
//
//   t   = scale * x A^T
//   dt  = dy B                   (N, r): dL/dt
//   dB += dy^T t                 (OC, r)
//   dA += scale * dt^T x         (r, IC)
//   dx += scale * dt A           (N, IC)
//
// The scale (alpha / r, or alpha / sqrt(r) with rsLoRA) rides on the GEMMs' alphas, so t
// is the scaled product and no separate scaling pass runs. PEFT computes
// (x A^T) B^T * scale; the two differ only in where bf16 rounds.
//
// The grouped forms run the same per expert of a mixture-of-experts layer, over that
// expert's rows of the rows sorted by expert (as GroupedLinear takes them), with its own
// A_e (r, IC) and B_e (OC, r).
#pragma once

#include <cstdint>
#include <type_traits>

#include "engine/kernels/reference/linear.h"

namespace megatrain::ref {

template <typename T>
void LoraForward(T* y, int64_t ld_y, T* t, const T* x, const T* A, const T* B, int64_t N,
                 int64_t IC, int64_t OC, int64_t r, double scale) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>, "float or double");
  linear_internal::CheckDims(N, IC, OC);
  linear_internal::CheckDims(r, ld_y, 1);
  linear_internal::Gemm(false, true, N, r, IC, T(scale), x, IC, A, IC, T(0), t, r);
  linear_internal::Gemm(false, true, N, OC, r, T(1), t, r, B, r, T(1), y, ld_y);
}

template <typename T>
void LoraBackward(T* dx, T* dA, T* dB, T* t, T* dt, const T* dy, int64_t ld_dy, const T* x,
                  const T* A, const T* B, int64_t N, int64_t IC, int64_t OC, int64_t r,
                  double scale) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>, "float or double");
  linear_internal::CheckDims(N, IC, OC);
  linear_internal::CheckDims(r, ld_dy, 1);
  linear_internal::Gemm(false, true, N, r, IC, T(scale), x, IC, A, IC, T(0), t, r);
  linear_internal::Gemm(false, false, N, r, OC, T(1), dy, ld_dy, B, r, T(0), dt, r);
  linear_internal::Gemm(true, false, OC, r, N, T(1), dy, ld_dy, t, r, T(1), dB, r);
  linear_internal::Gemm(true, false, r, IC, N, T(scale), dt, r, x, IC, T(1), dA, IC);
  linear_internal::Gemm(false, false, N, IC, r, T(scale), dt, r, A, IC, T(1), dx, IC);
}

// Per expert e over its rows [offsets[e], offsets[e+1]): LoraForward with A_e = A + e r IC
// and B_e = B + e OC r. y (R, OC) +=, t (R, r) written, x (R, IC); A (E, r, IC),
// B (E, OC, r). Experts with no rows are skipped.
template <typename T>
void GroupedLoraForward(T* y, T* t, const T* x, const T* A, const T* B, const int32_t* offsets,
                        int64_t E, int64_t IC, int64_t OC, int64_t r, double scale) {
  for (int64_t e = 0; e < E; ++e) {
    const int64_t r0 = offsets[e], rows = offsets[e + 1] - offsets[e];
    if (rows == 0) continue;
    LoraForward<T>(y + r0 * OC, OC, t + r0 * r, x + r0 * IC, A + e * r * IC, B + e * OC * r, rows,
                   IC, OC, r, scale);
  }
}

// Its backward, LoraBackward per expert: t, dt (R, r) scratch; dA (E, r, IC) +=;
// dB (E, OC, r) +=; dx (R, IC) +=; dy (R, OC). Experts without rows keep their gradients.
template <typename T>
void GroupedLoraBackward(T* dx, T* dA, T* dB, T* t, T* dt, const T* dy, const T* x, const T* A,
                         const T* B, const int32_t* offsets, int64_t E, int64_t IC, int64_t OC,
                         int64_t r, double scale) {
  for (int64_t e = 0; e < E; ++e) {
    const int64_t r0 = offsets[e], rows = offsets[e + 1] - offsets[e];
    if (rows == 0) continue;
    LoraBackward<T>(dx + r0 * IC, dA + e * r * IC, dB + e * OC * r, t + r0 * r, dt + r0 * r,
                    dy + r0 * OC, OC, x + r0 * IC, A + e * r * IC, B + e * OC * r, rows, IC, OC, r,
                    scale);
  }
}

}  // namespace megatrain::ref
