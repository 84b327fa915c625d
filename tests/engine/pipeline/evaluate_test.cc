// The forward-only pass (Pipeline::Evaluate): the loss a training step computes, bit for
// bit, on the weights the host holds; nothing it leaves behind changes the next step.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

#include "engine/data/pair_packer.h"
#include "engine/pipeline/pipeline.h"
#include "engine/store/model_io.h"
#include "gtest/gtest.h"
#include "tests/engine/pipeline/recording_sink.h"
#include "tests/engine/pipeline/sgd_sink.h"
#include "tests/engine/pipeline/tiny_model.h"

namespace megatrain::testing {
namespace {

struct Shape {
  int64_t micro_batches = 2;
  int64_t tokens = 10;
  int64_t k = 1;
  bool host_checkpoints = false;
  int64_t weight_slots = 0;
  int64_t eval_micro_batches = -1;  // -1: EvalCapacity
};

struct EvalHarness {
  EvalHarness(const ModelConfig& c, const Shape& shape) : config(c) {
    be = CreateCpuBackend(CpuBackendOptions{});
    store = std::move(*HostStore::Create(BuildLayout(c)));
    RandomInitWeights(c, 11, store.get());
    int64_t max_unit = 0;
    for (const UnitLayout& u : store->layout().units) max_unit = std::max(max_unit, u.num_elements);
    pool = std::move(*GradSlabPool::Create(2, max_unit));
    options.micro_batches = shape.micro_batches;
    options.tokens_per_micro_batch = shape.tokens;
    options.checkpoint_every = shape.k;
    options.loss_chunk_tokens = 7;
    options.checkpoints_on_host = shape.host_checkpoints;
    options.weight_slots = shape.weight_slots;
    options.eval_micro_batches = shape.eval_micro_batches >= 0 ? shape.eval_micro_batches
                                                               : EvalCapacity(c, options);
    absl::StatusOr<std::unique_ptr<Pipeline>> p =
        Pipeline::Create(c, store.get(), pool.get(), be.get(), options);
    EXPECT_TRUE(p.ok()) << p.status();
    if (p.ok()) pipeline = *std::move(p);
  }
  EvalResult Evaluate(const std::vector<MicroBatch>& batches) {
    absl::StatusOr<EvalResult> r = pipeline->Evaluate(batches);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? *r : EvalResult{};
  }
  StepResult Step(const std::vector<MicroBatch>& batches, GradSink* sink) {
    absl::StatusOr<StepResult> r = pipeline->Step(batches, sink);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? *r : StepResult{};
  }
  std::vector<uint16_t> Weights() const {
    std::vector<uint16_t> all;
    for (int64_t u = 0; u < store->num_units(); ++u) {
      all.insert(all.end(), store->weights(u), store->weights(u) + store->unit_elements(u));
    }
    return all;
  }

  ModelConfig config;
  std::unique_ptr<Backend> be;
  std::unique_ptr<HostStore> store;
  std::unique_ptr<GradSlabPool> pool;
  PipelineOptions options;
  std::unique_ptr<Pipeline> pipeline;
};

std::vector<MicroBatch> Batches(const ModelConfig& c, int64_t count, int64_t tokens,
                                uint64_t seed) {
  std::vector<MicroBatch> out;
  for (int64_t i = 0; i < count; ++i) out.push_back(RandomBatch(1, tokens, c.vocab_size, seed + i));
  return out;
}

class EvaluateEveryVariant : public ::testing::TestWithParam<Variant> {};

// The weights change between the steps (SGD), so every evaluation after the first reads
// layers whose slots the update made stale: it must upload them afresh.
TEST_P(EvaluateEveryVariant, LossEqualsTheNextStepsLossBitForBitAcrossUpdates) {
  const ModelConfig c = TinyConfig(GetParam());
  for (const Shape& shape : {Shape{2, 10, 1}, Shape{2, 10, 2}, Shape{2, 10, 1, false, 99},
                             Shape{2, 10, 2, true}}) {
    EvalHarness h(c, shape);
    ASSERT_NE(h.pipeline, nullptr);
    SgdSink sink(h.be.get(), h.pool.get(), h.store.get(), /*at_submit=*/true);
    for (int step = 0; step < 3; ++step) {
      const std::vector<MicroBatch> batches = Batches(c, shape.micro_batches, 10, 40 + step);
      const EvalResult eval = h.Evaluate(batches);
      const StepResult trained = h.Step(batches, &sink);
      EXPECT_EQ(eval.loss(), trained.loss) << "K=" << shape.k << " step " << step;
      EXPECT_EQ(eval.num_targets, trained.num_targets);
      EXPECT_EQ(eval.passes, 1);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Variants, EvaluateEveryVariant,
                         ::testing::Values(Variant::kLlamaTiedGqa, Variant::kQwen3QkNorm,
                                           Variant::kQwen3MoeMixedLayers,
                                           Variant::kGptOssSinksWindow),
                         [](const auto& info) { return VariantName(info); });

// Dense and MoE (whose forward routes on the device; an evaluation keeps no router
// statistics, so the next step's load-balancing loss is its own).
TEST(Evaluate, ChangesNoWeightAndNoBitOfTheStepsAfterIt) {
  for (Variant v : {Variant::kQwen2UntiedBias, Variant::kQwen3MoeMixedLayers}) {
    const ModelConfig c = TinyConfig(v);
    const Shape resident{2, 10, 1, false, 99};
    EvalHarness with(c, resident), without(c, resident);
    SgdSink sink_with(with.be.get(), with.pool.get(), with.store.get(), false);
    SgdSink sink_without(without.be.get(), without.pool.get(), without.store.get(), false);
    const std::vector<MicroBatch> held_out = Batches(c, 5, 10, 90);
    for (int step = 0; step < 3; ++step) {
      const std::vector<MicroBatch> batches = Batches(c, 2, 10, 10 + step);
      const StepResult a = with.Step(batches, &sink_with);
      // Every pending update applied first, as the trainer does (HostOptimizer::Drain).
      for (int64_t u = 0; u < with.store->num_units(); ++u) sink_with.AwaitUnit(u);
      const std::vector<uint16_t> before = with.Weights();
      with.Evaluate(held_out);
      EXPECT_EQ(with.Weights(), before);
      const StepResult b = without.Step(batches, &sink_without);
      EXPECT_EQ(a.loss, b.loss) << "step " << step;
      EXPECT_EQ(a.aux_loss, b.aux_loss) << "step " << step;
      for (size_t u = 0; u < sink_with.grads.size(); ++u) {
        EXPECT_EQ(sink_with.grads[u], sink_without.grads[u]) << "step " << step << " unit " << u;
      }
    }
  }
}

TEST(Evaluate, MoreMicroBatchesThanAPassHoldsGoInSeveralPassesOfTheSameLosses) {
  const ModelConfig c = TinyConfig(Variant::kQwen3QkNorm);
  EvalHarness two_at_a_time(c, Shape{1, 10, 1, false, 0, 2});
  EvalHarness one_at_a_time(c, Shape{1, 10, 1, false, 0, 1});
  const std::vector<MicroBatch> batches = Batches(c, 7, 10, 5);
  const EvalResult a = two_at_a_time.Evaluate(batches);
  const EvalResult b = one_at_a_time.Evaluate(batches);
  EXPECT_EQ(a.passes, 4);
  EXPECT_EQ(b.passes, 7);
  EXPECT_EQ(a.micro_batches, 7);
  EXPECT_EQ(a.num_targets, b.num_targets);
  // The same per-token values, added in the same order.
  EXPECT_EQ(a.loss_sum, b.loss_sum);
  // Two weight slots, three layers: the first pass uploads each layer once; each later one
  // finds layer 1 still in its slot (layer 2 took the other) and uploads the two others.
  ASSERT_EQ(c.num_layers, 3);
  const HostStore& store = *one_at_a_time.store;
  const int64_t layer_bytes = 2 * store.layout().MaxDecoderElements();  // bf16
  const int64_t token_bytes = 7 * 4 * 4 * 10;                          // 4 int32 arrays
  const int64_t embed_head =
      2 * (store.unit_elements(0) + store.unit_elements(store.layout().HeadUnit()));
  EXPECT_EQ(b.h2d_bytes, (3 + 6 * 2) * layer_bytes + token_bytes + embed_head);
}

// DPO's reference pass: per-token values from Evaluate, summed per sequence
// (SequenceLogps), give a pair's log-probabilities whatever it is packed with (sequences
// are segments of their own), and the values sum to the pass's loss.
TEST(Evaluate, PairLogpsDoNotDependOnWhatThePairIsPackedWith) {
  const ModelConfig c = TinyConfig(Variant::kLlamaTiedGqa);
  Shape shape;
  shape.micro_batches = 1;
  shape.tokens = 20;  // 2 rows of 10
  EvalHarness h(c, shape);
  auto seq = [](std::vector<int32_t> ids, int prompt) {
    PreferenceSequence s{ids, std::vector<uint8_t>(ids.size(), 1)};
    std::fill(s.completion.begin(), s.completion.begin() + prompt, 0);
    return s;
  };
  const std::vector<std::pair<PreferenceSequence, PreferenceSequence>> pairs = {
      {seq({3, 7, 1, 12}, 2), seq({3, 7, 9}, 2)},
      {seq({5, 2, 2, 8, 14}, 1), seq({5, 11, 4, 6}, 1)}};
  PairBatch alone, together;
  ASSERT_EQ(PackPairs({pairs[0]}, 0, 2, 10, 0, &alone), 1);
  ASSERT_EQ(PackPairs(pairs, 0, 2, 10, 0, &together), 2);
  std::vector<double> values;
  absl::StatusOr<EvalResult> r = h.pipeline->Evaluate({alone.batch, together.batch}, &values);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(values.size(), 40u);
  double sum = 0;
  for (size_t i = 0; i < values.size(); ++i) {
    sum += values[i];
    const MicroBatch& b = i < 20 ? alone.batch : together.batch;
    if (b.targets[i % 20] == kIgnoreIndex) {
      EXPECT_EQ(values[i], 0.0) << i;
    }
  }
  EXPECT_EQ(sum, r->loss_sum);
  const std::vector<double> a = SequenceLogps(alone, values.data());
  const std::vector<double> t = SequenceLogps(together, values.data() + 20);
  ASSERT_EQ(a.size(), 2u);
  ASSERT_EQ(t.size(), 4u);
  for (int k = 0; k < 2; ++k) {
    EXPECT_LT(a[k], 0.0);
    EXPECT_NEAR(t[k], a[k], 1e-5 * std::fabs(a[k])) << "sequence " << k;
  }
}

TEST(Evaluate, PipelineRefusesMoreEvalMicroBatchesThanItsActivationsHold) {
  const ModelConfig c = TinyConfig(Variant::kQwen3QkNorm);
  PipelineOptions o;
  o.micro_batches = 2;
  o.tokens_per_micro_batch = 10;
  o.checkpoint_every = 1;
  // K=1 on the device: L+1 checkpoints and the residual gradient, half each side.
  EXPECT_EQ(EvalCapacity(c, o), (c.num_layers + 2) / 2 * 2);
  auto be = CreateCpuBackend(CpuBackendOptions{});
  auto store = std::move(*HostStore::Create(BuildLayout(c)));
  auto pool = std::move(*GradSlabPool::Create(2, 1 << 16));
  o.eval_micro_batches = EvalCapacity(c, o) + 1;
  absl::StatusOr<std::unique_ptr<Pipeline>> p =
      Pipeline::Create(c, store.get(), pool.get(), be.get(), o);
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.status().message().find("eval_micro_batches"), std::string::npos) << p.status();
}

}  // namespace
}  // namespace megatrain::testing
