#include "engine/job/job_planner.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "engine/backend/devices.h"
#include "engine/backend/factory.h"
#include "engine/backend/planning_backend.h"
#include "engine/common/status.h"
#include "engine/job/generation_job.h"
#include "engine/job/trainer.h"

namespace megatrain {

absl::StatusOr<std::unique_ptr<Planner>> Planner::Create(const std::string& device,
                                                         const std::string& profile_path,
                                                         int64_t host_budget_bytes) {
  return JobPlanner::Create(device, profile_path, host_budget_bytes);
}

absl::StatusOr<std::unique_ptr<Planner>> Planner::CreateFromProfile(
    const std::string& device, const std::string& profile_json, int64_t device_budget_bytes,
    int64_t gpus, int64_t host_budget_bytes) {
  ASSIGN_OR_RETURN(const MachineProfile profile, ProfileFromJson(profile_json));
  return JobPlanner::CreateFromProfile(device, profile, device_budget_bytes, gpus,
                                       host_budget_bytes);
}

absl::StatusOr<std::unique_ptr<JobPlanner>> JobPlanner::Create(const std::string& device,
                                                               const std::string& profile_path,
                                                               int64_t host_budget_bytes) {
  std::unique_ptr<JobPlanner> p(new JobPlanner);
  p->host_budget_bytes_ = host_budget_bytes;
  MutexLock lock(&p->mu_);
  ASSIGN_OR_RETURN(p->backend_, CreateBackend(BackendRequest{device == "cpu" ? "cpu" : "cuda"}));
  ASSIGN_OR_RETURN(p->profile_, LoadOrMeasureProfile(p->backend_.get(), profile_path, &p->note_));
  p->gpus_ = device == "cpu" ? 0 : static_cast<int64_t>(ListGpus().size());
  return p;
}

absl::StatusOr<std::unique_ptr<JobPlanner>> JobPlanner::CreateFromProfile(
    const std::string& device, const MachineProfile& profile, int64_t device_budget_bytes,
    int64_t gpus, int64_t host_budget_bytes) {
  std::unique_ptr<JobPlanner> p(new JobPlanner);
  p->host_budget_bytes_ = host_budget_bytes;
  p->profile_ = profile;
  p->gpus_ = gpus;
  p->note_ = "the node's profile";
  MutexLock lock(&p->mu_);
  if (device == "cpu") {
    ASSIGN_OR_RETURN(p->backend_, CreateBackend(BackendRequest{"cpu"}));
  } else {
    p->backend_ = std::make_unique<PlanningBackend>("cuda:0", device_budget_bytes);
  }
  return p;
}

std::string JobPlanner::profile_json() const { return ProfileToJson(profile_); }

absl::StatusOr<PlanSummary> JobPlanner::Plan(const JobSpec& spec) {
  if (spec.kind != JobKind::kTrain) return PlanGenerationJob(spec);
  ASSIGN_OR_RETURN(const std::optional<TrainerState> resume, ResumeState(spec));
  absl::StatusOr<PlannedJob> planned = PlanJob(spec, resume);
  if (absl::IsFailedPrecondition(planned.status())) {
    // The memory that runs out, with the numbers: the job cannot fit.
    return absl::ResourceExhaustedError(planned.status().message());
  }
  if (!planned.ok()) return planned.status();
  return SummarizePlan(*planned);
}

absl::StatusOr<PlanSummary> JobPlanner::PlanGenerationJob(const JobSpec& spec) {
  MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(PlanSummary plan, PlanGeneration(GenerateSpecOf(spec), backend_.get()));
  if (host_budget_bytes_ > 0 && plan.host_bytes > host_budget_bytes_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the model's bf16 weights need ", plan.host_bytes >> 20, " MiB of host memory and ",
        host_budget_bytes_ >> 20, " MiB is available to a job"));
  }
  return plan;
}

PlanSummary SummarizePlan(const PlannedJob& planned) {
  const Plan& plan = planned.plan;
  const StepPrediction& s = plan.step;
  PlanSummary out;
  out.micro_batch_rows = plan.micro_batch_rows;
  out.micro_batches = plan.micro_batches;
  out.checkpoint_every = plan.checkpoint_every;
  out.checkpoints_on_host = plan.checkpoints_on_host;
  out.weight_slots = plan.weight_slots;
  out.kept_layers = plan.kept_layers;
  out.eval_micro_batches = plan.eval_micro_batches;
  out.mlp_tile_tokens = plan.mlp_tile_tokens;
  out.nvme_layers = plan.nvme_layers;
  out.nvme_bytes = plan.disk_bytes;
  out.devices = plan.devices;
  out.tokens_per_step = planned.request.rows_per_step * planned.request.seq_len;
  out.step_seconds = s.seconds;
  out.tokens_per_second = s.seconds > 0 ? out.tokens_per_step / s.seconds : 0;
  out.model_tflops = s.seconds > 0 ? s.model_flops / s.seconds / 1e12 : 0;
  out.bound = s.bound;
  out.compute_seconds = s.compute_seconds;
  out.pcie_seconds = s.pcie_seconds;
  out.optimizer_seconds = s.optimizer_seconds;
  out.reduce_seconds = s.reduce_seconds;
  out.h2d_bytes = s.h2d_bytes;
  out.d2h_bytes = s.d2h_bytes;
  out.device_bytes = plan.device_bytes;
  out.host_bytes = plan.host_bytes;
  out.text = planned.text;
  out.warnings = planned.warnings;
  return out;
}

int64_t JobPlanner::device_budget_bytes() {
  MutexLock lock(&mu_);
  return backend_->device_memory_budget();
}

absl::StatusOr<PlannedJob> JobPlanner::PlanJob(const JobSpec& spec,
                                               const std::optional<TrainerState>& resume) {
  ASSIGN_OR_RETURN(ModelConfig config, ResolveModelConfig(spec));
  MutexLock lock(&mu_);
  // The device as a job finds it: all of it but the library workspaces (Trainer::Init),
  // or the job's cap.
  int64_t device = PlannableDeviceBytes(backend_->device_memory_budget());
  if (spec.device_memory_cap_bytes > 0) {
    device = std::min(device, PlannableDeviceBytes(spec.device_memory_cap_bytes));
  }
  if (spec.devices > 1 && backend_->kind() != BackendKind::kCpu) {
    const int64_t gpus = gpus_;
    if (spec.devices > gpus) {
      return absl::InvalidArgumentError(
          absl::StrCat("train.devices is ", spec.devices, "; this node has ", gpus, " GPU(s)"));
    }
  }
  ASSIGN_OR_RETURN(const std::string frozen, DescribeFrozen(spec, config));  // checks it
  PlannedJob out;
  out.request = JobPlanRequest(spec, config, device, host_budget_bytes_);
  std::string resume_note;
  ASSIGN_OR_RETURN(out.plan, PlanKeepingSplit(spec, resume, profile_, backend_.get(),
                                              &out.request, &resume_note));
  out.text = DescribePlan(out.plan, out.request, profile_) + resume_note + frozen;
  out.warnings = JobWarnings(spec, config);
  for (const std::string& w : out.warnings) absl::StrAppend(&out.text, "warning: ", w, "\n");
  return out;
}

std::vector<std::string> JobWarnings(const JobSpec& spec, const ModelConfig& config) {
  std::vector<std::string> out;
  if (config.rope_scaling.type == RopeScaling::Type::kNone &&
      config.max_position_embeddings > 0 && spec.seq_len > config.max_position_embeddings) {
    const int64_t factor =
        (spec.seq_len + config.max_position_embeddings - 1) / config.max_position_embeddings;
    out.push_back(absl::StrCat(
        "data.seq_len ", spec.seq_len, " exceeds the model's max_position_embeddings ",
        config.max_position_embeddings, " and its config.json has no rope_scaling: positions "
        "past ", config.max_position_embeddings, " were never trained. To extend the context, "
        "add rope_scaling to config.json (for example {\"rope_type\": \"linear\", \"factor\": ",
        factor, "}, or \"dynamic\", \"yarn\", \"llama3\"); otherwise set data.seq_len to ",
        config.max_position_embeddings, " or less"));
  }
  return out;
}

}  // namespace megatrain
