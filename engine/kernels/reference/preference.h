// DPO's coefficient on each token's log-probability, in the form CrossEntropy's row_scale
// takes (layers/preference_loss.h has the losses): for one micro-batch whose target tokens
// belong to sequences 2k (pair k's chosen completion) and 2k+1 (its rejected one),
//
//   pi_s        = -sum of values[i] over the tokens i of sequence s (values: each token's
//                 -log p(target), the head's first sweep)
//   terms_k     = PreferencePairTerms(pi_2k - ref_2k, pi_2k+1 - ref_2k+1, lengths)
//   row_scale_i = nll_weight_s - pair_weight_s * d_s,   s = sequence[i], d_s = terms_k's
//                 derivative by pi_s; 0 where sequence[i] = -1
//
// so that CrossEntropy's dlogits = row_scale * (softmax - onehot) = d(step loss)/dlogits:
// the DPO term's (d_s per pair, weighted into the step's mean) and RPO's NLL on the chosen
// tokens (nll_weight_s). info (S, kPrefFields) doubles per sequence
// (common/preference_math.h). The sums run in double, in token order.
#pragma once

#include <cstdint>
#include <vector>

#include "engine/common/check.h"
#include "engine/common/preference_math.h"

namespace megatrain::ref {

template <typename T>
void PreferenceRowScale(T* row_scale, const T* values, const int32_t* sequence,
                        const double* info, int64_t N, int64_t S, PreferenceLoss kind,
                        double beta, double label_smoothing) {
  MT_CHECK(S % 2 == 0);
  std::vector<double> logp(S, 0.0);
  for (int64_t i = 0; i < N; ++i) {
    MT_CHECK_MSG(sequence[i] >= -1 && sequence[i] < S, "token %lld: sequence %d of %lld",
                 static_cast<long long>(i), sequence[i], static_cast<long long>(S));
    if (sequence[i] >= 0) logp[sequence[i]] -= static_cast<double>(values[i]);
  }
  std::vector<double> scale(S);
  for (int64_t k = 0; k < S / 2; ++k) {
    const double* c = info + 2 * k * kPrefFields;
    const double* r = c + kPrefFields;
    const PairLossTerms t = PreferencePairTerms(
        kind, beta, label_smoothing, logp[2 * k] - c[kPrefRefLogp],
        logp[2 * k + 1] - r[kPrefRefLogp], c[kPrefTokens], r[kPrefTokens]);
    scale[2 * k] = c[kPrefNllWeight] - c[kPrefPairWeight] * t.d_chosen;
    scale[2 * k + 1] = r[kPrefNllWeight] - r[kPrefPairWeight] * t.d_rejected;
  }
  for (int64_t i = 0; i < N; ++i) {
    row_scale[i] = sequence[i] >= 0 ? static_cast<T>(scale[sequence[i]]) : T(0);
  }
}

}  // namespace megatrain::ref
