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
  {
    MutexLock lock(&b->mu_);  // no writer runs yet: for the analysis only
    for (int64_t u = 0; u < b->units_; ++u) b->pieces_left_.push_back(b->writer_->NumPieces(u));
    b->times_.resize(b->units_);
  }
  b->after_commit_ = std::move(after_commit);
  b->fault_ = std::move(fault);
  for (int i = 0; i < std::max(threads, 1); ++i) {
    b->threads_.emplace_back([p = b.get()] { p->WriterLoop(); });
  }
  // Called with the optimizer's lock held: only queue the unit. (Lock order: the
  // optimizer's, then ours; never call the optimizer while holding ours.)
  optimizer->BeginCapture(b->step_, [p = b.get()](int64_t unit) {
    MutexLock lock(&p->mu_);
    p->times_[unit].ready = p->SinceStart();
    for (int64_t i = 0; i < p->pieces_left_[unit]; ++i) {
      p->ready_.push_back(Piece{unit, i, p->writer_->PieceFile(unit, i)});
    }
  });
  return b;
}

BackgroundCheckpoint::~BackgroundCheckpoint() {
  {
    MutexLock lock(&mu_);
    abandon_ = true;
  }
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

// Lock() and Unlock() by hand where a std::unique_lock was unlocked and locked again: the
// mutex is held over the same stretches as before. Each Unlock() wakes the waiting writers
// (Await releases the mutex silently): before a piece is written or Captured() is called
// they find nothing new. The one before EndCapture() may find the commit due (every unit
// written, the state known), so another writer may commit while EndCapture() runs, as a
// SetState() in that window always allowed: the commit touches only the files, and the
// destructor joins this thread before a next capture can begin.
void BackgroundCheckpoint::WriterLoop() {
  auto runnable = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return abandon_ || finished_ || !ready_.empty() ||
           (written_ == units_ && state_.has_value() && !committing_);
  };
  mu_.Lock();
  for (;;) {
    mu_.Await(runnable);
    if (abandon_ || finished_) {
      mu_.Unlock();
      return;
    }
    if (ready_.empty()) break;  // every unit written and the state known: commit
    const Piece piece = TakePieceLocked();
    ++writing_[piece.file];
    mu_.Unlock();
    absl::Status written = fault_ && piece.piece == 0 ? fault_(piece.unit) : absl::OkStatus();
    if (written.ok()) written = writer_->WritePiece(*store_, piece.unit, piece.piece);
    mu_.Lock();
    --writing_[piece.file];
    if (!written.ok()) {
      FinishLocked(written);
      mu_.Unlock();
      optimizer_->EndCapture();  // training goes on without it
      return;
    }
    if (--pieces_left_[piece.unit] > 0) continue;
    times_[piece.unit].written = SinceStart();
    mu_.Unlock();
    optimizer_->Captured(piece.unit);  // its next update may run
    mu_.Lock();
    if (++written_ == units_) {
      capture_seconds_ = SinceStart();
      mu_.Unlock();  // wakes the writers: one commits once the state is known
      optimizer_->EndCapture();
      mu_.Lock();
    }
  }
  // Every byte is in the files; make them durable off the training path.
  committing_ = true;
  const TrainerState state = *state_;
  mu_.Unlock();
  absl::StatusOr<std::string> path = writer_->Commit(state);
  absl::Status after = path.ok() && after_commit_ ? after_commit_() : absl::OkStatus();
  mu_.Lock();
  FinishLocked(path.ok() && !after.ok() ? absl::StatusOr<std::string>(after) : path);
  mu_.Unlock();
}

void BackgroundCheckpoint::FinishLocked(absl::StatusOr<std::string> result) {
  if (finished_) return;
  result_ = std::move(result);
  finished_ = true;
  seconds_ = SinceStart();  // the caller's Unlock() wakes Wait()
}

void BackgroundCheckpoint::SetState(const TrainerState& state) {
  MutexLock lock(&mu_);
  state_ = state;
}

bool BackgroundCheckpoint::has_state() const {
  MutexLock lock(&mu_);
  return state_.has_value();
}

bool BackgroundCheckpoint::done() const {
  MutexLock lock(&mu_);
  return finished_;
}

absl::StatusOr<std::string> BackgroundCheckpoint::Wait() {
  MutexLock lock(&mu_);
  mu_.Await([this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return finished_; });
  return result_;
}

double BackgroundCheckpoint::seconds() const {
  MutexLock lock(&mu_);
  return finished_ ? seconds_ : SinceStart();
}

std::vector<BackgroundCheckpoint::UnitTimes> BackgroundCheckpoint::unit_times() const {
  MutexLock lock(&mu_);
  return times_;
}

double BackgroundCheckpoint::capture_seconds() const {
  MutexLock lock(&mu_);
  return capture_seconds_ >= 0 ? capture_seconds_ : SinceStart();
}

}  // namespace megatrain
