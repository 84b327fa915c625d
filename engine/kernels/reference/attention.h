// Causal grouped-query attention over packed documents, with an optional sliding window and
// per-head attention sinks, and a flash-style backward.
//
// A packed batch holds several documents back to back; doc_start[i] (the first token of
// query i's document) bounds its keys to [doc_start[i], i], which is both the causal mask
// and the document mask, so no n x n mask is ever built. A sliding window (GPT-OSS) narrows
// that to the last `window` keys, i - j < window. A sink (GPT-OSS) is one more logit per
// head with no value: it adds exp(sink_h) to every softmax denominator of head h, so a query
// may put weight on "nothing". The forward keeps only the per-row logsumexp (sink included);
// the backward recomputes the probabilities from it, like FlashAttention-2. For determinism
// without atomics the backward runs two passes: dq parallel over (query, head), then dk/dv
// parallel over (key, kv head), each output element summed by one thread in a fixed order;
// the sink gradient is one sum per head over the tokens in order. All dot products and sums
// are in double.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "engine/common/check.h"

namespace megatrain::ref {
namespace attention_internal {

template <typename T>
double Dot(const T* a, const T* b, int64_t D) {
  double sum = 0.0;
  for (int64_t d = 0; d < D; ++d) sum += static_cast<double>(a[d]) * b[d];
  return sum;
}

// The first key query i sees: its document's start, or the window's if that is later.
inline int64_t FirstKey(const int32_t* doc_start, int64_t window, int64_t i) {
  const int64_t j0 = doc_start[i];
  MT_CHECK(j0 >= 0 && j0 <= i);
  return window > 0 ? std::max(j0, i - window + 1) : j0;
}

// One query's softmax over keys j0..i and its weighted sum of values, in double: q (D), the
// keys and values of its kv head at k + j * stride and v + j * stride; sink a logit or null;
// score and acc scratch of at least i - j0 + 1 and D. o (D) written; returns the logsumexp
// (the sink's term included). The loop Attention runs for each row, and DecodeAttention for
// each sequence's newest token.
template <typename T>
double AttendOne(const T* q, const T* k, const T* v, int64_t stride, int64_t j0, int64_t i,
                 int64_t D, double scale, const T* sink, double* score, double* acc, T* o) {
  double max_score = -std::numeric_limits<double>::infinity();
  for (int64_t j = j0; j <= i; ++j) {
    const double s = scale * Dot(q, k + j * stride, D);
    score[j - j0] = s;
    max_score = std::max(max_score, s);
  }
  const double sink_logit = sink != nullptr ? static_cast<double>(*sink) : 0.0;
  if (sink != nullptr) max_score = std::max(max_score, sink_logit);
  std::fill(acc, acc + D, 0.0);
  double sum = 0.0;
  for (int64_t j = j0; j <= i; ++j) {
    const double p = std::exp(score[j - j0] - max_score);
    sum += p;
    const T* vj = v + j * stride;
    for (int64_t d = 0; d < D; ++d) acc[d] += p * vj[d];
  }
  if (sink != nullptr) sum += std::exp(sink_logit - max_score);
  for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(acc[d] / sum);
  return max_score + std::log(sum);
}

}  // namespace attention_internal

// q (n,H,D), k (n,KV,D), v (n,KV,D), doc_start (n), sinks (H) or null -> o (n,H,D), lse (n,H).
// Query i sees keys j with doc_start[i] <= j <= i and, when window > 0, i - j < window
// (window == 0: no window). Query head h reads kv head h / (H/KV); scale 1/sqrt(D).
//   s_ij = scale q_i.k_j,  lse_i = log(sum_j exp(s_ij) + exp(sink_h))  (no sink term if null)
//   o_i = sum_j exp(s_ij - lse_i) v_j
// sinks are logits in the units of s_ij. lse is the natural log and includes the sink.
// REQUIRES: H % KV == 0; 0 <= doc_start[i] <= i; window >= 0.
template <typename T>
void Attention(T* o, T* lse, const T* q, const T* k, const T* v, const int32_t* doc_start,
               const T* sinks, int64_t window, int64_t n, int64_t H, int64_t KV, int64_t D) {
  MT_CHECK(H > 0 && KV > 0 && H % KV == 0 && D > 0 && window >= 0);
  const int64_t group = H / KV;
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
#pragma omp parallel
  {
    std::vector<double> score(std::max<int64_t>(n, 1));  // (keys of one query)
    std::vector<double> acc(D);
#pragma omp for collapse(2) schedule(dynamic, 8)
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t h = 0; h < H; ++h) {
        const int64_t j0 = attention_internal::FirstKey(doc_start, window, i);
        const int64_t g = h / group;
        lse[i * H + h] = static_cast<T>(attention_internal::AttendOne(
            q + (i * H + h) * D, k + g * D, v + g * D, KV * D, j0, i, D, scale,
            sinks != nullptr ? sinks + h : nullptr, score.data(), acc.data(),
            o + (i * H + h) * D));
      }
    }
  }
}

// dq (n,H,D), dk (n,KV,D), dv (n,KV,D) written, dsinks (H) += (or null), from dout (n,H,D)
// and the forward's q, k, v, o (n,H,D), lse (n,H), doc_start (n), sinks (H) or null and
// window. dk, dv sum over the query heads of their group.
//   P_ij = exp(scale q_i.k_j - lse_i), Delta_i = dO_i.O_i, dS_ij = P_ij (dO_i.v_j - Delta_i)
//   dq_i = scale sum_j dS_ij k_j,  dk_j = scale sum_i dS_ij q_i,  dv_j = sum_i P_ij dO_i
//   dsinks_h += -sum_i exp(sink_h - lse_ih) Delta_ih
// REQUIRES: the forward's REQUIRES; dsinks null when sinks is.
template <typename T>
void AttentionBackward(T* dq, T* dk, T* dv, T* dsinks, const T* dout, const T* q, const T* k,
                       const T* v, const T* o, const T* lse, const int32_t* doc_start,
                       const T* sinks, int64_t window, int64_t n, int64_t H, int64_t KV,
                       int64_t D) {
  MT_CHECK(H > 0 && KV > 0 && H % KV == 0 && D > 0 && window >= 0);
  MT_CHECK(dsinks == nullptr || sinks != nullptr);
  const int64_t group = H / KV;
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  using attention_internal::Dot;

  std::vector<double> delta(n * H);  // (n, H)
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < n * H; ++r) delta[r] = Dot(dout + r * D, o + r * D, D);

  // The sink's probability in row (i, h) is exp(sink_h - lse_ih); its dS is P (0 - Delta).
  if (dsinks != nullptr) {
#pragma omp parallel for schedule(static)
    for (int64_t h = 0; h < H; ++h) {
      double sum = 0.0;
      for (int64_t i = 0; i < n; ++i) {
        const int64_t r = i * H + h;
        sum += std::exp(static_cast<double>(sinks[h]) - static_cast<double>(lse[r])) * delta[r];
      }
      dsinks[h] += static_cast<T>(-sum);
    }
  }

  // Pass 1: dq, one (query, head) per task, keys in order.
#pragma omp parallel
  {
    std::vector<double> acc(D);
#pragma omp for collapse(2) schedule(dynamic, 8)
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t h = 0; h < H; ++h) {
        const int64_t j0 = attention_internal::FirstKey(doc_start, window, i);
        const int64_t g = h / group;
        const int64_t r = i * H + h;
        const T* qi = q + r * D;
        const T* doi = dout + r * D;
        std::fill(acc.begin(), acc.end(), 0.0);
        for (int64_t j = j0; j <= i; ++j) {
          const T* kj = k + (j * KV + g) * D;
          const double p = std::exp(scale * Dot(qi, kj, D) - static_cast<double>(lse[r]));
          const double ds = p * (Dot(doi, v + (j * KV + g) * D, D) - delta[r]);
          for (int64_t d = 0; d < D; ++d) acc[d] += ds * kj[d];
        }
        T* dqi = dq + r * D;
        for (int64_t d = 0; d < D; ++d) dqi[d] = static_cast<T>(scale * acc[d]);
      }
    }
  }

  // Pass 2: dk, dv, one (key, kv head) per task; queries j <= i (< j + window) of the same
  // document, in order, and within a query the heads of the group in order.
#pragma omp parallel
  {
    std::vector<double> acc_k(D), acc_v(D);
#pragma omp for collapse(2) schedule(dynamic, 8)
    for (int64_t j = 0; j < n; ++j) {
      for (int64_t g = 0; g < KV; ++g) {
        const T* kj = k + (j * KV + g) * D;
        const T* vj = v + (j * KV + g) * D;
        std::fill(acc_k.begin(), acc_k.end(), 0.0);
        std::fill(acc_v.begin(), acc_v.end(), 0.0);
        const int64_t i_end = window > 0 ? std::min(n, j + window) : n;
        for (int64_t i = j; i < i_end; ++i) {
          if (doc_start[i] > j) continue;  // j lies in an earlier document than i
          for (int64_t h = g * group; h < (g + 1) * group; ++h) {
            const int64_t r = i * H + h;
            const T* qi = q + r * D;
            const T* doi = dout + r * D;
            const double p = std::exp(scale * Dot(qi, kj, D) - static_cast<double>(lse[r]));
            const double ds = p * (Dot(doi, vj, D) - delta[r]);
            for (int64_t d = 0; d < D; ++d) {
              acc_k[d] += ds * qi[d];
              acc_v[d] += p * doi[d];
            }
          }
        }
        T* dkj = dk + (j * KV + g) * D;
        T* dvj = dv + (j * KV + g) * D;
        for (int64_t d = 0; d < D; ++d) {
          dkj[d] = static_cast<T>(scale * acc_k[d]);
          dvj[d] = static_cast<T>(acc_v[d]);
        }
      }
    }
  }
}

}  // namespace megatrain::ref
