// A training job, end to end: model in the host store, data, pipeline, optimizer,
// schedule and checkpoints. The local runner and the daemon (through engine.h's
// TrainingJob) both drive one of these.
//
// Create() loads or initialises the model and tokenizes the data; when the spec's
// checkpoint folder already holds a checkpoint of this job, it resumes from the newest.
// Then Step() until done(). Thread-compatible: one thread drives a Trainer.
//
// The Trainer is the step's script; its parts are units of their own: the setup
// (job_setup.h: the parts a step runs on, built in stages), the data-parallel replicas
// (replicas.h), the checkpoints (job_checkpoints.h) and the step's report
// (step_reporter.h).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/checkpoint/checkpoint.h"
#include "engine/data/dataset.h"
#include "engine/data/micro_batch.h"
#include "engine/engine.h"
#include "engine/job/background_checkpoint.h"
#include "engine/job/job_checkpoints.h"
#include "engine/job/job_setup.h"
#include "engine/job/preference_references.h"
#include "engine/job/spec.h"
#include "engine/job/step_reporter.h"
#include "engine/model/config.h"
#include "engine/plan/machine_profile.h"
#include "engine/plan/planner.h"
#include "engine/store/host_store.h"

namespace megatrain {

// StepReport, what Step() returns: engine.h. ResumeState, PlanKeepingSplit and
// JobPlanRequest, which the planner shares with the setup: job_setup.h.

class Trainer {
 public:
  // `profile`: the machine's rates for the planner; null = LoadMachineProfile()'s (the
  // daemon's profile when there is one for this backend, so that a spec plans alike run
  // here or by megatraind).
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<Trainer>> Create(
      const JobSpec& spec, const MachineProfile* profile = nullptr);
  ~Trainer();

  // Runs one optimizer step; saves a checkpoint when the spec says so. Evaluates the eval
  // set before the first step and after the steps the spec names (StepReport::evals).
  [[nodiscard]] absl::StatusOr<StepReport> Step();
  bool done() const { return state_.step >= spec_.steps; }
  int64_t step() const { return state_.step; }
  int64_t resumed_from_step() const { return parts_->resumed_from_step; }
  // The loss of the last step completed: in this run, else the one the checkpoint resumed
  // from recorded (NaN where it recorded none); 0 before any step.
  double last_loss() const { return state_.last_loss; }

  // Writes a checkpoint of the state after the last completed step and prunes old ones;
  // training waits. (A background checkpoint still being written is finished first.)
  [[nodiscard]] absl::StatusOr<std::string> SaveCheckpoint();
  // Starts writing a checkpoint of the state after the last completed step while the
  // next steps run; Step() reports when it is done (StepReport::checkpoint_paths).
  [[nodiscard]] absl::Status StartBackgroundCheckpoint();
  // The next Step() writes a checkpoint of its state in the background, begun before it
  // runs (as periodic ones are).
  void CheckpointNextStep() { checkpoints_->AskForNextStep(); }
  // Writer threads of background checkpoints (0: every core, at most 16). For
  // benchmarks comparing counts.
  void set_checkpoint_writer_threads(int n) { checkpoints_->set_writer_threads(n); }
  // Writes a checkpoint of the state after the last completed step under `root`, with
  // training stopped, leaving a background checkpoint being written alone (benchmarks
  // and tests compare the two).
  [[nodiscard]] absl::StatusOr<std::string> SaveCheckpointTo(const std::string& root);
  // Waits for the background checkpoint being written, if any; its path, or "" if none.
  [[nodiscard]] absl::StatusOr<std::string> FinishBackgroundCheckpoint();
  // The last checkpoint written: seconds it took (drain, write, fsync, prune; for one
  // written in the background, from its start to its commit) and bytes.
  double last_checkpoint_seconds() const { return checkpoints_->last_seconds(); }
  int64_t last_checkpoint_bytes() const { return checkpoints_->last_bytes(); }
  // For one written in the background: seconds from its start until every unit was
  // written (the rest is fsync).
  double last_checkpoint_capture_seconds() const {
    return checkpoints_->last_capture_seconds();
  }
  // Its units' timings (BackgroundCheckpoint::unit_times).
  const std::vector<BackgroundCheckpoint::UnitTimes>& last_checkpoint_unit_times() const {
    return checkpoints_->last_unit_times();
  }

  const ModelConfig& config() const { return parts_->config; }
  // How the job runs (the planner's choices and prediction), and the same in words.
  const Plan& plan() const { return parts_->plan; }
  const std::string& plan_text() const { return parts_->plan_text; }
  const JobSpec& spec() const { return spec_; }
  // Evaluates the eval set on the weights after the last completed step (every pending
  // update applied first); nothing else changes. FailedPrecondition without an eval set.
  [[nodiscard]] absl::StatusOr<EvalReport> Evaluate();
  // The eval set as the plan packs it (empty without one), and what tokenizing it found.
  const std::vector<MicroBatch>& eval_batches() const { return eval_batches_; }
  // A DPO job's eval pairs (0 without an eval set).
  int64_t eval_pairs() const {
    return parts_->eval_pairs != nullptr ? static_cast<int64_t>(parts_->eval_pairs->size()) : 0;
  }
  const DatasetStats& eval_stats() const { return parts_->eval_stats; }
  std::string backend_name() const { return parts_->backend->name(); }
  const HostStore& store() const { return *parts_->store; }
  // Host bytes page-locked for transfers (bf16 weights, gradient slabs) and pageable
  // (fp32 master weights and moments).
  int64_t pinned_host_bytes() const;
  int64_t pageable_host_bytes() const;
  int64_t num_parameters() const { return parts_->num_parameters; }
  // What building (or reusing) the tokenized dataset found.
  const DatasetStats& dataset_stats() const { return parts_->dataset_stats; }

 private:
  Trainer() = default;
  // The step on every device, from its data to its result: the micro-batches, the
  // optimizer's step, the pipelines. `*lr`: the step's learning rate.
  [[nodiscard]] absl::StatusOr<StepResult> RunStep(int64_t step, double* lr);

  // A DPO job's reference values (PreferenceReferences::Ensure): before its first step, and
  // before an evaluation of its eval pairs.
  [[nodiscard]] absl::Status EnsureReference();
  // A DPO job's evaluation: its eval pairs' metrics under the current weights.
  [[nodiscard]] absl::StatusOr<EvalReport> EvaluatePairs();

  JobSpec spec_;
  std::unique_ptr<JobParts> parts_;
  std::vector<MicroBatch> batches_;  // the first device's share of a step
  // A DPO job's: the step's pairs, and the reference's values.
  std::vector<PairBatch> pair_step_;
  std::unique_ptr<PreferenceReferences> references_;
  std::vector<MicroBatch> eval_batches_;  // the eval set (eval_set.h)
  TrainerState state_;
  bool step_failed_ = false;  // a step returned an error (its updates may be half done)
  std::unique_ptr<StepReporter> reporter_;
  // Last: it reads the store and holds the optimizer, so it goes first.
  std::unique_ptr<JobCheckpoints> checkpoints_;
};

}  // namespace megatrain
