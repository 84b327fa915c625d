#include "engine/pipeline/grad_reducer.h"

#include "engine/common/check.h"

namespace megatrain {

class GradReducer::Sink final : public GradSink {
 public:
  Sink(GradReducer* reducer, int r) : reducer_(reducer), r_(r) {}
  void Submit(int64_t unit, float* slab, void* ready, int64_t offset, int64_t count) override {
    reducer_->Submit(r_, unit, slab, ready, offset, count);
  }
  double Finish() override { return reducer_->Finish(r_); }
  void AwaitUnit(int64_t unit) override { reducer_->target_->AwaitUnit(unit); }

 private:
  GradReducer* reducer_;
  const int r_;
};

GradReducer::GradReducer(GradSink* target, std::vector<Backend*> backends,
                         std::vector<GradSlabPool*> pools, Mode mode)
    : target_(target), mode_(mode), backends_(std::move(backends)), pools_(std::move(pools)) {
  MT_CHECK(!backends_.empty() && backends_.size() == pools_.size());
  for (int r = 0; r < replicas(); ++r) sinks_.push_back(std::make_unique<Sink>(this, r));
  // Sharded, pieces go straight on from the replicas' threads: nothing to add.
  if (mode_ == Mode::kHostSum) worker_ = std::thread([this] { Loop(); });
}

GradSink* GradReducer::replica(int r) { return sinks_[r].get(); }

GradReducer::~GradReducer() {
  {
    MutexLock lock(&mu_);
    stop_ = true;
  }
  if (worker_.joinable()) worker_.join();
}

void GradReducer::Submit(int r, int64_t unit, float* slab, void* ready, int64_t offset,
                         int64_t count) {
  if (mode_ == Mode::kSharded) {  // a shard of the sum already
    target_->Submit(unit, slab, ready, offset, count);
    return;
  }
  MutexLock lock(&mu_);
  Piece& p = partial_[{unit, offset}];
  if (p.arrived == 0) {
    p.unit = unit;
    p.offset = offset;
    p.count = count;
    p.slabs.assign(replicas(), nullptr);
    p.ready.assign(replicas(), nullptr);
  }
  MT_CHECK_MSG(p.count == count && p.slabs[r] == nullptr,
               "replicas disagree on the pieces of a unit's gradient");
  p.slabs[r] = slab;
  p.ready[r] = ready;
  if (++p.arrived == replicas()) {
    complete_.push_back(std::move(p));
    partial_.erase({unit, offset});
  }
}

void GradReducer::Loop() {
  for (;;) {
    Piece p;
    {
      MutexLock lock(&mu_);
      mu_.Await([&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || !complete_.empty(); });
      if (complete_.empty()) return;  // stopping
      p = std::move(complete_.front());
      complete_.pop_front();
      ++adding_;
    }
    for (int r = 0; r < replicas(); ++r) {
      backends_[r]->BindThread();
      backends_[r]->EventSync(p.ready[r]);
    }
    float* sum = p.slabs[0];
    const int64_t n = p.count;
    for (int r = 1; r < replicas(); ++r) {
      const float* add = p.slabs[r];
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < n; ++i) sum[i] += add[i];
      pools_[r]->Release(p.slabs[r]);
    }
    target_->Submit(p.unit, sum, p.ready[0], p.offset, p.count);
    // A scope of its own: its Unlock() wakes Finish() (Await releases the mutex silently).
    MutexLock lock(&mu_);
    --adding_;
  }
}

double GradReducer::Finish(int r) {
  {
    MutexLock lock(&mu_);
    const int64_t round = round_;
    if (++finished_ < replicas()) {
      mu_.Await([&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return round_ != round; });
      return norm_;
    }
    // The last replica: every piece is complete (each replica submitted all of its own);
    // wait until the worker has handed every sum on.
    auto handed_on = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return complete_.empty() && adding_ == 0;
    };
    mu_.Await(handed_on);
    MT_CHECK_MSG(partial_.empty(), "a replica finished its step with pieces missing");
  }
  const double norm = target_->Finish();
  MutexLock lock(&mu_);
  norm_ = norm;
  finished_ = 0;
  ++round_;
  return norm;
}

}  // namespace megatrain
