// The commands against a fake megatraind on a unix socket: what each sends (including the
// user metadata), what it prints, and the exit code for each outcome.
#include "client/commands.h"

#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <mutex>

#include "client/exit_codes.h"
#include "tests/client/fake_daemon.h"
#include "gtest/gtest.h"

namespace megatrain::client {
namespace {

v1::Job MakeJob(int64_t id, v1::JobState state) {
  v1::Job job;
  job.set_id(id);
  job.set_name("demo");
  job.set_owner("alice");
  job.set_state(state);
  return job;
}

// Canned answers; records what the client sent. Thread-safe.
class FakeJobs final : public v1::JobService::Service {
 public:
  // The last call's "authorization" metadata ("" when it had none).
  std::string authorization() {
    std::lock_guard<std::mutex> lock(mu_);
    return authorization_;
  }
  int calls() {
    std::lock_guard<std::mutex> lock(mu_);
    return calls_;
  }
  v1::SubmitJobRequest submitted() {
    std::lock_guard<std::mutex> lock(mu_);
    return submitted_;
  }
  std::vector<v1::ListJobsRequest> lists() {
    std::lock_guard<std::mutex> lock(mu_);
    return lists_;
  }

  grpc::Status SubmitJob(grpc::ServerContext* c, const v1::SubmitJobRequest* r,
                         v1::Job* job) override {
    Record(c);
    std::lock_guard<std::mutex> lock(mu_);
    submitted_ = *r;
    *job = MakeJob(12, r->hold() ? v1::JOB_STATE_HELD : v1::JOB_STATE_QUEUED);
    if (r->spec_yaml().find("long") != std::string::npos) {
      job->mutable_plan()->add_warnings("data.seq_len 8192 exceeds max_position_embeddings");
    }
    return grpc::Status::OK;
  }
  grpc::Status GetJob(grpc::ServerContext* c, const v1::GetJobRequest* r, v1::Job* job) override {
    Record(c);
    if (r->id() != 7) return NotFound(r->id());
    *job = MakeJob(7, v1::JOB_STATE_RUNNING);
    job->set_created_unix_ms(1764415805000);
    return grpc::Status::OK;
  }
  // Three jobs, two per page.
  grpc::Status ListJobs(grpc::ServerContext* c, const v1::ListJobsRequest* r,
                        v1::ListJobsResponse* out) override {
    Record(c);
    std::lock_guard<std::mutex> lock(mu_);
    lists_.push_back(*r);
    if (r->page_token().empty()) {
      *out->add_jobs() = MakeJob(3, v1::JOB_STATE_QUEUED);
      *out->add_jobs() = MakeJob(2, v1::JOB_STATE_RUNNING);
      out->set_next_page_token("p2");
    } else {
      *out->add_jobs() = MakeJob(1, v1::JOB_STATE_SUCCEEDED);
    }
    return grpc::Status::OK;
  }
  // 1: succeeds, 2: fails, 3: is cancelled, 4: the stream ends while it is held.
  grpc::Status WatchJob(grpc::ServerContext* c, const v1::WatchJobRequest* r,
                        grpc::ServerWriter<v1::JobEvent>* w) override {
    Record(c);
    if (r->id() < 1 || r->id() > 4) return NotFound(r->id());
    WriteState(w, MakeJob(r->id(), v1::JOB_STATE_RUNNING));
    v1::JobEvent event;
    event.mutable_progress()->set_step(1);
    event.mutable_progress()->set_total_steps(2);
    event.mutable_progress()->set_loss(3.5);
    w->Write(event);
    v1::Job last = MakeJob(r->id(), v1::JOB_STATE_SUCCEEDED);
    if (r->id() == 2) {
      last.set_state(v1::JOB_STATE_FAILED);
      last.set_error("loss is NaN at step 2; lower train.lr");
    }
    if (r->id() == 3) last.set_state(v1::JOB_STATE_CANCELLED);
    if (r->id() == 4) last.set_state(v1::JOB_STATE_HELD);
    WriteState(w, last);
    return grpc::Status::OK;
  }
  grpc::Status StreamLogs(grpc::ServerContext* c, const v1::StreamLogsRequest* r,
                          grpc::ServerWriter<v1::LogLine>* w) override {
    Record(c);
    for (const char* text : {"step 1 loss 3.5", "step 2 loss 3.1\n"}) {
      v1::LogLine line;
      line.set_text(text);
      w->Write(line);
    }
    return grpc::Status::OK;
  }
  grpc::Status CancelJob(grpc::ServerContext* c, const v1::CancelJobRequest* r, v1::Job*) override {
    Record(c);
    return {grpc::StatusCode::FAILED_PRECONDITION, "job 5 has already finished"};
  }
  grpc::Status CheckpointJob(grpc::ServerContext* c, const v1::CheckpointJobRequest* r,
                             v1::CheckpointJobResponse* out) override {
    Record(c);
    out->set_path("/runs/demo/checkpoint-120");
    out->set_step(120);
    return grpc::Status::OK;
  }
  grpc::Status HoldJob(grpc::ServerContext* c, const v1::HoldJobRequest* r, v1::Job*) override {
    Record(c);
    return {grpc::StatusCode::PERMISSION_DENIED, "job 5 belongs to bob"};
  }
  grpc::Status ReleaseJob(grpc::ServerContext* c, const v1::ReleaseJobRequest* r,
                          v1::Job*) override {
    Record(c);
    return {grpc::StatusCode::RESOURCE_EXHAUSTED, "job needs 96.4 GiB; 71.2 GiB is free"};
  }

 private:
  static grpc::Status NotFound(int64_t id) {
    return {grpc::StatusCode::NOT_FOUND, "job " + std::to_string(id) + " not found"};
  }
  static void WriteState(grpc::ServerWriter<v1::JobEvent>* w, const v1::Job& job) {
    v1::JobEvent event;
    *event.mutable_state_change() = job;
    w->Write(event);
  }
  void Record(grpc::ServerContext* c) {
    auto it = c->client_metadata().find("authorization");
    std::lock_guard<std::mutex> lock(mu_);
    ++calls_;
    authorization_ =
        it == c->client_metadata().end() ? "" : std::string(it->second.data(), it->second.size());
  }

  std::mutex mu_;
  std::string authorization_;
  int calls_ = 0;
  v1::SubmitJobRequest submitted_;
  std::vector<v1::ListJobsRequest> lists_;
};

class CommandsTest : public FakeDaemonTest {
 protected:
  void SetUp() override { Serve("megatrain-client-test", {&jobs_}); }

  FakeJobs jobs_;
};

TEST_F(CommandsTest, SubmitSendsTheSpecAndItsFolderAndNoCredentialOverUnix) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() /
                                    ("megatrain-client-test-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "job.yaml") << "name: demo\n";
  SubmitArgs args;
  args.spec_path = (dir / "job.yaml").string();
  args.priority = 3;
  args.hold = true;
  EXPECT_EQ(Capture([&] { return Submit(ctx_, args); }), kExitOk) << err_;
  EXPECT_EQ(out_, "submitted job 12 (demo), held\n");
  const v1::SubmitJobRequest sent = jobs_.submitted();
  EXPECT_EQ(sent.spec_yaml(), "name: demo\n");
  EXPECT_EQ(sent.base_dir(), dir.string());
  EXPECT_EQ(sent.priority(), 3);
  EXPECT_TRUE(sent.hold());
  // Over a Unix socket the daemon reads the uid from the kernel: no credential is sent.
  EXPECT_EQ(jobs_.authorization(), "");
  std::filesystem::remove_all(dir);
}

// The plan's warnings go to stderr at submission; the job is submitted all the same.
TEST_F(CommandsTest, SubmitPrintsThePlansWarnings) {
  std::ofstream("long-job.yaml") << "name: long\n";
  SubmitArgs args;
  args.spec_path = "./long-job.yaml";
  EXPECT_EQ(Capture([&] { return Submit(ctx_, args); }), kExitOk) << err_;
  EXPECT_EQ(out_, "submitted job 12 (demo), queued\n");
  EXPECT_EQ(err_, "warning: data.seq_len 8192 exceeds max_position_embeddings\n");
  std::filesystem::remove("long-job.yaml");
}

TEST_F(CommandsTest, SubmitRelativePathResolvesAgainstTheWorkingDirectory) {
  std::ofstream("relative-job.yaml") << "name: demo\n";
  SubmitArgs args;
  args.spec_path = "./relative-job.yaml";
  EXPECT_EQ(Capture([&] { return Submit(ctx_, args); }), kExitOk) << err_;
  EXPECT_EQ(jobs_.submitted().base_dir(), std::filesystem::current_path().string());
  std::filesystem::remove("relative-job.yaml");
}

TEST_F(CommandsTest, SubmitUnreadableSpecIsAUsageErrorAndSendsNothing) {
  SubmitArgs args;
  args.spec_path = "/nonexistent/job.yaml";
  EXPECT_EQ(Capture([&] { return Submit(ctx_, args); }), kExitUsage);
  EXPECT_EQ(err_,
            "error: cannot read job spec /nonexistent/job.yaml: No such file or directory; "
            "give the path of a YAML job spec\n");
  EXPECT_EQ(jobs_.calls(), 0);
}

TEST_F(CommandsTest, ListOnePageSendsFiltersAndHintsAtMore) {
  ListArgs args;
  args.states = {"queued", "running"};
  args.mine = true;
  args.limit = 2;
  EXPECT_EQ(Capture([&] { return List(ctx_, args); }), kExitOk) << err_;
  ASSERT_EQ(jobs_.lists().size(), 1u);
  const v1::ListJobsRequest sent = jobs_.lists()[0];
  EXPECT_EQ(sent.owner(), "alice");
  EXPECT_EQ(sent.page_size(), 2);
  ASSERT_EQ(sent.states_size(), 2);
  EXPECT_EQ(sent.states(0), v1::JOB_STATE_QUEUED);
  EXPECT_EQ(sent.states(1), v1::JOB_STATE_RUNNING);
  EXPECT_NE(out_.find("ID  NAME  OWNER  STATE"), std::string::npos) << out_;
  EXPECT_EQ(std::count(out_.begin(), out_.end(), '\n'), 3);
  EXPECT_NE(err_.find("--all-pages"), std::string::npos);
}

TEST_F(CommandsTest, ListAllPagesFollowsThePageToken) {
  ListArgs args;
  args.all_pages = true;
  EXPECT_EQ(Capture([&] { return List(ctx_, args); }), kExitOk) << err_;
  ASSERT_EQ(jobs_.lists().size(), 2u);
  EXPECT_EQ(jobs_.lists()[1].page_token(), "p2");
  EXPECT_EQ(std::count(out_.begin(), out_.end(), '\n'), 4);
  EXPECT_EQ(err_, "");
}

TEST_F(CommandsTest, ListJsonPrintsOneResponsePerLine) {
  ctx_.output = Output::kJson;
  ListArgs args;
  args.all_pages = true;
  EXPECT_EQ(Capture([&] { return List(ctx_, args); }), kExitOk) << err_;
  EXPECT_EQ(std::count(out_.begin(), out_.end(), '\n'), 2);
  EXPECT_NE(out_.find("\"next_page_token\":\"p2\""), std::string::npos) << out_;
}

TEST_F(CommandsTest, StatusJsonUsesProtoFieldNames) {
  ctx_.output = Output::kJson;
  EXPECT_EQ(Capture([&] { return Status(ctx_, 7); }), kExitOk) << err_;
  EXPECT_NE(out_.find("\"created_unix_ms\":\"1764415805000\""), std::string::npos) << out_;
  EXPECT_NE(out_.find("\"state\":\"JOB_STATE_RUNNING\""), std::string::npos) << out_;
}

TEST_F(CommandsTest, StatusOfAMissingJobExitsNotFound) {
  EXPECT_EQ(Capture([&] { return Status(ctx_, 99); }), kExitNotFound);
  EXPECT_EQ(err_, "error: job 99 not found\n");
}

TEST_F(CommandsTest, WatchSucceededExitsZeroWithOneLinePerEvent) {
  EXPECT_EQ(Capture([&] { return Watch(ctx_, 1); }), kExitOk) << err_;
  EXPECT_EQ(out_,
            "job 1 (demo): running\n"
            "step 1/2  loss 3.5000  - tok/s  ETA -\n"
            "job 1 (demo): succeeded\n");
}

TEST_F(CommandsTest, WatchFailedExitsTenAndPrintsTheError) {
  EXPECT_EQ(Capture([&] { return Watch(ctx_, 2); }), kExitJobFailed);
  EXPECT_EQ(err_, "error: job 2 (demo) failed: loss is NaN at step 2; lower train.lr\n");
}

TEST_F(CommandsTest, WatchCancelledExitsEleven) {
  EXPECT_EQ(Capture([&] { return Watch(ctx_, 3); }), kExitJobCancelled);
}

TEST_F(CommandsTest, WatchEndingBeforeTheJobEndsIsAnError) {
  EXPECT_EQ(Capture([&] { return Watch(ctx_, 4); }), kExitInternal);
  EXPECT_NE(err_.find("megatrain watch 4"), std::string::npos) << err_;
}

TEST_F(CommandsTest, WatchJsonPrintsOneEventPerLine) {
  ctx_.output = Output::kJson;
  EXPECT_EQ(Capture([&] { return Watch(ctx_, 1); }), kExitOk) << err_;
  EXPECT_EQ(std::count(out_.begin(), out_.end(), '\n'), 3);
  EXPECT_NE(out_.find("\"state_change\""), std::string::npos) << out_;
}

TEST_F(CommandsTest, WatchOfAMissingJobExitsNotFound) {
  EXPECT_EQ(Capture([&] { return Watch(ctx_, 99); }), kExitNotFound);
}

TEST_F(CommandsTest, LogsPrintsEachLineOnce) {
  EXPECT_EQ(Capture([&] { return Logs(ctx_, 7, false); }), kExitOk) << err_;
  EXPECT_EQ(out_, "step 1 loss 3.5\nstep 2 loss 3.1\n");
}

TEST_F(CommandsTest, CheckpointPrintsThePathAlone) {
  EXPECT_EQ(Capture([&] { return Checkpoint(ctx_, 7); }), kExitOk) << err_;
  EXPECT_EQ(out_, "/runs/demo/checkpoint-120\n");
}

TEST_F(CommandsTest, DaemonErrorsMapToTheirExitCodes) {
  EXPECT_EQ(Capture([&] { return Cancel(ctx_, 5); }), kExitFailedPrecondition);
  EXPECT_EQ(err_, "error: job 5 has already finished\n");
  EXPECT_EQ(Capture([&] { return Hold(ctx_, 5); }), kExitPermissionDenied);
  EXPECT_EQ(Capture([&] { return Release(ctx_, 5); }), kExitResourceExhausted);
  EXPECT_EQ(err_, "error: job needs 96.4 GiB; 71.2 GiB is free\n");
}

TEST_F(CommandsTest, UnimplementedServiceSaysTheDaemonMayBeOlder) {
  EXPECT_EQ(Capture([&] { return Node(ctx_); }), kExitInternal);  // no NodeService here
  EXPECT_NE(err_.find("does not implement this call"), std::string::npos) << err_;
}

TEST(CommandsUnreachable, EveryKindOfCallExitsFourWithTheHint) {
  const std::string address = "unix:/tmp/megatrain-client-test-nonexistent.sock";
  const Context ctx = MakeContext(address, Output::kTable, "alice", 5, false);
  const std::string hint = "error: cannot reach megatraind at " + address +
                           ": is it running? (set --addr or MEGATRAIN_ADDR)\n";
  for (const auto& command : std::vector<std::function<int()>>{
           [&] { return List(ctx, ListArgs()); }, [&] { return Watch(ctx, 1); },
           [&] { return Checkpoint(ctx, 1); }, [&] { return Logs(ctx, 1, true); }}) {
    testing::internal::CaptureStderr();
    EXPECT_EQ(command(), kExitUnreachable);
    const std::string err = testing::internal::GetCapturedStderr();
    EXPECT_EQ(err.substr(0, hint.size()), hint);
  }
}

TEST(ExitCodeFor, DocumentedCodes) {
  EXPECT_EQ(ExitCodeFor(grpc::StatusCode::OK), 0);
  EXPECT_EQ(ExitCodeFor(grpc::StatusCode::INTERNAL), 1);
  EXPECT_EQ(ExitCodeFor(grpc::StatusCode::INVALID_ARGUMENT), 2);
  EXPECT_EQ(ExitCodeFor(grpc::StatusCode::NOT_FOUND), 3);
  EXPECT_EQ(ExitCodeFor(grpc::StatusCode::UNAVAILABLE), 4);
  EXPECT_EQ(ExitCodeFor(grpc::StatusCode::PERMISSION_DENIED), 5);
  EXPECT_EQ(ExitCodeFor(grpc::StatusCode::RESOURCE_EXHAUSTED), 6);
  EXPECT_EQ(ExitCodeFor(grpc::StatusCode::FAILED_PRECONDITION), 7);
  EXPECT_EQ(ExitCodeFor(grpc::StatusCode::DEADLINE_EXCEEDED), 1);
}

}  // namespace
}  // namespace megatrain::client
