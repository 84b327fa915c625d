#include "engine/kernels/reference/rmsnorm.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "tests/engine/kernels/reference/test_util.h"

namespace megatrain::ref {
namespace {

constexpr int64_t kRows = 5;
constexpr int64_t kC = 12;
constexpr double kEps = 1e-6;

Vec NaiveRmsNorm(const Vec& in, const Vec& w, int64_t rows, int64_t C, Vec* rstd = nullptr) {
  Vec out(rows * C);
  for (int64_t r = 0; r < rows; ++r) {
    double mean_sq = 0.0;
    for (int64_t c = 0; c < C; ++c) mean_sq += in[r * C + c] * in[r * C + c] / C;
    const double s = 1.0 / std::sqrt(mean_sq + kEps);
    if (rstd != nullptr) (*rstd)[r] = s;
    for (int64_t c = 0; c < C; ++c) out[r * C + c] = in[r * C + c] * s * w[c];
  }
  return out;
}

TEST(RmsNormTest, ForwardMatchesNaive) {
  std::mt19937_64 rng(10);
  const Vec in = testutil::RandomVec(rng, kRows * kC, -2.0, 2.0);
  const Vec w = testutil::RandomVec(rng, kC, 0.5, 1.5);
  Vec out(kRows * kC), rstd(kRows), expected_rstd(kRows);
  RmsNorm(out.data(), rstd.data(), in.data(), w.data(), kRows, kC, kEps);
  const Vec expected = NaiveRmsNorm(in, w, kRows, kC, &expected_rstd);
  testutil::ExpectAllNear(out, expected, 1e-14, 1e-15, "out");
  testutil::ExpectAllNear(rstd, expected_rstd, 1e-14, 0, "rstd");
}

// din and dw start at zero here, so the accumulated values are the gradients themselves.
TEST(RmsNormTest, BackwardMatchesFiniteDifferences) {
  std::mt19937_64 rng(11);
  Vec in = testutil::RandomVec(rng, kRows * kC, -2.0, 2.0);
  Vec w = testutil::RandomVec(rng, kC, 0.5, 1.5);
  const Vec g = testutil::RandomVec(rng, kRows * kC);
  Vec out(kRows * kC), rstd(kRows), din(kRows * kC, 0.0), dw(kC, 0.0);
  RmsNorm(out.data(), rstd.data(), in.data(), w.data(), kRows, kC, kEps);
  RmsNormBackward(din.data(), dw.data(), g.data(), in.data(), w.data(), rstd.data(), kRows, kC);
  auto loss = [&] { return testutil::WeightedSum(NaiveRmsNorm(in, w, kRows, kC), g); };
  testutil::ExpectGradientMatches(&in, din, loss, "din");
  testutil::ExpectGradientMatches(&w, dw, loss, "dw");
}

TEST(RmsNormTest, BackwardAccumulatesIntoDinAndDw) {
  std::mt19937_64 rng(12);
  const Vec in = testutil::RandomVec(rng, kRows * kC);
  const Vec w = testutil::RandomVec(rng, kC);
  const Vec g = testutil::RandomVec(rng, kRows * kC);
  Vec out(kRows * kC), rstd(kRows), din0(kRows * kC, 0.0), dw0(kC, 0.0);
  RmsNorm(out.data(), rstd.data(), in.data(), w.data(), kRows, kC, kEps);
  RmsNormBackward(din0.data(), dw0.data(), g.data(), in.data(), w.data(), rstd.data(), kRows, kC);
  const Vec din_init = testutil::RandomVec(rng, kRows * kC);
  const Vec dw_init = testutil::RandomVec(rng, kC);
  Vec din = din_init, dw = dw_init;
  RmsNormBackward(din.data(), dw.data(), g.data(), in.data(), w.data(), rstd.data(), kRows, kC);
  for (int64_t i = 0; i < kRows * kC; ++i) din0[i] += din_init[i];
  for (int64_t c = 0; c < kC; ++c) dw0[c] += dw_init[c];
  testutil::ExpectAllNear(din, din0, 1e-14, 1e-15, "din");
  testutil::ExpectAllNear(dw, dw0, 1e-14, 1e-15, "dw");
}

TEST(RmsNormTest, FloatMatchesDouble) {
  std::mt19937_64 rng(13);
  const int64_t rows = 9, C = 100;
  const Vec in = testutil::RandomVec(rng, rows * C, -3.0, 3.0);
  const Vec w = testutil::RandomVec(rng, C, 0.5, 1.5);
  const Vec g = testutil::RandomVec(rng, rows * C);
  Vec out(rows * C), rstd(rows), din(rows * C, 0.0), dw(C, 0.0);
  RmsNorm(out.data(), rstd.data(), in.data(), w.data(), rows, C, kEps);
  RmsNormBackward(din.data(), dw.data(), g.data(), in.data(), w.data(), rstd.data(), rows, C);
  const VecF in_f = testutil::ToFloat(in), w_f = testutil::ToFloat(w), g_f = testutil::ToFloat(g);
  VecF out_f(rows * C), rstd_f(rows), din_f(rows * C, 0.0f), dw_f(C, 0.0f);
  RmsNorm(out_f.data(), rstd_f.data(), in_f.data(), w_f.data(), rows, C, kEps);
  RmsNormBackward(din_f.data(), dw_f.data(), g_f.data(), in_f.data(), w_f.data(), rstd_f.data(),
                  rows, C);
  testutil::ExpectAllNear(out_f, out, 1e-5, 1e-6, "out");
  testutil::ExpectAllNear(rstd_f, rstd, 1e-6, 0, "rstd");
  testutil::ExpectAllNear(din_f, din, 1e-5, 1e-6, "din");
  testutil::ExpectAllNear(dw_f, dw, 1e-5, 1e-5, "dw");
}

TEST(RmsNormTest, ForwardAndBackwardAreBitIdenticalAcrossThreadCounts) {
  std::mt19937_64 rng(14);
  const int64_t rows = 67, C = 150;  // several column blocks for dw
  const VecF in = testutil::ToFloat(testutil::RandomVec(rng, rows * C));
  const VecF w = testutil::ToFloat(testutil::RandomVec(rng, C));
  const VecF g = testutil::ToFloat(testutil::RandomVec(rng, rows * C));
  testutil::ExpectBitIdenticalAcrossThreadCounts([&] {
    VecF out(rows * C), rstd(rows), din(rows * C, 0.25f), dw(C, 0.25f);
    RmsNorm(out.data(), rstd.data(), in.data(), w.data(), rows, C, kEps);
    RmsNormBackward(din.data(), dw.data(), g.data(), in.data(), w.data(), rstd.data(), rows, C);
    return testutil::Concat({out, rstd, din, dw});
  });
}

}  // namespace
}  // namespace megatrain::ref
