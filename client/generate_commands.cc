// `megatrain generate` and `megatrain eval`: a job of kind generate or eval made from the
// command line, submitted, then followed until it ends.
//
// The completions come from the job's log, where the daemon writes one line
// "completion {json}" per finished prompt, and not from WatchJob: the log holds each
// completion once, in the order they finished, from the job's first run on, so a job
// that waited in the queue or was preempted part way still shows every one. Its outcome
// and accuracy come from the job itself (GetJob) once the log ends.
#include <cstdio>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "client/commands.h"
#include "client/exit_codes.h"
#include "client/format.h"
#include "client/views.h"
#include "nlohmann/json.hpp"

namespace megatrain::client {
namespace {

constexpr absl::string_view kCompletionPrefix = "completion ";

// At most this much of a malformed completion line is quoted in the warning about it.
constexpr size_t kQuotedBytes = 120;

void SetGenerate(const GenerateArgs& args, v1::JobSpec::Generate* g) {
  for (const std::string& prompt : args.prompts) g->add_prompt(prompt);
  g->set_prompts(args.prompts_path);
  g->set_output(args.output_path);
  g->set_max_new_tokens(args.max_new_tokens);
  g->set_temperature(args.temperature);
  g->set_top_k(args.top_k);
  if (args.top_p.has_value()) g->set_top_p(*args.top_p);
  g->set_seed(args.seed);
  for (const std::string& stop : args.stop) g->add_stop(stop);
  for (int32_t id : args.stop_ids) g->add_stop_ids(id);
  g->set_ignore_eos(args.ignore_eos);
  g->set_chat(args.chat);
  g->set_tokenizer(args.tokenizer);
  g->set_max_sequences(args.max_sequences);
  g->set_answer_pattern(args.answer_pattern);
}

// The request for `args` as a job of `kind`: paths as given, resolved by the daemon
// against the working folder. Only the model and generate sections are set: a job of
// these kinds has no other. On failure prints why and returns false.
bool GenerationRequest(const GenerateArgs& args, const char* kind, v1::SubmitJobRequest* request) {
  std::error_code ec;
  const std::filesystem::path cwd = std::filesystem::current_path(ec);
  if (ec) {
    std::fprintf(stderr,
                 "error: cannot read the working folder, which relative paths resolve "
                 "against: %s; give absolute paths from a folder that exists\n",
                 ec.message().c_str());
    return false;
  }
  request->set_base_dir(cwd.string());
  request->set_priority(args.priority);
  v1::JobSpec* spec = request->mutable_spec();
  spec->set_kind(kind);
  spec->set_name(args.name.empty() ? kind : args.name);
  spec->mutable_model()->set_path(args.model);
  SetGenerate(args, spec->mutable_generate());
  return true;
}

// Why a completion line is not a JSON object, as far as the client can tell.
std::string Malformed(absl::string_view json) {
  // The daemon cuts a log line it sends at a bound, marking the cut.
  if (absl::StrContains(json, "... (truncated, ") && absl::EndsWith(json, " bytes)")) {
    return "longer than a log line megatraind sends";
  }
  return absl::StrCat("not a JSON object: ", TerminalText(json.substr(0, kQuotedBytes)));
}

// Prints one completion's JSON as the daemon logged it (--output json) or, with `text`,
// its text ("[index] " first when `numbered`); else nothing. A line that is not a JSON
// object is skipped with a warning: stdout stays one JSON object a line.
void ShowCompletion(const Context& ctx, const std::string& json, bool text, bool numbered) {
  if (ctx.output != Output::kJson && !text) return;
  const nlohmann::json completion =
      nlohmann::json::parse(json, nullptr, /*allow_exceptions=*/false);
  if (!completion.is_object()) {
    std::fprintf(stderr, "warning: skipped a completion: %s; the job's output file holds it\n",
                 Malformed(json).c_str());
    return;
  }
  if (ctx.output == Output::kJson) {
    PrintLine(json);
  } else if (text) {
    const auto index = completion.find("index");
    const auto body = completion.find("completion");
    std::string line;
    if (numbered && index != completion.end() && index->is_number_integer()) {
      line = absl::StrFormat("[%d] ", index->get<int64_t>());
    }
    if (body != completion.end() && body->is_string()) {
      line += TerminalLines(body->get_ref<const std::string&>());
    }
    PrintLine(line);
  }
  std::fflush(stdout);
}

// Follows job `job_id`'s log until the job ends, passing each completion's JSON to
// `show`. Returns kExitOk, or the exit code of a stream that failed (reported).
int FollowCompletions(const Context& ctx, int64_t job_id,
                      const std::function<void(const std::string&)>& show) {
  v1::StreamLogsRequest request;
  request.set_id(job_id);
  request.set_follow(true);
  auto call = NewCall(ctx, CallKind::kStream);
  auto reader = ctx.jobs->StreamLogs(call.get(), request);
  v1::LogLine line;
  while (reader->Read(&line)) {
    if (absl::StartsWith(line.text(), kCompletionPrefix)) {
      show(line.text().substr(kCompletionPrefix.size()));
    }
  }
  const grpc::Status status = reader->Finish();
  if (!status.ok()) return ReportRpcError(ctx, status);
  return kExitOk;
}

// "accuracy: 2/3 = 0.6667", or {"prompts": 3, "correct": 2, "accuracy": 0.6666666667}.
void PrintAccuracy(const Context& ctx, const v1::Progress& p) {
  if (ctx.output == Output::kJson) {
    PrintLine(absl::StrFormat(R"({"prompts": %d, "correct": %d, "accuracy": %.10g})",
                              p.prompts_done(), p.correct(), p.accuracy()));
  } else {
    PrintLine(
        absl::StrFormat("accuracy: %d/%d = %.4f", p.correct(), p.prompts_done(), p.accuracy()));
  }
  std::fflush(stdout);
}

// Submits `request`; prints the plan's warnings. Returns the exit code (failures reported).
int SubmitGeneration(const Context& ctx, const v1::SubmitJobRequest& request, v1::Job* job) {
  auto call = NewCall(ctx, CallKind::kReply);
  const grpc::Status status = ctx.jobs->SubmitJob(call.get(), request, job);
  if (!status.ok()) return ReportRpcError(ctx, status);
  for (const std::string& w : job->plan().warnings()) {
    std::fprintf(stderr, "warning: %s\n", TerminalText(w).c_str());
  }
  return kExitOk;
}

// The job after its log ended, and the exit code of its outcome (as `watch`'s).
int FinishedJob(const Context& ctx, int64_t job_id, v1::Job* job) {
  v1::GetJobRequest request;
  request.set_id(job_id);
  auto call = NewCall(ctx, CallKind::kReply);
  const grpc::Status status = ctx.jobs->GetJob(call.get(), request, job);
  if (!status.ok()) return ReportRpcError(ctx, status);
  return JobOutcome(*job, job_id);
}

// Generate (`eval` false) or eval: submit, then follow unless detached.
int RunGeneration(const Context& ctx, const GenerateArgs& args, bool eval) {
  if (args.prompts.empty() && args.prompts_path.empty()) {
    std::fprintf(stderr,
                 "error: no prompts: give --prompt TEXT (repeat it for several) or --prompts "
                 "FILE.jsonl\n");
    return kExitUsage;
  }
  v1::SubmitJobRequest request;
  if (!GenerationRequest(args, eval ? "eval" : "generate", &request)) return kExitUsage;
  v1::Job job;
  if (const int rc = SubmitGeneration(ctx, request, &job); rc != kExitOk) return rc;
  if (args.detach) {
    if (ctx.output == Output::kJson) return PrintJson(job) ? kExitOk : kExitInternal;
    PrintLine(FormatSubmitted(job));
    return kExitOk;
  }
  std::fprintf(stderr, "%s; following it (Ctrl-C stops following, not the job)\n",
               FormatSubmitted(job).c_str());
  const bool numbered = !args.prompts_path.empty() || args.prompts.size() > 1;
  const int followed = FollowCompletions(ctx, job.id(), [&](const std::string& json) {
    ShowCompletion(ctx, json, /*text=*/!eval, numbered);
  });
  if (followed != kExitOk) return followed;
  const int outcome = FinishedJob(ctx, job.id(), &job);
  if (outcome == kExitOk && eval) PrintAccuracy(ctx, job.progress());
  return outcome;
}

}  // namespace

int Generate(const Context& ctx, const GenerateArgs& args) {
  return RunGeneration(ctx, args, /*eval=*/false);
}

int Eval(const Context& ctx, const GenerateArgs& args) {
  return RunGeneration(ctx, args, /*eval=*/true);
}

}  // namespace megatrain::client
