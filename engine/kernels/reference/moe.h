// Mixture-of-experts ops: the router's top-k, the permutation of token rows by expert, the
// grouped expert matmuls, the weighted combine, and the backward of each.
//
//   logits (n, E) = h Wr^T                          (a plain Linear)
//   probs  (n, E) = softmax(logits)                 MoeRoute
//   idx, w (n, k) = top-k of probs (renormalised to sum 1 when `renorm`)
//   rows sorted by (expert, token, j): R = n*k      MoeSort
//   xe (R, C) = h[token of row]                     (Embedding: rows of h by index)
//   per expert e: ye_e = expert_e(xe_e)             GroupedLinear, SwiGlu, GroupedLinear
//   out (n, C) += sum_j w[t,j] * ye[slot of (t,j)]  MoeCombine
//
// The sort is stable and counting (no comparison of floats): row r of expert e holds the
// r-th (token, j) pair routed to e in token order, so every sum over rows of an expert (the
// expert's weight gradient) and every sum over a token's k choices runs in one fixed order:
// steps repeat bit for bit, on the CPU and on the device.
//
// Top-k picks the largest probabilities, the lower expert index first among equals (as a
// stable descending sort would). Statistics (probs, w, dw) are the stat dtype; counts and
// indices int32.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "engine/common/check.h"
#include "engine/kernels/moe_scratch.h"
#include "engine/kernels/reference/linear.h"

namespace megatrain::ref {

// Loops over less work than this run on the calling thread: a parallel region costs more
// than they do (and, with busy-waiting OpenMP threads, far more on a loaded machine).
constexpr int64_t kMinParallelWork = int64_t{1} << 16;

// probs (n,E) = softmax(logits (n,E)); idx (n,k) the top-k experts by probability (lower
// index first among equals), in decreasing order; w (n,k) their probabilities, divided by
// their sum when renorm.
template <typename T, typename S>
void MoeRoute(S* probs, int32_t* idx, S* w, const T* logits, int64_t n, int64_t E, int64_t k,
              bool renorm) {
  MT_CHECK(k >= 1 && k <= E);
#pragma omp parallel for schedule(static) if (n * E * k >= kMinParallelWork)
  for (int64_t t = 0; t < n; ++t) {
    const T* l = logits + t * E;
    S* p = probs + t * E;
    double mx = -INFINITY;
    for (int64_t e = 0; e < E; ++e) mx = std::max(mx, static_cast<double>(l[e]));
    double sum = 0;
    for (int64_t e = 0; e < E; ++e) sum += std::exp(static_cast<double>(l[e]) - mx);
    for (int64_t e = 0; e < E; ++e) {
      p[e] = static_cast<S>(std::exp(static_cast<double>(l[e]) - mx) / sum);
    }
    int32_t* ti = idx + t * k;
    S* tw = w + t * k;
    double chosen = 0;
    for (int64_t j = 0; j < k; ++j) {
      int64_t best = -1;
      for (int64_t e = 0; e < E; ++e) {
        bool taken = false;
        for (int64_t q = 0; q < j; ++q) taken |= ti[q] == e;
        if (!taken && (best < 0 || p[e] > p[best])) best = e;
      }
      ti[j] = static_cast<int32_t>(best);
      chosen += static_cast<double>(p[best]);
    }
    for (int64_t j = 0; j < k; ++j) {
      const double v = static_cast<double>(p[ti[j]]);
      tw[j] = static_cast<S>(renorm ? v / chosen : v);
    }
  }
}

// Counting sort of the n*k choices by expert, stable in (t, j) order:
//   offsets (E+1): rows [offsets[e], offsets[e+1]) are expert e's;
//   slot_of (n*k): the row of choice (t, j), at t*k + j;
//   row_token (n*k): the token of each row.
inline void MoeSort(int32_t* offsets, int32_t* slot_of, int32_t* row_token, const int32_t* idx,
                    int64_t n, int64_t E, int64_t k) {
  const int64_t R = n * k;
  std::vector<int64_t> cursor(E + 1, 0);
  for (int64_t f = 0; f < R; ++f) {
    MT_CHECK(idx[f] >= 0 && idx[f] < E);
    ++cursor[idx[f] + 1];
  }
  for (int64_t e = 0; e < E; ++e) cursor[e + 1] += cursor[e];
  for (int64_t e = 0; e <= E; ++e) offsets[e] = static_cast<int32_t>(cursor[e]);
  for (int64_t f = 0; f < R; ++f) {
    const int64_t r = cursor[idx[f]]++;
    slot_of[f] = static_cast<int32_t>(r);
    row_token[r] = static_cast<int32_t>(f / k);
  }
}

// dh (n,C) = sum_j dxe[slot_of[t*k+j]], j in order (the gather's backward; written).
template <typename T>
void MoeGatherBackward(T* dh, const T* dxe, const int32_t* slot_of, int64_t n, int64_t k,
                       int64_t C) {
#pragma omp parallel for schedule(static) if (n * k * C >= kMinParallelWork)
  for (int64_t t = 0; t < n; ++t) {
    T* d = dh + t * C;
    for (int64_t c = 0; c < C; ++c) {
      double acc = 0;
      for (int64_t j = 0; j < k; ++j) acc += dxe[int64_t{slot_of[t * k + j]} * C + c];
      d[c] = static_cast<T>(acc);
    }
  }
}

// Per expert e, over its rows [offsets[e], offsets[e+1]):
//   out (rows, OC) = in (rows, IC) W_e^T + bias_e, W (E, OC, IC), bias (E, OC) | null.
// Experts with no rows are skipped.
// With w_in_major, W is (E, IC, OC) and out = in W_e + bias_e (LinearInMajor).
template <typename T>
void GroupedLinear(T* out, const T* in, const T* W, const T* bias, const int32_t* offsets,
                   int64_t E, int64_t IC, int64_t OC, bool w_in_major = false) {
  for (int64_t e = 0; e < E; ++e) {
    const int64_t r0 = offsets[e], rows = offsets[e + 1] - offsets[e];
    if (rows == 0) continue;
    const T* b = bias == nullptr ? nullptr : bias + e * OC;
    if (w_in_major) {
      LinearInMajor<T>(out + r0 * OC, in + r0 * IC, W + e * OC * IC, b, rows, IC, OC);
    } else {
      Linear<T>(out + r0 * OC, in + r0 * IC, W + e * OC * IC, b, rows, IC, OC, false);
    }
  }
}

// din (R, IC) written (rows of experts without rows untouched: there are none);
// dW_e (OC, IC) += dout_e^T in_e (dW null: none, a frozen weight); dbias (E, OC) | null: dbias_e += the column sums of dout_e,
// rows in order. Experts without rows keep their gradients as they were, bit for bit.
template <typename T>
void GroupedLinearBackward(T* din, T* dW, T* dbias, const T* dout, const T* in, const T* W,
                           const int32_t* offsets, int64_t E, int64_t IC, int64_t OC,
                           bool w_in_major = false) {
  for (int64_t e = 0; e < E; ++e) {
    const int64_t r0 = offsets[e], rows = offsets[e + 1] - offsets[e];
    if (rows == 0) continue;
    T* db = dbias == nullptr ? nullptr : dbias + e * OC;
    T* dw = dW == nullptr ? nullptr : dW + e * OC * IC;
    if (w_in_major) {
      LinearInMajorBackward<T>(din + r0 * IC, dw, db, dout + r0 * OC, in + r0 * IC,
                               W + e * OC * IC, rows, IC, OC);
    } else {
      LinearBackward<T>(din + r0 * IC, false, dw, db, dout + r0 * OC, in + r0 * IC,
                        W + e * OC * IC, rows, IC, OC);
    }
  }
}

// out (n,C) += sum_j w[t,j] * ye[slot_of[t*k+j]], j in order, summed in double.
template <typename T, typename S>
void MoeCombine(T* out, const T* ye, const int32_t* slot_of, const S* w, int64_t n, int64_t k,
                int64_t C) {
#pragma omp parallel for schedule(static) if (n * k * C >= kMinParallelWork)
  for (int64_t t = 0; t < n; ++t) {
    T* o = out + t * C;
    for (int64_t c = 0; c < C; ++c) {
      double acc = static_cast<double>(o[c]);
      for (int64_t j = 0; j < k; ++j) {
        acc += static_cast<double>(w[t * k + j]) *
               static_cast<double>(ye[int64_t{slot_of[t * k + j]} * C + c]);
      }
      o[c] = static_cast<T>(acc);
    }
  }
}

// dye (R,C) written: dye[slot_of[t,j]] = w[t,j] * dout[t]; dw (n,k) written:
// dw[t,j] = dot(dout[t], ye[slot_of[t,j]]).
template <typename T, typename S>
void MoeCombineBackward(T* dye, S* dw, const T* dout, const T* ye, const int32_t* slot_of,
                        const S* w, int64_t n, int64_t k, int64_t C) {
#pragma omp parallel for schedule(static) if (n * k * C >= kMinParallelWork)
  for (int64_t t = 0; t < n; ++t) {
    const T* g = dout + t * C;
    for (int64_t j = 0; j < k; ++j) {
      const int64_t r = slot_of[t * k + j];
      const double wj = static_cast<double>(w[t * k + j]);
      double dot = 0;
      for (int64_t c = 0; c < C; ++c) {
        dye[r * C + c] = static_cast<T>(wj * static_cast<double>(g[c]));
        dot += static_cast<double>(g[c]) * static_cast<double>(ye[r * C + c]);
      }
      dw[t * k + j] = static_cast<S>(dot);
    }
  }
}

// dlogits (n,E) written from dw (n,k) through the top-k weights and the softmax:
//   dL/dp_e = (renorm ? (dw_j - sum_q dw_q w_q) / sum_q p_q : dw_j)  for e = idx[t,j], else 0
//           + aux_scale * counts[e]           (the load-balancing loss; counts may be null)
//   dlogit_e = p_e (dL/dp_e - sum_f p_f dL/dp_f).
template <typename T, typename S>
void MoeRouteBackward(T* dlogits, const S* probs, const int32_t* idx, const S* w, const S* dw,
                      const int32_t* counts, double aux_scale, int64_t n, int64_t E, int64_t k,
                      bool renorm) {
#pragma omp parallel for schedule(static) if (n * E >= kMinParallelWork)
  for (int64_t t = 0; t < n; ++t) {
    const S* p = probs + t * E;
    std::vector<double> g(E, 0.0);
    for (int64_t e = 0; e < E; ++e) {
      g[e] = counts == nullptr ? 0.0 : aux_scale * static_cast<double>(counts[e]);
    }
    double chosen = 0, wdw = 0;
    for (int64_t j = 0; j < k; ++j) {
      chosen += static_cast<double>(p[idx[t * k + j]]);
      wdw += static_cast<double>(w[t * k + j]) * static_cast<double>(dw[t * k + j]);
    }
    for (int64_t j = 0; j < k; ++j) {
      const double d = static_cast<double>(dw[t * k + j]);
      g[idx[t * k + j]] += renorm ? (d - wdw) / chosen : d;
    }
    double pg = 0;
    for (int64_t e = 0; e < E; ++e) pg += static_cast<double>(p[e]) * g[e];
    for (int64_t e = 0; e < E; ++e) {
      dlogits[t * E + e] = static_cast<T>(static_cast<double>(p[e]) * (g[e] - pg));
    }
  }
}

// The load-balancing loss's statistics over a step: counts (E) += choices of each expert,
// prob_sum (E) += the column sums of probs (n,E), rows in order.
template <typename S>
void MoeRouterStats(int32_t* counts, S* prob_sum, const S* probs, const int32_t* idx, int64_t n,
                    int64_t E, int64_t k) {
  for (int64_t f = 0; f < n * k; ++f) ++counts[idx[f]];
  for (int64_t e = 0; e < E; ++e) {
    double acc = 0;
    for (int64_t t = 0; t < n; ++t) acc += static_cast<double>(probs[t * E + e]);
    prob_sum[e] += static_cast<S>(acc);
  }
}

}  // namespace megatrain::ref
