// The text primitives of the BPE tokenizers: UTF-8 repair, NFC, the byte alphabet and the
// regex rewrite that makes PCRE2 agree with the JavaScript reference.
#include "engine/data/bpe_text.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace megatrain {
namespace {

TEST(BpeTextTest, RepairUtf8KeepsValidTextAndReplacesEachMaximalSubpart) {
  EXPECT_EQ(RepairUtf8("héllo 世界 😀"), "héllo 世界 😀");
  EXPECT_EQ(RepairUtf8("a\xFF"
                       "b"),
            "a\uFFFD"
            "b");
  EXPECT_EQ(RepairUtf8("\xE2\x82"), "\uFFFD");  // truncated: one subpart
  EXPECT_EQ(RepairUtf8("\xE2\x82"
                       "a"),
            "\uFFFD"
            "a");
  EXPECT_EQ(RepairUtf8("\xED\xA0\x80"), "\uFFFD\uFFFD\uFFFD");  // surrogate
  EXPECT_EQ(RepairUtf8("\xC0\xAF"), "\uFFFD\uFFFD");            // overlong
}

TEST(BpeTextTest, NfcComposes) {
  EXPECT_EQ(NfcNormalize("e\u0301"), "\u00e9");
  EXPECT_EQ(NfcNormalize("\u1100\u1161"), "\uac00");
  EXPECT_EQ(NfcNormalize(std::string("a\0b", 3)), std::string("a\0b", 3));
}

TEST(BpeTextTest, ByteLevelRoundTripsEveryByte) {
  std::string all;
  for (int b = 0; b < 256; ++b) all.push_back(static_cast<char>(b));
  EXPECT_EQ(ByteLevelEncode(" \n!"), "\u0120\u010a!");
  EXPECT_EQ(ByteLevelDecode(ByteLevelEncode(all)), all);
}

TEST(BpeTextTest, RewriteFoldsAsciiOnlyAndSpellsOutWhiteSpace) {
  absl::StatusOr<std::string> rewritten = RewriteOnigurumaPattern("(?i:'s|'ll)");
  ASSERT_TRUE(rewritten.ok()) << rewritten.status();
  EXPECT_EQ(*rewritten, "(?:'[sS]|'[lL][lL])");
  rewritten = RewriteOnigurumaPattern("\\s+(?!\\S)");
  ASSERT_TRUE(rewritten.ok());
  EXPECT_NE(rewritten->find("\\x{85}"), std::string::npos);
  EXPECT_FALSE(RewriteOnigurumaPattern("(?<name>a)").ok());
  EXPECT_FALSE(RewriteOnigurumaPattern("[^\\S]").ok());
}

TEST(BpeTextTest, SplitKeepsMatchesAndGaps) {
  absl::StatusOr<RegexSplitter> splitter = RegexSplitter::Create("\\p{N}{1,3}");
  ASSERT_TRUE(splitter.ok()) << splitter.status();
  const std::vector<absl::string_view> pieces = splitter->Split("ab12345c");
  EXPECT_EQ(pieces, (std::vector<absl::string_view>{"ab", "123", "45", "c"}));
  EXPECT_TRUE(splitter->Split("").empty());
}

TEST(BpeTextTest, ContractionsDoNotFoldNonAsciiLetters) {
  // PCRE2's own (?i) would match U+017F LATIN SMALL LETTER LONG S as 's'.
  absl::StatusOr<RegexSplitter> splitter = RegexSplitter::Create("(?i:'s)|\\p{L}+|'");
  ASSERT_TRUE(splitter.ok()) << splitter.status();
  EXPECT_EQ(splitter->Split("'S"), (std::vector<absl::string_view>{"'S"}));
  EXPECT_EQ(splitter->Split("'\u017f"), (std::vector<absl::string_view>{"'", "\u017f"}));
}

TEST(BpeTextTest, BadPatternIsInvalidArgument) {
  EXPECT_EQ(RegexSplitter::Create("(a").status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace megatrain
