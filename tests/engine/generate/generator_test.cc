// The generation engine on the CPU backend: a prefill and the decode steps after it give,
// position by position, the logits the training forward gives the whole sequence, for every
// tiny model family; sequences decoded together give what each gives alone; streamed
// weights give what resident ones give; bad calls are refused.
#include "engine/generate/generator.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

#include "engine/store/model_io.h"
#include "gtest/gtest.h"
#include "tests/engine/pipeline/tiny_model.h"
#include "tests/util/forward_logits.h"

namespace megatrain::testing {
namespace {

struct Model {
  explicit Model(Variant v) : config(TinyConfig(v)) {
    be = CreateCpuBackend(CpuBackendOptions{});
    store = std::move(*HostStore::Create(BuildLayout(config)));
    RandomInitWeights(config, 5, store.get());
  }
  std::unique_ptr<Generator> Make(GeneratorOptions o) {
    absl::StatusOr<std::unique_ptr<Generator>> g =
        Generator::Create(config, store.get(), be.get(), o);
    EXPECT_TRUE(g.ok()) << g.status();
    return g.ok() ? *std::move(g) : nullptr;
  }
  // The training forward's logits of `tokens` as one document, (n, V).
  std::vector<float> Reference(const std::vector<int32_t>& tokens) {
    return DocumentLogits(config, *store, be.get(), tokens);
  }
  ModelConfig config;
  std::unique_ptr<Backend> be;
  std::unique_ptr<HostStore> store;
};

std::vector<int32_t> Tokens(int64_t n, int64_t vocab, uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::vector<int32_t> t(n);
  for (int32_t& x : t) x = static_cast<int32_t>(gen() % vocab);
  return t;
}

// Row `row` of (n, V) `ref` against (V) `got`: the same values up to float rounding of
// sums taken in another order.
void ExpectRowNear(const std::vector<float>& ref, int64_t row, const float* got, int64_t V,
                   const char* what) {
  float scale = 0, worst = 0;
  for (int64_t v = 0; v < V; ++v) {
    scale = std::max(scale, std::abs(ref[row * V + v]));
    worst = std::max(worst, std::abs(ref[row * V + v] - got[v]));
  }
  EXPECT_LE(worst, 1e-4f * std::max(1.0f, scale)) << what << " row " << row;
}

class GeneratorEveryVariant : public ::testing::TestWithParam<Variant> {};

TEST_P(GeneratorEveryVariant, PrefillThenDecodeGiveTheForwardsLogitsAtEveryPosition) {
  Model m(GetParam());
  const int64_t V = m.config.vocab_size, n = 12, prompt = 5;
  const std::vector<int32_t> tokens = Tokens(n, V, 3);
  const std::vector<float> ref = m.Reference(tokens);
  for (int64_t slots : {int64_t{2}, m.config.num_layers}) {  // streamed, resident
    GeneratorOptions o;
    o.max_sequences = 3;
    o.max_len = 16;
    o.prefill_tokens = 16;
    o.weight_slots = slots;
    std::unique_ptr<Generator> g = m.Make(o);
    ASSERT_NE(g, nullptr);
    std::vector<float> logits;
    ASSERT_TRUE(
        g->Prefill({std::vector<int32_t>(tokens.begin(), tokens.begin() + prompt)}, {1}, &logits)
            .ok());
    ExpectRowNear(ref, prompt - 1, logits.data(), V, "prefill");
    for (int64_t i = prompt; i < n; ++i) {
      ASSERT_TRUE(g->Decode({tokens[i]}, {1}, &logits).ok());
      ExpectRowNear(ref, i, logits.data(), V, "decode");
    }
    EXPECT_EQ(g->length(1), n);
  }
}

INSTANTIATE_TEST_SUITE_P(Variants, GeneratorEveryVariant,
                         ::testing::Values(Variant::kLlamaTiedGqa, Variant::kQwen2UntiedBias,
                                           Variant::kQwen3QkNorm, Variant::kLlama3RopeMha,
                                           Variant::kQwen3MoeMixedLayers,
                                           Variant::kMixtralRenormalised,
                                           Variant::kGptOssSinksWindow),
                         [](const auto& info) { return VariantName(info); });

TEST(Generator, SequencesPrefilledAndDecodedTogetherGiveWhatEachGivesAlone) {
  Model m(Variant::kGptOssSinksWindow);
  const int64_t V = m.config.vocab_size;
  const std::vector<std::vector<int32_t>> prompts = {Tokens(4, V, 1), Tokens(7, V, 2),
                                                     Tokens(1, V, 3)};
  GeneratorOptions o;
  o.max_sequences = 4;
  o.max_len = 16;
  o.prefill_tokens = 16;
  std::unique_ptr<Generator> together = m.Make(o);
  std::vector<float> joint;
  ASSERT_TRUE(together->Prefill(prompts, {2, 0, 3}, &joint).ok());
  for (int step = 0; step < 4; ++step) {
    const std::vector<int32_t> next = Tokens(3, V, 10 + step);
    std::vector<float> decoded;
    ASSERT_TRUE(together->Decode(next, {2, 0, 3}, &decoded).ok());
    for (int i = 0; i < 3; ++i) {
      std::vector<int32_t> seq = prompts[i];
      for (int s = 0; s <= step; ++s) seq.push_back(Tokens(3, V, 10 + s)[i]);
      const std::vector<float> ref = m.Reference(seq);
      ExpectRowNear(ref, static_cast<int64_t>(seq.size()) - 1, decoded.data() + i * V, V,
                    "batched decode");
    }
  }
  EXPECT_EQ(together->length(0), 7 + 4);
  EXPECT_EQ(together->length(1), 0);
}

TEST(Generator, GreedyPicksOnTheDeviceAreTheLogitsArgmaxAndItsLogSoftmax) {
  Model m(Variant::kMixtralRenormalised);
  const int64_t V = m.config.vocab_size;
  GeneratorOptions o;
  o.max_sequences = 3;
  o.max_len = 16;
  o.prefill_tokens = 16;
  std::unique_ptr<Generator> a = m.Make(o), b = m.Make(o);
  const std::vector<std::vector<int32_t>> prompts = {Tokens(4, V, 1), Tokens(6, V, 2)};
  std::vector<float> logits;
  std::vector<SampledToken> picks;
  for (int step = 0; step < 3; ++step) {
    if (step == 0) {
      ASSERT_TRUE(a->Prefill(prompts, {0, 2}, &logits).ok());
      ASSERT_TRUE(b->Prefill(prompts, {0, 2}, Generator::Output{nullptr, &picks}).ok());
    } else {
      const std::vector<int32_t> next = Tokens(2, V, 30 + step);
      ASSERT_TRUE(a->Decode(next, {0, 2}, &logits).ok());
      ASSERT_TRUE(b->Decode(next, {0, 2}, Generator::Output{nullptr, &picks}).ok());
    }
    ASSERT_EQ(picks.size(), 2u);
    for (int i = 0; i < 2; ++i) {
      const float* row = logits.data() + i * V;
      const int64_t best = std::max_element(row, row + V) - row;
      double sum = 0;
      for (int64_t v = 0; v < V; ++v) sum += std::exp(static_cast<double>(row[v]) - row[best]);
      EXPECT_EQ(picks[i].id, best) << "step " << step << " sequence " << i;
      EXPECT_NEAR(picks[i].logprob, -std::log(sum), 1e-5) << "step " << step;
    }
  }
}

TEST(Generator, BadCallsAreRefusedNamingTheProblem) {
  Model m(Variant::kQwen3QkNorm);
  GeneratorOptions o;
  o.max_sequences = 2;
  o.max_len = 6;
  o.prefill_tokens = 8;
  std::unique_ptr<Generator> g = m.Make(o);
  std::vector<float> logits;
  absl::Status s = g->Prefill({Tokens(6, 10, 1)}, {0}, &logits);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("max_len"), std::string::npos) << s;
  EXPECT_EQ(g->Prefill({{}}, {0}, &logits).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(g->Prefill({{1}, {2}}, {1, 1}, &logits).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(g->Prefill({{1}}, {2}, &logits).code(), absl::StatusCode::kInvalidArgument);
  s = g->Prefill({{static_cast<int32_t>(m.config.vocab_size)}}, {0}, &logits);
  EXPECT_NE(s.message().find("vocab_size"), std::string::npos) << s;
  EXPECT_EQ(g->Decode({1}, {0}, &logits).code(), absl::StatusCode::kInvalidArgument);  // empty
  ASSERT_TRUE(g->Prefill({Tokens(5, 10, 1)}, {0}, &logits).ok());
  ASSERT_TRUE(g->Decode({1}, {0}, &logits).ok());  // the sixth token: the cache is full
  EXPECT_EQ(g->Decode({1}, {0}, &logits).code(), absl::StatusCode::kOutOfRange);
  o.max_len = 1;
  EXPECT_FALSE(Generator::Create(m.config, m.store.get(), m.be.get(), o).ok());
}

}  // namespace
}  // namespace megatrain::testing
