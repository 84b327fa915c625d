// A GradSink that records every unit's gradient (tests only).
#pragma once

#include <algorithm>
#include <cmath>
#include <vector>

#include "engine/common/backend.h"
#include "engine/transfer/grad_sink.h"
#include "engine/store/grad_slab_pool.h"

namespace megatrain::testing {

class RecordingSink : public GradSink {
 public:
  RecordingSink(Backend* be, GradSlabPool* pool, int64_t num_units)
      : be_(be), pool_(pool), grads(num_units), order() {}
  void Submit(int64_t unit, float* slab, void* ready, int64_t offset, int64_t count) override {
    be_->EventSync(ready);
    std::vector<float>& g = grads[unit];
    if (static_cast<int64_t>(g.size()) < offset + count) g.resize(offset + count);
    std::copy(slab, slab + count, g.begin() + offset);
    if (offset == 0) order.push_back(unit);
    pool_->Release(slab);
  }
  double Finish() override {
    double ss = 0;
    for (const auto& g : grads) for (float x : g) ss += double(x) * x;
    return std::sqrt(ss);
  }

  Backend* be_;
  GradSlabPool* pool_;
  std::vector<std::vector<float>> grads;  // per unit (its elements; padding is zero)
  std::vector<int64_t> order;             // units in submission order
};

}  // namespace megatrain::testing
