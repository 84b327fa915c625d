// The node's planner: the engine's JobPlanner for this node's device and its profile, kept
// in the state folder. Submissions are planned in a worker process of the user's
// (JobPlanner::CreateFromProfile with this profile, device budget and GPU count), and jobs
// run with the same profile, so what was admitted is what runs.
//
// Thread-safe.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "engine/engine.h"
#include "megatrain/v1/jobs.pb.h"

namespace megatrain {

// A plan as the API's JobPlan message.
v1::JobPlan JobPlanMessage(const PlannedJob& planned);

class NodePlanner {
 public:
  // device: "cpu" or "cuda:N". The profile is read from state_dir/machine-profile.json
  // when it matches this machine, else measured (seconds) and written there.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<NodePlanner>> Create(
      const std::string& device, const std::string& state_dir, int64_t host_budget_bytes);

  const MachineProfile& profile() const { return planner_->profile(); }
  const std::string& note() const { return planner_->note(); }  // where the profile came from
  // What a job finds on a lane (JobPlanner::device_budget_bytes) and the node's GPUs: what
  // a plan made elsewhere needs (JobPlanner::CreateFromProfile).
  int64_t device_budget_bytes() { return planner_->device_budget_bytes(); }
  int64_t gpus() const { return planner_->gpus(); }

 private:
  explicit NodePlanner(std::unique_ptr<JobPlanner> planner) : planner_(std::move(planner)) {}

  std::unique_ptr<JobPlanner> planner_;
};

}  // namespace megatrain
