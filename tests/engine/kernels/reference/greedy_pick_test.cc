#include "engine/kernels/reference/greedy_pick.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "tests/engine/kernels/reference/test_util.h"

namespace megatrain::ref {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNan = std::numeric_limits<double>::quiet_NaN();

struct Picks {
  std::vector<int32_t> ids;  // (B)
  VecF logprobs;             // (B)
};

// GreedyPick over logits (B, V) into fresh outputs.
template <typename T>
Picks RunGreedyPick(const std::vector<T>& logits, int64_t B, int64_t V) {
  Picks r{std::vector<int32_t>(B, 7), VecF(B, 7.0f)};
  GreedyPick(r.ids.data(), r.logprobs.data(), logits.data(), B, V);
  return r;
}

// log softmax(row)[c] by the textbook formula, no max subtracted (fine for |x| <= 3).
double NaiveLogSoftmax(const Vec& logits, int64_t b, int64_t V, int64_t c) {
  double sum = 0.0;
  for (int64_t j = 0; j < V; ++j) sum += std::exp(logits[b * V + j]);
  return std::log(std::exp(logits[b * V + c]) / sum);
}

TEST(GreedyPickTest, PicksTheLargestLogitOfEachRow) {
  std::mt19937_64 rng(80);
  constexpr int64_t B = 6, V = 50;
  const Vec logits = testutil::RandomVec(rng, B * V, -3.0, 3.0);
  const auto got = RunGreedyPick(logits, B, V);
  for (int64_t b = 0; b < B; ++b) {
    int64_t want = 0;
    for (int64_t c = 1; c < V; ++c) {
      if (logits[b * V + c] > logits[b * V + want]) want = c;
    }
    EXPECT_EQ(got.ids[b], want) << "row " << b;
  }
}

TEST(GreedyPickTest, EqualMaximaPickTheLowestIndex) {
  constexpr int64_t V = 6;
  const Vec logits = {1.0,  2.5, 0.0, 2.5, 2.5, -1.0,  // tie at 1, 3, 4
                      0.5,  0.5, 0.5, 0.5, 0.5, 0.5,   // all equal
                      -2.0, 0.0, 0.0, 0.0, 0.0, 3.0};  // the tie is not the maximum
  const auto got = RunGreedyPick(logits, 3, V);
  EXPECT_EQ(got.ids, (std::vector<int32_t>{1, 0, 5}));
  EXPECT_NEAR(got.logprobs[1], -std::log(6.0), 1e-6);
}

TEST(GreedyPickTest, LogprobEqualsIndependentLogSoftmax) {
  std::mt19937_64 rng(81);
  constexpr int64_t B = 4, V = 37;
  const Vec logits = testutil::RandomVec(rng, B * V, -3.0, 3.0);
  const auto got = RunGreedyPick(logits, B, V);
  for (int64_t b = 0; b < B; ++b) {
    EXPECT_NEAR(got.logprobs[b], NaiveLogSoftmax(logits, b, V, got.ids[b]), 1e-6) << "row " << b;
    EXPECT_LE(got.logprobs[b], 0.0f);
  }
}

// Large logits: the max is subtracted before exp, so nothing overflows.
TEST(GreedyPickTest, LargeLogitsDoNotOverflow) {
  const Vec logits = {1000.0, 1001.0, 999.0};
  const auto got = RunGreedyPick(logits, 1, 3);
  EXPECT_EQ(got.ids[0], 1);
  const double want = -std::log(1.0 + std::exp(-1.0) + std::exp(-2.0));
  EXPECT_NEAR(got.logprobs[0], want, 1e-6);
}

// -inf entries are masked tokens: never picked, no probability.
TEST(GreedyPickTest, NegativeInfinityEntriesTakeNoProbability) {
  const Vec logits = {-kInf, 0.0, -kInf, std::log(3.0), -kInf};
  const auto got = RunGreedyPick(logits, 1, 5);
  EXPECT_EQ(got.ids[0], 3);
  EXPECT_NEAR(got.logprobs[0], std::log(3.0 / 4.0), 1e-6);
}

TEST(GreedyPickTest, NanAnywhereGivesMinusOneAndNanLogprob) {
  constexpr int64_t V = 4;
  const Vec logits = {kNan,  1.0,  2.0,   0.0,   // NaN before the maximum
                      1.0,   2.0,  0.0,   kNan,  // NaN after it
                      -kInf, kNan, -kInf, -kInf,
                      1.0,   2.0,  0.0,   0.5};  // a good row beside them is unaffected
  const auto got = RunGreedyPick(logits, 4, V);
  for (int64_t b = 0; b < 3; ++b) {
    EXPECT_EQ(got.ids[b], -1) << "row " << b;
    EXPECT_TRUE(std::isnan(got.logprobs[b])) << "row " << b;
  }
  EXPECT_EQ(got.ids[3], 1);
}

// +inf is overflowed logits, as the host sampler treats it.
TEST(GreedyPickTest, PositiveInfinityGivesMinusOne) {
  const Vec logits = {1.0, kInf, 0.0};
  const auto got = RunGreedyPick(logits, 1, 3);
  EXPECT_EQ(got.ids[0], -1);
  EXPECT_TRUE(std::isnan(got.logprobs[0]));
}

TEST(GreedyPickTest, RowOfOnlyNegativeInfinityGivesMinusOne) {
  const Vec logits = {-kInf, -kInf, -kInf};
  const auto got = RunGreedyPick(logits, 1, 3);
  EXPECT_EQ(got.ids[0], -1);
  EXPECT_TRUE(std::isnan(got.logprobs[0]));
}

TEST(GreedyPickTest, SingleTokenVocabularyPicksItWithLogprobZero) {
  const Vec logits = {-5.0, 0.0, 7.25};  // B = 3 rows of V = 1
  const auto got = RunGreedyPick(logits, 3, 1);
  EXPECT_EQ(got.ids, (std::vector<int32_t>{0, 0, 0}));
  EXPECT_EQ(got.logprobs, (VecF{0.0f, 0.0f, 0.0f}));
}

// Rows of V = 13 and 1029 start at every offset mod 8 (what the CUDA kernel's unaligned
// head and tail cover); the maximum sits in the last logit of each row.
TEST(GreedyPickTest, VocabularyNotAMultipleOfEight) {
  std::mt19937_64 rng(82);
  for (const int64_t V : {13, 1029}) {
    constexpr int64_t B = 9;
    Vec logits = testutil::RandomVec(rng, B * V, -3.0, 3.0);
    for (int64_t b = 0; b < B; ++b) logits[b * V + V - 1] = 4.0;
    const auto got = RunGreedyPick(logits, B, V);
    for (int64_t b = 0; b < B; ++b) {
      EXPECT_EQ(got.ids[b], V - 1) << "V " << V << " row " << b;
      EXPECT_NEAR(got.logprobs[b], NaiveLogSoftmax(logits, b, V, V - 1), 1e-6);
    }
  }
}

// What the GPU backend runs: float logits give the double run's ids and log-probabilities.
TEST(GreedyPickTest, FloatLogitsGiveTheDoubleResults) {
  std::mt19937_64 rng(83);
  constexpr int64_t B = 5, V = 300;
  const Vec logits = testutil::RandomVec(rng, B * V, -8.0, 8.0);
  const auto d = RunGreedyPick(logits, B, V);
  const auto f = RunGreedyPick(testutil::ToFloat(logits), B, V);
  EXPECT_EQ(f.ids, d.ids);
  testutil::ExpectAllNear(f.logprobs, testutil::ToDouble(d.logprobs), 1e-6, 1e-6, "logprobs");
}

TEST(GreedyPickTest, ResultsDoNotDependOnThreadCount) {
  std::mt19937_64 rng(84);
  constexpr int64_t B = 7, V = 101;
  const VecF logits = testutil::ToFloat(testutil::RandomVec(rng, B * V, -3.0, 3.0));
  testutil::ExpectBitIdenticalAcrossThreadCounts([&] {
    const auto r = RunGreedyPick(logits, B, V);
    VecF all = r.logprobs;
    for (int32_t id : r.ids) all.push_back(static_cast<float>(id));
    return all;
  });
}

}  // namespace
}  // namespace megatrain::ref
