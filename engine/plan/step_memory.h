// The device memory of one training step, buffer by buffer: what Pipeline::Create()
// allocates and what the planner counts each candidate plan by. One arithmetic for both,
// so a plan that fits is a pipeline that allocates: the pipeline takes every buffer's size
// from StepMemory and checks, once allocated, that it holds exactly TotalBytes().
//
// It lives below the pipeline (which includes it) and beside the planner: the planner
// never sees the pipeline. Sizes come from the model's layout, the backend's dtypes, the
// options and what the layer kinds and the loss head say they need.
#pragma once

#include <cstdint>

#include "engine/common/backend.h"
#include "engine/common/collective.h"
#include "engine/layers/head.h"
#include "engine/layers/layer_kind.h"
#include "engine/model/config.h"
#include "engine/model/layout.h"

namespace megatrain {

// The shape of a pipeline's step and where its memory goes (pipeline/pipeline.h runs it).
struct PipelineOptions {
  int64_t micro_batches = 1;          // M per step
  int64_t tokens_per_micro_batch = 0; // n = rows * seq_len
  int64_t checkpoint_every = 1;       // K: keep the input of every K-th layer
  int64_t loss_chunk_tokens = 4096;   // rows of logits materialised at once
  // Keep layer-input checkpoints in pinned host memory instead of on the device: the
  // device working set no longer grows with depth (each checkpoint crosses PCIe once
  // each way per step). Meaningless on the CPU backend.
  bool checkpoints_on_host = false;
  // Device weight slots. At least max(2, K+1); with at least num_layers every layer keeps
  // its own slot, so backward finds each layer still resident from the forward and only
  // the forward upload crosses PCIe (the optimizer changes the weights every step).
  int64_t weight_slots = 0;
  // Keep the intermediates of the top `kept_layers` layers (every micro-batch's) from the
  // forward to the backward instead of recomputing them: a forward pass fewer per kept
  // layer (two norms and a SwiGLU rebuild the rest), DecoderLayer::SavedBytes(n) of device
  // memory per layer and micro-batch.
  // REQUIRES checkpoint_every == 1 when > 0.
  int64_t kept_layers = 0;
  // Sequence tiling: dense layers run their MLP half over tiles of this many tokens (0: the
  // whole micro-batch), so long sequences fit (DecoderLayer); the MLP is recomputed in the
  // backward, a kept layer keeps only its attention half.
  int64_t mlp_tile_tokens = 0;
  // Record a span (two events) around every transfer and every layer's compute, and
  // return the step's timeline. Costs a little; for benchmarks and diagnosis.
  bool record_timeline = false;
  // Data parallelism with the reduction on the devices: each unit's gradient is
  // reduce-scattered across the group on the D2H stream before it drains, and this
  // pipeline drains (and hands the sink) only its rank's shard. Gradient buffers are
  // padded to size() shards. Null: the whole gradient drains.
  GradCollective* collective = nullptr;
  // MoE models: the load-balancing loss's weight in the loss; < 0: what config.json says
  // (router_aux_loss_coef when output_router_logits is true, else 0, as transformers).
  double router_aux_loss_coef = -1;
  // What the loss head computes (layers/objective.h); a preference objective's micro-batches
  // carry their sequences (preference_arrays).
  ObjectiveOptions objective;
  // Evaluation (Pipeline::Evaluate): micro-batches a forward-only pass takes through each
  // layer at once, in the step's activation buffers (at most EvalCapacity); the token
  // arrays and per-token losses are sized for them. 0: the job evaluates nothing.
  int64_t eval_micro_batches = 0;
};

// Bytes of each device buffer of a step (a count beside the buffers that come several).
// "Activations" are M micro-batches of (n, C) act rows.
struct StepMemory {
  // The layers' gradient buffers on the device, in turn: a layer's backward waits until
  // the gradient of the layer this many above it has drained.
  static constexpr int kLayerGradBuffers = 2;
  // Per micro-batch: tokens, targets, doc_start, positions and TokenOrder, (n) int32 each.
  static constexpr int64_t kBatchArrays = 5;

  int64_t weight_slots = 0;        // decoder weight slots (NumWeightSlots) ...
  int64_t weight_slot = 0;         // ... of the largest decoder layer's weights each
  int64_t embedding_slot = 0, head_slot = 0;
  // Gradients: of each unit's state range alone (layout.h; a frozen unit has none), padded
  // to whole shards (collective).
  int64_t embedding_grad = 0, head_grad = 0;
  int64_t layer_grad = 0;          // each of kLayerGradBuffers, the largest layer's
  int64_t grad_discard = 0;        // frozen vectors' gradients, dropped (GradDiscardElements)
  int64_t activations = 0;         // one buffer of activations, M x (n, C)
  int64_t device_checkpoints = 0;  // activations buffers: layer-input checkpoints (on device)
  int64_t checkpoint_staging = 0;  // each of two, for checkpoints in host memory (else 0)
  int64_t recomputed_inputs = 0;   // activations buffers: a segment's recomputed inputs
  int64_t forward_buffers = 0;     // activations buffers: the forward's ping-pong (0 or 2)
  // The residual gradient is one activations buffer more.
  int64_t scratch_output = 0;      // (n, C): an output nobody reads
  int64_t layer_workspace = 0;     // the layer kinds' largest workspace
  int64_t kept_layers = 0;         // layers whose intermediates are kept ...
  int64_t kept_layer = 0;          // ... M x the kinds' largest saved bytes each
  int64_t head_workspace = 0;      // the loss head's
  int64_t token_arrays = 0;        // max(M, eval micro-batches) x kBatchArrays x (n) int32
  int64_t losses = 0;              // max(M, eval micro-batches) x (n) stat
  // A preference objective's: M x ((n) int32 sequence indices + kMaxPreferenceSequences x
  // kPrefFields f64); 0 otherwise.
  int64_t preference_arrays = 0;
  int64_t rope_frequencies = 0;    // (D/2) f32
  int64_t router_counts = 0;       // MoE: (E) int32, padded to 64 bytes: prob_sum follows
  int64_t router_stats = 0;        // MoE: router_counts + (E) stat; 0 for dense models

  // Everything above, counted as the pipeline allocates it.
  int64_t TotalBytes() const;
  // The activations buffers of a step (checkpoints, recomputed inputs, the forward's and
  // the residual gradient's): a forward-only pass's two sides, half each.
  int64_t activation_buffers() const {
    return device_checkpoints + recomputed_inputs + forward_buffers + 1;
  }
};

// Weight slots a pipeline with `options` uses: at least max(2, K + 1), at most one a layer.
int64_t NumWeightSlots(const ModelConfig& config, const PipelineOptions& options);

// The most micro-batches a forward-only pass of a pipeline with `options` can hold at once:
// half of the step's activations buffers, each M micro-batches (the layer's input on one
// side, its output on the other). At least M.
int64_t EvalCapacity(const ModelConfig& config, const PipelineOptions& options);

// The step's buffers for `options` on `backend`, given the layer kinds and loss head that
// run it (the pipeline's own, or ones made alike).
StepMemory SizeStepMemory(const ModelConfig& config, const ModelLayout& layout, Backend* backend,
                          const PipelineOptions& options, const LayerKinds& kinds,
                          const LossHead& head);

// What a pipeline with `options` allocates on `backend` for a model of `layout` (nothing
// is allocated): the planner's device-memory figure. Makes the layer kinds and the
// training loss head as Pipeline::Create() does.
int64_t StepDeviceBytes(const ModelConfig& config, const ModelLayout& layout, Backend* backend,
                        const PipelineOptions& options);

// A floor under StepDeviceBytes per token of a step (micro_batches x
// tokens_per_micro_batch), whatever the other options: the buffers every plan sizes by
// its tokens. Lets the planner refuse a step that can never fit before counting any plan.
int64_t MinDeviceBytesPerToken(const ModelConfig& config, const Backend& backend);

}  // namespace megatrain
