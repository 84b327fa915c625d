// Busy time per stream from a timeline: overlapping spans on one stream count once.
#include "engine/pipeline/pipeline.h"

#include "gtest/gtest.h"

namespace megatrain {
namespace {

TEST(Timeline, UnionLengthCountsOverlapsOnce) {
  EXPECT_DOUBLE_EQ(UnionLength({}), 0);
  EXPECT_DOUBLE_EQ(UnionLength({{0, 2}, {1, 3}, {5, 6}}), 4);
  EXPECT_DOUBLE_EQ(UnionLength({{5, 6}, {0, 10}, {2, 3}}), 10);
  EXPECT_DOUBLE_EQ(UnionLength({{-3, -1}, {-2, 0}}), 3);
}

TEST(Timeline, StreamBusySecondsSplitsByStream) {
  const std::vector<TimelineSpan> t = {{StreamId::kCompute, "fwd 0", 0, 100},
                                       {StreamId::kCompute, "fwd 1", 50, 150},
                                       {StreamId::kH2D, "h2d w 1", 10, 30},
                                       {StreamId::kD2H, "d2h g 1", 200, 201}};
  const std::array<double, kNumStreams> busy = StreamBusySeconds(t);
  EXPECT_DOUBLE_EQ(busy[0], 0.150);
  EXPECT_DOUBLE_EQ(busy[1], 0.020);
  EXPECT_DOUBLE_EQ(busy[2], 0.001);
}

}  // namespace
}  // namespace megatrain
