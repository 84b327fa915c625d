// Analytic gradients of the whole model (embedding, every decoder tensor, final norm,
// lm_head, tied or not) equal central finite differences, in double precision.
#include <cmath>
#include <random>

#include "engine/layers/preference_loss.h"
#include "gtest/gtest.h"
#include "tests/engine/pipeline/direct_model.h"
#include "tests/engine/pipeline/preference_batch.h"

namespace megatrain::testing {
namespace {

class GradientCheck : public ::testing::TestWithParam<Variant> {};

TEST_P(GradientCheck, AnalyticGradientsEqualCentralDifferencesForEveryTensor) {
  const ModelConfig c = TinyConfig(GetParam());
  std::unique_ptr<Backend> be =
      CreateCpuBackend(CpuBackendOptions{CpuBackendOptions::Precision::kF64});
  const MicroBatch batch = RandomBatch(2, 9, c.vocab_size, 17);
  DirectModel model(c, be.get(), batch.tokens.size());
  std::mt19937_64 gen(3);
  std::normal_distribution<double> normal(0.0, 0.3);
  for (size_t u = 0; u < model.layout().units.size(); ++u) {
    for (const TensorSlot& t : model.layout().units[u].tensors) {
      for (int64_t i = 0; i < t.num_elements; ++i) {
        // Norm weights near 1, everything else random: no structurally zero gradients.
        const bool norm = t.shape.size() == 1 && t.name.find("bias") == std::string::npos;
        model.Set(u, t.offset + i, (norm ? 1.0 : 0.0) + normal(gen));
      }
    }
  }
  std::vector<std::vector<double>> grads;
  model.Run(batch, &grads);

  const double h = 1e-5;
  int checked = 0;
  for (size_t u = 0; u < model.layout().units.size(); ++u) {
    for (const TensorSlot& t : model.layout().units[u].tensors) {
      // Six elements per tensor, spread over it.
      for (int k = 0; k < 6; ++k) {
        const int64_t i = t.offset + (k * 7919) % t.num_elements;
        const double numeric = model.CentralDifference(batch, u, i, h);
        const double analytic = grads[u][i];
        EXPECT_NEAR(analytic, numeric, 1e-7 + 1e-5 * std::fabs(numeric))
            << t.name << "[" << i - t.offset << "]";
        ++checked;
      }
    }
  }
  EXPECT_GT(checked, 60);
}

// The DPO step's loss as the host computes it (preference_loss.h) from a forward's
// per-token values, plus the weighted load-balancing loss of MoE models.
double PreferenceLossOf(const DirectModel& model, const PairBatch& b,
                        const PreferenceOptions& o, double aux_coef) {
  const std::vector<double> logps = SequenceLogps(b, model.last_token_values().data());
  std::vector<PairLogps> pairs(b.pairs());
  for (int64_t k = 0; k < b.pairs(); ++k) {
    const double* c = &b.batch.sequence_info[2 * k * kPrefFields];
    pairs[k] = PairLogps{logps[2 * k], logps[2 * k + 1], c[kPrefRefLogp],
                         c[kPrefFields + kPrefRefLogp], b.completion_tokens[2 * k],
                         b.completion_tokens[2 * k + 1]};
  }
  return ComputePreferenceStep(o, pairs).metrics.loss + aux_coef * model.last_aux_loss();
}

class PreferenceGradientCheck : public ::testing::TestWithParam<Variant> {};

// The preference objective's gradients (the head's two sweeps, the coefficients on the
// device, the layers' backward) are the derivatives of the DPO loss the host computes from
// the same forward: central differences, each loss kind, RPO and label smoothing on.
TEST_P(PreferenceGradientCheck, GradientsAreTheDpoLossDerivativesForEveryLoss) {
  const ModelConfig c = TinyConfig(GetParam());
  std::unique_ptr<Backend> be =
      CreateCpuBackend(CpuBackendOptions{CpuBackendOptions::Precision::kF64});
  for (const PreferenceLoss loss :
       {PreferenceLoss::kSigmoid, PreferenceLoss::kIpo, PreferenceLoss::kHinge}) {
    PreferenceOptions o;
    o.loss = loss, o.beta = 0.05, o.rpo_alpha = 0.3;
    o.label_smoothing = loss == PreferenceLoss::kSigmoid ? 0.1 : 0.0;
    ObjectiveOptions objective;
    objective.kind = ObjectiveKind::kPreference;
    objective.preference_loss = o.loss, objective.beta = o.beta;
    objective.label_smoothing = o.label_smoothing;
    PairBatch b = TwoPackedPairs(c.vocab_size, 0);
    AttachSequences({-9.5, -7.0, -11.0, -12.5}, 0.5,
                    o.rpo_alpha / static_cast<double>(ChosenTokens(b)), &b);
    DirectModel model(c, be.get(), b.batch.tokens.size(), BuildLayout(c), objective);
    std::mt19937_64 gen(5);
    std::normal_distribution<double> normal(0.0, 0.3);
    for (size_t u = 0; u < model.layout().units.size(); ++u) {
      for (const TensorSlot& t : model.layout().units[u].tensors) {
        const bool norm = t.shape.size() == 1 && t.name.find("bias") == std::string::npos;
        for (int64_t i = 0; i < t.num_elements; ++i) {
          model.Set(u, t.offset + i, (norm ? 1.0 : 0.0) + normal(gen));
        }
      }
    }
    const double aux_coef = c.moe.TrainedAuxLossCoef();
    std::vector<std::vector<double>> grads;
    model.Run(b.batch, &grads);
    const double h = 1e-5;
    for (size_t u = 0; u < model.layout().units.size(); ++u) {
      for (const TensorSlot& t : model.layout().units[u].tensors) {
        for (int k = 0; k < 3; ++k) {
          const int64_t i = t.offset + (k * 7919) % t.num_elements;
          const double w = model.Get(u, i);
          model.Set(u, i, w + h);
          model.Run(b.batch, nullptr);
          const double up = PreferenceLossOf(model, b, o, aux_coef);
          model.Set(u, i, w - h);
          model.Run(b.batch, nullptr);
          const double down = PreferenceLossOf(model, b, o, aux_coef);
          model.Set(u, i, w);
          const double numeric = (up - down) / (2 * h);
          EXPECT_NEAR(grads[u][i], numeric, 1e-7 + 1e-5 * std::fabs(numeric))
              << PreferenceLossName(loss) << " " << t.name << "[" << i - t.offset << "]";
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Variants, PreferenceGradientCheck,
                         ::testing::Values(Variant::kQwen2UntiedBias,
                                           Variant::kQwen3MoeMixedLayers),
                         VariantName<::testing::TestParamInfo<Variant>>);

INSTANTIATE_TEST_SUITE_P(Variants, GradientCheck,
                         ::testing::Values(Variant::kLlamaTiedGqa, Variant::kQwen2UntiedBias,
                                           Variant::kQwen3QkNorm, Variant::kLlama3RopeMha,
                                           Variant::kQwen3MoeMixedLayers,
                                           Variant::kMixtralRenormalised,
                                           Variant::kGptOssSinksWindow),
                         VariantName<::testing::TestParamInfo<Variant>>);

}  // namespace
}  // namespace megatrain::testing
