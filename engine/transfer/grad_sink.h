// Where the gradient drain (transfer/) hands each unit's finished gradient: the host
// optimizer in training, a recorder in tests. It sits in transfer/, which calls it, so the
// includes point down the diagram: pipeline/ and optim/ include transfer/, never back.
#pragma once

#include <cstdint>

namespace megatrain {

class GradSink {
 public:
  virtual ~GradSink() = default;
  // Called on the pipeline's host thread, in the order gradients complete (backward
  // order). `slab` holds elements [offset, offset + count) of the unit's gradient (f32):
  // a unit larger than a slab (an embedding, an lm_head) arrives in pieces, in order.
  // The slab is valid once `ready` (a backend event) has completed; the sink owns it until
  // it returns it to the pool.
  virtual void Submit(int64_t unit, float* slab, void* ready, int64_t offset, int64_t count) = 0;
  // Blocks until every submitted gradient has been read (not necessarily applied).
  // Returns the global L2 norm of the step's gradient (before clipping).
  virtual double Finish() = 0;
  // Blocks until `unit`'s host weights are final for the next step (its pending update,
  // if any, is applied). The pipeline calls it before uploading the unit, so the next
  // step's forward waits only for the layers it needs.
  virtual void AwaitUnit(int64_t unit) {}
  // Without blocking: true when every piece of `unit` submitted so far has been applied,
  // so that its host weights are final for the next step. The pipeline asks after it has
  // submitted the unit's whole gradient, and uploads the unit early when so. A sink that
  // cannot tell (one replica's view of a shared update) says false.
  virtual bool UnitUpdated(int64_t unit) { return false; }
};

}  // namespace megatrain
