#include "engine/kernels/reference/rope.h"

#include <gtest/gtest.h>

#include <vector>

namespace megatrain::ref {
namespace {

TEST(RopeInvFreqTest, DefaultIsThetaToTheMinusTwoJOverD) {
  std::vector<float> inv(4);
  RopeInvFreq(inv.data(), 8, 10000.0, /*llama3=*/false, 8.0, 1.0, 4.0, 8192);
  EXPECT_FLOAT_EQ(inv[0], 1.0f);
  EXPECT_FLOAT_EQ(inv[1], 0.1f);
  EXPECT_FLOAT_EQ(inv[2], 0.01f);
  EXPECT_FLOAT_EQ(inv[3], 0.001f);
}

// Llama 3.1 scaling (theta 500000, factor 8, low 1, high 4, original 8192) at D = 128.
// Expected values worked out by hand in double from HF's formula; j = 28 is the last
// unchanged frequency (wavelength 1956 < 2048), j = 29..34 blend, j = 35 onward is divided
// by the factor (wavelength 8219 > 8192).
TEST(RopeInvFreqTest, Llama3ScalingMatchesHandComputedValues) {
  std::vector<float> inv(64);
  RopeInvFreq(inv.data(), 128, 500000.0, /*llama3=*/true, 8.0, 1.0, 4.0, 8192);
  const struct {
    int j;
    double expected;
  } cases[] = {
      {0, 1.0},                      // high frequency, unchanged
      {1, 0.8146172338565447},       // 500000^(-2/128)
      {28, 0.0032114459947525913},   // unchanged
      {29, 0.002166570763503359},    // smooth = 0.8036
      {30, 0.0013718935677611381},   // smooth = 0.5928
      {34, 0.00017850781276799638},  // smooth = 0.0745
      {35, 9.556212353964683e-05},   // inv / 8
      {63, 3.068925988914511e-07},   // inv / 8
  };
  for (const auto& c : cases) {
    EXPECT_NEAR(inv[c.j], c.expected, 2e-6 * c.expected) << "j = " << c.j;
  }
}

TEST(RopeInvFreqTest, Llama3FlagOffIgnoresScalingParameters) {
  std::vector<float> plain(64), ignored(64);
  RopeInvFreq(plain.data(), 128, 500000.0, false, 1.0, 1.0, 4.0, 8192);
  RopeInvFreq(ignored.data(), 128, 500000.0, false, 32.0, 2.0, 8.0, 4096);
  EXPECT_EQ(plain, ignored);
  EXPECT_NEAR(plain[63], 3.068925988914511e-07 * 8.0, 2e-6 * 3.068925988914511e-07 * 8.0);
}

}  // namespace
}  // namespace megatrain::ref
