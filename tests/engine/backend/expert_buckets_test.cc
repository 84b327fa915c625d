// The expert GEMMs' algorithm buckets: every row count has one at or above it, within an
// eighth above 128 rows, and a run meets few of them.
#include "engine/backend/expert_buckets.h"

#include <set>

#include "gtest/gtest.h"

namespace megatrain {
namespace {

TEST(ExpertRowBucket, PowersOfTwoUpTo128RowsThenEighthsOfAnOctave) {
  EXPECT_EQ(ExpertRowBucket(1), 16);
  EXPECT_EQ(ExpertRowBucket(16), 16);
  EXPECT_EQ(ExpertRowBucket(17), 32);
  EXPECT_EQ(ExpertRowBucket(128), 128);
  EXPECT_EQ(ExpertRowBucket(129), 144);
  EXPECT_EQ(ExpertRowBucket(144), 144);
  EXPECT_EQ(ExpertRowBucket(145), 160);
  EXPECT_EQ(ExpertRowBucket(256), 256);
  EXPECT_EQ(ExpertRowBucket(257), 288);
  EXPECT_EQ(ExpertRowBucket(4097), 4608);
}

TEST(ExpertRowBucket, EveryCountFitsItsBucketAndAnOctaveHasAtMostEight) {
  std::set<int64_t> octave;  // the buckets of (4096, 8192]
  for (int64_t rows = 1; rows <= 70000; ++rows) {
    const int64_t b = ExpertRowBucket(rows);
    ASSERT_GE(b, rows);
    if (rows > 128) {
      ASSERT_LE(b, rows + rows / 8 + 1) << rows;
    }
    ASSERT_EQ(ExpertRowBucket(b), b) << rows;  // a bucket is its own bucket
    if (rows > 4096 && rows <= 8192) octave.insert(b);
  }
  EXPECT_EQ(octave.size(), 8u);
}

}  // namespace
}  // namespace megatrain
