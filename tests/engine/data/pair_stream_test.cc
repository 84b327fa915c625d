// DPO's step source (data/pair_stream.h): every pair once an epoch in the seeded order, a
// micro-batch's pairs where the batch says, and a resumed stream the same as one that ran
// on.
#include "engine/data/pair_stream.h"

#include <algorithm>
#include <memory>
#include <set>
#include <vector>

#include "gtest/gtest.h"

namespace megatrain {
namespace {

// 11 pairs of 2 to 9 tokens a sequence, the ids naming the pair (100 * k + position).
std::shared_ptr<const std::vector<SequencePair>> Pairs() {
  auto pairs = std::make_shared<std::vector<SequencePair>>();
  for (int32_t k = 0; k < 11; ++k) {
    auto seq = [k](int length, int32_t base) {
      PreferenceSequence s;
      for (int j = 0; j < length; ++j) {
        s.ids.push_back(100 * k + base + j);
        s.completion.push_back(j > 0);
      }
      return s;
    };
    pairs->emplace_back(seq(2 + k % 8, 0), seq(3 + (k * 5) % 7, 50));
  }
  return pairs;
}

TEST(PairStream, EachEpochTakesEveryPairOnceInTheSeededOrder) {
  const auto pairs = Pairs();
  PairStream stream(pairs, 12, /*seed=*/4, /*pad_id=*/0);
  for (int64_t epoch = 0; epoch < 2; ++epoch) {
    std::vector<int64_t> seen;
    while (static_cast<int64_t>(seen.size()) < stream.num_pairs()) {
      for (const PairBatch& b : stream.NextStep(2, 2)) {
        for (int64_t k = 0; k < b.pairs(); ++k) {
          const int64_t p = b.pair_index[k];
          // The chosen sequence's first token, where the micro-batch put it, is the pair's.
          const auto first = std::find(b.sequence.begin(), b.sequence.end(), 2 * k);
          ASSERT_NE(first, b.sequence.end());
          const int64_t at = first - b.sequence.begin();
          EXPECT_EQ(b.batch.tokens[at] / 100, p) << "pair " << p;
          if (static_cast<int64_t>(seen.size()) < stream.num_pairs()) seen.push_back(p);
        }
      }
    }
    seen.resize(stream.num_pairs());  // a step may run into the next epoch
    EXPECT_EQ(seen, DocumentOrder(stream.num_pairs(), 4, epoch)) << "epoch " << epoch;
    EXPECT_EQ(std::set<int64_t>(seen.begin(), seen.end()).size(), 11u);
    while (stream.position().epoch == epoch) stream.NextStep(1, 2);
    ASSERT_TRUE(stream.Seek(DataPosition{epoch + 1, 0, 0}).ok());
  }
}

TEST(PairStream, AResumedStreamGivesTheStepsOfOneThatRanOn) {
  const auto pairs = Pairs();
  PairStream ran(pairs, 12, 9, 0), resumed(pairs, 12, 9, 0);
  for (int step = 0; step < 3; ++step) ran.NextStep(2, 2);
  ASSERT_TRUE(resumed.Seek(ran.position()).ok());
  for (int step = 0; step < 5; ++step) {  // across an epoch's end
    const std::vector<PairBatch> a = ran.NextStep(2, 2), b = resumed.NextStep(2, 2);
    ASSERT_EQ(a.size(), b.size());
    for (size_t m = 0; m < a.size(); ++m) {
      EXPECT_EQ(a[m].pair_index, b[m].pair_index) << "step " << step;
      EXPECT_EQ(a[m].batch.tokens, b[m].batch.tokens) << "step " << step;
    }
  }
  EXPECT_GT(ran.position().epoch, 0);
}

TEST(PairStream, SeekRefusesAPositionOfAnotherDataset) {
  PairStream stream(Pairs(), 12, 1, 0);
  for (const DataPosition p : {DataPosition{0, 11, 0}, DataPosition{0, 3, 5},
                               DataPosition{-1, 0, 0}}) {
    const absl::Status s = stream.Seek(p);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("11 pairs"), std::string::npos) << s;
  }
  EXPECT_EQ(stream.position().doc_cursor, 0);
}

}  // namespace
}  // namespace megatrain
