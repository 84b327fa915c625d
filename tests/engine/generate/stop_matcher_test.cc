// StopMatcher: stop ids, stop strings within and across pieces, the text kept, the text
// held back while a stop string might still be forming, and independence from how the
// text is cut into pieces.
#include "engine/generate/stop_matcher.h"

#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace megatrain {
namespace {

constexpr int32_t kEos = 2;

TEST(StopMatcher, StopStringSpanningTwoPiecesStops) {
  StopMatcher stop({"</stop>"}, {});
  EXPECT_FALSE(stop.Feed(10, "Hello </"));
  EXPECT_TRUE(stop.Feed(11, "stop> and more"));
  EXPECT_EQ(stop.reason(), StopReason::kStopString);
  EXPECT_EQ(stop.stop_string_index(), 0);
  EXPECT_EQ(stop.text(), "Hello ");
  EXPECT_EQ(stop.stable_size(), stop.text().size());
}

TEST(StopMatcher, StopStringSpanningManyPiecesAndEmptyOnes) {
  StopMatcher stop({"\xe3\x80\x82"
                    "END"},
                   {});  // "。END": a multi-byte character cut in two
  for (const char* piece : {"ok", "\xe3\x80", "", "\x82", "E", "N"})
    EXPECT_FALSE(stop.Feed(5, piece));
  EXPECT_TRUE(stop.Feed(5, "D!"));
  EXPECT_EQ(stop.text(), "ok");
}

TEST(StopMatcher, TextBeforeStopStringIsKept) {
  StopMatcher stop({"\n\nUser:"}, {});
  EXPECT_FALSE(stop.Feed(3, "The answer"));
  EXPECT_TRUE(stop.Feed(4, " is 4.\n\nUser: and then"));
  EXPECT_EQ(stop.text(), "The answer is 4.");
}

TEST(StopMatcher, StopIdStopsAndDropsItsPiece) {
  StopMatcher stop({"###"}, {7, kEos});
  EXPECT_FALSE(stop.Feed(5, "done"));
  EXPECT_TRUE(stop.Feed(kEos, "</s>"));
  EXPECT_EQ(stop.reason(), StopReason::kStopId);
  EXPECT_EQ(stop.stop_id(), kEos);
  EXPECT_EQ(stop.text(), "done");
  EXPECT_EQ(stop.stable_size(), 4u);
}

TEST(StopMatcher, NoStopKeepsAllText) {
  StopMatcher stop({"STOP"}, {kEos});
  EXPECT_FALSE(stop.Feed(5, "a STO"));
  EXPECT_EQ(stop.stable_size(), 2u);
  EXPECT_FALSE(stop.Feed(6, "p, not STOp"));
  EXPECT_EQ(stop.reason(), StopReason::kNone);
  EXPECT_EQ(stop.text(), "a STOp, not STOp");
  EXPECT_EQ(stop.stable_size(), stop.text().size());
}

TEST(StopMatcher, PossibleStartOfStopStringIsHeldBack) {
  StopMatcher stop({"</answer>", "zz"}, {});
  EXPECT_FALSE(stop.Feed(1, "x = 3 </ans"));
  EXPECT_EQ(stop.stable_size(), 6u);  // "x = 3 " may be sent; "</ans" may start the stop
  EXPECT_FALSE(stop.Feed(2, "wer"));
  EXPECT_EQ(stop.stable_size(), 6u);
  EXPECT_FALSE(stop.Feed(3, "!z"));  // not the stop after all; "z" may start "zz"
  EXPECT_EQ(stop.stable_size(), stop.text().size() - 1);
  EXPECT_FALSE(stop.Feed(4, "a"));
  EXPECT_EQ(stop.stable_size(), stop.text().size());
}

TEST(StopMatcher, FirstStopStringToEndWins) {
  StopMatcher first_end({"world", "lo w"}, {});
  EXPECT_TRUE(first_end.Feed(1, "hello world"));
  EXPECT_EQ(first_end.stop_string_index(), 1);
  EXPECT_EQ(first_end.text(), "hel");
  StopMatcher longest({"b", "ab"}, {});  // both end at the same byte: the longer one cuts
  EXPECT_TRUE(longest.Feed(1, "xab"));
  EXPECT_EQ(longest.stop_string_index(), 1);
  EXPECT_EQ(longest.text(), "x");
}

TEST(StopMatcher, FlushedTextIsChecked) {
  StopMatcher stop({"\n"}, {});
  EXPECT_FALSE(stop.Feed(1, "last"));
  EXPECT_TRUE(stop.FeedText(" line\ntail"));
  EXPECT_EQ(stop.text(), "last line");
}

// The same text cut at seeded random places gives the same kept text and stop, and the
// stable size never shrinks.
TEST(StopMatcher, ResultDoesNotDependOnPieceBoundaries) {
  const std::string text = "a <x <x> <<stop>><<end> trailing";
  const std::vector<std::string> stops = {"<<end>", "<stop>", "x> <"};
  StopMatcher whole(stops, {});
  ASSERT_TRUE(whole.Feed(0, text));
  std::mt19937 rng(3);
  for (int trial = 0; trial < 200; ++trial) {
    StopMatcher pieces(stops, {});
    size_t at = 0, stable = 0;
    while (at < text.size() && !pieces.stopped()) {
      const size_t n = std::min<size_t>(rng() % 4, text.size() - at);
      pieces.Feed(1, text.substr(at, n));
      EXPECT_GE(pieces.stable_size(), stable);
      stable = pieces.stable_size();
      at += n;
    }
    ASSERT_TRUE(pieces.stopped()) << "trial " << trial;
    EXPECT_EQ(pieces.text(), whole.text()) << "trial " << trial;
    EXPECT_EQ(pieces.stop_string_index(), whole.stop_string_index()) << "trial " << trial;
  }
  EXPECT_EQ(whole.text(), "a <x <");
  EXPECT_EQ(whole.stop_string_index(), 2);
}

}  // namespace
}  // namespace megatrain
