// The D2H gradient drain: a unit's finished gradient goes from its device buffer into
// pinned host slabs on the D2H stream, in slab-sized pieces (so that the host holds a few
// slabs of a layer's size whatever the vocabulary), each handed to the GradSink as it is
// enqueued with the event that says it has landed. In data parallelism with the
// reduction on the devices, the gradient is first reduce-scattered across the group on
// the same stream, and only this rank's shard drains.
//
// Thread-compatible: the pipeline's thread drives it.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "engine/common/backend.h"
#include "engine/common/collective.h"
#include "engine/transfer/grad_sink.h"
#include "engine/store/grad_slab_pool.h"
#include "engine/store/host_store.h"
#include "engine/transfer/timeline.h"

namespace megatrain {

class GradientDrain {
 public:
  // `store` and `slabs` may be null when nothing drains (a pipeline only counted);
  // `collective` null: the whole gradient drains.
  GradientDrain(Backend* backend, HostStore* store, GradSlabPool* slabs,
                GradCollective* collective, SpanRecorder* spans);

  // The events: one per unit (its gradient is on the host) and one per slab.
  void CreateEvents(int64_t num_units);

  void BeginStep() { d2h_bytes_ = 0; }
  // After `done_event` (the gradient is complete), drains unit's gradient from
  // `device_grad` (its state range's, from the range's start) and hands its pieces to
  // `sink` (offsets in the unit); records `free_event` (may be null) when
  // the buffer may be written again, and the unit's own event.
  void Drain(int64_t unit, void* device_grad, void* done_event, void* free_event,
             GradSink* sink);
  // Blocks until unit's gradient is on the host.
  void WaitFor(int64_t unit) { backend_->EventSync(unit_done_[unit].get()); }

  int64_t d2h_bytes() const { return d2h_bytes_; }  // this step's

 private:
  Backend* backend_;
  HostStore* store_;
  GradSlabPool* slabs_;
  GradCollective* collective_;
  SpanRecorder* spans_;
  std::vector<Event> unit_done_;   // per unit: its gradient is on the host
  std::vector<Event> slab_ready_;  // per gradient slab: its piece is on the host
  int64_t d2h_bytes_ = 0;
};

}  // namespace megatrain
