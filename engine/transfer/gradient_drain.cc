#include "engine/transfer/gradient_drain.h"

#include <algorithm>
#include <string>

namespace megatrain {

GradientDrain::GradientDrain(Backend* backend, HostStore* store, GradSlabPool* slabs,
                             GradCollective* collective, SpanRecorder* spans)
    : backend_(backend), store_(store), slabs_(slabs), collective_(collective), spans_(spans) {}

void GradientDrain::CreateEvents(int64_t num_units) {
  for (int64_t u = 0; u < num_units; ++u) unit_done_.emplace_back(backend_);
  for (int64_t i = 0; i < slabs_->num_slabs(); ++i) slab_ready_.emplace_back(backend_);
}

void GradientDrain::Drain(int64_t unit, void* device_grad, void* done_event, void* free_event,
                          GradSink* sink) {
  backend_->StreamWait(StreamId::kD2H, done_event);
  // The unit's state range alone: frozen tensors outside it have no gradient to drain.
  const int64_t first = store_->state_begin(unit), n = store_->state_elements(unit);
  const int64_t piece = slabs_->slab_elements();
  int64_t begin = first, end = first + n;  // what this pipeline drains
  if (collective_ != nullptr && n > 0) {
    const int64_t shard = GradShardElements(n, collective_->size());
    // On the D2H stream, ahead of the copies; not a span: the stream's busy time stands
    // for PCIe, and this waits for the other devices. (The gradient buffer, the state
    // range's, has room for every rank's shard: step_memory.cc.)
    collective_->ReduceScatter(device_grad, shard, StreamId::kD2H);
    begin = first + std::min(n, collective_->rank() * shard);
    end = first + std::min(n, begin - first + shard);
  }
  const int span = spans_->Begin(StreamId::kD2H, "d2h g " + std::to_string(unit));
  for (int64_t offset = begin; offset < end; offset += piece) {
    const int64_t count = std::min(piece, end - offset);
    float* slab = slabs_->Acquire();  // returned by the sink once it has read the piece
    Event& ready = slab_ready_[slabs_->IndexOf(slab)];
    backend_->DownloadGrads(slab, Offset(device_grad, offset - first, backend_->grad_dtype()),
                            count, StreamId::kD2H);
    backend_->Record(ready.get(), StreamId::kD2H);
    sink->Submit(unit, slab, ready.get(), offset, count);
  }
  d2h_bytes_ += 4 * (end - begin);
  spans_->End(span);
  if (free_event != nullptr) backend_->Record(free_event, StreamId::kD2H);
  backend_->Record(unit_done_[unit].get(), StreamId::kD2H);
}

}  // namespace megatrain
