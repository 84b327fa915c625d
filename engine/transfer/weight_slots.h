// Device weight slots and the H2D uploads into them: a decoder layer's bf16 weights go up
// from the host store into slot (layer mod S) on the H2D stream, once the slot's last use
// is done; compute waits for the upload. A slot that still holds the layer it needs is
// not uploaded again, and one that holds an older version of it gets only the part the
// optimizer changes (its unit's state range: a LoRA layer's adapters, not its frozen base;
// a layer with no state is never uploaded twice). With a slot per layer (S >= L), a
// layer's next weights go up during the backward as soon as the optimizer has applied its
// update (UploadUpdated), and the next forward finds them loaded.
//
// Thread-compatible: the pipeline's thread drives it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "engine/common/backend.h"
#include "engine/model/layout.h"
#include "engine/transfer/grad_sink.h"
#include "engine/store/host_store.h"
#include "engine/transfer/timeline.h"

namespace megatrain {

// Uploads a unit's weights into `slot` on stream s: the store's bf16 weights, or its fp32
// master rounded on the device when it keeps none (the same bits). `state_only`: its state
// range alone (what the optimizer changes). Returns the bytes that cross PCIe.
int64_t UploadUnitWeights(Backend* backend, const HostStore& store, int64_t unit, void* slot,
                          StreamId s, bool state_only = false);

class WeightSlots {
 public:
  // `num_slots` slots for the decoder layers of `layout`, loaded from `store`.
  WeightSlots(Backend* backend, HostStore* store, const ModelLayout& layout, int64_t num_slots,
              SpanRecorder* spans);

  [[nodiscard]] absl::Status Allocate(DeviceAllocator* alloc);

  // A new step whose updates `sink` applies: the optimizer changed every layer, so every
  // slot is stale but those uploaded afresh during the last step's backward.
  void BeginStep(GradSink* sink);
  // A forward-only pass (evaluation) between steps, over the weights the host holds now:
  // the slots of layers the last step's update left stale are, and what the pass uploads
  // stays loaded for the next step (nothing changes the weights in between).
  // REQUIRES: every update applied (HostOptimizer::Drain).
  void BeginForwardOnly();
  // Every slot forgotten: the host's weights changed outside a step (generation after
  // training), so nothing on the device is current.
  void Forget();
  // Uploads `layer` into its slot unless it holds it (after its pending update).
  void EnsureLoaded(int64_t layer);
  // Slot per layer only: uploads each layer from the top down to `lowest` (their backward
  // is done) whose update the sink has applied and that is not uploaded yet. (Updates may
  // land in any order: with one device the optimizer takes the lowest layer queued.)
  void UploadUpdated(int64_t lowest);
  // The slot of `layer` for compute, which waits for its upload. REQUIRES: loaded.
  void* Use(int64_t layer);
  // Compute is done with the slot of `layer`.
  void Release(int64_t layer);

  int64_t num_slots() const { return num_slots_; }
  int64_t early_uploads() const {  // this step's
    return std::count(fresh_.begin(), fresh_.end(), 1);
  }
  int64_t h2d_bytes() const { return h2d_bytes_; }                     // this step's

 private:
  void Upload(int64_t layer, const char* label);
  // Marks stale the slots whose layer the last step updated after uploading it.
  void DropStale();

  Backend* backend_;
  HostStore* store_;
  const ModelLayout& layout_;
  int64_t num_slots_;
  int64_t num_layers_;
  SpanRecorder* spans_;
  GradSink* sink_ = nullptr;  // of the step in progress; null in a forward-only pass
  std::vector<DeviceBuffer> slots_;  // S x the largest layer, weight dtype
  std::vector<int64_t> slot_layer_;  // layer in each slot, -1 = none
  std::vector<char> slot_stale_;     // its state range is older than the host's
  // Per layer: its slot holds its next-step weights (uploaded during this step's backward).
  std::vector<char> fresh_;
  std::vector<Event> slot_loaded_, slot_free_;
  int64_t h2d_bytes_ = 0;
};

}  // namespace megatrain
