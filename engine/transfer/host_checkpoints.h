// Layer-input checkpoints in pinned host memory (PipelineOptions::checkpoints_on_host):
// the device working set no longer grows with depth. The forward copies the input of
// every K-th layer (all micro-batches) to the host on the D2H stream as soon as it is
// computed; the backward copies a segment's checkpoint back into one of two device
// staging buffers on the H2D stream, ahead of the segment that needs it.
//
// Thread-compatible: the pipeline's thread drives it.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "engine/common/backend.h"
#include "engine/store/host_store.h"
#include "engine/transfer/timeline.h"

namespace megatrain {

class HostCheckpoints {
 public:
  // Checkpoints of every `checkpoint_every`-th input of `num_layers` layers, each
  // `checkpoint_bytes` (every micro-batch's (n, C) activations), `micro_batch_bytes` a
  // micro-batch's share.
  HostCheckpoints(Backend* backend, int64_t checkpoint_every, int64_t num_layers,
                  int64_t checkpoint_bytes, int64_t micro_batch_bytes, SpanRecorder* spans);
  ~HostCheckpoints();
  HostCheckpoints(const HostCheckpoints&) = delete;
  HostCheckpoints& operator=(const HostCheckpoints&) = delete;

  // The pinned host arena and the two device staging buffers (counted only: the staging).
  [[nodiscard]] absl::Status Allocate(DeviceAllocator* alloc);

  void BeginStep();
  // Forward: x_layer, complete in `activations` (a forward buffer, at forward parity
  // layer % 2), goes to the host when layer is a checkpoint (a multiple of K below L).
  void Save(int64_t layer, const DeviceBuffer& activations);
  // Recorded on D2H when the copy out of the forward buffer of parity `parity` is done:
  // the forward waits for it before overwriting that buffer.
  void* saved_event(int64_t parity) const { return saved_[parity].get(); }

  // Backward: checkpoint c into its staging buffer (c < 0 or already there: nothing).
  void Load(int64_t c);
  // Micro-batch m of checkpoint c in its staging buffer. REQUIRES: Load(c).
  void* Input(int64_t c, int64_t m) const;
  // Recorded on H2D when checkpoint c has landed; compute waits for it.
  void* loaded_event(int64_t c) const { return loaded_[Staging(c)].get(); }
  // Compute records it when done with checkpoint c's staging buffer.
  void* free_event(int64_t c) const { return free_[Staging(c)].get(); }

  int64_t h2d_bytes() const { return h2d_bytes_; }  // this step's
  int64_t d2h_bytes() const { return d2h_bytes_; }

 private:
  int Staging(int64_t c) const { return static_cast<int>((c / checkpoint_every_) % 2); }
  void* HostCheckpoint(int64_t layer) const;

  Backend* backend_;
  int64_t checkpoint_every_, num_layers_, checkpoint_bytes_, micro_batch_bytes_;
  SpanRecorder* spans_;
  HostArena host_;                    // [checkpoint index] x M x (n, C)
  DeviceBuffer staging_[2];           // x_c of a segment, M x (n, C)
  Event saved_[2], loaded_[2], free_[2];
  std::vector<Event> on_host_;        // [checkpoint index]: its forward copy has landed
  int64_t staged_[2] = {-1, -1};      // which checkpoint each staging buffer holds
  int64_t h2d_bytes_ = 0, d2h_bytes_ = 0;
};

}  // namespace megatrain
