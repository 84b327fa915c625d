// A checkpoint written while training goes on (../shared/DESIGN.md, "Checkpoints").
//
// A unit's state is constant between its update in step s and its update in step s+1.
// So the state after step s is written unit by unit, each as soon as its step-s update
// is in the store, straight from the store (no copy), by writer threads that share each
// unit in pieces: the optimizer hands units over as they become ready
// (HostOptimizer::BeginCapture), and the unit's step-s+1 update waits until it is
// written. Started before step s runs, the writing begins as step s's backward updates
// the top layers, so every unit has a whole step's time. Threads prefer pieces of files
// no other thread is writing (buffered writes to one file serialize in the kernel). When
// every unit is written and the step's trainer state is known (SetState), the checkpoint
// is fsynced, renamed and old ones pruned, on a writer thread, while later steps run.
//
// Thread-safe. Destroying it before it finished abandons the checkpoint (its temporary
// folder is removed) and releases the optimizer.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/checkpoint/checkpoint.h"
#include "engine/common/mutex.h"
#include "engine/optim/host_optimizer.h"
#include "engine/store/host_store.h"

namespace megatrain {

class BackgroundCheckpoint {
 public:
  // Starts writing `writer`'s checkpoint of step writer->step(), which is the step the
  // optimizer finished last or the one about to begin (HostOptimizer::BeginCapture), with
  // `threads` writers; `after_commit` runs on a writer thread once it is durable
  // (pruning). `fault`, for tests: runs before each unit is written; an error fails the
  // checkpoint as a write error would.
  static std::unique_ptr<BackgroundCheckpoint> Start(
      std::unique_ptr<CheckpointWriter> writer, HostOptimizer* optimizer,
      const HostStore* store, int threads, std::function<absl::Status()> after_commit,
      std::function<absl::Status(int64_t unit)> fault = nullptr);
  ~BackgroundCheckpoint();

  int64_t step() const { return step_; }
  // The trainer state after step(), once that step has finished; the commit waits for it.
  void SetState(const TrainerState& state);
  bool has_state() const;
  // True once Wait() would not block.
  bool done() const;
  // Blocks until the checkpoint is committed (its path) or has failed (why).
  // REQUIRES: SetState() was called, or will be from another thread.
  [[nodiscard]] absl::StatusOr<std::string> Wait();
  // From Start() to the commit (or failure); from Start() to the last unit written (or
  // until now); and the bytes written.
  double seconds() const;
  double capture_seconds() const;
  uint64_t bytes() const { return bytes_; }
  // Per unit, seconds from Start(): when it was handed over (its update of step() was in
  // the store) and when it was written; -1 for not yet.
  struct UnitTimes {
    double ready = -1;
    double written = -1;
  };
  std::vector<UnitTimes> unit_times() const;

 private:
  struct Piece {
    int64_t unit;
    int64_t piece;  // CheckpointWriter::WritePiece
    int64_t file;   // CheckpointWriter::PieceFile
  };
  BackgroundCheckpoint() = default;
  void WriterLoop();
  // The next piece to write, preferring a file no thread is writing.
  Piece TakePieceLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Records the outcome.
  void FinishLocked(absl::StatusOr<std::string> result) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  double SinceStart() const;

  std::unique_ptr<CheckpointWriter> writer_;
  HostOptimizer* optimizer_ = nullptr;
  const HostStore* store_ = nullptr;
  std::function<absl::Status()> after_commit_;
  std::function<absl::Status(int64_t)> fault_;
  int64_t step_ = 0;
  uint64_t bytes_ = 0;
  int64_t units_ = 0;
  std::chrono::steady_clock::time_point started_;

  mutable Mutex mu_;
  // Pieces of units whose state may be written now.
  std::deque<Piece> ready_ ABSL_GUARDED_BY(mu_);
  std::map<int64_t, int> writing_ ABSL_GUARDED_BY(mu_);    // file -> threads writing it
  std::vector<int64_t> pieces_left_ ABSL_GUARDED_BY(mu_);  // per unit
  std::vector<UnitTimes> times_ ABSL_GUARDED_BY(mu_);      // per unit
  int64_t written_ ABSL_GUARDED_BY(mu_) = 0;               // units written
  double capture_seconds_ ABSL_GUARDED_BY(mu_) = -1;       // when the last unit was written
  std::optional<TrainerState> state_ ABSL_GUARDED_BY(mu_);
  bool committing_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;  // result_ is final
  bool abandon_ ABSL_GUARDED_BY(mu_) = false;   // destroyed early: stop
  absl::StatusOr<std::string> result_ ABSL_GUARDED_BY(mu_) = absl::UnknownError("not finished");
  double seconds_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<std::thread> threads_;
};

}  // namespace megatrain
