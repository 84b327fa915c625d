#include "engine/layers/decoder.h"

#include <algorithm>
#include <cmath>
#include <initializer_list>

namespace megatrain {

DecoderLayer::DecoderLayer(const ModelConfig& config, const UnitLayout& unit, Backend* backend)
    : config_(config),
      unit_(unit),
      backend_(backend),
      qkv_dim_((config.num_heads + 2 * config.num_kv_heads) * config.head_dim) {}

DecoderTensors DecoderLayer::Bind(void* base, DType dtype) const {
  auto at = [&](TensorRole role) -> void* {
    int64_t off = unit_.OffsetOf(role);
    return off < 0 ? nullptr : Offset(base, off, dtype);
  };
  DecoderTensors t;
  t.input_norm = at(TensorRole::kInputNorm);
  auto fused = [&](std::initializer_list<TensorRole> roles) -> void* {
    int64_t off = unit_.OffsetOfFused(roles);
    return off < 0 ? nullptr : Offset(base, off, dtype);
  };
  t.qkv = fused({TensorRole::kQ, TensorRole::kK, TensorRole::kV});
  t.qkv_bias = fused({TensorRole::kQBias, TensorRole::kKBias, TensorRole::kVBias});
  t.q_norm = at(TensorRole::kQNorm);
  t.k_norm = at(TensorRole::kKNorm);
  t.o_proj = at(TensorRole::kOProj);
  t.post_norm = at(TensorRole::kPostNorm);
  t.gate_up = fused({TensorRole::kGate, TensorRole::kUp});
  t.down = at(TensorRole::kDown);
  return t;
}

DecoderTensors DecoderLayer::BindWeights(void* slot) const {
  return Bind(slot, backend_->weight_dtype());
}

DecoderTensors DecoderLayer::BindGrads(void* grads) const {
  return Bind(grads, backend_->grad_dtype());
}

int64_t DecoderLayer::WorkspaceBytes(int64_t n) const {
  int64_t bytes = 0;
  CarveWorkspace(nullptr, n, &bytes);
  return bytes;
}

int64_t DecoderLayer::SavedBytes(int64_t n) const {
  int64_t all = 0, saved = 0;
  CarveWorkspace(nullptr, n, &all, &saved);
  return saved;
}

DecoderSaved DecoderLayer::CarveSaved(void* base, int64_t n, const DecoderSaved& scratch) const {
  DecoderSaved w = CarveWorkspace(base, n);  // the saved fields come first
  if (!config_.qk_norm) w.qkv = scratch.qkv;
  w.h = scratch.h;
  w.h2 = scratch.h2;
  w.a = scratch.a;
  w.dh = scratch.dh;
  w.dqkv = scratch.dqkv;
  w.dq = scratch.dq;
  w.dk = scratch.dk;
  w.dv = scratch.dv;
  w.dout = scratch.dout;
  w.dgu = scratch.dgu;
  w.da = scratch.da;
  return w;
}

DecoderSaved DecoderLayer::CarveWorkspace(void* base, int64_t n, int64_t* bytes,
                                          int64_t* saved_bytes) const {
  const int64_t act = DTypeSize(backend_->act_dtype());
  const int64_t stat = DTypeSize(backend_->stat_dtype());
  const int64_t C = config_.hidden_size, H = config_.num_heads, KV = config_.num_kv_heads;
  const int64_t D = config_.head_dim, I = config_.intermediate_size;
  Carver c(base);
  DecoderSaved w;
  // Saved: what Backward cannot rebuild cheaply. qkv only with QK-norm (its backward reads
  // the unnormalised heads); h, h2 and a are rebuilt from x, x2 and gu (Rebuild).
  w.rstd1 = c.Take(n * stat);
  if (config_.qk_norm) w.qkv = c.Take(n * qkv_dim_ * act);
  w.q = c.Take(n * H * D * act);
  w.k = c.Take(n * KV * D * act);
  w.v = c.Take(n * KV * D * act);
  w.rstd_q = c.Take(n * H * stat);
  w.rstd_k = c.Take(n * KV * stat);
  w.o = c.Take(n * H * D * act);
  w.lse = c.Take(n * H * stat);
  w.x2 = c.Take(n * C * act);
  w.rstd2 = c.Take(n * stat);
  w.gu = c.Take(n * 2 * I * act);
  if (saved_bytes != nullptr) *saved_bytes = c.used();  // the scratch follows
  if (!config_.qk_norm) w.qkv = c.Take(n * qkv_dim_ * act);
  w.h = c.Take(n * C * act);
  w.h2 = c.Take(n * C * act);
  w.a = c.Take(n * I * act);
  w.dh = c.Take(n * C * act);
  w.dqkv = c.Take(n * qkv_dim_ * act);
  w.dq = c.Take(n * H * D * act);
  w.dk = c.Take(n * KV * D * act);
  w.dv = c.Take(n * KV * D * act);
  w.dout = c.Take(n * H * D * act);
  w.dgu = c.Take(n * 2 * I * act);
  w.da = c.Take(n * I * act);
  if (bytes != nullptr) *bytes = c.used();
  return w;
}

DecoderSaved DecoderLayer::SavedOf(const LayerCall& call) const {
  const int64_t n = call.batch->num_tokens;
  const DecoderSaved scratch = CarveWorkspace(call.workspace, n);
  return call.saved == nullptr ? scratch : CarveSaved(call.saved, n, scratch);
}

LayerWork DecoderLayer::Work(int64_t n, int64_t seq_len, int64_t act_bytes) const {
  const int64_t hd = config_.num_heads * config_.head_dim, C = config_.hidden_size;
  const int64_t I = config_.intermediate_size;
  LayerWork w;
  w.matmuls = {{C, qkv_dim_}, {hd, C}, {C, 2 * I}, {I, C}};
  w.attention_flops = 2.0 * n * std::min(seq_len, n) * hd;
  // Per token: the norms read x and write h (twice), RoPE rewrites q and k, SwiGLU reads
  // gate and up and writes a, the residuals read and write C each.
  w.elementwise_bytes =
      static_cast<double>(act_bytes) * n * (8 * C + 2 * qkv_dim_ + 2 * hd + 3 * I);
  // Rebuild: two norms (read x, write h) and a SwiGLU (read g and u, write a).
  w.rebuild_bytes = static_cast<double>(act_bytes) * n * (4 * C + 3 * I);
  return w;
}

void DecoderLayer::Forward(const LayerCall& call, const void* x, void* out) const {
  Forward(BindWeights(const_cast<void*>(call.weights)), x, out, SavedOf(call), *call.batch,
          call.rope_inv_freq, call.stream);
}

void DecoderLayer::Rebuild(const LayerCall& call, const void* x) const {
  Rebuild(BindWeights(const_cast<void*>(call.weights)), x, SavedOf(call), *call.batch,
          call.stream);
}

void DecoderLayer::Backward(const LayerCall& call, const void* x, void* dres) const {
  Backward(BindWeights(const_cast<void*>(call.weights)), BindGrads(call.grads), x, dres,
           SavedOf(call), *call.batch, call.rope_inv_freq, call.stream);
}

void DecoderLayer::Forward(const DecoderTensors& w, const void* x, void* out,
                           const DecoderSaved& ws, const DeviceBatch& b, const float* inv_freq,
                           StreamId s) const {
  Backend& be = *backend_;
  const int64_t n = b.num_tokens, C = config_.hidden_size, H = config_.num_heads;
  const int64_t KV = config_.num_kv_heads, D = config_.head_dim;
  const int64_t I = config_.intermediate_size;
  const double eps = config_.rms_norm_eps;
  // attention half
  be.RmsNorm(ws.h, ws.rstd1, x, w.input_norm, n, C, eps, s);                // h = norm(x)
  be.Linear(ws.qkv, ws.h, w.qkv, w.qkv_bias, n, C, qkv_dim_, false, s);      // qkv = h Wqkv^T + b
  be.QkvPrepare(ws.q, ws.k, ws.v, ws.rstd_q, ws.rstd_k, ws.qkv, w.q_norm, w.k_norm,
                b.positions, inv_freq, n, H, KV, D, eps, s);                 // split, QK-norm, RoPE
  be.Attention(ws.o, ws.lse, ws.q, ws.k, ws.v, b.doc_start, n, H, KV, D, s);  // o = attn(q,k,v)
  be.CopyOnDevice(ws.x2, x, n * C * DTypeSize(be.act_dtype()), s);
  be.Linear(ws.x2, ws.o, w.o_proj, nullptr, n, H * D, C, true, s);          // x2 = x + o Wo^T
  // MLP half
  be.RmsNorm(ws.h2, ws.rstd2, ws.x2, w.post_norm, n, C, eps, s);             // h2 = norm(x2)
  be.Linear(ws.gu, ws.h2, w.gate_up, nullptr, n, C, 2 * I, false, s);        // gu = h2 [Wg;Wu]^T
  be.SwiGlu(ws.a, ws.gu, n, I, s);                                           // a = silu(g) * u
  be.CopyOnDevice(out, ws.x2, n * C * DTypeSize(be.act_dtype()), s);
  be.Linear(out, ws.a, w.down, nullptr, n, I, C, true, s);                   // out = x2 + a Wd^T
}

void DecoderLayer::Rebuild(const DecoderTensors& w, const void* x, const DecoderSaved& ws,
                           const DeviceBatch& b, StreamId s) const {
  Backend& be = *backend_;
  const int64_t n = b.num_tokens, C = config_.hidden_size, I = config_.intermediate_size;
  const double eps = config_.rms_norm_eps;
  // The same kernels on the same inputs as Forward: the same bits (rstd is rewritten as is).
  be.RmsNorm(ws.h, ws.rstd1, x, w.input_norm, n, C, eps, s);
  be.RmsNorm(ws.h2, ws.rstd2, ws.x2, w.post_norm, n, C, eps, s);
  be.SwiGlu(ws.a, ws.gu, n, I, s);
}

void DecoderLayer::Backward(const DecoderTensors& w, const DecoderTensors& g, const void* x,
                            void* dres, const DecoderSaved& ws, const DeviceBatch& b,
                            const float* inv_freq, StreamId s) const {
  Backend& be = *backend_;
  const int64_t n = b.num_tokens, C = config_.hidden_size, H = config_.num_heads;
  const int64_t KV = config_.num_kv_heads, D = config_.head_dim;
  const int64_t I = config_.intermediate_size;
  const double eps = config_.rms_norm_eps;
  // MLP half: dres = dL/dout
  be.LinearBackward(ws.da, false, g.down, nullptr, dres, ws.a, w.down, n, I, C, s);
  be.SwiGluBackward(ws.dgu, ws.da, ws.gu, n, I, s);
  be.LinearBackward(ws.dh, false, g.gate_up, nullptr, ws.dgu, ws.h2, w.gate_up, n, C, 2 * I, s);
  be.RmsNormBackward(dres, g.post_norm, ws.dh, ws.x2, w.post_norm, ws.rstd2, n, C, s);
  // attention half: dres = dL/dx2
  be.LinearBackward(ws.dout, false, g.o_proj, nullptr, dres, ws.o, w.o_proj, n, H * D, C, s);
  be.AttentionBackward(ws.dq, ws.dk, ws.dv, ws.dout, ws.q, ws.k, ws.v, ws.o, ws.lse,
                       b.doc_start, n, H, KV, D, s);
  be.QkvPrepareBackward(ws.dqkv, g.q_norm, g.k_norm, ws.dq, ws.dk, ws.dv, ws.qkv, w.q_norm,
                        w.k_norm, ws.rstd_q, ws.rstd_k, b.positions, inv_freq, n, H, KV, D,
                        eps, s);
  be.LinearBackward(ws.dh, false, g.qkv, g.qkv_bias, ws.dqkv, ws.h, w.qkv, n, C, qkv_dim_, s);
  be.RmsNormBackward(dres, g.input_norm, ws.dh, x, w.input_norm, ws.rstd1, n, C, s);
  // dres = dL/dx
}

}  // namespace megatrain
