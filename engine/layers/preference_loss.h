// Direct preference optimization's losses over a step's pairs (Rafailov et al. 2023, arXiv
// 2305.18290), on the per-sequence log-probabilities the head sums: the value, the metrics
// TRL reports, and the coefficient that carries the loss back to each sequence's tokens.
//
// A pair k is a prompt with a chosen and a rejected completion. Its policy log-probability
// pi_c, pi_r is the sum of log p(y_t) over the completion's tokens, ref_c, ref_r the same
// under the reference (the starting weights; 0 when reference-free). With
//   delta_k = (pi_c - ref_c) - (pi_r - ref_r),
// the losses, as TRL defines them (trl/trainer/dpo_trainer.py), are
//   sigmoid  -(1 - eps) log sigmoid(beta delta) - eps log sigmoid(-beta delta)
//            (eps = label_smoothing: conservative DPO; eps 0 is the paper's loss)
//   ipo      (delta' - 1 / (2 beta))^2, delta' the log-ratios each divided by its
//            completion's token count (IPO, Azar et al. 2023, as TRL normalises it)
//   hinge    max(0, 1 - beta delta)  (SLiC, Zhao et al. 2023)
// averaged over the step's pairs, plus rpo_alpha times the mean -log p(y_t) over every
// chosen completion token of the step (RPO, Pang et al. 2024; 0: none).
//
// The gradient reaches the model through each token's log-probability: a completion
// token of pair k's chosen sequence gets d(step loss)/d log p(y_t) = g_chosen[k] (the
// same for every token of it: the loss depends on their sum) plus -rpo_alpha / (the
// step's chosen tokens); a rejected one g_rejected[k]. The head turns such a coefficient
// c into dL/dlogits = c (onehot(y_t) - softmax) for that token.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/common/preference_math.h"  // PreferenceLoss, the pair's arithmetic

namespace megatrain {

// "sigmoid", "ipo", "hinge" (TRL's loss_type names).
[[nodiscard]] bool ParsePreferenceLoss(const std::string& name, PreferenceLoss* out);
const char* PreferenceLossName(PreferenceLoss loss);

struct PreferenceOptions {
  double beta = 0.1;             // the KL penalty's weight (IPO: its regularisation tau)
  PreferenceLoss loss = PreferenceLoss::kSigmoid;
  double label_smoothing = 0;    // sigmoid only: the chance a label is flipped, in [0, 0.5)
  double rpo_alpha = 0;          // the weight of the chosen completions' NLL (0: none)
};

// One pair's summed log-probabilities and completion lengths (tokens with a loss).
struct PairLogps {
  double chosen = 0, rejected = 0;          // the policy's
  double ref_chosen = 0, ref_rejected = 0;  // the reference's (0: reference-free)
  int64_t chosen_tokens = 0, rejected_tokens = 0;
};

// A step's loss and what TRL logs under these names, each a mean over the step's pairs.
struct PreferenceMetrics {
  double loss = 0;                // the DPO term plus the RPO term
  double rewards_chosen = 0;      // rewards/chosen: beta (pi_c - ref_c)
  double rewards_rejected = 0;    // rewards/rejected: beta (pi_r - ref_r)
  double rewards_accuracies = 0;  // rewards/accuracies: the share with chosen > rejected
  double rewards_margins = 0;     // rewards/margins: rewards/chosen - rewards/rejected
  double logps_chosen = 0;        // logps/chosen: pi_c
  double logps_rejected = 0;      // logps/rejected: pi_r
  int64_t pairs = 0;
};

struct PreferenceStep {
  PreferenceMetrics metrics;
  // Per pair: d(step loss) / d pi_c and d pi_r (the DPO term's), and the RPO term's
  // coefficient on each chosen token's log-probability (the same for all of the step's).
  std::vector<double> chosen_coef, rejected_coef;
  double rpo_token_coef = 0;
};

// The step's loss, metrics and coefficients over `pairs` (at least one).
// REQUIRES: options valid (beta > 0; 0 <= label_smoothing < 0.5; rpo_alpha >= 0).
PreferenceStep ComputePreferenceStep(const PreferenceOptions& options,
                                     const std::vector<PairLogps>& pairs);

}  // namespace megatrain
