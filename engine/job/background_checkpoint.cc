#include "engine/job/background_checkpoint.h"

#include <algorithm>
#include <chrono>

namespace megatrain {

std::unique_ptr<BackgroundCheckpoint> BackgroundCheckpoint::Start(
    std::unique_ptr<CheckpointWriter> writer, HostOptimizer* optimizer, const HostStore* store,
    int threads, std::function<absl::Status()> after_commit,
    std::function<absl::Status(int64_t unit)> fault) {
  std::unique_ptr<BackgroundCheckpoint> b(new BackgroundCheckpoint());
  b->started_ = std::chrono::steady_clock::now();
  b->step_ = writer->step();
  b->bytes_ = writer->data_bytes();
  b->writer_ = std::move(writer);
  b->optimizer_ = optimizer;
  b->store_ = store;
  b->units_ = store->num_units();
  for (int64_t u = 0; u < b->units_; ++u) b->pieces_left_.push_back(b->writer_->NumPieces(u));
  b->after_commit_ = std::move(after_commit);
  b->fault_ = std::move(fault);
  const int n = std::max(threads, 1);
  for (int i = 0; i < n; ++i) b->threads_.emplace_back([p = b.get()] { p->WriterLoop(); });
  // Called with the optimizer's lock held: only queue the unit. (Lock order: the
  // optimizer's, then ours; never call the optimizer while holding ours.)
  optimizer->BeginCapture([p = b.get()](int64_t unit) {
    {
      std::lock_guard<std::mutex> lock(p->mu_);
      for (int64_t i = 0; i < p->pieces_left_[unit]; ++i) p->ready_.push_back(Piece{unit, i});
    }
    p->cv_.notify_all();
  });
  return b;
}

BackgroundCheckpoint::~BackgroundCheckpoint() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    abandon_ = true;
  }
  cv_.notify_all();
  for (std::thread& t : threads_) t.join();
  optimizer_->EndCapture();
  writer_.reset();  // uncommitted: removes its temporary folder
}

void BackgroundCheckpoint::WriterLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [this] { return abandon_ || finished_ || !ready_.empty(); });
    if (abandon_ || finished_) return;
    const Piece piece = ready_.front();
    ready_.pop_front();
    lock.unlock();
    absl::Status written = fault_ && piece.piece == 0 ? fault_(piece.unit) : absl::OkStatus();
    if (written.ok()) written = writer_->WritePiece(*store_, piece.unit, piece.piece);
    lock.lock();
    if (!written.ok()) {
      FailLocked(written);
      lock.unlock();
      optimizer_->EndCapture();
      return;
    }
    if (--pieces_left_[piece.unit] > 0) continue;
    lock.unlock();
    optimizer_->Captured(piece.unit);  // its next update may run
    lock.lock();
    if (++written_ < units_) continue;
    // The last unit: every byte is in the files; make them durable off the training path.
    lock.unlock();
    optimizer_->EndCapture();
    absl::StatusOr<std::string> path = writer_->Commit();
    absl::Status after = path.ok() && after_commit_ ? after_commit_() : absl::OkStatus();
    lock.lock();
    if (path.ok() && !after.ok()) {
      FailLocked(after);
    } else {
      result_ = std::move(path);
      finished_ = true;
      seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - started_).count();
      cv_.notify_all();
    }
    return;
  }
}

void BackgroundCheckpoint::FailLocked(absl::Status status) {
  if (finished_) return;
  result_ = std::move(status);
  finished_ = true;
  seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - started_).count();
  cv_.notify_all();
}

bool BackgroundCheckpoint::done() const {
  std::lock_guard<std::mutex> lock(mu_);
  return finished_;
}

absl::StatusOr<std::string> BackgroundCheckpoint::Wait() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [this] { return finished_; });
  return result_;
}

double BackgroundCheckpoint::seconds() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (finished_) return seconds_;
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - started_).count();
}

}  // namespace megatrain
