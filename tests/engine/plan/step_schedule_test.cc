// The ideal schedule's step, on cases small enough to work out by hand.
#include "engine/plan/step_schedule.h"

#include "gtest/gtest.h"

namespace megatrain {
namespace {

// An embedding (free), `layers` equal layers, and a head of `head` GPU seconds.
StepStages Stack(int layers, ScheduleUnit layer, double head) {
  StepStages s;
  s.units.push_back(ScheduleUnit{});
  for (int i = 0; i < layers; ++i) s.units.push_back(layer);
  ScheduleUnit h;
  h.forward = head;
  s.units.push_back(h);
  return s;
}

TEST(StepSchedule, OneLayersUpdateSitsBetweenItsBackwardAndTheNextForward) {
  // forward 1 + head 1 + backward 1, then the layer's 0.5 s update before the next forward
  // of it: nothing overlaps it.
  StepStages s = Stack(1, ScheduleUnit{.forward = 1, .backward = 1, .optimizer = 0.5}, 1);
  EXPECT_NEAR(ScheduleStepSeconds(s), 3.5, 1e-9);
  // With clipping the updates also wait for the norm.
  s.clipping = true;
  s.norm = 0.25;
  EXPECT_NEAR(ScheduleStepSeconds(s), 3.75, 1e-9);
}

TEST(StepSchedule, ADeepGpuBoundStackPaysOnlyTheBottomLayersRoundTrip) {
  // 32 layers of 3 GPU seconds; every update hides under the backward but layer 0's:
  // its download, update and upload come after the GPU's last work and before its first.
  const ScheduleUnit layer{.forward = 1, .backward = 2, .download = 0.1, .optimizer = 0.5,
                           .upload = 0.1};
  EXPECT_NEAR(ScheduleStepSeconds(Stack(32, layer, 0)), 96 + 0.7, 1e-9);
}

TEST(StepSchedule, ADeepOptimizerBoundStackKeepsTheOptimizerBusy) {
  // 64 s of updates a step against 19.2 s of GPU: the optimizer waits only for the top
  // layer's forward, the head and the top layer's backward between one step's last
  // update and the next step's first gradient.
  const ScheduleUnit layer{.forward = 0.1, .backward = 0.2, .optimizer = 1};
  EXPECT_NEAR(ScheduleStepSeconds(Stack(64, layer, 0.1)), 64 + 0.1 + 0.1 + 0.2, 1e-9);
}

TEST(StepSchedule, FourLargeLayersCannotHideTheirUpdatesBehindTheGpu) {
  // Mixtral-8x7B's cut of 4 layers at 64K tokens on an H200 (stage times of a 2026-12-02
  // run): the updates of the top layers wait for the whole forward and the head, and the
  // next forward waits for them, so the step is well above the optimizer's 1.8 s, its
  // largest floor, and above the optimizer plus the head.
  const ScheduleUnit layer{.forward = 0.085, .backward = 0.207, .download = 0.11,
                           .optimizer = 0.43, .upload = 0.052};
  StepStages s = Stack(4, layer, 0.08);
  s.units.front().optimizer = s.units.back().optimizer = 0.04;
  const double optimizer = 4 * 0.43 + 0.08;
  const double step = ScheduleStepSeconds(s);
  EXPECT_GT(step, 1.15 * optimizer);
  EXPECT_GT(step, optimizer + 0.08);
  EXPECT_LT(step, 4 * (0.085 + 0.207) + 0.08 + optimizer);  // not everything in series
}

TEST(StepSchedule, NoUnitsNoStep) { EXPECT_EQ(ScheduleStepSeconds(StepStages{}), 0); }

}  // namespace
}  // namespace megatrain
