// One preference pair's loss and its derivatives by the pair's two summed
// log-probabilities (layers/preference_loss.h has the definitions and their sources): the
// arithmetic the host's step metrics and the backends' PreferenceRowScale share, written
// once for the host and for CUDA device code (no library beyond <cmath>).
#pragma once

#include <cmath>
#include <cstdint>

#include "engine/common/host_device.h"

namespace megatrain {

enum class PreferenceLoss : int32_t { kSigmoid, kIpo, kHinge };

struct PairLossTerms {
  double loss = 0, d_chosen = 0, d_rejected = 0;  // and d loss / d pi_c, d loss / d pi_r
};

// log sigmoid(x) = -softplus(-x), without overflow for any finite x.
MT_HOST_DEVICE inline double PreferenceLogSigmoid(double x) {
  return -(fmax(-x, 0.0) + log1p(exp(-fabs(x))));
}

MT_HOST_DEVICE inline double PreferenceSigmoid(double x) {
  return x >= 0 ? 1.0 / (1.0 + exp(-x)) : exp(x) / (1.0 + exp(x));
}

// chosen_ratio = pi_c - ref_c, rejected_ratio = pi_r - ref_r; chosen_tokens and
// rejected_tokens the completions' lengths (IPO's normalisation; at least 1 is used).
MT_HOST_DEVICE inline PairLossTerms PreferencePairTerms(PreferenceLoss kind, double beta,
                                                        double label_smoothing,
                                                        double chosen_ratio,
                                                        double rejected_ratio,
                                                        double chosen_tokens,
                                                        double rejected_tokens) {
  PairLossTerms t;
  const double delta = chosen_ratio - rejected_ratio;
  if (kind == PreferenceLoss::kSigmoid) {
    const double eps = label_smoothing, x = beta * delta;
    t.loss = -(1 - eps) * PreferenceLogSigmoid(x) - eps * PreferenceLogSigmoid(-x);
    t.d_chosen = beta * (-(1 - eps) * PreferenceSigmoid(-x) + eps * PreferenceSigmoid(x));
    t.d_rejected = -t.d_chosen;
  } else if (kind == PreferenceLoss::kIpo) {
    const double nc = fmax(chosen_tokens, 1.0), nr = fmax(rejected_tokens, 1.0);
    const double gap = chosen_ratio / nc - rejected_ratio / nr - 1.0 / (2.0 * beta);
    t.loss = gap * gap;
    t.d_chosen = 2.0 * gap / nc;
    t.d_rejected = -2.0 * gap / nr;
  } else {  // hinge
    const double margin = 1.0 - beta * delta;
    t.loss = fmax(margin, 0.0);
    t.d_chosen = margin > 0 ? -beta : 0.0;
    t.d_rejected = -t.d_chosen;
  }
  return t;
}

// What PreferenceRowScale reads per sequence of a micro-batch: a row of four doubles.
enum PreferenceSequenceField : int {
  kPrefRefLogp = 0,     // the reference's summed log-probability (0: reference-free)
  kPrefTokens = 1,      // the completion's token count
  kPrefPairWeight = 2,  // d(step loss) / d(the pair's loss): 1 / the step's pairs
  kPrefNllWeight = 3,   // each token's -log p weight in the step loss (RPO on a chosen
                        // completion: rpo_alpha / the step's chosen tokens; else 0)
  kPrefFields = 4,
};

// The most sequences (2 per pair) one micro-batch may hold under a preference loss.
constexpr int64_t kMaxPreferenceSequences = 4096;

}  // namespace megatrain
