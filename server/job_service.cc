#include "server/job_service.h"

#include <filesystem>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "server/spec_convert.h"

namespace megatrain::server {
namespace {

bool Terminal(v1::JobState s) {
  return s == v1::JOB_STATE_SUCCEEDED || s == v1::JOB_STATE_FAILED || s == v1::JOB_STATE_CANCELLED;
}

double GiB(int64_t b) { return b / double(1ll << 30); }

}  // namespace

grpc::Status ToGrpc(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

std::string CallerUser(const grpc::ServerContext& ctx) {
  auto it = ctx.client_metadata().find("x-megatrain-user");
  if (it == ctx.client_metadata().end() || it->second.empty()) return "unknown";
  return std::string(it->second.data(), it->second.size());
}

JobServiceImpl::JobServiceImpl(JobStore* store, EventHub* hub, JobRunner* runner,
                               const JobServiceOptions& options)
    : store_(store), hub_(hub), runner_(runner), options_(options) {}

// The node's plan of `spec`; a job that cannot fit is RESOURCE_EXHAUSTED, with the numbers.
grpc::Status JobServiceImpl::Plan(const JobSpec& spec, v1::JobPlan* plan) {
  absl::StatusOr<v1::JobPlan> planned = options_.planner->PlanJob(spec);
  if (!planned.ok()) {
    if (planned.status().code() == absl::StatusCode::kFailedPrecondition) {
      return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                          std::string(planned.status().message()));
    }
    return ToGrpc(planned.status());
  }
  *plan = *std::move(planned);
  return grpc::Status::OK;
}

grpc::Status JobServiceImpl::PlanJob(grpc::ServerContext* ctx, const v1::SubmitJobRequest* req,
                                     v1::JobPlan* resp) {
  absl::StatusOr<JobSpec> spec = SpecFromRequest(*req);
  if (!spec.ok()) return ToGrpc(spec.status());
  return Plan(*spec, resp);
}

grpc::Status JobServiceImpl::SubmitJob(grpc::ServerContext* ctx, const v1::SubmitJobRequest* req,
                                       v1::Job* resp) {
  absl::StatusOr<JobSpec> spec = SpecFromRequest(*req);
  if (!spec.ok()) return ToGrpc(spec.status());
  absl::Status inputs = CheckSpecInputs(*spec);
  if (!inputs.ok()) return ToGrpc(inputs);
  // The plan admits the job: it names the memory that runs out when it cannot fit.
  v1::JobPlan plan;
  if (grpc::Status planned = Plan(*spec, &plan); !planned.ok()) return planned;
  const int64_t need = plan.host_bytes();

  MutexLock lock(&submit_mu_);
  if (options_.host_memory_bytes > 0 && need > options_.host_memory_bytes) {
    return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                        absl::StrFormat("job needs %.2f GiB of host memory; this node has %.2f GiB "
                                        "for jobs; use a smaller model or fewer tokens per step",
                                        GiB(need), GiB(options_.host_memory_bytes)));
  }
  v1::Job job;
  job.set_name(spec->name);
  job.set_owner(CallerUser(*ctx));
  job.set_priority(req->priority());
  // Stored unqueued until its spec is complete, so the runner cannot claim it early.
  job.set_state(v1::JOB_STATE_UNSPECIFIED);
  job.set_host_bytes_estimate(need);
  *job.mutable_plan() = plan;
  job.set_created_unix_ms(absl::ToUnixMillis(absl::Now()));
  absl::StatusOr<int64_t> id = store_->Insert(&job);
  if (!id.ok()) return ToGrpc(id.status());
  // The daemon keeps every job's checkpoints, so it can resume any job after a crash.
  if (spec->checkpoint_dir.empty()) {
    spec->checkpoint_dir = (std::filesystem::path(options_.state_dir) / "jobs" /
                            std::to_string(*id) / "checkpoints").string();
  }
  job.set_checkpoint_dir(spec->checkpoint_dir);
  job.set_spec_yaml(JobSpecToYaml(*spec));
  job.mutable_progress()->set_total_steps(spec->steps);
  absl::Status s =
      runner_->SetState(&job, req->hold() ? v1::JOB_STATE_HELD : v1::JOB_STATE_QUEUED,
                        absl::StrCat("submitted by ", job.owner(), req->hold() ? ", held" : ""));
  if (!s.ok()) return ToGrpc(s);
  (void)store_->Audit(job.owner(), "submit", job.id(), spec->name);
  runner_->Wake();
  *resp = job;
  return grpc::Status::OK;
}

grpc::Status JobServiceImpl::GetJob(grpc::ServerContext*, const v1::GetJobRequest* req,
                                    v1::Job* resp) {
  absl::StatusOr<v1::Job> job = store_->Get(req->id());
  if (!job.ok()) return ToGrpc(job.status());
  *resp = *job;
  return grpc::Status::OK;
}

grpc::Status JobServiceImpl::ListJobs(grpc::ServerContext*, const v1::ListJobsRequest* req,
                                      v1::ListJobsResponse* resp) {
  int limit = req->page_size() <= 0 ? 100 : std::min(req->page_size(), 1000);
  int64_t before = 0;
  if (!req->page_token().empty() && !absl::SimpleAtoi(req->page_token(), &before)) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        "page_token is not one this server returned");
  }
  std::vector<v1::JobState> typed;
  for (int s : req->states()) typed.push_back(static_cast<v1::JobState>(s));
  absl::StatusOr<std::vector<v1::Job>> jobs = store_->List(typed, req->owner(), before, limit + 1);
  if (!jobs.ok()) return ToGrpc(jobs.status());
  for (int i = 0; i < static_cast<int>(jobs->size()) && i < limit; ++i) *resp->add_jobs() = (*jobs)[i];
  if (static_cast<int>(jobs->size()) > limit) {
    resp->set_next_page_token(std::to_string((*jobs)[limit - 1].id()));
  }
  return grpc::Status::OK;
}

grpc::Status JobServiceImpl::WatchJob(grpc::ServerContext* ctx, const v1::WatchJobRequest* req,
                                      grpc::ServerWriter<v1::JobEvent>* writer) {
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
  first.set_unix_ms(absl::ToUnixMillis(absl::Now()));
  *first.mutable_state_change() = *job;
  if (!writer->Write(first)) return grpc::Status::OK;
  if (Terminal(job->state())) return grpc::Status::OK;
  while (!ctx->IsCancelled()) {
    absl::StatusOr<std::vector<v1::JobEvent>> events = store_->EventsAfter(req->id(), seq, 1000);
    if (!events.ok()) return ToGrpc(events.status());
    for (const v1::JobEvent& e : *events) {
      seq = e.seq();
      if (!writer->Write(e)) return grpc::Status::OK;
      if (e.has_state_change() && Terminal(e.state_change().state())) return grpc::Status::OK;
    }
    if (events->empty()) {
      version = hub_->WaitPast(req->id(), version, absl::Now() + absl::Milliseconds(500));
    }
  }
  return grpc::Status::OK;
}

grpc::Status JobServiceImpl::StreamLogs(grpc::ServerContext* ctx, const v1::StreamLogsRequest* req,
                                        grpc::ServerWriter<v1::LogLine>* writer) {
  absl::StatusOr<v1::Job> exists = store_->Get(req->id());
  if (!exists.ok()) return ToGrpc(exists.status());
  int64_t seq = 0;
  int64_t version = hub_->Version(req->id());
  while (!ctx->IsCancelled()) {
    absl::StatusOr<std::vector<v1::LogLine>> lines = store_->LogsAfter(req->id(), seq, 1000);
    if (!lines.ok()) return ToGrpc(lines.status());
    for (const v1::LogLine& l : *lines) {
      seq = l.seq();
      if (!writer->Write(l)) return grpc::Status::OK;
    }
    if (!lines->empty()) continue;
    absl::StatusOr<v1::Job> job = store_->Get(req->id());
    if (!req->follow() || !job.ok() || Terminal(job->state())) {
      // One more read: lines written just before the terminal state.
      absl::StatusOr<std::vector<v1::LogLine>> rest = store_->LogsAfter(req->id(), seq, 1000);
      if (rest.ok()) for (const v1::LogLine& l : *rest) writer->Write(l);
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
  return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                      absl::StrCat("job ", id, " is still finishing its step; it will stop after it"));
}

grpc::Status JobServiceImpl::CancelJob(grpc::ServerContext* ctx, const v1::CancelJobRequest* req,
                                       v1::Job* resp) {
  (void)store_->Audit(CallerUser(*ctx), "cancel", req->id(), "");
  if (runner_->CancelRunning(req->id()).ok()) return AwaitNotRunning(req->id(), resp);
  absl::StatusOr<v1::Job> job = runner_->Transition(
      req->id(), {v1::JOB_STATE_QUEUED, v1::JOB_STATE_HELD}, v1::JOB_STATE_CANCELLED, "cancelled");
  if (job.ok()) {
    *resp = *job;
    return grpc::Status::OK;
  }
  // It may have started meanwhile.
  if (runner_->CancelRunning(req->id()).ok()) return AwaitNotRunning(req->id(), resp);
  return ToGrpc(job.status());
}

grpc::Status JobServiceImpl::CheckpointJob(grpc::ServerContext* ctx,
                                           const v1::CheckpointJobRequest* req,
                                           v1::CheckpointJobResponse* resp) {
  absl::StatusOr<v1::Job> job = store_->Get(req->id());
  if (!job.ok()) return ToGrpc(job.status());
  if (job->state() != v1::JOB_STATE_RUNNING) {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                        absl::StrCat("job ", req->id(), " is ", v1::JobState_Name(job->state()),
                                     "; only a running job can checkpoint now"));
  }
  (void)store_->Audit(CallerUser(*ctx), "checkpoint", req->id(), "");
  absl::StatusOr<v1::CheckpointJobResponse> r = runner_->CheckpointRunning(req->id());
  if (!r.ok()) return ToGrpc(r.status());
  *resp = *r;
  return grpc::Status::OK;
}

grpc::Status JobServiceImpl::HoldJob(grpc::ServerContext* ctx, const v1::HoldJobRequest* req,
                                     v1::Job* resp) {
  (void)store_->Audit(CallerUser(*ctx), "hold", req->id(), "");
  if (runner_->HoldRunning(req->id()).ok()) return AwaitNotRunning(req->id(), resp);
  absl::StatusOr<v1::Job> job =
      runner_->Transition(req->id(), {v1::JOB_STATE_QUEUED}, v1::JOB_STATE_HELD, "held");
  if (job.ok()) {
    *resp = *job;
    return grpc::Status::OK;
  }
  if (runner_->HoldRunning(req->id()).ok()) return AwaitNotRunning(req->id(), resp);
  return ToGrpc(job.status());
}

grpc::Status JobServiceImpl::ReleaseJob(grpc::ServerContext* ctx, const v1::ReleaseJobRequest* req,
                                        v1::Job* resp) {
  (void)store_->Audit(CallerUser(*ctx), "release", req->id(), "");
  absl::StatusOr<v1::Job> job =
      runner_->Transition(req->id(), {v1::JOB_STATE_HELD}, v1::JOB_STATE_QUEUED, "released");
  if (!job.ok()) return ToGrpc(job.status());
  runner_->Wake();
  *resp = *job;
  return grpc::Status::OK;
}

}  // namespace megatrain::server
