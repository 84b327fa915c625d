#include "engine/kernels/reference/swiglu.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "tests/engine/kernels/reference/test_util.h"

namespace megatrain::ref {
namespace {

constexpr int64_t kN = 4;
constexpr int64_t kI = 6;

Vec NaiveSwiGlu(const Vec& gu, int64_t N, int64_t I) {
  Vec out(N * I);
  for (int64_t r = 0; r < N; ++r) {
    for (int64_t c = 0; c < I; ++c) {
      const double gate = gu[r * 2 * I + c], up = gu[r * 2 * I + I + c];
      const double sigmoid = 1.0 / (1.0 + std::exp(-gate));
      out[r * I + c] = gate * sigmoid * up;
    }
  }
  return out;
}

TEST(SwiGluTest, ForwardMatchesNaive) {
  std::mt19937_64 rng(60);
  const Vec gu = testutil::RandomVec(rng, kN * 2 * kI, -4.0, 4.0);
  Vec out(kN * kI);
  SwiGlu(out.data(), gu.data(), kN, kI);
  testutil::ExpectAllNear(out, NaiveSwiGlu(gu, kN, kI), 1e-15, 1e-15, "out");
}

TEST(SwiGluTest, SaturatedGatesGiveZeroOrIdentityWithoutNan) {
  const Vec gu = {-1000.0, 1000.0, 2.0, 3.0};  // one row: gate (2) | up (2)
  Vec out(2), dgu(4);
  const Vec dout = {1.0, 1.0};
  SwiGlu(out.data(), gu.data(), 1, 2);
  SwiGluBackward(dgu.data(), dout.data(), gu.data(), 1, 2);
  EXPECT_EQ(out[0], 0.0);
  EXPECT_EQ(out[1], 3000.0);
  EXPECT_EQ(dgu[0], 0.0);  // d silu -> 0 for very negative gates
  EXPECT_EQ(dgu[1], 3.0);  // d silu -> 1 for very positive gates
  EXPECT_EQ(dgu[2], 0.0);
  EXPECT_EQ(dgu[3], 1000.0);
}

TEST(SwiGluTest, BackwardMatchesFiniteDifferences) {
  std::mt19937_64 rng(61);
  Vec gu = testutil::RandomVec(rng, kN * 2 * kI, -4.0, 4.0);
  const Vec g = testutil::RandomVec(rng, kN * kI);
  Vec dgu(kN * 2 * kI, 5.0);  // written, not accumulated
  SwiGluBackward(dgu.data(), g.data(), gu.data(), kN, kI);
  testutil::ExpectGradientMatches(
      &gu, dgu, [&] { return testutil::WeightedSum(NaiveSwiGlu(gu, kN, kI), g); }, "dgu");
}

TEST(SwiGluTest, FloatMatchesDouble) {
  std::mt19937_64 rng(62);
  const int64_t N = 17, I = 40;
  const Vec gu = testutil::RandomVec(rng, N * 2 * I, -6.0, 6.0);
  const Vec g = testutil::RandomVec(rng, N * I);
  Vec out(N * I), dgu(N * 2 * I);
  SwiGlu(out.data(), gu.data(), N, I);
  SwiGluBackward(dgu.data(), g.data(), gu.data(), N, I);
  const VecF gu_f = testutil::ToFloat(gu), g_f = testutil::ToFloat(g);
  VecF out_f(N * I), dgu_f(N * 2 * I);
  SwiGlu(out_f.data(), gu_f.data(), N, I);
  SwiGluBackward(dgu_f.data(), g_f.data(), gu_f.data(), N, I);
  testutil::ExpectAllNear(out_f, out, 1e-6, 1e-6, "out");
  testutil::ExpectAllNear(dgu_f, dgu, 1e-6, 1e-6, "dgu");
}

TEST(SwiGluTest, ForwardAndBackwardAreBitIdenticalAcrossThreadCounts) {
  std::mt19937_64 rng(63);
  const int64_t N = 67, I = 50;
  const VecF gu = testutil::ToFloat(testutil::RandomVec(rng, N * 2 * I, -6.0, 6.0));
  const VecF g = testutil::ToFloat(testutil::RandomVec(rng, N * I));
  testutil::ExpectBitIdenticalAcrossThreadCounts([&] {
    VecF out(N * I), dgu(N * 2 * I);
    SwiGlu(out.data(), gu.data(), N, I);
    SwiGluBackward(dgu.data(), g.data(), gu.data(), N, I);
    return testutil::Concat({out, dgu});
  });
}

}  // namespace
}  // namespace megatrain::ref
