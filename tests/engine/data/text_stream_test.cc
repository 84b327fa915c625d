// TextStream: what it returns id by id adds up to Tokenizer::Decode of all the ids, for the
// byte tokenizer and both BPE kinds (tiny_tokenizers.h): characters cut between ids, the
// space a SentencePiece decoder strips only at the start, bytes that never become valid,
// ids outside the vocab, a window that stays small on long sequences.
#include "engine/data/text_stream.h"

#include <algorithm>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "engine/data/bpe_text.h"
#include "engine/data/byte_tokenizer.h"
#include "gtest/gtest.h"
#include "tests/engine/data/tiny_tokenizers.h"

namespace megatrain {
namespace {

namespace bl = testing::byte_level;
namespace bf = testing::byte_fallback;

std::unique_ptr<HfTokenizer> Load(const nlohmann::json& doc) {
  absl::StatusOr<std::unique_ptr<HfTokenizer>> tok = testing::LoadTokenizerJson(doc);
  EXPECT_TRUE(tok.ok()) << tok.status();
  return tok.ok() ? *std::move(tok) : nullptr;
}

// What Next() returned for each id.
std::vector<std::string> Pieces(const Tokenizer& tok, const std::vector<int32_t>& ids) {
  TextStream stream(tok);
  std::vector<std::string> pieces;
  for (int32_t id : ids) pieces.push_back(stream.Next(id));
  return pieces;
}

// Streams `ids`, checking after every id that the text so far is Decode of the ids so far
// less an incomplete UTF-8 tail, and after Flush() that it is all of Decode.
void ExpectStreamMatchesDecode(const Tokenizer& tok, const std::vector<int32_t>& ids) {
  TextStream stream(tok);
  std::string streamed;
  for (size_t n = 1; n <= ids.size(); ++n) {
    streamed += stream.Next(ids[n - 1]);
    const std::string want = tok.Decode(absl::MakeConstSpan(ids.data(), n));
    ASSERT_LE(streamed.size(), want.size()) << "after " << n << " ids";
    ASSERT_EQ(want.substr(0, streamed.size()), streamed) << "after " << n << " ids";
    ASSERT_EQ(IncompleteUtf8SuffixLength(want), want.size() - streamed.size())
        << "after " << n << " ids";
  }
  streamed += stream.Flush();
  EXPECT_EQ(streamed, tok.Decode(ids));
  EXPECT_EQ(stream.num_ids(), static_cast<int64_t>(ids.size()));
}

TEST(TextStreamTest, CharacterCutBetweenIdsComesOutWhenItsLastByteArrives) {
  const ByteTokenizer bytes;
  EXPECT_EQ(Pieces(bytes, {'a', 0xE4, 0xBD, 0xA0, 'b'}),
            (std::vector<std::string>{"a", "", "", "你", "b"}));
  std::unique_ptr<HfTokenizer> level = Load(testing::ByteLevelTokenizerJson());
  ASSERT_NE(level, nullptr);
  EXPECT_EQ(Pieces(*level, {bl::kHello, bl::kE4Bd, 0xA0}),
            (std::vector<std::string>{"hello", "", "你"}));
  std::unique_ptr<HfTokenizer> fallback = Load(testing::ByteFallbackTokenizerJson());
  ASSERT_NE(fallback, nullptr);
  EXPECT_EQ(Pieces(*fallback, {bf::kMetaspace, bf::Byte(0xF0), bf::Byte(0x9F), bf::Byte(0x98),
                               bf::Byte(0x80), bf::kShi}),
            (std::vector<std::string>{"", "", "", "", "😀", "世"}));
}

TEST(TextStreamTest, SentencePieceSpaceIsStrippedOnlyAtTheStart) {
  std::unique_ptr<HfTokenizer> tok = Load(testing::ByteFallbackTokenizerJson());
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(Pieces(*tok, {bf::kSpaceHello, bf::kSpaceWorld, bf::kSpaceHello}),
            (std::vector<std::string>{"hello", " world", " hello"}));
  // A lone "▁" first is the stripped space; the next word keeps its own.
  EXPECT_EQ(Pieces(*tok, {bf::kMetaspace, bf::kSpaceHello}),
            (std::vector<std::string>{"", " hello"}));
  EXPECT_EQ(Pieces(*tok, {bf::kBos, bf::kSpaceHello}), (std::vector<std::string>{"<s>", " hello"}));
  // Past many restarts of the window the space of each word is still there.
  std::vector<int32_t> ids;
  for (int i = 0; i < 40; ++i) ids.push_back(i % 3 == 0 ? bf::kSpaceWorld : bf::kSpaceHello);
  ExpectStreamMatchesDecode(*tok, ids);
}

TEST(TextStreamTest, FlushReturnsTheIncompleteTail) {
  const ByteTokenizer bytes;
  TextStream stream(bytes);
  EXPECT_EQ(stream.Next('x'), "x");
  EXPECT_EQ(stream.Next(0xE4), "");
  EXPECT_EQ(stream.Next(0xBD), "");
  EXPECT_EQ(stream.Flush(), "\xE4\xBD");
  EXPECT_EQ(stream.Flush(), "");
  // An id after Flush() comes after the flushed bytes: the text is still Decode's.
  EXPECT_EQ(stream.Next(0xA0), "\xA0");
}

TEST(TextStreamTest, BytesThatCanNeverBeValidAreReturnedAtOnce) {
  const ByteTokenizer bytes;
  EXPECT_EQ(Pieces(bytes, {0xFF, 0xE4, 'a', 0xC0, 0xED, 0xA0}),
            (std::vector<std::string>{"\xFF", "",
                                      "\xE4"
                                      "a",
                                      "\xC0", "", "\xED\xA0"}));
}

TEST(TextStreamTest, IdsOutsideTheVocabAddNothing) {
  const ByteTokenizer bytes;
  EXPECT_EQ(Pieces(bytes, {'o', -1, ByteTokenizer::kBos, 1 << 30, 'k'}),
            (std::vector<std::string>{"o", "", "", "", "k"}));
  std::unique_ptr<HfTokenizer> tok = Load(testing::ByteFallbackTokenizerJson());
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(Pieces(*tok, {bf::kVocabSize, bf::kSpaceHello, -3, bf::kSpaceWorld}),
            (std::vector<std::string>{"", "hello", "", " world"}));
}

TEST(TextStreamTest, SpecialTokensStreamAsTheirContent) {
  std::unique_ptr<HfTokenizer> tok = Load(testing::ByteLevelTokenizerJson());
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(Pieces(*tok, {bl::kImStart, bl::kHello, bl::kTool, bl::kEndOfText}),
            (std::vector<std::string>{"<|im_start|>", "hello", "<tool>", "<|endoftext|>"}));
}

TEST(TextStreamTest, EncodedTextStreamsBackWhole) {
  const ByteTokenizer bytes;
  std::unique_ptr<HfTokenizer> level = Load(testing::ByteLevelTokenizerJson());
  std::unique_ptr<HfTokenizer> fallback = Load(testing::ByteFallbackTokenizerJson());
  ASSERT_NE(level, nullptr);
  ASSERT_NE(fallback, nullptr);
  const std::string text =
      " hello world\n\n你好世界 😀👍🏽 日本語 한국어\thello</s><|im_start|>  world  "
      "\n";
  for (const Tokenizer* tok :
       {static_cast<const Tokenizer*>(&bytes), static_cast<const Tokenizer*>(level.get()),
        static_cast<const Tokenizer*>(fallback.get())}) {
    const std::vector<int32_t> ids = tok->Encode(text).value();
    ExpectStreamMatchesDecode(*tok, ids);
  }
}

// Any ids a model may sample, out-of-range ones included: the stream is still Decode.
TEST(TextStreamTest, RandomIdsStreamAsDecode) {
  const ByteTokenizer bytes;
  std::unique_ptr<HfTokenizer> level = Load(testing::ByteLevelTokenizerJson());
  std::unique_ptr<HfTokenizer> fallback = Load(testing::ByteFallbackTokenizerJson());
  ASSERT_NE(level, nullptr);
  ASSERT_NE(fallback, nullptr);
  std::mt19937 rng(20240611);
  for (const Tokenizer* tok :
       {static_cast<const Tokenizer*>(&bytes), static_cast<const Tokenizer*>(level.get()),
        static_cast<const Tokenizer*>(fallback.get())}) {
    std::uniform_int_distribution<int32_t> id(-2, static_cast<int32_t>(tok->vocab_size()) + 2);
    for (int round = 0; round < 50; ++round) {
      std::vector<int32_t> ids(200);
      for (int32_t& x : ids) x = id(rng);
      ExpectStreamMatchesDecode(*tok, ids);
    }
  }
}

// Decode of a window stays cheap: the window starts over, whatever the length.
TEST(TextStreamTest, WindowStaysSmallOnALongSequence) {
  std::unique_ptr<HfTokenizer> tok = Load(testing::ByteLevelTokenizerJson());
  ASSERT_NE(tok, nullptr);
  TextStream stream(*tok);
  size_t largest = 0;
  std::string streamed;
  for (int i = 0; i < 10000; ++i) {
    streamed += stream.Next(i % 2 == 0 ? bl::kE4Bd : 0xA0);
    largest = std::max(largest, stream.window_size());
  }
  EXPECT_LE(largest, 9u);  // 8, and the second id of a character cut in two
  EXPECT_EQ(streamed.size(), 5000u * 3);
}

}  // namespace
}  // namespace megatrain
