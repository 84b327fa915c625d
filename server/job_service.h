// megatrain.v1.JobService: a thin adapter from RPCs to the job store and the runner.
//
// The caller's user comes from the "x-megatrain-user" metadata (proving it is the
// sharing issue's work); specs are validated before anything is stored, so a bad spec
// is an INVALID_ARGUMENT / NOT_FOUND naming the field and nothing else changes.
#pragma once

#include <string>

#include "megatrain/v1/jobs.grpc.pb.h"
#include "server/event_hub.h"
#include "server/job_runner.h"
#include "server/node_planner.h"
#include "server/job_store.h"

namespace megatrain::server {

struct JobServiceOptions {
  std::string state_dir;
  int64_t host_memory_bytes = 0;  // admission limit: total usable host memory
  NodePlanner* planner = nullptr; // plans jobs for admission and PlanJob (required)
};

class JobServiceImpl final : public v1::JobService::Service {
 public:
  JobServiceImpl(JobStore* store, EventHub* hub, JobRunner* runner,
                 const JobServiceOptions& options);

  grpc::Status SubmitJob(grpc::ServerContext* ctx, const v1::SubmitJobRequest* req,
                         v1::Job* resp) override;
  grpc::Status PlanJob(grpc::ServerContext* ctx, const v1::SubmitJobRequest* req,
                       v1::JobPlan* resp) override;
  grpc::Status GetJob(grpc::ServerContext* ctx, const v1::GetJobRequest* req,
                      v1::Job* resp) override;
  grpc::Status ListJobs(grpc::ServerContext* ctx, const v1::ListJobsRequest* req,
                        v1::ListJobsResponse* resp) override;
  grpc::Status WatchJob(grpc::ServerContext* ctx, const v1::WatchJobRequest* req,
                        grpc::ServerWriter<v1::JobEvent>* writer) override;
  grpc::Status StreamLogs(grpc::ServerContext* ctx, const v1::StreamLogsRequest* req,
                          grpc::ServerWriter<v1::LogLine>* writer) override;
  grpc::Status CancelJob(grpc::ServerContext* ctx, const v1::CancelJobRequest* req,
                         v1::Job* resp) override;
  grpc::Status CheckpointJob(grpc::ServerContext* ctx, const v1::CheckpointJobRequest* req,
                             v1::CheckpointJobResponse* resp) override;
  grpc::Status HoldJob(grpc::ServerContext* ctx, const v1::HoldJobRequest* req,
                       v1::Job* resp) override;
  grpc::Status ReleaseJob(grpc::ServerContext* ctx, const v1::ReleaseJobRequest* req,
                          v1::Job* resp) override;

 private:
  grpc::Status Plan(const JobSpec& spec, v1::JobPlan* plan);
  grpc::Status AwaitNotRunning(int64_t id, v1::Job* resp);

  JobStore* store_;
  EventHub* hub_;
  JobRunner* runner_;
  JobServiceOptions options_;
  Mutex submit_mu_;  // admission sees a consistent set of queued jobs
};

// absl::Status -> grpc::Status (the codes are the same numbers).
grpc::Status ToGrpc(const absl::Status& s);
// The caller's user name from metadata ("unknown" when absent).
std::string CallerUser(const grpc::ServerContext& ctx);

}  // namespace megatrain::server
