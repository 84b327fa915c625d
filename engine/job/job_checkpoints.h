// A job's checkpoints: when they are written (every checkpoint.every_steps steps, the
// final step, or when asked), how (with training stopped, or in the background while the
// next steps run: background_checkpoint.h), the pruning to checkpoint.keep_last, and what
// the last one cost. The Trainer calls BeforeStep() and AfterStep() around each step and
// passes what finished to the step's report (CheckpointOutcomes).
//
// A periodic checkpoint that fails is reported and training goes on; only the final one
// failing fails the step. One background checkpoint at a time: starting the next waits
// for the previous one's fsync.
//
// Thread-compatible: the thread that drives the job calls it. It reads the store (and
// holds the optimizer's capture while writing in the background), so it goes before them.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/checkpoint/checkpoint.h"
#include "engine/job/background_checkpoint.h"
#include "engine/model/config.h"
#include "engine/optim/host_optimizer.h"
#include "engine/store/host_store.h"

namespace megatrain {

struct JobCheckpointOptions {
  std::string dir;          // checkpoint.dir; "" = no checkpoints
  int64_t every_steps = 0;  // periodic: every that many steps; 0 = only the final one
  bool background = true;   // periodic ones are written while training goes on
  int64_t keep_last = 3;    // PruneCheckpoints
  int64_t total_steps = 0;  // the job's last step, always checkpointed (with a dir)
  // Writer threads of background checkpoints (0: every core, at most 16).
  int writer_threads = 0;
  CheckpointOptions files;  // shard sizes, tokenizer files, moment dtype
};

// The checkpoints a step saw finish or fail, oldest first (StepReport's fields).
struct CheckpointOutcomes {
  std::vector<std::string> paths;
  std::string error;                  // each failure in words, "; "-joined
  std::vector<int64_t> failed_steps;
};

class JobCheckpoints {
 public:
  // `last_saved_step`: the checkpoint the job resumed from (-1: none). `config`, `store`
  // and `optimizer` outlive this object.
  JobCheckpoints(const JobCheckpointOptions& options, const ModelConfig* config,
                 HostStore* store, HostOptimizer* optimizer, int64_t last_saved_step);
  // Abandons a background checkpoint still being written (its temporary folder goes).
  ~JobCheckpoints();

  // Step `step` is about to run (before its optimizer's BeginStep): begins its
  // checkpoint in the background when one is due, waiting first for the previous one.
  // Returns the seconds waited; what finished or failed goes to `out`.
  double BeforeStep(int64_t step, CheckpointOutcomes* out);
  // Step `step` failed: its background checkpoint, if begun, is abandoned.
  void StepFailed(int64_t step);
  // The step reached `state`: a background checkpoint of it may commit; finished ones go
  // to `out`, and a checkpoint due with training stopped is written. An error only when
  // the job's final checkpoint fails.
  [[nodiscard]] absl::Status AfterStep(const TrainerState& state, CheckpointOutcomes* out);

  // The next step's checkpoint is written in the background (Trainer::CheckpointNextStep).
  void AskForNextStep() { next_step_asked_ = true; }
  void set_writer_threads(int n) { options_.writer_threads = n; }

  // `state`, the one after the last completed step, with training stopped, into the dir;
  // old ones pruned. A background checkpoint being written is finished first (it is the
  // one returned when it is of `state`'s step).
  [[nodiscard]] absl::StatusOr<std::string> Save(const TrainerState& state);
  // Likewise under `root`, leaving a background checkpoint alone, without pruning.
  [[nodiscard]] absl::StatusOr<std::string> SaveTo(const std::string& root,
                                                   const TrainerState& state);
  // Begins writing `state` in the background, after finishing the one being written.
  [[nodiscard]] absl::Status StartNow(const TrainerState& state);
  // Waits for the background checkpoint being written, if any: its path, or "" if none
  // (or one of a step that never finished).
  [[nodiscard]] absl::StatusOr<std::string> FinishBackground();

  // The last checkpoint written: seconds (drain, write, fsync, prune; in the background,
  // from its start to its commit), bytes, and for one in the background the seconds until
  // every unit was written and its units' timings.
  double last_seconds() const { return last_seconds_; }
  int64_t last_bytes() const { return last_bytes_; }
  double last_capture_seconds() const { return last_capture_seconds_; }
  const std::vector<BackgroundCheckpoint::UnitTimes>& last_unit_times() const {
    return last_unit_times_;
  }

 private:
  bool Periodic(int64_t step) const {
    return !options_.dir.empty() && options_.every_steps > 0 && step % options_.every_steps == 0;
  }
  // Begins the background checkpoint of `step` (the last finished or the next).
  [[nodiscard]] absl::Status StartBackground(int64_t step);
  // Takes the background checkpoint's outcome into `out`, waiting for it if `wait`.
  void CollectBackground(bool wait, CheckpointOutcomes* out);
  void AddFailure(int64_t step, const absl::Status& status, CheckpointOutcomes* out) const;
  // The state after `state.step` with training stopped, into the dir; prunes.
  [[nodiscard]] absl::StatusOr<std::string> SaveStopped(const TrainerState& state);

  JobCheckpointOptions options_;
  const ModelConfig* config_;
  HostStore* store_;
  HostOptimizer* optimizer_;
  int64_t last_saved_step_;
  bool next_step_asked_ = false;
  double last_seconds_ = 0;
  int64_t last_bytes_ = 0;
  double last_capture_seconds_ = 0;
  std::vector<BackgroundCheckpoint::UnitTimes> last_unit_times_;
  std::unique_ptr<BackgroundCheckpoint> background_;
};

}  // namespace megatrain
