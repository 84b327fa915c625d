// RMSNorm: out = in * rstd * w, rstd = 1 / sqrt(mean(in^2) + eps), per row.
//
// The forward stores rstd per row so the backward needs no second reduction over in^2.
// The weight gradient sums over rows; threads own column blocks and sum rows in
// row order, so results do not depend on the thread count. Sums are kept in double, which
// keeps float results close to Hugging Face's float32-upcast RMSNorm for wide rows.
#pragma once

#include <cmath>
#include <cstdint>

#include "engine/common/check.h"
#include "engine/kernels/reference/column_blocks.h"

namespace megatrain::ref {

// out (rows, C), rstd (rows) written from in (rows, C) and w (C).
template <typename T>
void RmsNorm(T* out, T* rstd, const T* in, const T* w, int64_t rows, int64_t C, double eps) {
  MT_CHECK(C > 0);
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const T* x = in + r * C;
    double sum_sq = 0.0;
    for (int64_t c = 0; c < C; ++c) sum_sq += static_cast<double>(x[c]) * x[c];
    const T s = static_cast<T>(1.0 / std::sqrt(sum_sq / static_cast<double>(C) + eps));
    rstd[r] = s;
    T* y = out + r * C;
    for (int64_t c = 0; c < C; ++c) y[c] = x[c] * s * w[c];
  }
}

// din (rows, C) += dL/din and dw (C) += dL/dw (both accumulate), given dout (rows, C) and
// the forward's in (rows, C), w (C), rstd (rows).
//   dw_c  += sum_r dout_rc * in_rc * rstd_r
//   din_rc = rstd_r * (dout_rc w_c - in_rc * rstd_r^2 * mean_k(dout_rk w_k in_rk))
template <typename T>
void RmsNormBackward(T* din, T* dw, const T* dout, const T* in, const T* w, const T* rstd,
                     int64_t rows, int64_t C) {
  MT_CHECK(C > 0);
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const T* x = in + r * C;
    const T* g = dout + r * C;
    const double s = rstd[r];
    double dot = 0.0;  // sum_k dout_k w_k x_k
    for (int64_t c = 0; c < C; ++c) dot += static_cast<double>(g[c]) * w[c] * x[c];
    const double coef = s * s * dot / static_cast<double>(C);
    T* dx = din + r * C;
    for (int64_t c = 0; c < C; ++c) {
      dx[c] += static_cast<T>(s * (static_cast<double>(g[c]) * w[c] - x[c] * coef));
    }
  }

  ForEachColumnBlock(C, [&](int64_t c0, int64_t c1) {
    double acc[kColumnBlock] = {};
    for (int64_t r = 0; r < rows; ++r) {
      const T* x = in + r * C;
      const T* g = dout + r * C;
      const double s = rstd[r];
      for (int64_t c = c0; c < c1; ++c) acc[c - c0] += static_cast<double>(g[c]) * x[c] * s;
    }
    for (int64_t c = c0; c < c1; ++c) dw[c] += static_cast<T>(acc[c - c0]);
  });
}

}  // namespace megatrain::ref
