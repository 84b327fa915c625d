// The host optimizer: a worker thread that consumes gradients as they land in host
// memory and applies AdamW to the unit's fp32 master, m and v, writing the bf16 copy the
// next step streams.
//
// Without clipping a unit is updated as soon as its gradient lands, overlapping the rest
// of the backward pass; Finish() returns the norm without waiting for the updates, and
// the updates still queued then run in forward order, so the next step's forward starts
// as soon as the embedding and its first layers are updated. With one device the worker
// always takes the lowest unit queued (forward order throughout: see TakeNextLocked()).
// (The norm adds the pieces' sums of squares in (unit, offset) order, whichever thread
// summed each: the same bits whatever the order they were read in.)
// With global-norm clipping every gradient must be seen first: the norm accumulates as
// they land, they wait in their slabs (or, compact_held, in 16 bits: HeldGradients), and
// after Finish() the worker applies the updates
// in forward order while the next step's forward runs: the pipeline waits (AwaitUnit)
// only for the unit it is about to upload. Weight decay applies to matrices only, and
// frozen tensors are left as they are, their gradients in no norm (TensorSlot).
//
// Thread-safe. Submit() is called from the pipeline thread, or from every replica's thread
// in sharded data parallelism (pipeline/grad_reducer.h); Finish() from one thread.
#pragma once

#include <atomic>
#include <chrono>
#include <deque>
#include <functional>
#include <map>
#include <utility>
#include <thread>
#include <vector>

#include "engine/common/backend.h"
#include "engine/common/mutex.h"
#include "engine/optim/adamw.h"
#include "engine/optim/held_gradients.h"
#include "engine/transfer/grad_sink.h"
#include "engine/store/grad_slab_pool.h"
#include "engine/store/host_store.h"

namespace megatrain {

struct HostOptimizerOptions {
  AdamWHyper hyper;
  double weight_decay = 0.0;
  double max_grad_norm = 0.0;  // <= 0: no clipping
  // Clipping: the gradients waiting for the norm are kept in 16 bits (held_gradients.h) and
  // their slabs returned at once, so the slabs cycle as without clipping; else they wait
  // in their fp32 slabs (every piece of the step needs one).
  bool compact_held = false;
  int numa_node = -1;          // run the optimizer (and its OpenMP team) on this node's cores
  // Keep a span per piece of work (TakeSpans): for benchmarks' timelines. Costs a little.
  bool record_spans = false;
};

// One piece of the worker's work, on the host's steady clock: AdamW of a unit's gradient
// piece (with clipping: its sum of squares as it lands, then its update once the norm is
// known). Between `taken` and `ready` the worker waited for the piece's copy to land.
struct OptimizerSpan {
  int64_t unit = 0;
  int64_t offset = 0;  // the piece's first element in its unit
  int64_t count = 0;   // its elements
  bool update = true;  // AdamW (false: the sum of squares alone)
  std::chrono::steady_clock::time_point taken, ready, end;
};

class HostOptimizer final : public GradSink {
 public:
  HostOptimizer(HostStore* store, GradSlabPool* pool, Backend* backend,
                const HostOptimizerOptions& options);
  ~HostOptimizer() override;

  // The store holds the state after `step` (0: initial weights; or a loaded checkpoint's).
  // Without it, the step before the first BeginStep() is taken.
  void Restored(int64_t step);
  // Sets the learning rate and 1-based step count for the next step's updates.
  void BeginStep(double lr, int64_t step);
  // Slabs may also come from `pool` (another device's, in sharded data parallelism);
  // each is returned to the pool that holds it. Before the first Submit().
  void AddSlabPool(GradSlabPool* pool);
  void Submit(int64_t unit, float* slab, void* ready, int64_t offset, int64_t count) override;
  double Finish() override;
  void AwaitUnit(int64_t unit) override;
  bool UnitUpdated(int64_t unit) override;
  // Blocks until every update is applied (before reading the store: checkpoints).
  void Drain();
  // Capture, for checkpoints written while training runs: BeginCapture(step) takes the
  // state after `step`, which is the step last finished (call it after Finish()) or the
  // next one (call it before its BeginStep(): the capture then starts as that step's
  // backward updates the top layers). `ready(unit)` is called once per unit as soon as
  // that step's update of the unit is in the store (at once for the units already
  // updated, the ones the next step updates first first), on this thread or the
  // optimizer's, with the optimizer's lock held: it must only hand the unit on. The
  // unit's next update waits until Captured(unit). EndCapture() lifts every wait (the
  // capture is finished or abandoned).
  void BeginCapture(int64_t step, std::function<void(int64_t unit)> ready);
  void Captured(int64_t unit);
  void EndCapture();
  // Seconds updates have waited for captures, since creation.
  double capture_wait_seconds() const {
    return capture_wait_ns_.load(std::memory_order_relaxed) / 1e9;
  }
  // OK, or the first error of the NVMe tier (its moments could not be read): the updates
  // of the unit it hit were skipped, so the step must fail.
  absl::Status status() const {
    MutexLock lock(&mu_);
    return status_;
  }
  // Seconds the optimizer thread has spent on gradients (norms and AdamW) since creation.
  double busy_seconds() const { return busy_ns_.load(std::memory_order_relaxed) / 1e9; }
  // The spans finished since the last call, in the order they finished (empty unless
  // HostOptimizerOptions::record_spans).
  std::vector<OptimizerSpan> TakeSpans();

 private:
  struct Item {
    int64_t unit = 0;
    float* slab = nullptr;  // null: apply the held updates (clipping), scaled by coef
    bool compact = false;   // held in held_gradients_, its slab returned
    int64_t offset = 0;     // the piece of the unit the slab holds
    int64_t count = 0;
    bool norm_counted = false;   // its squares summed apart from its update (at Finish())
    bool forward_order = false;  // left over at Finish(): updated before newer items,
                                 // lowest unit first, as the next forward needs them
    void* ready = nullptr;
    double lr = 0;
    int64_t step = 0;
    float coef = 1.0f;
  };
  // What the worker does next (TakeWork).
  struct Work {
    enum Kind {
      kStop,       // stop_ and nothing queued
      kSquares,    // items: queued pieces whose squares Finish() waits for
      kApplyHeld,  // clipping: items (the held pieces) updated, scaled by item.coef
      kPiece,      // item: a landed piece, updated (or, clipping, its squares summed)
      kRequeued,   // a piece put back (Finish() asked for squares while it waited)
    };
    Kind kind = kStop;
    Item item;
    std::vector<Item> items;
  };
  // The worker thread: TakeWork(), then the work, until kStop.
  void Loop();
  // Blocks until there is work (or stop_); takes it off the queue.
  Work TakeWork(bool clipping) ABSL_LOCKS_EXCLUDED(mu_);
  // Removes and returns the queued item due first (the order: see the .cc).
  Item TakeNextLocked(bool clipping) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The pieces' sums of squares, into piece_squares_ (Finish() waits for them).
  void SumSquares(const std::vector<Item>& pieces) ABSL_LOCKS_EXCLUDED(mu_);
  // Clipping: AdamW of the held pieces in forward order, gradients scaled by coef.
  void ApplyHeld(std::vector<Item>* held, float coef) ABSL_LOCKS_EXCLUDED(mu_);
  // A landed piece: updated, or with clipping its squares summed and the piece held.
  void Consume(const Item& item, bool clipping) ABSL_LOCKS_EXCLUDED(mu_);
  // Applies AdamW to the item's piece of its unit, but for its frozen tensors
  // (TensorSlot::trainable); returns the sum of squares of the rest of the piece's gradient.
  double Update(const Item& item, const float* grad, float grad_scale);
  // The sum of squares of the item's gradient over its unit's trainable tensors (the whole
  // piece in one pass when none is frozen).
  double TrainableSquares(const Item& item) const;
  // Blocks while the item's unit must first be captured; with or_squares, returns false
  // instead once Finish() asks for the queued pieces' squares (the item is not updated yet).
  bool AwaitCapture(const Item& item, bool or_squares = false) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RestoredLocked(int64_t step) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The item's piece of its unit is updated.
  void PieceDone(const Item& item) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The step's sum of squares so far, piece by piece in (unit, offset) order.
  double SumOfPieceSquares() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Returns a consumed slab to the pool it came from.
  void ReleaseSlab(float* slab);
  // Adds a span of `item`'s piece, ended now, when spans are recorded.
  void AddSpan(const Item& item, bool update, std::chrono::steady_clock::time_point taken,
               std::chrono::steady_clock::time_point ready) ABSL_LOCKS_EXCLUDED(mu_);

  HostStore* store_;
  GradSlabPool* pool_;
  std::vector<GradSlabPool*> other_pools_;  // AddSlabPool (before the first Submit)
  Backend* backend_;
  HostOptimizerOptions options_;

  mutable Mutex mu_;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  double lr_ ABSL_GUARDED_BY(mu_) = 0.0;
  int64_t step_ ABSL_GUARDED_BY(mu_) = 0;
  std::deque<Item> queue_ ABSL_GUARDED_BY(mu_);
  int64_t in_flight_ ABSL_GUARDED_BY(mu_) = 0;  // submitted, not yet consumed by the worker
  // Per unit, step: pieces owed an update.
  std::vector<std::map<int64_t, int64_t>> pending_ ABSL_GUARDED_BY(mu_);
  // This step's gradient sums of squares by piece (unit, offset), added in that order
  // (SumOfPieceSquares): the norm's bits do not depend on the order pieces were read in.
  std::map<std::pair<int64_t, int64_t>, double> piece_squares_ ABSL_GUARDED_BY(mu_);
  // Submitted pieces whose squares are not yet summed.
  int64_t norms_pending_ ABSL_GUARDED_BY(mu_) = 0;
  // Finish() waits for the norm: the worker sums the squares of the pieces queued, before
  // any update.
  bool squares_asked_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<Item> held_ ABSL_GUARDED_BY(mu_);  // clipping: waiting for the norm
  // compact_held: their 16-bit values, and the fp32 piece an update reads them back into
  // (the worker thread's alone).
  std::unique_ptr<HeldGradients> held_gradients_;
  std::vector<float> held_scratch_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  // Per unit: the last step whose pieces have begun to land in the store, and how many of
  // its elements have (the unit is at that step when all have). Set at the first
  // BeginStep(): before it the store holds a finished step (loaded or initial).
  std::vector<int64_t> updated_step_ ABSL_GUARDED_BY(mu_);
  std::vector<int64_t> updated_elements_ ABSL_GUARDED_BY(mu_);
  // Capture (BeginCapture): the step captured (-1: none), whether each unit is captured.
  int64_t capture_step_ ABSL_GUARDED_BY(mu_) = -1;
  std::function<void(int64_t)> capture_ready_ ABSL_GUARDED_BY(mu_);
  std::vector<char> captured_ ABSL_GUARDED_BY(mu_);
  std::atomic<int64_t> capture_wait_ns_{0};
  std::atomic<int64_t> busy_ns_{0};
  Mutex spans_mu_;  // apart from mu_: the worker adds a span holding nothing else
  std::vector<OptimizerSpan> spans_ ABSL_GUARDED_BY(spans_mu_);
  std::thread worker_;
};

}  // namespace megatrain
