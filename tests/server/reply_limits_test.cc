// What a reply may carry (server/reply_limits.h): whatever the store holds, every reply
// stays under the client's 4 MiB limit, and a cut says so.
#include "server/reply_limits.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace megatrain::server {
namespace {

constexpr size_t kClientLimitBytes = 4 << 20;  // gRPC's default limit on a received message
constexpr size_t kThreeMegabytes = 3'000'000;

// A job as an older daemon may have stored it: every text field `bytes` long.
v1::Job HugeJob(int64_t id, size_t bytes) {
  const std::string text(bytes, 'x');
  v1::Job job;
  job.set_id(id);
  job.set_name(text);
  job.set_owner("alice");
  job.set_state(v1::JOB_STATE_QUEUED);
  job.set_spec_yaml("name: " + text + "\n");
  job.set_error(text);
  job.set_waiting(text);
  job.set_checkpoint_dir(text);
  job.set_last_checkpoint(text);
  job.set_device(text);
  job.mutable_plan()->set_text(text);
  job.mutable_plan()->set_bound(text);
  job.mutable_plan()->add_warnings(text);
  job.mutable_progress()->set_step(7);
  return job;
}

v1::Job SmallJob(int64_t id) {
  v1::Job job;
  job.set_id(id);
  job.set_name("demo");
  job.set_owner("alice");
  job.set_spec_yaml("name: demo\n");
  return job;
}

bool IsValidUtf8(const std::string& text) {
  // Every lead byte is followed by as many continuation bytes as it announces.
  for (size_t i = 0; i < text.size();) {
    const unsigned char b = text[i];
    const size_t n = b < 0x80 ? 1 : b >= 0xF0 ? 4 : b >= 0xE0 ? 3 : b >= 0xC0 ? 2 : 0;
    if (n == 0 || i + n > text.size()) return false;
    for (size_t k = 1; k < n; ++k) {
      if ((static_cast<unsigned char>(text[i + k]) & 0xC0) != 0x80) return false;
    }
    i += n;
  }
  return true;
}

TEST(TruncateForReply, ShortTextIsUntouched) {
  std::string text = "demo";
  EXPECT_FALSE(TruncateForReply(&text, 4));
  EXPECT_EQ(text, "demo");
}

TEST(TruncateForReply, LongTextIsCutAndSaysItsOriginalSize) {
  std::string text(10, 'a');
  EXPECT_TRUE(TruncateForReply(&text, 4));
  EXPECT_EQ(text, "aaaa... (truncated, 10 bytes)");
}

TEST(TruncateForReply, CutInsideAUtf8SequenceBacksOffToItsStart) {
  std::string text = "ab\xC3\xBC\xE2\x82\xAC";  // "abü€"
  EXPECT_TRUE(TruncateForReply(&text, 3));      // byte 3 is inside 'ü'
  EXPECT_EQ(text, "ab... (truncated, 7 bytes)");
  text = "ab\xC3\xBC\xE2\x82\xAC";
  EXPECT_TRUE(TruncateForReply(&text, 6));  // bytes 4..6 are '€'
  EXPECT_EQ(text, "ab\xC3\xBC... (truncated, 7 bytes)");
  EXPECT_TRUE(IsValidUtf8(text));
}

TEST(BoundJobForReply, ThreeMegabyteNameIsCutWithAMarker) {
  v1::Job job = SmallJob(5);
  job.set_name(std::string(kThreeMegabytes, 'n'));
  BoundJobForReply(&job);
  EXPECT_LE(job.name().size(), kMaxNameBytes + 40);
  EXPECT_NE(job.name().find("... (truncated, 3000000 bytes)"), std::string::npos);
  EXPECT_EQ(job.spec_yaml(), "name: demo\n");
  EXPECT_EQ(job.id(), 5);
}

TEST(BoundJobForReply, EveryTextFieldHugeStaysUnderAMegabyte) {
  v1::Job job = HugeJob(1, kThreeMegabytes);
  BoundJobForReply(&job);
  EXPECT_LT(job.ByteSizeLong(), 1u << 20);
  EXPECT_EQ(job.progress().step(), 7);
  EXPECT_NE(job.error().find("truncated"), std::string::npos);
  EXPECT_NE(job.plan().text().find("truncated"), std::string::npos);
}

TEST(BoundJobForReply, ThousandsOfWarningsKeepTheFirstAndCountTheRest) {
  v1::Job job = SmallJob(1);
  for (int i = 0; i < 1000; ++i) job.mutable_plan()->add_warnings("w");
  BoundJobForReply(&job);
  ASSERT_EQ(job.plan().warnings_size(), kMaxPlanWarnings + 1);
  EXPECT_EQ(job.plan().warnings(kMaxPlanWarnings),
            "... (" + std::to_string(1000 - kMaxPlanWarnings) + " more warnings truncated)");
}

TEST(BoundJobForReply, OrdinaryJobIsUnchanged) {
  v1::Job job = SmallJob(1);
  job.mutable_plan()->set_text("plan\n");
  const std::string before = job.SerializeAsString();
  BoundJobForReply(&job);
  EXPECT_EQ(job.SerializeAsString(), before);
}

TEST(BoundJobEventForReply, StateChangeWithAHugeJobStaysUnderTheLimit) {
  v1::JobEvent event;
  *event.mutable_state_change() = HugeJob(1, kThreeMegabytes);
  BoundJobEventForReply(&event);
  EXPECT_LT(event.ByteSizeLong(), kClientLimitBytes);
}

TEST(BoundLogLineForReply, FiveMegabyteLineIsCut) {
  v1::LogLine line;
  line.set_text(std::string(5 << 20, 'l'));
  BoundLogLineForReply(&line);
  EXPECT_LT(line.ByteSizeLong(), kClientLimitBytes);
  EXPECT_NE(line.text().find("truncated"), std::string::npos);
}

TEST(BoundAuditEntryForReply, SubmitOfAHugeNameIsCut) {
  v1::AuditEntry entry;
  entry.set_user("alice");
  entry.set_action("submit");
  entry.set_detail(std::string(kThreeMegabytes, 'n') + ", priority 0");
  entry.set_outcome("ok");
  BoundAuditEntryForReply(&entry);
  EXPECT_LT(entry.ByteSizeLong(), 64u << 10);
  EXPECT_EQ(entry.outcome(), "ok");
}

// The case testers hit: one job with a 3 MB name made `list` fail for every user. Here
// the newest jobs have 3 MB names and the other thousand carry errors of 64 KiB each,
// within their bound: 70 MB as stored (sized to keep the test's memory small).
TEST(FillListJobsReply, ThousandJobsWithThreeMegabyteNamesStayUnderFourMiB) {
  std::vector<v1::Job> jobs;
  for (int64_t id = 1001; id > 0; --id) {
    v1::Job job = SmallJob(id);
    if (id > 998) job.set_name(std::string(kThreeMegabytes, 'n'));
    job.set_error(std::string(kMaxErrorBytes, 'e'));
    jobs.push_back(std::move(job));
  }
  v1::ListJobsResponse reply;
  FillListJobsReply(std::move(jobs), 1000, &reply);
  EXPECT_LT(reply.ByteSizeLong(), kClientLimitBytes);
  EXPECT_LE(reply.ByteSizeLong(), kListReplyBudgetBytes);
  ASSERT_GT(reply.jobs_size(), 3);
  EXPECT_LT(reply.jobs_size(), 1000);
  EXPECT_NE(reply.jobs(0).name().find("truncated"), std::string::npos);
  EXPECT_EQ(reply.jobs(3).error().size(), kMaxErrorBytes);
  // The rest is on the next page: it starts below the last job sent.
  EXPECT_EQ(reply.next_page_token(), std::to_string(reply.jobs(reply.jobs_size() - 1).id()));
  EXPECT_EQ(reply.jobs(0).id(), 1001);
}

TEST(FillListJobsReply, JobsWithEveryFieldHugeStillComeAtLeastOnePerPage) {
  std::vector<v1::Job> jobs;
  for (int64_t id = 3; id > 0; --id) jobs.push_back(HugeJob(id, kThreeMegabytes));
  v1::ListJobsResponse reply;
  FillListJobsReply(std::move(jobs), 1000, &reply);
  EXPECT_LT(reply.ByteSizeLong(), kClientLimitBytes);
  ASSERT_GE(reply.jobs_size(), 1);
}

TEST(FillListJobsReply, SmallJobsFillThePageAndTheExtraRowMakesTheToken) {
  std::vector<v1::Job> jobs;
  for (int64_t id = 101; id > 0; --id) jobs.push_back(SmallJob(id));
  v1::ListJobsResponse reply;
  FillListJobsReply(std::move(jobs), 100, &reply);
  EXPECT_EQ(reply.jobs_size(), 100);
  EXPECT_EQ(reply.next_page_token(), "2");
}

TEST(FillListJobsReply, LastPageHasNoToken) {
  v1::ListJobsResponse reply;
  FillListJobsReply({SmallJob(2), SmallJob(1)}, 100, &reply);
  EXPECT_EQ(reply.jobs_size(), 2);
  EXPECT_EQ(reply.next_page_token(), "");
}

TEST(FillListJobsReply, NoJobsGiveAnEmptyLastPage) {
  v1::ListJobsResponse reply;
  FillListJobsReply({}, 100, &reply);
  EXPECT_EQ(reply.jobs_size(), 0);
  EXPECT_EQ(reply.next_page_token(), "");
}

TEST(FillListJobsReply, FirstJobGoesInEvenPastTheBudget) {
  v1::ListJobsResponse reply;
  FillListJobsReply({SmallJob(2), SmallJob(1)}, 100, &reply, /*budget_bytes=*/1);
  ASSERT_EQ(reply.jobs_size(), 1);
  EXPECT_EQ(reply.next_page_token(), "2");
}

TEST(ReplyBudget, RefusesWhatWouldPassTheBudget) {
  ReplyBudget budget(100);
  v1::LogLine line;
  line.set_text(std::string(50, 'l'));
  EXPECT_TRUE(budget.Take(line));
  EXPECT_FALSE(budget.Take(line));
  line.set_text("short");
  EXPECT_TRUE(budget.Take(line));
}

}  // namespace
}  // namespace megatrain::server
