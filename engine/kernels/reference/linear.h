// Linear layer: out (N, OC) = in (N, IC) W (OC, IC)^T + bias (OC), on OpenBLAS GEMM.
//
// W is stored as (out_features, in_features), the PyTorch / safetensors layout, so the
// forward multiplies by W^T and no transposed copy of a weight ever exists. OpenBLAS
// threads a GEMM over blocks of the output, never over the reduction dimension, so the
// result does not depend on its thread count. The bias is folded in by seeding out with it
// and running the GEMM with beta = 1.
#pragma once

#include <cblas.h>

#include <cstdint>
#include <limits>
#include <type_traits>

#include "engine/common/check.h"
#include "engine/kernels/reference/column_blocks.h"

namespace megatrain::ref {
namespace linear_internal {

// BLAS takes int dimensions.
inline void CheckDims(int64_t a, int64_t b, int64_t c) {
  constexpr int64_t kMax = std::numeric_limits<int>::max();
  MT_CHECK(a > 0 && b > 0 && c > 0 && a <= kMax && b <= kMax && c <= kMax);
}

// Row-major C (M, Nc) = alpha * op(A) op(B) + beta * C.
inline void Gemm(bool trans_a, bool trans_b, int64_t M, int64_t Nc, int64_t K, float alpha,
                 const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C,
                 int64_t ldc) {
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, M, Nc, K, alpha, A, lda, B, ldb, beta, C, ldc);
}
inline void Gemm(bool trans_a, bool trans_b, int64_t M, int64_t Nc, int64_t K, double alpha,
                 const double* A, int64_t lda, const double* B, int64_t ldb, double beta, double* C,
                 int64_t ldc) {
  cblas_dgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, M, Nc, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

// The GEMM's beta for out (N, OC) after the bias (OC) | null is put in first: out = bias
// (or out += bias with accumulate), then the product adds to it.
template <typename T>
T PreloadBias(T* out, const T* bias, int64_t N, int64_t OC, bool accumulate) {
  if (bias == nullptr) return accumulate ? T(1) : T(0);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < N; ++i) {
    T* row = out + i * OC;
    if (accumulate) {
      for (int64_t o = 0; o < OC; ++o) row[o] += bias[o];
    } else {
      for (int64_t o = 0; o < OC; ++o) row[o] = bias[o];
    }
  }
  return T(1);
}

// dbias (OC) += the column sums of dout (N, OC). Threads own column blocks and sum rows in
// order: deterministic.
template <typename T>
void AddColumnSums(T* dbias, const T* dout, int64_t N, int64_t OC) {
  ForEachColumnBlock(OC, [&](int64_t o0, int64_t o1) {
    double acc[kColumnBlock] = {};
    for (int64_t i = 0; i < N; ++i) {
      for (int64_t o = o0; o < o1; ++o) acc[o - o0] += dout[i * OC + o];
    }
    for (int64_t o = o0; o < o1; ++o) dbias[o] += static_cast<T>(acc[o - o0]);
  });
}

}  // namespace linear_internal

// out (N, OC) = in (N, IC) W (OC, IC)^T + bias (OC); bias may be null. With accumulate,
// out += the same. REQUIRES: N, IC, OC > 0 and small enough for BLAS int dimensions.
template <typename T>
void Linear(T* out, const T* in, const T* W, const T* bias, int64_t N, int64_t IC, int64_t OC,
            bool accumulate) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>, "float or double");
  linear_internal::CheckDims(N, IC, OC);
  const T beta = linear_internal::PreloadBias(out, bias, N, OC, accumulate);
  linear_internal::Gemm(false, true, N, OC, IC, T(1), in, IC, W, IC, beta, out, OC);
}

// out (N, OC) = in (N, IC) W (IC, OC) + bias (OC) | null: a weight stored input-major, as
// transformers keeps GPT-OSS's experts.
template <typename T>
void LinearInMajor(T* out, const T* in, const T* W, const T* bias, int64_t N, int64_t IC,
                   int64_t OC) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>, "float or double");
  linear_internal::CheckDims(N, IC, OC);
  const T beta = linear_internal::PreloadBias(out, bias, N, OC, false);
  linear_internal::Gemm(false, false, N, OC, IC, T(1), in, IC, W, OC, beta, out, OC);
}

// din (N, IC) = dout (N, OC) W^T; dW (IC, OC) += in^T dout; dbias (OC) += column sums of
// dout | null.
template <typename T>
void LinearInMajorBackward(T* din, T* dW, T* dbias, const T* dout, const T* in, const T* W,
                           int64_t N, int64_t IC, int64_t OC) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>, "float or double");
  linear_internal::CheckDims(N, IC, OC);
  linear_internal::Gemm(false, true, N, IC, OC, T(1), dout, OC, W, OC, T(0), din, IC);
  if (dW != nullptr) linear_internal::Gemm(true, false, IC, OC, N, T(1), in, IC, dout, OC, T(1), dW, OC);
  if (dbias != nullptr) linear_internal::AddColumnSums(dbias, dout, N, OC);
}

// din (N, IC) = dout (N, OC) W (OC, IC), or += with din_accumulate; din may be null.
// dW (OC, IC) += dout^T in (N, IC); dW may be null (a frozen weight: no gradient).
// dbias (OC) += column sums of dout; dbias may be null.
template <typename T>
void LinearBackward(T* din, bool din_accumulate, T* dW, T* dbias, const T* dout, const T* in,
                    const T* W, int64_t N, int64_t IC, int64_t OC) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>, "float or double");
  linear_internal::CheckDims(N, IC, OC);
  if (din != nullptr) {
    linear_internal::Gemm(false, false, N, IC, OC, T(1), dout, OC, W, IC,
                          din_accumulate ? T(1) : T(0), din, IC);
  }
  if (dW != nullptr) linear_internal::Gemm(true, false, OC, IC, N, T(1), dout, OC, in, IC, T(1), dW, IC);
  if (dbias != nullptr) linear_internal::AddColumnSums(dbias, dout, N, OC);
}

}  // namespace megatrain::ref
