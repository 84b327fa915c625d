// megatrain.v1.JobService: a thin adapter from RPCs to the job store and the runner.
//
// Every call's user is the one the kernel or a token vouches for (server/identity.h).
// Anyone may read the queue, jobs, events and logs; only a job's owner or an admin may
// cancel, hold, release or checkpoint it. Every mutating call, allowed or refused, is
// written to the audit log with its outcome.
//
// Submission checks, in order, before anything is stored (so a refused job changes
// nothing and the error names the problem): the daemon can act for the user
// (PERMISSION_DENIED); the priority; then, in a worker process of the user's (Check):
// the spec (INVALID_ARGUMENT naming the field), the files as the user: inputs readable
// and regular, outputs writable, all inside the configured roots (PERMISSION_DENIED /
// NOT_FOUND naming the field), the plan (RESOURCE_EXHAUSTED with the numbers); then the
// user's queued-job limit and the node's and the user's memory.
#pragma once

#include <optional>
#include <string>

#include "megatrain/internal/worker.pb.h"
#include "megatrain/v1/jobs.grpc.pb.h"
#include "server/config.h"
#include "engine/engine.h"
#include "server/event_hub.h"
#include "server/identity.h"
#include "server/job_runner.h"
#include "server/job_store.h"

namespace megatrain::server {

struct JobServiceOptions {
  std::string state_dir;
  int64_t host_memory_bytes = 0;  // admission limit: total usable host memory
  // The node's planner (required): what its checks in workers plan against, the device
  // budget and GPU count with its profile.
  Planner* planner = nullptr;
  Authenticator* auth = nullptr;  // who calls (required)
  const DaemonConfig* config = nullptr;  // roots and limits (required)
  int exe_fd = -1;  // the daemon's executable: submissions are checked in a worker of it
  std::string profile_json;  // the planner's profile (ProfileToJson), for those workers
};

class JobServiceImpl final : public v1::JobService::Service {
 public:
  JobServiceImpl(JobStore* store, EventHub* hub, JobRunner* runner,
                 const JobServiceOptions& options);

  [[nodiscard]] grpc::Status SubmitJob(grpc::ServerContext* ctx, const v1::SubmitJobRequest* req,
                                       v1::Job* resp) override;
  [[nodiscard]] grpc::Status PlanJob(grpc::ServerContext* ctx, const v1::SubmitJobRequest* req,
                                     v1::JobPlan* resp) override;
  [[nodiscard]] grpc::Status GetJob(grpc::ServerContext* ctx, const v1::GetJobRequest* req,
                                    v1::Job* resp) override;
  [[nodiscard]] grpc::Status ListJobs(grpc::ServerContext* ctx, const v1::ListJobsRequest* req,
                                      v1::ListJobsResponse* resp) override;
  [[nodiscard]] grpc::Status WatchJob(grpc::ServerContext* ctx, const v1::WatchJobRequest* req,
                                      grpc::ServerWriter<v1::JobEvent>* writer) override;
  [[nodiscard]] grpc::Status StreamLogs(grpc::ServerContext* ctx, const v1::StreamLogsRequest* req,
                                        grpc::ServerWriter<v1::LogLine>* writer) override;
  [[nodiscard]] grpc::Status CancelJob(grpc::ServerContext* ctx, const v1::CancelJobRequest* req,
                                       v1::Job* resp) override;
  [[nodiscard]] grpc::Status CheckpointJob(grpc::ServerContext* ctx,
                                           const v1::CheckpointJobRequest* req,
                                           v1::CheckpointJobResponse* resp) override;
  [[nodiscard]] grpc::Status HoldJob(grpc::ServerContext* ctx, const v1::HoldJobRequest* req,
                                     v1::Job* resp) override;
  [[nodiscard]] grpc::Status ReleaseJob(grpc::ServerContext* ctx, const v1::ReleaseJobRequest* req,
                                        v1::Job* resp) override;

 private:
  // Reads, checks (with `check_files`: paths, folders, inputs) and plans the request's
  // spec in a short-lived worker process of `who`'s, within workers.check_timeout_s and
  // check_memory_gib: a spec or file that hangs or crashes the reader is refused.
  [[nodiscard]] absl::StatusOr<internal::CheckReply> Check(const Caller& who,
                                                           const v1::SubmitJobRequest& req,
                                                           bool check_files);
  [[nodiscard]] grpc::Status AwaitNotRunning(int64_t id, v1::Job* resp);
  [[nodiscard]] grpc::Status Submit(const Caller& who, const v1::SubmitJobRequest& req,
                                    v1::Job* resp, std::string* detail);
  // OK when `who` may change job `id` (`action` names the change in the error); the job
  // as read goes to *found when given.
  [[nodiscard]] grpc::Status MayChange(const Caller& who, int64_t id, const std::string& action,
                                       v1::Job* found = nullptr);
  // Records `action` by `who` with the outcome `result`, and returns `result` (an entry
  // the store fails to take is reported on stderr: the outcome is decided by then).
  [[nodiscard]] grpc::Status Audited(const Caller& who, const std::string& action, int64_t job_id,
                                     const std::string& detail, grpc::Status result);

  JobStore* store_;
  EventHub* hub_;
  JobRunner* runner_;
  JobServiceOptions options_;
  Mutex submit_mu_;  // admission sees a consistent set of queued jobs
};

// absl::Status -> grpc::Status (the codes are the same numbers).
[[nodiscard]] grpc::Status ToGrpc(const absl::Status& status);
// Whether `who` owns `job` (by uid; by name for jobs stored without one).
bool Owns(const Caller& who, const v1::Job& job);
// "OK" or "CODE: message", as the audit log records an outcome.
std::string Outcome(const grpc::Status& status);

}  // namespace megatrain::server
