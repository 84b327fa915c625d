#include "server/worker.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "engine/common/status.h"
#include "engine/common/check.h"
#include "engine/engine.h"
#include "megatrain/internal/worker.pb.h"
#include "nlohmann/json.hpp"
#include "server/run_as.h"
#include "server/spec_convert.h"
#include "server/worker_channel.h"

namespace megatrain::server {
namespace {

using internal::WorkerReply;
using internal::WorkerRequest;

// Sends a heartbeat every `period` until stopped.
class Heartbeat {
 public:
  Heartbeat(WorkerChannel* channel, absl::Duration period)
      : thread_([this, channel, period] {
          std::unique_lock<std::mutex> lock(mu_);
          while (!cv_.wait_for(lock, absl::ToChronoMilliseconds(period), [&] { return stop_; })) {
            WorkerReply beat;
            beat.mutable_heartbeat();
            if (!channel->Write(beat).ok()) return;  // the daemon has gone
          }
        }) {}
  ~Heartbeat() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;  // guarded by mu_
  std::thread thread_;
};


class Worker {
 public:
  explicit Worker(WorkerChannel* channel) : channel_(channel) {}

  // Serves requests until an exit; the exit status.
  int Serve() {
    for (;;) {
      WorkerRequest request;
      absl::Status read = channel_->Read(&request);
      if (!read.ok()) {
        // The daemon closed the channel (it stopped): nothing to answer.
        return absl::IsUnavailable(read) ? 0 : 3;
      }
      if (request.has_context()) SetContext(request.context());
      WorkerReply reply;
      const bool exit = request.what_case() == WorkerRequest::kExit;
      if (exit) {
        job_.reset();  // finishes a background checkpoint
        generation_.reset();
        reply.mutable_ack();
      } else {
        absl::Status done = Handle(request, &reply);
        if (!done.ok()) {
          reply.Clear();
          reply.set_error_code(static_cast<int>(done.code()));
          reply.set_error_message(std::string(done.message()));
        }
      }
      if (!channel_->Write(reply).ok()) return 3;
      if (exit) return 0;
    }
  }

 private:
  void SetContext(const internal::WorkerContext& context) {
    context_ = context;
    roots_ = FileRoots{{context.file_roots().begin(), context.file_roots().end()},
                       context.state_dir()};
    if (context.heartbeat_ms() > 0 && heartbeat_ == nullptr) {
      heartbeat_ = std::make_unique<Heartbeat>(channel_, absl::Milliseconds(context.heartbeat_ms()));
    }
  }

  [[nodiscard]] absl::Status Handle(const WorkerRequest& request, WorkerReply* reply) {
    switch (request.what_case()) {
      case WorkerRequest::kCheck:
        return Check(request.check(), reply->mutable_check());
      case WorkerRequest::kStart:
        return Start(request.start(), reply->mutable_start());
      case WorkerRequest::kStep:
        return Step(reply->mutable_step());
      case WorkerRequest::kSaveCheckpoint:
        return Save(reply->mutable_checkpoint());
      case WorkerRequest::kCheckpointNextStep:
        RETURN_IF_ERROR(NeedTrainingJob());
        job_->CheckpointNextStep();
        reply->mutable_ack();
        return absl::OkStatus();
      case WorkerRequest::kListCheckpoints: {
        internal::CheckpointsReply* list = reply->mutable_checkpoints();  // set, even empty
        for (const std::string& path : ListCheckpoints(checkpoint_dir_)) list->add_paths(path);
        return absl::OkStatus();
      }
      default:
        return absl::InvalidArgumentError("a request the worker does not know");
    }
  }

  [[nodiscard]] absl::Status NeedJob() const {
    if (job_ == nullptr) return absl::FailedPreconditionError("no job started in this worker");
    return absl::OkStatus();
  }
  // A training job, for the requests only it answers (checkpoints).
  [[nodiscard]] absl::Status NeedTrainingJob() const {
    if (generation_ != nullptr) {
      return absl::FailedPreconditionError(
          "a generate or eval job has no checkpoints: its completions are written to its "
          "output as each finishes");
    }
    return NeedJob();
  }

  [[nodiscard]] absl::Status Check(const internal::CheckRequest& check,
                                   internal::CheckReply* out) {
    ASSIGN_OR_RETURN(JobSpec spec, SpecFromRequest(check.request()));
    if (check.check_files()) RETURN_IF_ERROR(CheckJobFiles(spec, roots_, ""));
    ASSIGN_OR_RETURN(std::unique_ptr<Planner> planner,
                     Planner::CreateFromProfile(check.device(), context_.profile_json(),
                                                check.device_budget_bytes(), check.gpus(),
                                                check.host_budget_bytes()));
    ASSIGN_OR_RETURN(const PlanSummary planned, planner->Plan(spec));
    *out->mutable_plan() = JobPlanMessage(planned);
    out->set_spec_yaml(JobSpecToYaml(spec));
    return absl::OkStatus();
  }

  [[nodiscard]] absl::Status Start(const internal::StartRequest& start,
                                   internal::StartReply* out) {
    if (job_ != nullptr || generation_ != nullptr) {
      return absl::FailedPreconditionError("a job runs in this worker");
    }
    ASSIGN_OR_RETURN(JobSpec spec, ParseJobSpec(start.spec_yaml(), "", "stored job spec"));
    const RunOptions run{start.backend(), start.checkpoint_dir(), context_.profile_json()};
    const JobSpec placed = PlacedSpec(spec, run);
    checkpoint_dir_ = placed.checkpoint_dir;
    // Checked again, where the job runs: a folder may have been swapped for a link since
    // submission.
    RETURN_IF_ERROR(CheckJobFiles(placed, roots_, context_.own_dir()));
    if (spec.kind != JobKind::kTrain) return StartGeneration(placed, start, out);
    const absl::Time began = absl::Now();
    ASSIGN_OR_RETURN(job_, TrainingJob::Create(spec, run));
    out->set_create_seconds(absl::ToDoubleSeconds(absl::Now() - began));
    const JobDescription d = job_->Describe();
    out->set_step(d.step);
    out->set_resumed_from_step(d.resumed_from_step);
    out->set_last_loss(d.last_loss);
    out->set_done(d.done);
    out->set_dataset_summary(d.dataset_summary);
    out->set_eval_summary(d.eval_summary);
    out->set_architecture(d.architecture);
    out->set_num_parameters(d.num_parameters);
    out->set_backend_name(d.backend_name);
    out->set_tokens_per_step(d.tokens_per_step);
    out->set_plan_text(d.plan_text);
    out->set_pinned_host_bytes(d.pinned_host_bytes);
    out->set_pageable_host_bytes(d.pageable_host_bytes);
    return absl::OkStatus();
  }

  // A generate or eval job: its output is its state, resumed when an earlier run wrote one.
  [[nodiscard]] absl::Status StartGeneration(const JobSpec& placed,
                                             const internal::StartRequest& start,
                                             internal::StartReply* out) {
    const absl::Time began = absl::Now();
    GenerateSpec g = GenerateSpecOf(placed);
    g.resume_output = start.resume_output();
    ASSIGN_OR_RETURN(generation_, GenerationJob::Create(g, RunOptions{placed.backend, "", ""}));
    out->set_create_seconds(absl::ToDoubleSeconds(absl::Now() - began));
    out->set_step(generation_->prompts_done());
    out->set_done(generation_->prompts_done() == generation_->num_prompts());
    out->set_dataset_summary(absl::StrCat(generation_->num_prompts(), " prompt(s), ",
                                          generation_->prompts_done(), " already completed in ",
                                          g.output_path.empty() ? "no output" : g.output_path));
    out->set_backend_name(placed.backend);
    out->set_plan_text(generation_->Describe());
    return absl::OkStatus();
  }

  // A step of a generate or eval job: the next prompts, a few times the sequences in
  // flight, so that requests (cancel, hold, preemption) are answered between steps.
  [[nodiscard]] absl::Status GenerationStep(internal::StepReply* out) {
    const int64_t before = generation_->prompts_done();
    const int64_t prompts = 4 * generation_->sequences();
    // Each line within a log line's bound (reply_limits.h), and the step's within half a
    // channel frame, however many sequences run at once.
    const size_t line_bytes = std::min<size_t>(
        60 << 10, static_cast<size_t>(WorkerChannel::kMaxFrameBytes / 2 / prompts));
    ASSIGN_OR_RETURN(const GenerationSummary total,
                     generation_->RunSome(prompts, [&](const CompletionReport& c) {
                       out->add_completions(CompletionLogLine(c.json, line_bytes));
                     }));
    out->set_step(generation_->prompts_done());
    out->set_total_steps(generation_->num_prompts());
    out->set_correct(total.correct);
    out->set_tokens(total.new_tokens);  // over this run
    out->set_seconds(total.seconds);
    out->set_tokens_per_second(total.tokens_per_second);
    out->set_done(generation_->prompts_done() == generation_->num_prompts());
    MT_CHECK(generation_->prompts_done() > before || out->done());
    return absl::OkStatus();
  }

  [[nodiscard]] absl::Status Step(internal::StepReply* out) {
    if (generation_ != nullptr) return GenerationStep(out);
    RETURN_IF_ERROR(NeedJob());
    ASSIGN_OR_RETURN(const StepReport r, job_->Step());
    out->set_step(r.step);
    out->set_total_steps(r.total_steps);
    out->set_loss(r.loss);
    for (const EvalReport& e : r.evals) {
      internal::EvalReply* eval = out->add_evals();
      eval->set_step(e.step);
      eval->set_loss(e.loss);
      eval->set_perplexity(e.perplexity);
      eval->set_targets(e.targets);
      eval->set_tokens(e.tokens);
      eval->set_seconds(e.seconds);
      eval->set_tokens_per_second(e.tokens_per_second);
      if (e.has_preference) PreferenceToMessage(e.preference, eval->mutable_preference());
    }
    out->set_has_aux_loss(r.has_aux_loss);
    out->set_aux_loss(r.aux_loss);
    out->set_aux_loss_coef(r.aux_loss_coef);
    if (r.has_preference) PreferenceToMessage(r.preference, out->mutable_preference());
    out->set_lr(r.lr);
    out->set_grad_norm(r.grad_norm);
    out->set_tokens(r.tokens);
    out->set_seconds(r.seconds);
    out->set_tokens_per_second(r.tokens_per_second);
    out->set_model_tflops(r.model_tflops);
    out->set_device_bytes_peak(r.device_bytes_peak);
    out->set_device_bytes_in_use(r.device_bytes_in_use);
    for (double busy : r.stream_busy_seconds) out->add_stream_busy_seconds(busy);
    out->set_optimizer_busy_seconds(r.optimizer_busy_seconds);
    out->set_optimizer_params_per_second(r.optimizer_params_per_second);
    out->set_optimizer_in_step_fraction(r.optimizer_in_step_fraction);
    out->set_h2d_bytes(r.h2d_bytes);
    out->set_d2h_bytes(r.d2h_bytes);
    for (const std::string& path : r.checkpoint_paths) out->add_checkpoint_paths(path);
    out->set_checkpoint_wait_seconds(r.checkpoint_wait_seconds);
    out->set_checkpoint_error(r.checkpoint_error);
    for (int64_t failed : r.failed_checkpoint_steps) out->add_failed_checkpoint_steps(failed);
    out->set_last_checkpoint_seconds(job_->last_checkpoint_seconds());
    out->set_last_checkpoint_bytes(job_->last_checkpoint_bytes());
    out->set_done(job_->done());
    return absl::OkStatus();
  }

  [[nodiscard]] absl::Status Save(internal::CheckpointReply* out) {
    RETURN_IF_ERROR(NeedTrainingJob());
    ASSIGN_OR_RETURN(std::string path, job_->SaveCheckpoint());
    out->set_path(path);
    out->set_step(job_->step());
    out->set_seconds(job_->last_checkpoint_seconds());
    out->set_bytes(job_->last_checkpoint_bytes());
    return absl::OkStatus();
  }

  WorkerChannel* channel_;
  internal::WorkerContext context_;
  FileRoots roots_;
  std::string checkpoint_dir_;
  // Last: its thread writes on the channel until it is gone.
  std::unique_ptr<Heartbeat> heartbeat_;
  std::unique_ptr<TrainingJob> job_;
  std::unique_ptr<GenerationJob> generation_;  // a generate or eval job instead
};

}  // namespace

std::string CompletionLogLine(const std::string& output_line, size_t max_bytes) {
  nlohmann::json j = nlohmann::json::parse(output_line, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return "{}";
  j.erase("logprobs");
  auto dump = [&] { return j.dump(-1, ' ', /*ensure_ascii=*/true, nlohmann::json::error_handler_t::replace); };
  std::string line = dump();
  for (const char* key : {"prompt", "ids"}) {  // a long prompt goes first: the output has it
    if (line.size() <= max_bytes) break;
    j.erase(key);
    j["truncated"] = true;
    line = dump();
  }
  while (line.size() > max_bytes && j.contains("completion") && j["completion"].is_string() &&
         !j["completion"].get<std::string>().empty()) {
    std::string text = j["completion"].get<std::string>();
    size_t keep = text.size() / 2;
    while (keep > 0 && (static_cast<unsigned char>(text[keep]) & 0xC0) == 0x80) --keep;  // a whole character
    text.resize(keep);
    j["completion"] = text;
    j["truncated"] = true;
    line = dump();
  }
  return line;
}

int RunWorker(int fd) {
  WorkerChannel channel(fd);
  Worker worker(&channel);
  return worker.Serve();
}

}  // namespace megatrain::server
