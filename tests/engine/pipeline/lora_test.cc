// LoRA adapters in the layer kinds (model/lora.h), in double precision: the adapted model
// is the model with merged weights W + scale B A, and the adapters' analytic gradients
// equal central finite differences, on every projection of the dense families and the
// attention and experts of the MoE ones (GPT-OSS's input-major experts included).
#include <algorithm>
#include <cmath>
#include <random>

#include "engine/model/lora.h"
#include "engine/plan/step_memory.h"
#include "gtest/gtest.h"
#include "tests/engine/pipeline/direct_model.h"

namespace megatrain::testing {
namespace {

class LoraLayers : public ::testing::TestWithParam<Variant> {
 protected:
  // Every weight random (norms near 1, B too: the adapters contribute).
  static void Randomize(DirectModel* model, uint64_t seed) {
    std::mt19937_64 gen(seed);
    std::normal_distribution<double> normal(0.0, 0.3);
    for (size_t u = 0; u < model->layout().units.size(); ++u) {
      for (const TensorSlot& t : model->layout().units[u].tensors) {
        const bool norm = t.shape.size() == 1 && t.name.find("bias") == std::string::npos;
        for (int64_t i = 0; i < t.num_elements; ++i) {
          model->Set(u, t.offset + i, (norm ? 1.0 : 0.0) + normal(gen));
        }
      }
    }
  }
  // Every projection; in an MoE model the attention's and the experts' (a dense MLP layer
  // of a mixed one: its attention alone).
  static LoraConfig Lora(const ModelConfig& c, double alpha, bool rslora) {
    LoraConfig lora;
    lora.rank = 2;
    lora.alpha = alpha;
    lora.rslora = rslora;
    if (c.is_moe()) {
      lora.target_modules = {"q_proj", "k_proj", "v_proj", "o_proj", "experts.gate_up_proj",
                             "experts.down_proj"};
    }
    return lora;
  }
  // The adapted projections of the model.
  static int Targets(const ModelConfig& c) {
    int n = 0;
    for (int64_t l = 0; l < c.num_layers; ++l) n += !c.is_moe() ? 7 : c.IsMoeLayer(l) ? 6 : 4;
    return n;
  }
};

// W += scale B A for one adapter of `adapted`, into `merged` (the same base layout): per
// expert for an experts' adapter, transposed into GPT-OSS's input-major experts.
void MergeAdapter(const DirectModel& adapted, const UnitLayout& unit, size_t u,
                  const TensorSlot& a, double scale, DirectModel* merged) {
  const TensorSlot& b = *unit.FindLora(a.base_role, TensorRole::kLoraB);
  const TensorSlot& w = *unit.Find(a.base_role);  // an experts' tensor: expert 0's
  const bool in_major =
      a.base_role == TensorRole::kExpertGateUpT || a.base_role == TensorRole::kExpertDownT;
  const int64_t E = std::max<int64_t>(LoraExperts(a), 1);
  const int64_t r = LoraRank(a), in = a.shape.back(), out = b.shape[b.shape.size() - 2];
  for (int64_t e = 0; e < E; ++e) {
    const int64_t a0 = a.offset + e * r * in, b0 = b.offset + e * out * r;
    const int64_t w0 = w.offset + e * out * in;
    for (int64_t o = 0; o < out; ++o) {
      for (int64_t i = 0; i < in; ++i) {
        double sum = 0;
        for (int64_t j = 0; j < r; ++j) {
          sum += adapted.Get(u, b0 + o * r + j) * adapted.Get(u, a0 + j * in + i);
        }
        const int64_t at = w0 + (in_major ? i * out + o : o * in + i);
        merged->Set(u, at, merged->Get(u, at) + scale * sum);
      }
    }
  }
}

TEST_P(LoraLayers, TheAdaptedModelIsTheModelWithMergedWeights) {
  const ModelConfig c = TinyConfig(GetParam());
  std::unique_ptr<Backend> be =
      CreateCpuBackend(CpuBackendOptions{CpuBackendOptions::Precision::kF64});
  const MicroBatch batch = RandomBatch(2, 9, c.vocab_size, 17);
  for (const bool rslora : {false, true}) {
    const LoraConfig lora = Lora(c, 3.0, rslora);
    ModelLayout layout = BuildLayout(c);
    ASSERT_TRUE(AddLoraAdapters(lora, c, &layout).ok());
    DirectModel adapted(c, be.get(), batch.tokens.size(), layout);
    DirectModel merged(c, be.get(), batch.tokens.size());
    Randomize(&adapted, 5);
    int adapters = 0;
    for (size_t u = 0; u < layout.units.size(); ++u) {
      const UnitLayout& unit = layout.units[u];
      for (const TensorSlot& t : merged.layout().units[u].tensors) {  // the base as it is
        for (int64_t i = 0; i < t.num_elements; ++i) {
          merged.Set(u, t.offset + i, adapted.Get(u, t.offset + i));
        }
      }
      for (const TensorSlot& a : unit.tensors) {  // W += scale B A
        if (a.role != TensorRole::kLoraA) continue;
        ++adapters;
        MergeAdapter(adapted, unit, u, a, lora.Scale(), &merged);
      }
    }
    EXPECT_EQ(adapters, Targets(c));
    const double want = merged.Run(batch, nullptr), got = adapted.Run(batch, nullptr);
    EXPECT_NEAR(got, want, 1e-12 * std::fabs(want)) << "rslora " << rslora;
  }
}

TEST_P(LoraLayers, AdapterGradientsEqualCentralDifferences) {
  const ModelConfig c = TinyConfig(GetParam());
  std::unique_ptr<Backend> be =
      CreateCpuBackend(CpuBackendOptions{CpuBackendOptions::Precision::kF64});
  const MicroBatch batch = RandomBatch(2, 9, c.vocab_size, 17);
  ModelLayout layout = BuildLayout(c);
  ASSERT_TRUE(AddLoraAdapters(Lora(c, 4.0, false), c, &layout).ok());
  DirectModel model(c, be.get(), batch.tokens.size(), layout);
  Randomize(&model, 7);
  std::vector<std::vector<double>> grads;
  model.Run(batch, &grads);
  const double h = 1e-5;
  int checked = 0;
  for (size_t u = 0; u < layout.units.size(); ++u) {
    for (const TensorSlot& t : layout.units[u].tensors) {
      if (!IsLora(t)) continue;
      for (int k = 0; k < 4; ++k) {
        const int64_t i = t.offset + (k * 7919) % t.num_elements;
        const double numeric = model.CentralDifference(batch, u, i, h);
        EXPECT_NEAR(grads[u][i], numeric, 1e-7 + 1e-5 * std::fabs(numeric))
            << t.name << "[" << i - t.offset << "]";
        ++checked;
      }
    }
  }
  EXPECT_EQ(checked, 4 * 2 * Targets(c));
}

// The device holds the gradients of the adapters alone: a layer's gradient buffers are its
// adapters' size, the frozen embedding and head have none (on a GPU box this is tens of
// GB for the largest models).
TEST(LoraDeviceMemory, GradientBuffersHoldTheAdaptersAlone) {
  const ModelConfig c = TinyConfig(Variant::kQwen2UntiedBias);
  std::unique_ptr<Backend> be = CreateCpuBackend(CpuBackendOptions{});
  LoraConfig lora;
  lora.rank = 2;
  lora.alpha = 4;
  ModelLayout layout = BuildLayout(c);
  ASSERT_TRUE(AddLoraAdapters(lora, c, &layout).ok());
  PipelineOptions o;
  o.micro_batches = 1;
  o.tokens_per_micro_batch = 16;
  o.checkpoint_every = 1;
  o.loss_chunk_tokens = 8;
  const LayerKinds kinds = MakeLayerKinds(c, layout, be.get());
  const LossHead head(c, layout, be.get(), 8, MakeObjective(ObjectiveKind::kNextTokenCrossEntropy,
                                                            be.get()));
  const StepMemory m = SizeStepMemory(c, layout, be.get(), o, kinds, head);
  const auto [begin, end] = layout.units[layout.DecoderUnit(0)].StateRange();
  EXPECT_EQ(m.layer_grad, (end - begin) * 4);  // f32 gradients on the CPU backend
  EXPECT_LT(m.layer_grad, layout.MaxDecoderElements() * 4 / 3);
  EXPECT_EQ(m.embedding_grad, 0);
  EXPECT_EQ(m.head_grad, 0);
  EXPECT_EQ(m.grad_discard, GradDiscardElements(layout) * 4);
}

// With lora, train.freeze may freeze more of the base, never the adapters (their backward
// needs their gradients): a pattern that names one is refused naming it.
TEST(LoraLayout, FreezingAnAdapterIsRefusedNamingThePattern) {
  const ModelConfig c = TinyConfig(Variant::kLlamaTiedGqa);
  LoraConfig lora;
  lora.rank = 2;
  lora.alpha = 4;
  EXPECT_TRUE(TrainingLayout(c, lora, {"model.norm", "embed_tokens"}).ok());
  absl::StatusOr<ModelLayout> bad = TrainingLayout(c, lora, {"embed_tokens", "layers.0"});
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("train.freeze[1] 'layers.0' freezes the LoRA adapter "
                                        "model.layers.0.self_attn.q_proj.lora_A.weight"),
            std::string::npos)
      << bad.status();
}

// The experts are adapted by their own names, only where there are experts; an MLP name on
// a model whose MLPs are all experts points to them; a rank beyond an expert's smaller
// side names it.
TEST(LoraLayout, ExpertTargetsAreCheckedAgainstTheModel) {
  LoraConfig lora;
  lora.rank = 2;
  lora.alpha = 4;
  auto error = [&](Variant v, std::vector<std::string> targets) {
    lora.target_modules = std::move(targets);
    ModelLayout layout = BuildLayout(TinyConfig(v));
    return std::string(AddLoraAdapters(lora, TinyConfig(v), &layout).message());
  };
  EXPECT_EQ(error(Variant::kLlamaTiedGqa, {"q_proj", "experts.down_proj"}),
            "lora.target_modules[1] 'experts.down_proj': llama has no experts");
  EXPECT_EQ(error(Variant::kMixtralRenormalised, {"up_proj"}),
            "lora.target_modules[0] 'up_proj': the MLPs of mixtral are experts; adapt them as "
            "experts.gate_up_proj and experts.down_proj");
  EXPECT_EQ(error(Variant::kQwen3MoeMixedLayers, {"up_proj", "experts.gate_up_proj"}), "")
      << "its dense layer 1 has an up_proj";
  EXPECT_NE(error(Variant::kLlamaTiedGqa, {"experts"}).find("is not a projection; choose from"),
            std::string::npos);
  lora.rank = 7;  // > the experts' intermediate size 6
  EXPECT_EQ(error(Variant::kGptOssSinksWindow, {"experts.down_proj"}),
            "lora.rank 7 is larger than layer 0's experts.down_proj's smaller side (6)");
}

INSTANTIATE_TEST_SUITE_P(Variants, LoraLayers,
                         ::testing::Values(Variant::kLlamaTiedGqa, Variant::kQwen2UntiedBias,
                                           Variant::kQwen3QkNorm, Variant::kQwen3MoeMixedLayers,
                                           Variant::kGptOssSinksWindow),
                         [](const auto& info) { return VariantName(info); });

}  // namespace
}  // namespace megatrain::testing
