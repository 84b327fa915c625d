#include "engine/job/background_checkpoint.h"

#include <algorithm>

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
  b->times_.resize(b->units_);
  b->after_commit_ = std::move(after_commit);
  b->fault_ = std::move(fault);
  for (int i = 0; i < std::max(threads, 1); ++i) {
    b->threads_.emplace_back([p = b.get()] { p->WriterLoop(); });
  }
  // Called with the optimizer's lock held: only queue the unit. (Lock order: the
  // optimizer's, then ours; never call the optimizer while holding ours.)
  optimizer->BeginCapture(b->step_, [p = b.get()](int64_t unit) {
    {
      std::lock_guard<std::mutex> lock(p->mu_);
      p->times_[unit].ready = p->SinceStart();
      for (int64_t i = 0; i < p->pieces_left_[unit]; ++i) {
        p->ready_.push_back(Piece{unit, i, p->writer_->PieceFile(unit, i)});
      }
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

double BackgroundCheckpoint::SinceStart() const {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - started_).count();
}

BackgroundCheckpoint::Piece BackgroundCheckpoint::TakePieceLocked() {
  // The oldest piece of a file nobody writes, else the oldest: the order is the order the
  // units' next updates come in, so the oldest is the most urgent.
  auto pick = ready_.begin();
  for (auto it = ready_.begin(); it != ready_.end(); ++it) {
    if (writing_[it->file] == 0) {
      pick = it;
      break;
    }
  }
  const Piece piece = *pick;
  ready_.erase(pick);
  return piece;
}

void BackgroundCheckpoint::WriterLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [this] {
      return abandon_ || finished_ || !ready_.empty() ||
             (written_ == units_ && state_.has_value() && !committing_);
    });
    if (abandon_ || finished_) return;
    if (ready_.empty()) break;  // every unit written and the state known: commit
    const Piece piece = TakePieceLocked();
    ++writing_[piece.file];
    lock.unlock();
    absl::Status written = fault_ && piece.piece == 0 ? fault_(piece.unit) : absl::OkStatus();
    if (written.ok()) written = writer_->WritePiece(*store_, piece.unit, piece.piece);
    lock.lock();
    --writing_[piece.file];
    if (!written.ok()) {
      FinishLocked(written);
      lock.unlock();
      optimizer_->EndCapture();  // training goes on without it
      return;
    }
    if (--pieces_left_[piece.unit] > 0) continue;
    times_[piece.unit].written = SinceStart();
    lock.unlock();
    optimizer_->Captured(piece.unit);  // its next update may run
    lock.lock();
    if (++written_ == units_) {
      capture_seconds_ = SinceStart();
      lock.unlock();
      optimizer_->EndCapture();
      lock.lock();
      cv_.notify_all();  // a thread commits once the state is known
    }
  }
  // Every byte is in the files; make them durable off the training path.
  committing_ = true;
  const TrainerState state = *state_;
  lock.unlock();
  absl::StatusOr<std::string> path = writer_->Commit(state);
  absl::Status after = path.ok() && after_commit_ ? after_commit_() : absl::OkStatus();
  lock.lock();
  FinishLocked(path.ok() && !after.ok() ? absl::StatusOr<std::string>(after) : path);
}

void BackgroundCheckpoint::FinishLocked(absl::StatusOr<std::string> result) {
  if (finished_) return;
  result_ = std::move(result);
  finished_ = true;
  seconds_ = SinceStart();
  cv_.notify_all();
}

void BackgroundCheckpoint::SetState(const TrainerState& state) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    state_ = state;
  }
  cv_.notify_all();
}

bool BackgroundCheckpoint::has_state() const {
  std::lock_guard<std::mutex> lock(mu_);
  return state_.has_value();
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
  return finished_ ? seconds_ : SinceStart();
}

std::vector<BackgroundCheckpoint::UnitTimes> BackgroundCheckpoint::unit_times() const {
  std::lock_guard<std::mutex> lock(mu_);
  return times_;
}

double BackgroundCheckpoint::capture_seconds() const {
  std::lock_guard<std::mutex> lock(mu_);
  return capture_seconds_ >= 0 ? capture_seconds_ : SinceStart();
}

}  // namespace megatrain
