#include "server/job_service.h"

#include <filesystem>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "engine/common/printable.h"
#include "engine/common/status.h"
#include "engine/common/units.h"
#include "server/reply_limits.h"
#include "server/run_as.h"
#include "server/spec_convert.h"
#include "server/worker_process.h"

namespace megatrain::server {
namespace {

bool Terminal(v1::JobState state) {
  return state == v1::JOB_STATE_SUCCEEDED || state == v1::JOB_STATE_FAILED ||
         state == v1::JOB_STATE_CANCELLED;
}

}  // namespace

grpc::Status ToGrpc(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), Printable(status.message()));
}

bool Owns(const Caller& who, const v1::Job& job) {
  if (job.owner_uid() != 0 || job.owner() == "root") return job.owner_uid() == who.uid;
  return job.owner() == who.user;
}

std::string Outcome(const grpc::Status& status) {
  if (status.ok()) return "ok";
  // gRPC's codes are absl's, number for number.
  return absl::StrCat(
      absl::StatusCodeToString(static_cast<absl::StatusCode>(status.error_code())), ": ",
      status.error_message());
}

JobServiceImpl::JobServiceImpl(JobStore* store, EventHub* hub, JobRunner* runner,
                               const JobServiceOptions& options)
    : store_(store), hub_(hub), runner_(runner), options_(options) {}

absl::StatusOr<internal::CheckReply> JobServiceImpl::Check(const Caller& who,
                                                           const v1::SubmitJobRequest& req,
                                                           bool check_files) {
  const WorkerLimits& limits = options_.config->workers;
  WorkerOptions options;
  options.exe_fd = options_.exe_fd;
  options.what = "the submission's check";
  options.memory_bytes = static_cast<int64_t>(limits.check_memory_gib * (int64_t{1} << 30));
  options.memory_rule = "workers.check_memory_gib";
  options.open_files = limits.open_files;
  options.processes = limits.processes;
  options.silence_timeout = absl::Seconds(limits.check_timeout_s);
  ASSIGN_OR_RETURN(std::unique_ptr<WorkerProcess> worker, WorkerProcess::Spawn(who, options));
  internal::WorkerRequest request;
  internal::WorkerContext* context = request.mutable_context();
  for (const std::string& root : options_.config->file_roots) context->add_file_roots(root);
  context->set_state_dir(options_.state_dir);
  context->set_profile_json(options_.profile_json);
  context->set_heartbeat_ms(absl::ToInt64Milliseconds(options.heartbeat));
  internal::CheckRequest* check = request.mutable_check();
  *check->mutable_request() = req;
  check->set_check_files(check_files);
  check->set_device(options_.planner->gpus() > 0 ? "cuda" : "cpu");
  check->set_device_budget_bytes(options_.planner->device_budget_bytes());
  check->set_host_budget_bytes(options_.host_memory_bytes);
  check->set_gpus(options_.planner->gpus());
  const absl::Time deadline = absl::Now() + absl::Seconds(limits.check_timeout_s);
  absl::StatusOr<internal::WorkerReply> reply = worker->Call(request, nullptr, deadline);
  if (absl::IsDeadlineExceeded(reply.status())) {
    worker->Stop(absl::Seconds(1));
    return absl::DeadlineExceededError(absl::StrFormat(
        "checking the job's spec, files and plan timed out after %.0f s (a model, tokenizer or "
        "data path that blocks when read, or one too large to read in that time?)",
        limits.check_timeout_s));
  }
  if (!reply.ok()) return reply.status();
  worker->Exit(absl::Seconds(5));
  return reply->check();
}

grpc::Status JobServiceImpl::PlanJob(grpc::ServerContext* ctx, const v1::SubmitJobRequest* req,
                                     v1::JobPlan* resp) {
  MT_IDENTIFY(who, options_.auth, ctx);
  if (absl::Status can = CanActFor(who); !can.ok()) return ToGrpc(can);
  absl::StatusOr<internal::CheckReply> checked = Check(who, *req, /*check_files=*/false);
  if (!checked.ok()) return ToGrpc(checked.status());
  *resp = checked->plan();
  return grpc::Status::OK;
}

grpc::Status JobServiceImpl::Audited(const Caller& who, const std::string& action,
                                     int64_t job_id, const std::string& detail,
                                     grpc::Status result) {
  AuditEntry entry;
  entry.user = who.user;
  entry.action = action;
  entry.job_id = job_id;
  entry.detail = detail;
  entry.outcome = Outcome(result);
  // The outcome is decided, and what the call changed committed: an entry that fails is
  // reported, not returned.
  if (absl::Status audited = store_->Audit(entry); !audited.ok()) {
    ReportWriteFailure(job_id,
                       absl::StrCat("recording the audit entry of ", who.user, "'s ", action),
                       audited);
  }
  return result;
}

grpc::Status JobServiceImpl::MayChange(const Caller& who, int64_t id, const std::string& action,
                                       v1::Job* found) {
  absl::StatusOr<v1::Job> job = store_->Get(id);
  if (!job.ok()) return ToGrpc(job.status());
  if (found != nullptr) *found = *job;
  if (Owns(who, *job) || who.admin) return grpc::Status::OK;
  return grpc::Status(
      grpc::StatusCode::PERMISSION_DENIED,
      absl::StrCat("job ", id, " belongs to ", job->owner(), "; only its owner or an admin",
                   options_.config->admin_group.empty()
                       ? ""
                       : absl::StrCat(" (group ", options_.config->admin_group, ")"),
                   " may ", action, " it"));
}

grpc::Status JobServiceImpl::SubmitJob(grpc::ServerContext* ctx, const v1::SubmitJobRequest* req,
                                       v1::Job* resp) {
  MT_IDENTIFY(who, options_.auth, ctx);
  std::string detail;
  grpc::Status result = Submit(who, *req, resp, &detail);
  BoundJobForReply(resp);
  return Audited(who, "submit", result.ok() ? resp->id() : 0, detail, result);
}

grpc::Status JobServiceImpl::Submit(const Caller& who, const v1::SubmitJobRequest& req,
                                    v1::Job* resp, std::string* detail) {
  if (absl::Status can = CanActFor(who); !can.ok()) return ToGrpc(can);
  const UserLimits limits = options_.config->LimitsFor(who.user);
  if (!who.admin && req.priority() > limits.max_priority) {
    return grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                        absl::StrCat("priority ", req.priority(), " is above ", who.user,
                                     "'s highest, ", limits.max_priority,
                                     " (higher priorities are for admins)"));
  }
  // The spec is read, its files checked and the job planned in a process of the user's:
  // a path they cannot read is refused exactly as if the daemon were them, and a spec or
  // file that would hang or crash its reader is refused, the daemon untouched.
  absl::StatusOr<internal::CheckReply> checked = Check(who, req, /*check_files=*/true);
  if (!checked.ok()) return ToGrpc(checked.status());
  absl::StatusOr<JobSpec> spec = ParseJobSpec(checked->spec_yaml(), "", "checked job spec");
  if (!spec.ok()) return ToGrpc(spec.status());
  *detail = absl::StrCat(spec->name, ", priority ", req.priority());
  if (spec->devices > 1) {
    if (absl::Status can = runner_->CanRunDevices(spec->devices); !can.ok()) return ToGrpc(can);
  }
  const v1::JobPlan& plan = checked->plan();
  const int64_t need = plan.host_bytes();

  MutexLock lock(&submit_mu_);  // admission sees every job admitted before it
  if (!who.admin && limits.max_queued_jobs > 0) {
    absl::StatusOr<std::vector<v1::Job>> waiting = store_->List(
        {v1::JOB_STATE_QUEUED, v1::JOB_STATE_HELD}, who.user, 0, limits.max_queued_jobs + 1);
    if (!waiting.ok()) return ToGrpc(waiting.status());
    int mine = 0;
    for (const v1::Job& waiting_job : *waiting) mine += Owns(who, waiting_job) ? 1 : 0;
    if (mine >= limits.max_queued_jobs) {
      return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                          absl::StrCat(who.user, " has ", mine, " jobs queued or held, the most ",
                                       "allowed (limits.max_queued_jobs); cancel some or wait"));
    }
  }
  if (options_.host_memory_bytes > 0 && need > options_.host_memory_bytes) {
    return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                        absl::StrFormat("job needs %.2f GiB of host memory; this node has %.2f GiB "
                                        "for jobs; use a smaller model or fewer tokens per step",
                                        GiB(need), GiB(options_.host_memory_bytes)));
  }
  if (!who.admin && limits.max_host_bytes > 0 && need > limits.max_host_bytes) {
    return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                        absl::StrFormat("job needs %.2f GiB of host memory; %s may use at most "
                                        "%.2f GiB (limits.max_host_memory_gib)",
                                        GiB(need), who.user, GiB(limits.max_host_bytes)));
  }
  v1::Job job;
  job.set_name(spec->name);
  job.set_owner(who.user);
  job.set_owner_uid(who.uid);
  job.set_priority(req.priority());
  // Stored unqueued until its spec is complete, so the runner cannot claim it early.
  job.set_state(v1::JOB_STATE_UNSPECIFIED);
  job.set_host_bytes_estimate(need);
  *job.mutable_plan() = plan;
  job.set_created_unix_ms(NowUnixMs());
  absl::StatusOr<int64_t> id = store_->Insert(&job);
  if (!id.ok()) return ToGrpc(id.status());
  // The daemon keeps every job's checkpoints, so it can resume any job after a crash: in
  // a folder of the job's own, owned by its user.
  if (spec->checkpoint_dir.empty()) {
    absl::StatusOr<std::string> dir = MakeJobFolder(options_.state_dir, *id, who);
    if (!dir.ok()) {
      job.set_error(std::string(dir.status().message()));
      // The call fails with the folder's error either way; a failed record is reported.
      if (absl::Status failed = runner_->SetState(&job, v1::JOB_STATE_FAILED,
                                                  absl::StrCat("error: ", job.error()));
          !failed.ok()) {
        ReportWriteFailure(job.id(), "recording its failure", failed);
      }
      return ToGrpc(dir.status());
    }
    spec->checkpoint_dir = *dir + "/checkpoints";
  }
  job.set_checkpoint_dir(spec->checkpoint_dir);
  job.set_spec_yaml(JobSpecToYaml(*spec));
  job.set_kind(SpecName(spec->kind));
  if (spec->kind == JobKind::kTrain) job.mutable_progress()->set_total_steps(spec->steps);
  absl::Status queued =
      runner_->SetState(&job, req.hold() ? v1::JOB_STATE_HELD : v1::JOB_STATE_QUEUED,
                        absl::StrCat("submitted by ", job.owner(), req.hold() ? ", held" : ""));
  if (!queued.ok()) return ToGrpc(queued);
  runner_->Wake();
  *resp = job;
  return grpc::Status::OK;
}

grpc::Status JobServiceImpl::GetJob(grpc::ServerContext* ctx, const v1::GetJobRequest* req,
                                    v1::Job* resp) {
  MT_IDENTIFY(who, options_.auth, ctx);
  absl::StatusOr<v1::Job> job = store_->Get(req->id());
  if (!job.ok()) return ToGrpc(job.status());
  *resp = *job;
  BoundJobForReply(resp);
  return grpc::Status::OK;
}

grpc::Status JobServiceImpl::ListJobs(grpc::ServerContext* ctx, const v1::ListJobsRequest* req,
                                      v1::ListJobsResponse* resp) {
  MT_IDENTIFY(who, options_.auth, ctx);
  int limit = req->page_size() <= 0 ? 100 : std::min(req->page_size(), 1000);
  int64_t before = 0;
  if (!req->page_token().empty() && !absl::SimpleAtoi(req->page_token(), &before)) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        "page_token is not one this server returned");
  }
  std::vector<v1::JobState> typed;
  for (int state : req->states()) typed.push_back(static_cast<v1::JobState>(state));
  absl::StatusOr<std::vector<v1::Job>> jobs = store_->List(typed, req->owner(), before, limit + 1);
  if (!jobs.ok()) return ToGrpc(jobs.status());
  // Each job bounded, and the page cut short of the client's message limit.
  FillListJobsReply(*std::move(jobs), limit, resp);
  return grpc::Status::OK;
}

grpc::Status JobServiceImpl::WatchJob(grpc::ServerContext* ctx, const v1::WatchJobRequest* req,
                                      grpc::ServerWriter<v1::JobEvent>* writer) {
  MT_IDENTIFY(who, options_.auth, ctx);
  int64_t version = hub_->Version(req->id());
  // Read the last seq before the job: an event in between is sent twice, never missed.
  absl::StatusOr<int64_t> last = store_->LastEventSeq(req->id());
  if (!last.ok()) return ToGrpc(last.status());
  int64_t seq = *last;
  absl::StatusOr<v1::Job> job = store_->Get(req->id());
  if (!job.ok()) return ToGrpc(job.status());
  v1::JobEvent first;
  first.set_job_id(job->id());
  first.set_seq(seq);
  first.set_unix_ms(NowUnixMs());
  *first.mutable_state_change() = *job;
  BoundJobEventForReply(&first);
  if (!writer->Write(first)) return grpc::Status::OK;
  if (Terminal(job->state())) return grpc::Status::OK;
  while (!ctx->IsCancelled()) {
    absl::StatusOr<std::vector<v1::JobEvent>> events = store_->EventsAfter(req->id(), seq, 1000);
    if (!events.ok()) return ToGrpc(events.status());
    for (v1::JobEvent& event : *events) {
      seq = event.seq();
      BoundJobEventForReply(&event);
      if (!writer->Write(event)) return grpc::Status::OK;
      if (event.has_state_change() && Terminal(event.state_change().state())) {
        return grpc::Status::OK;
      }
    }
    if (events->empty()) {
      version = hub_->WaitPast(req->id(), version, absl::Now() + absl::Milliseconds(500));
    }
  }
  return grpc::Status::OK;
}

grpc::Status JobServiceImpl::StreamLogs(grpc::ServerContext* ctx, const v1::StreamLogsRequest* req,
                                        grpc::ServerWriter<v1::LogLine>* writer) {
  MT_IDENTIFY(who, options_.auth, ctx);
  absl::StatusOr<v1::Job> exists = store_->Get(req->id());
  if (!exists.ok()) return ToGrpc(exists.status());
  int64_t seq = 0;
  int64_t version = hub_->Version(req->id());
  while (!ctx->IsCancelled()) {
    absl::StatusOr<std::vector<v1::LogLine>> lines = store_->LogsAfter(req->id(), seq, 1000);
    if (!lines.ok()) return ToGrpc(lines.status());
    for (v1::LogLine& line : *lines) {
      seq = line.seq();
      BoundLogLineForReply(&line);
      if (!writer->Write(line)) return grpc::Status::OK;
    }
    if (!lines->empty()) continue;
    absl::StatusOr<v1::Job> job = store_->Get(req->id());
    if (!req->follow() || !job.ok() || Terminal(job->state())) {
      // One more read: lines written just before the terminal state.
      absl::StatusOr<std::vector<v1::LogLine>> rest = store_->LogsAfter(req->id(), seq, 1000);
      if (rest.ok()) {
        for (v1::LogLine& line : *rest) {
          BoundLogLineForReply(&line);
          writer->Write(line);
        }
      }
      return grpc::Status::OK;
    }
    version = hub_->WaitPast(req->id(), version, absl::Now() + absl::Milliseconds(500));
  }
  return grpc::Status::OK;
}

// Waits (bounded) until job `id` leaves the running state; the runner moves it after its
// current step.
grpc::Status JobServiceImpl::AwaitNotRunning(int64_t id, v1::Job* resp) {
  int64_t version = hub_->Version(id);
  for (int i = 0; i < 3000; ++i) {
    absl::StatusOr<v1::Job> now = store_->Get(id);
    if (now.ok() && now->state() != v1::JOB_STATE_RUNNING) {
      *resp = *now;
      return grpc::Status::OK;
    }
    version = hub_->WaitPast(id, version, absl::Now() + absl::Milliseconds(100));
  }
  return grpc::Status(
      grpc::StatusCode::DEADLINE_EXCEEDED,
      absl::StrCat("job ", id, " is still finishing its step; it will stop after it"));
}

grpc::Status JobServiceImpl::CancelJob(grpc::ServerContext* ctx, const v1::CancelJobRequest* req,
                                       v1::Job* resp) {
  MT_IDENTIFY(who, options_.auth, ctx);
  auto cancel = [&]() -> grpc::Status {
    if (grpc::Status may = MayChange(who, req->id(), "cancel"); !may.ok()) return may;
    const std::string why = absl::StrCat("cancelled by ", who.user);
    if (runner_->CancelRunning(req->id(), why).ok()) return AwaitNotRunning(req->id(), resp);
    absl::StatusOr<v1::Job> job = runner_->Transition(
        req->id(), {v1::JOB_STATE_QUEUED, v1::JOB_STATE_HELD}, v1::JOB_STATE_CANCELLED, why);
    if (job.ok()) {
      *resp = *job;
      return grpc::Status::OK;
    }
    // It may have started meanwhile.
    if (runner_->CancelRunning(req->id(), why).ok()) return AwaitNotRunning(req->id(), resp);
    return ToGrpc(job.status());
  };
  grpc::Status result = cancel();
  BoundJobForReply(resp);
  return Audited(who, "cancel", req->id(), "", result);
}

grpc::Status JobServiceImpl::CheckpointJob(grpc::ServerContext* ctx,
                                           const v1::CheckpointJobRequest* req,
                                           v1::CheckpointJobResponse* resp) {
  MT_IDENTIFY(who, options_.auth, ctx);
  auto checkpoint = [&]() -> grpc::Status {
    v1::Job job;
    if (grpc::Status may = MayChange(who, req->id(), "checkpoint", &job); !may.ok()) return may;
    if (job.state() != v1::JOB_STATE_RUNNING) {
      return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                          absl::StrCat("job ", req->id(), " is ", v1::JobState_Name(job.state()),
                                       "; only a running job can checkpoint now"));
    }
    if (job.kind() == "generate" || job.kind() == "eval") {
      return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                          absl::StrCat("job ", req->id(), " is a ", job.kind(),
                                       " job: it has no checkpoints; its completions are "
                                       "written to its output as each finishes"));
    }
    absl::StatusOr<v1::CheckpointJobResponse> written = runner_->CheckpointRunning(req->id());
    if (!written.ok()) return ToGrpc(written.status());
    *resp = *written;
    return grpc::Status::OK;
  };
  grpc::Status result = checkpoint();
  return Audited(who, "checkpoint", req->id(), result.ok() ? resp->path() : "", result);
}

grpc::Status JobServiceImpl::HoldJob(grpc::ServerContext* ctx, const v1::HoldJobRequest* req,
                                     v1::Job* resp) {
  MT_IDENTIFY(who, options_.auth, ctx);
  auto hold = [&]() -> grpc::Status {
    if (grpc::Status may = MayChange(who, req->id(), "hold"); !may.ok()) return may;
    const std::string why = absl::StrCat("held by ", who.user);
    if (runner_->HoldRunning(req->id()).ok()) return AwaitNotRunning(req->id(), resp);
    absl::StatusOr<v1::Job> job =
        runner_->Transition(req->id(), {v1::JOB_STATE_QUEUED}, v1::JOB_STATE_HELD, why);
    if (job.ok()) {
      *resp = *job;
      return grpc::Status::OK;
    }
    if (runner_->HoldRunning(req->id()).ok()) return AwaitNotRunning(req->id(), resp);
    return ToGrpc(job.status());
  };
  grpc::Status result = hold();
  BoundJobForReply(resp);
  return Audited(who, "hold", req->id(), "", result);
}

grpc::Status JobServiceImpl::ReleaseJob(grpc::ServerContext* ctx, const v1::ReleaseJobRequest* req,
                                        v1::Job* resp) {
  MT_IDENTIFY(who, options_.auth, ctx);
  auto release = [&]() -> grpc::Status {
    if (grpc::Status may = MayChange(who, req->id(), "release"); !may.ok()) return may;
    absl::StatusOr<v1::Job> job =
        runner_->Transition(req->id(), {v1::JOB_STATE_HELD}, v1::JOB_STATE_QUEUED,
                            absl::StrCat("released by ", who.user));
    if (!job.ok()) return ToGrpc(job.status());
    runner_->Wake();
    *resp = *job;
    return grpc::Status::OK;
  };
  grpc::Status result = release();
  BoundJobForReply(resp);
  return Audited(who, "release", req->id(), "", result);
}

}  // namespace megatrain::server
