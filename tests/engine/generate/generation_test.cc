// Completions of many prompts (Generate) on the CPU backend: greedy tokens are the forward's
// argmax at every step, continuous batching changes no token, the same seed repeats, stop
// ids, stop strings and lengths end sequences as they say, bad requests are refused.
#include "engine/generate/generation.h"

#include <algorithm>
#include <memory>
#include <vector>

#include "engine/data/byte_tokenizer.h"
#include "engine/store/model_io.h"
#include "gtest/gtest.h"
#include "tests/engine/pipeline/tiny_model.h"
#include "tests/util/forward_logits.h"

namespace megatrain::testing {
namespace {

struct TinyModel {
  TinyModel() : config(TinyConfig(Variant::kQwen3QkNorm)) {
    config.vocab_size = 260;  // the byte tokenizer's ids and a few more
    be = CreateCpuBackend(CpuBackendOptions{});
    StoreOptions o;
    o.weights_only = true;
    store = std::move(*HostStore::Create(BuildLayout(config), -1, o));
    RandomInitWeights(config, 21, store.get());
  }
  std::unique_ptr<Generator> Make(int64_t sequences) {
    GeneratorOptions o;
    o.max_sequences = sequences;
    o.max_len = 32;
    o.prefill_tokens = 64;
    return std::move(*Generator::Create(config, store.get(), be.get(), o));
  }
  ModelConfig config;
  std::unique_ptr<Backend> be;
  std::unique_ptr<HostStore> store;
};

std::vector<std::vector<int32_t>> Prompts() {
  return {{256, 72, 105}, {256, 84, 104, 101, 32}, {65}, {256, 10, 10, 10, 10, 10, 10}, {66, 67}};
}

TEST(Generate, GreedyTokensAreTheForwardsArgmaxAtEveryStep) {
  TinyModel s;
  std::unique_ptr<Generator> g = s.Make(2);
  SamplingOptions greedy;
  greedy.max_new_tokens = 6;
  absl::StatusOr<std::vector<Completion>> done = Generate(g.get(), nullptr, Prompts(), greedy);
  ASSERT_TRUE(done.ok()) << done.status();
  const int64_t V = s.config.vocab_size;
  for (size_t i = 0; i < Prompts().size(); ++i) {
    std::vector<int32_t> seq = Prompts()[i];
    ASSERT_EQ((*done)[i].ids.size(), 6u);
    EXPECT_EQ((*done)[i].finish, FinishReason::kLength);
    for (int32_t id : (*done)[i].ids) {
      const std::vector<float> logits = DocumentLogits(s.config, *s.store, s.be.get(), seq);
      const float* last = logits.data() + (seq.size() - 1) * V;
      EXPECT_EQ(id, std::max_element(last, last + V) - last) << "prompt " << i;
      seq.push_back(id);
    }
  }
}

TEST(Generate, ContinuousBatchingChangesNoTokenAndTheSameSeedRepeats) {
  TinyModel s;
  SamplingOptions sampled;
  sampled.temperature = 1.0;
  sampled.seed = 11;
  sampled.max_new_tokens = 8;
  std::vector<std::vector<Completion>> runs;
  for (int64_t sequences : {1, 2, 5, 5}) {
    std::unique_ptr<Generator> g = s.Make(sequences);
    absl::StatusOr<std::vector<Completion>> done = Generate(g.get(), nullptr, Prompts(), sampled);
    ASSERT_TRUE(done.ok()) << done.status();
    runs.push_back(*done);
  }
  for (size_t r = 1; r < runs.size(); ++r) {
    for (size_t i = 0; i < Prompts().size(); ++i) {
      EXPECT_EQ(runs[r][i].ids, runs[0][i].ids) << "run " << r << " prompt " << i;
    }
  }
  sampled.seed = 12;
  std::unique_ptr<Generator> g = s.Make(5);
  absl::StatusOr<std::vector<Completion>> other = Generate(g.get(), nullptr, Prompts(), sampled);
  ASSERT_TRUE(other.ok());
  int differ = 0;
  for (size_t i = 0; i < Prompts().size(); ++i) differ += (*other)[i].ids != runs[0][i].ids;
  EXPECT_GT(differ, 0) << "another seed gave the same tokens for every prompt";
}

// A job completed in parts (a generate job's steps, a resumed run) keys each prompt's draws
// by its index in the job: the parts give the tokens one call gives.
TEST(Generate, PromptsCompletedInPartsWithTheirKeysGetTheTokensOfOneCall) {
  TinyModel s;
  SamplingOptions sampled;
  sampled.temperature = 1.0;
  sampled.seed = 3;
  sampled.max_new_tokens = 8;
  std::unique_ptr<Generator> g = s.Make(2);
  absl::StatusOr<std::vector<Completion>> whole = Generate(g.get(), nullptr, Prompts(), sampled);
  ASSERT_TRUE(whole.ok()) << whole.status();
  const std::vector<std::vector<int32_t>> all = Prompts();
  const std::vector<std::vector<int64_t>> parts = {{3, 0}, {4}, {1, 2}};
  int keyless_differ = 0;
  for (const std::vector<int64_t>& part : parts) {
    std::vector<std::vector<int32_t>> prompts;
    for (int64_t i : part) prompts.push_back(all[i]);
    absl::StatusOr<std::vector<Completion>> done =
        Generate(g.get(), nullptr, prompts, sampled, nullptr, part);
    ASSERT_TRUE(done.ok()) << done.status();
    absl::StatusOr<std::vector<Completion>> keyless = Generate(g.get(), nullptr, prompts, sampled);
    ASSERT_TRUE(keyless.ok());
    for (size_t k = 0; k < part.size(); ++k) {
      EXPECT_EQ((*done)[k].ids, (*whole)[part[k]].ids) << "prompt " << part[k];
      keyless_differ += (*keyless)[k].ids != (*whole)[part[k]].ids;
    }
  }
  EXPECT_GT(keyless_differ, 0) << "the keys changed nothing: the test shows nothing";
}

TEST(Generate, StopIdsStopStringsAndLengthsEndSequencesAsTheySay) {
  TinyModel s;
  ByteTokenizer bytes;
  std::unique_ptr<Generator> g = s.Make(3);
  SamplingOptions greedy;
  greedy.max_new_tokens = 10;
  absl::StatusOr<std::vector<Completion>> free_run = Generate(g.get(), &bytes, Prompts(), greedy);
  ASSERT_TRUE(free_run.ok()) << free_run.status();
  // Stop at each prompt's third token: as an id, it is kept and ends the sequence.
  const Completion& first = (*free_run)[0];
  greedy.stop_ids = {first.ids[2]};
  absl::StatusOr<std::vector<Completion>> by_id = Generate(g.get(), &bytes, Prompts(), greedy);
  ASSERT_TRUE(by_id.ok());
  const std::vector<int32_t> kept(first.ids.begin(), first.ids.begin() + 3);
  const auto stop_at = std::find(first.ids.begin(), first.ids.end(), first.ids[2]);
  EXPECT_EQ((*by_id)[0].ids, std::vector<int32_t>(first.ids.begin(), stop_at + 1));
  EXPECT_EQ((*by_id)[0].finish, FinishReason::kStop);
  // A stop string: the text is cut before it.
  if (first.text.size() >= 4) {
    greedy.stop_ids.clear();
    greedy.stop_strings = {first.text.substr(2, 2)};
    absl::StatusOr<std::vector<Completion>> by_text = Generate(g.get(), &bytes, Prompts(), greedy);
    ASSERT_TRUE(by_text.ok());
    EXPECT_EQ((*by_text)[0].finish, FinishReason::kStop);
    EXPECT_EQ((*by_text)[0].text, first.text.substr(0, first.text.find(greedy.stop_strings[0])));
  }
  EXPECT_EQ((*free_run)[1].finish, FinishReason::kLength);
  EXPECT_EQ((*free_run)[1].ids.size(), 10u);
}

// A sequence as long as the cache holds still yields the token its last position predicts:
// the cache's max_len positions feed max_len - prompt + 1 new tokens.
TEST(Generate, TheCachesLastPositionStillPredictsAToken) {
  TinyModel s;
  std::unique_ptr<Generator> g = s.Make(1);  // max_len 32
  SamplingOptions greedy;
  greedy.max_new_tokens = 100;
  absl::StatusOr<std::vector<Completion>> done =
      Generate(g.get(), nullptr, {std::vector<int32_t>(30, 7)}, greedy);
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_EQ((*done)[0].ids.size(), 3u);
  EXPECT_EQ((*done)[0].finish, FinishReason::kLength);
}

TEST(Generate, BadRequestsAreRefusedNamingThePrompt) {
  TinyModel s;
  std::unique_ptr<Generator> g = s.Make(2);
  SamplingOptions o;
  absl::StatusOr<std::vector<Completion>> r = Generate(g.get(), nullptr, {{1}, {}}, o);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("prompt 1 is empty"), std::string::npos) << r.status();
  r = Generate(g.get(), nullptr, {std::vector<int32_t>(32, 5)}, o);
  EXPECT_NE(r.status().message().find("prompt 0 is 32 tokens long"), std::string::npos)
      << r.status();
  o.top_p = 1.5;
  r = Generate(g.get(), nullptr, {{1}}, o);
  EXPECT_NE(r.status().message().find("top_p"), std::string::npos) << r.status();
  o.top_p = 1;
  o.stop_strings = {"x"};
  r = Generate(g.get(), nullptr, {{1}}, o);
  EXPECT_NE(r.status().message().find("tokenizer"), std::string::npos) << r.status();
}

}  // namespace
}  // namespace megatrain::testing
