#include "engine/transfer/weight_slots.h"

#include <algorithm>
#include <string>

#include "engine/common/check.h"
#include "engine/common/status.h"

namespace megatrain {

WeightSlots::WeightSlots(Backend* backend, HostStore* store, const ModelLayout& layout,
                         int64_t num_slots, SpanRecorder* spans)
    : backend_(backend),
      store_(store),
      layout_(layout),
      num_slots_(num_slots),
      num_layers_(layout.num_layers),
      spans_(spans),
      fresh_(layout.num_layers, 0) {}

absl::Status WeightSlots::Allocate(DeviceAllocator* alloc) {
  const int64_t slot_bytes = layout_.MaxDecoderElements() * DTypeSize(backend_->weight_dtype());
  slots_.resize(num_slots_);
  for (int64_t s = 0; s < num_slots_; ++s) {
    RETURN_IF_ERROR(alloc->Allocate(&slots_[s], slot_bytes, "a weight slot"));
    slot_loaded_.emplace_back(backend_);
    slot_free_.emplace_back(backend_);
  }
  slot_layer_.assign(num_slots_, -1);
  slot_stale_.assign(num_slots_, 0);
  return absl::OkStatus();
}

void WeightSlots::BeginStep(GradSink* sink) {
  sink_ = sink;
  DropStale();
  fresh_.assign(num_layers_, 0);
  h2d_bytes_ = 0;
}

void WeightSlots::DropStale() {
  for (int64_t s = 0; s < num_slots_; ++s) {
    const int64_t layer = slot_layer_[s];
    if (layer < 0 || fresh_[layer]) continue;
    slot_stale_[s] = store_->state_elements(layout_.DecoderUnit(layer)) > 0;  // else frozen
  }
}

void WeightSlots::Forget() {
  slot_layer_.assign(num_slots_, -1);
  slot_stale_.assign(num_slots_, 0);
  fresh_.assign(num_layers_, 0);
}

void WeightSlots::BeginForwardOnly() {
  sink_ = nullptr;
  DropStale();
  h2d_bytes_ = 0;
}

int64_t UploadUnitWeights(Backend* backend, const HostStore& store, int64_t unit, void* slot,
                          StreamId s, bool state_only) {
  const int64_t n = store.unit_elements(unit);
  if (store.has_bf16(unit)) {
    const int64_t begin = state_only ? store.state_begin(unit) : 0;
    const int64_t count = state_only ? store.state_elements(unit) : n;
    backend->UploadWeights(Offset(slot, begin, backend->weight_dtype()),
                           store.weights(unit) + begin, count, s);
    return 2 * count;
  }
  // No bf16 weights: the state is the whole unit (HostStore), which goes up whole.
  backend->UploadWeightsFromF32(slot, store.master(unit), n, s);
  return 4 * n;
}

void WeightSlots::EnsureLoaded(int64_t layer) {
  const int64_t s = layer % num_slots_;
  if (slot_layer_[s] == layer && !slot_stale_[s]) return;
  if (sink_ == nullptr) {  // forward only: these are the next step's weights too
    Upload(layer, "h2d eval w ");
    fresh_[layer] = 1;
    return;
  }
  sink_->AwaitUnit(layout_.DecoderUnit(layer));  // its pending update is applied
  Upload(layer, "h2d w ");
}

void WeightSlots::Upload(int64_t layer, const char* label) {
  const int64_t s = layer % num_slots_, unit = layout_.DecoderUnit(layer);
  backend_->StreamWait(StreamId::kH2D, slot_free_[s].get());  // the slot's last use is done
  const int span = spans_->Begin(StreamId::kH2D, label + std::to_string(layer));
  const bool state_only = slot_layer_[s] == layer;  // an older version of it: what changed
  h2d_bytes_ +=
      UploadUnitWeights(backend_, *store_, unit, slots_[s].get(), StreamId::kH2D, state_only);
  spans_->End(span);
  backend_->Record(slot_loaded_[s].get(), StreamId::kH2D);
  slot_layer_[s] = layer;
  slot_stale_[s] = 0;
}

void WeightSlots::UploadUpdated(int64_t lowest) {
  if (num_slots_ < num_layers_) return;  // slots are reused: none of its own
  for (int64_t layer = num_layers_ - 1; layer >= std::max<int64_t>(lowest, 0); --layer) {
    if (fresh_[layer] || !sink_->UnitUpdated(layout_.DecoderUnit(layer))) continue;
    if (store_->state_elements(layout_.DecoderUnit(layer)) == 0 && slot_layer_[layer] == layer) {
      continue;  // frozen: its slot is current for good
    }
    Upload(layer, "h2d next w ");  // into its own slot, once its backward is done
    fresh_[layer] = 1;
  }
}

void* WeightSlots::Use(int64_t layer) {
  const int64_t s = layer % num_slots_;
  MT_CHECK(slot_layer_[s] == layer);
  backend_->StreamWait(StreamId::kCompute, slot_loaded_[s].get());
  return slots_[s].get();
}

void WeightSlots::Release(int64_t layer) {
  backend_->Record(slot_free_[layer % num_slots_].get(), StreamId::kCompute);
}

}  // namespace megatrain
