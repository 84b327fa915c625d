// The BPE merge loop: rank order, leftmost-first ties, the same ids for a word short
// enough to merge in place and for one long enough to take the heap, unknown symbols.
#include "engine/data/bpe_model.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace megatrain {
namespace {

BpeModel Create(BpeModelOptions options) {
  absl::StatusOr<BpeModel> model = BpeModel::Create(std::move(options));
  EXPECT_TRUE(model.ok()) << model.status();
  return *std::move(model);
}

std::vector<int32_t> Encode(const BpeModel& model, absl::string_view word) {
  std::vector<int32_t> ids;
  model.EncodeWord(word, &ids);
  return ids;
}

std::string Repeat(absl::string_view text, int times) {
  std::string out;
  for (int i = 0; i < times; ++i) out.append(text.data(), text.size());
  return out;
}

TEST(BpeModelTest, EqualRanksMergeLeftmostFirstInShortAndLongWords) {
  BpeModelOptions options;
  options.vocab = {{"a", 0}, {"aa", 1}};
  options.merges = {{"a", "a"}};
  const BpeModel model = Create(std::move(options));
  EXPECT_EQ(Encode(model, "aaa"), (std::vector<int32_t>{1, 0}));
  for (int size : {5, 63, 64, 65, 201}) {  // around the in-place limit of 64 symbols
    std::vector<int32_t> want(size / 2, 1);
    if (size % 2 == 1) want.push_back(0);
    EXPECT_EQ(Encode(model, Repeat("a", size)), want) << size;
  }
}

TEST(BpeModelTest, LowerRankMergesFirstInShortAndLongWords) {
  BpeModelOptions options;
  options.vocab = {{"a", 0}, {"b", 1}, {"ab", 2}, {"ba", 3}, {"abab", 4}};
  options.merges = {{"b", "a"}, {"a", "b"}, {"ab", "ab"}};
  const BpeModel model = Create(std::move(options));
  // "abab": b+a ranks first, so a [ba] b, and nothing else merges.
  EXPECT_EQ(Encode(model, "abab"), (std::vector<int32_t>{0, 3, 1}));
  for (int times : {2, 40, 100}) {
    std::vector<int32_t> want = {0};
    for (int i = 0; i + 1 < times; ++i) want.push_back(3);
    want.push_back(1);
    EXPECT_EQ(Encode(model, Repeat("ab", times)), want) << times;
  }
}

TEST(BpeModelTest, SymbolsAreCodePointsOfAnyLength) {
  BpeModelOptions options;
  options.vocab = {
      {"\u00e9", 0}, {"\u4e16", 1}, {"\U0001F600", 2}, {"\u4e16\U0001F600", 3}, {"\u2581", 4}};
  options.merges = {{"\u4e16", "\U0001F600"}};
  const BpeModel model = Create(std::move(options));
  EXPECT_EQ(Encode(model, "\u00e9\u4e16\U0001F600\u2581"), (std::vector<int32_t>{0, 3, 4}));
  EXPECT_EQ(Encode(model, Repeat("\u4e16\U0001F600", 50)), std::vector<int32_t>(50, 3));
}

TEST(BpeModelTest, UnknownSymbolsFallBackToBytesOrUnk) {
  BpeModelOptions options;
  options.vocab = {{"a", 0}, {"<unk>", 1}, {"<0xC3>", 2}, {"<0xA9>", 3}};
  options.unk_id = 1;
  BpeModelOptions with_bytes = options;
  with_bytes.byte_fallback = true;
  const BpeModel bytes = Create(std::move(with_bytes));
  EXPECT_EQ(Encode(bytes, "a\u00e9a"), (std::vector<int32_t>{0, 2, 3, 0}));
  EXPECT_EQ(Encode(bytes, "\u4e16"), (std::vector<int32_t>{1}));  // its bytes are not all known
  const BpeModel unk = Create(std::move(options));
  EXPECT_EQ(Encode(unk, "a\u00e9a"), (std::vector<int32_t>{0, 1, 0}));
  // Not UTF-8: "\xC3" leads a two-byte symbol "\xC3a" that is no token.
  EXPECT_EQ(Encode(unk,
                   "\xC3"
                   "a"),
            (std::vector<int32_t>{1}));
}

TEST(BpeModelTest, IgnoreMergesTakesAWordThatIsAToken) {
  BpeModelOptions options;
  options.vocab = {{"a", 0}, {"b", 1}, {"ab", 2}, {"abb", 3}, {"bb", 4}};
  options.merges = {{"b", "b"}, {"a", "b"}};
  BpeModelOptions ignoring = options;
  ignoring.ignore_merges = true;
  EXPECT_EQ(Encode(Create(std::move(options)), "abb"), (std::vector<int32_t>{0, 4}));
  EXPECT_EQ(Encode(Create(std::move(ignoring)), "abb"), (std::vector<int32_t>{3}));
}

}  // namespace
}  // namespace megatrain
