// The mixture-of-experts block (Qwen3-MoE, Mixtral, GPT-OSS): the dense block's attention
// half, then a router and E SwiGLU experts of which each token uses k.
//
//   x2  = x + attention(RMSNorm(x))                     (attention_block.h)
//   h2  = RMSNorm(x2) * w_post                           (n, C)
//   logits = h2 Wr^T;  probs, idx, w = top-k(softmax)    (n, E), (n, k), (n, k)
//   rows sorted by expert; xe = h2[token of row]         (R = n*k, C)
//   gu  = xe [Wg_e; Wu_e]^T per expert                   (R, 2I)   grouped GEMM
//   a   = silu(gate) * up                                (R, I)
//   ye  = a Wd_e^T per expert                            (R, C)    grouped GEMM
//   out = x2 + sum_j w[t,j] ye[row of (t,j)]             (n, C)
//
// With LoRA on the experts (lora.h), each expert's adapter adds scale (x A_e^T) B_e^T to
// its gate|up and down outputs, grouped as the base matmuls (GroupedLoraForward).
//
// GPT-OSS: the router and both expert projections add biases, the expert weights are
// transformers' input-major tensors (gu = xe Wgu_e with gate/up interleaved, ye = a Wd_e),
// and the activation is the clamped SwiGLU (ClampedSwiGlu). Its top-k-then-softmax router
// gives the weights of a softmax over all E renormalised over the top k: MoeRoute's renorm.
//
// The load-balancing loss (transformers' load_balancing_loss_func over the step's MoE
// layers and tokens) adds aux_scale * counts[e] to dL/dprobs in backward; its value is the
// pipeline's, from the step's RouterStats. Experts that receive no token get a zero
// gradient. Thread-compatible; every call enqueues on call.stream.
#pragma once

#include <cstdint>

#include "engine/common/backend.h"
#include "engine/layers/attention_block.h"
#include "engine/layers/batch.h"
#include "engine/layers/layer_kind.h"
#include "engine/model/config.h"
#include "engine/model/layout.h"

namespace megatrain {

struct MoeTensors {
  AttentionTensors attn;
  void* post_norm = nullptr;  // (C)
  void* router = nullptr;     // (E, C)
  void* gate_up = nullptr;    // (E, 2I, C): expert e's [gate; up]; GPT-OSS (E, C, 2I)
  void* down = nullptr;       // (E, C, I); GPT-OSS (E, I, C)
  void* router_bias = nullptr;   // (E) or null
  void* gate_up_bias = nullptr;  // (E, 2I) or null
  void* down_bias = nullptr;     // (E, C) or null
  // The experts' LoRA adapters (lora.h; null where not adapted), [0] over gate|up, [1]
  // over down: A (E, r, in), B (E, out, r).
  void* lora_a[2] = {};
  void* lora_b[2] = {};
};

// Intermediates of one micro-batch of n tokens, R = n*k rows. Saved (kept layers): the
// attention half's, rstd2, the routing (probs, idx, w, offsets, slot_of, row_token), gu
// and ye; h2, xe and a are rebuilt (a norm, a gather and a SwiGLU).
struct MoeActs {
  AttentionActs attn;
  void* rstd2;         // stat (n)
  void* probs;         // stat (n, E)
  int32_t* idx;        // (n, k)
  void* w;             // stat (n, k)
  int32_t* offsets;    // (E+1)
  int32_t* slot_of;    // (R)
  int32_t* row_token;  // (R)
  void* gu;            // act (R, 2I)
  void* ye;            // act (R, C)
  // scratch
  void* h2;            // act (n, C)
  void* logits;        // act (n, E)
  int32_t* sort_scratch;  // MoeSortScratchInts(R, E)
  void* xe;            // act (R, C)
  void* a;             // act (R, I)
  void* dw;            // stat (n, k)
  void* da;            // act (R, I)
  void* dgu;           // act (R, 2I)
  void* dxe;           // act (R, C); also dye (dead once the down projection's backward ran)
  void* dlogits;       // act (n, E)
  void* lora_t;        // act (R, r): the experts' adapters' x A^T (null without)
  void* lora_dt;       // act (R, r): its gradient (null without)
};

class MoeLayer final : public LayerKind {
 public:
  MoeLayer(const ModelConfig& config, const UnitLayout& unit, Backend* backend);

  // ---- LayerKind ----
  int64_t WorkspaceBytes(int64_t n) const override;
  int64_t SavedBytes(int64_t n) const override;
  LayerWork Work(int64_t n, int64_t seq_len, int64_t act_bytes) const override;
  void Forward(const LayerCall& call, const void* x, void* out) const override;
  void Rebuild(const LayerCall& call, const void* x) const override;
  void Backward(const LayerCall& call, const void* x, void* dres) const override;

  MoeTensors BindWeights(void* slot) const { return Bind(slot, backend_->weight_dtype()); }
  // Frozen matrices' views are null (UnlessFrozen): their gradients are never computed.
  MoeTensors BindGrads(void* grads, void* discard) const;  // LayerCall's (GradViews)

 private:
  MoeTensors Bind(void* base, DType dtype) const;
  // The workspace from `base` (null: count only); `saved_bytes`: the saved fields' bytes.
  MoeActs Carve(void* base, int64_t n, int64_t* bytes, int64_t* saved_bytes) const;
  MoeActs ActsOf(const LayerCall& call) const;
  // h2 = RMSNorm(x2) * w_post.
  void PostNorm(const MoeTensors& w, const MoeActs& a, int64_t n, StreamId s) const;
  // a = act(gu): SwiGLU, or GPT-OSS's clamped SwiGLU; and its backward.
  void Activation(const MoeActs& a, int64_t rows, StreamId s) const;
  void ActivationBackward(const MoeActs& a, int64_t rows, StreamId s) const;

  ModelConfig config_;
  UnitLayout unit_;
  Backend* backend_;
  AttentionBlock attention_;
  int64_t E_, k_, I_;
  bool in_major_;  // the experts' weights are input-major (GPT-OSS)
  TensorRole lora_base_[2];  // the base roles of the experts' adapters (LoraExpertRole)
  bool expert_lora_;         // some expert projection has an adapter
};

}  // namespace megatrain
