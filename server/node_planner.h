// The node's planner: the machine profile (measured once, cached in the state folder) and
// a backend of the node's kind to size plans against. Admission, `megatrain plan` and the
// runner all plan with it, so what was admitted is what runs.
//
// Thread-safe.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "server/mutex.h"
#include "engine/engine.h"
#include "megatrain/v1/jobs.pb.h"

namespace megatrain {

class NodePlanner {
 public:
  // device: "cpu" or "cuda:N". The profile is read from state_dir/machine-profile.json
  // when it matches this machine, else measured (seconds) and written there.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<NodePlanner>> Create(
      const std::string& device, const std::string& state_dir, int64_t host_budget_bytes);

  // The plan of `spec` on this node: FailedPrecondition naming the memory that runs out.
  [[nodiscard]] absl::StatusOr<v1::JobPlan> PlanJob(const JobSpec& spec);

  const MachineProfile& profile() const { return profile_; }
  const std::string& note() const { return note_; }  // where the profile came from

 private:
  NodePlanner() = default;

  server::Mutex mu_;
  std::unique_ptr<Backend> backend_;  // sizes plans; never runs a job
  MachineProfile profile_;
  std::string note_;
  int64_t host_budget_bytes_ = 0;
};

}  // namespace megatrain
