// A training job, end to end: model in the host store, data, pipeline, optimizer,
// schedule and checkpoints. The local runner and the daemon both drive one of these.
//
// Create() loads or initialises the model and tokenizes the data; when the spec's
// checkpoint folder already holds a checkpoint of this job, it resumes from the newest.
// Then Step() until done(). Thread-compatible: one thread drives a Trainer; RequestStop()
// alone may be called from any thread.
#pragma once

#include <atomic>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "engine/backend/factory.h"
#include "engine/checkpoint/checkpoint.h"
#include "engine/common/backend.h"
#include "engine/data/dataset.h"
#include "engine/data/packer.h"
#include "engine/data/tokenizer.h"
#include "engine/job/background_checkpoint.h"
#include "engine/job/inputs.h"
#include "engine/job/spec.h"
#include "engine/optim/host_optimizer.h"
#include "engine/pipeline/grad_reducer.h"
#include "engine/pipeline/pipeline.h"
#include "engine/plan/planner.h"

namespace megatrain {

// StepReport, what Step() returns: engine.h.

// The trainer state of the checkpoint `spec` resumes from: its checkpoint.dir's newest
// (none without one). FailedPrecondition when that is another job's (another Fingerprint:
// the daemon refuses the job at submit, the trainer at start); DataLoss naming the file for
// a corrupt state. `newest`, unless null, gets the folder read, which the trainer then
// loads. Reads files: call it as the job's user.
[[nodiscard]] absl::StatusOr<std::optional<TrainerState>> ResumeState(
    const JobSpec& spec, std::string* newest = nullptr);

// The plan of `*request` for `spec`, keeping a resumed job's split of a step and MLP tile
// (TrainerState::micro_batch_rows, mlp_tile_tokens: they decide a step's bits) when the spec
// leaves the split to the planner and it still fits; *request then asks for them. `*note` is
// a line for the plan's text saying which ("" without a split to keep).
[[nodiscard]] absl::StatusOr<Plan> PlanKeepingSplit(const JobSpec& spec,
                                                    const std::optional<TrainerState>& resume,
                                                    const MachineProfile& profile,
                                                    Backend* backend, PlanRequest* request,
                                                    std::string* note);

// What the planner needs to know of a job: the model, the batch, clipping and the choices
// the spec fixes; the budgets are the caller's (the device's, the node's).
PlanRequest JobPlanRequest(const JobSpec& spec, const ModelConfig& config,
                           int64_t device_budget_bytes, int64_t host_budget_bytes);

class Trainer {
 public:
  // `profile`: the machine's rates for the planner; null = LoadMachineProfile()'s (the
  // daemon's profile when there is one for this backend, so that a spec plans alike run
  // here or by megatraind).
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<Trainer>> Create(
      const JobSpec& spec, const MachineProfile* profile = nullptr);
  ~Trainer();

  // Runs one optimizer step; saves a checkpoint when the spec says so.
  [[nodiscard]] absl::StatusOr<StepReport> Step();
  bool done() const { return state_.step >= spec_.steps; }
  int64_t step() const { return state_.step; }
  int64_t resumed_from_step() const { return resumed_from_; }
  // The loss of the last step completed: in this run, else the one the checkpoint resumed
  // from recorded (NaN where it recorded none); 0 before any step.
  double last_loss() const { return state_.last_loss; }

  // Writes a checkpoint of the state after the last completed step and prunes old ones;
  // training waits. (A background checkpoint still being written is finished first.)
  [[nodiscard]] absl::StatusOr<std::string> SaveCheckpoint();
  // Starts writing a checkpoint of the state after the last completed step while the
  // next steps run; Step() reports when it is done (StepReport::checkpoint_path).
  [[nodiscard]] absl::Status StartBackgroundCheckpoint();
  // The next Step() writes a checkpoint of its state in the background, begun before it
  // runs (as periodic ones are).
  void CheckpointNextStep() { checkpoint_next_step_ = true; }
  // Writer threads of background checkpoints (0: every core, at most 16). For
  // benchmarks comparing counts.
  void set_checkpoint_writer_threads(int n) { checkpoint_writer_threads_ = n; }
  // Writes a checkpoint of the state after the last completed step under `root`, with
  // training stopped, leaving a background checkpoint being written alone (benchmarks
  // and tests compare the two).
  [[nodiscard]] absl::StatusOr<std::string> SaveCheckpointTo(const std::string& root);
  // Waits for the background checkpoint being written, if any; its path, or "" if none.
  [[nodiscard]] absl::StatusOr<std::string> FinishBackgroundCheckpoint();
  // The last checkpoint written: seconds it took (drain, write, fsync, prune; for one
  // written in the background, from its start to its commit) and bytes.
  double last_checkpoint_seconds() const { return last_checkpoint_seconds_; }
  int64_t last_checkpoint_bytes() const { return last_checkpoint_bytes_; }
  // For one written in the background: seconds from its start until every unit was
  // written (the rest is fsync).
  double last_checkpoint_capture_seconds() const { return last_checkpoint_capture_seconds_; }
  // Its units' timings (BackgroundCheckpoint::unit_times).
  const std::vector<BackgroundCheckpoint::UnitTimes>& last_checkpoint_unit_times() const {
    return last_checkpoint_unit_times_;
  }

  const ModelConfig& config() const { return config_; }
  // How the job runs (the planner's choices and prediction), and the same in words.
  const Plan& plan() const { return plan_; }
  const std::string& plan_text() const { return plan_text_; }
  const JobSpec& spec() const { return spec_; }
  std::string backend_name() const { return backend_->name(); }
  const HostStore& store() const { return *store_; }
  // Host bytes page-locked for transfers (bf16 weights, gradient slabs) and pageable
  // (fp32 master weights and moments).
  int64_t pinned_host_bytes() const;
  int64_t pageable_host_bytes() const;
  int64_t num_parameters() const { return num_params_; }
  // What building (or reusing) the tokenized dataset found.
  const DatasetStats& dataset_stats() const { return dataset_stats_; }

 private:
  Trainer() = default;
  // The job's devices: the first (backend_) and the replicas', with what made each.
  struct DeviceSet {
    std::vector<Backend*> backends;
    std::vector<BackendRequest> requests;
  };
  // Setup, stage by stage (Init runs them in this order).
  [[nodiscard]] absl::Status Init(const JobSpec& spec, const MachineProfile* profile);
  [[nodiscard]] absl::Status InitData(const JobSpec& spec);
  [[nodiscard]] absl::Status InitReplicas(const JobSpec& spec, DeviceSet* devices);
  // resume: the trainer state of the checkpoint the job resumes from (ResumeState), whose
  // split of a step the plan keeps when it still fits.
  [[nodiscard]] absl::Status InitPlan(const JobSpec& spec, const MachineProfile& profile,
                                      const DeviceSet& devices,
                                      const std::optional<TrainerState>& resume);
  [[nodiscard]] absl::Status InitStore(const JobSpec& spec, const DeviceSet& devices);
  [[nodiscard]] absl::Status InitPipelines(const JobSpec& spec, const DeviceSet& devices);
  // newest: the checkpoint folder ResumeState read ("" for none).
  [[nodiscard]] absl::Status Restore(const JobSpec& spec, const std::string& newest);
  // The gradient slabs of device `device` of `devices` (0: the optimizer's).
  [[nodiscard]] absl::StatusOr<std::unique_ptr<GradSlabPool>> MakeSlabs(const JobSpec& spec,
                                                          const DeviceSet& devices,
                                                          int device) const;
  CheckpointOptions checkpoint_options() const;
  // Takes the background checkpoint's outcome into the report, waiting for it if `wait`.
  void CollectBackground(bool wait, StepReport* report);
  // Starts the background checkpoint of `step` (the last finished or the next).
  [[nodiscard]] absl::Status StartBackground(int64_t step);
  std::string CheckpointFailure(int64_t step, const absl::Status& status) const;

  JobSpec spec_;
  ModelConfig config_;
  int64_t num_params_ = 0;
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<HostStore> store_;
  std::unique_ptr<GradSlabPool> slabs_;
  std::unique_ptr<Pipeline> pipeline_;
  std::unique_ptr<HostOptimizer> optimizer_;
  // Data parallelism (spec.devices > 1): the devices after the first, each with its own
  // pipeline and gradient slabs, and the reducer through which their gradients (summed
  // on the devices, or on the host) reach the one optimizer.
  struct Replica {
    std::unique_ptr<Backend> backend;
    std::unique_ptr<GradSlabPool> slabs;
    std::unique_ptr<Pipeline> pipeline;
    std::vector<MicroBatch> batches;
  };
  std::vector<Replica> replicas_;
  // One per device when the devices reduce-scatter the gradients (spec.gradient_reduce).
  std::vector<std::unique_ptr<GradCollective>> collectives_;
  std::string reduce_note_;  // why they are added on the host instead, for the plan
  std::unique_ptr<GradReducer> reducer_;
  [[nodiscard]] absl::StatusOr<StepResult> StepReplicas();
  std::unique_ptr<Packer> packer_;
  Plan plan_;
  std::string plan_text_;
  DatasetStats dataset_stats_;
  double optimizer_busy_seen_ = 0;
  MachineProfile profile_;  // what the plan was made with (AdamW's rate alone: the reports)
  double capture_wait_seen_ = 0;
  double last_checkpoint_seconds_ = 0;
  int64_t last_checkpoint_bytes_ = 0;
  double last_checkpoint_capture_seconds_ = 0;
  std::vector<BackgroundCheckpoint::UnitTimes> last_checkpoint_unit_times_;
  std::vector<MicroBatch> batches_;
  TrainerState state_;
  int64_t resumed_from_ = 0;
  int64_t last_saved_step_ = -1;
  bool checkpoint_next_step_ = false;
  bool step_failed_ = false;  // a step returned an error (its updates may be half done)
  int checkpoint_writer_threads_ = 0;
  std::vector<void*> pinned_;  // host ranges page-locked for this job
  std::string tokenizer_dir_;  // tokenizer files to copy into checkpoints
  int optimizer_numa_node_ = -1;  // where the optimizer's threads run (InitStore)
  // Last: it reads the store and holds the optimizer, so it goes first.
  std::unique_ptr<BackgroundCheckpoint> background_;
};

}  // namespace megatrain
