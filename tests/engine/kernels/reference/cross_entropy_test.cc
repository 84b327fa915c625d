#include "engine/kernels/reference/cross_entropy.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "tests/engine/kernels/reference/test_util.h"

namespace megatrain::ref {
namespace {

constexpr int64_t kN = 5;
constexpr int64_t kV = 7;

// Mean-over-tokens style scale, as the loss layer passes it.
constexpr double kScale = 1.0 / 3.0;

// Row 2 is ignored.
std::vector<int32_t> Targets() { return {3, 0, kIgnoreIndex, 6, 3}; }

// N targets drawn from [0, V), row ignored_row set to kIgnoreIndex.
std::vector<int32_t> RandomTargets(std::mt19937_64& rng, int64_t N, int64_t V,
                                   int64_t ignored_row) {
  std::vector<int32_t> targets(N);
  for (auto& t : targets) t = static_cast<int32_t>(rng() % V);
  targets[ignored_row] = kIgnoreIndex;
  return targets;
}

// loss (N) and, when dlogits is given, scale * (softmax - onehot) (N, V); textbook formulas.
Vec NaiveCrossEntropy(const Vec& logits, const std::vector<int32_t>& targets, int64_t N, int64_t V,
                      Vec* dlogits = nullptr) {
  Vec loss(N, 0.0);
  if (dlogits != nullptr) dlogits->assign(N * V, 0.0);
  for (int64_t i = 0; i < N; ++i) {
    if (targets[i] == kIgnoreIndex) continue;
    double sum = 0.0;
    for (int64_t c = 0; c < V; ++c) sum += std::exp(logits[i * V + c]);
    loss[i] = -std::log(std::exp(logits[i * V + targets[i]]) / sum);
    if (dlogits == nullptr) continue;
    for (int64_t c = 0; c < V; ++c) {
      const double onehot = c == targets[i] ? 1.0 : 0.0;
      (*dlogits)[i * V + c] = kScale * (std::exp(logits[i * V + c]) / sum - onehot);
    }
  }
  return loss;
}

template <typename T>
struct Result {
  std::vector<T> dlogits, loss;  // (N, V), (N)
};

// CrossEntropy over logits (N, V) into fresh outputs, with the loss layer's kScale.
template <typename T>
Result<T> RunCrossEntropy(const std::vector<T>& logits, const std::vector<int32_t>& targets,
                          int64_t N, int64_t V) {
  Result<T> r{std::vector<T>(N * V), std::vector<T>(N)};
  CrossEntropy(r.dlogits.data(), r.loss.data(), logits.data(), targets.data(), N, V, kScale);
  return r;
}

TEST(CrossEntropyTest, LossAndGradientMatchNaive) {
  std::mt19937_64 rng(70);
  const auto targets = Targets();
  const Vec logits = testutil::RandomVec(rng, kN * kV, -3.0, 3.0);
  Vec want_dlogits;
  const Vec want_loss = NaiveCrossEntropy(logits, targets, kN, kV, &want_dlogits);
  const auto got = RunCrossEntropy(logits, targets, kN, kV);
  testutil::ExpectAllNear(got.loss, want_loss, 1e-13, 1e-14, "loss");
  testutil::ExpectAllNear(got.dlogits, want_dlogits, 1e-13, 1e-14, "dlogits");
}

// dlogits is the gradient of scale * sum(loss).
TEST(CrossEntropyTest, GradientMatchesFiniteDifferencesOfScaledLoss) {
  std::mt19937_64 rng(71);
  const auto targets = Targets();
  Vec logits = testutil::RandomVec(rng, kN * kV, -3.0, 3.0);
  const Vec dlogits = RunCrossEntropy(logits, targets, kN, kV).dlogits;
  const Vec scale(kN, kScale);
  testutil::ExpectGradientMatches(
      &logits, dlogits,
      [&] { return testutil::WeightedSum(NaiveCrossEntropy(logits, targets, kN, kV), scale); },
      "dlogits");
}

TEST(CrossEntropyTest, IgnoredRowsGiveZeroLossAndZeroGradient) {
  std::mt19937_64 rng(72);
  const std::vector<int32_t> targets = {kIgnoreIndex, 2, kIgnoreIndex};
  const Vec logits = testutil::RandomVec(rng, 3 * kV, -3.0, 3.0);
  Vec dlogits(3 * kV, 9.0), loss(3, 9.0);  // stale values must be overwritten
  CrossEntropy(dlogits.data(), loss.data(), logits.data(), targets.data(), 3, kV, kScale);
  EXPECT_EQ(loss[0], 0.0);
  EXPECT_EQ(loss[2], 0.0);
  EXPECT_GT(loss[1], 0.0);
  for (int64_t c = 0; c < kV; ++c) {
    EXPECT_EQ(dlogits[c], 0.0);
    EXPECT_EQ(dlogits[2 * kV + c], 0.0);
  }
}

TEST(CrossEntropyTest, InPlaceOverLogitsMatchesSeparateOutput) {
  std::mt19937_64 rng(73);
  const auto targets = Targets();
  const VecF logits = testutil::ToFloat(testutil::RandomVec(rng, kN * kV, -3.0, 3.0));
  const auto separate = RunCrossEntropy(logits, targets, kN, kV);
  VecF buffer = logits, loss_in_place(kN);
  CrossEntropy(buffer.data(), loss_in_place.data(), buffer.data(), targets.data(), kN, kV, kScale);
  EXPECT_TRUE(testutil::BitIdentical(buffer, separate.dlogits));
  EXPECT_TRUE(testutil::BitIdentical(loss_in_place, separate.loss));
}

// A coefficient per row scales that row's gradient (0 zeroes it, a negative one flips it)
// and leaves the loss as it is.
TEST(CrossEntropyTest, RowScalesMultiplyEachRowsGradient) {
  std::mt19937_64 rng(75);
  const auto targets = Targets();
  const Vec logits = testutil::RandomVec(rng, kN * kV, -3.0, 3.0);
  const auto plain = RunCrossEntropy(logits, targets, kN, kV);
  Vec row_scale(kN), dlogits(kN * kV), loss(kN);
  for (int64_t i = 0; i < kN; ++i) row_scale[i] = 0.5 * static_cast<double>(i % 5) - 1.0;
  CrossEntropy<double>(dlogits.data(), loss.data(), logits.data(), targets.data(), kN, kV, kScale,
                       row_scale.data());
  EXPECT_TRUE(testutil::BitIdentical(loss, plain.loss));
  for (int64_t i = 0; i < kN; ++i) {
    for (int64_t c = 0; c < kV; ++c) {
      EXPECT_NEAR(dlogits[i * kV + c], row_scale[i] * plain.dlogits[i * kV + c], 1e-15)
          << "row " << i << ", column " << c;
    }
  }
}

TEST(CrossEntropyTest, NullDlogitsComputesLossOnly) {
  std::mt19937_64 rng(74);
  const auto targets = Targets();
  const Vec logits = testutil::RandomVec(rng, kN * kV, -3.0, 3.0);
  Vec loss(kN);
  CrossEntropy<double>(nullptr, loss.data(), logits.data(), targets.data(), kN, kV, kScale);
  testutil::ExpectAllNear(loss, NaiveCrossEntropy(logits, targets, kN, kV), 1e-13, 1e-14, "loss");
}

// exp(1e4) overflows even in double; the row max keeps everything finite.
TEST(CrossEntropyTest, HugeLogitsStayFinite) {
  const std::vector<int32_t> targets = {1};
  const VecF logits = {10000.0f, 9999.0f, -10000.0f};
  VecF dlogits(3), loss(1);
  CrossEntropy(dlogits.data(), loss.data(), logits.data(), targets.data(), 1, 3, 1.0);
  const double lse = 10000.0 + std::log(1.0 + std::exp(-1.0));
  EXPECT_NEAR(loss[0], lse - 9999.0, 1e-6);
  EXPECT_NEAR(dlogits[0], 1.0 / (1.0 + std::exp(-1.0)), 1e-6);
  EXPECT_NEAR(dlogits[1], std::exp(-1.0) / (1.0 + std::exp(-1.0)) - 1.0, 1e-6);
  EXPECT_EQ(dlogits[2], 0.0f);
}

TEST(CrossEntropyTest, FloatMatchesDouble) {
  std::mt19937_64 rng(75);
  const int64_t N = 6, V = 1000;
  const auto targets = RandomTargets(rng, N, V, /*ignored_row=*/4);
  const Vec logits = testutil::RandomVec(rng, N * V, -8.0, 8.0);
  const auto want = RunCrossEntropy(logits, targets, N, V);
  const auto got = RunCrossEntropy(testutil::ToFloat(logits), targets, N, V);
  testutil::ExpectAllNear(got.loss, want.loss, 1e-6, 1e-6, "loss");
  testutil::ExpectAllNear(got.dlogits, want.dlogits, 1e-5, 1e-9, "dlogits");
}

TEST(CrossEntropyTest, BitIdenticalAcrossThreadCounts) {
  std::mt19937_64 rng(76);
  const int64_t N = 37, V = 300;
  const auto targets = RandomTargets(rng, N, V, /*ignored_row=*/5);
  const VecF logits = testutil::ToFloat(testutil::RandomVec(rng, N * V, -8.0, 8.0));
  testutil::ExpectBitIdenticalAcrossThreadCounts([&] {
    const auto r = RunCrossEntropy(logits, targets, N, V);
    return testutil::Concat({r.dlogits, r.loss});
  });
}

}  // namespace
}  // namespace megatrain::ref
