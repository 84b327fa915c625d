// Sampler: greedy and its limits, the top-k and nucleus cuts, the draw's distribution and
// its independence from batch and threads, the log-probability, option validation.
#include "engine/generate/sampling.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "engine/generate/philox.h"
#include "gtest/gtest.h"

namespace megatrain {
namespace {

constexpr float kMasked = -std::numeric_limits<float>::infinity();

SamplingOptions Options(double temperature, int64_t top_k = 0, double top_p = 1.0,
                        uint64_t seed = 1) {
  SamplingOptions options;
  options.temperature = temperature;
  options.top_k = top_k;
  options.top_p = top_p;
  options.seed = seed;
  return options;
}

// Seeded normal logits, all distinct.
std::vector<float> RandomLogits(int64_t vocab_size, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> logits(vocab_size);
  for (float& x : logits) x = normal(rng);
  return logits;
}

SampledToken SampleOne(const SamplingOptions& options, const std::vector<float>& logits,
                       SampleKey key) {
  Sampler sampler(options, static_cast<int64_t>(logits.size()));
  SampledToken token;
  absl::Status status = sampler.Sample(logits, {&key, 1}, {&token, 1});
  EXPECT_TRUE(status.ok()) << status;
  return token;
}

// The ids drawn for sequence 0 at steps 0 .. n-1.
std::vector<int32_t> DrawSteps(const SamplingOptions& options, const std::vector<float>& logits,
                               int64_t n) {
  std::vector<int32_t> ids;
  for (int64_t step = 0; step < n; ++step) ids.push_back(SampleOne(options, logits, {0, step}).id);
  return ids;
}

// Ids in (logit descending, id ascending) order.
std::vector<int32_t> Ranked(const std::vector<float>& logits) {
  std::vector<int32_t> ids(logits.size());
  std::iota(ids.begin(), ids.end(), 0);
  std::stable_sort(ids.begin(), ids.end(),
                   [&](int32_t a, int32_t b) { return logits[a] > logits[b]; });
  return ids;
}

int32_t Argmax(const std::vector<float>& logits) {
  return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
}

TEST(SamplingPhilox, MatchesRandom123KnownAnswers) {
  const uint32_t cases[3][10] = {{0, 0, 0, 0, 0, 0, 0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8},
                                 {0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff,
                                  0xffffffff, 0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd},
                                 {0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344, 0xa4093822,
                                  0x299f31d0, 0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}};
  for (const auto& c : cases) {
    uint32_t out[4];
    Philox4x32(c, c + 4, out);
    for (int i = 0; i < 4; ++i) EXPECT_EQ(out[i], c[6 + i]) << "word " << i;
  }
}

TEST(Sampler, GreedyPicksArgmax) {
  const std::vector<float> logits = RandomLogits(1000, 3);
  EXPECT_EQ(SampleOne(Options(0), logits, {0, 0}).id, Argmax(logits));
}

TEST(Sampler, GreedyPicksLowestIdAmongTiedMaxima) {
  const std::vector<float> logits = {0.5f, 2.0f, -1.0f, 2.0f, 2.0f};
  EXPECT_EQ(SampleOne(Options(0), logits, {0, 0}).id, 1);
  EXPECT_EQ(SampleOne(Options(1.0, 1), logits, {0, 0}).id, 1);  // top_k = 1 agrees
}

TEST(Sampler, TinyTemperatureEqualsGreedy) {
  for (uint32_t seed = 0; seed < 20; ++seed) {
    const std::vector<float> logits = RandomLogits(500, seed);
    for (double temperature : {1e-8, 1e-300}) {
      EXPECT_EQ(SampleOne(Options(temperature), logits, {seed, 7}).id, Argmax(logits));
    }
  }
}

TEST(Sampler, TopKOfOneEqualsGreedy) {
  for (uint32_t seed = 0; seed < 20; ++seed) {
    const std::vector<float> logits = RandomLogits(500, seed);
    EXPECT_EQ(SampleOne(Options(1.5, 1), logits, {seed, 0}).id, Argmax(logits));
    EXPECT_EQ(SampleOne(Options(1.5, 1, 0.5), logits, {seed, 1}).id, Argmax(logits));
  }
}

TEST(Sampler, TinyTopPEqualsGreedy) {
  for (uint32_t seed = 0; seed < 20; ++seed) {
    const std::vector<float> logits = RandomLogits(500, seed);
    EXPECT_EQ(SampleOne(Options(1.0, 0, 1e-9), logits, {seed, 0}).id, Argmax(logits));
    EXPECT_EQ(SampleOne(Options(1.0, 50, 1e-9), logits, {seed, 0}).id, Argmax(logits));
  }
}

TEST(Sampler, SameSeedGivesSameTokens) {
  const std::vector<float> logits = RandomLogits(300, 5, 0.3f);
  for (const SamplingOptions& options : {Options(1.0), Options(0.8, 40), Options(1.0, 0, 0.9)}) {
    EXPECT_EQ(DrawSteps(options, logits, 200), DrawSteps(options, logits, 200));
  }
}

TEST(Sampler, DifferentSeedsGiveDifferentTokens) {
  const std::vector<float> logits(100, 0.0f);  // uniform: two seeds agree 1 time in 100
  const std::vector<int32_t> a = DrawSteps(Options(1.0, 0, 1.0, 1), logits, 200);
  const std::vector<int32_t> b = DrawSteps(Options(1.0, 0, 1.0, 2), logits, 200);
  int64_t differ = 0;
  for (size_t i = 0; i < a.size(); ++i) differ += a[i] != b[i];
  EXPECT_GT(differ, 180);
}

// Every option path, each row alone and inside batches that hold it at another position
// beside other sequences: its token depends on its logits and key alone.
TEST(Sampler, DrawDependsOnSequenceIndexNotBatchPosition) {
  const int64_t vocab = 2000, rows = 6;
  std::vector<float> logits;
  std::vector<SampleKey> keys;
  for (int64_t b = 0; b < rows; ++b) {
    const std::vector<float> row = RandomLogits(vocab, 100 + b, 2.0f);
    logits.insert(logits.end(), row.begin(), row.end());
    keys.push_back({b * 3 + 1, b % 2 ? 5 : 11});
  }
  for (const SamplingOptions& options : {Options(1.0), Options(1.3, 30), Options(0.9, 0, 0.8)}) {
    Sampler sampler(options, vocab);
    std::vector<SampledToken> batch(rows), reversed(rows), alone(1);
    ASSERT_TRUE(sampler.Sample(logits, keys, absl::MakeSpan(batch)).ok());
    std::vector<float> reversed_logits;
    std::vector<SampleKey> reversed_keys(keys.rbegin(), keys.rend());
    for (int64_t b = rows - 1; b >= 0; --b) {
      reversed_logits.insert(reversed_logits.end(), logits.begin() + b * vocab,
                             logits.begin() + (b + 1) * vocab);
    }
    ASSERT_TRUE(sampler.Sample(reversed_logits, reversed_keys, absl::MakeSpan(reversed)).ok());
    for (int64_t b = 0; b < rows; ++b) {
      absl::Span<const float> row(logits.data() + b * vocab, vocab);
      ASSERT_TRUE(sampler.Sample(row, {&keys[b], 1}, absl::MakeSpan(alone)).ok());
      EXPECT_EQ(batch[b].id, alone[0].id) << "row " << b;
      EXPECT_EQ(batch[b].id, reversed[rows - 1 - b].id) << "row " << b;
      EXPECT_EQ(batch[b].logprob, alone[0].logprob) << "row " << b;
    }
  }
}

TEST(Sampler, SameTokensWithOneThreadOrMany) {
  const int64_t vocab = 1000, rows = 16;
  std::vector<float> logits;
  std::vector<SampleKey> keys;
  for (int64_t b = 0; b < rows; ++b) {
    const std::vector<float> row = RandomLogits(vocab, 200 + b);
    logits.insert(logits.end(), row.begin(), row.end());
    keys.push_back({b, 3});
  }
  Sampler sampler(Options(1.0, 0, 0.95), vocab);
  std::vector<SampledToken> one(rows), many(rows);
  const int threads = omp_get_max_threads();
  omp_set_num_threads(1);
  ASSERT_TRUE(sampler.Sample(logits, keys, absl::MakeSpan(one)).ok());
  omp_set_num_threads(4);
  ASSERT_TRUE(sampler.Sample(logits, keys, absl::MakeSpan(many)).ok());
  omp_set_num_threads(threads);
  for (int64_t b = 0; b < rows; ++b) EXPECT_EQ(one[b].id, many[b].id) << "row " << b;
}

// The distribution the options define, computed the plain way: a full sort, the k best,
// the smallest prefix of their renormalised softmax(logits / T) reaching top_p,
// renormalised again. Indexed by id; 0 for tokens that must never be drawn.
std::vector<double> Reference(const std::vector<float>& logits, const SamplingOptions& options) {
  const std::vector<int32_t> ranked = Ranked(logits);
  int64_t k = static_cast<int64_t>(logits.size());
  if (options.top_k > 0) k = std::min(k, options.top_k);
  std::vector<double> weights(k);
  double total = 0;
  for (int64_t i = 0; i < k; ++i) {
    weights[i] = std::exp((logits[ranked[i]] - logits[ranked[0]]) / options.temperature);
    total += weights[i];
  }
  double mass = 0;
  int64_t m = 0;
  while (m < k && mass < options.top_p * total) mass += weights[m++];
  std::vector<double> probs(logits.size(), 0.0);
  for (int64_t i = 0; i < m; ++i) probs[ranked[i]] = weights[i] / mass;
  return probs;
}

// Draws n tokens (sequence i / 100, step i % 100) and checks their histogram against
// Reference() with Pearson's chi-square, binned by `bin` of each id (bins in [0, bins)):
// below the quantile a correct sampler exceeds with probability 1e-6 (Wilson-Hilferty),
// where a wrong distribution lands far above. The draws are seeded, so the test is
// deterministic. Returns the ids drawn.
std::vector<int32_t> ExpectReferenceDistribution(const std::vector<float>& logits,
                                                 const SamplingOptions& options, int64_t n,
                                                 const std::vector<int>& bin, int bins) {
  const std::vector<double> probs = Reference(logits, options);
  std::vector<double> expected(bins, 0.0);
  for (size_t id = 0; id < logits.size(); ++id) expected[bin[id]] += probs[id] * n;
  std::vector<int64_t> counts(bins, 0);
  std::vector<int32_t> ids;
  for (int64_t i = 0; i < n; ++i) {
    const int32_t id = SampleOne(options, logits, {i / 100, i % 100}).id;
    EXPECT_GT(probs[id], 0.0) << "token " << id << " is outside the top-k / nucleus";
    ++counts[bin[id]];
    ids.push_back(id);
  }
  double chi_square = 0;
  int dof = -1;
  for (int b = 0; b < bins; ++b) {
    if (expected[b] == 0) continue;
    chi_square += (counts[b] - expected[b]) * (counts[b] - expected[b]) / expected[b];
    ++dof;
  }
  const double h = 2.0 / (9.0 * dof), z = 4.75;  // the standard normal's 1e-6 upper quantile
  EXPECT_LT(chi_square, dof * std::pow(1 - h + z * std::sqrt(h), 3))
      << dof << " degrees of freedom";
  return ids;
}

std::vector<int> OneBinPerToken(size_t vocab_size) {
  std::vector<int> bin(vocab_size);
  std::iota(bin.begin(), bin.end(), 0);
  return bin;
}

TEST(Sampler, DrawsFollowSoftmaxOfScaledLogits) {
  const std::vector<float> logits = {1.0f, 0.5f, -0.3f, 2.0f, 0.0f, -1.0f};
  ExpectReferenceDistribution(logits, Options(0.8), 20000, OneBinPerToken(6), 6);
}

TEST(Sampler, DrawsFollowRenormalisedTopKThenNucleus) {
  const std::vector<float> logits = {3.0f, 2.5f, 2.0f, 1.0f, 0.5f, 0.0f, -1.0f, 1.5f};
  ExpectReferenceDistribution(logits, Options(1.2, 5, 0.8), 20000, OneBinPerToken(8), 8);
}

TEST(Sampler, TopKNeverPicksOutsideTheKLargest) {
  const std::vector<float> logits = RandomLogits(1000, 11);
  const std::vector<int32_t> ranked = Ranked(logits);
  const std::vector<int32_t> ids = DrawSteps(Options(2.0, 10), logits, 2000);
  for (int32_t id : ids) {
    EXPECT_NE(std::find(ranked.begin(), ranked.begin() + 10, id), ranked.begin() + 10) << id;
  }
  for (int r = 0; r < 10; ++r) {  // and each of them is drawn
    EXPECT_NE(std::find(ids.begin(), ids.end(), ranked[r]), ids.end()) << "rank " << r;
  }
}

// A flat distribution whose nucleus holds hundreds of tokens, more than the sampler's first
// sorted chunk: draws stay inside it, reach its far end, and follow it by rank bucket.
TEST(Sampler, TopPNeverPicksOutsideTheNucleus) {
  const std::vector<float> logits = RandomLogits(5000, 12, 0.5f);
  const SamplingOptions options = Options(1.0, 0, 0.9);
  const std::vector<int32_t> ranked = Ranked(logits);
  const std::vector<double> probs = Reference(logits, options);
  const int64_t nucleus = std::count_if(probs.begin(), probs.end(), [](double p) { return p > 0; });
  ASSERT_GT(nucleus, 1024);
  ASSERT_LT(nucleus, 5000);
  std::vector<int> bin(logits.size());
  for (size_t r = 0; r < ranked.size(); ++r)
    bin[ranked[r]] = static_cast<int>(std::min<int64_t>(10, r * 10 / nucleus));
  ExpectReferenceDistribution(logits, options, 4000, bin, 11);
}

// Four equal logits and top_p = 0.5: the nucleus is the first two in (logit, id) order.
TEST(Sampler, TopPCutsTiedLogitsByLowestId) {
  const std::vector<float> logits(4, 0.0f);
  ExpectReferenceDistribution(logits, Options(1.0, 0, 0.5), 20000, OneBinPerToken(4), 4);
  const std::vector<int32_t> ids = DrawSteps(Options(1.0, 0, 0.5), logits, 200);
  EXPECT_NE(std::find(ids.begin(), ids.end(), 1), ids.end());
}

TEST(Sampler, MaskedTokensAreNeverPicked) {
  std::vector<float> logits = RandomLogits(50, 13);
  for (size_t i = 0; i < logits.size(); i += 2) logits[i] = kMasked;
  for (const SamplingOptions& options : {Options(3.0), Options(3.0, 40), Options(3.0, 0, 0.99)}) {
    for (int64_t step = 0; step < 300; ++step) {
      const SampledToken token = SampleOne(options, logits, {0, step});
      EXPECT_EQ(token.id % 2, 1);
      EXPECT_TRUE(std::isfinite(token.logprob));
    }
  }
}

TEST(Sampler, LogprobIsLogSoftmaxOfUnscaledLogits) {
  const std::vector<float> logits = RandomLogits(1000, 14, 3.0f);
  double sum = 0;
  const double max_logit = *std::max_element(logits.begin(), logits.end());
  for (float x : logits) sum += std::exp(x - max_logit);
  for (const SamplingOptions& options : {Options(0), Options(0.5, 20), Options(2.0, 0, 0.7)}) {
    for (int64_t step = 0; step < 20; ++step) {
      const SampledToken token = SampleOne(options, logits, {2, step});
      EXPECT_NEAR(token.logprob, logits[token.id] - max_logit - std::log(sum), 1e-12);
    }
  }
}

TEST(Sampler, NanLogitIsInvalidArgumentNamingRowAndToken) {
  std::vector<float> logits(2 * 10, 0.0f);
  logits[10 + 7] = std::numeric_limits<float>::quiet_NaN();
  Sampler sampler(Options(1.0), 10);
  const std::vector<SampleKey> keys = {{0, 0}, {4, 9}};
  std::vector<SampledToken> out(2);
  const absl::Status status = sampler.Sample(logits, keys, absl::MakeSpan(out));
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("row 1 (sequence 4, step 9)"), absl::string_view::npos);
  EXPECT_NE(status.message().find("token 7 is nan"), absl::string_view::npos) << status;
}

TEST(Sampler, InfiniteLogitIsInvalidArgument) {
  std::vector<float> logits(10, 0.0f);
  logits[3] = std::numeric_limits<float>::infinity();
  Sampler sampler(Options(0), 10);
  SampledToken out;
  const SampleKey key;
  EXPECT_EQ(sampler.Sample(logits, {&key, 1}, {&out, 1}).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(Sampler, AllMaskedRowIsInvalidArgument) {
  const std::vector<float> logits(10, kMasked);
  Sampler sampler(Options(1.0), 10);
  SampledToken out;
  const SampleKey key;
  const absl::Status status = sampler.Sample(logits, {&key, 1}, {&out, 1});
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("every logit is -inf"), absl::string_view::npos) << status;
}

// The message of ValidateSamplingOptions(options, 100), or "" when valid.
std::string ValidationMessage(const SamplingOptions& options) {
  const absl::Status status = ValidateSamplingOptions(options, 100);
  EXPECT_TRUE(status.ok() || status.code() == absl::StatusCode::kInvalidArgument) << status;
  return std::string(status.message());
}

TEST(SamplingOptionsValidation, DefaultsAndTopKAboveVocabAreValid) {
  EXPECT_EQ(ValidationMessage(SamplingOptions()), "");
  EXPECT_EQ(ValidationMessage(Options(1.0, 1000)), "");
}

TEST(SamplingOptionsValidation, TopPAboveOneNamesTheField) {
  EXPECT_EQ(ValidationMessage(Options(1.0, 0, 1.5)), "sampling.top_p must be in (0, 1]; got 1.5");
  EXPECT_EQ(ValidationMessage(Options(1.0, 0, 0.0)), "sampling.top_p must be in (0, 1]; got 0");
}

TEST(SamplingOptionsValidation, NegativeOrNanTemperatureNamesTheField) {
  EXPECT_EQ(ValidationMessage(Options(-0.5)),
            "sampling.temperature must be finite and >= 0 (0 = greedy); got -0.5");
  EXPECT_EQ(ValidationMessage(Options(std::nan(""))).rfind("sampling.temperature ", 0), 0u);
  EXPECT_EQ(ValidationMessage(Options(std::numeric_limits<double>::infinity()))
                .rfind("sampling.temperature ", 0),
            0u);
}

TEST(SamplingOptionsValidation, NegativeTopKNamesTheField) {
  EXPECT_EQ(ValidationMessage(Options(1.0, -3)), "sampling.top_k must be >= 0 (0 = off); got -3");
}

TEST(SamplingOptionsValidation, ZeroMaxNewTokensNamesTheField) {
  SamplingOptions options;
  options.max_new_tokens = 0;
  EXPECT_EQ(ValidationMessage(options), "sampling.max_new_tokens must be >= 1; got 0");
}

TEST(SamplingOptionsValidation, StopIdOutsideVocabularyNamesTheEntry) {
  SamplingOptions options;
  options.stop_ids = {5, 100};
  EXPECT_EQ(ValidationMessage(options),
            "sampling.stop_ids[1] must be a token id in [0, 100); got 100");
  options.stop_ids = {-1};
  EXPECT_EQ(ValidationMessage(options).rfind("sampling.stop_ids[0] ", 0), 0u);
}

TEST(SamplingOptionsValidation, EmptyStopStringNamesTheEntry) {
  SamplingOptions options;
  options.stop_strings = {"\n\n", ""};
  EXPECT_EQ(ValidationMessage(options).rfind("sampling.stop_strings[1] must not be empty", 0), 0u);
}

}  // namespace
}  // namespace megatrain
