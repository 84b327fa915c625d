// The layer-kind seam: what the pipeline and the planner know of a block. A kind is
// stateless code with a tensor layout (today's dense decoder block is one, decoder.h; an
// MoE block or a sequence-tiled block would be others). It runs on whichever weight slot
// holds a layer now and knows nothing of the pipeline's order: the pipeline hands it the
// slot, the gradient buffer, the workspace and the layer's kept intermediates, and the
// kind binds its own views of them (pointer arithmetic against its unit layout).
//
// A model may mix kinds: LayerKinds groups its decoder layers by structure (the same
// tensors in the same places) and attention window (GPT-OSS alternates sliding and full
// layers), one kind instance per group, as MegaTrain groups layers.
//
// Thread-compatible; every call enqueues on call.stream and returns.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <vector>

#include "engine/common/backend.h"
#include "engine/layers/batch.h"
#include "engine/model/config.h"
#include "engine/model/layout.h"

namespace megatrain {

// A step's router statistics, shared by its MoE layers (device buffers, zeroed by the
// pipeline at the step's start): the load-balancing loss over every MoE layer and token.
struct RouterStats {
  int32_t* counts = nullptr;  // (E) choices of each expert, over layers and micro-batches
  void* prob_sum = nullptr;   // stat (E) the router probabilities' sums, likewise
  // dAux/dp_e = aux_scale * counts[e] in backward (0: no load-balancing gradient).
  double aux_scale = 0;
};

// One layer, one micro-batch: where its weights, gradients and intermediates are.
struct LayerCall {
  const void* weights = nullptr;  // its weight slot (weight dtype)
  // Backward only: the gradient of the unit's state range (layout.h), grad dtype, from its
  // start; and a scratch where the gradients of frozen vectors outside that range (norms,
  // biases: computed with the kernels' other outputs) land and are dropped
  // (GradDiscardElements).
  void* grads = nullptr;
  void* grad_discard = nullptr;
  void* workspace = nullptr;      // the shared workspace, WorkspaceBytes(n)
  // The layer's kept intermediates of this micro-batch, SavedBytes(n), from its forward to
  // its backward; null: they are recomputed into the workspace.
  void* saved = nullptr;
  const DeviceBatch* batch = nullptr;
  const float* rope_inv_freq = nullptr;  // f32 (D/2) device buffer (RopeInvFreqs)
  StreamId stream = StreamId::kCompute;
  // MoE kinds: the step's router statistics (null: none are kept, as in an evaluation).
  const RouterStats* router_stats = nullptr;
  // The layer's first forward of this input, not a recomputation: MoE kinds add its routing
  // to router_stats (when given) and write host_offsets.
  bool first_forward = false;
  // Forward's output is discarded (the backward's recompute of a layer not kept): a kind
  // may skip what only the output needs.
  bool output_unused = false;
  // MoE kinds: host int32 (num_experts + 1) of this layer and micro-batch, the experts' row
  // offsets. The first Forward (first_forward) writes them, its one wait for
  // the device; a recompute and Backward read them, since the same input routes the same
  // way. Null: each grouped matmul reads the offsets back from the device.
  int32_t* host_offsets = nullptr;
  // Generation: this layer's KV cache (batch->seq_slot says where each token goes); null in
  // training.
  const KvCacheLayer* kv = nullptr;
};

// One matmul of a layer's forward: (n, in) . W^T (out, in), for the planner. A grouped
// matmul (the experts') is `groups` GEMMs over n * rows_per_token rows in all.
struct MatmulShape {
  int64_t in = 0;
  int64_t out = 0;
  int64_t rows_per_token = 1;
  int64_t groups = 1;
  bool rebuilt = false;  // a kept layer's Rebuild or Backward runs it again (its forward)
  bool frozen = false;   // no weight gradient: backward is once (dx), not twice
};



// A layer's forward over n tokens, as work the planner times with the machine's rates.
struct LayerWork {
  std::vector<MatmulShape> matmuls;  // each over the n rows; backward is twice each
  double attention_flops = 0;        // causal attention forward (backward: 2.5x)
  int64_t attention_head_dim = 128;  // the attention's head size (its kernels' rate)
  double elementwise_bytes = 0;      // norms, RoPE, activation, residuals (backward: 2x)
  double rebuild_bytes = 0;          // a kept layer's rebuild of what it did not keep
};
// The matmuls of a LoRA adapter beside a projection (in -> out) of `unit`, when it has
// one: x A^T (in -> r) and t B^T (r -> out), to add to a kind's work; an experts' adapter's
// are grouped as their projection's (rows_per_token, groups).
void AddLoraWork(const UnitLayout& unit, TensorRole base, int64_t in, int64_t out,
                 LayerWork* work, int64_t rows_per_token = 1, int64_t groups = 1);

class LayerKind {
 public:
  virtual ~LayerKind() = default;

  // Device bytes of the shared workspace for micro-batches of up to n tokens, and of one
  // micro-batch's kept intermediates (what keeping a layer costs instead of recomputing).
  virtual int64_t WorkspaceBytes(int64_t n) const = 0;
  virtual int64_t SavedBytes(int64_t n) const = 0;

  // The forward's work over n tokens in documents of seq_len tokens; act_bytes: the
  // activation element size.
  virtual LayerWork Work(int64_t n, int64_t seq_len, int64_t act_bytes) const = 0;

  // out act (n, C) = block(x act (n, C)); intermediates to call.saved (kept) or the
  // workspace.
  virtual void Forward(const LayerCall& call, const void* x, void* out) const = 0;
  // A kept layer's intermediates that were not kept, rebuilt bit for bit as Forward made
  // them. Before Backward of a kept layer (call.saved set).
  virtual void Rebuild(const LayerCall& call, const void* x) const = 0;
  // dres act (n, C): on entry dL/d(out), on exit dL/dx; weight gradients accumulate into
  // call.grads. REQUIRES: the intermediates of this x (Forward, or Rebuild when kept).
  virtual void Backward(const LayerCall& call, const void* x, void* dres) const = 0;
};

// The kinds of a model's decoder layers: one instance per group of layers of the same
// structure, and each layer's group.
struct LayerKinds {
  std::vector<std::unique_ptr<LayerKind>> kinds;
  std::vector<int> of_layer;  // (num_layers): index into kinds
  const LayerKind& ForLayer(int64_t layer) const { return *kinds[of_layer[layer]]; }
  // The largest workspace and kept bytes over the kinds, for n tokens.
  int64_t MaxWorkspaceBytes(int64_t n) const;
  int64_t MaxSavedBytes(int64_t n) const;
};

// The kinds of `config`'s decoder layers in `layout`, for `backend`'s element types.
// mlp_tile: dense blocks run their MLP half over tiles of that many tokens (0: the whole
// micro-batch at once; see DecoderLayer).
LayerKinds MakeLayerKinds(const ModelConfig& config, const ModelLayout& layout, Backend* backend,
                          int64_t mlp_tile = 0);

// The tensor of `role` in `unit`'s block at `base` (elements of `dtype`), or null when the
// unit has none: a kind's binding of its views.
void* TensorAt(const UnitLayout& unit, void* base, TensorRole role, DType dtype);

// A kind's gradient view of the matrix made of `roles` in `unit` (one, or a fused q|k|v or
// gate|up; every expert's): `grad`, or null when all of those tensors are frozen, so that
// the weight gradient is never computed (Backend::LinearBackward takes a null dW).
void* UnlessFrozen(const UnitLayout& unit, void* grad, std::initializer_list<TensorRole> roles);

// Where a kind binds the gradient of the tensor (or fused group) at `offset` of `unit`,
// given LayerCall's grads (the state range's) and grad_discard: its place in grads inside
// the range; outside it, null for a matrix (never computed) and the discard scratch for a
// vector. offset < 0 (no such tensor): null.
class GradViews {
 public:
  GradViews(const UnitLayout& unit, void* grads, void* discard, DType dtype);
  void* At(int64_t offset, bool matrix) const;
  void* Matrix(int64_t offset) const { return At(offset, true); }
  void* Vector(int64_t offset) const { return At(offset, false); }

 private:
  int64_t begin_, end_;
  void* grads_;
  void* discard_;
  DType dtype_;
};

// Elements of the discard scratch the kinds of `layout` need: its largest vector tensor (a
// layer's q|k|v biases count as one).
int64_t GradDiscardElements(const ModelLayout& layout);

// RoPE's inverse frequencies of `config` (rope_scaling included), f32 (D/2), for
// LayerCall::rope_inv_freq.
std::vector<float> RopeInvFreqs(const ModelConfig& config);

}  // namespace megatrain
