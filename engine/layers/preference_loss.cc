#include "engine/layers/preference_loss.h"

#include <algorithm>
#include <cmath>

#include "engine/common/check.h"

namespace megatrain {
namespace {

// log sigmoid(x) = -softplus(-x), without overflow for any finite x.
double LogSigmoid(double x) { return -(std::max(-x, 0.0) + std::log1p(std::exp(-std::fabs(x)))); }

double Sigmoid(double x) {
  return x >= 0 ? 1.0 / (1.0 + std::exp(-x)) : std::exp(x) / (1.0 + std::exp(x));
}

// One pair's loss and its derivatives by pi_c and pi_r.
struct PairLoss {
  double loss, d_chosen, d_rejected;
};

PairLoss Pair(const PreferenceOptions& o, const PairLogps& p) {
  const double chosen_ratio = p.chosen - p.ref_chosen;
  const double rejected_ratio = p.rejected - p.ref_rejected;
  const double delta = chosen_ratio - rejected_ratio;
  const double beta = o.beta;
  switch (o.loss) {
    case PreferenceLoss::kSigmoid: {
      const double eps = o.label_smoothing, x = beta * delta;
      const double loss = -(1 - eps) * LogSigmoid(x) - eps * LogSigmoid(-x);
      const double d = beta * (-(1 - eps) * Sigmoid(-x) + eps * Sigmoid(x));  // dL/ddelta
      return {loss, d, -d};
    }
    case PreferenceLoss::kIpo: {
      const double nc = std::max<double>(static_cast<double>(p.chosen_tokens), 1.0);
      const double nr = std::max<double>(static_cast<double>(p.rejected_tokens), 1.0);
      const double gap = chosen_ratio / nc - rejected_ratio / nr - 1.0 / (2.0 * beta);
      return {gap * gap, 2.0 * gap / nc, -2.0 * gap / nr};
    }
    case PreferenceLoss::kHinge: {
      const double margin = 1.0 - beta * delta;
      const double d = margin > 0 ? -beta : 0.0;
      return {std::max(margin, 0.0), d, -d};
    }
  }
  MT_CHECK_MSG(false, "unknown preference loss %d", static_cast<int>(o.loss));
  return {};
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
    const PairLoss l = Pair(options, p);
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
