#include "server/node_planner.h"

#include <filesystem>

#include "engine/common/status.h"

namespace megatrain {

absl::StatusOr<std::unique_ptr<NodePlanner>> NodePlanner::Create(const std::string& device,
                                                                 const std::string& state_dir,
                                                                 int64_t host_budget_bytes) {
  const std::string path = (std::filesystem::path(state_dir) / "machine-profile.json").string();
  ASSIGN_OR_RETURN(std::unique_ptr<JobPlanner> planner,
                   JobPlanner::Create(device, path, host_budget_bytes));
  return std::unique_ptr<NodePlanner>(new NodePlanner(std::move(planner)));
}

v1::JobPlan JobPlanMessage(const PlannedJob& planned) {
  const Plan& plan = planned.plan;
  const PlanRequest& request = planned.request;
  v1::JobPlan out;
  out.set_micro_batch_rows(plan.micro_batch_rows);
  out.set_micro_batches(plan.micro_batches);
  out.set_checkpoint_every(plan.checkpoint_every);
  out.set_checkpoints_on_host(plan.checkpoints_on_host);
  out.set_weight_slots(plan.weight_slots);
  out.set_kept_layers(plan.kept_layers);
  out.set_mlp_tile_tokens(plan.mlp_tile_tokens);
  out.set_nvme_layers(plan.nvme_layers);
  out.set_nvme_bytes(plan.disk_bytes);
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
  out.set_text(planned.text);
  for (const std::string& w : planned.warnings) out.add_warnings(w);
  return out;
}

}  // namespace megatrain
