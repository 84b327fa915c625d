// The training step: the only code that knows the order of stages.
//
// Layer-major: all micro-batches of a step pass through layer l while its weights are in
// a device slot, so each layer crosses to the device at most twice per step (forward,
// backward) whatever the accumulation, and its gradient is complete after one backward
// visit: one D2H, then the host optimizer updates it while the device works on.
//
//   forward   embed -> layer 0 .. L-1 (inputs of every K-th layer checkpointed) -> head
//   head      final norm + lm_head + CE, forward and backward fused (layers/head.h)
//   backward  per segment [c, c+K) from the top: recompute inputs c+1.. from checkpoint c,
//             then per layer (top down): re-run its forward to get intermediates, backward,
//             gradient D2H -> GradSink
//   embed     embedding backward; embedding and head gradients D2H -> GradSink
//
// Streams: weights upload on H2D into slot (l mod S), S = max(2, K+1), waiting until the
// slot's previous layer is no longer in use; the compute stream waits for the upload; the
// gradient buffer (two, alternating) drains on D2H while the next layer computes. The host
// waits only on events. A slot that still holds the layer it needs is not re-uploaded.
//
// All device memory is sized by the options and allocated in Create(); Step() allocates
// nothing on the device. Thread-compatible.
#pragma once

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/common/backend.h"
#include "engine/data/packer.h"
#include "engine/layers/decoder.h"
#include "engine/layers/head.h"
#include "engine/model/config.h"
#include "engine/pipeline/grad_sink.h"
#include "engine/store/grad_slab_pool.h"
#include "engine/store/host_store.h"

namespace megatrain {

struct PipelineOptions {
  int64_t micro_batches = 1;          // M per step
  int64_t tokens_per_micro_batch = 0; // n = rows * seq_len
  int64_t checkpoint_every = 1;       // K: keep the input of every K-th layer
  int64_t loss_chunk_tokens = 4096;   // rows of logits materialised at once
};

struct StepResult {
  double loss = 0;            // mean over the step's unmasked tokens
  int64_t num_targets = 0;
  double grad_norm = 0;       // global L2 norm before clipping
  double seconds = 0;
};

class Pipeline {
 public:
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<Pipeline>> Create(
      const ModelConfig& config, HostStore* store, GradSlabPool* slabs, Backend* backend,
      const PipelineOptions& options);
  ~Pipeline();

  // Runs forward and backward over `batches` (exactly micro_batches of them, each of
  // tokens_per_micro_batch tokens) and hands every unit's gradient to `sink`.
  // Returns after sink->Finish().
  [[nodiscard]] absl::StatusOr<StepResult> Step(const std::vector<MicroBatch>& batches,
                                                GradSink* sink);

  // Device bytes allocated by Create().
  int64_t device_bytes() const { return device_bytes_; }

 private:
  Pipeline(const ModelConfig& config, HostStore* store, GradSlabPool* slabs, Backend* backend,
           const PipelineOptions& options);
  absl::Status Allocate();

  void EnsureLoaded(int64_t layer);          // H2D layer's weights into its slot
  void* UseSlot(int64_t layer);              // compute waits for the upload
  void ReleaseSlot(int64_t layer);           // compute is done with the slot
  void* Act(std::vector<DeviceBuffer>& v, int64_t i, int64_t m);
  void* ForwardInput(int64_t layer, int64_t m);   // x_layer of micro-batch m in forward
  void* Checkpoint(int64_t layer, int64_t m);     // layer % K == 0 or layer == L
  // D2H of a finished gradient into a slab, then hands it to the sink.
  void DrainGradient(int64_t unit, void* device_grad, void* done_event, void* free_event,
                     GradSink* sink);

  ModelConfig config_;
  HostStore* store_;
  GradSlabPool* slabs_;
  Backend* backend_;
  PipelineOptions options_;
  DecoderLayer decoder_;
  LossHead head_;
  int64_t num_slots_;
  int64_t act_row_bytes_;  // C * act size
  int64_t device_bytes_ = 0;

  std::vector<DeviceBuffer> slots_;       // S weight slots
  std::vector<int64_t> slot_layer_;       // layer in each slot, -1 = none/stale
  std::vector<Event> slot_loaded_, slot_free_;
  DeviceBuffer embed_slot_, head_slot_, embed_grad_, head_grad_;
  Event embed_loaded_, head_loaded_;
  DeviceBuffer layer_grad_[2];
  Event grad_ready_[2], grad_free_[2];
  std::vector<Event> unit_done_;          // per unit: its gradient is on the host
  std::vector<DeviceBuffer> ckpt_;        // [ckpt index] -> M x (n, C)
  std::vector<DeviceBuffer> seg_;         // [K-1] recomputed inputs, M x (n, C)
  DeviceBuffer cur_[2];                   // forward ping-pong, M x (n, C)
  DeviceBuffer dres_;                     // M x (n, C)
  DeviceBuffer scratch_out_;              // (n, C)
  DeviceBuffer layer_ws_, head_ws_;
  DecoderSaved saved_;
  DeviceBuffer batch_ints_;               // M x 4 x (n) int32
  DeviceBuffer losses_;                   // M x (n) stat
  DeviceBuffer inv_freq_;                 // (D/2) f32
  Event inputs_loaded_, losses_ready_, step_start_, step_end_;
  std::vector<char> host_losses_;
};

}  // namespace megatrain
