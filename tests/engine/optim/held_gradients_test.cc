#include "engine/optim/held_gradients.h"

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace megatrain {
namespace {

// Every element comes back within its block's largest magnitude / 65534 (half a level),
// zeros and each block's largest exactly, over magnitudes far apart and a partial last
// block.
TEST(HeldGradients, EachElementIsWithinHalfALevelOfItsBlocksLargest) {
  std::mt19937_64 gen(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int64_t n = 5 * kHeldBlock + 17;
  std::vector<float> x(n);
  for (int64_t i = 0; i < n; ++i) x[i] = normal(gen) * std::pow(10.0f, -(i / kHeldBlock) * 3.0f);
  x[3] = 0.0f;
  std::vector<int16_t> q(n);
  std::vector<float> scales((n + kHeldBlock - 1) / kHeldBlock), back(n);
  EncodeHeld(x.data(), n, q.data(), scales.data());
  DecodeHeld(q.data(), scales.data(), n, back.data());
  for (int64_t b = 0; b < static_cast<int64_t>(scales.size()); ++b) {
    float largest = 0;
    for (int64_t i = b * kHeldBlock; i < std::min(n, (b + 1) * kHeldBlock); ++i) {
      largest = std::max(largest, std::fabs(x[i]));
    }
    EXPECT_EQ(scales[b], largest);
    for (int64_t i = b * kHeldBlock; i < std::min(n, (b + 1) * kHeldBlock); ++i) {
      ASSERT_LE(std::fabs(back[i] - x[i]), largest / 65534.0f * 1.0001f) << i;
      if (std::fabs(x[i]) == largest) {
        EXPECT_NEAR(back[i], x[i], largest * 1e-7f) << i;
      }
    }
  }
  EXPECT_EQ(back[3], 0.0f);
}

// A block holding a NaN or an infinity decodes as NaN (its step's norm is not finite
// either); an all-zero block as zeros; the other blocks are untouched.
TEST(HeldGradients, ANonFiniteBlockDecodesAsNanAndLeavesTheOthers) {
  std::vector<float> x(3 * kHeldBlock, 0.5f);
  x[kHeldBlock + 4] = std::numeric_limits<float>::infinity();
  x[2 * kHeldBlock + 9] = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> zero(kHeldBlock, 0.0f);
  std::vector<int16_t> q(x.size());
  std::vector<float> scales(3), back(x.size());
  EncodeHeld(x.data(), x.size(), q.data(), scales.data());
  DecodeHeld(q.data(), scales.data(), x.size(), back.data());
  EXPECT_EQ(back[0], 0.5f);
  EXPECT_TRUE(std::isnan(back[kHeldBlock]));
  EXPECT_TRUE(std::isnan(back[2 * kHeldBlock]));
  EncodeHeld(zero.data(), kHeldBlock, q.data(), scales.data());
  DecodeHeld(q.data(), scales.data(), kHeldBlock, back.data());
  EXPECT_EQ(back[7], 0.0f);
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
