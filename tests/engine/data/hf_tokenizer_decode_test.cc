// HfTokenizer::Decode on the hand-made tokenizers of tiny_tokenizers.h: round trips over
// scripts, emoji, newlines and added tokens; the bytes of a cut character; the one space
// a SentencePiece decoder strips; ids outside the vocab; decoders refused at load.
// hf_tokenizer_test.cc compares Decode with the JavaScript reference on real tokenizers.
#include <memory>
#include <string>
#include <vector>

#include "engine/data/bpe_text.h"
#include "engine/data/hf_tokenizer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/engine/data/tiny_tokenizers.h"

namespace megatrain {
namespace {

using ::testing::HasSubstr;
using Json = nlohmann::json;
namespace bl = testing::byte_level;
namespace bf = testing::byte_fallback;

std::unique_ptr<HfTokenizer> Load(const Json& doc) {
  absl::StatusOr<std::unique_ptr<HfTokenizer>> tok = testing::LoadTokenizerJson(doc);
  EXPECT_TRUE(tok.ok()) << tok.status();
  return tok.ok() ? *std::move(tok) : nullptr;
}

std::string RoundTrip(const HfTokenizer& tok, const std::string& text) {
  return tok.Decode(tok.Encode(text).value());
}

const std::vector<std::string> kTexts = {"hello world",
                                         " hello  world ",
                                         "a\nb\n\n\r\nc",
                                         "\n",
                                         "\t tabs\tand  spaces",
                                         "你好世界",
                                         "日本語 한국어 Ελληνικά",
                                         "😀👍🏽 🏳️‍🌈",
                                         "mixed 世 and 界\n😀"};

TEST(HfTokenizerDecodeTest, ByteLevelRoundTripsScriptsEmojiNewlinesAndAddedTokens) {
  std::unique_ptr<HfTokenizer> tok = Load(testing::ByteLevelTokenizerJson());
  ASSERT_NE(tok, nullptr);
  for (const std::string& text : kTexts) EXPECT_EQ(RoundTrip(*tok, text), text);
  for (const std::string text : {"<|im_start|>user\nhi<|endoftext|>", "<tool>x<tool>",
                                 "<|endoftext|>", "a <|im_start|> b"}) {
    EXPECT_EQ(RoundTrip(*tok, text), text);
  }
  EXPECT_EQ(*tok->Encode("hello world"), (std::vector<int32_t>{bl::kHello, bl::kSpaceWorld}));
}

TEST(HfTokenizerDecodeTest, ByteFallbackRoundTripsScriptsEmojiNewlinesAndAddedTokens) {
  std::unique_ptr<HfTokenizer> tok = Load(testing::ByteFallbackTokenizerJson());
  ASSERT_NE(tok, nullptr);
  for (const std::string& text : kTexts) EXPECT_EQ(RoundTrip(*tok, text), text);
  for (const std::string text : {"hello</s>", "</s>", "<s>", "hello world</s></s>"}) {
    EXPECT_EQ(RoundTrip(*tok, text), text);
  }
  EXPECT_EQ(*tok->Encode("hello world"), (std::vector<int32_t>{bf::kSpaceHello, bf::kSpaceWorld}));
  EXPECT_EQ(*tok->Encode("世"), (std::vector<int32_t>{bf::kMetaspace, bf::kShi}));
}

// As the reference does: Encode prepends "▁" to each stretch between added tokens, and
// Decode strips only the first space of the whole text ("<s>hello" -> "<s> hello").
TEST(HfTokenizerDecodeTest, ByteFallbackTextAfterAnAddedTokenKeepsItsPrependedSpace) {
  std::unique_ptr<HfTokenizer> tok = Load(testing::ByteFallbackTokenizerJson());
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(*tok->Encode("<s>hello"), (std::vector<int32_t>{bf::kBos, bf::kSpaceHello}));
  EXPECT_EQ(RoundTrip(*tok, "<s>hello"), "<s> hello");
}

TEST(HfTokenizerDecodeTest, ByteFallbackStripsOnlyTheFirstSpaceOfTheText) {
  std::unique_ptr<HfTokenizer> tok = Load(testing::ByteFallbackTokenizerJson());
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(tok->Decode({bf::kSpaceWorld}), "world");
  EXPECT_EQ(tok->Decode({bf::kSpaceHello, bf::kSpaceWorld}), "hello world");
  EXPECT_EQ(tok->Decode({bf::kMetaspace}), "");
  EXPECT_EQ(tok->Decode({bf::kMetaspace, bf::kMetaspace}), " ");
  EXPECT_EQ(tok->Decode({bf::Byte(' '), bf::kSpaceHello}), " hello");  // a byte's space too
  EXPECT_EQ(tok->Decode({}), "");
}

TEST(HfTokenizerDecodeTest, CutCharacterDecodesToItsFirstBytes) {
  std::unique_ptr<HfTokenizer> level = Load(testing::ByteLevelTokenizerJson());
  std::unique_ptr<HfTokenizer> fallback = Load(testing::ByteFallbackTokenizerJson());
  ASSERT_NE(level, nullptr);
  ASSERT_NE(fallback, nullptr);
  EXPECT_EQ(*level->Encode("你"), (std::vector<int32_t>{bl::kE4Bd, 0xA0}));
  EXPECT_EQ(level->Decode({bl::kE4Bd}), "\xE4\xBD");
  EXPECT_EQ(level->Decode({bl::kE4Bd, 0xA0}), "你");
  EXPECT_EQ(fallback->Decode({bf::Byte(0xE4), bf::Byte(0xBD)}), "\xE4\xBD");
  EXPECT_EQ(fallback->Decode({bf::kMetaspace, bf::Byte(0xF0), bf::Byte(0x9F)}), "\xF0\x9F");
}

TEST(HfTokenizerDecodeTest, InvalidBytesStayUnrepaired) {
  std::unique_ptr<HfTokenizer> level = Load(testing::ByteLevelTokenizerJson());
  std::unique_ptr<HfTokenizer> fallback = Load(testing::ByteFallbackTokenizerJson());
  ASSERT_NE(level, nullptr);
  ASSERT_NE(fallback, nullptr);
  EXPECT_EQ(level->Decode({0xFF, 'a', bl::kE4Bd, 'b'}),
            "\xFF"
            "a\xE4\xBD"
            "b");
  EXPECT_EQ(RepairUtf8(level->Decode({0xFF, 'a'})),
            "\uFFFD"
            "a");
  EXPECT_EQ(fallback->Decode({bf::Byte(0xFF), bf::kSpaceHello}), "\xFF hello");
}

TEST(HfTokenizerDecodeTest, IdsOutsideTheVocabDecodeToNothing) {
  std::unique_ptr<HfTokenizer> level = Load(testing::ByteLevelTokenizerJson());
  std::unique_ptr<HfTokenizer> fallback = Load(testing::ByteFallbackTokenizerJson());
  ASSERT_NE(level, nullptr);
  ASSERT_NE(fallback, nullptr);
  EXPECT_EQ(level->vocab_size(), bl::kVocabSize);
  EXPECT_EQ(level->Decode({-1, bl::kHello, bl::kVocabSize, 1 << 30, bl::kSpaceWorld, 280}),
            "hello world");  // 280: inside the vocab's range, but no token has it
  EXPECT_EQ(fallback->vocab_size(), bf::kVocabSize);
  EXPECT_EQ(fallback->Decode({bf::kVocabSize, bf::kSpaceHello, -7}), "hello");
}

TEST(HfTokenizerDecodeTest, AddedTokensDecodeToTheirContent) {
  std::unique_ptr<HfTokenizer> level = Load(testing::ByteLevelTokenizerJson());
  std::unique_ptr<HfTokenizer> fallback = Load(testing::ByteFallbackTokenizerJson());
  ASSERT_NE(level, nullptr);
  ASSERT_NE(fallback, nullptr);
  EXPECT_EQ(
      level->Decode({bl::kImStart, bl::kHello, bl::kEndOfText, bl::kTool, bl::kE4Bd, bl::kTool}),
      "<|im_start|>hello<|endoftext|><tool>\xE4\xBD<tool>");
  EXPECT_EQ(fallback->Decode({bf::kBos, bf::kSpaceHello, bf::kEos, bf::kUnk}),
            "<s> hello</s><unk>");
}

// As in the reference, a run of "<0xXX>" tokens is one token for the steps after it.
TEST(HfTokenizerDecodeTest, ByteFallbackRunIsOneTokenForLaterSteps) {
  Json doc = testing::ByteFallbackTokenizerJson();
  doc["decoder"] = Json::parse(R"({"type": "Sequence", "decoders": [{"type": "ByteFallback"},
      {"type": "Strip", "content": " ", "start": 1, "stop": 0}]})");
  std::unique_ptr<HfTokenizer> tok = Load(doc);
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(tok->Decode({bf::Byte(' '), bf::Byte(' '), bf::kShi, bf::Byte(' ')}), " 世");
}

TEST(HfTokenizerDecodeTest, WithoutDecoderTokensAreJoinedBySpaces) {
  Json doc = testing::ByteFallbackTokenizerJson();
  doc["decoder"] = nullptr;
  std::unique_ptr<HfTokenizer> tok = Load(doc);
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(tok->Decode({bf::kSpaceHello, bf::kEos, 9999}), "▁hello </s>");
}

TEST(HfTokenizerDecodeTest, UnsupportedDecoderIsRejectedAtLoadNamingItsType) {
  Json doc = testing::ByteFallbackTokenizerJson();
  doc["decoder"]["decoders"].push_back({{"type", "WordPiece"}, {"prefix", "##"}});
  absl::StatusOr<std::unique_ptr<HfTokenizer>> tok = testing::LoadTokenizerJson(doc);
  ASSERT_FALSE(tok.ok());
  EXPECT_EQ(tok.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(tok.status().message(), HasSubstr("decoder type 'WordPiece' is not supported"));
  doc = testing::ByteFallbackTokenizerJson();
  doc["decoder"]["decoders"][0]["pattern"] = {{"Regex", "▁+"}};
  EXPECT_THAT(testing::LoadTokenizerJson(doc).status().message(),
              HasSubstr("decoder Replace with a Regex pattern is not supported"));
}

}  // namespace
}  // namespace megatrain
