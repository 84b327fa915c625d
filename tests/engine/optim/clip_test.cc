#include "engine/optim/clip.h"

#include <omp.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "tests/engine/optim/normal_values.h"

namespace megatrain {
namespace {

TEST(SumOfSquaresTest, EmptyIsZero) { EXPECT_EQ(SumOfSquares(nullptr, 0), 0.0); }

TEST(SumOfSquaresTest, SmallExactValues) {
  const std::vector<float> g = {1.0f, -2.0f, 3.0f, 0.5f};
  EXPECT_EQ(SumOfSquares(g.data(), 4), 14.25);
}

TEST(SumOfSquaresTest, LargeInputMatchesLongDoubleReference) {
  const int64_t n = 3'000'001;
  const std::vector<float> g = Normal(n, 1);
  long double ref = 0;
  for (float x : g) ref += static_cast<long double>(x) * x;
  EXPECT_NEAR(SumOfSquares(g.data(), n), static_cast<double>(ref), 1e-12 * ref);
}

TEST(SumOfSquaresTest, BitIdenticalForOneAndTwoThreads) {
  const int64_t n = 5'000'017;
  const std::vector<float> g = Normal(n, 2);
  const int saved = omp_get_max_threads();
  omp_set_num_threads(1);
  const double one = SumOfSquares(g.data(), n);
  omp_set_num_threads(2);
  const double two = SumOfSquares(g.data(), n);
  omp_set_num_threads(saved);
  EXPECT_EQ(one, two);
}

TEST(ClipCoefficientTest, NormBelowMaxIsNotClipped) {
  EXPECT_EQ(ClipCoefficient(0.5, 1.0), 1.0f);
  EXPECT_EQ(ClipCoefficient(0.0, 1.0), 1.0f);
}

TEST(ClipCoefficientTest, NormAboveMaxScalesToMax) {
  EXPECT_EQ(ClipCoefficient(4.0, 1.0), static_cast<float>(1.0 / (4.0 + 1e-6)));
  EXPECT_NEAR(ClipCoefficient(10.0, 2.0), 0.2f, 1e-7);
}

TEST(ClipCoefficientTest, NormEqualToMaxIsJustBelowOne) {
  // PyTorch's 1e-6 keeps the coefficient a hair under 1 here.
  EXPECT_EQ(ClipCoefficient(1.0, 1.0), static_cast<float>(1.0 / (1.0 + 1e-6)));
}

TEST(ClipCoefficientTest, NonPositiveMaxNormDisablesClipping) {
  EXPECT_EQ(ClipCoefficient(100.0, 0.0), 1.0f);
  EXPECT_EQ(ClipCoefficient(100.0, -1.0), 1.0f);
}

TEST(ClipCoefficientTest, NonFiniteNormsBehaveAsPyTorch) {
  EXPECT_EQ(ClipCoefficient(std::numeric_limits<double>::infinity(), 1.0), 0.0f);
  EXPECT_TRUE(std::isnan(ClipCoefficient(std::nan(""), 1.0)));
}

}  // namespace
}  // namespace megatrain
