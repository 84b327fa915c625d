#include "engine/optim/schedule.h"

#include <cmath>

#include "gtest/gtest.h"

namespace megatrain {
namespace {

// lr 2, 10 warmup steps, 110 total: the decay spans steps 10..110.
ScheduleOptions Options(ScheduleType type, double min_lr_ratio = 0.0) {
  return ScheduleOptions{type, 2.0, 10, 110, min_lr_ratio};
}

TEST(ScheduleTest, WarmupIsTheSameForEveryType) {
  for (ScheduleType type :
       {ScheduleType::kConstant, ScheduleType::kLinear, ScheduleType::kCosine}) {
    SCOPED_TRACE(ScheduleTypeName(type));
    EXPECT_EQ(LearningRate(Options(type), 0), 0.0);
    EXPECT_DOUBLE_EQ(LearningRate(Options(type), 5), 1.0);
    EXPECT_DOUBLE_EQ(LearningRate(Options(type), 9), 1.8);
    EXPECT_EQ(LearningRate(Options(type), 10), 2.0);  // end of warmup: the peak
  }
}

TEST(ScheduleTest, ConstantStaysAtPeak) {
  const ScheduleOptions o = Options(ScheduleType::kConstant);
  EXPECT_EQ(LearningRate(o, 60), 2.0);
  EXPECT_EQ(LearningRate(o, 110), 2.0);
  EXPECT_EQ(LearningRate(o, 1000), 2.0);
}

TEST(ScheduleTest, LinearDecaysToZeroAndStays) {
  const ScheduleOptions o = Options(ScheduleType::kLinear);
  EXPECT_DOUBLE_EQ(LearningRate(o, 60), 1.0);
  EXPECT_DOUBLE_EQ(LearningRate(o, 85), 0.5);
  EXPECT_EQ(LearningRate(o, 110), 0.0);
  EXPECT_EQ(LearningRate(o, 150), 0.0);
}

TEST(ScheduleTest, CosineFollowsHalfCosineToZeroAndStays) {
  const ScheduleOptions o = Options(ScheduleType::kCosine);
  EXPECT_DOUBLE_EQ(LearningRate(o, 60), 1.0);
  EXPECT_NEAR(LearningRate(o, 35), 2.0 * 0.5 * (1.0 + std::sqrt(0.5)), 1e-12);
  EXPECT_EQ(LearningRate(o, 110), 0.0);
  EXPECT_EQ(LearningRate(o, 130), 0.0);  // Hugging Face would rise again here
}

TEST(ScheduleTest, MinLrRatioSetsTheFloorOfTheDecay) {
  const ScheduleOptions lin = Options(ScheduleType::kLinear, 0.1);
  EXPECT_EQ(LearningRate(lin, 3), 0.6);  // warmup is unaffected
  EXPECT_EQ(LearningRate(lin, 10), 2.0);
  EXPECT_DOUBLE_EQ(LearningRate(lin, 60), 2.0 * (0.1 + 0.9 * 0.5));
  EXPECT_DOUBLE_EQ(LearningRate(lin, 110), 0.2);
  EXPECT_DOUBLE_EQ(LearningRate(lin, 500), 0.2);
  const ScheduleOptions cos = Options(ScheduleType::kCosine, 0.1);
  EXPECT_DOUBLE_EQ(LearningRate(cos, 60), 2.0 * (0.1 + 0.9 * 0.5));
  EXPECT_DOUBLE_EQ(LearningRate(cos, 110), 0.2);
  EXPECT_DOUBLE_EQ(LearningRate(cos, 500), 0.2);
  EXPECT_EQ(LearningRate(Options(ScheduleType::kConstant, 0.1), 500), 2.0);
}

TEST(ScheduleTest, NoWarmupStartsAtPeak) {
  for (ScheduleType type :
       {ScheduleType::kConstant, ScheduleType::kLinear, ScheduleType::kCosine}) {
    EXPECT_EQ(LearningRate(ScheduleOptions{type, 3e-4, 0, 100}, 0), 3e-4) << ScheduleTypeName(type);
  }
}

TEST(ScheduleTest, WarmupAsLongAsTrainingDoesNotDivideByZero) {
  const ScheduleOptions o{ScheduleType::kLinear, 1.0, 10, 10};
  EXPECT_EQ(LearningRate(o, 10), 0.0);
  const ScheduleOptions c{ScheduleType::kCosine, 1.0, 10, 10};
  EXPECT_EQ(LearningRate(c, 10), 1.0);  // progress 0 at step 10 (max(1, 0) decay steps)
  EXPECT_EQ(LearningRate(c, 11), 0.0);
}

}  // namespace
}  // namespace megatrain
