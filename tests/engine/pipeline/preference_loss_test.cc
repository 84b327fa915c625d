// The DPO losses (layers/preference_loss.h) against their definitions written out here
// from the papers and TRL's code, their coefficients against central differences of the
// step's loss, and TRL's metrics.
#include "engine/layers/preference_loss.h"

#include <cmath>
#include <cstdint>
#include <vector>

#include "engine/kernels/reference/preference.h"

#include "gtest/gtest.h"

namespace megatrain {
namespace {

std::vector<PairLogps> TwoPairs() {
  PairLogps a;  // the policy prefers chosen more than the reference does
  a.chosen = -12.0, a.rejected = -15.0, a.ref_chosen = -13.0, a.ref_rejected = -14.5;
  a.chosen_tokens = 6, a.rejected_tokens = 9;
  PairLogps b;  // and here less
  b.chosen = -20.0, b.rejected = -18.0, b.ref_chosen = -19.0, b.ref_rejected = -18.5;
  b.chosen_tokens = 11, b.rejected_tokens = 4;
  return {a, b};
}

TEST(PreferenceLoss, SigmoidIsThePapersLossWithTrlsMetrics) {
  PreferenceOptions o;
  o.beta = 0.3;
  const std::vector<PairLogps> pairs = TwoPairs();
  const PreferenceStep step = ComputePreferenceStep(o, pairs);
  // delta_a = (1) - (-0.5) = 1.5; delta_b = (-1) - (0.5) = -1.5
  const double la = std::log(1 + std::exp(-0.3 * 1.5)), lb = std::log(1 + std::exp(0.3 * 1.5));
  EXPECT_NEAR(step.metrics.loss, (la + lb) / 2, 1e-14);
  EXPECT_NEAR(step.metrics.rewards_chosen, 0.3 * (1.0 + -1.0) / 2, 1e-14);
  EXPECT_NEAR(step.metrics.rewards_rejected, 0.3 * (-0.5 + 0.5) / 2, 1e-14);
  EXPECT_NEAR(step.metrics.rewards_margins, 0.3 * (1.5 - 1.5) / 2, 1e-14);
  EXPECT_EQ(step.metrics.rewards_accuracies, 0.5);
  EXPECT_EQ(step.metrics.logps_chosen, -16.0);
  EXPECT_EQ(step.metrics.logps_rejected, -16.5);
  EXPECT_EQ(step.metrics.pairs, 2);
}

TEST(PreferenceLoss, IpoAndHingeAreTrlsDefinitions) {
  const std::vector<PairLogps> pairs = TwoPairs();
  PreferenceOptions o;
  o.beta = 0.5;
  o.loss = PreferenceLoss::kIpo;  // each log-ratio over its completion's length
  const double ga = 1.0 / 6 - (-0.5) / 9 - 1.0, gb = -1.0 / 11 - 0.5 / 4 - 1.0;
  EXPECT_NEAR(ComputePreferenceStep(o, pairs).metrics.loss, (ga * ga + gb * gb) / 2, 1e-14);
  o.loss = PreferenceLoss::kHinge;
  o.beta = 0.9;  // max(0, 1 - 0.9 * 1.5) = 0 and max(0, 1 + 0.9 * 1.5) = 2.35
  EXPECT_NEAR(ComputePreferenceStep(o, pairs).metrics.loss, 2.35 / 2, 1e-14);
}

// d(step loss) / d pi of each sequence, for each loss, label smoothing and the RPO term.
TEST(PreferenceLoss, CoefficientsAreTheStepLossDerivativesByEachSequencesLogp) {
  struct Case {
    PreferenceLoss loss;
    double beta, smoothing, rpo;
  };
  for (const Case c : {Case{PreferenceLoss::kSigmoid, 0.3, 0.0, 0.0},
                       Case{PreferenceLoss::kSigmoid, 0.3, 0.2, 0.5},
                       Case{PreferenceLoss::kIpo, 0.5, 0.0, 0.0},
                       Case{PreferenceLoss::kHinge, 0.3, 0.0, 1.0}}) {
    PreferenceOptions o;
    o.loss = c.loss, o.beta = c.beta, o.label_smoothing = c.smoothing, o.rpo_alpha = c.rpo;
    const std::vector<PairLogps> pairs = TwoPairs();
    const PreferenceStep step = ComputePreferenceStep(o, pairs);
    const double h = 1e-6;
    for (size_t k = 0; k < pairs.size(); ++k) {
      for (const bool chosen : {true, false}) {
        std::vector<PairLogps> up = pairs, down = pairs;
        (chosen ? up[k].chosen : up[k].rejected) += h;
        (chosen ? down[k].chosen : down[k].rejected) -= h;
        const double numeric = (ComputePreferenceStep(o, up).metrics.loss -
                                ComputePreferenceStep(o, down).metrics.loss) / (2 * h);
        const double analytic = chosen ? step.chosen_coef[k] + step.rpo_token_coef
                                        : step.rejected_coef[k];
        EXPECT_NEAR(analytic, numeric, 1e-8)
            << PreferenceLossName(c.loss) << " smoothing " << c.smoothing << " rpo " << c.rpo
            << " pair " << k << (chosen ? " chosen" : " rejected");
      }
    }
  }
}

// The device op's reference: from a micro-batch's per-token -log p (both pairs' tokens
// interleaved with padding, and a pair's tokens not adjacent), each token's row_scale is
// minus the step's derivative by its log-probability: the coefficients of
// ComputePreferenceStep over the same sums.
TEST(PreferenceLoss, RowScaleIsMinusEachTokensCoefficientFromTheSequencesSums) {
  const std::vector<PairLogps> pairs = TwoPairs();
  // Token i of sequence s carries -log p = -(pi_s) / length_s, so each sum is pi_s.
  const std::vector<int32_t> sequence = {-1, 0, 0, 1, 0, 1, 1, -1, 2, 3, 2, 3, 0, 1, -1};
  std::vector<double> pi(4), length(4, 0.0);
  for (int k = 0; k < 2; ++k) pi[2 * k] = pairs[k].chosen, pi[2 * k + 1] = pairs[k].rejected;
  for (const int32_t s : sequence) length[s < 0 ? 0 : s] += s < 0 ? 0 : 1;
  std::vector<double> values(sequence.size(), 7.0);  // padding's values are never read
  for (size_t i = 0; i < sequence.size(); ++i) {
    if (sequence[i] >= 0) values[i] = -pi[sequence[i]] / length[sequence[i]];
  }
  for (const PreferenceLoss loss :
       {PreferenceLoss::kSigmoid, PreferenceLoss::kIpo, PreferenceLoss::kHinge}) {
    PreferenceOptions o;
    o.loss = loss, o.beta = 0.3, o.label_smoothing = loss == PreferenceLoss::kSigmoid ? 0.1 : 0;
    o.rpo_alpha = 0.5;
    const PreferenceStep step = ComputePreferenceStep(o, pairs);
    std::vector<double> info(4 * kPrefFields);
    for (int k = 0; k < 2; ++k) {
      double* c = &info[2 * k * kPrefFields];
      double* r = c + kPrefFields;
      c[kPrefRefLogp] = pairs[k].ref_chosen, r[kPrefRefLogp] = pairs[k].ref_rejected;
      c[kPrefTokens] = static_cast<double>(pairs[k].chosen_tokens);
      r[kPrefTokens] = static_cast<double>(pairs[k].rejected_tokens);
      c[kPrefPairWeight] = r[kPrefPairWeight] = 1.0 / 2;
      c[kPrefNllWeight] = -step.rpo_token_coef;  // rpo_alpha / the step's chosen tokens
      r[kPrefNllWeight] = 0;
    }
    std::vector<double> row_scale(sequence.size(), 99.0);
    ref::PreferenceRowScale<double>(row_scale.data(), values.data(), sequence.data(),
                                    info.data(), static_cast<int64_t>(sequence.size()), 4, o.loss,
                                    o.beta, o.label_smoothing);
    for (size_t i = 0; i < sequence.size(); ++i) {
      const int32_t s = sequence[i];
      const double want = s < 0        ? 0.0
                          : s % 2 == 0 ? -(step.chosen_coef[s / 2] + step.rpo_token_coef)
                                       : -step.rejected_coef[s / 2];
      EXPECT_NEAR(row_scale[i], want, 1e-13) << PreferenceLossName(loss) << " token " << i;
    }
  }
}

TEST(PreferenceLoss, RpoAddsTheChosenTokensMeanNll) {
  PreferenceOptions o;
  const std::vector<PairLogps> pairs = TwoPairs();
  const double without = ComputePreferenceStep(o, pairs).metrics.loss;
  o.rpo_alpha = 0.25;
  const PreferenceStep step = ComputePreferenceStep(o, pairs);
  EXPECT_NEAR(step.metrics.loss - without, 0.25 * (12.0 + 20.0) / 17, 1e-14);
  EXPECT_NEAR(step.rpo_token_coef, -0.25 / 17, 1e-15);
}

TEST(PreferenceLoss, HugeMarginsStayFinite) {
  PairLogps p;
  p.chosen = 0, p.rejected = -1e6;
  for (const double sign : {1.0, -1.0}) {
    std::swap(p.chosen, p.rejected);
    PreferenceOptions o;
    o.label_smoothing = 0.1 * (sign > 0);
    const PreferenceStep step = ComputePreferenceStep(o, {p});
    EXPECT_TRUE(std::isfinite(step.metrics.loss) && std::isfinite(step.chosen_coef[0]))
        << sign;
  }
}

TEST(PreferenceLoss, NamesAreTrlsLossTypes) {
  PreferenceLoss loss;
  for (const char* name : {"sigmoid", "ipo", "hinge"}) {
    ASSERT_TRUE(ParsePreferenceLoss(name, &loss)) << name;
    EXPECT_STREQ(PreferenceLossName(loss), name);
  }
  EXPECT_FALSE(ParsePreferenceLoss("robust", &loss));
}

}  // namespace
}  // namespace megatrain
