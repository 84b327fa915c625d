#include "engine/layers/preference_loss.h"

#include <algorithm>
#include <cmath>

#include "engine/common/check.h"

namespace megatrain {
namespace {

PairLossTerms Pair(const PreferenceOptions& o, const PairLogps& p) {
  return PreferencePairTerms(o.loss, o.beta, o.label_smoothing, p.chosen - p.ref_chosen,
                             p.rejected - p.ref_rejected, static_cast<double>(p.chosen_tokens),
                             static_cast<double>(p.rejected_tokens));
}

}  // namespace

bool ParsePreferenceLoss(const std::string& name, PreferenceLoss* out) {
  for (const PreferenceLoss loss :
       {PreferenceLoss::kSigmoid, PreferenceLoss::kIpo, PreferenceLoss::kHinge}) {
    if (name == PreferenceLossName(loss)) {
      *out = loss;
      return true;
    }
  }
  return false;
}

const char* PreferenceLossName(PreferenceLoss loss) {
  switch (loss) {
    case PreferenceLoss::kSigmoid: return "sigmoid";
    case PreferenceLoss::kIpo: return "ipo";
    case PreferenceLoss::kHinge: return "hinge";
  }
  return "?";
}

PreferenceStep ComputePreferenceStep(const PreferenceOptions& options,
                                     const std::vector<PairLogps>& pairs) {
  MT_CHECK(!pairs.empty());
  MT_CHECK(options.beta > 0 && options.label_smoothing >= 0 && options.label_smoothing < 0.5 &&
           options.rpo_alpha >= 0);
  const double n = static_cast<double>(pairs.size());
  PreferenceStep step;
  PreferenceMetrics& m = step.metrics;
  m.pairs = static_cast<int64_t>(pairs.size());
  int64_t chosen_tokens = 0;
  double chosen_logps = 0;
  for (const PairLogps& p : pairs) {
    const PairLossTerms l = Pair(options, p);
    m.loss += l.loss / n;
    step.chosen_coef.push_back(l.d_chosen / n);
    step.rejected_coef.push_back(l.d_rejected / n);
    const double reward_c = options.beta * (p.chosen - p.ref_chosen);
    const double reward_r = options.beta * (p.rejected - p.ref_rejected);
    m.rewards_chosen += reward_c / n;
    m.rewards_rejected += reward_r / n;
    m.rewards_accuracies += (reward_c > reward_r ? 1.0 : 0.0) / n;
    m.logps_chosen += p.chosen / n;
    m.logps_rejected += p.rejected / n;
    chosen_tokens += p.chosen_tokens;
    chosen_logps += p.chosen;
  }
  m.rewards_margins = m.rewards_chosen - m.rewards_rejected;
  if (options.rpo_alpha > 0 && chosen_tokens > 0) {  // alpha * mean -log p over chosen tokens
    const double tokens = static_cast<double>(chosen_tokens);
    m.loss += options.rpo_alpha * -chosen_logps / tokens;
    step.rpo_token_coef = -options.rpo_alpha / tokens;
  }
  return step;
}

}  // namespace megatrain
