#include "server/node_planner.h"

#include <filesystem>

#include "engine/backend/factory.h"
#include "engine/common/status.h"

namespace megatrain {

absl::StatusOr<std::unique_ptr<NodePlanner>> NodePlanner::Create(const std::string& device,
                                                                 const std::string& state_dir,
                                                                 int64_t host_budget_bytes) {
  std::unique_ptr<NodePlanner> p(new NodePlanner);
  p->host_budget_bytes_ = host_budget_bytes;
  ASSIGN_OR_RETURN(p->backend_, CreateBackend(BackendRequest{device == "cpu" ? "cpu" : "cuda"}));
  const std::string path = (std::filesystem::path(state_dir) / "machine-profile.json").string();
  ASSIGN_OR_RETURN(p->profile_, LoadOrMeasureProfile(p->backend_.get(), path, &p->note_));
  return p;
}

absl::StatusOr<v1::JobPlan> NodePlanner::PlanJob(const JobSpec& spec) {
  ASSIGN_OR_RETURN(ModelConfig config, ResolveModelConfig(spec));
  server::MutexLock lock(&mu_);
  // The device as a job finds it: all of it but the library workspaces (Trainer::Init),
  // or the job's cap.
  int64_t device = PlannableDeviceBytes(backend_->device_memory_budget());
  if (spec.device_memory_cap_bytes > 0) {
    device = std::min(device, PlannableDeviceBytes(spec.device_memory_cap_bytes));
  }
  if (spec.devices > 1 && backend_->name() != "cpu") {
    const int64_t gpus = static_cast<int64_t>(ListGpus().size());
    if (spec.devices > gpus) {
      return absl::InvalidArgumentError(
          absl::StrCat("train.devices is ", spec.devices, "; this node has ", gpus, " GPU(s)"));
    }
  }
  const PlanRequest request = JobPlanRequest(spec, config, device, host_budget_bytes_);
  ASSIGN_OR_RETURN(Plan plan, MakePlan(request, profile_, backend_.get()));
  v1::JobPlan out;
  out.set_micro_batch_rows(plan.micro_batch_rows);
  out.set_micro_batches(plan.micro_batches);
  out.set_checkpoint_every(plan.checkpoint_every);
  out.set_checkpoints_on_host(plan.checkpoints_on_host);
  out.set_weight_slots(plan.weight_slots);
  out.set_kept_layers(plan.kept_layers);
  out.set_devices(plan.devices);
  out.set_reduce_seconds(plan.step.reduce_seconds);
  const StepPrediction& s = plan.step;
  const int64_t tokens = request.rows_per_step * request.seq_len;
  out.set_tokens_per_step(tokens);
  out.set_step_seconds(s.seconds);
  out.set_tokens_per_second(s.seconds > 0 ? tokens / s.seconds : 0);
  out.set_model_tflops(s.seconds > 0 ? s.model_flops / s.seconds / 1e12 : 0);
  out.set_bound(s.bound);
  out.set_compute_seconds(s.compute_seconds);
  out.set_pcie_seconds(s.pcie_seconds);
  out.set_optimizer_seconds(s.optimizer_seconds);
  out.set_h2d_bytes(s.h2d_bytes);
  out.set_d2h_bytes(s.d2h_bytes);
  out.set_device_bytes(plan.device_bytes);
  out.set_host_bytes(plan.host_bytes);
  out.set_text(DescribePlan(plan, request, profile_));
  return out;
}

}  // namespace megatrain
