// The streaming subcommands: watch and logs.
//
// `watch` draws one progress line redrawn in place with '\r' when stdout is a terminal
// (cut to the terminal's width: a wrapped line cannot be redrawn), and prints one line per
// step otherwise, so that logs and pipes stay readable. Its exit code is the job's outcome,
// taken from the last state change the stream carried.
#include <sys/ioctl.h>
#include <unistd.h>

#include <cstdio>
#include <optional>

#include "client/commands.h"
#include "client/exit_codes.h"
#include "client/format.h"
#include "client/views.h"

namespace megatrain::client {
namespace {

constexpr int kBarCells = 20;

int TerminalColumns() {
  struct winsize ws {};
  if (::ioctl(STDOUT_FILENO, TIOCGWINSZ, &ws) == 0 && ws.ws_col > 0) return ws.ws_col;
  return 0;
}

// Table-mode output of a watch. Owns the state of the live line on a terminal.
class WatchDisplay {
 public:
  explicit WatchDisplay(bool tty) : tty_(tty) {}

  // Keeps the last bar (ends its line) and prints the state on a line of its own.
  // Also learns from the job whether its progress carries an accuracy (an eval job).
  void ShowState(const v1::Job& job) {
    Finish();
    scored_ = ScoresAnswers(job);
    PrintLine(FormatJobState(job));
    const v1::Progress& p = job.progress();
    if (job.state() == v1::JOB_STATE_RUNNING && (p.step() > 0 || p.prompts_done() > 0)) {
      ShowProgress(p);
    }
    std::fflush(stdout);
  }

  void ShowProgress(const v1::Progress& progress) {
    if (!tty_) {
      PrintLine(FormatProgressLine(progress, scored_));
      std::fflush(stdout);
      return;
    }
    std::string line = FormatProgressBar(progress, kBarCells, scored_);
    const int columns = TerminalColumns();
    if (columns > 1 && line.size() >= static_cast<size_t>(columns)) line.resize(columns - 1);
    std::printf("\r%s\033[K", line.c_str());
    std::fflush(stdout);
    bar_shown_ = true;
  }

  // Ends the live line, if any, so that what follows starts on a fresh line.
  void Finish() {
    if (bar_shown_) std::fputc('\n', stdout);
    bar_shown_ = false;
    std::fflush(stdout);
  }

 private:
  const bool tty_;
  bool bar_shown_ = false;
  bool scored_ = false;  // the job is an eval job
};

}  // namespace

int JobOutcome(const std::optional<v1::Job>& last, int64_t job_id) {
  if (!last.has_value()) {
    std::fprintf(stderr, "error: the watch of job %lld ended before megatraind sent its state\n",
                 static_cast<long long>(job_id));
    return kExitInternal;
  }
  switch (last->state()) {
    case v1::JOB_STATE_SUCCEEDED:
      return kExitOk;
    case v1::JOB_STATE_FAILED:
      std::fprintf(stderr, "error: %s failed: %s\n", JobLabel(*last).c_str(),
                   last->error().empty() ? "megatraind gave no reason; see `megatrain logs`"
                                         : TerminalText(last->error()).c_str());
      return kExitJobFailed;
    case v1::JOB_STATE_CANCELLED:
      return kExitJobCancelled;
    default:
      std::fprintf(stderr,
                   "error: the watch ended while %s is %s; run `megatrain watch %lld` again\n",
                   JobLabel(*last).c_str(), StateName(last->state()).c_str(),
                   static_cast<long long>(job_id));
      return kExitInternal;
  }
}

int Watch(const Context& ctx, int64_t job_id) {
  if (!WaitForConnection(ctx)) return kExitUnreachable;
  v1::WatchJobRequest request;
  request.set_id(job_id);
  auto call = NewCall(ctx, CallKind::kStream);
  auto reader = ctx.jobs->WatchJob(call.get(), request);

  const bool json = ctx.output == Output::kJson;
  WatchDisplay display(::isatty(STDOUT_FILENO) == 1);
  std::optional<v1::Job> last;
  v1::JobEvent event;
  while (reader->Read(&event)) {
    if (event.has_state_change()) last = event.state_change();
    if (json) {
      if (!PrintJson(event)) {
        call->TryCancel();
        reader->Finish();
        return kExitInternal;
      }
    } else if (event.has_state_change()) {
      display.ShowState(event.state_change());
    } else if (event.has_progress()) {
      display.ShowProgress(event.progress());
    }
  }
  display.Finish();
  const grpc::Status status = reader->Finish();
  if (!status.ok()) return ReportRpcError(ctx, status);
  return JobOutcome(last, job_id);
}

int Logs(const Context& ctx, int64_t job_id, bool follow) {
  if (!WaitForConnection(ctx)) return kExitUnreachable;
  v1::StreamLogsRequest request;
  request.set_id(job_id);
  request.set_follow(follow);
  auto call = NewCall(ctx, CallKind::kStream);
  auto reader = ctx.jobs->StreamLogs(call.get(), request);

  v1::LogLine line;
  while (reader->Read(&line)) {
    if (ctx.output == Output::kJson) {
      if (!PrintJson(line)) {
        call->TryCancel();
        reader->Finish();
        return kExitInternal;
      }
      continue;
    }
    PrintLine(TerminalLines(line.text()));
    if (follow) std::fflush(stdout);
  }
  const grpc::Status status = reader->Finish();
  if (!status.ok()) return ReportRpcError(ctx, status);
  return kExitOk;
}

}  // namespace megatrain::client
