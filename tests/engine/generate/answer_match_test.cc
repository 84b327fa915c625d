// Exact-match scoring: the answer a completion gives (its last number, or a pattern's last
// match) and when two answers are the same.
#include "engine/generate/answer_match.h"

#include "gtest/gtest.h"

namespace megatrain {
namespace {

AnswerMatcher Make(const std::string& pattern) {
  absl::StatusOr<AnswerMatcher> m = AnswerMatcher::Create(pattern);
  EXPECT_TRUE(m.ok()) << m.status();
  return *std::move(m);
}

TEST(AnswerMatcher, WithoutAPatternTheAnswerIsTheLastNumber) {
  const AnswerMatcher m = Make("");
  EXPECT_EQ(m.Extract("3 apples and 4 pears make 7."), "7");  // the full stop ends it
  EXPECT_EQ(m.Extract("The answer is: -12,345.5 dollars"), "-12,345.5");
  EXPECT_EQ(m.Extract("no number here"), std::nullopt);
  EXPECT_EQ(m.Extract(""), std::nullopt);
}

TEST(AnswerMatcher, NumbersCompareAsNumbersAndTextAsTrimmedText) {
  EXPECT_TRUE(AnswerMatcher::SameAnswer("1,000", "1000"));
  EXPECT_TRUE(AnswerMatcher::SameAnswer("42.0", "42"));
  EXPECT_TRUE(AnswerMatcher::SameAnswer("7.", "7"));
  EXPECT_TRUE(AnswerMatcher::SameAnswer(" Paris ", "Paris"));
  EXPECT_FALSE(AnswerMatcher::SameAnswer("41", "42"));
  EXPECT_FALSE(AnswerMatcher::SameAnswer("paris", "Paris"));
  EXPECT_FALSE(AnswerMatcher::SameAnswer("12a", "12"));
}

TEST(AnswerMatcher, APatternsFirstGroupIsTheAnswerAndTheLastMatchWins) {
  const AnswerMatcher m = Make(R"(answer is:?\s*(\S+))");
  EXPECT_EQ(m.Extract("I think the answer is 5, no, the answer is: 6"), "6");
  EXPECT_TRUE(m.Correct("so the answer is 1,024", "1024"));
  EXPECT_FALSE(m.Correct("the result is 1024", "1024"));  // the pattern does not match
  const AnswerMatcher whole = Make(R"(\b[A-D]\b)");
  EXPECT_EQ(whole.Extract("Between A and C, I pick C"), "C");
}

TEST(AnswerMatcher, TextCutMidCharacterAndEmptyMatchesEndTheSearch) {
  const AnswerMatcher m = Make("");
  EXPECT_EQ(m.Extract("costs 5 \xE2\x82"), std::nullopt);  // not UTF-8: no match, no crash
  const AnswerMatcher empty = Make("x*");
  EXPECT_EQ(empty.Extract("abxx"), "");  // the last (empty) match at the end
}

TEST(AnswerMatcher, ABadPatternIsRefusedNamingIt) {
  absl::StatusOr<AnswerMatcher> m = AnswerMatcher::Create("(unclosed");
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(m.status().message().find("(unclosed"), std::string::npos) << m.status();
}

}  // namespace
}  // namespace megatrain
