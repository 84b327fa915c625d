// A GradSink that applies plain SGD to the host store (tests only): when the gradient
// arrives, or only when the pipeline waits for the unit, as a lagging optimizer would.
#pragma once

#include <algorithm>
#include <vector>

#include "engine/common/dtype.h"
#include "engine/store/host_store.h"
#include "tests/engine/pipeline/recording_sink.h"

namespace megatrain::testing {

// at_submit: the unit's next weights are final as soon as its gradient is submitted.
class SgdSink : public RecordingSink {
 public:
  SgdSink(Backend* be, GradSlabPool* pool, HostStore* store, bool at_submit)
      : RecordingSink(be, pool, store->num_units()), store_(store), at_submit_(at_submit) {}
  void Submit(int64_t unit, float* slab, void* ready, int64_t offset, int64_t count) override {
    RecordingSink::Submit(unit, slab, ready, offset, count);
    pending_.push_back(
        Piece{unit, offset, std::vector<float>(grads[unit].begin() + offset,
                                               grads[unit].begin() + offset + count)});
    if (at_submit_) AwaitUnit(unit);
  }
  void AwaitUnit(int64_t unit) override {
    for (auto it = pending_.begin(); it != pending_.end();) {
      if (it->unit != unit) {
        ++it;
        continue;
      }
      float* master = store_->master(unit) - store_->state_begin(unit);  // unit offsets
      uint16_t* weights = store_->weights(unit);
      for (size_t i = 0; i < it->grad.size(); ++i) {
        master[it->offset + i] -= 0.05f * it->grad[i];
        weights[it->offset + i] = FloatToBf16(master[it->offset + i]);
      }
      it = pending_.erase(it);
    }
  }
  bool UnitUpdated(int64_t unit) override {
    return std::none_of(pending_.begin(), pending_.end(),
                        [&](const Piece& p) { return p.unit == unit; });
  }

 private:
  struct Piece {
    int64_t unit, offset;
    std::vector<float> grad;
  };
  HostStore* store_;
  bool at_submit_;
  std::vector<Piece> pending_;
};

}  // namespace megatrain::testing
