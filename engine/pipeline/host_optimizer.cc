#include "engine/pipeline/host_optimizer.h"

#include <algorithm>
#include <cmath>

#include "engine/optim/clip.h"

namespace megatrain {

HostOptimizer::HostOptimizer(HostStore* store, GradSlabPool* pool, Backend* backend,
                             const HostOptimizerOptions& options)
    : store_(store), pool_(pool), backend_(backend), options_(options),
      worker_([this] { Loop(); }) {}

HostOptimizer::~HostOptimizer() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  worker_.join();
}

void HostOptimizer::BeginStep(double lr, int64_t step) {
  std::lock_guard<std::mutex> lock(mu_);
  lr_ = lr;
  step_ = step;
  sum_squares_ = 0;
}

void HostOptimizer::Submit(int64_t unit, float* slab, void* ready) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(Item{unit, slab, ready});
    ++in_flight_;
  }
  cv_.notify_all();
}

void HostOptimizer::Loop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;
    Item item = queue_.front();
    queue_.pop_front();
    lock.unlock();
    backend_->EventSync(item.ready);
    const double ss = SumOfSquares(item.slab, store_->unit_elements(item.unit));
    const bool clipping = options_.max_grad_norm > 0;
    if (!clipping) {
      Update(item.unit, item.slab, 1.0f);
      pool_->Release(item.slab);
    }
    lock.lock();
    sum_squares_ += ss;
    if (clipping) held_.push_back(item);
    --in_flight_;
    cv_.notify_all();
  }
}

double HostOptimizer::Finish() {
  std::vector<Item> held;
  double norm;
  {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return in_flight_ == 0; });
    held.swap(held_);
    norm = std::sqrt(sum_squares_);
  }
  if (options_.max_grad_norm > 0) {
    const float coef = ClipCoefficient(norm, options_.max_grad_norm);
    std::sort(held.begin(), held.end(),
              [](const Item& a, const Item& b) { return a.unit < b.unit; });
    for (const Item& item : held) {
      Update(item.unit, item.slab, coef);
      pool_->Release(item.slab);
    }
  }
  return norm;
}

void HostOptimizer::Update(int64_t unit, const float* grad, float grad_scale) {
  float* master = store_->master(unit);
  float* m = store_->exp_avg(unit);
  float* v = store_->exp_avg_sq(unit);
  uint16_t* bf16 = store_->weights(unit);
  for (const TensorSlot& t : store_->layout().units[unit].tensors) {
    const int64_t o = t.offset;
    AdamWUpdate(master + o, m + o, v + o, bf16 + o, grad + o, t.num_elements, step_, lr_,
                t.weight_decay ? options_.weight_decay : 0.0, grad_scale, options_.hyper);
  }
}

}  // namespace megatrain
