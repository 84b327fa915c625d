// engine.h's TrainingJob: a Trainer placed where RunOptions say, behind the public API.
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "engine/common/status.h"
#include "engine/engine.h"
#include "engine/job/trainer.h"
#include "engine/model/config.h"
#include "engine/plan/machine_profile.h"

namespace megatrain {
namespace {

class TrainerJob final : public TrainingJob {
 public:
  explicit TrainerJob(std::unique_ptr<Trainer> trainer) : trainer_(std::move(trainer)) {}

  JobDescription Describe() const override {
    const Trainer& t = *trainer_;
    JobDescription d;
    d.step = t.step();
    d.resumed_from_step = t.resumed_from_step();
    d.last_loss = t.last_loss();
    d.done = t.done();
    d.dataset_summary = t.dataset_stats().Summary();
    if (!t.eval_batches().empty()) {
      d.eval_summary = absl::StrCat("eval set: ", absl::StripPrefix(t.eval_stats().Summary(), "dataset: "), "; ",
                                    t.eval_batches().size(), " micro-batch(es) of ",
                                    t.plan().micro_batch_rows, " x ", t.spec().seq_len);
    } else if (t.eval_pairs() > 0) {  // a DPO job's
      d.eval_summary = absl::StrCat("eval set: ", absl::StripPrefix(t.eval_stats().Summary(), "dataset: "), "; ",
                                    t.eval_pairs(), " preference pairs");
    }
    d.architecture = ArchitectureClassName(t.config().architecture);
    d.num_parameters = t.num_parameters();
    d.backend_name = t.backend_name();
    d.tokens_per_step = t.spec().tokens_per_step_resolved();
    d.plan_text = t.plan_text();
    d.pinned_host_bytes = t.pinned_host_bytes();
    d.pageable_host_bytes = t.pageable_host_bytes();
    return d;
  }
  absl::StatusOr<StepReport> Step() override { return trainer_->Step(); }
  absl::StatusOr<EvalReport> Evaluate() override { return trainer_->Evaluate(); }
  bool done() const override { return trainer_->done(); }
  int64_t step() const override { return trainer_->step(); }
  absl::StatusOr<std::string> SaveCheckpoint() override { return trainer_->SaveCheckpoint(); }
  void CheckpointNextStep() override { trainer_->CheckpointNextStep(); }
  double last_checkpoint_seconds() const override { return trainer_->last_checkpoint_seconds(); }
  int64_t last_checkpoint_bytes() const override { return trainer_->last_checkpoint_bytes(); }

 private:
  std::unique_ptr<Trainer> trainer_;
};

}  // namespace

JobSpec PlacedSpec(const JobSpec& spec, const RunOptions& options) {
  JobSpec placed = spec;
  if (!options.device.empty()) placed.backend = options.device;
  if (!options.checkpoint_dir.empty()) placed.checkpoint_dir = options.checkpoint_dir;
  return placed;
}

absl::StatusOr<std::unique_ptr<TrainingJob>> TrainingJob::Create(const JobSpec& spec,
                                                                 const RunOptions& options) {
  const JobSpec placed = PlacedSpec(spec, options);
  RETURN_IF_ERROR(ValidateJobSpec(placed));
  std::unique_ptr<Trainer> trainer;
  if (options.profile_json.empty()) {
    ASSIGN_OR_RETURN(trainer, Trainer::Create(placed));
  } else {
    ASSIGN_OR_RETURN(const MachineProfile profile, ProfileFromJson(options.profile_json));
    ASSIGN_OR_RETURN(trainer, Trainer::Create(placed, &profile));
  }
  return std::unique_ptr<TrainingJob>(new TrainerJob(std::move(trainer)));
}

}  // namespace megatrain
