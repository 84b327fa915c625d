#include "engine/kernels/reference/linear.h"

#include <gtest/gtest.h>

#include <random>

#include "tests/engine/kernels/reference/test_util.h"

namespace megatrain::ref {
namespace {

constexpr int64_t kN = 4;
constexpr int64_t kIC = 6;
constexpr int64_t kOC = 5;

// out (N, OC) = in (N, IC) W (OC, IC)^T + bias (OC); bias empty means none.
Vec NaiveLinear(const Vec& in, const Vec& W, const Vec& bias, int64_t N, int64_t IC, int64_t OC) {
  Vec out(N * OC);
  for (int64_t i = 0; i < N; ++i) {
    for (int64_t o = 0; o < OC; ++o) {
      double sum = bias.empty() ? 0.0 : bias[o];
      for (int64_t c = 0; c < IC; ++c) sum += in[i * IC + c] * W[o * IC + c];
      out[i * OC + o] = sum;
    }
  }
  return out;
}

TEST(LinearTest, ForwardWithBiasMatchesNaive) {
  std::mt19937_64 rng(20);
  const Vec in = testutil::RandomVec(rng, kN * kIC), W = testutil::RandomVec(rng, kOC * kIC);
  const Vec bias = testutil::RandomVec(rng, kOC);
  Vec out(kN * kOC, 123.0);  // overwritten
  Linear(out.data(), in.data(), W.data(), bias.data(), kN, kIC, kOC, /*accumulate=*/false);
  testutil::ExpectAllNear(out, NaiveLinear(in, W, bias, kN, kIC, kOC), 1e-14, 1e-15, "out");
}

TEST(LinearTest, ForwardWithNullBiasMatchesNaive) {
  std::mt19937_64 rng(21);
  const Vec in = testutil::RandomVec(rng, kN * kIC), W = testutil::RandomVec(rng, kOC * kIC);
  Vec out(kN * kOC, 123.0);
  Linear<double>(out.data(), in.data(), W.data(), /*bias=*/nullptr, kN, kIC, kOC, false);
  testutil::ExpectAllNear(out, NaiveLinear(in, W, {}, kN, kIC, kOC), 1e-14, 1e-15, "out");
}

TEST(LinearTest, ForwardAccumulateAddsToOutputWithAndWithoutBias) {
  std::mt19937_64 rng(22);
  const Vec in = testutil::RandomVec(rng, kN * kIC), W = testutil::RandomVec(rng, kOC * kIC);
  const Vec bias = testutil::RandomVec(rng, kOC);
  const Vec initial = testutil::RandomVec(rng, kN * kOC);
  for (bool with_bias : {false, true}) {
    Vec out = initial;
    Linear(out.data(), in.data(), W.data(), with_bias ? bias.data() : nullptr, kN, kIC, kOC,
           /*accumulate=*/true);
    Vec expected = NaiveLinear(in, W, with_bias ? bias : Vec{}, kN, kIC, kOC);
    for (int64_t i = 0; i < kN * kOC; ++i) expected[i] += initial[i];
    testutil::ExpectAllNear(out, expected, 1e-14, 1e-15, with_bias ? "biased" : "unbiased");
  }
}

TEST(LinearTest, BackwardMatchesFiniteDifferences) {
  std::mt19937_64 rng(23);
  Vec in = testutil::RandomVec(rng, kN * kIC), W = testutil::RandomVec(rng, kOC * kIC);
  Vec bias = testutil::RandomVec(rng, kOC);
  const Vec g = testutil::RandomVec(rng, kN * kOC);
  Vec din(kN * kIC, 99.0), dW(kOC * kIC, 0.0), dbias(kOC, 0.0);
  LinearBackward(din.data(), /*din_accumulate=*/false, dW.data(), dbias.data(), g.data(), in.data(),
                 W.data(), kN, kIC, kOC);
  auto loss = [&] { return testutil::WeightedSum(NaiveLinear(in, W, bias, kN, kIC, kOC), g); };
  testutil::ExpectGradientMatches(&in, din, loss, "din");
  testutil::ExpectGradientMatches(&W, dW, loss, "dW");
  testutil::ExpectGradientMatches(&bias, dbias, loss, "dbias");
}

// din_accumulate adds to din; dW and dbias always add; null din and dbias are skipped.
TEST(LinearTest, BackwardAccumulateSemanticsAndNullOutputs) {
  std::mt19937_64 rng(24);
  const Vec in = testutil::RandomVec(rng, kN * kIC), W = testutil::RandomVec(rng, kOC * kIC);
  const Vec g = testutil::RandomVec(rng, kN * kOC);
  Vec din(kN * kIC, 0.0), dW(kOC * kIC, 0.0), dbias(kOC, 0.0);
  LinearBackward(din.data(), false, dW.data(), dbias.data(), g.data(), in.data(), W.data(), kN, kIC,
                 kOC);

  const Vec din_init = testutil::RandomVec(rng, kN * kIC);
  const Vec dW_init = testutil::RandomVec(rng, kOC * kIC);
  const Vec dbias_init = testutil::RandomVec(rng, kOC);
  Vec din2 = din_init, dW2 = dW_init, dbias2 = dbias_init;
  LinearBackward(din2.data(), /*din_accumulate=*/true, dW2.data(), dbias2.data(), g.data(),
                 in.data(), W.data(), kN, kIC, kOC);
  Vec expected_din = din, expected_dW = dW, expected_dbias = dbias;
  for (int64_t i = 0; i < kN * kIC; ++i) expected_din[i] += din_init[i];
  for (int64_t i = 0; i < kOC * kIC; ++i) expected_dW[i] += dW_init[i];
  for (int64_t o = 0; o < kOC; ++o) expected_dbias[o] += dbias_init[o];
  testutil::ExpectAllNear(din2, expected_din, 1e-14, 1e-15, "din accumulated");
  testutil::ExpectAllNear(dW2, expected_dW, 1e-14, 1e-15, "dW accumulated");
  testutil::ExpectAllNear(dbias2, expected_dbias, 1e-14, 1e-15, "dbias accumulated");

  Vec dW3 = dW_init;
  LinearBackward<double>(/*din=*/nullptr, false, dW3.data(), /*dbias=*/nullptr, g.data(), in.data(),
                         W.data(), kN, kIC, kOC);
  testutil::ExpectAllNear(dW3, expected_dW, 1e-14, 1e-15, "dW with null din and dbias");
}

TEST(LinearTest, FloatMatchesDouble) {
  std::mt19937_64 rng(25);
  const int64_t N = 33, IC = 70, OC = 45;
  const Vec in = testutil::RandomVec(rng, N * IC), W = testutil::RandomVec(rng, OC * IC);
  const Vec bias = testutil::RandomVec(rng, OC), g = testutil::RandomVec(rng, N * OC);
  Vec out(N * OC), din(N * IC), dW(OC * IC, 0.0), dbias(OC, 0.0);
  Linear(out.data(), in.data(), W.data(), bias.data(), N, IC, OC, false);
  LinearBackward(din.data(), false, dW.data(), dbias.data(), g.data(), in.data(), W.data(), N, IC,
                 OC);
  const VecF in_f = testutil::ToFloat(in), W_f = testutil::ToFloat(W);
  const VecF bias_f = testutil::ToFloat(bias), g_f = testutil::ToFloat(g);
  VecF out_f(N * OC), din_f(N * IC), dW_f(OC * IC, 0.0f), dbias_f(OC, 0.0f);
  Linear(out_f.data(), in_f.data(), W_f.data(), bias_f.data(), N, IC, OC, false);
  LinearBackward(din_f.data(), false, dW_f.data(), dbias_f.data(), g_f.data(), in_f.data(),
                 W_f.data(), N, IC, OC);
  testutil::ExpectAllNear(out_f, out, 1e-5, 1e-5, "out");
  testutil::ExpectAllNear(din_f, din, 1e-5, 1e-5, "din");
  testutil::ExpectAllNear(dW_f, dW, 1e-5, 1e-5, "dW");
  testutil::ExpectAllNear(dbias_f, dbias, 1e-5, 1e-5, "dbias");
}

TEST(LinearTest, ForwardAndBackwardAreBitIdenticalAcrossThreadCounts) {
  std::mt19937_64 rng(26);
  const int64_t N = 64, IC = 96, OC = 130;
  const VecF in = testutil::ToFloat(testutil::RandomVec(rng, N * IC));
  const VecF W = testutil::ToFloat(testutil::RandomVec(rng, OC * IC));
  const VecF bias = testutil::ToFloat(testutil::RandomVec(rng, OC));
  const VecF g = testutil::ToFloat(testutil::RandomVec(rng, N * OC));
  testutil::ExpectBitIdenticalAcrossThreadCounts([&] {
    VecF out(N * OC), din(N * IC), dW(OC * IC, 0.0f), dbias(OC, 0.0f);
    Linear(out.data(), in.data(), W.data(), bias.data(), N, IC, OC, false);
    LinearBackward(din.data(), false, dW.data(), dbias.data(), g.data(), in.data(), W.data(), N, IC,
                   OC);
    return testutil::Concat({out, din, dW, dbias});
  });
}

}  // namespace
}  // namespace megatrain::ref
