#include "engine/data/packer.h"

#include <algorithm>
#include <numeric>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace megatrain {
namespace {

// Document d's token k is d * 1000 + k, so every token says where it came from.
std::vector<std::vector<int32_t>> MakeDocs(const std::vector<int>& lengths) {
  std::vector<std::vector<int32_t>> docs;
  for (size_t d = 0; d < lengths.size(); ++d) {
    std::vector<int32_t> doc(lengths[d]);
    for (int k = 0; k < lengths[d]; ++k) doc[k] = static_cast<int32_t>(d * 1000 + k);
    docs.push_back(doc);
  }
  return docs;
}

// Lengths 0..40, some longer than the sequence, one empty, one of a single token.
std::vector<int> Lengths() {
  std::mt19937 rng(7);
  std::vector<int> lengths(20);
  for (int& len : lengths) len = static_cast<int>(rng() % 40) + 2;
  lengths[4] = 0;
  lengths[9] = 1;
  lengths[13] = 37;
  return lengths;
}

// The stream the packing rule defines, written out independently of the packer: every
// token of every document in each epoch's order, with its label and whether it starts a
// document.
struct Expected {
  std::vector<int32_t> tokens, targets;
  std::vector<bool> doc_first;
};

Expected ExpectedStream(const std::vector<std::vector<int32_t>>& docs, uint64_t seed,
                        int64_t epochs) {
  Expected e;
  for (int64_t epoch = 0; epoch < epochs; ++epoch) {
    for (int64_t d : DocumentOrder(static_cast<int64_t>(docs.size()), seed, epoch)) {
      const std::vector<int32_t>& doc = docs[d];
      for (size_t k = 0; k < doc.size(); ++k) {
        e.tokens.push_back(doc[k]);
        e.targets.push_back(k + 1 < doc.size() ? doc[k + 1] : kIgnoreIndex);
        e.doc_first.push_back(k == 0);
      }
    }
  }
  return e;
}

// Checks batch against the expected stream from flat offset `at`; returns the new offset.
size_t CheckBatch(const MicroBatch& b, const Expected& e, size_t at) {
  const int64_t n = b.rows * b.seq_len;
  EXPECT_EQ(b.tokens.size(), static_cast<size_t>(n));
  EXPECT_EQ(b.targets.size(), static_cast<size_t>(n));
  EXPECT_EQ(b.doc_start.size(), static_cast<size_t>(n));
  EXPECT_EQ(b.positions.size(), static_cast<size_t>(n));
  EXPECT_LE(at + n, e.tokens.size()) << "the expected stream is too short";
  for (int64_t i = 0; i < n && at < e.tokens.size(); ++i, ++at) {
    SCOPED_TRACE(testing::Message() << "flat index " << i << ", stream token " << at);
    EXPECT_EQ(b.tokens[i], e.tokens[at]);
    EXPECT_EQ(b.targets[i], e.targets[at]);  // the true next token, or -100 on a doc's last
    const bool segment_start = e.doc_first[at] || i % b.seq_len == 0;
    EXPECT_EQ(b.doc_start[i], segment_start ? i : b.doc_start[i - 1]);
    EXPECT_EQ(b.doc_start[i] / b.seq_len, i / b.seq_len);  // never crosses a row
    EXPECT_EQ(b.positions[i], i - b.doc_start[i]);
    if (testing::Test::HasFailure()) return at;
  }
  return at;
}

TEST(DocumentOrderTest, IsAPermutationThatDependsOnSeedAndEpoch) {
  std::vector<int64_t> order = DocumentOrder(100, 1, 0);
  EXPECT_EQ(order, DocumentOrder(100, 1, 0));
  EXPECT_NE(order, DocumentOrder(100, 2, 0));
  EXPECT_NE(order, DocumentOrder(100, 1, 1));
  std::sort(order.begin(), order.end());
  std::vector<int64_t> iota(100);
  std::iota(iota.begin(), iota.end(), 0);
  EXPECT_EQ(order, iota);
  EXPECT_TRUE(DocumentOrder(0, 1, 0).empty());
  EXPECT_EQ(DocumentOrder(1, 1, 5), std::vector<int64_t>{0});
}

TEST(DocumentOrderTest, IsPinned) {
  // std::mt19937_64 and our shuffle are fully specified, so these hold on every platform;
  // a change here would make old checkpoints resume into different batches.
  EXPECT_EQ(DocumentOrder(8, 42, 0), (std::vector<int64_t>{1, 0, 3, 4, 2, 7, 6, 5}));
  EXPECT_EQ(DocumentOrder(8, 42, 1), (std::vector<int64_t>{0, 4, 7, 5, 6, 2, 3, 1}));
}

TEST(PackerTest, OneRowBatchesFollowThePackingRuleOverThreeEpochs) {
  const std::vector<std::vector<int32_t>> docs = MakeDocs(Lengths());
  Packer packer(docs, 16, 3);
  const Expected e = ExpectedStream(docs, 3, 4);
  size_t at = 0;
  MicroBatch b;
  while (at < static_cast<size_t>(3 * packer.num_tokens())) {
    packer.Next(1, &b);
    at = CheckBatch(b, e, at);
    ASSERT_FALSE(testing::Test::HasFailure());
  }
  EXPECT_EQ(packer.position().epoch, 3);
}

TEST(PackerTest, MultiRowBatchesContinueDocumentsAcrossRows) {
  const std::vector<std::vector<int32_t>> docs = MakeDocs({5, 30, 3});
  Packer packer(docs, 8, 11);
  const Expected e = ExpectedStream(docs, 11, 4);  // 38 tokens an epoch, 144 used
  MicroBatch b;
  size_t at = 0;
  for (int i = 0; i < 6; ++i) {
    packer.Next(3, &b);
    EXPECT_EQ(b.rows, 3);
    EXPECT_EQ(b.seq_len, 8);
    at = CheckBatch(b, e, at);
    ASSERT_FALSE(testing::Test::HasFailure());
  }
}

TEST(PackerTest, LongDocumentSpansRowsWithTargetsAcrossTheBoundary) {
  Packer packer(MakeDocs({10}), 4, 0);
  MicroBatch b;
  packer.Next(2, &b);
  EXPECT_EQ(b.tokens, (std::vector<int32_t>{0, 1, 2, 3, 4, 5, 6, 7}));
  EXPECT_EQ(b.targets, (std::vector<int32_t>{1, 2, 3, 4, 5, 6, 7, 8}));
  EXPECT_EQ(b.doc_start, (std::vector<int32_t>{0, 0, 0, 0, 4, 4, 4, 4}));
  EXPECT_EQ(b.positions, (std::vector<int32_t>{0, 1, 2, 3, 0, 1, 2, 3}));
  EXPECT_EQ(b.num_targets(), 8);
  packer.Next(2, &b);  // the rest of the document, then the next epoch begins
  EXPECT_EQ(b.tokens, (std::vector<int32_t>{8, 9, 0, 1, 2, 3, 4, 5}));
  EXPECT_EQ(b.targets, (std::vector<int32_t>{9, kIgnoreIndex, 1, 2, 3, 4, 5, 6}));
  EXPECT_EQ(b.doc_start, (std::vector<int32_t>{0, 0, 2, 2, 4, 4, 4, 4}));
  EXPECT_EQ(b.positions, (std::vector<int32_t>{0, 1, 0, 1, 0, 1, 2, 3}));
  EXPECT_EQ(b.num_targets(), 7);
  EXPECT_EQ(packer.position().epoch, 1);
}

TEST(PackerTest, SinglePassPadsAfterTheLastDocumentInsteadOfStartingTheNextEpoch) {
  PackOptions options;
  options.single_pass = true;
  options.pad_id = 99;
  Packer packer(TokenDocs::FromVectors(MakeDocs({10})), 4, 0, options);
  MicroBatch b;
  packer.Next(2, &b);
  EXPECT_FALSE(packer.exhausted());
  packer.Next(2, &b);  // the rest of the document, then padding, never token 0 again
  EXPECT_EQ(b.tokens, (std::vector<int32_t>{8, 9, 99, 99, 99, 99, 99, 99}));
  EXPECT_EQ(b.targets, (std::vector<int32_t>{9, kIgnoreIndex, kIgnoreIndex, kIgnoreIndex,
                                             kIgnoreIndex, kIgnoreIndex, kIgnoreIndex,
                                             kIgnoreIndex}));
  EXPECT_EQ(b.doc_start, (std::vector<int32_t>{0, 0, 2, 3, 4, 5, 6, 7}));
  EXPECT_EQ(b.num_targets(), 1);
  EXPECT_TRUE(packer.exhausted());
  packer.Next(1, &b);
  EXPECT_EQ(b.num_targets(), 0);
}

TEST(PackerTest, SameSeedSameBatchesDifferentSeedDifferentOrder) {
  const std::vector<std::vector<int32_t>> docs = MakeDocs(Lengths());
  Packer a(docs, 32, 5), b(docs, 32, 5), c(docs, 32, 6);
  MicroBatch ba, bb, bc;
  bool any_difference = false;
  for (int i = 0; i < 10; ++i) {
    a.Next(2, &ba);
    b.Next(2, &bb);
    c.Next(2, &bc);
    EXPECT_EQ(ba.tokens, bb.tokens);
    EXPECT_EQ(ba.targets, bb.targets);
    EXPECT_EQ(ba.doc_start, bb.doc_start);
    any_difference |= ba.tokens != bc.tokens;
  }
  EXPECT_TRUE(any_difference);
}

void ExpectSameBatch(const MicroBatch& x, const MicroBatch& y) {
  EXPECT_EQ(x.rows, y.rows);
  EXPECT_EQ(x.tokens, y.tokens);
  EXPECT_EQ(x.targets, y.targets);
  EXPECT_EQ(x.doc_start, y.doc_start);
  EXPECT_EQ(x.positions, y.positions);
}

TEST(PackerTest, SeekResumesBitExactlyThroughJson) {
  const std::vector<std::vector<int32_t>> docs = MakeDocs(Lengths());
  // 3 rows of 64 per batch: six batches cross into the second epoch.
  Packer a(docs, 64, 9);
  std::vector<MicroBatch> expected(6);
  for (MicroBatch& b : expected) a.Next(3, &b);
  ASSERT_GE(a.position().epoch, 1);

  Packer b(docs, 64, 9);
  MicroBatch batch;
  for (int i = 0; i < 3; ++i) b.Next(3, &batch);
  const nlohmann::json saved = DataPositionToJson(b.position());
  const absl::StatusOr<DataPosition> loaded = DataPositionFromJson(saved);
  ASSERT_TRUE(loaded.ok()) << loaded.status();

  Packer c(docs, 64, 9);
  ASSERT_TRUE(c.Seek(*loaded).ok());
  for (int i = 3; i < 6; ++i) {
    c.Next(3, &batch);
    ExpectSameBatch(batch, expected[i]);
  }
  EXPECT_EQ(c.position().epoch, a.position().epoch);
  EXPECT_EQ(c.position().doc_cursor, a.position().doc_cursor);
  EXPECT_EQ(c.position().token_offset, a.position().token_offset);
}

TEST(PackerTest, SeekRejectsPositionsFromAnotherDataset) {
  Packer packer(MakeDocs({4, 4, 4}), 4, 1);
  MicroBatch first;
  EXPECT_EQ(packer.Seek(DataPosition{0, 3, 0}).code(), absl::StatusCode::kInvalidArgument);
  const absl::Status offset = packer.Seek(DataPosition{0, 1, 5});
  EXPECT_EQ(offset.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(offset.message().find("has 4 tokens"), absl::string_view::npos) << offset;
  EXPECT_EQ(packer.Seek(DataPosition{-1, 0, 0}).code(), absl::StatusCode::kInvalidArgument);
  // A failed seek leaves the packer where it was.
  packer.Next(1, &first);
  Packer fresh(MakeDocs({4, 4, 4}), 4, 1);
  MicroBatch other;
  fresh.Next(1, &other);
  ExpectSameBatch(first, other);
}

TEST(DataPositionTest, JsonRoundTripAndErrors) {
  const DataPosition p{2, 17, 5};
  const nlohmann::json j = DataPositionToJson(p);
  EXPECT_EQ(j.dump(), R"({"doc_cursor":17,"epoch":2,"token_offset":5})");
  const absl::StatusOr<DataPosition> back = DataPositionFromJson(j);
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->epoch, 2);
  EXPECT_EQ(back->doc_cursor, 17);
  EXPECT_EQ(back->token_offset, 5);

  nlohmann::json missing = j;
  missing.erase("doc_cursor");
  EXPECT_NE(DataPositionFromJson(missing).status().message().find("'doc_cursor' missing"),
            absl::string_view::npos);
  nlohmann::json negative = j;
  negative["epoch"] = -1;
  EXPECT_NE(DataPositionFromJson(negative).status().message().find("'epoch' is -1"),
            absl::string_view::npos);
  nlohmann::json text = j;
  text["token_offset"] = "5";
  EXPECT_EQ(DataPositionFromJson(text).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(DataPositionFromJson(nlohmann::json::array()).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace megatrain
