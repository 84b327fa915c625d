// A GradSink that records every unit's gradient (tests only).
#pragma once

#include <cmath>
#include <vector>

#include "engine/common/backend.h"
#include "engine/pipeline/grad_sink.h"
#include "engine/store/grad_slab_pool.h"

namespace megatrain::testing {

class RecordingSink : public GradSink {
 public:
  RecordingSink(Backend* be, GradSlabPool* pool, int64_t num_units)
      : be_(be), pool_(pool), grads(num_units), order() {}
  void Submit(int64_t unit, float* slab, void* ready) override {
    be_->EventSync(ready);
    grads[unit].assign(slab, slab + pool_->slab_elements());
    order.push_back(unit);
    pool_->Release(slab);
  }
  double Finish() override {
    double ss = 0;
    for (const auto& g : grads) for (float x : g) ss += double(x) * x;
    return std::sqrt(ss);
  }

  Backend* be_;
  GradSlabPool* pool_;
  std::vector<std::vector<float>> grads;  // per unit (slab-sized; padding is zero)
  std::vector<int64_t> order;             // units in submission order
};

}  // namespace megatrain::testing
