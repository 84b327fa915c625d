#include "engine/data/byte_tokenizer.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace megatrain {
namespace {

TEST(ByteTokenizerTest, SpecialIdsAndVocab) {
  const ByteTokenizer tok;
  EXPECT_EQ(tok.vocab_size(), 258);
  EXPECT_EQ(tok.bos_id(), 256);
  EXPECT_EQ(tok.eos_id(), 257);
  EXPECT_EQ(tok.name(), "byte");
}

TEST(ByteTokenizerTest, AsciiIsOneIdPerCharacter) {
  const ByteTokenizer tok;
  EXPECT_EQ(*tok.Encode("Hi!"), (std::vector<int32_t>{'H', 'i', '!'}));
  EXPECT_TRUE(tok.Encode("")->empty());
}

TEST(ByteTokenizerTest, Utf8RoundTripsByteForByte) {
  const ByteTokenizer tok;
  const std::string text = "gr\xC3\xBC\xC3\x9F dich \xE4\xB8\x96\xE7\x95\x8C \xF0\x9F\x98\x80";
  const std::vector<int32_t> ids = *tok.Encode(text);
  ASSERT_EQ(ids.size(), text.size());  // one id per byte, not per code point
  EXPECT_EQ(ids[2], 0xC3);             // high bytes are 128..255, never negative
  for (int32_t id : ids) {
    EXPECT_GE(id, 0);
    EXPECT_LT(id, 256);
  }
  EXPECT_EQ(tok.Decode(ids), text);
}

TEST(ByteTokenizerTest, DecodeSkipsSpecialIds) {
  const ByteTokenizer tok;
  EXPECT_EQ(tok.Decode({ByteTokenizer::kBos, 'o', 'k', ByteTokenizer::kEos}), "ok");
}

TEST(ByteTokenizerTest, DecodeSkipsIdsOutsideTheVocab) {
  const ByteTokenizer tok;
  const Tokenizer& as_interface = tok;
  EXPECT_EQ(as_interface.Decode({-1, 'o', 258, 1 << 30, 'k'}), "ok");
}

TEST(ByteTokenizerTest, DecodeOfACutCharacterEndsInItsFirstBytes) {
  const ByteTokenizer tok;
  EXPECT_EQ(tok.Decode({'a', 0xE4, 0xBD}), "a\xE4\xBD");
  EXPECT_EQ(tok.Decode({0xFF}), "\xFF");  // invalid UTF-8 is not repaired
}

TEST(ByteTokenizerTest, AsciiCjkEmojiNewlinesRoundTrip) {
  const ByteTokenizer tok;
  const std::vector<std::string> texts = {"plain ASCII", "\n\r\n\t\n", "你好世界",
                                          "😀👍🏽🏳️‍🌈", ""};
  for (const std::string& text : texts) {
    EXPECT_EQ(tok.Decode(*tok.Encode(text)), text);
  }
}

TEST(TokenizeDocumentsTest, AddsBosAndEosAndKeepsShortDocuments) {
  const ByteTokenizer tok;
  const absl::StatusOr<std::vector<std::vector<int32_t>>> docs = TokenizeDocuments({"ab", ""}, tok);
  ASSERT_TRUE(docs.ok()) << docs.status();
  ASSERT_EQ(docs->size(), 2u);
  EXPECT_EQ((*docs)[0], (std::vector<int32_t>{256, 'a', 'b', 257}));
  EXPECT_EQ((*docs)[1], (std::vector<int32_t>{256, 257}));
}

// A tokenizer without special tokens, to check they are left out.
class PlainTokenizer : public Tokenizer {
 public:
  absl::StatusOr<std::vector<int32_t>> Encode(absl::string_view text) const override {
    return std::vector<int32_t>(text.size(), 7);
  }
  int64_t vocab_size() const override { return 8; }
  int32_t bos_id() const override { return -1; }
  int32_t eos_id() const override { return -1; }
  std::string name() const override { return "plain"; }
  std::string Decode(absl::Span<const int32_t> ids) const override {
    return std::string(ids.size(), 'x');
  }
};

TEST(TokenizeDocumentsTest, LeavesOutMissingSpecialTokens) {
  const absl::StatusOr<std::vector<std::vector<int32_t>>> docs =
      TokenizeDocuments({"xyz"}, PlainTokenizer());
  ASSERT_TRUE(docs.ok());
  EXPECT_EQ((*docs)[0], (std::vector<int32_t>{7, 7, 7}));
}

TEST(TokenizeDocumentsTest, EmptyDatasetIsInvalidArgument) {
  EXPECT_EQ(TokenizeDocuments({}, ByteTokenizer()).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(TokenizeDocumentsTest, AllDocumentsEmptyIsInvalidArgument) {
  const absl::Status status = TokenizeDocuments({"", ""}, PlainTokenizer()).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("'plain'"), absl::string_view::npos);
}

}  // namespace
}  // namespace megatrain
