#include "engine/kernels/reference/lora.h"

#include <gtest/gtest.h>

#include <random>

#include "tests/engine/kernels/reference/test_util.h"

namespace megatrain::ref {
namespace {

constexpr int64_t kN = 5, kIC = 7, kOC = 4, kR = 3;
constexpr int64_t kLd = 9;   // y is a column slice of a fused (N, 9) output, from column 2
constexpr int64_t kCol = 2;
constexpr double kScale = 0.75;

// y (N, ld) columns [col, col + OC) += scale * (x A^T) B^T, the rest unchanged.
Vec NaiveLora(Vec y, const Vec& x, const Vec& A, const Vec& B) {
  for (int64_t i = 0; i < kN; ++i) {
    for (int64_t o = 0; o < kOC; ++o) {
      double sum = 0;
      for (int64_t j = 0; j < kR; ++j) {
        double t = 0;
        for (int64_t c = 0; c < kIC; ++c) t += x[i * kIC + c] * A[j * kIC + c];
        sum += kScale * t * B[o * kR + j];
      }
      y[i * kLd + kCol + o] += sum;
    }
  }
  return y;
}

struct Inputs {
  Vec y, x, A, B, dy;
};

Inputs Random(uint64_t seed) {
  std::mt19937_64 rng(seed);
  return Inputs{testutil::RandomVec(rng, kN * kLd), testutil::RandomVec(rng, kN * kIC),
                testutil::RandomVec(rng, kR * kIC), testutil::RandomVec(rng, kOC * kR),
                testutil::RandomVec(rng, kN * kLd)};
}

TEST(LoraTest, ForwardAddsTheScaledLowRankProductToItsColumnsAlone) {
  const Inputs in = Random(1);
  Vec y = in.y, t(kN * kR);
  LoraForward(y.data() + kCol, kLd, t.data(), in.x.data(), in.A.data(), in.B.data(), kN, kIC,
              kOC, kR, kScale);
  testutil::ExpectAllNear(y, NaiveLora(in.y, in.x, in.A, in.B), 1e-13, 1e-14, "y");
}

// dx, dA and dB against central differences of sum(y * dy) over the slice; dx and the
// weight gradients add to what they held (t, scratch, is computed again).
TEST(LoraTest, BackwardMatchesFiniteDifferencesAndAccumulates) {
  Inputs in = Random(2);
  auto loss = [&] {
    const Vec y = NaiveLora(Vec(kN * kLd, 0.0), in.x, in.A, in.B);
    return testutil::WeightedSum(y, in.dy);
  };
  Vec t(kN * kR), dt(kN * kR);
  std::mt19937_64 rng(3);
  const Vec dx0 = testutil::RandomVec(rng, kN * kIC), dA0 = testutil::RandomVec(rng, kR * kIC),
            dB0 = testutil::RandomVec(rng, kOC * kR);
  Vec dx = dx0, dA = dA0, dB = dB0;
  LoraBackward(dx.data(), dA.data(), dB.data(), t.data(), dt.data(), in.dy.data() + kCol, kLd,
               in.x.data(), in.A.data(), in.B.data(), kN, kIC, kOC, kR, kScale);
  for (size_t i = 0; i < dx.size(); ++i) dx[i] -= dx0[i];
  for (size_t i = 0; i < dA.size(); ++i) dA[i] -= dA0[i];
  for (size_t i = 0; i < dB.size(); ++i) dB[i] -= dB0[i];
  testutil::ExpectGradientMatches(&in.x, dx, loss, "dx");
  testutil::ExpectGradientMatches(&in.A, dA, loss, "dA");
  testutil::ExpectGradientMatches(&in.B, dB, loss, "dB");
}

}  // namespace
}  // namespace megatrain::ref
