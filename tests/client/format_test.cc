// The pure formatting functions of client/format.h, one edge case per test.
#include "client/format.h"

#include <cmath>

#include "gtest/gtest.h"

namespace megatrain::client {
namespace {

v1::Progress MakeProgress(int64_t step, int64_t total, double loss, double tok_s, double eta_s) {
  v1::Progress p;
  p.set_step(step);
  p.set_total_steps(total);
  if (step > 0) p.set_loss(loss);  // as the daemon: a loss once a step measured one
  p.set_tokens_per_second(tok_s);
  p.set_eta_seconds(eta_s);
  return p;
}

TEST(StateName, RoundTripsEveryRealState) {
  for (const std::string& name : StateNames()) {
    v1::JobState state;
    ASSERT_TRUE(ParseStateName(name, &state)) << name;
    EXPECT_EQ(StateName(state), name);
  }
  EXPECT_EQ(StateNames().size(), 6u);
}

TEST(StateName, UnspecifiedIsUnknownAndNotParsed) {
  EXPECT_EQ(StateName(v1::JOB_STATE_UNSPECIFIED), "unknown");
  v1::JobState state;
  EXPECT_FALSE(ParseStateName("unknown", &state));
  EXPECT_FALSE(ParseStateName("QUEUED", &state));
}

TEST(IsTerminal, OnlySucceededFailedCancelled) {
  EXPECT_TRUE(IsTerminal(v1::JOB_STATE_SUCCEEDED));
  EXPECT_TRUE(IsTerminal(v1::JOB_STATE_FAILED));
  EXPECT_TRUE(IsTerminal(v1::JOB_STATE_CANCELLED));
  EXPECT_FALSE(IsTerminal(v1::JOB_STATE_RUNNING));
  EXPECT_FALSE(IsTerminal(v1::JOB_STATE_HELD));
}

TEST(FormatHumanNumber, SmallValuesArePlainIntegers) {
  EXPECT_EQ(FormatHumanNumber(0), "0");
  EXPECT_EQ(FormatHumanNumber(950), "950");
  EXPECT_EQ(FormatHumanNumber(999.4), "999");
}

TEST(FormatHumanNumber, ThousandsGetOneDecimalBelowAHundred) {
  EXPECT_EQ(FormatHumanNumber(1234), "1.2k");
  EXPECT_EQ(FormatHumanNumber(12345), "12.3k");
  EXPECT_EQ(FormatHumanNumber(123456), "123k");
}

TEST(FormatHumanNumber, RoundingCarriesIntoTheNextUnit) {
  EXPECT_EQ(FormatHumanNumber(999.6), "1.0k");
  EXPECT_EQ(FormatHumanNumber(99960), "100k");
  EXPECT_EQ(FormatHumanNumber(999999), "1.0M");
}

TEST(FormatHumanNumber, LargeUnitsAndBadInput) {
  EXPECT_EQ(FormatHumanNumber(1.5e6), "1.5M");
  EXPECT_EQ(FormatHumanNumber(2.5e9), "2.5G");
  EXPECT_EQ(FormatHumanNumber(5e15), "5000T");
  EXPECT_EQ(FormatHumanNumber(-1), "-");
  EXPECT_EQ(FormatHumanNumber(std::nan("")), "-");
}

TEST(FormatGiB, OneDecimal) {
  EXPECT_EQ(FormatGiB(0), "0.0 GiB");
  EXPECT_EQ(FormatGiB(int64_t{48} << 30), "48.0 GiB");
  EXPECT_EQ(FormatGiB(static_cast<int64_t>(71.3 * (1 << 30))), "71.3 GiB");
}

TEST(FormatDuration, HoursMinutesSeconds) {
  EXPECT_EQ(FormatDuration(0), "0:00:00");
  EXPECT_EQ(FormatDuration(83), "0:01:23");
  EXPECT_EQ(FormatDuration(82.6), "0:01:23");
  EXPECT_EQ(FormatDuration(100000), "27:46:40");
}

TEST(FormatDuration, NegativeNanAndHugeAreUnknown) {
  EXPECT_EQ(FormatDuration(-1), "-");
  EXPECT_EQ(FormatDuration(std::nan("")), "-");
  EXPECT_EQ(FormatDuration(1e300), "-");
}

TEST(FormatAge, LargestWholeUnit) {
  EXPECT_EQ(FormatAge(42'000), "42s");
  EXPECT_EQ(FormatAge(59'999), "59s");
  EXPECT_EQ(FormatAge(5 * 60'000 + 59'000), "5m");
  EXPECT_EQ(FormatAge(3 * 3'600'000), "3h");
  EXPECT_EQ(FormatAge(2 * 86'400'000 + 5), "2d");
}

TEST(FormatAge, ClockSkewGivesZero) { EXPECT_EQ(FormatAge(-5000), "0s"); }

TEST(FormatLocalTime, FormatsInTheGivenZone) {
  const int64_t ms = 1764415805000;  // 2025-11-29 11:30:05 UTC
  EXPECT_EQ(FormatLocalTime(ms, absl::UTCTimeZone()), "2025-11-29 11:30:05");
  EXPECT_EQ(FormatLocalTime(ms, absl::FixedTimeZone(3600)), "2025-11-29 12:30:05");
}

TEST(FormatLocalTime, ZeroMeansNotYet) { EXPECT_EQ(FormatLocalTime(0, absl::UTCTimeZone()), "-"); }

TEST(FormatCpuList, CompressesRunsAndSortsAndDedups) {
  EXPECT_EQ(FormatCpuList({0, 1, 2, 3, 8, 10, 11}), "0-3,8,10-11");
  EXPECT_EQ(FormatCpuList({11, 10, 10, 8, 3, 2, 1, 0}), "0-3,8,10-11");
  EXPECT_EQ(FormatCpuList({5}), "5");
  EXPECT_EQ(FormatCpuList({}), "");
}

TEST(FormatStep, KnownTotalUnknownTotalAndNothing) {
  EXPECT_EQ(FormatStep(MakeProgress(120, 200, 0, 0, 0)), "120/200");
  EXPECT_EQ(FormatStep(MakeProgress(0, 200, 0, 0, 0)), "0/200");
  EXPECT_EQ(FormatStep(MakeProgress(7, 0, 0, 0, 0)), "7");
  EXPECT_EQ(FormatStep(MakeProgress(0, 0, 0, 0, 0)), "-");
}

TEST(FormatLoss, DashBeforeTheFirstStep) {
  EXPECT_EQ(FormatLoss(MakeProgress(0, 200, 0, 0, 0)), "-");
  EXPECT_EQ(FormatLoss(MakeProgress(1, 200, 2.34123, 0, 0)), "2.3412");
}

TEST(FormatProgressLine, AGenerateJobCountsPromptsAndAnEvalJobItsAccuracy) {
  v1::Progress p;
  p.set_prompts_total(10);
  p.set_prompts_done(3);
  p.set_step(3);
  p.set_total_steps(10);
  p.set_correct(2);
  p.set_accuracy(2.0 / 3);
  p.set_tokens_per_second(52);
  p.set_eta_seconds(7);
  EXPECT_EQ(FormatProgressLine(p), "prompts 3/10  52 tok/s  ETA 0:00:07");
  EXPECT_EQ(FormatProgressLine(p, /*scored=*/true),
            "prompts 3/10  accuracy 0.6667 (2/3)  52 tok/s  ETA 0:00:07");
  EXPECT_EQ(FormatProgressLine(p).find("loss"), std::string::npos);
}

// A job resumed at its final step ran none: its step is the last, its loss unmeasured
// (or the checkpoint's, when it recorded one), never a made-up 0.
TEST(FormatProgressLine, ShowsTheAuxLossOfMoeModelsBesideTheLmLoss) {
  v1::Progress p = MakeProgress(3, 10, 2.5, 1000, 0);
  EXPECT_EQ(FormatProgressLine(p).find("aux"), std::string::npos);  // a dense model
  p.set_aux_loss(1.03125);
  EXPECT_NE(FormatProgressLine(p).find("loss 2.5000  aux 1.0312"), std::string::npos)
      << FormatProgressLine(p);
}

TEST(FormatLoss, DashWhenNoLossWasMeasuredWhateverTheStep) {
  v1::Progress p;
  p.set_step(120);
  p.set_total_steps(120);
  EXPECT_EQ(FormatLoss(p), "-");
  p.set_loss(std::nan(""));
  EXPECT_EQ(FormatLoss(p), "-");
  p.set_loss(0.8617);
  EXPECT_EQ(FormatLoss(p), "0.8617");
  p.set_loss(0);
  EXPECT_EQ(FormatLoss(p), "0.0000");  // measured: shown
}

TEST(FormatProgressLine, ShowsTheNewestEvalLossAndItsStep) {
  v1::Progress p = MakeProgress(120, 200, 2.5, 1000, 60);
  EXPECT_EQ(FormatProgressLine(p).find("eval"), std::string::npos);  // no eval set
  p.set_eval_loss(2.75);
  p.set_eval_step(100);
  EXPECT_NE(FormatProgressLine(p).find("loss 2.5000  eval 2.7500@100"), std::string::npos)
      << FormatProgressLine(p);
}

TEST(FormatProgressLine, AllFields) {
  EXPECT_EQ(FormatProgressLine(MakeProgress(120, 200, 2.34123, 1234, 83)),
            "step 120/200  loss 2.3412  1.2k tok/s  ETA 0:01:23");
}

TEST(FormatProgressLine, UnknownRateAndEtaBeforeTheFirstStep) {
  EXPECT_EQ(FormatProgressLine(MakeProgress(0, 200, 0, 0, 0)),
            "step 0/200  loss -  - tok/s  ETA -");
}

TEST(FormatProgressLine, FinishedJobHasZeroEta) {
  EXPECT_EQ(FormatProgressLine(MakeProgress(200, 200, 1.5, 950, 0)),
            "step 200/200  loss 1.5000  950 tok/s  ETA 0:00:00");
}

TEST(FormatProgressBar, FillsInProportionToSteps) {
  EXPECT_EQ(FormatProgressBar(MakeProgress(120, 200, 2.34123, 1234, 83), 10),
            "[######....] step 120/200  loss 2.3412  1.2k tok/s  ETA 0:01:23");
}

TEST(FormatProgressBar, EmptyWithoutTotalAndFullAtTheEnd) {
  EXPECT_EQ(FormatProgressBar(MakeProgress(3, 0, 1, 0, 0), 4).substr(0, 6), "[....]");
  EXPECT_EQ(FormatProgressBar(MakeProgress(200, 200, 1, 0, 0), 4).substr(0, 6), "[####]");
  EXPECT_EQ(FormatProgressBar(MakeProgress(300, 200, 1, 0, 0), 4).substr(0, 6), "[####]");
}

TEST(FormatTable, PadsColumnsAndRightAlignsNumbers) {
  EXPECT_EQ(FormatTable({{"ID", true}, {"NAME"}, {"STATE"}},
                        {{"7", "demo", "running"}, {"12", "a", "held"}}),
            "ID  NAME  STATE\n"
            " 7  demo  running\n"
            "12  a     held\n");
}

TEST(FormatTable, CountsUtf8CodePointsNotBytes) {
  EXPECT_EQ(FormatTable({{"NAME"}, {"X"}}, {{"müller", "1"}, {"ab", "2"}}),
            "NAME    X\n"
            "müller  1\n"
            "ab      2\n");
}

TEST(FormatTable, HeaderOnlyAndShortRows) {
  EXPECT_EQ(FormatTable({{"A"}, {"B"}}, {}), "A  B\n");
  EXPECT_EQ(FormatTable({{"A"}, {"B"}}, {{"x"}}), "A  B\nx\n");
}

TEST(FormatKeyValues, AlignsValuesAndDashesEmptyOnes) {
  EXPECT_EQ(FormatKeyValues({{"id", "7"}, {"device", ""}, {"state", "running"}}),
            "id:      7\n"
            "device:  -\n"
            "state:   running\n");
}

}  // namespace
}  // namespace megatrain::client
