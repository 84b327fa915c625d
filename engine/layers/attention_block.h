// The attention half of a decoder block, shared by the dense and the MoE kinds:
//
//   h   = RMSNorm(x) * w_in                               (n, C)
//   qkv = h Wqkv^T (+ b_qkv)                               (n, (H+2KV)*D)
//   q,k,v = split, QK-norm (Qwen3), RoPE                   (n,H,D) (n,KV,D) (n,KV,D)
//   o   = causal GQA attention within documents            (n, H*D)
//         (GPT-OSS: a learned sink logit per head, and a window on sliding layers)
//   x2  = x + o Wo^T (+ b_o)                               (n, C)
//
// Stateless: a kind binds its views of a slot (BindAttention) and carves the
// intermediates (CarveSaved, then CarveScratch) out of its workspace. Thread-compatible;
// every call enqueues on the given stream.
#pragma once

#include <cstdint>

#include "engine/common/backend.h"
#include "engine/layers/batch.h"
#include "engine/layers/layer_kind.h"
#include "engine/model/config.h"
#include "engine/model/layout.h"

namespace megatrain {

// Pointers into one slot (weights) or one gradient buffer, by role.
struct AttentionTensors {
  void* input_norm = nullptr;  // (C)
  void* qkv = nullptr;         // ((H+2KV)*D, C)
  void* qkv_bias = nullptr;    // ((H+2KV)*D) or null
  void* q_norm = nullptr;      // (D) or null
  void* k_norm = nullptr;      // (D) or null
  void* o_proj = nullptr;      // (C, H*D)
  void* o_bias = nullptr;      // (C) or null
  void* sinks = nullptr;       // (H) or null
  // LoRA adapters of q, k, v, o_proj (lora.h; null where not adapted): A (r, in), B (out, r).
  void* lora_a[4] = {};
  void* lora_b[4] = {};
};

// The attention half's views of `unit`'s tensors from `base` (elements of `dtype`).
AttentionTensors BindAttention(const UnitLayout& unit, void* base, DType dtype);
// The attention half's gradient views (GradViews, layer_kind.h): frozen matrices null.
AttentionTensors BindAttentionGrads(const UnitLayout& unit, const GradViews& g);

// Intermediates of one micro-batch of n tokens. Saved (Backward cannot rebuild them
// cheaply): rstd1, q, k, v, rstd_q, rstd_k, o, lse, x2, and qkv with QK-norm (its backward
// reads the unnormalised heads). Scratch: h (rebuilt from x) and the backward's buffers.
struct AttentionActs {
  void* rstd1;   // stat (n)
  void* qkv;     // act (n, QKV)
  void* q;       // act (n, H*D)
  void* k;       // act (n, KV*D)
  void* v;       // act (n, KV*D)
  void* rstd_q;  // stat (n*H)
  void* rstd_k;  // stat (n*KV)
  void* o;       // act (n, H*D)
  void* lse;     // stat (n*H)
  void* x2;      // act (n, C)
  void* h;       // act (n, C)
  // backward scratch
  void* dh;      // act (n, C)
  void* dqkv;    // act (n, QKV)
  void* dq;      // act (n, H*D)
  void* dk;      // act (n, KV*D)
  void* dv;      // act (n, KV*D)
  void* dout;    // act (n, H*D)
  void* lora_t;   // act (n, r): LoRA's low-rank product (the decoder's MLP uses it too)
  void* lora_dt;  // act (n, r): its gradient
};

class AttentionBlock {
 public:
  // window: the layer's attention window in tokens (ModelConfig::AttentionWindow), 0 for
  // full causal attention. unit: the layer's layout (its LoRA rank and scale).
  AttentionBlock(const ModelConfig& config, const UnitLayout& unit, Backend* backend,
                 int64_t window);

  // The saved fields of `a`, then (a second call, after the kind's own saved fields) the
  // scratch ones. UseScratch points a saved-only carve's scratch fields at `scratch`'s.
  void CarveSaved(Carver& c, int64_t n, AttentionActs* a) const;
  void CarveScratch(Carver& c, int64_t n, AttentionActs* a) const;
  void UseScratch(const AttentionActs& scratch, AttentionActs* a) const;

  // The matmuls, attention FLOPs and elementwise bytes of the half, added to `work`
  // (`unit`: the layer's layout, for frozen projections and adapters).
  void AddWork(const UnitLayout& unit, int64_t n, int64_t seq_len, int64_t act_bytes,
               LayerWork* work) const;

  // a.x2 = x + attention(RMSNorm(x)); intermediates to `a`. With a KV cache (generation):
  // the tokens' keys and values are written to it, and a decode batch (batch.kv_length)
  // attends to it instead of to the batch; a.lse is not written then.
  void Forward(const AttentionTensors& w, const void* x, const AttentionActs& a,
               const DeviceBatch& batch, const float* inv_freq, StreamId s,
               const KvCacheLayer* kv = nullptr) const;
  // h, bit for bit as Forward made it (a kept layer's rebuild).
  void Rebuild(const AttentionTensors& w, const void* x, const AttentionActs& a, int64_t n,
               StreamId s) const;
  // dres act (n,C): on entry dL/dx2, on exit dL/dx; weight gradients accumulate into g.
  void Backward(const AttentionTensors& w, const AttentionTensors& g, const void* x, void* dres,
                const AttentionActs& a, const DeviceBatch& batch, const float* inv_freq,
                StreamId s) const;

 private:
  // q's, k's or v's (i = 0, 1, 2) first column in q|k|v, and its width.
  int64_t QkvColumn(int i) const {
    return (i == 0 ? 0 : config_.num_heads + (i - 1) * config_.num_kv_heads) * config_.head_dim;
  }
  int64_t QkvWidth(int i) const {
    return (i == 0 ? config_.num_heads : config_.num_kv_heads) * config_.head_dim;
  }

  ModelConfig config_;
  Backend* backend_;
  int64_t qkv_dim_;  // (H + 2*KV) * D
  int64_t window_;
  float rope_scale_;  // YaRN's attention factor, else 1
  int64_t lora_rank_;  // 0: no adapters
  double lora_scale_;
};

}  // namespace megatrain
