// The generation engine on the CUDA backend: prefill and decode give the CUDA forward's
// logits at every position within bf16 rounding (decode attention is another kernel), the
// same bits streamed or resident and run after run.
#include <algorithm>
#include <cmath>
#include <random>

#include "engine/generate/generator.h"
#include "engine/store/model_io.h"
#include "tests/engine/pipeline/tiny_model.h"
#include "tests/gpu/gpu_util.h"
#include "tests/util/forward_logits.h"

namespace megatrain::testing {
namespace {

class GeneratorGpu : public ::testing::TestWithParam<Variant> {};

// The variant at a width the CUDA kernels take (head_dim 64 or 128 for decode attention).
ModelConfig GpuConfig(Variant v, int64_t heads, int64_t head_dim, int64_t vocab) {
  ModelConfig c = TinyConfig(v);
  c.hidden_size = 256;
  c.num_heads = heads;
  c.num_kv_heads = 2;
  c.head_dim = head_dim;
  c.intermediate_size = 512;
  c.vocab_size = vocab;
  c.max_position_embeddings = 512;
  if (c.is_moe()) c.moe.intermediate_size = 128;
  return c;
}

// Every row's logits from `prompt` tokens of prefill, then one decode step per token.
std::vector<float> Generated(Generator* g, const std::vector<int32_t>& tokens, int64_t prompt) {
  std::vector<float> all, logits;
  EXPECT_TRUE(g->Prefill({std::vector<int32_t>(tokens.begin(), tokens.begin() + prompt)}, {0},
                         &logits).ok());
  all = logits;
  for (size_t i = prompt; i < tokens.size(); ++i) {
    EXPECT_TRUE(g->Decode({tokens[i]}, {0}, &logits).ok());
    all.insert(all.end(), logits.begin(), logits.end());
  }
  return all;
}

TEST_P(GeneratorGpu, DecodeGivesTheForwardsLogitsAndTheSameBitsStreamedOrResident) {
  if (!CudaAvailable()) GTEST_SKIP() << "no CUDA device (or no CUDA backend in this build)";
  absl::StatusOr<std::unique_ptr<Backend>> be = CreateBackend(BackendRequest{"cuda"});
  ASSERT_TRUE(be.ok()) << be.status();
  const ModelConfig c = GpuConfig(GetParam(), 4, 64, 512);
  std::unique_ptr<HostStore> store = std::move(*HostStore::Create(BuildLayout(c)));
  RandomInitWeights(c, 13, store.get());
  std::mt19937 rng(5);
  std::vector<int32_t> tokens(48);
  for (int32_t& t : tokens) t = static_cast<int32_t>(rng() % c.vocab_size);
  const int64_t prompt = 20, V = c.vocab_size;

  const std::vector<float> ref = DocumentLogits(c, *store, be->get(), tokens);

  std::vector<std::vector<float>> runs;
  for (int64_t slots : {c.num_layers, int64_t{2}, c.num_layers}) {
    GeneratorOptions o;
    o.max_sequences = 2;
    o.max_len = 64;
    o.prefill_tokens = 64;
    o.weight_slots = slots;
    absl::StatusOr<std::unique_ptr<Generator>> g = Generator::Create(c, store.get(), be->get(), o);
    ASSERT_TRUE(g.ok()) << g.status();
    runs.push_back(Generated(g->get(), tokens, prompt));
  }
  EXPECT_EQ(runs[0], runs[1]) << "streamed weights changed a bit";
  EXPECT_EQ(runs[0], runs[2]) << "a second run changed a bit";
  const std::vector<float>& got = runs[0];
  ASSERT_EQ(static_cast<int64_t>(got.size()), (static_cast<int64_t>(tokens.size()) - prompt + 1) * V);
  double worst = 0, scale = 0;
  for (int64_t r = 0; r + prompt - 1 < static_cast<int64_t>(tokens.size()); ++r) {
    for (int64_t v = 0; v < V; ++v) {
      const float want = ref[(r + prompt - 1) * V + v];
      worst = std::max(worst, static_cast<double>(std::abs(got[r * V + v] - want)));
      scale = std::max(scale, static_cast<double>(std::abs(want)));
    }
  }
  std::printf("max |logit - forward's| %.4g (logits up to %.3g)\n", worst, scale);
  EXPECT_LE(worst, 0.03 * std::max(1.0, scale));
}

// Prompts of uneven lengths prefilled together in one pass (as Generate() packs them), then
// decoded together: each one's logits are its forward's alone.
TEST_P(GeneratorGpu, PromptsPrefilledAndDecodedTogetherGiveEachOnesForward) {
  if (!CudaAvailable()) GTEST_SKIP() << "no CUDA device (or no CUDA backend in this build)";
  absl::StatusOr<std::unique_ptr<Backend>> be = CreateBackend(BackendRequest{"cuda"});
  ASSERT_TRUE(be.ok()) << be.status();
  const ModelConfig c = GpuConfig(GetParam(), 8, 128, 1000);
  std::unique_ptr<HostStore> store = std::move(*HostStore::Create(BuildLayout(c)));
  RandomInitWeights(c, 17, store.get());
  std::mt19937 rng(9);
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 12; ++i) {
    prompts.emplace_back(16 + (i * 31) % 33);
    for (int32_t& t : prompts.back()) t = static_cast<int32_t>(rng() % c.vocab_size);
  }
  GeneratorOptions o;
  o.max_sequences = 12;
  o.max_len = 64;
  o.prefill_tokens = 1024;
  absl::StatusOr<std::unique_ptr<Generator>> g = Generator::Create(c, store.get(), be->get(), o);
  ASSERT_TRUE(g.ok()) << g.status();
  std::vector<int32_t> slots(prompts.size());
  for (size_t i = 0; i < slots.size(); ++i) slots[i] = static_cast<int32_t>(slots.size() - 1 - i);
  std::vector<float> logits;
  ASSERT_TRUE((*g)->Prefill(prompts, slots, &logits).ok());
  const int64_t V = c.vocab_size;
  for (int step = 0; step < 4; ++step) {
    if (step > 0) {
      std::vector<int32_t> next;
      for (auto& p : prompts) next.push_back(p.emplace_back(static_cast<int32_t>(rng() % V)));
      ASSERT_TRUE((*g)->Decode(next, slots, &logits).ok());
    }
    for (size_t i = 0; i < prompts.size(); ++i) {
      const std::vector<float> ref = DocumentLogits(c, *store, be->get(), prompts[i]);
      const int64_t last = static_cast<int64_t>(prompts[i].size()) - 1;
      double worst = 0, scale = 0;
      for (int64_t v = 0; v < V; ++v) {
        const float want = ref[last * V + v], got = logits[i * V + v];
        ASSERT_TRUE(std::isfinite(got)) << "step " << step << " prompt " << i;
        worst = std::max(worst, static_cast<double>(std::abs(got - want)));
        scale = std::max(scale, static_cast<double>(std::abs(want)));
      }
      EXPECT_LE(worst, 0.03 * std::max(1.0, scale)) << "step " << step << " prompt " << i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Variants, GeneratorGpu,
                         ::testing::Values(Variant::kQwen2UntiedBias, Variant::kQwen3QkNorm,
                                           Variant::kMixtralRenormalised,
                                           Variant::kGptOssSinksWindow),
                         [](const auto& info) { return VariantName(info); });

}  // namespace
}  // namespace megatrain::testing
