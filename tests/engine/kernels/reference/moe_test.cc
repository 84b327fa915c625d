// The grouped expert matmuls of reference/moe.h: each expert's rows against a naive double
// loop, its bias on its rows only, the bias gradient as per-expert column sums (experts
// without rows untouched), and null biases leaving the unbiased results bit for bit.
#include "engine/kernels/reference/moe.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "tests/engine/kernels/reference/test_util.h"

namespace megatrain::ref {
namespace {

using Offsets = std::vector<int32_t>;

constexpr int64_t kIC = 5;
constexpr int64_t kOC = 3;

// Expert 0 and 2 without rows, expert 3 with many, the last expert with one row.
const Offsets kUneven = {0, 0, 2, 2, 11, 12};
// The last expert without rows.
const Offsets kLastEmpty = {0, 3, 4, 4};

int64_t Experts(const Offsets& o) { return static_cast<int64_t>(o.size()) - 1; }
int64_t Rows(const Offsets& o) { return o.back(); }

// out (R, OC) = in (R, IC) W_e (OC, IC)^T + bias_e (OC) for the expert e of each row; bias
// empty means none.
Vec NaiveGroupedLinear(const Vec& in, const Vec& W, const Vec& bias, const Offsets& offsets,
                       int64_t IC, int64_t OC) {
  Vec out(Rows(offsets) * OC);
  for (int64_t e = 0; e < Experts(offsets); ++e) {
    for (int64_t r = offsets[e]; r < offsets[e + 1]; ++r) {
      for (int64_t o = 0; o < OC; ++o) {
        double sum = bias.empty() ? 0.0 : bias[e * OC + o];
        for (int64_t c = 0; c < IC; ++c) sum += in[r * IC + c] * W[(e * OC + o) * IC + c];
        out[r * OC + o] = sum;
      }
    }
  }
  return out;
}

// Random in (R, kIC), W (E, kOC, kIC) and bias (E, kOC) drawn from [bias_lo, bias_hi], in
// that order, for the experts of `offsets`.
struct Inputs {
  int64_t E, R;
  Vec in, W, bias;
};

Inputs RandomInputs(std::mt19937_64& rng, const Offsets& offsets, double bias_lo = -1.0,
                    double bias_hi = 1.0) {
  Inputs x{Experts(offsets), Rows(offsets), {}, {}, {}};
  x.in = testutil::RandomVec(rng, x.R * kIC);
  x.W = testutil::RandomVec(rng, x.E * kOC * kIC);
  x.bias = testutil::RandomVec(rng, x.E * kOC, bias_lo, bias_hi);
  return x;
}

TEST(GroupedLinearTest, BiasOfEachExpertGoesToItsRowsOnly) {
  std::mt19937_64 rng(80);
  for (const Offsets& offsets : {kUneven, kLastEmpty}) {
    const Inputs x = RandomInputs(rng, offsets, 1.0, 3.0);
    Vec out(x.R * kOC, 123.0);  // written
    GroupedLinear(out.data(), x.in.data(), x.W.data(), x.bias.data(), offsets.data(), x.E, kIC,
                  kOC);
    testutil::ExpectAllNear(out, NaiveGroupedLinear(x.in, x.W, x.bias, offsets, kIC, kOC), 1e-14,
                            1e-15, "out");
  }
}

// (E, OC, IC) -> (E, IC, OC): each expert's matrix transposed.
Vec InMajor(const Vec& W, int64_t E, int64_t IC, int64_t OC) {
  Vec out(W.size());
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t o = 0; o < OC; ++o) {
      for (int64_t c = 0; c < IC; ++c) out[(e * IC + c) * OC + o] = W[(e * OC + o) * IC + c];
    }
  }
  return out;
}

// GPT-OSS's experts keep their weights input-major: the same products and gradients (the
// weight gradient transposed like the weight), with biases, skipping experts without rows.
TEST(GroupedLinearTest, InputMajorWeightsGiveTheSameResultsAndTransposedGradients) {
  std::mt19937_64 rng(86);
  for (const Offsets& offsets : {kUneven, kLastEmpty}) {
    const auto [E, R, in, W, bias] = RandomInputs(rng, offsets);
    const Vec dout = testutil::RandomVec(rng, R * kOC);
    const Vec Wt = InMajor(W, E, kIC, kOC);
    Vec out(R * kOC), out_t(R * kOC, 5.0), din(R * kIC), din_t(R * kIC, 5.0);
    Vec dW(E * kOC * kIC, 0.5), dW_t = InMajor(dW, E, kIC, kOC), db(E * kOC, 0.25), db_t = db;
    GroupedLinear(out.data(), in.data(), W.data(), bias.data(), offsets.data(), E, kIC, kOC);
    GroupedLinear(out_t.data(), in.data(), Wt.data(), bias.data(), offsets.data(), E, kIC, kOC,
                  /*w_in_major=*/true);
    GroupedLinearBackward(din.data(), dW.data(), db.data(), dout.data(), in.data(), W.data(),
                          offsets.data(), E, kIC, kOC);
    GroupedLinearBackward(din_t.data(), dW_t.data(), db_t.data(), dout.data(), in.data(),
                          Wt.data(), offsets.data(), E, kIC, kOC, /*w_in_major=*/true);
    testutil::ExpectAllNear(out_t, out, 1e-14, 1e-15, "out");
    testutil::ExpectAllNear(din_t, din, 1e-14, 1e-15, "din");
    testutil::ExpectAllNear(dW_t, InMajor(dW, E, kIC, kOC), 1e-14, 1e-15, "dW");
    EXPECT_EQ(db_t, db);
  }
}

// A null bias runs exactly the unbiased per-expert Linear of before.
TEST(GroupedLinearTest, NullBiasIsTheUnbiasedLinearPerExpertBitForBit) {
  std::mt19937_64 rng(81);
  const Offsets& offsets = kUneven;
  const int64_t E = Experts(offsets), R = Rows(offsets);
  const VecF in = testutil::ToFloat(testutil::RandomVec(rng, R * kIC));
  const VecF W = testutil::ToFloat(testutil::RandomVec(rng, E * kOC * kIC));
  const VecF dout = testutil::ToFloat(testutil::RandomVec(rng, R * kOC));
  const VecF dW0 = testutil::ToFloat(testutil::RandomVec(rng, E * kOC * kIC));
  VecF out(R * kOC), din(R * kIC), dW = dW0;
  GroupedLinear<float>(out.data(), in.data(), W.data(), nullptr, offsets.data(), E, kIC, kOC);
  GroupedLinearBackward<float>(din.data(), dW.data(), nullptr, dout.data(), in.data(), W.data(),
                               offsets.data(), E, kIC, kOC);
  VecF want_out(R * kOC), want_din(R * kIC), want_dW = dW0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t r0 = offsets[e], rows = offsets[e + 1] - r0;
    if (rows == 0) continue;
    Linear<float>(&want_out[r0 * kOC], &in[r0 * kIC], &W[e * kOC * kIC], nullptr, rows, kIC, kOC,
                  false);
    LinearBackward<float>(&want_din[r0 * kIC], false, &want_dW[e * kOC * kIC], nullptr,
                          &dout[r0 * kOC], &in[r0 * kIC], &W[e * kOC * kIC], rows, kIC, kOC);
  }
  EXPECT_TRUE(testutil::BitIdentical(out, want_out));
  EXPECT_TRUE(testutil::BitIdentical(din, want_din));
  EXPECT_TRUE(testutil::BitIdentical(dW, want_dW));
}

TEST(GroupedLinearTest, BackwardWithBiasMatchesFiniteDifferences) {
  std::mt19937_64 rng(82);
  for (const Offsets& offsets : {kUneven, kLastEmpty}) {
    Inputs x = RandomInputs(rng, offsets);
    const Vec g = testutil::RandomVec(rng, x.R * kOC);
    Vec din(x.R * kIC, 99.0), dW(x.E * kOC * kIC, 0.0), dbias(x.E * kOC, 0.0);
    GroupedLinearBackward(din.data(), dW.data(), dbias.data(), g.data(), x.in.data(), x.W.data(),
                          offsets.data(), x.E, kIC, kOC);
    auto loss = [&] {
      return testutil::WeightedSum(NaiveGroupedLinear(x.in, x.W, x.bias, offsets, kIC, kOC), g);
    };
    testutil::ExpectGradientMatches(&x.in, din, loss, "din");
    testutil::ExpectGradientMatches(&x.W, dW, loss, "dW");
    testutil::ExpectGradientMatches(&x.bias, dbias, loss, "dbias");
  }
}

// dbias_e += the column sums of expert e's rows of dout; an expert without rows keeps its
// gradient bits (here -0.0, which adding a zero sum would turn into +0.0).
TEST(GroupedLinearTest, BiasGradientAddsPerExpertColumnSumsAndLeavesEmptyExperts) {
  std::mt19937_64 rng(83);
  const Offsets offsets = {0, 0, 700, 700, 703, 1000};  // empty, many, empty, 3, last
  const int64_t E = Experts(offsets), R = Rows(offsets), OC = 70;
  const Vec in = testutil::RandomVec(rng, R * kIC), W = testutil::RandomVec(rng, E * OC * kIC);
  const Vec dout = testutil::RandomVec(rng, R * OC);
  Vec dbias0 = testutil::RandomVec(rng, E * OC);
  for (int64_t o = 0; o < OC; ++o) dbias0[0 * OC + o] = dbias0[2 * OC + o] = -0.0;
  Vec din(R * kIC), dW(E * OC * kIC), dbias = dbias0;
  GroupedLinearBackward(din.data(), dW.data(), dbias.data(), dout.data(), in.data(), W.data(),
                        offsets.data(), E, kIC, OC);
  Vec want = dbias0;
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t o = 0; o < OC; ++o) {
      double sum = 0.0;
      for (int64_t r = offsets[e]; r < offsets[e + 1]; ++r) sum += dout[r * OC + o];
      if (offsets[e + 1] > offsets[e]) want[e * OC + o] += sum;
    }
  }
  testutil::ExpectAllNear(dbias, want, 1e-13, 1e-13, "dbias");
  for (int64_t e : {0, 2}) {
    EXPECT_TRUE(testutil::BitIdentical(Vec(&dbias[e * OC], &dbias[(e + 1) * OC]),
                                       Vec(&dbias0[e * OC], &dbias0[(e + 1) * OC])))
        << "expert " << e << " has no rows";
  }
}

// The bias gradient touches neither din nor dW.
TEST(GroupedLinearTest, BiasChangesNothingButItsOwnTerms) {
  std::mt19937_64 rng(84);
  const Offsets& offsets = kUneven;
  const int64_t E = Experts(offsets), R = Rows(offsets);
  const Vec in = testutil::RandomVec(rng, R * kIC), W = testutil::RandomVec(rng, E * kOC * kIC);
  const Vec dout = testutil::RandomVec(rng, R * kOC);
  Vec din_a(R * kIC), dW_a(E * kOC * kIC), din_b(R * kIC), dW_b(E * kOC * kIC), dbias(E * kOC);
  GroupedLinearBackward<double>(din_a.data(), dW_a.data(), nullptr, dout.data(), in.data(),
                                W.data(), offsets.data(), E, kIC, kOC);
  GroupedLinearBackward(din_b.data(), dW_b.data(), dbias.data(), dout.data(), in.data(), W.data(),
                        offsets.data(), E, kIC, kOC);
  EXPECT_TRUE(testutil::BitIdentical(din_a, din_b));
  EXPECT_TRUE(testutil::BitIdentical(dW_a, dW_b));
}

TEST(GroupedLinearTest, BiasGradientIsBitIdenticalAcrossThreadCounts) {
  std::mt19937_64 rng(85);
  const Offsets offsets = {0, 500, 500, 1300, 1301};
  const int64_t E = Experts(offsets), R = Rows(offsets), OC = 200;
  const VecF in = testutil::ToFloat(testutil::RandomVec(rng, R * kIC));
  const VecF W = testutil::ToFloat(testutil::RandomVec(rng, E * OC * kIC));
  const VecF bias = testutil::ToFloat(testutil::RandomVec(rng, E * OC));
  const VecF dout = testutil::ToFloat(testutil::RandomVec(rng, R * OC));
  testutil::ExpectBitIdenticalAcrossThreadCounts([&] {
    VecF out(R * OC), din(R * kIC), dW(E * OC * kIC), dbias(E * OC);
    GroupedLinear(out.data(), in.data(), W.data(), bias.data(), offsets.data(), E, kIC, OC);
    GroupedLinearBackward(din.data(), dW.data(), dbias.data(), dout.data(), in.data(), W.data(),
                          offsets.data(), E, kIC, OC);
    return testutil::Concat({out, din, dW, dbias});
  });
}

}  // namespace
}  // namespace megatrain::ref
