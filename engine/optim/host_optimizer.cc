#include "engine/optim/host_optimizer.h"

#include <numa.h>

#include <algorithm>
#include <chrono>
#include <cmath>

#include "engine/common/check.h"
#include "engine/optim/clip.h"

namespace megatrain {

namespace {

// Clipping with compact_held: room for every unit's state range (else none).
std::unique_ptr<HeldGradients> MakeHeldGradients(const HostStore& store,
                                                 const HostOptimizerOptions& options) {
  if (!options.compact_held || options.max_grad_norm <= 0) return nullptr;
  std::vector<int64_t> elements(store.num_units());
  for (int64_t u = 0; u < store.num_units(); ++u) elements[u] = store.state_elements(u);
  return std::make_unique<HeldGradients>(std::move(elements));
}

}  // namespace

HostOptimizer::HostOptimizer(HostStore* store, GradSlabPool* pool, Backend* backend,
                             const HostOptimizerOptions& options)
    : store_(store), pool_(pool), backend_(backend), options_(options),
      held_gradients_(MakeHeldGradients(*store, options)), worker_([this] { Loop(); }) {}

HostOptimizer::~HostOptimizer() {
  Drain();
  {
    MutexLock lock(&mu_);
    stop_ = true;
  }
  worker_.join();
}

void HostOptimizer::Restored(int64_t step) {
  MutexLock lock(&mu_);
  RestoredLocked(step);
}

void HostOptimizer::RestoredLocked(int64_t step) {
  step_ = step;
  updated_step_.assign(store_->num_units(), step);
  updated_elements_.resize(store_->num_units());
  for (int64_t u = 0; u < store_->num_units(); ++u) updated_elements_[u] = store_->state_elements(u);
}

void HostOptimizer::AddSlabPool(GradSlabPool* pool) { other_pools_.push_back(pool); }

void HostOptimizer::ReleaseSlab(float* slab) {
  for (GradSlabPool* p : other_pools_) {
    if (p->Holds(slab)) return p->Release(slab);
  }
  pool_->Release(slab);
}

void HostOptimizer::AddSpan(const Item& item, bool update,
                            std::chrono::steady_clock::time_point taken,
                            std::chrono::steady_clock::time_point ready) {
  if (!options_.record_spans) return;
  const auto end = std::chrono::steady_clock::now();
  MutexLock lock(&spans_mu_);
  spans_.push_back(OptimizerSpan{item.unit, item.offset, item.count, update, taken, ready, end});
}

std::vector<OptimizerSpan> HostOptimizer::TakeSpans() {
  MutexLock lock(&spans_mu_);
  std::vector<OptimizerSpan> out;
  out.swap(spans_);
  return out;
}

void HostOptimizer::BeginStep(double lr, int64_t step) {
  MutexLock lock(&mu_);
  if (updated_step_.empty()) RestoredLocked(step - 1);
  lr_ = lr;
  step_ = step;
  piece_squares_.clear();
}

void HostOptimizer::Submit(int64_t unit, float* slab, void* ready, int64_t offset,
                           int64_t count) {
  {
    MutexLock lock(&mu_);
    if (pending_.empty()) pending_.resize(store_->num_units());
    ++pending_[unit][step_];
    Item item;
    item.unit = unit;
    item.slab = slab;
    item.ready = ready;
    item.offset = offset;
    item.count = count;
    item.lr = lr_;
    item.step = step_;
    queue_.push_back(item);
    ++in_flight_;
    ++norms_pending_;
  }
  // The NVMe tier: the unit's moments are needed soon (a piece of its gradient is here),
  // and the next unit down is usually the next to land.
  if (MomentDisk* disk = store_->moment_disk(); disk != nullptr) {
    disk->Prefetch(unit);
    for (int64_t u = unit - 1; u >= 0; --u) {
      if (disk->Has(u)) {
        disk->Prefetch(u);
        break;
      }
    }
  }
}

// The worker: takes the next work under the lock, then does it without. Each stretch
// under the lock is a MutexLock scope of its own, also the last one of an iteration: Await
// releases the mutex without waking anyone, so it is that scope's Unlock() that wakes
// Drain(), Finish() and AwaitUnit() once an item is consumed.
void HostOptimizer::Loop() {
  // Near the GPU: the slabs and the store are bound to this node. Threads this one
  // creates (the OpenMP team) inherit the affinity.
  if (options_.numa_node >= 0 && numa_available() >= 0) numa_run_on_node(options_.numa_node);
  backend_->BindThread();  // it waits on that device's events
  // Without clipping the norm (reported only) comes from the update's own pass.
  const bool clipping = options_.max_grad_norm > 0;
  for (;;) {
    Work work = TakeWork(clipping);
    switch (work.kind) {
      case Work::kStop:
        return;
      case Work::kSquares:
        SumSquares(work.items);
        break;
      case Work::kApplyHeld:
        ApplyHeld(&work.items, work.item.coef);
        break;
      case Work::kPiece:
        Consume(work.item, clipping);
        break;
      case Work::kRequeued:
        break;
    }
  }
}

HostOptimizer::Work HostOptimizer::TakeWork(bool clipping) {
  Work work;
  MutexLock lock(&mu_);
  mu_.Await([this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || !queue_.empty(); });
  if (queue_.empty()) {
    work.kind = Work::kStop;
    return work;
  }
  if (squares_asked_) {  // Finish() waits for the norm: the queued pieces' squares first
    squares_asked_ = false;
    for (Item& q : queue_) {
      if (q.slab == nullptr || q.norm_counted) continue;
      q.norm_counted = true;
      work.items.push_back(q);
    }
    if (!work.items.empty()) {
      work.kind = Work::kSquares;
      return work;
    }
  }
  work.item = TakeNextLocked(clipping);
  if (work.item.slab == nullptr) {
    work.kind = Work::kApplyHeld;
    work.items.swap(held_);
  } else if (!clipping && !AwaitCapture(work.item, /*or_squares=*/true)) {
    // Finish() asked for the squares while this piece waited for a checkpoint's capture:
    // back in the queue, a leftover like the others, for the squares first.
    work.item.forward_order = true;
    queue_.push_back(work.item);
    work.kind = Work::kRequeued;
  } else {
    work.kind = Work::kPiece;
  }
  return work;
}

HostOptimizer::Item HostOptimizer::TakeNextLocked(bool clipping) {
  // One device without clipping: the lowest unit first (a unit's pieces by offset), the one
  // the next forward needs first: a backlog (the optimizer slower than the backward) leaves
  // the top of the stack, needed last, for the next forward to overlap, and the bottom
  // layers the next forward waits for go first.
  // Otherwise leftovers of a finished step first, in forward order; then backward order
  // (unit ids descending, a unit's pieces by offset), which is one pipeline's arrival
  // order. With several devices (sharded data parallelism) a fast device's shard of a unit
  // may arrive before a slow device's shard of an earlier unit: its copy waits on a
  // reduce-scatter the slow device enqueues only once it has a slab, which it gets back
  // only when its earlier shard is consumed. Taking the earlier unit first means the worker
  // only ever waits on work that every device has enqueued. (Clipping holds the updates
  // anyway; its norms are summed as they land.)
  const bool lowest_first = !clipping && other_pools_.empty();
  auto before = [lowest_first](const Item& a, const Item& b) {
    if (!lowest_first && a.forward_order != b.forward_order) return a.forward_order;
    if (lowest_first || a.forward_order) {
      return std::make_pair(a.unit, a.offset) < std::make_pair(b.unit, b.offset);
    }
    return a.unit != b.unit ? a.unit > b.unit : a.offset < b.offset;
  };
  auto pick = queue_.begin();
  for (auto it = queue_.begin(); it != queue_.end(); ++it) {
    if (before(*it, *pick)) pick = it;
  }
  const Item item = *pick;
  queue_.erase(pick);
  return item;
}

void HostOptimizer::SumSquares(const std::vector<Item>& pieces) {
  // On this thread's OpenMP team, not beside it on the caller's: two teams on the same
  // cores slow each other far more than one pass over the gradients costs.
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<double> ss(pieces.size());
  for (size_t i = 0; i < pieces.size(); ++i) {
    const auto taken = std::chrono::steady_clock::now();
    backend_->EventSync(pieces[i].ready);
    const auto ready = std::chrono::steady_clock::now();
    ss[i] = TrainableSquares(pieces[i]);
    AddSpan(pieces[i], /*update=*/false, taken, ready);
  }
  busy_ns_ += std::chrono::duration_cast<std::chrono::nanoseconds>(
                  std::chrono::steady_clock::now() - t0).count();
  MutexLock lock(&mu_);
  for (size_t i = 0; i < pieces.size(); ++i) {
    piece_squares_[{pieces[i].unit, pieces[i].offset}] += ss[i];
  }
  norms_pending_ -= static_cast<int64_t>(pieces.size());
}

void HostOptimizer::ApplyHeld(std::vector<Item>* held, float coef) {
  std::sort(held->begin(), held->end(), [](const Item& a, const Item& b) {
    return a.unit != b.unit ? a.unit < b.unit : a.offset < b.offset;
  });
  for (const Item& h : *held) {
    {
      MutexLock gate(&mu_);
      AwaitCapture(h);
    }
    const auto t0 = std::chrono::steady_clock::now();
    if (h.compact) {
      if (static_cast<int64_t>(held_scratch_.size()) < h.count) held_scratch_.resize(h.count);
      held_gradients_->Load(h.unit, h.offset - store_->state_begin(h.unit), h.count,
                            held_scratch_.data());
      Update(h, held_scratch_.data(), coef);
    } else {
      Update(h, h.slab, coef);
      ReleaseSlab(h.slab);
    }
    busy_ns_ += std::chrono::duration_cast<std::chrono::nanoseconds>(
                    std::chrono::steady_clock::now() - t0).count();
    AddSpan(h, /*update=*/true, t0, t0);
    MutexLock done(&mu_);
    PieceDone(h);
  }
  MutexLock lock(&mu_);
  --in_flight_;
}

void HostOptimizer::Consume(const Item& item, bool clipping) {
  const auto taken = std::chrono::steady_clock::now();
  backend_->EventSync(item.ready);
  const auto t0 = std::chrono::steady_clock::now();
  double ss = 0;
  Item held = item;
  if (clipping) {
    ss = TrainableSquares(item);
    if (held_gradients_ != nullptr) {  // kept in 16 bits: the slab goes back at once
      held_gradients_->Store(item.unit, item.offset - store_->state_begin(item.unit), item.count,
                             item.slab);
      ReleaseSlab(item.slab);
      held.compact = true;
    }
  } else {
    ss = Update(item, item.slab, 1.0f);
    ReleaseSlab(item.slab);
  }
  busy_ns_ += std::chrono::duration_cast<std::chrono::nanoseconds>(
                  std::chrono::steady_clock::now() - t0).count();
  AddSpan(item, /*update=*/!clipping, taken, t0);
  MutexLock lock(&mu_);
  if (!item.norm_counted) {
    piece_squares_[{item.unit, item.offset}] += ss;
    --norms_pending_;
  }
  if (clipping) {
    held_.push_back(held);
  } else {
    PieceDone(item);
  }
  --in_flight_;
}

double HostOptimizer::Finish() {
  if (options_.max_grad_norm <= 0) {
    // The pieces still queued are updated after this step's others, in forward order; the
    // worker sums their squares before it updates any (squares_asked_), so the norm is
    // known without waiting for their updates.
    {
      // A scope of its own: its Unlock() wakes the worker (Await below would not).
      MutexLock ask(&mu_);
      for (Item& q : queue_) {
        if (q.slab == nullptr || q.norm_counted) continue;
        q.forward_order = true;
        squares_asked_ = true;
      }
    }
    MutexLock lock(&mu_);
    mu_.Await([this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return norms_pending_ == 0;  // the ones being updated now
    });
    return std::sqrt(SumOfPieceSquares());
  }
  MutexLock lock(&mu_);
  mu_.Await([this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return in_flight_ == 0; });
  const double norm = std::sqrt(SumOfPieceSquares());
  if (options_.max_grad_norm > 0 && !held_.empty()) {
    Item apply;
    apply.coef = ClipCoefficient(norm, options_.max_grad_norm);
    apply.unit = -1;
    apply.forward_order = true;  // before any piece of the next step
    queue_.push_back(apply);
    ++in_flight_;
  }
  return norm;
}

double HostOptimizer::SumOfPieceSquares() const {
  double sum = 0;
  for (const auto& [piece, squares] : piece_squares_) sum += squares;
  return sum;
}

void HostOptimizer::AwaitUnit(int64_t unit) {
  MutexLock lock(&mu_);
  // Only earlier steps' pieces: in data parallelism a faster device may already have
  // handed over this step's piece of the unit that a slower one is about to upload.
  mu_.Await([&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return pending_.empty() || pending_[unit].empty() || pending_[unit].begin()->first >= step_;
  });
}

bool HostOptimizer::UnitUpdated(int64_t unit) {
  MutexLock lock(&mu_);
  return pending_.empty() || pending_[unit].empty();
}

void HostOptimizer::PieceDone(const Item& item) {
  const int64_t u = item.unit;
  if (--pending_[u][item.step] == 0) pending_[u].erase(item.step);
  if (updated_step_[u] != item.step) {
    updated_step_[u] = item.step;
    updated_elements_[u] = 0;
  }
  updated_elements_[u] += item.count;
  if (capture_step_ == item.step && updated_elements_[u] == store_->state_elements(u)) {
    capture_ready_(u);
  }
}

bool HostOptimizer::AwaitCapture(const Item& item, bool or_squares) {
  auto free = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return capture_step_ < 0 || item.step <= capture_step_ || captured_[item.unit];
  };
  if (free()) return true;
  const auto t0 = std::chrono::steady_clock::now();
  mu_.Await([&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return free() || (or_squares && squares_asked_);
  });
  capture_wait_ns_ += std::chrono::duration_cast<std::chrono::nanoseconds>(
                          std::chrono::steady_clock::now() - t0).count();
  return free();
}

void HostOptimizer::BeginCapture(int64_t step, std::function<void(int64_t unit)> ready) {
  MutexLock lock(&mu_);
  MT_CHECK_MSG(capture_step_ < 0, "a capture is already running");
  if (updated_step_.empty()) RestoredLocked(step_);
  MT_CHECK_MSG(step == step_ || step == step_ + 1,
               "capture of step %lld at step %lld: only the last or the next step",
               static_cast<long long>(step), static_cast<long long>(step_));
  const int64_t units = store_->num_units();
  capture_step_ = step;
  capture_ready_ = std::move(ready);
  captured_.assign(units, 0);
  // The next step updates backward (as gradients land), or forward with clipping.
  const bool forward = options_.max_grad_norm > 0;
  for (int64_t i = 0; i < units; ++i) {
    const int64_t u = forward ? i : units - 1 - i;
    // A unit without state (all frozen) never changes: its capture is ready at once.
    if (store_->state_elements(u) == 0 ||
        (updated_step_[u] == step && updated_elements_[u] == store_->state_elements(u))) {
      capture_ready_(u);
    }
  }
}

void HostOptimizer::Captured(int64_t unit) {
  MutexLock lock(&mu_);
  if (capture_step_ < 0) return;
  captured_[unit] = 1;
}

void HostOptimizer::EndCapture() {
  MutexLock lock(&mu_);
  capture_step_ = -1;
  capture_ready_ = nullptr;
}

void HostOptimizer::Drain() {
  MutexLock lock(&mu_);
  mu_.Await([this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return in_flight_ == 0; });
}

double HostOptimizer::TrainableSquares(const Item& item) const {
  const UnitLayout& layout = store_->layout().units[item.unit];
  if (layout.AllTrainable()) return SumOfSquares(item.slab, item.count);
  double sum = 0;
  for (const TensorSlot& t : layout.tensors) {
    const int64_t begin = std::max(t.offset, item.offset);
    const int64_t end = std::min(t.offset + t.num_elements, item.offset + item.count);
    if (!t.trainable || begin >= end) continue;
    sum += SumOfSquares(item.slab + (begin - item.offset), end - begin);
  }
  return sum;
}

double HostOptimizer::Update(const Item& item, const float* grad, float grad_scale) {
  const int64_t unit = item.unit;
  // The state range's elements, from its start: the piece and the tensors are moved there.
  const int64_t first = store_->state_begin(unit), elements = store_->state_elements(unit);
  const int64_t begin = item.offset - first, end = begin + item.count;
  float* master = store_->master(unit);
  uint16_t* bf16 = store_->has_bf16(unit) ? store_->weights(unit) + first : nullptr;
  const UnitLayout& layout = store_->layout().units[unit];
  // The unit's moments: in RAM, or in a buffer of the NVMe tier (written back once the
  // unit's last piece is updated).
  UnitMoments moments;
  MomentDisk* disk = store_->moments_on_disk(unit) ? store_->moment_disk() : nullptr;
  if (disk != nullptr) {
    absl::StatusOr<char*> block = disk->Acquire(unit);
    if (!block.ok()) {
      MutexLock lock(&mu_);
      if (status_.ok()) status_ = block.status();
      return 0.0;  // the job fails at the end of this step (status())
    }
    moments = store_->MomentsAt(unit, *block);
  } else {
    moments = store_->moments(unit);
  }
  struct WriteBack {
    MomentDisk* disk;
    int64_t unit, count, elements;
    ~WriteBack() {
      if (disk != nullptr) disk->Updated(unit, count, elements);
    }
  } write_back{disk, unit, item.count, elements};
  if (store_->moment_dtype() != MomentDType::kF32) {
    // Whole blocks of the piece at once: pieces start on block boundaries (grad_slab_pool.h).
    std::vector<ElementRange> tensors;
    tensors.reserve(layout.tensors.size());
    for (const TensorSlot& t : layout.tensors) {
      if (!t.trainable) continue;
      tensors.push_back(
          ElementRange{t.offset - first, t.offset - first + t.num_elements, t.weight_decay});
    }
    std::sort(tensors.begin(), tensors.end(),
              [](const ElementRange& a, const ElementRange& b) { return a.begin < b.begin; });
    double sum_squares = 0;
    AdamWUpdateQuantized(master, moments, bf16, grad, begin, end, elements, tensors, item.step,
                         item.lr, options_.weight_decay, grad_scale, options_.hyper,
                         MomentRoundingKey(unit, item.step), &sum_squares);
    return sum_squares;
  }
  // The piece [item.offset, item.offset + item.count) meets each tensor in one range; all
  // of them in one pass of the thread team.
  std::vector<ElementRange> ranges;
  ranges.reserve(layout.tensors.size());
  for (const TensorSlot& t : layout.tensors) {
    const int64_t b = std::max(t.offset - first, begin);
    const int64_t e = std::min(t.offset - first + t.num_elements, end);
    if (b < e && t.trainable) ranges.push_back(ElementRange{b, e, t.weight_decay});
  }
  double sum_squares = 0;
  AdamWUpdateRanges(master, static_cast<float*>(moments.m), static_cast<float*>(moments.v), bf16,
                    grad, begin, ranges, item.step, item.lr, options_.weight_decay,
                    grad_scale, options_.hyper, &sum_squares);
  return sum_squares;
}

}  // namespace megatrain
