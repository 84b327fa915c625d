// The worker channel and the worker process, as the daemon drives them. This test binary
// is its own worker: run as `worker_test worker`, it serves the channel on fd 3 as
// `megatraind worker` does (main below), so WorkerProcess::Spawn starts a real one.
#include <signal.h>
#include <sys/stat.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <string>
#include <thread>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "megatrain/internal/worker.pb.h"
#include "server/identity.h"
#include "server/worker.h"
#include "server/worker_channel.h"
#include "server/worker_process.h"
#include "tests/util/temp_dir.h"

namespace megatrain::server {
namespace {

using internal::WorkerReply;
using internal::WorkerRequest;
using megatrain::testing::TempDir;

// A completion's log line: valid JSON in ASCII whatever its bytes, without logprobs, and
// within its bound, its text cut at a character and marked so.
TEST(CompletionLogLine, IsAsciiJsonWithoutLogprobsAndFitsItsBound) {
  std::string text = "caf\xc3\xa9 \x7f";
  for (int i = 0; i < 2000; ++i) text += "\xe2\x82\xac";  // euro signs: 3 bytes each
  nlohmann::json line = {{"index", 3}, {"prompt", std::string(5000, 'p')}, {"completion", text},
                         {"finish_reason", "length"}, {"ids", std::vector<int>(500, 7)},
                         {"logprobs", std::vector<double>(500, -0.5)}};
  const std::string whole = CompletionLogLine(line.dump(), 1 << 20);
  for (unsigned char c : whole) EXPECT_LT(c, 0x7f) << "not ASCII";
  nlohmann::json back = nlohmann::json::parse(whole, nullptr, /*allow_exceptions=*/false);
  ASSERT_TRUE(back.is_object()) << whole;
  EXPECT_FALSE(back.contains("logprobs"));
  EXPECT_FALSE(back.contains("truncated"));
  EXPECT_EQ(back["completion"], text);
  EXPECT_EQ(back["ids"].size(), 500u);

  const std::string cut = CompletionLogLine(line.dump(), 4000);
  EXPECT_LE(cut.size(), 4000u);
  back = nlohmann::json::parse(cut, nullptr, /*allow_exceptions=*/false);
  ASSERT_TRUE(back.is_object()) << cut;
  EXPECT_TRUE(back["truncated"].get<bool>());
  EXPECT_FALSE(back.contains("prompt"));
  EXPECT_FALSE(back.contains("ids"));
  EXPECT_EQ(back["index"], 3);
  const std::string kept = back["completion"].get<std::string>();
  EXPECT_FALSE(kept.empty());
  EXPECT_EQ(text.compare(0, kept.size(), kept), 0) << "the text's start, whole characters";
}

TEST(WorkerChannel, MessagesCrossWholeInOrder) {
  int fds[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, fds), 0);
  WorkerChannel a(fds[0]), b(fds[1]);
  // More than a socket buffer holds: the writer blocks until the reader takes frames.
  std::thread writer([&] {
    for (int i = 0; i < 3; ++i) {
      WorkerReply reply;
      reply.set_error_message(std::string(100000 * (i + 1), static_cast<char>('a' + i)));
      EXPECT_TRUE(a.Write(reply).ok());
    }
  });
  for (int i = 0; i < 3; ++i) {
    WorkerReply got;
    ASSERT_TRUE(b.Read(&got, absl::Now() + absl::Seconds(10)).ok());
    EXPECT_EQ(got.error_message().size(), 100000u * (i + 1));
    EXPECT_EQ(got.error_message()[0], 'a' + i);
  }
  writer.join();
}

TEST(WorkerChannel, ReadTimesOutWithoutAMessageAndEndsAtClose) {
  int fds[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, fds), 0);
  WorkerChannel b(fds[1]);
  WorkerReply got;
  EXPECT_TRUE(absl::IsDeadlineExceeded(b.Read(&got, absl::Now() + absl::Milliseconds(50))));
  close(fds[0]);
  EXPECT_TRUE(absl::IsUnavailable(b.Read(&got, absl::Now() + absl::Seconds(10))));
}

TEST(WorkerChannel, AFrameOverTheLimitIsRefusedNotAllocated) {
  int fds[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, fds), 0);
  WorkerChannel b(fds[1]);
  const unsigned char huge[4] = {0xff, 0xff, 0xff, 0x7f};  // ~2 GiB
  ASSERT_EQ(write(fds[0], huge, 4), 4);
  WorkerReply got;
  absl::Status read = b.Read(&got, absl::Now() + absl::Seconds(10));
  EXPECT_TRUE(absl::IsDataLoss(read)) << read;
  close(fds[0]);
}

class WorkerProcessTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<int> exe = OpenOwnExecutable();
    ASSERT_TRUE(exe.ok()) << exe.status();
    options_.exe_fd = *exe;
    options_.what = "the test's worker";
    options_.silence_timeout = absl::Seconds(2);
    options_.heartbeat = absl::Milliseconds(100);
    absl::StatusOr<Caller> me = LookupUid(geteuid());
    ASSERT_TRUE(me.ok()) << me.status();
    me_ = *me;
  }
  void TearDown() override { close(options_.exe_fd); }

  // A worker of this user's that has answered its first call.
  std::unique_ptr<WorkerProcess> Answering() {
    absl::StatusOr<std::unique_ptr<WorkerProcess>> worker = WorkerProcess::Spawn(me_, options_);
    EXPECT_TRUE(worker.ok()) << worker.status();
    if (!worker.ok()) return nullptr;
    absl::StatusOr<WorkerReply> reply = (*worker)->Call(First());
    EXPECT_TRUE(reply.ok()) << reply.status();
    return *std::move(worker);
  }

  // What the next call to an answering worker gets once it was sent `signal`.
  absl::Status CallAfterSignal(int signal) {
    std::unique_ptr<WorkerProcess> worker = Answering();
    if (worker == nullptr) return absl::InternalError("no answering worker");
    worker->Signal(signal);
    return worker->Call(First()).status();
  }

  // A list request with the context: the first call to a worker.
  WorkerRequest First() const {
    WorkerRequest request;
    request.mutable_context()->set_heartbeat_ms(absl::ToInt64Milliseconds(options_.heartbeat));
    request.mutable_list_checkpoints();
    return request;
  }

  WorkerOptions options_;
  Caller me_;
};

TEST_F(WorkerProcessTest, AnswersAndExitsWhenAsked) {
  absl::StatusOr<std::unique_ptr<WorkerProcess>> worker = WorkerProcess::Spawn(me_, options_);
  ASSERT_TRUE(worker.ok()) << worker.status();
  absl::StatusOr<WorkerReply> reply = (*worker)->Call(First());
  ASSERT_TRUE(reply.ok()) << reply.status();
  EXPECT_TRUE(reply->has_checkpoints());
  (*worker)->Exit(absl::Seconds(10));
  EXPECT_EQ((*worker)->ended(), "exited with status 0");
}

TEST_F(WorkerProcessTest, ARequestThatFailsInTheWorkerIsItsError) {
  absl::StatusOr<std::unique_ptr<WorkerProcess>> worker = WorkerProcess::Spawn(me_, options_);
  ASSERT_TRUE(worker.ok()) << worker.status();
  WorkerRequest step = First();
  step.mutable_step();  // no job was started
  absl::StatusOr<WorkerReply> reply = (*worker)->Call(step);
  EXPECT_EQ(reply.status().code(), absl::StatusCode::kFailedPrecondition) << reply.status();
  EXPECT_TRUE((*worker)->ended().empty()) << "the worker goes on";
}

TEST_F(WorkerProcessTest, AKilledWorkerIsReportedWithTheSignal) {
  const absl::Status s = CallAfterSignal(SIGKILL);
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
  EXPECT_NE(s.message().find("was killed by SIGKILL"), absl::string_view::npos) << s;
}

TEST_F(WorkerProcessTest, ASilentWorkerIsStoppedAsHung) {
  const absl::Status s = CallAfterSignal(SIGSTOP);
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
  EXPECT_NE(s.message().find("stopped reporting for 2 s"), absl::string_view::npos) << s;
}

TEST_F(WorkerProcessTest, AnInterruptedCallReturnsCancelled) {
  std::unique_ptr<WorkerProcess> worker = Answering();
  ASSERT_NE(worker, nullptr);
  worker->Signal(SIGSTOP);  // the reply never comes
  absl::StatusOr<WorkerReply> reply = worker->Call(First(), [] { return true; });
  EXPECT_TRUE(absl::IsCancelled(reply.status())) << reply.status();
  worker->Stop(absl::Milliseconds(200));
  EXPECT_NE(worker->ended().find("SIGKILL"), std::string::npos) << worker->ended();
}

TEST_F(WorkerProcessTest, AsAnotherUserItRunsWithTheirCredentials) {
  if (geteuid() != 0) GTEST_SKIP() << "acting as another user needs root";
  absl::StatusOr<Caller> nobody = LookupUid(65534);
  if (!nobody.ok()) GTEST_SKIP() << "no 'nobody' account";
  TempDir dir;
  chmod(dir.path().c_str(), 0755);
  const std::string secret = dir.path() + "/secret.jsonl";
  std::ofstream(secret) << "{\"text\": \"root's\"}\n";
  chmod(secret.c_str(), 0600);
  absl::StatusOr<std::unique_ptr<WorkerProcess>> worker = WorkerProcess::Spawn(*nobody, options_);
  ASSERT_TRUE(worker.ok()) << worker.status();
  WorkerRequest check = First();
  check.mutable_context()->add_file_roots("/");
  check.mutable_check()->set_check_files(true);
  check.mutable_check()->mutable_request()->set_spec_yaml(
      "name: t\nmodel: {config: {architectures: [LlamaForCausalLM], hidden_size: 64, "
      "intermediate_size: 128, num_hidden_layers: 1, num_attention_heads: 4, "
      "num_key_value_heads: 4, vocab_size: 260}}\n"
      "data: {path: " + secret + ", tokenizer: byte, seq_len: 16}\n"
      "train: {steps: 1, micro_batch_rows: 1, micro_batches: 1}\n");
  absl::StatusOr<WorkerReply> reply = (*worker)->Call(check);
  EXPECT_EQ(reply.status().code(), absl::StatusCode::kPermissionDenied) << reply.status();
  EXPECT_NE(reply.status().message().find("data.path"), absl::string_view::npos)
      << reply.status();
}

}  // namespace
}  // namespace megatrain::server

int main(int argc, char** argv) {
  if (argc == 2 && std::strcmp(argv[1], "worker") == 0) {
    return megatrain::server::RunWorker(3);
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
