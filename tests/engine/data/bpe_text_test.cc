// The text primitives of the BPE tokenizers: UTF-8 repair, NFC, the byte alphabet, the
// regex rewrite that makes PCRE2 agree with the JavaScript reference, and the splitter.
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

TEST(BpeTextTest, RepairUtf8FindsInvalidBytesAfterLongAsciiRuns) {
  const std::string ascii(21, 'x');  // past two 8-byte words
  EXPECT_EQ(RepairUtf8(ascii + "\xFF" + ascii), ascii + "\uFFFD" + ascii);
  EXPECT_EQ(RepairUtf8(ascii + "\xF0\x9F\x98"), ascii + "\uFFFD");  // truncated at the end
}

TEST(BpeTextTest, IsValidUtf8RejectsWhatRepairReplaces) {
  const std::vector<std::string> valid = {"", "plain ASCII that is longer than eight bytes",
                                          "h\u00e9llo \u4e16\u754c \U0001F600",
                                          std::string("a\0b", 3), "\xF4\x8F\xBF\xBF"};
  const std::vector<std::string> invalid = {"a\xFF",        "0123456789\xC3", "\xE2\x82",
                                            "\xED\xA0\x80", "\xC0\xAF",       "\xF4\x90\x80\x80",
                                            "\x80"};
  for (const std::string& text : valid) {
    EXPECT_TRUE(IsValidUtf8(text)) << text;
    EXPECT_EQ(RepairUtf8(text), text);
  }
  for (const std::string& text : invalid) {
    EXPECT_FALSE(IsValidUtf8(text)) << text;
    EXPECT_NE(RepairUtf8(text), text);
  }
}

TEST(BpeTextTest, IncompleteUtf8SuffixIsALeadWithTooFewValidContinuations) {
  EXPECT_EQ(IncompleteUtf8SuffixLength(""), 0u);
  EXPECT_EQ(IncompleteUtf8SuffixLength("abc"), 0u);
  EXPECT_EQ(IncompleteUtf8SuffixLength("a\xC3"), 1u);
  EXPECT_EQ(IncompleteUtf8SuffixLength("a\xE4\xBD"), 2u);
  EXPECT_EQ(IncompleteUtf8SuffixLength("\xF0\x9F\x98"), 3u);
  EXPECT_EQ(IncompleteUtf8SuffixLength("x\xF0"), 1u);
  // Complete sequences.
  EXPECT_EQ(IncompleteUtf8SuffixLength("\xC3\xA9"), 0u);
  EXPECT_EQ(IncompleteUtf8SuffixLength("你"), 0u);
  EXPECT_EQ(IncompleteUtf8SuffixLength("😀"), 0u);
  // Bytes no continuation makes valid: never leads, a bad second byte, a stray continuation.
  EXPECT_EQ(IncompleteUtf8SuffixLength("\xC0"), 0u);
  EXPECT_EQ(IncompleteUtf8SuffixLength("\xC1"), 0u);
  EXPECT_EQ(IncompleteUtf8SuffixLength("\xF5"), 0u);
  EXPECT_EQ(IncompleteUtf8SuffixLength("\xFF"), 0u);
  EXPECT_EQ(IncompleteUtf8SuffixLength("\xED\xA0"), 0u);  // a surrogate
  EXPECT_EQ(IncompleteUtf8SuffixLength("\xE0\x80"), 0u);  // overlong
  EXPECT_EQ(IncompleteUtf8SuffixLength("\xF4\x90"), 0u);  // past U+10FFFF
  EXPECT_EQ(IncompleteUtf8SuffixLength("a\x80"), 0u);
  EXPECT_EQ(IncompleteUtf8SuffixLength("\xBD\xA0"), 0u);
  EXPECT_EQ(IncompleteUtf8SuffixLength("\xE4\xBD\xA0\x80"), 0u);
}

TEST(BpeTextTest, NfcComposes) {
  EXPECT_EQ(*NfcNormalize("e\u0301"), "\u00e9");
  EXPECT_EQ(*NfcNormalize("\u1100\u1161"), "\uac00");
  EXPECT_EQ(*NfcNormalize(std::string("a\0b", 3)), std::string("a\0b", 3));
}

TEST(BpeTextTest, NfcChangesOnlyAroundCodePointsFromU0300) {
  // The starter before a mark composes with it; marks are reordered by combining class.
  EXPECT_EQ(*NfcNormalize("abc e\u0301 x\u0308yz"), "abc \u00e9 \u1e8dyz");
  EXPECT_EQ(*NfcNormalize("e\u0301\u0323"), "\u1eb9\u0301");
  EXPECT_EQ(*NfcNormalize("\u1100\u1161\u11a8!"), "\uac01!");
  EXPECT_EQ(*NfcNormalize("Ko\u0308ln \u00c5 A\u030a"), "K\u00f6ln \u00c5 \u00c5");
  EXPECT_EQ(*NfcNormalize("\u2126 \u0344"), "\u03a9 \u0308\u0301");  // singletons
  EXPECT_EQ(*NfcNormalize("\u0301a"), "\u0301a");                    // a mark first
}

TEST(BpeTextTest, QuickCheckPassesOnlyCodePointsBelowU0300) {
  EXPECT_TRUE(IsNfcByQuickCheck(""));
  EXPECT_TRUE(IsNfcByQuickCheck("plain text, caf\u00e9, \u02ff"));
  EXPECT_FALSE(IsNfcByQuickCheck("e\u0301"));
  EXPECT_FALSE(IsNfcByQuickCheck("\u4e16"));  // NFC, but not known without a lookup
}

TEST(BpeTextTest, ByteLevelRoundTripsEveryByte) {
  std::string all;
  for (int b = 0; b < 256; ++b) all.push_back(static_cast<char>(b));
  EXPECT_EQ(ByteLevelEncode(" \n!"), "\u0120\u010a!");
  EXPECT_EQ(ByteLevelDecode(ByteLevelEncode(all)), all);
}

TEST(BpeTextTest, ByteLevelEncodeAppends) {
  std::string out = "x";
  ByteLevelEncode(" a\xFF", &out);
  EXPECT_EQ(out, "x\u0120a\u00ff");
}

TEST(BpeTextTest, RewriteFoldsAsciiOnlyAndSpellsOutWhiteSpace) {
  absl::StatusOr<std::string> rewritten = RewriteOnigurumaPattern("(?i:'s|'ll)");
  ASSERT_TRUE(rewritten.ok()) << rewritten.status();
  EXPECT_EQ(*rewritten, "(?:'[sS]|'[lL][lL])");
  rewritten = RewriteOnigurumaPattern("\\s+(?!\\S)");
  ASSERT_TRUE(rewritten.ok());
  EXPECT_NE(rewritten->find("\\x{85}"), std::string::npos);
  EXPECT_FALSE(RewriteOnigurumaPattern("(?<name>a)").ok());
  rewritten = RewriteOnigurumaPattern("\\p{L}+[^\\p{N}\\p{Lu}\\p{M}]");
  ASSERT_TRUE(rewritten.ok());
  EXPECT_EQ(*rewritten, "[A-Za-z\\p{L}]+[^0-9\\p{N}A-Z\\p{Lu}\\p{M}]");  // the same sets
  EXPECT_FALSE(RewriteOnigurumaPattern("[^\\S]").ok());
}

TEST(BpeTextTest, SplitKeepsMatchesAndGaps) {
  absl::StatusOr<RegexSplitter> splitter = RegexSplitter::Create("\\p{N}{1,3}");
  ASSERT_TRUE(splitter.ok()) << splitter.status();
  const std::vector<absl::string_view> pieces = *splitter->Split("ab12345c");
  EXPECT_EQ(pieces, (std::vector<absl::string_view>{"ab", "123", "45", "c"}));
  EXPECT_TRUE(splitter->Split("")->empty());
}

TEST(BpeTextTest, SplitAfterAnEmptyMatchResumesOneCodePointLater) {
  absl::StatusOr<RegexSplitter> splitter = RegexSplitter::Create("a*");
  ASSERT_TRUE(splitter.ok()) << splitter.status();
  EXPECT_EQ(*splitter->Split("baac"), (std::vector<absl::string_view>{"b", "aa", "c"}));
  EXPECT_EQ(*splitter->Split("\u00e9a"), (std::vector<absl::string_view>{"\u00e9", "a"}));
}

// Found by fuzz_tokenizer_json: an empty match at the very end of the text made the
// splitter read one byte past it.
TEST(BpeTextTest, SplitStopsAtAnEmptyMatchAtTheEnd) {
  absl::StatusOr<RegexSplitter> splitter = RegexSplitter::Create("x*$");
  ASSERT_TRUE(splitter.ok()) << splitter.status();
  EXPECT_EQ(*splitter->Split("bb"), (std::vector<absl::string_view>{"bb"}));
  EXPECT_EQ(*splitter->Split("bx"), (std::vector<absl::string_view>{"b", "x"}));
}

// The Llama 3 pre-tokenizer; pieces as the one-match-per-call splitter found them.
constexpr absl::string_view kLlama3Pattern =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| "
    "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

TEST(BpeTextTest, SplitMatchesPieceAfterPieceLikeOneMatchPerCall) {
  absl::StatusOr<RegexSplitter> splitter = RegexSplitter::Create(kLlama3Pattern);
  ASSERT_TRUE(splitter.ok()) << splitter.status();
  EXPECT_EQ(
      *splitter->Split("Hello world's  THE'LL 1234567 x   \n \n end!!  ..."),
      (std::vector<absl::string_view>{"Hello", " world", "'s", " ", " THE", "'LL", " ", "123",
                                      "456", "7", " x", "   \n \n", " end", "!!", " ", " ..."}));
  EXPECT_EQ(*splitter->Split("na\u00efve caf\u00e9 42"),
            (std::vector<absl::string_view>{"na\u00efve", " caf\u00e9", " ", "42"}));
}

TEST(BpeTextTest, SplitOfLongTextKeepsEveryPiece) {
  absl::StatusOr<RegexSplitter> splitter = RegexSplitter::Create(kLlama3Pattern);
  ASSERT_TRUE(splitter.ok()) << splitter.status();
  std::string text;
  for (int i = 0; i < 100000; ++i) text += "ab ";
  std::vector<absl::string_view> pieces = {"stale"};
  ASSERT_TRUE(splitter->Split(text, &pieces).ok());  // clears, then fills
  ASSERT_EQ(pieces.size(), 100001u);
  EXPECT_EQ(pieces[0], "ab");
  EXPECT_EQ(pieces[1], " ab");
  EXPECT_EQ(pieces.back(), " ");
  const std::string spaces(1 << 20, ' ');  // one piece
  EXPECT_EQ(*splitter->Split(spaces), (std::vector<absl::string_view>{spaces}));
}

TEST(BpeTextTest, ContractionsDoNotFoldNonAsciiLetters) {
  // PCRE2's own (?i) would match U+017F LATIN SMALL LETTER LONG S as 's'.
  absl::StatusOr<RegexSplitter> splitter = RegexSplitter::Create("(?i:'s)|\\p{L}+|'");
  ASSERT_TRUE(splitter.ok()) << splitter.status();
  EXPECT_EQ(*splitter->Split("'S"), (std::vector<absl::string_view>{"'S"}));
  EXPECT_EQ(*splitter->Split("'\u017f"), (std::vector<absl::string_view>{"'", "\u017f"}));
}

TEST(BpeTextTest, CatastrophicBacktrackingIsInvalidArgumentQuotingTheText) {
  // (a+)+$ tries every way to cut the a's before failing at the 'b': PCRE2 stops at its
  // match limit, which used to abort the process.
  absl::StatusOr<RegexSplitter> splitter = RegexSplitter::Create("(a+)+$");
  ASSERT_TRUE(splitter.ok()) << splitter.status();
  const std::string text = std::string(4096, 'a') + "b";
  const absl::StatusOr<std::vector<absl::string_view>> pieces = splitter->Split(text);
  ASSERT_FALSE(pieces.ok());
  EXPECT_EQ(pieces.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(pieces.status().message().find("pre-tokenizer regex gave up at byte 0"),
            std::string::npos) << pieces.status();
  EXPECT_NE(pieces.status().message().find("on text starting 'aaaaaaaa"), std::string::npos)
      << pieces.status();
  EXPECT_LT(pieces.status().message().size(), 400u) << "quotes a prefix, not the text";
}

TEST(BpeTextTest, BadPatternIsInvalidArgument) {
  EXPECT_EQ(RegexSplitter::Create("(a").status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace megatrain
