// The engine's one planner (engine.h's Planner): plans jobs for one kind of device of this
// machine without running them, from the machine profile (read from a file when it
// matches this machine, else measured, seconds, and cached there) and a backend of that
// kind to size plans against. The daemon admits, answers `megatrain plan` and runs jobs
// with one of these, so what was admitted is what runs. The plan itself is plan/'s
// MakePlan; this binds it to a job's spec, its resume and the node.
//
// Thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/checkpoint/checkpoint.h"
#include "engine/common/backend.h"
#include "engine/common/mutex.h"
#include "engine/engine.h"
#include "engine/job/spec.h"
#include "engine/plan/machine_profile.h"
#include "engine/plan/planner.h"

namespace megatrain {

// A job's plan on this machine, with what it was asked and the plan in words.
struct PlannedJob {
  Plan plan;
  PlanRequest request;
  std::string text;  // DescribePlan, then the warnings
  std::vector<std::string> warnings;  // JobWarnings
};

// What a valid job will do that its owner may not mean, each naming the field and a fix:
// a sequence longer than the model's max_position_embeddings without rope_scaling (its
// positions past that length were never trained).
std::vector<std::string> JobWarnings(const JobSpec& spec, const ModelConfig& config);

// The summary of a plan the API carries (engine.h).
PlanSummary SummarizePlan(const PlannedJob& planned);

class JobPlanner final : public Planner {
 public:
  // device: "cpu" or "cuda:N"; the profile is read from / cached at `profile_path`.
  // host_budget_bytes: the host memory a job may hold.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<JobPlanner>> Create(
      const std::string& device, const std::string& profile_path, int64_t host_budget_bytes);
  // Plans with a given profile and no device: for "cpu" a CPU backend, for "cuda" a
  // PlanningBackend of `device_budget_bytes` (what a job finds on a lane, the daemon's
  // device_budget_bytes()) on a node of `gpus` GPUs. Touches no GPU: megatraind's
  // submission checks plan this way in a process of the user's.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<JobPlanner>> CreateFromProfile(
      const std::string& device, const MachineProfile& profile, int64_t device_budget_bytes,
      int64_t gpus, int64_t host_budget_bytes);

  // The plan of `spec`: FailedPrecondition naming the memory that runs out,
  // InvalidArgument for more devices than the machine has. `resume`: the state of the
  // checkpoint it resumes from (ResumeState, read as the job's user), whose split of a step
  // the plan keeps, as the trainer's will (PlanKeepingSplit).
  [[nodiscard]] absl::StatusOr<PlannedJob> PlanJob(
      const JobSpec& spec, const std::optional<TrainerState>& resume = std::nullopt);

  // Planner: PlanJob with the resume of the spec's checkpoint folder, summarised.
  [[nodiscard]] absl::StatusOr<PlanSummary> Plan(const JobSpec& spec) override;
  std::string profile_json() const override;
  double gemm_peak_tflops() const override { return profile_.gemm_peak_tflops; }
  std::string note() const override { return note_; }  // where the profile came from
  // The device memory its backend offers a job (before PlannableDeviceBytes).
  int64_t device_budget_bytes() override;
  int64_t gpus() const override { return gpus_; }

  const MachineProfile& profile() const { return profile_; }

 private:
  JobPlanner() = default;
  // Plan() of a generate or eval job.
  [[nodiscard]] absl::StatusOr<PlanSummary> PlanGenerationJob(const JobSpec& spec);

  Mutex mu_;
  std::unique_ptr<Backend> backend_ ABSL_GUARDED_BY(mu_);  // sizes plans; never runs a job
  MachineProfile profile_;
  std::string note_;
  int64_t host_budget_bytes_ = 0;
  int64_t gpus_ = 0;  // GPUs on the node (ListGpus, or as given)
};

}  // namespace megatrain
