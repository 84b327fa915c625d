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
// What a block computes is its kind's business (layers/layer_kind.h): the pipeline hands
// each layer's kind its slot, gradient buffer and workspace. What crosses PCIe is
// transfer/'s: weight slots (weight_slots.h), the gradient drain (gradient_drain.h) and
// host checkpoints (host_checkpoints.h); this file orders them.
//
// All device memory is sized by StepMemory (plan/step_memory.h: what the planner counts)
// and allocated in Create(); Step() allocates nothing on the device. Thread-compatible.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/common/backend.h"
#include "engine/common/collective.h"
#include "engine/data/micro_batch.h"
#include "engine/layers/head.h"
#include "engine/layers/layer_kind.h"
#include "engine/model/config.h"
#include "engine/plan/step_memory.h"
#include "engine/transfer/grad_sink.h"
#include "engine/store/grad_slab_pool.h"
#include "engine/store/host_store.h"
#include "engine/transfer/gradient_drain.h"
#include "engine/transfer/host_checkpoints.h"
#include "engine/transfer/timeline.h"
#include "engine/transfer/weight_slots.h"

namespace megatrain {

struct StepResult {
  double loss = 0;            // the LM loss: mean over the step's unmasked tokens
  // A preference objective's step: every token's -log p(target) (M x n, micro-batch by
  // micro-batch), for the pair metrics; empty otherwise.
  std::vector<double> token_values;
  // MoE models: the load-balancing loss over the step's MoE layers and tokens, unweighted
  // (transformers' aux_loss), and its weight in the loss that was differentiated.
  double aux_loss = 0;
  double aux_loss_coef = 0;
  int64_t num_targets = 0;
  double grad_norm = 0;       // global L2 norm before clipping
  double seconds = 0;
  int64_t h2d_bytes = 0;      // host -> device this step: weights, checkpoints, inputs
  int64_t d2h_bytes = 0;      // device -> host: gradients, checkpoints, losses
  // Resident slots: layers uploaded for the next step during this one's backward (their
  // update was applied in time); the next forward finds them loaded. Counted in h2d_bytes.
  int64_t early_uploads = 0;
  std::vector<TimelineSpan> timeline;  // when PipelineOptions::record_timeline
};

// A forward-only pass over an evaluation set (Pipeline::Evaluate).
struct EvalResult {
  double loss_sum = 0;       // sum of the objective's per-token values (-log p(target))
  int64_t num_targets = 0;   // tokens with a target: loss_sum / num_targets is the mean
  int64_t micro_batches = 0;
  int64_t passes = 0;        // sweeps over the layers (each holds eval_micro_batches())
  double seconds = 0;
  int64_t h2d_bytes = 0;     // weights and token arrays
  int64_t d2h_bytes = 0;     // per-token losses
  // The mean, as StepResult::loss is: loss_sum / num_targets (0 without targets).
  double loss() const { return num_targets > 0 ? loss_sum / num_targets : 0.0; }
};

// Total length of the union of [begin, end) intervals (overlaps count once).
double UnionLength(std::vector<std::pair<double, double>> intervals);

// Seconds each stream was busy in `timeline`: the length of the union of its spans
// (overlapping spans on one stream count once). Indexed by StreamId.
std::array<double, kNumStreams> StreamBusySeconds(const std::vector<TimelineSpan>& timeline);

class Pipeline {
 public:
  static constexpr int kLayerGradBuffers = StepMemory::kLayerGradBuffers;
  static constexpr int64_t kBatchArrays = StepMemory::kBatchArrays;

  [[nodiscard]] static absl::StatusOr<std::unique_ptr<Pipeline>> Create(
      const ModelConfig& config, HostStore* store, GradSlabPool* slabs, Backend* backend,
      const PipelineOptions& options);
  ~Pipeline();

  // Runs forward and backward over `batches` (exactly micro_batches of them, each of
  // tokens_per_micro_batch tokens) and hands every unit's gradient to `sink`. Before
  // uploading a unit it waits for sink->AwaitUnit(unit), so updates of the previous step
  // may still run during this step's forward. Returns after sink->Finish().
  // step_targets > 0: the targets of the whole step, of which `batches` are a share (data
  // parallelism); gradients are scaled by 1/step_targets. StepResult.loss stays the mean
  // over this share's own targets.
  [[nodiscard]] absl::StatusOr<StepResult> Step(const std::vector<MicroBatch>& batches,
                                                GradSink* sink, int64_t step_targets = 0);

  // The forward-only pass: `batches` (any number, each of tokens_per_micro_batch tokens)
  // go through the layers eval_micro_batches() at a time, every one of them through a
  // layer while its weights are on the device (each layer crosses PCIe once per pass,
  // unless its slot still holds it), then through the head's forward (LossHead::Forward):
  // no gradient, no drain, nothing for an optimizer. A micro-batch's per-token values are
  // those a training step's forward computes on the same weights, and their sum over the
  // step's micro-batches is StepResult::loss's numerator bit for bit.
  // REQUIRES: options.eval_micro_batches > 0; every update of the last step applied
  // (HostOptimizer::Drain): the pass reads the host's weights as they are. The slots it
  // loads stay loaded for the next Step(). token_values, when given, gets every token's
  // value (batches.size() * tokens_per_micro_batch, micro-batch after micro-batch; 0 where
  // there is no target): a reference model's log-probabilities, per sequence, for DPO
  // (pair_packer.h's SequenceLogps).
  [[nodiscard]] absl::StatusOr<EvalResult> Evaluate(const std::vector<MicroBatch>& batches,
                                                    std::vector<double>* token_values = nullptr);
  int64_t eval_micro_batches() const { return options_.eval_micro_batches; }
  // The host's weights were replaced outside a step (a DPO job's reference weights loaded
  // for its reference pass, then its own): nothing on the device holds them, so the next
  // pass uploads every unit whole.
  void WeightsReplaced();

  // Device bytes allocated by Create(): StepMemory's TotalBytes() for its options.
  int64_t device_bytes() const { return device_bytes_; }

 private:
  Pipeline(const ModelConfig& config, const ModelLayout& layout, HostStore* store,
           GradSlabPool* slabs, Backend* backend, const PipelineOptions& options);
  // Allocates every device buffer, each of StepMemory's size.
  [[nodiscard]] absl::Status Allocate();

  // The step, stage by stage (Step runs them in this order).
  [[nodiscard]] absl::StatusOr<int64_t> CheckBatches(const std::vector<MicroBatch>& batches) const;
  void BeginStep(GradSink* sink);
  // H2D of the micro-batches' token arrays, the embedding, layer 0 and the head.
  void UploadInputs(const std::vector<MicroBatch>& batches, GradSink* sink);
  // The embedding or head unit into its own slot: whole the first time, then what the
  // optimizer changes (its state range; nothing for a frozen unit). Returns the bytes.
  // Micro-batch m's sequence indices and info (a preference objective's) to the device.
  void UploadSequences(int64_t m, const MicroBatch& b);
  int64_t UploadEdgeUnit(int64_t unit, void* slot, bool* loaded);
  void ForwardSweep();  // embedding, then layer by layer for every micro-batch
  void Head(double scale, GradSink* sink);  // loss forward + backward, per micro-batch
  void BackwardSweep(GradSink* sink);  // segments from the top; then the embedding
  // One checkpoint segment [c, e): its inputs recomputed, then its layers' backward.
  void BackwardSegment(int64_t c, int64_t e, int64_t* grad_turn, GradSink* sink);
  // A unit's gradient drain is enqueued after the next layer's backward, not before: the
  // drain blocks this thread while the sink holds every gradient slab (the optimizer
  // behind), and the device should have that layer's kernels queued meanwhile. The D2H
  // stream's order is the same either way.
  void DeferDrain(int64_t unit, void* device_grad, void* done_event, void* free_event,
                  GradSink* sink);
  void FlushDrain(GradSink* sink);
  StepResult FinishStep(GradSink* sink, int64_t num_targets,
                        std::chrono::steady_clock::time_point start);

  void* Act(std::vector<DeviceBuffer>& v, int64_t i, int64_t m);
  void* MicroBatchRow(const DeviceBuffer& b, int64_t m) const;  // micro-batch m of an (M*n, C)
  bool IsCheckpoint(int64_t layer) const;
  void* LayerInput(int64_t layer, int64_t m);     // x_layer of micro-batch m in forward
  void* Checkpoint(int64_t layer, int64_t m);     // device checkpoints only
  void* SegmentInput(int64_t c, int64_t m);       // x_c in backward
  bool Kept(int64_t layer) const { return layer >= config_.num_layers - options_.kept_layers; }
  // What a layer's kind runs with for micro-batch m: its slot (Use()d), the workspace,
  // its kept intermediates if it is kept (and `kept` is true), the batch and RoPE table.
  LayerCall CallFor(int64_t layer, int64_t m, void* slot, bool kept, void* grads = nullptr);
  // Evaluate's stages: the token arrays of batches [first, first + count), and one sweep of
  // them through the layers and the head, adding to *result.
  void UploadEvalInputs(const std::vector<MicroBatch>& batches, int64_t first, int64_t count);
  void EvalPass(int64_t count, EvalResult* result, double* token_values);
  // Micro-batch g of a forward-only pass on side 0 or 1 (eval_sides_).
  void* EvalAct(int side, int64_t g) const;
  // The load-balancing loss of the step's router statistics (on the host after the step).
  double AuxLoss() const;

  ModelConfig config_;
  const ModelLayout* layout_;  // the store's
  HostStore* store_;
  GradSlabPool* slabs_;
  Backend* backend_;
  PipelineOptions options_;
  LayerKinds kinds_;
  LossHead head_;
  int64_t act_row_bytes_;  // C * act size
  int64_t device_bytes_ = 0;

  SpanRecorder spans_;
  WeightSlots slots_;
  GradientDrain drain_;
  std::unique_ptr<HostCheckpoints> host_checkpoints_;  // checkpoints_on_host only

  // The gradients of the embedding's and the head's state ranges; the discard scratch of
  // frozen vectors' gradients (LayerCall::grad_discard).
  DeviceBuffer embed_slot_, head_slot_, embed_grad_, head_grad_, grad_discard_;
  Event embed_loaded_, head_loaded_;
  bool embed_uploaded_ = false, head_uploaded_ = false;  // their slots hold them
  DeviceBuffer layer_grad_[kLayerGradBuffers];
  Event grad_ready_[kLayerGradBuffers], grad_free_[kLayerGradBuffers];
  struct PendingDrain {
    int64_t unit = -1;   // -1: none
    void* device_grad = nullptr;
    void* done_event = nullptr;
    void* free_event = nullptr;
  } pending_drain_;
  std::vector<DeviceBuffer> ckpt_;        // [ckpt index] -> M x (n, C)
  std::vector<DeviceBuffer> seg_;         // [K-1] recomputed inputs, M x (n, C)
  DeviceBuffer cur_[2];                   // forward ping-pong, M x (n, C)
  DeviceBuffer dres_;                     // M x (n, C)
  DeviceBuffer scratch_out_;              // (n, C)
  DeviceBuffer layer_ws_, head_ws_;       // the kinds' largest workspace; the head's
  int64_t kept_bytes_ = 0;                // a kept layer's intermediates, one micro-batch
  std::vector<DeviceBuffer> kept_ws_;     // [kept layer] M x kept_bytes_
  DeviceBuffer batch_ints_;               // M x kBatchArrays x (n) int32
  std::vector<int32_t> token_order_;      // M x (n): the host side of the TokenOrder copies
  std::vector<DeviceBatch> batches_;      // this step's, on the device
  DeviceBuffer losses_;                   // M x (n) stat
  // A preference objective's: per micro-batch, its sequences' info, then their indices.
  DeviceBuffer preference_buf_;
  DeviceBuffer inv_freq_;                 // (D/2) f32
  // MoE: the step's router statistics (counts (E) int32, then prob_sum (E) stat), what the
  // layers see of them, and their host copy.
  DeviceBuffer router_stats_buf_;
  RouterStats router_stats_;
  std::vector<char> host_router_stats_;
  // [layer][micro-batch] (E+1): the experts' row offsets of each MoE layer's routing, from
  // the step's forward to its recompute and backward (LayerCall::host_offsets).
  std::vector<int32_t> host_offsets_;
  double aux_coef_ = 0;
  // A forward-only pass's two sides: the step's activations buffers, half each.
  std::vector<const DeviceBuffer*> eval_sides_[2];
  Event inputs_loaded_, losses_ready_, step_start_, step_end_, uploads_done_;
  std::vector<char> host_losses_;
  int64_t h2d_bytes_ = 0, d2h_bytes_ = 0;  // this step's own (inputs, embedding, head, losses)
};

}  // namespace megatrain
