// Fused softmax cross-entropy over a chunk of rows: loss and dlogits in one pass.
//
// The vocabulary projection is evaluated chunk by chunk so the (tokens, V) logits never
// exist in full; this op therefore writes the logits' gradient straight over the logits
// (dlogits may alias logits). Every element is read before it is overwritten, and the row
// max and sum are in double so a 150k-entry vocabulary loses nothing to float rounding.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "engine/common/check.h"

namespace megatrain::ref {

// Targets equal to this contribute no loss and no gradient (PyTorch's ignore_index).
constexpr int32_t kIgnoreIndex = -100;

// logits (N, V), targets (N) in [0, V) or kIgnoreIndex -> loss (N) = logsumexp(logits_i) -
// logits_i[target] (0 when ignored), dlogits (N, V) = scale * row_scale[i] (1 when
// row_scale is null) * (softmax(logits_i) - onehot(target)) (0 when ignored). dlogits may
// alias logits, or be null for loss only.
template <typename T>
void CrossEntropy(T* dlogits, T* loss, const T* logits, const int32_t* targets, int64_t N,
                  int64_t V, double scale, const T* row_scale = nullptr) {
  MT_CHECK(V > 0);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < N; ++i) {
    const T* x = logits + i * V;
    T* dx = dlogits != nullptr ? dlogits + i * V : nullptr;
    const int32_t t = targets[i];
    if (t == kIgnoreIndex) {
      loss[i] = T(0);
      if (dx != nullptr) std::fill(dx, dx + V, T(0));
      continue;
    }
    MT_CHECK_MSG(t >= 0 && t < V, "target %d at row %lld is outside [0, %lld)", t,
                 static_cast<long long>(i), static_cast<long long>(V));
    double max_logit = -std::numeric_limits<double>::infinity();
    for (int64_t c = 0; c < V; ++c) max_logit = std::max(max_logit, static_cast<double>(x[c]));
    double sum = 0.0;
    for (int64_t c = 0; c < V; ++c) sum += std::exp(static_cast<double>(x[c]) - max_logit);
    const double lse = max_logit + std::log(sum);
    loss[i] = static_cast<T>(lse - static_cast<double>(x[t]));
    if (dx == nullptr) continue;
    const double row = row_scale != nullptr ? scale * static_cast<double>(row_scale[i]) : scale;
    for (int64_t c = 0; c < V; ++c) {
      const double p = std::exp(static_cast<double>(x[c]) - lse);  // x[c] read before dx[c]
      dx[c] = static_cast<T>(row * (c == t ? p - 1.0 : p));
    }
  }
}

}  // namespace megatrain::ref
