// DPO's micro-batches (data/pair_packer.h): a pair's two sequences together, each its own
// segment, targets where the next token is a completion token, and the sequence of each
// target; a pair that does not fit ends the micro-batch.
#include "engine/data/pair_packer.h"

#include "engine/common/preference_math.h"
#include "gtest/gtest.h"

namespace megatrain {
namespace {

PreferenceSequence Seq(std::vector<int32_t> ids, std::vector<uint8_t> completion) {
  return PreferenceSequence{std::move(ids), std::move(completion)};
}

TEST(PairPacker, PairsShareAMicroBatchWithTargetsOnTheirCompletions) {
  const std::vector<std::pair<PreferenceSequence, PreferenceSequence>> pairs = {
      {Seq({10, 11, 12}, {0, 1, 1}), Seq({20, 21}, {0, 1})},
      {Seq({30, 31, 32, 33}, {0, 0, 1, 1}), Seq({40, 41, 42, 43}, {0, 0, 0, 1})}};
  PairBatch out;
  // Row 0: pair 0's chosen and rejected; pair 1's chosen takes row 1, its rejected finds
  // no row: the micro-batch holds pair 0 alone.
  ASSERT_EQ(PackPairs(pairs, 0, 2, 6, /*pad_id=*/0, &out), 1);
  const MicroBatch& b = out.batch;
  EXPECT_EQ(b.tokens, (std::vector<int32_t>{10, 11, 12, 20, 21, 0, 0, 0, 0, 0, 0, 0}));
  EXPECT_EQ(b.targets, (std::vector<int32_t>{11, 12, -100, 21, -100, -100, -100, -100, -100,
                                             -100, -100, -100}));
  EXPECT_EQ(out.sequence, (std::vector<int32_t>{0, 0, -1, 1, -1, -1, -1, -1, -1, -1, -1, -1}));
  EXPECT_EQ(b.doc_start, (std::vector<int32_t>{0, 0, 0, 3, 3, 5, 6, 7, 8, 9, 10, 11}));
  EXPECT_EQ(b.positions, (std::vector<int32_t>{0, 1, 2, 0, 1, 0, 0, 0, 0, 0, 0, 0}));
  EXPECT_EQ(out.pair_index, (std::vector<int64_t>{0}));
  EXPECT_EQ(out.completion_tokens, (std::vector<int64_t>{2, 1}));
  EXPECT_EQ(b.num_targets(), 3);

  // The next micro-batch starts at pair 1: one row each.
  ASSERT_EQ(PackPairs(pairs, 1, 2, 6, 0, &out), 1);
  EXPECT_EQ(out.batch.tokens, (std::vector<int32_t>{30, 31, 32, 33, 0, 0, 40, 41, 42, 43, 0, 0}));
  EXPECT_EQ(out.batch.targets, (std::vector<int32_t>{-100, 32, 33, -100, -100, -100, -100, -100,
                                                     43, -100, -100, -100}));
  EXPECT_EQ(out.sequence, (std::vector<int32_t>{-1, 0, 0, -1, -1, -1, -1, -1, 1, -1, -1, -1}));
  EXPECT_EQ(out.pair_index, (std::vector<int64_t>{1}));
}

TEST(PairPacker, APairThatCannotFitAnEmptyMicroBatchIsNotTaken) {
  const std::vector<std::pair<PreferenceSequence, PreferenceSequence>> pairs = {
      {Seq({1, 2, 3, 4}, {0, 1, 1, 1}), Seq({5, 6, 7, 8}, {0, 1, 1, 1})}};
  PairBatch out;
  EXPECT_EQ(PackPairs(pairs, 0, 1, 6, 0, &out), 0);  // 8 tokens, a sequence a row: 2 rows
  EXPECT_EQ(PackPairs(pairs, 0, 1, 8, 0, &out), 1);
  EXPECT_EQ(PackPairs(pairs, 0, 4, 3, 0, &out), 0);  // a sequence longer than a row
}

// Short pairs in a long micro-batch: it ends at the sequences a preference step's
// micro-batch may carry, the rest of its rows padding.
TEST(PairPacker, AMicroBatchHoldsAtMostTheSequencesAStepCarries) {
  const std::vector<std::pair<PreferenceSequence, PreferenceSequence>> pairs(
      kMaxPreferenceSequences, {Seq({1, 2}, {0, 1}), Seq({1, 3}, {0, 1})});
  PairBatch out;
  const int64_t rows = 8, seq_len = 2 * kMaxPreferenceSequences;  // room for every pair
  EXPECT_EQ(PackPairs(pairs, 0, rows, seq_len, 0, &out), kMaxPreferenceSequences / 2);
  EXPECT_EQ(out.completion_tokens.size(), static_cast<size_t>(kMaxPreferenceSequences));
}

}  // namespace
}  // namespace megatrain
