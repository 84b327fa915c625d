// Greedy decoding's pick: each row's argmax token and its log-probability, so that a decode
// step need not copy the (B, V) logits to the host.
//
// A row is broken when it holds a NaN or a +inf, or when every entry is -inf: then the id is
// -1 and the log-probability NaN, the cases the host sampler (generate/sampling.h) refuses
// with InvalidArgument, so the caller can report them the same way. -inf entries (masked
// tokens) are otherwise ordinary: they take no probability. Sums are in double; the CUDA
// kernel accumulates in fp32 and must give the same ids.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#include "engine/common/check.h"

namespace megatrain::ref {

// For each row b of logits (B, V): ids (B) [b] = the lowest index of the row's maximum,
// logprobs (B) [b] = logits[b][id] - logsumexp(logits[b]); -1 and NaN for a broken row.
// REQUIRES: V >= 1, V < 2^31.
template <typename T>
void GreedyPick(int32_t* ids, float* logprobs, const T* logits, int64_t B, int64_t V) {
  MT_CHECK(V >= 1 && V <= std::numeric_limits<int32_t>::max());
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < B; ++b) {
    const T* x = logits + b * V;
    double max_logit = -std::numeric_limits<double>::infinity();
    int64_t argmax = -1;
    bool broken = false;
    for (int64_t c = 0; c < V; ++c) {
      const double v = static_cast<double>(x[c]);
      if (std::isnan(v) || v == std::numeric_limits<double>::infinity()) broken = true;
      if (v > max_logit) {  // strict: the first of equal maxima stays
        max_logit = v;
        argmax = c;
      }
    }
    if (broken || argmax < 0) {
      ids[b] = -1;
      logprobs[b] = std::numeric_limits<float>::quiet_NaN();
      continue;
    }
    double sum = 0.0;
    for (int64_t c = 0; c < V; ++c) sum += std::exp(static_cast<double>(x[c]) - max_logit);
    const double lse = max_logit + std::log(sum);
    ids[b] = static_cast<int32_t>(argmax);
    logprobs[b] = static_cast<float>(static_cast<double>(x[argmax]) - lse);
  }
}

}  // namespace megatrain::ref
