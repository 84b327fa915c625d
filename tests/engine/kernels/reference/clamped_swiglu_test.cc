#include "engine/kernels/reference/clamped_swiglu.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <utility>
#include <vector>

#include "engine/kernels/reference/swiglu.h"
#include "tests/engine/kernels/reference/test_util.h"

namespace megatrain::ref {
namespace {

constexpr double kAlpha = 1.702;  // GPT-OSS's
constexpr double kLimit = 7.0;
constexpr int64_t kN = 4;
constexpr int64_t kI = 6;

// The tests below write rows as [gate (I) | up (I)] for readability; the op takes
// transformers' interleaving (gate j at column 2j, up j at 2j + 1). These convert.
template <typename V>
V Interleave(const V& split, int64_t N, int64_t I) {
  V out(split.size());
  for (int64_t r = 0; r < N; ++r) {
    for (int64_t c = 0; c < I; ++c) {
      out[r * 2 * I + 2 * c] = split[r * 2 * I + c];
      out[r * 2 * I + 2 * c + 1] = split[r * 2 * I + I + c];
    }
  }
  return out;
}

template <typename V>
V Deinterleave(const V& mixed, int64_t N, int64_t I) {
  V out(mixed.size());
  for (int64_t r = 0; r < N; ++r) {
    for (int64_t c = 0; c < I; ++c) {
      out[r * 2 * I + c] = mixed[r * 2 * I + 2 * c];
      out[r * 2 * I + I + c] = mixed[r * 2 * I + 2 * c + 1];
    }
  }
  return out;
}

template <typename T>
void SplitForward(T* out, const T* split_gu, int64_t N, int64_t I, double alpha, double limit) {
  const std::vector<T> gu = Interleave(std::vector<T>(split_gu, split_gu + N * 2 * I), N, I);
  ClampedSwiGlu(out, gu.data(), N, I, alpha, limit);
}

template <typename T>
void SplitBackward(T* split_dgu, const T* dout, const T* split_gu, int64_t N, int64_t I,
                   double alpha, double limit) {
  const std::vector<T> gu = Interleave(std::vector<T>(split_gu, split_gu + N * 2 * I), N, I);
  std::vector<T> dgu(N * 2 * I);
  ClampedSwiGluBackward(dgu.data(), dout, gu.data(), N, I, alpha, limit);
  const std::vector<T> split = Deinterleave(dgu, N, I);
  std::copy(split.begin(), split.end(), split_dgu);
}

// transformers' GptOssExperts activation, on a row written [gate | up].
Vec NaiveClampedSwiGlu(const Vec& gu, int64_t N, int64_t I, double alpha, double limit) {
  Vec out(N * I);
  for (int64_t r = 0; r < N; ++r) {
    for (int64_t c = 0; c < I; ++c) {
      const double gate = std::min(gu[r * 2 * I + c], limit);
      const double up = std::clamp(gu[r * 2 * I + I + c], -limit, limit);
      const double glu = gate / (1.0 + std::exp(-gate * alpha));
      out[r * I + c] = (up + 1.0) * glu;
    }
  }
  return out;
}

// Uniform in [-12, 12], but at least 1e-3 from the kinks at gate = limit and up = +-limit,
// so that central differences with eps = 1e-6 never straddle one.
Vec AwayFromKinks(std::mt19937_64& rng, int64_t N, int64_t I, double limit) {
  Vec gu = testutil::RandomVec(rng, N * 2 * I, -12.0, 12.0);
  for (int64_t r = 0; r < N; ++r) {
    for (int64_t c = 0; c < 2 * I; ++c) {
      double& x = gu[r * 2 * I + c];
      const bool is_up = c >= I;
      while (std::fabs(x - limit) < 1e-3 || (is_up && std::fabs(x + limit) < 1e-3)) x += 2e-3;
    }
  }
  return gu;
}

// The op's own layout: gate j at column 2j, up j at 2j + 1, in and out.
TEST(ClampedSwiGluTest, ReadsAndWritesTransformersInterleavedColumns) {
  const Vec gu = {0.5, 2.0, -1.0, 3.0};  // gate 0, up 0, gate 1, up 1
  Vec out(2), dgu(4);
  ClampedSwiGlu(out.data(), gu.data(), 1, 2, kAlpha, kLimit);
  const auto glu = [](double g) { return g / (1.0 + std::exp(-kAlpha * g)); };
  EXPECT_DOUBLE_EQ(out[0], 3.0 * glu(0.5));
  EXPECT_DOUBLE_EQ(out[1], 4.0 * glu(-1.0));
  const Vec dout = {1.0, 0.0};
  ClampedSwiGluBackward(dgu.data(), dout.data(), gu.data(), 1, 2, kAlpha, kLimit);
  EXPECT_DOUBLE_EQ(dgu[1], glu(0.5));  // d out_0 / d up_0
  EXPECT_NE(dgu[0], 0.0);              // d out_0 / d gate_0
  EXPECT_EQ(dgu[2], 0.0);              // column 1 has no gradient
  EXPECT_EQ(dgu[3], 0.0);
}

TEST(ClampedSwiGluTest, ForwardMatchesNaiveInsideAndBeyondTheClamps) {
  std::mt19937_64 rng(70);
  const Vec gu = testutil::RandomVec(rng, kN * 2 * kI, -12.0, 12.0);
  Vec out(kN * kI, 9.0);  // written
  SplitForward(out.data(), gu.data(), kN, kI, kAlpha, kLimit);
  testutil::ExpectAllNear(out, NaiveClampedSwiGlu(gu, kN, kI, kAlpha, kLimit), 1e-15, 1e-15, "out");
}

// One row per case: gate (4) | up (4). Inputs at a limit and beyond it give the limit's
// output; below -limit only up is clamped (the gate has no lower clamp).
TEST(ClampedSwiGluTest, ClampEdgesGiveTheLimitsOutput) {
  const Vec gu = {kLimit, kLimit + 0.5, 100.0,   -20.0,           // gate
                  1.0,    1.0,          1.0,     1.0,             // up
                  0.5,    0.5,          0.5,     0.5,             // gate
                  kLimit, kLimit + 3.0, -kLimit, -kLimit - 3.0};  // up
  Vec out(8);
  SplitForward(out.data(), gu.data(), 2, 4, kAlpha, kLimit);
  const double at_limit = 2.0 * kLimit / (1.0 + std::exp(-kAlpha * kLimit));
  EXPECT_DOUBLE_EQ(out[0], at_limit);
  EXPECT_EQ(out[1], out[0]);
  EXPECT_EQ(out[2], out[0]);
  EXPECT_DOUBLE_EQ(out[3], 2.0 * -20.0 / (1.0 + std::exp(20.0 * kAlpha)));  // unclamped
  const double glu = 0.5 / (1.0 + std::exp(-0.5 * kAlpha));
  EXPECT_DOUBLE_EQ(out[4], (kLimit + 1.0) * glu);
  EXPECT_EQ(out[5], out[4]);
  EXPECT_DOUBLE_EQ(out[6], (1.0 - kLimit) * glu);
  EXPECT_EQ(out[7], out[6]);
}

// torch's clamp gradient: it passes at the boundary itself and is zero past it.
TEST(ClampedSwiGluTest, GradientPassesAtTheLimitsInclusiveAndIsZeroBeyond) {
  const double above = std::nextafter(kLimit, 100.0);
  const Vec gu = {kLimit, above, 0.5,    0.5,   0.5,     0.5,      // gate
                  2.0,    2.0,   kLimit, above, -kLimit, -above};  // up
  const Vec dout(6, 1.0);
  Vec dgu(12, 9.0);  // written
  SplitBackward(dgu.data(), dout.data(), gu.data(), 1, 6, kAlpha, kLimit);
  const double sig7 = 1.0 / (1.0 + std::exp(-kAlpha * kLimit));
  EXPECT_DOUBLE_EQ(dgu[0], 3.0 * sig7 * (1.0 + kAlpha * kLimit * (1.0 - sig7)));  // gate = limit
  EXPECT_EQ(dgu[1], 0.0);                                                         // gate past it
  EXPECT_DOUBLE_EQ(dgu[6], kLimit * sig7);  // up, through gate = limit
  EXPECT_DOUBLE_EQ(dgu[7], kLimit * sig7);  // up, through the clamped gate: up still passes
  const double glu = 0.5 / (1.0 + std::exp(-0.5 * kAlpha));
  EXPECT_DOUBLE_EQ(dgu[8], glu);   // up = limit
  EXPECT_EQ(dgu[9], 0.0);          // up past it
  EXPECT_DOUBLE_EQ(dgu[10], glu);  // up = -limit
  EXPECT_EQ(dgu[11], 0.0);         // up below it
  // Where up is clamped the gate still sees (clamped up + 1).
  EXPECT_DOUBLE_EQ(dgu[3], dgu[2]);
  EXPECT_DOUBLE_EQ(dgu[5], dgu[4]);
  EXPECT_DOUBLE_EQ(dgu[4] / dgu[2], (1.0 - kLimit) / (1.0 + kLimit));
}

TEST(ClampedSwiGluTest, BackwardMatchesFiniteDifferencesAwayFromTheKinks) {
  std::mt19937_64 rng(71);
  for (const std::pair<double, double>& params : {std::pair{kAlpha, kLimit}, std::pair{0.8, 3.0}}) {
    const double alpha = params.first, limit = params.second;
    Vec gu = AwayFromKinks(rng, kN, kI, limit);
    const Vec g = testutil::RandomVec(rng, kN * kI);
    Vec dgu(kN * 2 * kI, 5.0);  // written, not accumulated
    SplitBackward(dgu.data(), g.data(), gu.data(), kN, kI, alpha, limit);
    testutil::ExpectGradientMatches(
        &gu, dgu,
        [&] { return testutil::WeightedSum(NaiveClampedSwiGlu(gu, kN, kI, alpha, limit), g); },
        "dgu");
  }
}

// alpha = 1 and no limit is SwiGlu with up shifted by one.
TEST(ClampedSwiGluTest, UnclampedWithUnitAlphaIsSwiGluOfUpPlusOne) {
  std::mt19937_64 rng(72);
  const int64_t N = 5, I = 7;
  const Vec gu = testutil::RandomVec(rng, N * 2 * I, -20.0, 20.0);
  Vec shifted = gu;
  for (int64_t r = 0; r < N; ++r) {
    for (int64_t c = I; c < 2 * I; ++c) shifted[r * 2 * I + c] += 1.0;
  }
  const double inf = std::numeric_limits<double>::infinity();
  const Vec g = testutil::RandomVec(rng, N * I);
  Vec out(N * I), want(N * I), dgu(N * 2 * I), want_dgu(N * 2 * I);
  SplitForward(out.data(), gu.data(), N, I, 1.0, inf);
  SplitBackward(dgu.data(), g.data(), gu.data(), N, I, 1.0, inf);
  SwiGlu(want.data(), shifted.data(), N, I);
  SwiGluBackward(want_dgu.data(), g.data(), shifted.data(), N, I);
  testutil::ExpectAllNear(out, want, 1e-14, 1e-14, "out");
  testutil::ExpectAllNear(dgu, want_dgu, 1e-14, 1e-14, "dgu");
}

TEST(ClampedSwiGluTest, SaturatedGatesGiveZeroWithoutNan) {
  const Vec gu = {-1000.0, -1e300, 3.0, 3.0};  // one row: gate (2) | up (2)
  const Vec dout = {1.0, 1.0};
  Vec out(2), dgu(4);
  SplitForward(out.data(), gu.data(), 1, 2, kAlpha, kLimit);
  SplitBackward(dgu.data(), dout.data(), gu.data(), 1, 2, kAlpha, kLimit);
  for (double v : {out[0], out[1], dgu[0], dgu[1], dgu[2], dgu[3]}) EXPECT_EQ(v, 0.0);
}

TEST(ClampedSwiGluTest, FloatMatchesDouble) {
  std::mt19937_64 rng(73);
  const int64_t N = 17, I = 40;
  const Vec gu = testutil::RandomVec(rng, N * 2 * I, -10.0, 10.0);
  const Vec g = testutil::RandomVec(rng, N * I);
  Vec out(N * I), dgu(N * 2 * I);
  SplitForward(out.data(), gu.data(), N, I, kAlpha, kLimit);
  SplitBackward(dgu.data(), g.data(), gu.data(), N, I, kAlpha, kLimit);
  const VecF gu_f = testutil::ToFloat(gu), g_f = testutil::ToFloat(g);
  VecF out_f(N * I), dgu_f(N * 2 * I);
  SplitForward(out_f.data(), gu_f.data(), N, I, kAlpha, kLimit);
  SplitBackward(dgu_f.data(), g_f.data(), gu_f.data(), N, I, kAlpha, kLimit);
  testutil::ExpectAllNear(out_f, out, 1e-6, 1e-6, "out");
  testutil::ExpectAllNear(dgu_f, dgu, 1e-6, 1e-6, "dgu");
}

TEST(ClampedSwiGluTest, ForwardAndBackwardAreBitIdenticalAcrossThreadCounts) {
  std::mt19937_64 rng(74);
  const int64_t N = 67, I = 50;
  const VecF gu = testutil::ToFloat(testutil::RandomVec(rng, N * 2 * I, -10.0, 10.0));
  const VecF g = testutil::ToFloat(testutil::RandomVec(rng, N * I));
  testutil::ExpectBitIdenticalAcrossThreadCounts([&] {
    VecF out(N * I), dgu(N * 2 * I);
    SplitForward(out.data(), gu.data(), N, I, kAlpha, kLimit);
    SplitBackward(dgu.data(), g.data(), gu.data(), N, I, kAlpha, kLimit);
    return testutil::Concat({out, dgu});
  });
}

}  // namespace
}  // namespace megatrain::ref
