#include "engine/optim/held_gradients.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "engine/common/dtype.h"
#include "gtest/gtest.h"

namespace megatrain {
namespace {

std::vector<float> RoundTrip(const std::vector<float>& x) {
  const int64_t n = static_cast<int64_t>(x.size());
  std::vector<uint16_t> q(n);
  std::vector<float> scales((n + kHeldBlock - 1) / kHeldBlock), back(n);
  EncodeHeld(x.data(), n, q.data(), scales.data());
  DecodeHeld(q.data(), scales.data(), n, back.data());
  return back;
}

// Every element keeps 11 significant bits (a relative error of at most 2^-11) across
// magnitudes far apart, block after block, a partial last block included; powers of two and
// zeros come back exactly; an element 2^-30 below its block's largest (an fp16 subnormal
// after the scale) within 2^-40 of that largest.
TEST(HeldGradients, EachElementKeepsElevenSignificantBits) {
  std::mt19937_64 gen(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int64_t n = 5 * kHeldBlock + 17;
  std::vector<float> x(n);
  for (int64_t i = 0; i < n; ++i) {
    x[i] = normal(gen) * std::pow(10.0f, -static_cast<float>((i / kHeldBlock) * 7) +
                                             static_cast<float>(i % 7));
  }
  x[3] = 0.0f;
  x[5] = 0.25f;
  x[kHeldBlock] = 1.0f;  // this block's largest: 1e6 at most
  x[kHeldBlock + 1] = std::ldexp(1.0f, -30) * 0.7f;
  const std::vector<float> back = RoundTrip(x);
  for (int64_t i = 0; i < n; ++i) {
    if (i == kHeldBlock + 1) continue;
    ASSERT_LE(std::fabs(back[i] - x[i]), std::ldexp(std::fabs(x[i]), -11)) << i << " " << x[i];
  }
  EXPECT_EQ(back[3], 0.0f);
  EXPECT_EQ(back[5], 0.25f);
  EXPECT_EQ(back[kHeldBlock], 1.0f);
  float largest = 0;
  for (int64_t i = kHeldBlock; i < 2 * kHeldBlock; ++i) largest = std::max(largest, std::fabs(x[i]));
  EXPECT_LE(std::fabs(back[kHeldBlock + 1] - x[kHeldBlock + 1]), std::ldexp(largest, -40));
}

// The halves are IEEE fp16, rounded to nearest even: for values already in fp16's range
// the scale is 1 and each element comes back as a half it is nearest to.
TEST(HeldGradients, HalvesRoundToNearestEven) {
  std::vector<float> x(kHeldBlock);
  for (int64_t i = 0; i < kHeldBlock; ++i) x[i] = 16384.0f + 0.37f * static_cast<float>(i * 13);
  x[1] = 16384.0f + 8.0f;   // between 16384 and 16400: a tie, to the even 16384
  x[2] = 16384.0f + 24.0f;  // between 16400 and 16416: a tie, to the even 16416
  const std::vector<float> back = RoundTrip(x);
  EXPECT_EQ(back[1], 16384.0f);
  EXPECT_EQ(back[2], 16416.0f);
  for (int64_t i = 0; i < kHeldBlock; ++i) {
    EXPECT_LE(std::fabs(back[i] - x[i]), 8.0f) << i;  // half of a half's spacing there (16)
    EXPECT_EQ(std::fmod(back[i], 16.0f), 0.0f) << i;
  }
}

// A block holding a NaN or an infinity decodes as NaN (its step's norm is not finite
// either); an all-zero block as zeros; the other blocks are untouched.
TEST(HeldGradients, ANonFiniteBlockDecodesAsNanAndLeavesTheOthers) {
  std::vector<float> x(4 * kHeldBlock, 0.5f);
  x[kHeldBlock + 4] = std::numeric_limits<float>::infinity();
  x[2 * kHeldBlock + 9] = std::numeric_limits<float>::quiet_NaN();
  std::fill(x.begin() + 3 * kHeldBlock, x.end(), 0.0f);
  const std::vector<float> back = RoundTrip(x);
  EXPECT_EQ(back[0], 0.5f);
  EXPECT_TRUE(std::isnan(back[kHeldBlock]));
  EXPECT_TRUE(std::isnan(back[2 * kHeldBlock]));
  EXPECT_EQ(back[3 * kHeldBlock + 7], 0.0f);
}

// Pieces of a unit kept apart by their offsets, each read back as encoded, whatever the
// order they were stored in; a piece never stored is a bug, not a value.
TEST(HeldGradients, PiecesOfAUnitAreKeptApartByOffset) {
  HeldGradients held({1000, 10});
  std::vector<float> a(600, 1.0f), b(400, -2.0f), out(600);
  held.Store(0, 600, 400, b.data());
  held.Store(0, 0, 600, a.data());
  held.Load(0, 0, 600, out.data());
  EXPECT_EQ(out[599], 1.0f);
  held.Load(0, 600, 400, out.data());
  EXPECT_EQ(out[0], -2.0f);
  EXPECT_DEATH(held.Load(1, 0, 10, out.data()), "no piece");
}

}  // namespace
}  // namespace megatrain
