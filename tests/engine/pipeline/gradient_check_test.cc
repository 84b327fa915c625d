// Analytic gradients of the whole model (embedding, every decoder tensor, final norm,
// lm_head, tied or not) equal central finite differences, in double precision.
#include <cmath>
#include <random>

#include "gtest/gtest.h"
#include "tests/engine/pipeline/direct_model.h"

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

INSTANTIATE_TEST_SUITE_P(Variants, GradientCheck,
                         ::testing::Values(Variant::kLlamaTiedGqa, Variant::kQwen2UntiedBias,
                                           Variant::kQwen3QkNorm, Variant::kLlama3RopeMha,
                                           Variant::kQwen3MoeMixedLayers,
                                           Variant::kMixtralRenormalised,
                                           Variant::kGptOssSinksWindow),
                         VariantName<::testing::TestParamInfo<Variant>>);

}  // namespace
}  // namespace megatrain::testing
