#include "engine/layers/attention_block.h"

#include <algorithm>
#include <initializer_list>

#include "engine/model/lora.h"

namespace megatrain {

AttentionTensors BindAttention(const UnitLayout& unit, void* base, DType dtype) {
  auto at = [&](TensorRole role) { return TensorAt(unit, base, role, dtype); };
  auto fused = [&](std::initializer_list<TensorRole> roles) -> void* {
    const int64_t off = unit.OffsetOfFused(roles);
    return off < 0 ? nullptr : Offset(base, off, dtype);
  };
  AttentionTensors t;
  t.input_norm = at(TensorRole::kInputNorm);
  t.qkv = fused({TensorRole::kQ, TensorRole::kK, TensorRole::kV});
  t.qkv_bias = fused({TensorRole::kQBias, TensorRole::kKBias, TensorRole::kVBias});
  t.q_norm = at(TensorRole::kQNorm);
  t.k_norm = at(TensorRole::kKNorm);
  t.o_proj = at(TensorRole::kOProj);
  t.o_bias = at(TensorRole::kOBias);
  t.sinks = at(TensorRole::kSinks);
  for (int i = 0; i < 4; ++i) {
    const TensorSlot* a = unit.FindLora(LoraTargetRole(i), TensorRole::kLoraA);
    const TensorSlot* b = unit.FindLora(LoraTargetRole(i), TensorRole::kLoraB);
    if (a == nullptr) continue;
    t.lora_a[i] = Offset(base, a->offset, dtype);
    t.lora_b[i] = Offset(base, b->offset, dtype);
  }
  return t;
}

AttentionTensors BindAttentionGrads(const UnitLayout& unit, const GradViews& g) {
  AttentionTensors t;
  t.input_norm = g.Vector(unit.OffsetOf(TensorRole::kInputNorm));
  t.qkv = UnlessFrozen(unit, g.Matrix(unit.OffsetOfFused({TensorRole::kQ, TensorRole::kK,
                                                          TensorRole::kV})),
                       {TensorRole::kQ, TensorRole::kK, TensorRole::kV});
  t.qkv_bias = g.Vector(
      unit.OffsetOfFused({TensorRole::kQBias, TensorRole::kKBias, TensorRole::kVBias}));
  t.q_norm = g.Vector(unit.OffsetOf(TensorRole::kQNorm));
  t.k_norm = g.Vector(unit.OffsetOf(TensorRole::kKNorm));
  t.o_proj = UnlessFrozen(unit, g.Matrix(unit.OffsetOf(TensorRole::kOProj)), {TensorRole::kOProj});
  t.o_bias = g.Vector(unit.OffsetOf(TensorRole::kOBias));
  t.sinks = g.Vector(unit.OffsetOf(TensorRole::kSinks));
  for (int i = 0; i < 4; ++i) {
    const TensorSlot* a = unit.FindLora(LoraTargetRole(i), TensorRole::kLoraA);
    if (a == nullptr) continue;
    t.lora_a[i] = g.Matrix(a->offset);
    t.lora_b[i] = g.Matrix(unit.FindLora(LoraTargetRole(i), TensorRole::kLoraB)->offset);
  }
  return t;
}

AttentionBlock::AttentionBlock(const ModelConfig& config, const UnitLayout& unit,
                               Backend* backend, int64_t window)
    : config_(config),
      backend_(backend),
      qkv_dim_((config.num_heads + 2 * config.num_kv_heads) * config.head_dim),
      window_(window),
      rope_scale_(static_cast<float>(config.rope_scaling.attention_factor)),
      lora_rank_(unit.lora_rank),
      lora_scale_(unit.lora_scale) {}

void AttentionBlock::CarveSaved(Carver& c, int64_t n, AttentionActs* a) const {
  const int64_t act = DTypeSize(backend_->act_dtype());
  const int64_t stat = DTypeSize(backend_->stat_dtype());
  const int64_t C = config_.hidden_size, H = config_.num_heads, KV = config_.num_kv_heads;
  const int64_t D = config_.head_dim;
  a->rstd1 = c.Take(n * stat);
  if (config_.qk_norm) a->qkv = c.Take(n * qkv_dim_ * act);
  a->q = c.Take(n * H * D * act);
  a->k = c.Take(n * KV * D * act);
  a->v = c.Take(n * KV * D * act);
  a->rstd_q = c.Take(n * H * stat);
  a->rstd_k = c.Take(n * KV * stat);
  a->o = c.Take(n * H * D * act);
  a->lse = c.Take(n * H * stat);
  a->x2 = c.Take(n * C * act);
}

void AttentionBlock::CarveScratch(Carver& c, int64_t n, AttentionActs* a) const {
  const int64_t act = DTypeSize(backend_->act_dtype());
  const int64_t C = config_.hidden_size, H = config_.num_heads, KV = config_.num_kv_heads;
  const int64_t D = config_.head_dim;
  if (!config_.qk_norm) a->qkv = c.Take(n * qkv_dim_ * act);
  a->h = c.Take(n * C * act);
  a->dh = c.Take(n * C * act);
  a->dqkv = c.Take(n * qkv_dim_ * act);
  a->dq = c.Take(n * H * D * act);
  a->dk = c.Take(n * KV * D * act);
  a->dv = c.Take(n * KV * D * act);
  a->dout = c.Take(n * H * D * act);
  a->lora_t = c.Take(n * lora_rank_ * act);
  a->lora_dt = c.Take(n * lora_rank_ * act);
}

void AttentionBlock::UseScratch(const AttentionActs& scratch, AttentionActs* a) const {
  if (!config_.qk_norm) a->qkv = scratch.qkv;
  a->h = scratch.h;
  a->dh = scratch.dh;
  a->dqkv = scratch.dqkv;
  a->dq = scratch.dq;
  a->dk = scratch.dk;
  a->dv = scratch.dv;
  a->dout = scratch.dout;
  a->lora_t = scratch.lora_t;
  a->lora_dt = scratch.lora_dt;
}

void AttentionBlock::AddWork(const UnitLayout& unit, int64_t n, int64_t seq_len,
                             int64_t act_bytes, LayerWork* work) const {
  const int64_t hd = config_.num_heads * config_.head_dim, C = config_.hidden_size;
  MatmulShape qkv{C, qkv_dim_}, o{hd, C};
  qkv.frozen = !unit.AnyTrainable({TensorRole::kQ, TensorRole::kK, TensorRole::kV});
  o.frozen = !unit.AnyTrainable({TensorRole::kOProj});
  work->matmuls.push_back(qkv);
  work->matmuls.push_back(o);
  for (int i = 0; i < 3; ++i) AddLoraWork(unit, LoraTargetRole(i), C, QkvWidth(i), work);
  AddLoraWork(unit, TensorRole::kOProj, hd, C, work);
  // 4 hd FLOPs per visible (query, key) pair: L/2 keys per query on average in a causal
  // document of L tokens, W - W^2/(2L) under a window of W < L.
  const double L = static_cast<double>(std::min(seq_len, n)), W = static_cast<double>(window_);
  const double keys = window_ > 0 && W < L ? W - W * W / (2 * L) : L / 2;
  work->attention_flops += 4.0 * n * keys * hd;
  work->attention_head_dim = config_.head_dim;
  // Per token: the norm reads x and writes h, RoPE rewrites q and k, the residual reads and
  // writes C; the rebuild is the norm again.
  work->elementwise_bytes += static_cast<double>(act_bytes) * n * (4 * C + 2 * qkv_dim_ + 2 * hd);
  work->rebuild_bytes += static_cast<double>(act_bytes) * n * 2 * C;
}

void AttentionBlock::Forward(const AttentionTensors& w, const void* x, const AttentionActs& a,
                             const DeviceBatch& b, const float* inv_freq, StreamId s,
                             const KvCacheLayer* kv) const {
  Backend& be = *backend_;
  const int64_t n = b.num_tokens, C = config_.hidden_size, H = config_.num_heads;
  const int64_t KV = config_.num_kv_heads, D = config_.head_dim;
  const double eps = config_.rms_norm_eps;
  be.RmsNorm(a.h, a.rstd1, x, w.input_norm, n, C, eps, s);                  // h = norm(x)
  be.Linear(a.qkv, a.h, w.qkv, w.qkv_bias, n, C, qkv_dim_, false, s);        // qkv = h Wqkv^T + b
  for (int i = 0; i < 3; ++i) {  // qkv[:, q|k|v] += scale (h A^T) B^T
    if (w.lora_a[i] == nullptr) continue;
    be.LoraForward(Offset(a.qkv, QkvColumn(i), be.act_dtype()), qkv_dim_, a.lora_t, a.h,
                   w.lora_a[i], w.lora_b[i], n, C, QkvWidth(i), lora_rank_, lora_scale_, s);
  }
  be.QkvPrepare(a.q, a.k, a.v, a.rstd_q, a.rstd_k, a.qkv, w.q_norm, w.k_norm, b.positions,
                inv_freq, rope_scale_, n, H, KV, D, eps, s);                 // split, QK-norm, RoPE
  if (kv != nullptr) {  // generation: cache[slot, pos] = k, v
    be.KvCacheWrite(kv->k, kv->v, a.k, a.v, b.seq_slot, b.positions, n, KV, D, kv->max_len, s);
  }
  if (kv != nullptr && b.kv_length != nullptr) {  // decode: o = attn(q, cached k, v)
    be.DecodeAttention(a.o, a.q, kv->k, kv->v, b.seq_slot, b.kv_length, w.sinks, window_, n, H,
                       KV, D, kv->max_len, s);
  } else {
    be.Attention(a.o, a.lse, a.q, a.k, a.v, b.doc_start, w.sinks, window_, n, H, KV, D,
                 s);                                                         // o = attn(q,k,v)
  }
  be.CopyOnDevice(a.x2, x, n * C * DTypeSize(be.act_dtype()), s);
  be.Linear(a.x2, a.o, w.o_proj, w.o_bias, n, H * D, C, true, s);           // x2 = x + o Wo^T + b
  if (w.lora_a[3] != nullptr) {  // x2 += scale (o A^T) B^T
    be.LoraForward(a.x2, C, a.lora_t, a.o, w.lora_a[3], w.lora_b[3], n, H * D, C, lora_rank_,
                   lora_scale_, s);
  }
}

void AttentionBlock::Rebuild(const AttentionTensors& w, const void* x, const AttentionActs& a,
                             int64_t n, StreamId s) const {
  // The same kernel on the same input as Forward: the same bits (rstd is rewritten as is).
  backend_->RmsNorm(a.h, a.rstd1, x, w.input_norm, n, config_.hidden_size,
                    config_.rms_norm_eps, s);
}

void AttentionBlock::Backward(const AttentionTensors& w, const AttentionTensors& g,
                              const void* x, void* dres, const AttentionActs& a,
                              const DeviceBatch& b, const float* inv_freq, StreamId s) const {
  Backend& be = *backend_;
  const int64_t n = b.num_tokens, C = config_.hidden_size, H = config_.num_heads;
  const int64_t KV = config_.num_kv_heads, D = config_.head_dim;
  const double eps = config_.rms_norm_eps;
  // dres = dL/dx2
  be.LinearBackward(a.dout, false, g.o_proj, g.o_bias, dres, a.o, w.o_proj, n, H * D, C, s);
  if (w.lora_a[3] != nullptr) {
    be.LoraBackward(a.dout, g.lora_a[3], g.lora_b[3], a.lora_t, a.lora_dt, dres, C, a.o,
                    w.lora_a[3], w.lora_b[3], n, H * D, C, lora_rank_, lora_scale_, s);
  }
  be.AttentionBackward(a.dq, a.dk, a.dv, g.sinks, a.dout, a.q, a.k, a.v, a.o, a.lse,
                       b.doc_start, w.sinks, window_, n, H, KV, D, s);
  be.QkvPrepareBackward(a.dqkv, g.q_norm, g.k_norm, a.dq, a.dk, a.dv, a.qkv, w.q_norm, w.k_norm,
                        a.rstd_q, a.rstd_k, b.positions, inv_freq, rope_scale_, n, H, KV, D, eps,
                        s);
  be.LinearBackward(a.dh, false, g.qkv, g.qkv_bias, a.dqkv, a.h, w.qkv, n, C, qkv_dim_, s);
  for (int i = 0; i < 3; ++i) {  // dh += the adapters' share; dA, dB
    if (w.lora_a[i] == nullptr) continue;
    be.LoraBackward(a.dh, g.lora_a[i], g.lora_b[i], a.lora_t, a.lora_dt,
                    Offset(a.dqkv, QkvColumn(i), be.act_dtype()), qkv_dim_, a.h, w.lora_a[i],
                    w.lora_b[i], n, C, QkvWidth(i), lora_rank_, lora_scale_, s);
  }
  be.RmsNormBackward(dres, g.input_norm, a.dh, x, w.input_norm, a.rstd1, n, C, s);
  // dres = dL/dx
}

}  // namespace megatrain
