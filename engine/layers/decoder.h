// The decoder block template (Llama / Mistral / Qwen2 / Qwen3): stateless code that runs
// on whichever weight slot holds a layer now. Binding is pointer arithmetic against the
// unit layout; the backward is written out op by op (no autograd).
//
//   h   = RMSNorm(x) * w_in                               (n, C)
//   qkv = h Wqkv^T (+ b_qkv)                               (n, (H+2KV)*D)
//   q,k,v = split, QK-norm (Qwen3), RoPE                   (n,H,D) (n,KV,D) (n,KV,D)
//   o   = causal GQA attention within documents            (n, H*D)
//   x2  = x + o Wo^T                                       (n, C)
//   h2  = RMSNorm(x2) * w_post                             (n, C)
//   gu  = h2 [Wgate; Wup]^T                                (n, 2I)
//   a   = silu(gate) * up                                  (n, I)
//   out = x2 + a Wdown^T                                   (n, C)
//
// A LayerKind (layer_kind.h): the pipeline calls it through that seam; tests and tools
// may also call its typed entry points directly. One instance serves every decoder layer
// of the same structure (one unit layout).
// Thread-compatible; every call enqueues on the given stream and returns.
#pragma once

#include <cstdint>

#include "engine/common/backend.h"
#include "engine/layers/attention_block.h"
#include "engine/layers/batch.h"
#include "engine/layers/layer_kind.h"
#include "engine/model/config.h"
#include "engine/model/layout.h"

namespace megatrain {

// Pointers into one slot (weights) or one gradient buffer, by role.
struct DecoderTensors {
  AttentionTensors attn;
  void* post_norm = nullptr;   // (C)
  void* gate_up = nullptr;     // (2I, C)
  void* down = nullptr;        // (C, I)
  // LoRA adapters of gate_proj, up_proj, down_proj (lora.h; null where not adapted).
  void* lora_a[3] = {};
  void* lora_b[3] = {};
};

// Forward's intermediates, for one micro-batch of n tokens. Those Backward needs are kept
// per layer when the layer is kept (the attention half's saved fields, rstd2 and gu); h,
// h2 and a live in the shared scratch and are rebuilt by Rebuild, at the cost of two norms
// and a SwiGLU.
struct DecoderSaved {
  AttentionActs attn;
  void* h2;      // act (n, C)
  void* rstd2;   // stat (n)
  void* gu;      // act (n, 2I)
  void* a;       // act (n, I)
  // backward scratch
  void* dgu;     // act (n, 2I)
  void* da;      // act (n, I)
};

// Sequence tiling (mlp_tile > 0, below a micro-batch's tokens): the MLP half, token-local,
// runs over tiles of mlp_tile tokens, so its intermediates (gate|up: 2I per token, the
// largest of a layer) take a tile's memory, not the micro-batch's; the attention half runs
// over the whole micro-batch. Nothing of the MLP is kept: Backward recomputes each tile's
// norm, gate|up and SwiGLU from the residual (the same kernels on the same rows: the same
// bits) before its backward; the weight gradients add tile by tile, in tile order.
class DecoderLayer final : public LayerKind {
 public:
  DecoderLayer(const ModelConfig& config, const UnitLayout& unit, Backend* backend,
               int64_t mlp_tile = 0);

  // ---- LayerKind ----
  int64_t WorkspaceBytes(int64_t n) const override;
  int64_t SavedBytes(int64_t n) const override;
  LayerWork Work(int64_t n, int64_t seq_len, int64_t act_bytes) const override;
  void Forward(const LayerCall& call, const void* x, void* out) const override;
  void Rebuild(const LayerCall& call, const void* x) const override;
  void Backward(const LayerCall& call, const void* x, void* dres) const override;

  // ---- typed entry points ----

  // Views of a weight slot (weight dtype) or gradient buffer (grad dtype).
  DecoderTensors BindWeights(void* slot) const;
  // LayerCall's grads and grad_discard (GradViews): frozen matrices null.
  DecoderTensors BindGrads(void* grads, void* discard) const;

  // Lays the workspace out from `base` (null: only count `bytes`; `saved_bytes`: those of
  // the saved fields, which come first).
  DecoderSaved CarveWorkspace(void* base, int64_t n, int64_t* bytes = nullptr,
                              int64_t* saved_bytes = nullptr) const;
  // SavedBytes: the saved activations alone (the fields before the backward scratch).
  // Saved activations laid out from `base`, with the backward scratch of `scratch` (a
  // carved workspace, shared by every layer: it is only used during one call).
  DecoderSaved CarveSaved(void* base, int64_t n, const DecoderSaved& scratch) const;

  // out act (n,C) = block(x act (n,C)). Intermediates go to `ws` (kept for Backward).
  // inv_freq: f32 (D/2) device buffer of RoPE frequencies.
  // output_unused: only the intermediates Backward needs (tiled: the attention half's).
  // kv: generation's cache of this layer (AttentionBlock::Forward), null in training.
  void Forward(const DecoderTensors& w, const void* x, void* out, const DecoderSaved& ws,
               const DeviceBatch& batch, const float* inv_freq, StreamId s,
               bool output_unused = false, const KvCacheLayer* kv = nullptr) const;

  // Recomputes the scratch intermediates (h, h2, a) of a kept layer from its saved fields,
  // bit for bit as Forward made them. Call before Backward unless Forward just ran into ws.
  void Rebuild(const DecoderTensors& w, const void* x, const DecoderSaved& ws,
               const DeviceBatch& batch, StreamId s) const;

  // dres act (n,C): on entry dL/d(out), on exit dL/dx. Weight gradients accumulate into
  // g. REQUIRES: ws holds Forward's intermediates for this x and these weights (for a kept
  // layer, after Rebuild).
  void Backward(const DecoderTensors& w, const DecoderTensors& g, const void* x, void* dres,
                const DecoderSaved& ws, const DeviceBatch& batch, const float* inv_freq,
                StreamId s) const;

 private:
  DecoderTensors Bind(void* base, DType dtype) const;
  // The intermediates of `call`: its kept ones over the workspace's scratch, else the
  // workspace's.
  DecoderSaved SavedOf(const LayerCall& call) const;
  // The MLP half's rows at a time for n tokens: n, or mlp_tile_ when that is fewer.
  int64_t Tile(int64_t n) const { return mlp_tile_ > 0 && mlp_tile_ < n ? mlp_tile_ : n; }
  // The MLP half's intermediates over rows [r0, r0 + rows): h2, gu, a (at the
  // workspace's start: a tile's) from the residual x2.
  void MlpIntermediates(const DecoderTensors& w, const DecoderSaved& ws, int64_t r0,
                        int64_t rows, StreamId s) const;
  // The MLP half over those rows: its intermediates, then out = x2 + a Wd^T.
  void MlpForward(const DecoderTensors& w, const DecoderSaved& ws, void* out, int64_t r0,
                  int64_t rows, StreamId s) const;
  // Its backward over the same rows: dres (rows of dL/dout) becomes dL/dx2 there.
  void MlpBackward(const DecoderTensors& w, const DecoderTensors& g, const DecoderSaved& ws,
                   void* dres, int64_t r0, int64_t rows, StreamId s) const;

  ModelConfig config_;
  UnitLayout unit_;  // offsets are the same for every decoder layer
  Backend* backend_;
  AttentionBlock attention_;
  int64_t mlp_tile_;
};

}  // namespace megatrain
