// QKV prepare: split the fused QKV projection into per-head q, k, v, apply the optional
// Qwen3 per-head RMSNorm to q and k (QK-norm), then rotate q and k with RoPE.
//
// RoPE follows Hugging Face's rotate_half convention (pairs j and j + D/2, not adjacent
// elements), and the angle pos * inv_freq is rounded to float exactly as HF's float32
// matmul does before cos/sin are taken, so positions far into a long context rotate by
// the same angles as in transformers. The norm-weight gradient sums over all tokens; the
// backward sums it per fixed token chunk and then over chunks in order (kNumPartials), so
// it is bit-identical for any thread count.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "engine/common/check.h"

namespace megatrain::ref {
namespace qkv_internal {

// Number of token chunks whose norm-weight gradients are summed separately and then added
// in chunk order. Fixed, so the summation order never depends on the thread count.
constexpr int64_t kNumPartials = 64;

// cos_t, sin_t (D/2) for one position: angle rounded to float, cos/sin in double, times
// rope_scale (YaRN's attention factor; 1 otherwise).
inline void RopeCosSin(double* cos_t, double* sin_t, int32_t pos, const float* inv_freq,
                       float rope_scale, int64_t half) {
  for (int64_t j = 0; j < half; ++j) {
    const float angle = static_cast<float>(pos) * inv_freq[j];
    cos_t[j] = std::cos(static_cast<double>(angle)) * rope_scale;
    sin_t[j] = std::sin(static_cast<double>(angle)) * rope_scale;
  }
}

// One head: y (D) = rope(norm(x (D))). norm_w (D) may be null (no norm, rstd untouched).
// scratch (D).
template <typename T>
void HeadForward(T* y, T* rstd, const T* x, const T* norm_w, const double* cos_t,
                 const double* sin_t, int64_t D, double eps, T* scratch) {
  const T* xn = x;
  if (norm_w != nullptr) {
    double sum_sq = 0.0;
    for (int64_t d = 0; d < D; ++d) sum_sq += static_cast<double>(x[d]) * x[d];
    const T s = static_cast<T>(1.0 / std::sqrt(sum_sq / static_cast<double>(D) + eps));
    *rstd = s;
    for (int64_t d = 0; d < D; ++d) scratch[d] = x[d] * s * norm_w[d];
    xn = scratch;
  }
  const int64_t half = D / 2;
  for (int64_t j = 0; j < half; ++j) {
    const double a = xn[j], b = xn[j + half];
    y[j] = static_cast<T>(a * cos_t[j] - b * sin_t[j]);
    y[j + half] = static_cast<T>(b * cos_t[j] + a * sin_t[j]);
  }
}

// One head's backward: dx (D) from dy (D). With a norm, dnorm_w (D, double) += the head's
// contribution. scratch (2*D) doubles.
template <typename T>
void HeadBackward(T* dx, double* dnorm_w, const T* dy, const T* x, const T* norm_w, T rstd,
                  const double* cos_t, const double* sin_t, int64_t D, double* scratch) {
  const int64_t half = D / 2;
  double* dxn = scratch;  // (D) gradient w.r.t. the normalised, pre-rotation head
  for (int64_t j = 0; j < half; ++j) {
    const double a = dy[j], b = dy[j + half];
    dxn[j] = a * cos_t[j] + b * sin_t[j];
    dxn[j + half] = b * cos_t[j] - a * sin_t[j];
  }
  if (norm_w == nullptr) {
    for (int64_t d = 0; d < D; ++d) dx[d] = static_cast<T>(dxn[d]);
    return;
  }
  // xn = u * w with u = x * rstd:  dw += dxn * u;  dx = rstd * (du - u * mean(du * u)).
  const double s = rstd;
  double* du = scratch + D;  // (D)
  double dot = 0.0;
  for (int64_t d = 0; d < D; ++d) {
    const double u = x[d] * s;
    dnorm_w[d] += dxn[d] * u;
    du[d] = dxn[d] * norm_w[d];
    dot += du[d] * u;
  }
  const double mean = dot / static_cast<double>(D);
  for (int64_t d = 0; d < D; ++d) dx[d] = static_cast<T>(s * (du[d] - x[d] * s * mean));
}

}  // namespace qkv_internal

// qkv (n, (H+2*KV)*D), each row [q (H*D) | k (KV*D) | v (KV*D)] -> q (n,H,D), k (n,KV,D),
// v (n,KV,D). q_norm_w (D) / k_norm_w (D) enable QK-norm when non-null; rstd_q (n*H) and
// rstd_k (n*KV) then receive the per-head rstd (may be null otherwise). pos (n) positions,
// inv_freq (D/2) from RopeInvFreq; cos and sin are scaled by rope_scale (YaRN's attention
// factor, else 1). REQUIRES: D even.
template <typename T>
void QkvPrepare(T* q, T* k, T* v, T* rstd_q, T* rstd_k, const T* qkv, const T* q_norm_w,
                const T* k_norm_w, const int32_t* pos, const float* inv_freq, float rope_scale,
                int64_t n, int64_t H, int64_t KV, int64_t D, double eps) {
  MT_CHECK(D > 0 && D % 2 == 0 && H > 0 && KV > 0);
  MT_CHECK(q_norm_w == nullptr || rstd_q != nullptr);
  MT_CHECK(k_norm_w == nullptr || rstd_k != nullptr);
  const int64_t width = (H + 2 * KV) * D;
#pragma omp parallel
  {
    std::vector<double> cos_t(D / 2), sin_t(D / 2);
    std::vector<T> scratch(D);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      MT_CHECK(pos[i] >= 0);
      qkv_internal::RopeCosSin(cos_t.data(), sin_t.data(), pos[i], inv_freq, rope_scale, D / 2);
      const T* row = qkv + i * width;
      for (int64_t h = 0; h < H; ++h) {
        qkv_internal::HeadForward(q + (i * H + h) * D, rstd_q ? rstd_q + i * H + h : nullptr,
                                  row + h * D, q_norm_w, cos_t.data(), sin_t.data(), D, eps,
                                  scratch.data());
      }
      for (int64_t g = 0; g < KV; ++g) {
        qkv_internal::HeadForward(k + (i * KV + g) * D, rstd_k ? rstd_k + i * KV + g : nullptr,
                                  row + (H + g) * D, k_norm_w, cos_t.data(), sin_t.data(), D, eps,
                                  scratch.data());
      }
      std::memcpy(v + i * KV * D, row + (H + KV) * D, KV * D * sizeof(T));
    }
  }
}

// dqkv (n, (H+2*KV)*D) written from dq (n,H,D), dk (n,KV,D), dv (n,KV,D). dq_norm_w (D) and
// dk_norm_w (D) accumulate and must be non-null exactly when the matching norm weight is.
// qkv, norm weights, rstd_q (n*H), rstd_k (n*KV) are the forward's. eps is unused (the
// forward's rstd already holds it); it is kept so both calls take the same arguments.
template <typename T>
void QkvPrepareBackward(T* dqkv, T* dq_norm_w, T* dk_norm_w, const T* dq, const T* dk, const T* dv,
                        const T* qkv, const T* q_norm_w, const T* k_norm_w, const T* rstd_q,
                        const T* rstd_k, const int32_t* pos, const float* inv_freq,
                        float rope_scale, int64_t n, int64_t H, int64_t KV, int64_t D,
                        double eps) {
  MT_CHECK(D > 0 && D % 2 == 0 && H > 0 && KV > 0);
  MT_CHECK((q_norm_w == nullptr) == (dq_norm_w == nullptr));
  MT_CHECK((k_norm_w == nullptr) == (dk_norm_w == nullptr));
  MT_CHECK(q_norm_w == nullptr || rstd_q != nullptr);
  MT_CHECK(k_norm_w == nullptr || rstd_k != nullptr);
  if (n <= 0) return;
  const int64_t width = (H + 2 * KV) * D;
  const int64_t num_chunks = std::min(n, qkv_internal::kNumPartials);
  std::vector<double> partial_q(num_chunks * D, 0.0);  // (num_chunks, D)
  std::vector<double> partial_k(num_chunks * D, 0.0);  // (num_chunks, D)
#pragma omp parallel
  {
    std::vector<double> cos_t(D / 2), sin_t(D / 2), scratch(2 * D);
#pragma omp for schedule(static)
    for (int64_t chunk = 0; chunk < num_chunks; ++chunk) {
      double* pq = partial_q.data() + chunk * D;
      double* pk = partial_k.data() + chunk * D;
      const int64_t i0 = chunk * n / num_chunks;
      const int64_t i1 = (chunk + 1) * n / num_chunks;
      for (int64_t i = i0; i < i1; ++i) {
        qkv_internal::RopeCosSin(cos_t.data(), sin_t.data(), pos[i], inv_freq, rope_scale, D / 2);
        const T* row = qkv + i * width;
        T* drow = dqkv + i * width;
        for (int64_t h = 0; h < H; ++h) {
          qkv_internal::HeadBackward(drow + h * D, pq, dq + (i * H + h) * D, row + h * D, q_norm_w,
                                     rstd_q ? rstd_q[i * H + h] : T(1), cos_t.data(), sin_t.data(),
                                     D, scratch.data());
        }
        for (int64_t g = 0; g < KV; ++g) {
          qkv_internal::HeadBackward(
              drow + (H + g) * D, pk, dk + (i * KV + g) * D, row + (H + g) * D, k_norm_w,
              rstd_k ? rstd_k[i * KV + g] : T(1), cos_t.data(), sin_t.data(), D, scratch.data());
        }
        std::memcpy(drow + (H + KV) * D, dv + i * KV * D, KV * D * sizeof(T));
      }
    }
  }
  for (int64_t d = 0; d < D; ++d) {
    double sum_q = 0.0, sum_k = 0.0;
    for (int64_t chunk = 0; chunk < num_chunks; ++chunk) {
      sum_q += partial_q[chunk * D + d];
      sum_k += partial_k[chunk * D + d];
    }
    if (dq_norm_w != nullptr) dq_norm_w[d] += static_cast<T>(sum_q);
    if (dk_norm_w != nullptr) dk_norm_w[d] += static_cast<T>(sum_k);
  }
}

}  // namespace megatrain::ref
