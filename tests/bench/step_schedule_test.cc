// The ideal schedule's step, on cases small enough to work out by hand.
#include "bench/step_schedule.h"

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

TEST(StepSchedule, ASlabPoolOfOnePacesEachGradientByThePreviousUpdate) {
  // Two layers (backward 1, download 0.5, update 2) under a head of 1 s. As many slabs as
  // wanted: a step of 6.5 s (L2's update is preempted by L1's, which the next forward needs
  // first). One slab: each gradient crosses only once the one before it is updated, so L1
  // lands at 12 of a step starting at 7 (head 8, L2 9.5, updated by 11.5), the embedding's
  // once L1 is updated, at 14: a step of 7 s.
  StepStages s = Stack(2, ScheduleUnit{.backward = 1, .download = 0.5, .optimizer = 2}, 1);
  EXPECT_NEAR(ScheduleStepSeconds(s), 6.5, 1e-9);
  s.slabs = 1;
  EXPECT_NEAR(ScheduleStepSeconds(s), 7, 1e-9);
  // As many slabs as pieces: as if unlimited. With clipping the plan holds every gradient.
  s.slabs = 4;
  EXPECT_NEAR(ScheduleStepSeconds(s), 6.5, 1e-9);
  s.slabs = 1;
  s.clipping = true;
  StepStages unlimited = s;
  unlimited.slabs = 0;
  EXPECT_NEAR(ScheduleStepSeconds(s), ScheduleStepSeconds(unlimited), 1e-9);
}

TEST(StepSchedule, PiecesShareAUnitsDownloadAndUpdate) {
  // A unit's gradient in slab-sized pieces: its update can start on the first piece, so
  // with pieces the single layer's round trip shortens by what overlaps. forward 1 + head 1
  // + backward 1, then download 1 and update 1: in one piece 2 s after the backward; in two,
  // the second half-download (0.5) runs beside the first half-update (0.5): 1.5 s.
  StepStages s = Stack(1, ScheduleUnit{.forward = 1, .backward = 1, .download = 1,
                                       .optimizer = 1},
                       1);
  EXPECT_NEAR(ScheduleStepSeconds(s), 5, 1e-9);
  s.units[1].pieces = 2;
  EXPECT_NEAR(ScheduleStepSeconds(s), 4.5, 1e-9);
  StackTimes times;
  times.layers_backward = 1;
  times.slab_elements = 100;
  const StepStages cut = StackStages({10, 250, 100}, times);
  EXPECT_EQ(cut.units[0].pieces, 1);
  EXPECT_EQ(cut.units[1].pieces, 3);
  EXPECT_EQ(cut.units[2].pieces, 1);
}

TEST(StepSchedule, TwoGradientBuffersHoldTheBackwardToTheDownloads) {
  // Four layers: the top two's gradients take 3 s to cross after 1 s of backward, the bottom
  // two's take none after 2 s. With two device buffers a layer's backward waits until the
  // gradient two layers above it has crossed. Free-running: backward L4 0-1, L3 1-2, L2 2-4,
  // L1 4-6; crossings L4 1-4, L3 4-7, so the last gradient lands at 7. Held: L2 waits for
  // L4's crossing (4-6), L1 for L3's (7-9): the last lands at 9.
  StepStages s;
  s.units.push_back(ScheduleUnit{});
  s.units.push_back(ScheduleUnit{.backward = 2});
  s.units.push_back(ScheduleUnit{.backward = 2});
  s.units.push_back(ScheduleUnit{.backward = 1, .download = 3});
  s.units.push_back(ScheduleUnit{.backward = 1, .download = 3});
  s.units.push_back(ScheduleUnit{});
  EXPECT_NEAR(ScheduleStepSeconds(s), 7, 1e-9);
  s.device_grad_buffers = 2;
  EXPECT_NEAR(ScheduleStepSeconds(s), 9, 1e-9);
}

TEST(StepSchedule, NoUnitsNoStep) { EXPECT_EQ(ScheduleStepSeconds(StepStages{}), 0); }

}  // namespace
}  // namespace megatrain
