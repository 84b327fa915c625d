// Data parallelism over one host copy of the state: N pipelines, one per device, each run
// its share of a step's micro-batches through the same layers (the weights they stream
// come from the one host store), and one optimizer (the target) updates every unit once.
// Two ways to meet there:
//
//   kHostSum   each pipeline drains its whole gradient into its own slabs; the reducer
//              adds the N pieces of each unit's gradient on the host and hands the sum
//              on. A piece (unit, offset) is complete when all N replicas submitted it; a
//              worker thread waits for the N copies (each on its own backend's event),
//              adds them into replica 0's slab (OpenMP, in replica order, so the sum is
//              deterministic), returns the others to their pools and submits the sum.
//              Replicas produce pieces in the same order, so the sums reach the target in
//              that order too. REQUIRES: replica 0's pool is the target's.
//   kSharded   the devices already reduce-scattered each gradient (PipelineOptions::
//              collective): every piece arrives once, from the replica owning that shard,
//              and goes straight to the target, which returns each slab to the pool it
//              came from (HostOptimizer::AddSlabPool). Nothing is added on the host.
//
// Finish() is a barrier: the last replica to call it waits for every piece to be handed
// on, then calls the target's Finish(), whose norm all N return. AwaitUnit goes to the
// target.
//
// Thread-safe: each replica's sink is used by that replica's thread; the target's Submit
// must be thread-safe in kSharded mode (HostOptimizer's is).
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "engine/common/backend.h"
#include "engine/common/mutex.h"
#include "engine/transfer/grad_sink.h"
#include "engine/store/grad_slab_pool.h"

namespace megatrain {

class GradReducer {
 public:
  enum class Mode { kHostSum, kSharded };
  GradReducer(GradSink* target, std::vector<Backend*> backends, std::vector<GradSlabPool*> pools,
              Mode mode = Mode::kHostSum);
  ~GradReducer();
  GradReducer(const GradReducer&) = delete;
  GradReducer& operator=(const GradReducer&) = delete;

  int replicas() const { return static_cast<int>(backends_.size()); }
  GradSink* replica(int r);

 private:
  class Sink;
  struct Piece {
    int64_t unit = 0, offset = 0, count = 0;
    std::vector<float*> slabs;
    std::vector<void*> ready;
    int arrived = 0;
  };
  void Submit(int r, int64_t unit, float* slab, void* ready, int64_t offset, int64_t count);
  double Finish(int r);
  void Loop();

  GradSink* target_;
  const Mode mode_;
  std::vector<Backend*> backends_;
  std::vector<GradSlabPool*> pools_;
  std::vector<std::unique_ptr<Sink>> sinks_;

  Mutex mu_;
  // By (unit, offset).
  std::map<std::pair<int64_t, int64_t>, Piece> partial_ ABSL_GUARDED_BY(mu_);
  std::deque<Piece> complete_ ABSL_GUARDED_BY(mu_);  // to add, in completion order
  int adding_ ABSL_GUARDED_BY(mu_) = 0;              // pieces the worker holds
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  int finished_ ABSL_GUARDED_BY(mu_) = 0;   // replicas in Finish() this round
  int64_t round_ ABSL_GUARDED_BY(mu_) = 0;  // completed Finish() rounds
  double norm_ ABSL_GUARDED_BY(mu_) = 0;    // of the last round
  std::thread worker_;  // kHostSum only
};

}  // namespace megatrain
