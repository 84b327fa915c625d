// Tests of JobStore against real SQLite files in a fresh temporary directory per test.
#include "server/job_store.h"

#include <signal.h>
#include <sqlite3.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <numeric>
#include <set>
#include <thread>

#include "engine/common/check.h"
#include "engine/common/status.h"
#include "gtest/gtest.h"

namespace megatrain::server {
namespace {

#define ASSERT_OK(expr)                                     \
  do {                                                      \
    const ::absl::Status assert_ok_status = (expr);         \
    ASSERT_TRUE(assert_ok_status.ok()) << assert_ok_status; \
  } while (0)
#define ASSERT_OK_AND_ASSIGN(lhs, expr) \
  ASSERT_OK_AND_ASSIGN_IMPL(MT_STATUS_CONCAT(statusor_, __LINE__), lhs, expr)
#define ASSERT_OK_AND_ASSIGN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                              \
  ASSERT_TRUE(tmp.ok()) << tmp.status();          \
  lhs = std::move(tmp).value()

using v1::Job;
using v1::JobEvent;
using v1::JobState;
using v1::LogLine;

Job MakeJob(const std::string& owner, JobState state, int priority = 0) {
  Job job;
  job.set_name("job of " + owner);
  job.set_owner(owner);
  job.set_state(state);
  job.set_priority(priority);
  return job;
}

JobEvent ProgressEvent(int64_t step) {
  JobEvent event;
  event.mutable_progress()->set_step(step);
  return event;
}

std::vector<int64_t> Ids(const std::vector<Job>& jobs) {
  std::vector<int64_t> ids;
  for (const Job& job : jobs) ids.push_back(job.id());
  return ids;
}

class JobStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string dir = ::testing::TempDir() + "job_store_test.XXXXXX";
    ASSERT_NE(mkdtemp(dir.data()), nullptr);
    dir_ = dir;
    path_ = dir_ + "/jobs.db";
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  // Runs `sql` on the store's file directly, as another program or an older megatraind would.
  void ExecRaw(const std::string& sql) const {
    sqlite3* db = nullptr;
    ASSERT_EQ(sqlite3_open(path_.c_str(), &db), SQLITE_OK);
    const int rc = sqlite3_exec(db, sql.c_str(), nullptr, nullptr, nullptr);
    sqlite3_close(db);
    ASSERT_EQ(rc, SQLITE_OK) << sql;
  }

  // PRAGMA `name` as read from the store's file directly, as text; a failure and "" when it
  // cannot be read.
  std::string ReadPragma(const std::string& name) const {
    const std::string sql = "PRAGMA " + name;
    sqlite3* db = nullptr;
    sqlite3_stmt* stmt = nullptr;
    std::string value;
    if (sqlite3_open(path_.c_str(), &db) == SQLITE_OK &&
        sqlite3_prepare_v2(db, sql.c_str(), -1, &stmt, nullptr) == SQLITE_OK &&
        sqlite3_step(stmt) == SQLITE_ROW) {
      value = reinterpret_cast<const char*>(sqlite3_column_text(stmt, 0));
    } else {
      ADD_FAILURE() << "reading " << sql << " from " << path_;
    }
    sqlite3_finalize(stmt);
    sqlite3_close(db);
    return value;
  }

  std::string dir_;
  std::string path_;
};

TEST_F(JobStoreTest, InsertThenGetRoundTripsEveryField) {
  ASSERT_OK_AND_ASSIGN(auto store, JobStore::Open(path_));
  Job job = MakeJob("alice", v1::JOB_STATE_RUNNING, 7);
  job.set_spec_yaml("model:\n  path: /models/llama\n");
  job.set_created_unix_ms(1700000000123);
  job.set_started_unix_ms(1700000001000);
  job.mutable_progress()->set_step(42);
  job.mutable_progress()->set_total_steps(1000);
  job.mutable_progress()->set_loss(2.5);
  job.mutable_progress()->set_tokens_per_second(12345.5);
  job.set_checkpoint_dir("/ckpt/1");
  job.set_last_checkpoint("/ckpt/1/step-40");
  job.set_error("none yet");
  job.set_device("cuda:0");
  job.set_host_bytes_estimate(int64_t{96} << 30);
  job.set_resumed_from_step(40);

  ASSERT_OK_AND_ASSIGN(int64_t id, store->Insert(&job));
  EXPECT_EQ(job.id(), id);
  EXPECT_EQ(job.created_unix_ms(), 1700000000123);  // kept, not overwritten
  ASSERT_OK_AND_ASSIGN(Job got, store->Get(id));
  EXPECT_EQ(got.SerializeAsString(), job.SerializeAsString()) << got.DebugString();
}

TEST_F(JobStoreTest, InsertAssignsIncreasingIdsAndFillsCreatedTime) {
  ASSERT_OK_AND_ASSIGN(auto store, JobStore::Open(path_));
  int64_t last_id = 0;
  for (int i = 0; i < 5; ++i) {
    Job job = MakeJob("bob", v1::JOB_STATE_QUEUED);
    job.set_id(999);  // ignored
    ASSERT_OK_AND_ASSIGN(int64_t id, store->Insert(&job));
    EXPECT_GT(id, last_id);
    EXPECT_GT(job.created_unix_ms(), 1600000000000);
    last_id = id;
  }
}

TEST_F(JobStoreTest, UpdateReplacesJobAndItsFilterColumns) {
  ASSERT_OK_AND_ASSIGN(auto store, JobStore::Open(path_));
  Job job = MakeJob("carol", v1::JOB_STATE_QUEUED);
  ASSERT_OK_AND_ASSIGN(int64_t id, store->Insert(&job));
  job.set_state(v1::JOB_STATE_FAILED);
  job.set_owner("dave");
  job.set_error("out of memory");
  ASSERT_OK(store->Update(job));

  ASSERT_OK_AND_ASSIGN(Job got, store->Get(id));
  EXPECT_EQ(got.state(), v1::JOB_STATE_FAILED);
  EXPECT_EQ(got.error(), "out of memory");
  ASSERT_OK_AND_ASSIGN(auto queued, store->ListInState(v1::JOB_STATE_QUEUED));
  EXPECT_TRUE(queued.empty());
  ASSERT_OK_AND_ASSIGN(auto failed, store->List({v1::JOB_STATE_FAILED}, "dave", 0, 10));
  EXPECT_EQ(Ids(failed), std::vector<int64_t>{id});
  ASSERT_OK_AND_ASSIGN(auto carols, store->List({}, "carol", 0, 10));
  EXPECT_TRUE(carols.empty());
}

TEST_F(JobStoreTest, UnknownJobIsNotFoundEverywhere) {
  ASSERT_OK_AND_ASSIGN(auto store, JobStore::Open(path_));
  absl::StatusOr<Job> got = store->Get(12);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(got.status().message(), "job 12 not found");

  Job job = MakeJob("erin", v1::JOB_STATE_QUEUED);
  job.set_id(12);
  EXPECT_EQ(store->Update(job).code(), absl::StatusCode::kNotFound);
  JobEvent event = ProgressEvent(1);
  EXPECT_EQ(store->AppendEvent(12, &event).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(event.seq(), 0);  // untouched on error
  LogLine line;
  line.set_text("hello");
  EXPECT_EQ(store->AppendLog(12, &line).status().code(), absl::StatusCode::kNotFound);
  ASSERT_OK_AND_ASSIGN(auto events, store->EventsAfter(12, 0, 10));
  EXPECT_TRUE(events.empty());
}

TEST_F(JobStoreTest, ListIsNewestFirstAndFiltersByStatesAndOwner) {
  ASSERT_OK_AND_ASSIGN(auto store, JobStore::Open(path_));
  std::vector<int64_t> ids;
  const JobState states[] = {v1::JOB_STATE_QUEUED, v1::JOB_STATE_RUNNING, v1::JOB_STATE_HELD};
  for (int i = 0; i < 9; ++i) {
    Job job = MakeJob(i % 2 == 0 ? "alice" : "bob", states[i % 3]);
    ASSERT_OK_AND_ASSIGN(int64_t id, store->Insert(&job));
    ids.push_back(id);
  }
  ASSERT_OK_AND_ASSIGN(auto all, store->List({}, "", 0, 100));
  EXPECT_EQ(Ids(all), std::vector<int64_t>(ids.rbegin(), ids.rend()));

  ASSERT_OK_AND_ASSIGN(auto running, store->List({v1::JOB_STATE_RUNNING}, "", 0, 100));
  EXPECT_EQ(Ids(running), (std::vector<int64_t>{ids[7], ids[4], ids[1]}));

  ASSERT_OK_AND_ASSIGN(
      auto queued_or_held,
      store->List({v1::JOB_STATE_HELD, v1::JOB_STATE_QUEUED, v1::JOB_STATE_HELD}, "", 0, 100));
  EXPECT_EQ(Ids(queued_or_held),
            (std::vector<int64_t>{ids[8], ids[6], ids[5], ids[3], ids[2], ids[0]}));

  ASSERT_OK_AND_ASSIGN(auto bobs, store->List({}, "bob", 0, 100));
  EXPECT_EQ(Ids(bobs), (std::vector<int64_t>{ids[7], ids[5], ids[3], ids[1]}));

  ASSERT_OK_AND_ASSIGN(auto alices_queued, store->List({v1::JOB_STATE_QUEUED}, "alice", 0, 100));
  EXPECT_EQ(Ids(alices_queued), (std::vector<int64_t>{ids[6], ids[0]}));

  ASSERT_OK_AND_ASSIGN(auto nobody, store->List({}, "zed", 0, 100));
  EXPECT_TRUE(nobody.empty());
  ASSERT_OK_AND_ASSIGN(auto unknown_state, store->List({static_cast<JobState>(99)}, "", 0, 100));
  EXPECT_TRUE(unknown_state.empty());
}

TEST_F(JobStoreTest, ListPagesWithBeforeIdAndLimitAcross250Jobs) {
  ASSERT_OK_AND_ASSIGN(auto store, JobStore::Open(path_));
  std::vector<int64_t> ids, succeeded_ids;
  for (int i = 0; i < 250; ++i) {
    Job job = MakeJob("user" + std::to_string(i % 4),
                      i % 5 == 0 ? v1::JOB_STATE_SUCCEEDED : v1::JOB_STATE_QUEUED);
    ASSERT_OK_AND_ASSIGN(int64_t id, store->Insert(&job));
    ids.push_back(id);
    if (i % 5 == 0) succeeded_ids.push_back(id);
  }
  std::reverse(ids.begin(), ids.end());
  std::reverse(succeeded_ids.begin(), succeeded_ids.end());

  auto page_through = [&](const std::vector<JobState>& states, int limit) {
    std::vector<int64_t> seen;
    int64_t before_id = 0;
    int pages = 0;
    while (true) {
      absl::StatusOr<std::vector<Job>> page = store->List(states, "", before_id, limit);
      EXPECT_TRUE(page.ok()) << page.status();
      if (!page.ok() || page->empty()) break;
      EXPECT_LE(static_cast<int>(page->size()), limit);
      for (const Job& job : *page) seen.push_back(job.id());
      before_id = page->back().id();
      ++pages;
    }
    return std::make_pair(seen, pages);
  };
  auto [all, all_pages] = page_through({}, 37);
  EXPECT_EQ(all, ids);
  EXPECT_EQ(all_pages, 7);  // 6 * 37 + 28
  auto [succeeded, succeeded_pages] = page_through({v1::JOB_STATE_SUCCEEDED}, 10);
  EXPECT_EQ(succeeded, succeeded_ids);
  EXPECT_EQ(succeeded_pages, 5);

  ASSERT_OK_AND_ASSIGN(auto first_three, store->List({}, "", 0, 3));
  EXPECT_EQ(Ids(first_three), std::vector<int64_t>(ids.begin(), ids.begin() + 3));
}

TEST_F(JobStoreTest, ListRejectsNonPositiveLimitAndNegativeBeforeId) {
  ASSERT_OK_AND_ASSIGN(auto store, JobStore::Open(path_));
  EXPECT_EQ(store->List({}, "", 0, 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store->List({}, "", -1, 10).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store->EventsAfter(1, 0, 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store->AuditLog(-5).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(JobStoreTest, ListInStateIsOldestFirst) {
  ASSERT_OK_AND_ASSIGN(auto store, JobStore::Open(path_));
  std::vector<int64_t> queued;
  for (int i = 0; i < 6; ++i) {
    Job job = MakeJob("u", i % 2 ? v1::JOB_STATE_QUEUED : v1::JOB_STATE_RUNNING, 6 - i);
    ASSERT_OK_AND_ASSIGN(int64_t id, store->Insert(&job));
    if (i % 2) queued.push_back(id);
  }
  ASSERT_OK_AND_ASSIGN(auto jobs, store->ListInState(v1::JOB_STATE_QUEUED));
  EXPECT_EQ(Ids(jobs), queued);
}

TEST_F(JobStoreTest, EventAndLogSeqsStartAtOneAndArePerJobAndPerKind) {
  ASSERT_OK_AND_ASSIGN(auto store, JobStore::Open(path_));
  Job a = MakeJob("u", v1::JOB_STATE_RUNNING), b = MakeJob("u", v1::JOB_STATE_RUNNING);
  ASSERT_OK(store->Insert(&a).status());
  ASSERT_OK(store->Insert(&b).status());
  for (int64_t i = 1; i <= 3; ++i) {
    JobEvent event = ProgressEvent(i);
    ASSERT_OK_AND_ASSIGN(int64_t seq, store->AppendEvent(a.id(), &event));
    EXPECT_EQ(seq, i);
    EXPECT_EQ(event.seq(), i);
    EXPECT_EQ(event.job_id(), a.id());
    EXPECT_GT(event.unix_ms(), 0);
  }
  JobEvent for_b = ProgressEvent(1);
  for_b.set_unix_ms(777);
  ASSERT_OK_AND_ASSIGN(int64_t b_seq, store->AppendEvent(b.id(), &for_b));
  EXPECT_EQ(b_seq, 1);
  LogLine line;
  line.set_text("first log line of a");
  ASSERT_OK_AND_ASSIGN(int64_t log_seq, store->AppendLog(a.id(), &line));
  EXPECT_EQ(log_seq, 1);
  EXPECT_EQ(line.seq(), 1);

  ASSERT_OK_AND_ASSIGN(auto b_events, store->EventsAfter(b.id(), 0, 10));
  ASSERT_EQ(b_events.size(), 1u);
  EXPECT_EQ(b_events[0].unix_ms(), 777);
  EXPECT_EQ(b_events[0].job_id(), b.id());
}

TEST_F(JobStoreTest, EventsAfterPagesAndRoundTripsPayloads) {
  ASSERT_OK_AND_ASSIGN(auto store, JobStore::Open(path_));
  Job job = MakeJob("u", v1::JOB_STATE_QUEUED);
  ASSERT_OK(store->Insert(&job).status());
  JobEvent first;
  *first.mutable_state_change() = job;
  ASSERT_OK(store->AppendEvent(job.id(), &first).status());
  for (int64_t step = 1; step <= 24; ++step) {
    JobEvent event = ProgressEvent(step);
    ASSERT_OK(store->AppendEvent(job.id(), &event).status());
  }
  ASSERT_OK_AND_ASSIGN(auto head, store->EventsAfter(job.id(), 0, 1));
  ASSERT_EQ(head.size(), 1u);
  EXPECT_EQ(head[0].SerializeAsString(), first.SerializeAsString());

  std::vector<int64_t> seqs;
  int64_t after = 0;
  while (true) {
    ASSERT_OK_AND_ASSIGN(auto page, store->EventsAfter(job.id(), after, 10));
    if (page.empty()) break;
    for (const JobEvent& event : page) {
      seqs.push_back(event.seq());
      if (event.seq() > 1) {
        EXPECT_EQ(event.progress().step(), event.seq() - 1);
      }
    }
    after = page.back().seq();
  }
  std::vector<int64_t> expected(25);
  std::iota(expected.begin(), expected.end(), 1);
  EXPECT_EQ(seqs, expected);
}

TEST_F(JobStoreTest, LogsAfterPagesInOrder) {
  ASSERT_OK_AND_ASSIGN(auto store, JobStore::Open(path_));
  Job job = MakeJob("u", v1::JOB_STATE_RUNNING);
  ASSERT_OK(store->Insert(&job).status());
  for (int i = 1; i <= 7; ++i) {
    LogLine line;
    line.set_text("line " + std::to_string(i));
    ASSERT_OK(store->AppendLog(job.id(), &line).status());
  }
  ASSERT_OK_AND_ASSIGN(auto page, store->LogsAfter(job.id(), 2, 3));
  ASSERT_EQ(page.size(), 3u);
  EXPECT_EQ(page[0].seq(), 3);
  EXPECT_EQ(page[0].text(), "line 3");
  EXPECT_EQ(page[2].text(), "line 5");
  ASSERT_OK_AND_ASSIGN(auto rest, store->LogsAfter(job.id(), 5, 100));
  EXPECT_EQ(rest.size(), 2u);
}

// Fills a store with one job, two events, a log line and an audit entry; returns the job.
Job Populate(JobStore* store) {
  Job job = MakeJob("frank", v1::JOB_STATE_RUNNING, 3);
  job.set_spec_yaml("train:\n  steps: 10\n");
  MT_CHECK(store->Insert(&job).ok());
  JobEvent first;
  *first.mutable_state_change() = job;
  MT_CHECK(store->AppendEvent(job.id(), &first).ok());
  JobEvent second = ProgressEvent(1);
  MT_CHECK(store->AppendEvent(job.id(), &second).ok());
  LogLine line;
  line.set_text("step 1 loss 9.9");
  MT_CHECK(store->AppendLog(job.id(), &line).ok());
  MT_CHECK(store->Audit("frank", "submit", job.id(), "priority 3").ok());
  return job;
}

void ExpectPopulated(JobStore* store, const Job& job) {
  absl::StatusOr<Job> got = store->Get(job.id());
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->SerializeAsString(), job.SerializeAsString());
  absl::StatusOr<std::vector<JobEvent>> events = store->EventsAfter(job.id(), 0, 10);
  ASSERT_TRUE(events.ok()) << events.status();
  ASSERT_EQ(events->size(), 2u);
  EXPECT_EQ((*events)[0].state_change().spec_yaml(), job.spec_yaml());
  EXPECT_EQ((*events)[1].progress().step(), 1);
  absl::StatusOr<std::vector<LogLine>> logs = store->LogsAfter(job.id(), 0, 10);
  ASSERT_TRUE(logs.ok()) << logs.status();
  ASSERT_EQ(logs->size(), 1u);
  EXPECT_EQ((*logs)[0].text(), "step 1 loss 9.9");
  absl::StatusOr<std::vector<AuditEntry>> audit = store->AuditLog(10);
  ASSERT_TRUE(audit.ok()) << audit.status();
  ASSERT_EQ(audit->size(), 1u);
  EXPECT_EQ((*audit)[0].action, "submit");
  // Appends continue the sequence.
  JobEvent next = ProgressEvent(2);
  absl::StatusOr<int64_t> seq = store->AppendEvent(job.id(), &next);
  ASSERT_TRUE(seq.ok()) << seq.status();
  EXPECT_EQ(*seq, 3);
}

TEST_F(JobStoreTest, EverythingSurvivesCloseAndReopen) {
  Job job;
  {
    ASSERT_OK_AND_ASSIGN(auto store, JobStore::Open(path_));
    job = Populate(store.get());
  }
  ASSERT_OK_AND_ASSIGN(auto store, JobStore::Open(path_));
  ExpectPopulated(store.get(), job);
}

// Runs Populate in a child that then exits (or is killed by SIGKILL) without closing the store, and
// checks that the parent sees everything.
void ExpectCommittedWritesSurviveChildDeath(const std::string& path, bool kill_nine) {
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    absl::StatusOr<std::unique_ptr<JobStore>> store = JobStore::Open(path);
    if (!store.ok()) _exit(1);
    Populate(store->get());
    if (kill_nine) raise(SIGKILL);
    _exit(0);  // no destructors: the connection is never closed
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  if (kill_nine) {
    ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << status;
  } else {
    ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  }
  ASSERT_OK_AND_ASSIGN(auto store, JobStore::Open(path));
  ASSERT_OK_AND_ASSIGN(auto jobs, store->List({}, "frank", 0, 10));
  ASSERT_EQ(jobs.size(), 1u);
  ExpectPopulated(store.get(), jobs[0]);
}

TEST_F(JobStoreTest, CommittedWritesSurviveExitWithoutClose) {
  ExpectCommittedWritesSurviveChildDeath(path_, /*kill_nine=*/false);
}

TEST_F(JobStoreTest, CommittedWritesSurviveKillNine) {
  ExpectCommittedWritesSurviveChildDeath(path_, /*kill_nine=*/true);
}

TEST_F(JobStoreTest, ConcurrentInsertsAndAppendsFromEightThreadsKeepSeqsGapFree) {
  ASSERT_OK_AND_ASSIGN(auto store, JobStore::Open(path_));
  Job shared = MakeJob("shared", v1::JOB_STATE_RUNNING);
  ASSERT_OK(store->Insert(&shared).status());
  constexpr int kThreads = 8, kPerThread = 25;
  std::vector<std::vector<int64_t>> job_ids(kThreads), event_seqs(kThreads), log_seqs(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kPerThread; ++i) {
        Job job = MakeJob("t" + std::to_string(t), v1::JOB_STATE_QUEUED);
        absl::StatusOr<int64_t> id = store->Insert(&job);
        JobEvent event = ProgressEvent(i);
        absl::StatusOr<int64_t> seq = store->AppendEvent(shared.id(), &event);
        LogLine line;
        line.set_text("thread " + std::to_string(t));
        absl::StatusOr<int64_t> log_seq = store->AppendLog(shared.id(), &line);
        if (!id.ok() || !seq.ok() || !log_seq.ok()) {
          ADD_FAILURE() << id.status() << seq.status() << log_seq.status();
          return;
        }
        job_ids[t].push_back(*id);
        event_seqs[t].push_back(*seq);
        log_seqs[t].push_back(*log_seq);
      }
    });
  }
  for (std::thread& thread : threads) thread.join();

  auto merged = [](const std::vector<std::vector<int64_t>>& per_thread) {
    std::vector<int64_t> all;
    for (const auto& v : per_thread) {
      EXPECT_TRUE(std::is_sorted(v.begin(), v.end()));
      all.insert(all.end(), v.begin(), v.end());
    }
    std::sort(all.begin(), all.end());
    return all;
  };
  std::vector<int64_t> one_to_n(kThreads * kPerThread);
  std::iota(one_to_n.begin(), one_to_n.end(), 1);
  EXPECT_EQ(merged(event_seqs), one_to_n);
  EXPECT_EQ(merged(log_seqs), one_to_n);
  std::vector<int64_t> ids = merged(job_ids);
  EXPECT_EQ(std::set<int64_t>(ids.begin(), ids.end()).size(), ids.size());

  ASSERT_OK_AND_ASSIGN(auto events, store->EventsAfter(shared.id(), 0, 1000));
  ASSERT_EQ(events.size(), one_to_n.size());
  for (size_t i = 0; i < events.size(); ++i) EXPECT_EQ(events[i].seq(), one_to_n[i]);
}

TEST_F(JobStoreTest, OpeningNonDatabaseFileIsDataLossNamingPath) {
  std::string garbage;
  for (int i = 0; i < 200; ++i) garbage += "this is not a database, it is a text file\n";
  std::ofstream(path_) << garbage;
  absl::StatusOr<std::unique_ptr<JobStore>> store = JobStore::Open(path_);
  EXPECT_EQ(store.status().code(), absl::StatusCode::kDataLoss) << store.status();
  EXPECT_NE(store.status().message().find(path_), absl::string_view::npos) << store.status();
  // The file is left as it was.
  std::ifstream in(path_);
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(in), {}), garbage);
}

TEST_F(JobStoreTest, OpeningNewerSchemaVersionIsFailedPreconditionNamingPath) {
  { ASSERT_OK(JobStore::Open(path_).status()); }
  ASSERT_NO_FATAL_FAILURE(
      ExecRaw("PRAGMA user_version = " + std::to_string(JobStore::kSchemaVersion + 1)));

  absl::StatusOr<std::unique_ptr<JobStore>> store = JobStore::Open(path_);
  EXPECT_EQ(store.status().code(), absl::StatusCode::kFailedPrecondition) << store.status();
  EXPECT_NE(store.status().message().find(path_), absl::string_view::npos) << store.status();
}

TEST_F(JobStoreTest, FileStoreIsInWalModeAtCurrentSchemaVersion) {
  ASSERT_OK_AND_ASSIGN(auto store, JobStore::Open(path_));
  EXPECT_EQ(ReadPragma("journal_mode"), "wal");
  EXPECT_EQ(ReadPragma("user_version"), std::to_string(JobStore::kSchemaVersion));
}

TEST_F(JobStoreTest, OpeningEmptyPathIsInvalidArgument) {
  EXPECT_EQ(JobStore::Open("").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(JobStoreTest, OpeningInMissingDirectoryIsUnavailableNamingPath) {
  const std::string path = dir_ + "/no/such/dir/jobs.db";
  absl::StatusOr<std::unique_ptr<JobStore>> store = JobStore::Open(path);
  EXPECT_EQ(store.status().code(), absl::StatusCode::kUnavailable) << store.status();
  EXPECT_NE(store.status().message().find(path), absl::string_view::npos) << store.status();
}

TEST_F(JobStoreTest, InMemoryStoreWorks) {
  ASSERT_OK_AND_ASSIGN(auto store, JobStore::Open(":memory:"));
  Job job = MakeJob("u", v1::JOB_STATE_QUEUED);
  ASSERT_OK_AND_ASSIGN(int64_t id, store->Insert(&job));
  ASSERT_OK(store->Get(id).status());
}

TEST_F(JobStoreTest, AuditEntriesAreRecordedInOrder) {
  ASSERT_OK_AND_ASSIGN(auto store, JobStore::Open(path_));
  ASSERT_OK(store->Audit("alice", "submit", 1, "priority 0"));
  ASSERT_OK(store->Audit("bob", "cancel", 1, ""));
  ASSERT_OK(store->Audit("root", "drain", 0, "node maintenance"));
  ASSERT_OK_AND_ASSIGN(auto entries, store->AuditLog(10));
  ASSERT_EQ(entries.size(), 3u);  // newest first
  EXPECT_EQ(entries[0].action, "drain");
  EXPECT_EQ(entries[0].job_id, 0);
  EXPECT_EQ(entries[0].detail, "node maintenance");
  EXPECT_EQ(entries[1].user, "bob");
  EXPECT_EQ(entries[2].user, "alice");
  EXPECT_EQ(entries[2].detail, "priority 0");
  EXPECT_GT(entries[0].id, entries[1].id);
  EXPECT_GT(entries[1].id, entries[2].id);
  EXPECT_GE(entries[0].unix_ms, entries[2].unix_ms);
  ASSERT_OK_AND_ASSIGN(auto newest, store->AuditLog(1));
  ASSERT_EQ(newest.size(), 1u);
  EXPECT_EQ(newest[0].id, entries[0].id);
}

TEST_F(JobStoreTest, AuditRecordsOutcomesAndFiltersByUserAndJob) {
  ASSERT_OK_AND_ASSIGN(auto store, JobStore::Open(path_));
  AuditEntry denied;
  denied.user = "bob";
  denied.action = "cancel";
  denied.job_id = 7;
  denied.outcome = "PERMISSION_DENIED: job 7 belongs to alice";
  ASSERT_OK(store->Audit(denied));
  ASSERT_OK(store->Audit("alice", "cancel", 7, ""));
  ASSERT_OK(store->Audit("alice", "submit", 8, "demo"));
  ASSERT_OK_AND_ASSIGN(auto bobs, store->AuditLog(10, "bob"));
  ASSERT_EQ(bobs.size(), 1u);
  EXPECT_EQ(bobs[0].outcome, "PERMISSION_DENIED: job 7 belongs to alice");
  ASSERT_OK_AND_ASSIGN(auto about7, store->AuditLog(10, "", 7));
  ASSERT_EQ(about7.size(), 2u);
  EXPECT_EQ(about7[0].user, "alice");
  EXPECT_EQ(about7[0].outcome, "ok");
  ASSERT_OK_AND_ASSIGN(auto alice8, store->AuditLog(10, "alice", 8));
  ASSERT_EQ(alice8.size(), 1u);
  EXPECT_EQ(alice8[0].action, "submit");
}

TEST_F(JobStoreTest, VersionOneFileIsUpgradedKeepingItsJobsAndAudit) {
  // A version-1 file as the previous megatraind wrote it.
  const char* v1_schema = R"sql(
    CREATE TABLE jobs (id INTEGER PRIMARY KEY AUTOINCREMENT, owner TEXT NOT NULL,
      state INTEGER NOT NULL, priority INTEGER NOT NULL, created_ms INTEGER NOT NULL,
      job BLOB NOT NULL);
    CREATE TABLE events (job_id INTEGER NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
      seq INTEGER NOT NULL, unix_ms INTEGER NOT NULL, payload BLOB NOT NULL,
      PRIMARY KEY (job_id, seq)) WITHOUT ROWID;
    CREATE TABLE logs (job_id INTEGER NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
      seq INTEGER NOT NULL, unix_ms INTEGER NOT NULL, text TEXT NOT NULL,
      PRIMARY KEY (job_id, seq)) WITHOUT ROWID;
    CREATE TABLE audit (id INTEGER PRIMARY KEY, unix_ms INTEGER NOT NULL, user TEXT NOT NULL,
      action TEXT NOT NULL, job_id INTEGER NOT NULL, detail TEXT NOT NULL);
    INSERT INTO audit (unix_ms, user, action, job_id, detail) VALUES (1, 'old', 'submit', 1, 'x');
    PRAGMA user_version = 1;)sql";
  ASSERT_NO_FATAL_FAILURE(ExecRaw(v1_schema));
  ASSERT_OK_AND_ASSIGN(auto store, JobStore::Open(path_));
  ASSERT_OK_AND_ASSIGN(auto entries, store->AuditLog(10));
  ASSERT_EQ(entries.size(), 1u);
  EXPECT_EQ(entries[0].user, "old");
  EXPECT_EQ(entries[0].outcome, "");
  ASSERT_OK(store->InsertToken("abc", "alice", "laptop").status());
  ASSERT_OK(store->AddUsage("alice", 10, 3600));
  store.reset();
  EXPECT_EQ(ReadPragma("user_version"), std::to_string(JobStore::kSchemaVersion));
}

TEST_F(JobStoreTest, TokensAreFoundByHashListedAndRevoked) {
  ASSERT_OK_AND_ASSIGN(auto store, JobStore::Open(path_));
  ASSERT_OK_AND_ASSIGN(int64_t a, store->InsertToken("hash-a", "alice", "laptop"));
  ASSERT_OK_AND_ASSIGN(int64_t b, store->InsertToken("hash-b", "bob", ""));
  EXPECT_NE(a, b);
  ASSERT_OK_AND_ASSIGN(TokenRecord used, store->UseToken("hash-a"));
  EXPECT_EQ(used.id, a);
  EXPECT_EQ(used.user, "alice");
  EXPECT_EQ(used.name, "laptop");
  EXPECT_GT(used.last_used_ms, 0);  // noted
  EXPECT_EQ(store->UseToken("hash-c").status().code(), absl::StatusCode::kNotFound);
  // The same hash twice is refused (UNIQUE): two tokens can never collide silently.
  EXPECT_FALSE(store->InsertToken("hash-a", "mallory", "").ok());
  ASSERT_OK_AND_ASSIGN(auto alices, store->ListTokens("alice"));
  ASSERT_EQ(alices.size(), 1u);
  ASSERT_OK_AND_ASSIGN(auto all, store->ListTokens(""));
  EXPECT_EQ(all.size(), 2u);
  ASSERT_OK(store->DeleteToken(a));
  EXPECT_EQ(store->UseToken("hash-a").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store->DeleteToken(a).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store->GetToken(a).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(JobStoreTest, UsageAddsUpAndDecaysWithTheHalfLife) {
  ASSERT_OK_AND_ASSIGN(auto store, JobStore::Open(path_));
  // An explicit clock: the decay is exact, however slow the machine writes.
  const absl::Time t0 = absl::FromUnixSeconds(1'800'000'000);
  ASSERT_OK(store->AddUsage("alice", 100, 0, t0));  // half-life 0: never decays
  ASSERT_OK(store->AddUsage("alice", 50, 0, t0 + absl::Seconds(5)));
  ASSERT_OK(store->AddUsage("bob", 10, 0, t0 + absl::Seconds(5)));
  ASSERT_OK_AND_ASSIGN(auto usage, store->Usage(0, t0 + absl::Hours(1)));
  EXPECT_DOUBLE_EQ(usage["alice"], 150);
  EXPECT_DOUBLE_EQ(usage["bob"], 10);
  // Two half-lives later a quarter is left, for both alike.
  ASSERT_OK_AND_ASSIGN(auto decayed, store->Usage(60, t0 + absl::Seconds(125)));
  EXPECT_DOUBLE_EQ(decayed["alice"], 150 * 0.25);
  EXPECT_DOUBLE_EQ(decayed["bob"], 10 * 0.25);
  // Adding decays the stored total to the moment of the add first: 37.5 + 12.
  ASSERT_OK(store->AddUsage("alice", 12, 60, t0 + absl::Seconds(125)));
  ASSERT_OK_AND_ASSIGN(auto later, store->Usage(60, t0 + absl::Seconds(185)));
  EXPECT_DOUBLE_EQ(later["alice"], (37.5 + 12) / 2);
  // A read from before the last record does not grow it.
  ASSERT_OK_AND_ASSIGN(auto earlier, store->Usage(60, t0));
  EXPECT_DOUBLE_EQ(earlier["alice"], 37.5 + 12);
}

TEST_F(JobStoreTest, CountByStateCountsEveryState) {
  ASSERT_OK_AND_ASSIGN(auto store, JobStore::Open(path_));
  for (JobState state :
       {v1::JOB_STATE_QUEUED, v1::JOB_STATE_QUEUED, v1::JOB_STATE_RUNNING, v1::JOB_STATE_FAILED}) {
    Job job = MakeJob("u", state);
    ASSERT_OK(store->Insert(&job).status());
  }
  ASSERT_OK_AND_ASSIGN(auto counts, store->CountByState());
  const std::map<JobState, int64_t> expected = {
      {v1::JOB_STATE_QUEUED, 2},    {v1::JOB_STATE_HELD, 0},   {v1::JOB_STATE_RUNNING, 1},
      {v1::JOB_STATE_SUCCEEDED, 0}, {v1::JOB_STATE_FAILED, 1}, {v1::JOB_STATE_CANCELLED, 0}};
  EXPECT_EQ(counts, expected);
}

}  // namespace
}  // namespace megatrain::server
