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

// GPT-OSS's YaRN (theta 150000, factor 32, beta_fast 32, beta_slow 1, 4096 original
// positions, no truncation) on D = 64: the correction range is dims [8.09, 17.4], so the
// frequencies below it are the plain ones, those above it divided by 32, and those inside
// a blend strictly between the two.
TEST(RopeYarnInvFreqTest, GptOssRampKeepsHighAndInterpolatesLowFrequencies) {
  const int64_t D = 64;
  std::vector<float> plain(D / 2), yarn(D / 2);
  RopeInvFreq(plain.data(), D, 150000.0, false, 1.0, 1.0, 4.0, 8192);
  RopeYarnInvFreq(yarn.data(), D, 150000.0, 32.0, 32.0, 1.0, 4096, /*truncate=*/false);
  for (int64_t j = 0; j <= 8; ++j) EXPECT_EQ(yarn[j], plain[j]) << j;
  for (int64_t j = 18; j < D / 2; ++j) {
    EXPECT_NEAR(yarn[j], plain[j] / 32.0f, 2e-7 * plain[j] / 32.0f) << j;
  }
  for (int64_t j = 9; j <= 17; ++j) {
    EXPECT_LT(yarn[j], plain[j]) << j;
    EXPECT_GT(yarn[j], plain[j] / 32.0f) << j;
  }
}

// truncate rounds the range outwards to whole dimensions: [8, 18] here, so dim 8 keeps its
// plain frequency and dim 18 is fully interpolated.
TEST(RopeYarnInvFreqTest, TruncateRoundsTheRampToWholeDimensions) {
  const int64_t D = 64;
  std::vector<float> plain(D / 2), yarn(D / 2);
  RopeInvFreq(plain.data(), D, 150000.0, false, 1.0, 1.0, 4.0, 8192);
  RopeYarnInvFreq(yarn.data(), D, 150000.0, 32.0, 32.0, 1.0, 4096, /*truncate=*/true);
  EXPECT_EQ(yarn[8], plain[8]);
  EXPECT_LT(yarn[9], plain[9]);
  EXPECT_NEAR(yarn[18], plain[18] / 32.0f, 2e-7 * plain[18] / 32.0f);
  EXPECT_GT(yarn[17], plain[17] / 32.0f);
}

}  // namespace
}  // namespace megatrain::ref
