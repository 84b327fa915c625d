// Hostile text from the daemon: names, owners, errors, paths, log lines, plans, node
// info and audit entries holding ESC, CR, LF and other controls reach the terminal only
// as visible escapes, and a reply over the 4 MiB limit (an older daemon) is a clear error.
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>

#include "client/commands.h"
#include "client/exit_codes.h"
#include "client/format.h"
#include "client/views.h"
#include "tests/client/fake_daemon.h"
#include "gtest/gtest.h"

namespace megatrain::client {
namespace {

constexpr int64_t kNowMs = 1764415805000;

// Clears the screen, moves home, and forges a line of `list` after a CR and a LF.
const std::string kEvil = "evil\x1b[2J\x1b[H\r\n 99  forged  root  running";
// A C1 CSI (U+009B) and a right-to-left override (U+202E), as UTF-8.
const std::string kHiddenControls =
    "a\xC2\x9B"
    "31mb\xE2\x80\xAE"
    "cba";

// What no line printed for a user may hold: ESC, CR, and the 8-bit CSI.
bool HasRawControls(const std::string& text) {
  return text.find('\x1b') != std::string::npos || text.find('\r') != std::string::npos ||
         text.find("\xC2\x9B") != std::string::npos ||
         text.find("\xE2\x80\xAE") != std::string::npos;
}

int Lines(const std::string& text) { return std::count(text.begin(), text.end(), '\n'); }

v1::Job EvilJob(int64_t id) {
  v1::Job job;
  job.set_id(id);
  job.set_name(kEvil);
  job.set_owner(kEvil);
  job.set_state(v1::JOB_STATE_FAILED);
  job.set_device(kEvil);
  job.set_error(kEvil);
  job.set_waiting(kEvil);
  job.set_checkpoint_dir(kEvil);
  job.set_last_checkpoint(kEvil);
  job.set_spec_yaml("name: " + kEvil + "\nsteps: 2\n");
  job.set_created_unix_ms(kNowMs - 1000);
  return job;
}

TEST(TerminalText, ControlsBecomeVisibleEscapesOnOneLine) {
  EXPECT_EQ(TerminalText("a\x1b[2Jb\r\nc\td\x7f"), "a\\x1b[2Jb\\r\\nc\\td\\x7f");
}

TEST(TerminalText, C1ControlsAndBidiOverridesBecomeUnicodeEscapes) {
  EXPECT_EQ(TerminalText(kHiddenControls), "a\\u009b31mb\\u202ecba");
  EXPECT_EQ(TerminalText("x\xE2\x80\xA8y"), "x\\u2028y");  // LINE SEPARATOR
}

TEST(TerminalText, PlainAndUnicodeTextIsUnchanged) {
  EXPECT_EQ(TerminalText("müller-7b — 日本"), "müller-7b — 日本");
  EXPECT_EQ(TerminalText(""), "");
}

TEST(TerminalText, InvalidUtf8BytesAreEscaped) {
  EXPECT_EQ(TerminalText("a\xff\xC3"), "a\\xff\\xc3");
}

TEST(TerminalLines, KeepsNewlinesAndTabsButNotCarriageReturnsOrEscapes) {
  EXPECT_EQ(TerminalLines("one\n\ttwo\r\x1b[2K\nthree\n"), "one\n\ttwo\\r\\x1b[2K\nthree\n");
  EXPECT_EQ(TerminalLines(kHiddenControls + "\n"), "a\\u009b31mb\\u202ecba\n");
}

TEST(FormatTable, CellWithANewlineStaysOnItsRow) {
  const std::string table = FormatTable({{"NAME"}, {"OWNER"}}, {{kEvil, "bob"}});
  EXPECT_EQ(Lines(table), 2) << table;
  EXPECT_FALSE(HasRawControls(table)) << table;
}

TEST(FormatKeyValues, ValueWithControlsStaysOnItsLine) {
  const std::string text = FormatKeyValues({{"name", kEvil}, {"owner", "bob"}});
  EXPECT_EQ(Lines(text), 2) << text;
  EXPECT_FALSE(HasRawControls(text)) << text;
}

TEST(FormatJobTable, NameAndOwnerWithControlsCannotForgeRows) {
  const std::string table = FormatJobTable({EvilJob(1), EvilJob(2)}, kNowMs);
  EXPECT_EQ(Lines(table), 3) << table;
  EXPECT_FALSE(HasRawControls(table)) << table;
  EXPECT_NE(table.find("evil\\x1b[2J\\x1b[H\\r\\n 99  forged"), std::string::npos) << table;
}

TEST(FormatJobStatus, EveryFieldWithControlsIsEscapedAndTheSpecKeepsItsLines) {
  const std::string text = FormatJobStatus(EvilJob(1), kNowMs, absl::UTCTimeZone());
  EXPECT_FALSE(HasRawControls(text)) << text;
  EXPECT_NE(text.find("\n  steps: 2\n"), std::string::npos) << text;
  // A forged line would start with " 99"; every line is a key, or the spec indented.
  EXPECT_EQ(text.find("\n 99"), std::string::npos) << text;
}

TEST(FormatJobState, NameAndDeviceAreEscaped) {
  v1::Job job = EvilJob(3);
  job.set_state(v1::JOB_STATE_RUNNING);
  const std::string line = FormatJobState(job);
  EXPECT_FALSE(HasRawControls(line)) << line;
  EXPECT_EQ(line.find('\n'), std::string::npos) << line;
  EXPECT_FALSE(HasRawControls(FormatSubmitted(job)));
}

TEST(FormatNode, HostGpuAndVersionFieldsAreEscaped) {
  v1::Node node;
  node.set_hostname(kEvil);
  node.set_backend(kEvil);
  node.set_version(kEvil);
  (*node.mutable_versions())["grpc"] = kEvil;
  v1::Gpu* gpu = node.add_gpus();
  gpu->set_name(kEvil);
  gpu->set_pcie_link(kEvil);
  gpu->set_pci_bus_id(kEvil);
  const std::string text = FormatNode(node);
  EXPECT_FALSE(HasRawControls(text)) << text;
  EXPECT_EQ(text.find("\n 99"), std::string::npos) << text;
}

// A daemon whose store holds hostile text; job 9's reply is over the 4 MiB limit.
class HostileJobs final : public v1::JobService::Service {
 public:
  grpc::Status GetJob(grpc::ServerContext*, const v1::GetJobRequest* r, v1::Job* job) override {
    *job = EvilJob(r->id());
    if (r->id() == 9) job->set_name(std::string(5 << 20, 'n'));
    return grpc::Status::OK;
  }
  grpc::Status ListJobs(grpc::ServerContext*, const v1::ListJobsRequest* r,
                        v1::ListJobsResponse* out) override {
    *out->add_jobs() = EvilJob(2);
    if (r->owner() == "huge") out->mutable_jobs(0)->set_spec_yaml(std::string(6 << 20, 's'));
    return grpc::Status::OK;
  }
  grpc::Status WatchJob(grpc::ServerContext*, const v1::WatchJobRequest* r,
                        grpc::ServerWriter<v1::JobEvent>* w) override {
    v1::JobEvent event;
    *event.mutable_state_change() = EvilJob(r->id());
    w->Write(event);
    return grpc::Status::OK;
  }
  grpc::Status StreamLogs(grpc::ServerContext*, const v1::StreamLogsRequest*,
                          grpc::ServerWriter<v1::LogLine>* w) override {
    v1::LogLine line;
    line.set_text("step 1\r\x1b[2Kstep 9 loss 0.0\nsecond line\n");
    w->Write(line);
    return grpc::Status::OK;
  }
  grpc::Status CheckpointJob(grpc::ServerContext*, const v1::CheckpointJobRequest*,
                             v1::CheckpointJobResponse* out) override {
    out->set_path("/runs/" + kEvil);
    return grpc::Status::OK;
  }
  grpc::Status CancelJob(grpc::ServerContext*, const v1::CancelJobRequest*, v1::Job*) override {
    return {grpc::StatusCode::PERMISSION_DENIED, "job 5 belongs to " + kEvil};
  }
  grpc::Status PlanJob(grpc::ServerContext*, const v1::SubmitJobRequest*,
                       v1::JobPlan* plan) override {
    plan->set_text("plan for " + kEvil + "\nsecond line\n");
    return grpc::Status::OK;
  }
  grpc::Status SubmitJob(grpc::ServerContext*, const v1::SubmitJobRequest*, v1::Job* job) override {
    *job = EvilJob(12);
    job->mutable_plan()->add_warnings(kEvil);
    return grpc::Status::OK;
  }
};

class HostileAccess final : public v1::AccessService::Service {
 public:
  grpc::Status WhoAmI(grpc::ServerContext*, const v1::WhoAmIRequest*, v1::Identity* me) override {
    me->set_user(kEvil);
    me->add_groups(kEvil);
    me->set_authenticated_by(kEvil);
    return grpc::Status::OK;
  }
  grpc::Status ListTokens(grpc::ServerContext*, const v1::ListTokensRequest*,
                          v1::ListTokensResponse* out) override {
    v1::Token* t = out->add_tokens();
    t->set_user(kEvil);
    t->set_name(kEvil);
    return grpc::Status::OK;
  }
  grpc::Status ListAudit(grpc::ServerContext*, const v1::ListAuditRequest*,
                         v1::ListAuditResponse* out) override {
    v1::AuditEntry* e = out->add_entries();
    e->set_user(kEvil);
    e->set_action(kEvil);
    e->set_detail(kEvil);
    e->set_outcome(kEvil);
    return grpc::Status::OK;
  }
  grpc::Status GetUsage(grpc::ServerContext*, const v1::GetUsageRequest*,
                        v1::GetUsageResponse* out) override {
    out->add_users()->set_user(kEvil);
    return grpc::Status::OK;
  }
};

class HostileDaemonTest : public FakeDaemonTest {
 protected:
  void SetUp() override { Serve("megatrain-hostile-test", {&jobs_, &access_}); }

  void ExpectNoRawControls() {
    EXPECT_FALSE(HasRawControls(out_)) << out_;
    EXPECT_FALSE(HasRawControls(err_)) << err_;
    EXPECT_EQ(out_.find("\n 99"), std::string::npos) << out_;
  }

  HostileJobs jobs_;
  HostileAccess access_;
};

TEST_F(HostileDaemonTest, ListPrintsOneRowPerJobWithControlsEscaped) {
  EXPECT_EQ(Capture([&] { return List(ctx_, ListArgs()); }), kExitOk) << err_;
  ExpectNoRawControls();
  EXPECT_EQ(Lines(out_), 2) << out_;
}

// JSON is escaped by protobuf's encoder: ESC as \u001b, CR as \r, LF as \n.
TEST_F(HostileDaemonTest, ListJsonEscapesControlsInStrings) {
  ctx_.output = Output::kJson;
  EXPECT_EQ(Capture([&] { return List(ctx_, ListArgs()); }), kExitOk) << err_;
  ExpectNoRawControls();
  EXPECT_EQ(Lines(out_), 1) << out_;
  EXPECT_NE(out_.find("evil\\u001b[2J\\u001b[H\\r\\n 99"), std::string::npos) << out_;
}

TEST_F(HostileDaemonTest, StatusEscapesEveryField) {
  EXPECT_EQ(Capture([&] { return Status(ctx_, 7); }), kExitOk) << err_;
  ExpectNoRawControls();
}

TEST_F(HostileDaemonTest, WatchEscapesTheStateLineAndTheError) {
  EXPECT_EQ(Capture([&] { return Watch(ctx_, 2); }), kExitJobFailed);
  ExpectNoRawControls();
  EXPECT_EQ(Lines(out_), 1) << out_;
  EXPECT_EQ(Lines(err_), 1) << err_;
}

TEST_F(HostileDaemonTest, LogsKeepNewlinesButEscapeCarriageReturnsAndEscapes) {
  EXPECT_EQ(Capture([&] { return Logs(ctx_, 7, false); }), kExitOk) << err_;
  EXPECT_EQ(out_, "step 1\\r\\x1b[2Kstep 9 loss 0.0\nsecond line\n");
}

TEST_F(HostileDaemonTest, CheckpointPathIsEscaped) {
  EXPECT_EQ(Capture([&] { return Checkpoint(ctx_, 7); }), kExitOk) << err_;
  ExpectNoRawControls();
  EXPECT_EQ(Lines(out_), 1) << out_;
}

TEST_F(HostileDaemonTest, ErrorMessageQuotingANameIsEscaped) {
  EXPECT_EQ(Capture([&] { return Cancel(ctx_, 5); }), kExitPermissionDenied);
  ExpectNoRawControls();
  EXPECT_EQ(Lines(err_), 1) << err_;
}

TEST_F(HostileDaemonTest, PlanKeepsItsLinesButEscapesControls) {
  const std::string spec = "hostile-plan-" + std::to_string(::getpid()) + ".yaml";
  std::ofstream(spec) << "name: demo\n";
  EXPECT_EQ(Capture([&] { return Plan(ctx_, spec); }), kExitOk) << err_;
  EXPECT_FALSE(HasRawControls(out_)) << out_;
  // The plan's own newline and the name's LF split lines; its CR does not.
  EXPECT_EQ(out_, "plan for evil\\x1b[2J\\x1b[H\\r\n 99  forged  root  running\nsecond line\n");
  SubmitArgs args;
  args.spec_path = spec;
  EXPECT_EQ(Capture([&] { return Submit(ctx_, args); }), kExitOk) << err_;
  ExpectNoRawControls();
  EXPECT_EQ(Lines(out_), 1) << out_;
  EXPECT_EQ(Lines(err_), 1) << err_;  // the warning
  std::filesystem::remove(spec);
}

TEST_F(HostileDaemonTest, AccessCommandsEscapeNamesDetailsAndOutcomes) {
  for (const auto& command : std::vector<std::function<int()>>{
           [&] { return WhoAmI(ctx_); },
           [&] {
             TokenArgs args;
             args.action = "list";
             return Token(ctx_, args);
           },
           [&] { return Audit(ctx_, AuditArgs()); }, [&] { return Usage(ctx_); }}) {
    EXPECT_EQ(Capture(command), kExitOk) << err_;
    ExpectNoRawControls();
  }
}

// An older daemon sends a 5 MiB job: gRPC refuses it with RESOURCE_EXHAUSTED.
TEST_F(HostileDaemonTest, ReplyOverTheMessageLimitIsAClearError) {
  EXPECT_EQ(Capture([&] { return Status(ctx_, 9); }), kExitInternal);
  EXPECT_EQ(out_, "");
  EXPECT_NE(err_.find("too large to receive (5.0 MiB; this CLI accepts 4.0 MiB)"),
            std::string::npos)
      << err_;
  EXPECT_NE(err_.find("upgrade megatraind"), std::string::npos) << err_;
  ListArgs args;
  args.owner = "huge";
  EXPECT_EQ(Capture([&] { return List(ctx_, args); }), kExitInternal);
  EXPECT_NE(err_.find("too large to receive"), std::string::npos) << err_;
}

}  // namespace
}  // namespace megatrain::client
