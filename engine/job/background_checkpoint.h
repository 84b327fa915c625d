// A checkpoint written while training goes on (../shared/DESIGN.md, "Checkpoints").
//
// A unit's state is constant between its update in step s and its update in step s+1.
// So the state after step s is written unit by unit, each as soon as its step-s update
// is in the store, by writer threads sharing each unit in pieces, straight from the
// store (no copy): the
// optimizer hands units over as they become ready (HostOptimizer::BeginCapture), and the
// unit's step-s+1 update waits until it is written. The units become ready in the order
// the next step updates them, so the writers stay ahead of the updates unless the disk's
// page cache takes the bytes slower than a step updates them. Then the last writer
// fsyncs and renames the checkpoint and prunes old ones while later steps run.
//
// Thread-safe. Destroying it before it finished abandons the checkpoint (its temporary
// folder is removed) and releases the optimizer.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/checkpoint/checkpoint.h"
#include "engine/pipeline/host_optimizer.h"
#include "engine/store/host_store.h"

namespace megatrain {

class BackgroundCheckpoint {
 public:
  // Starts writing `writer`'s checkpoint (of the step the optimizer just finished) with
  // `threads` writers; `after_commit` runs on a writer thread once it is durable (pruning).
  // `fault`, for tests: runs before each unit is written; an error fails the checkpoint
  // as a write error would.
  // REQUIRES: called at a step boundary (HostOptimizer::BeginCapture).
  static std::unique_ptr<BackgroundCheckpoint> Start(
      std::unique_ptr<CheckpointWriter> writer, HostOptimizer* optimizer,
      const HostStore* store, int threads, std::function<absl::Status()> after_commit,
      std::function<absl::Status(int64_t unit)> fault = nullptr);
  ~BackgroundCheckpoint();

  int64_t step() const { return step_; }
  // True once Wait() would not block.
  bool done() const;
  // Blocks until the checkpoint is committed (its path) or has failed (why).
  absl::StatusOr<std::string> Wait();
  // From Start() to the commit (or failure), and the bytes written.
  double seconds() const;
  uint64_t bytes() const { return bytes_; }

 private:
  BackgroundCheckpoint() = default;
  void WriterLoop();
  // Under mu_: stops the writers and releases the optimizer's waits.
  void FailLocked(absl::Status status);

  std::unique_ptr<CheckpointWriter> writer_;
  HostOptimizer* optimizer_ = nullptr;
  const HostStore* store_ = nullptr;
  std::function<absl::Status()> after_commit_;
  std::function<absl::Status(int64_t)> fault_;
  int64_t step_ = 0;
  uint64_t bytes_ = 0;
  int64_t units_ = 0;
  std::chrono::steady_clock::time_point started_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  struct Piece {
    int64_t unit;
    int64_t piece;  // CheckpointWriter::WritePiece
  };
  std::deque<Piece> ready_;     // pieces of units whose state may be written now
  std::vector<int64_t> pieces_left_;  // per unit
  int64_t written_ = 0;         // units written
  bool finished_ = false;       // result_ is final
  bool abandon_ = false;        // destroyed early: stop
  absl::StatusOr<std::string> result_ = absl::UnknownError("not finished");
  double seconds_ = 0;
  std::vector<std::thread> threads_;
};

}  // namespace megatrain
