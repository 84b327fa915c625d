// A DPO job's passes (job/preference_pass.h) on the CPU backend: the reference pass, in
// one go or interrupted, writes each pair's log-probabilities as the forward-only pass
// gives them; and a first step on the starting weights has DPO's starting values (every
// reward 0, the sigmoid loss ln 2).
#include "engine/job/preference_pass.h"

#include <cmath>
#include <memory>
#include <random>
#include <vector>

#include "engine/store/model_io.h"
#include "gtest/gtest.h"
#include "tests/engine/pipeline/recording_sink.h"
#include "tests/engine/pipeline/tiny_model.h"
#include "tests/util/temp_dir.h"

namespace megatrain {
namespace {

using testing::TempDir;
using testing::TinyConfig;
using testing::Variant;

constexpr int64_t kRows = 2, kSeqLen = 16;

// 9 pairs: a prompt of 2 to 5 tokens, completions of 2 to 6.
std::vector<SequencePair> Pairs(int64_t vocab) {
  std::mt19937 rng(3);
  auto draw = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  std::vector<SequencePair> pairs;
  for (int k = 0; k < 9; ++k) {
    PreferenceSequence prompt;
    for (int j = draw(2, 5); j > 0; --j) {
      prompt.ids.push_back(draw(0, static_cast<int>(vocab) - 1));
      prompt.completion.push_back(0);
    }
    auto completion = [&] {
      PreferenceSequence s = prompt;
      for (int j = draw(2, 6); j > 0; --j) {
        s.ids.push_back(draw(0, static_cast<int>(vocab) - 1));
        s.completion.push_back(1);
      }
      return s;
    };
    pairs.emplace_back(completion(), completion());
  }
  return pairs;
}

struct Job {
  explicit Job(ObjectiveOptions objective) : config(TinyConfig(Variant::kQwen2UntiedBias)) {
    be = CreateCpuBackend(CpuBackendOptions{});
    store = std::move(*HostStore::Create(BuildLayout(config)));
    RandomInitWeights(config, 11, store.get());
    int64_t max_unit = 0;
    for (const UnitLayout& u : store->layout().units) max_unit = std::max(max_unit, u.num_elements);
    pool = std::move(*GradSlabPool::Create(2, max_unit));
    PipelineOptions o;
    o.micro_batches = 2;
    o.tokens_per_micro_batch = kRows * kSeqLen;
    o.loss_chunk_tokens = 7;
    o.eval_micro_batches = 2;
    o.objective = objective;
    pipeline = std::move(*Pipeline::Create(config, store.get(), pool.get(), be.get(), o));
  }
  ModelConfig config;
  std::unique_ptr<Backend> be;
  std::unique_ptr<HostStore> store;
  std::unique_ptr<GradSlabPool> pool;
  std::unique_ptr<Pipeline> pipeline;
};

TEST(PreferencePass, AnInterruptedReferencePassWritesWhatOneWholePassDoes) {
  Job job{ObjectiveOptions{}};
  const std::vector<SequencePair> pairs = Pairs(job.config.vocab_size);
  TempDir dir;
  const std::string whole_path = dir.Join("whole.json"), parts_path = dir.Join("parts.json");
  ReferenceLogps whole = *ReferenceLogps::Open(whole_path, "f", 9);
  ASSERT_TRUE(RunReferencePass(job.pipeline.get(), pairs, kRows, kSeqLen, 0, 3, &whole).ok());
  ASSERT_TRUE(whole.complete());
  {
    ReferenceLogps parts = *ReferenceLogps::Open(parts_path, "f", 9);
    ASSERT_TRUE(RunReferencePass(job.pipeline.get(), pairs, kRows, kSeqLen, 0, 3, &parts, 4).ok());
    EXPECT_EQ(parts.done(), 4);
  }
  ReferenceLogps resumed = *ReferenceLogps::Open(parts_path, "f", 9);  // as after a restart
  ASSERT_EQ(resumed.done(), 4);
  ASSERT_TRUE(RunReferencePass(job.pipeline.get(), pairs, kRows, kSeqLen, 0, 1, &resumed).ok());
  ASSERT_TRUE(resumed.complete());
  // Each pair alone in its micro-batch, through the forward-only pass: the same values.
  for (int64_t k = 0; k < 9; ++k) {
    PairBatch b;
    ASSERT_EQ(PackPairs({pairs[k]}, 0, kRows, kSeqLen, 0, &b), 1);
    std::vector<double> values;
    ASSERT_TRUE(job.pipeline->Evaluate({b.batch}, &values).ok());
    const std::vector<double> logps = SequenceLogps(b, values.data());
    EXPECT_NEAR(whole.Get(k).first, logps[0], 1e-4 * std::fabs(logps[0])) << "pair " << k;
    EXPECT_NEAR(whole.Get(k).second, logps[1], 1e-4 * std::fabs(logps[1])) << "pair " << k;
    EXPECT_LT(logps[0], 0.0);
    EXPECT_EQ(resumed.Get(k), whole.Get(k)) << "pair " << k;
  }
}

TEST(PreferencePass, TheFirstStepOnTheReferencesWeightsHasEveryRewardZero) {
  ObjectiveOptions objective;
  objective.kind = ObjectiveKind::kPreference;
  Job job{objective};
  const auto pairs =
      std::make_shared<const std::vector<SequencePair>>(Pairs(job.config.vocab_size));
  TempDir dir;
  ReferenceLogps ref = *ReferenceLogps::Open(dir.Join("ref.json"), "f", 9);
  ASSERT_TRUE(RunReferencePass(job.pipeline.get(), *pairs, kRows, kSeqLen, 0, 2, &ref).ok());
  PairStream stream(pairs, kSeqLen, 5, 0);
  std::vector<PairBatch> step = stream.NextStep(2, kRows);
  PreferenceOptions options;  // sigmoid, beta 0.1
  const std::vector<MicroBatch> batches = PreferenceStepBatches(&step, &ref, options);
  testing::RecordingSink sink(job.be.get(), job.pool.get(), job.store->num_units());
  absl::StatusOr<StepResult> r = job.pipeline->Step(batches, &sink);
  ASSERT_TRUE(r.ok()) << r.status();
  const PreferenceStep m = PreferenceStepMetrics(step, r->token_values, &ref, options);
  EXPECT_GE(m.metrics.pairs, 2);
  EXPECT_NEAR(m.metrics.loss, std::log(2.0), 1e-5);
  EXPECT_NEAR(m.metrics.rewards_chosen, 0.0, 1e-5);
  EXPECT_NEAR(m.metrics.rewards_margins, 0.0, 1e-5);
  EXPECT_LT(m.metrics.logps_chosen, 0.0);
  // Reference-free: the rewards are the policy's log-probabilities times beta.
  const PreferenceStep free = PreferenceStepMetrics(step, r->token_values, nullptr, options);
  EXPECT_NEAR(free.metrics.rewards_chosen, options.beta * m.metrics.logps_chosen, 1e-9);
}

}  // namespace
}  // namespace megatrain
