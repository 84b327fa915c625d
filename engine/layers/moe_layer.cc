#include "engine/layers/moe_layer.h"

#include "engine/common/check.h"
#include "engine/kernels/moe_scratch.h"
#include "engine/model/lora.h"

namespace megatrain {

MoeLayer::MoeLayer(const ModelConfig& config, const UnitLayout& unit, Backend* backend)
    : config_(config),
      unit_(unit),
      backend_(backend),
      attention_(config, unit, backend, config.AttentionWindow(unit.layer)),
      E_(config.moe.num_experts),
      k_(config.moe.experts_per_token),
      I_(config.moe.intermediate_size),
      in_major_(unit.Find(TensorRole::kExpertGateUpT) != nullptr),
      lora_base_{LoraExpertRole(unit, 0), LoraExpertRole(unit, 1)},
      expert_lora_(unit.FindLora(lora_base_[0], TensorRole::kLoraA) != nullptr ||
                   unit.FindLora(lora_base_[1], TensorRole::kLoraA) != nullptr) {}

MoeTensors MoeLayer::Bind(void* base, DType dtype) const {
  MoeTensors t;
  t.attn = BindAttention(unit_, base, dtype);
  t.post_norm = Offset(base, unit_.OffsetOf(TensorRole::kPostNorm), dtype);
  auto at = [&](TensorRole role) { return TensorAt(unit_, base, role, dtype); };
  t.router = at(TensorRole::kRouter);
  t.gate_up = at(in_major_ ? TensorRole::kExpertGateUpT : TensorRole::kExpertGate);
  t.down = at(in_major_ ? TensorRole::kExpertDownT : TensorRole::kExpertDown);
  t.router_bias = at(TensorRole::kRouterBias);
  t.gate_up_bias = at(TensorRole::kExpertGateUpBias);
  t.down_bias = at(TensorRole::kExpertDownBias);
  for (int i = 0; i < 2; ++i) {
    const TensorSlot* a = unit_.FindLora(lora_base_[i], TensorRole::kLoraA);
    if (a == nullptr) continue;
    t.lora_a[i] = Offset(base, a->offset, dtype);
    t.lora_b[i] = Offset(base, unit_.FindLora(lora_base_[i], TensorRole::kLoraB)->offset, dtype);
  }
  return t;
}

MoeTensors MoeLayer::BindGrads(void* grads, void* discard) const {
  const GradViews g(unit_, grads, discard, backend_->grad_dtype());
  const TensorRole gate_up = in_major_ ? TensorRole::kExpertGateUpT : TensorRole::kExpertGate;
  const TensorRole down = in_major_ ? TensorRole::kExpertDownT : TensorRole::kExpertDown;
  MoeTensors t;
  t.attn = BindAttentionGrads(unit_, g);
  t.post_norm = g.Vector(unit_.OffsetOf(TensorRole::kPostNorm));
  t.router = UnlessFrozen(unit_, g.Matrix(unit_.OffsetOf(TensorRole::kRouter)),
                          {TensorRole::kRouter});
  t.gate_up = UnlessFrozen(
      unit_, g.Matrix(unit_.OffsetOf(gate_up)),
      {TensorRole::kExpertGate, TensorRole::kExpertUp, TensorRole::kExpertGateUpT});
  t.down = UnlessFrozen(unit_, g.Matrix(unit_.OffsetOf(down)),
                        {TensorRole::kExpertDown, TensorRole::kExpertDownT});
  t.router_bias = g.Vector(unit_.OffsetOf(TensorRole::kRouterBias));
  t.gate_up_bias = g.Vector(unit_.OffsetOf(TensorRole::kExpertGateUpBias));
  t.down_bias = g.Vector(unit_.OffsetOf(TensorRole::kExpertDownBias));
  for (int i = 0; i < 2; ++i) {
    const TensorSlot* a = unit_.FindLora(lora_base_[i], TensorRole::kLoraA);
    if (a == nullptr) continue;
    t.lora_a[i] = g.Matrix(a->offset);
    t.lora_b[i] = g.Matrix(unit_.FindLora(lora_base_[i], TensorRole::kLoraB)->offset);
  }
  return t;
}

MoeActs MoeLayer::Carve(void* base, int64_t n, int64_t* bytes, int64_t* saved_bytes) const {
  const int64_t act = DTypeSize(backend_->act_dtype());
  const int64_t stat = DTypeSize(backend_->stat_dtype());
  const int64_t C = config_.hidden_size, R = n * k_;
  Carver c(base);
  MoeActs a;
  auto ints = [&](int64_t count) { return static_cast<int32_t*>(c.Take(count * 4)); };
  attention_.CarveSaved(c, n, &a.attn);
  a.rstd2 = c.Take(n * stat);
  a.probs = c.Take(n * E_ * stat);
  a.idx = ints(n * k_);
  a.w = c.Take(n * k_ * stat);
  a.offsets = ints(E_ + 1);
  a.slot_of = ints(R);
  a.row_token = ints(R);
  a.gu = c.Take(R * 2 * I_ * act);
  a.ye = c.Take(R * C * act);
  if (saved_bytes != nullptr) *saved_bytes = c.used();  // the scratch follows
  attention_.CarveScratch(c, n, &a.attn);
  a.h2 = c.Take(n * C * act);
  a.logits = c.Take(n * E_ * act);
  a.sort_scratch = ints(MoeSortScratchInts(R, E_));
  a.xe = c.Take(R * C * act);
  a.a = c.Take(R * I_ * act);
  a.dw = c.Take(n * k_ * stat);
  a.da = c.Take(R * I_ * act);
  a.dgu = c.Take(R * 2 * I_ * act);
  a.dxe = c.Take(R * C * act);
  a.dlogits = c.Take(n * E_ * act);
  a.lora_t = expert_lora_ ? c.Take(R * unit_.lora_rank * act) : nullptr;
  a.lora_dt = expert_lora_ ? c.Take(R * unit_.lora_rank * act) : nullptr;
  if (bytes != nullptr) *bytes = c.used();
  return a;
}

int64_t MoeLayer::WorkspaceBytes(int64_t n) const {
  int64_t bytes = 0;
  Carve(nullptr, n, &bytes, nullptr);
  return bytes;
}

int64_t MoeLayer::SavedBytes(int64_t n) const {
  int64_t all = 0, saved = 0;
  Carve(nullptr, n, &all, &saved);
  return saved;
}

MoeActs MoeLayer::ActsOf(const LayerCall& call) const {
  const int64_t n = call.batch->num_tokens;
  const MoeActs scratch = Carve(call.workspace, n, nullptr, nullptr);
  if (call.saved == nullptr) return scratch;
  MoeActs a = Carve(call.saved, n, nullptr, nullptr);  // the saved fields come first
  attention_.UseScratch(scratch.attn, &a.attn);
  a.h2 = scratch.h2;
  a.logits = scratch.logits;
  a.sort_scratch = scratch.sort_scratch;
  a.xe = scratch.xe;
  a.a = scratch.a;
  a.dw = scratch.dw;
  a.da = scratch.da;
  a.dgu = scratch.dgu;
  a.dxe = scratch.dxe;
  a.dlogits = scratch.dlogits;
  a.lora_t = scratch.lora_t;
  a.lora_dt = scratch.lora_dt;
  return a;
}

LayerWork MoeLayer::Work(int64_t n, int64_t seq_len, int64_t act_bytes) const {
  const int64_t C = config_.hidden_size;
  LayerWork w;
  attention_.AddWork(unit_, n, seq_len, act_bytes, &w);
  const bool experts_frozen =
      !unit_.AnyTrainable({TensorRole::kExpertGate, TensorRole::kExpertUp,
                           TensorRole::kExpertGateUpT});
  w.matmuls.push_back({C, E_, 1, 1, false, !unit_.AnyTrainable({TensorRole::kRouter})});
  w.matmuls.push_back({C, 2 * I_, k_, E_, false, experts_frozen});
  w.matmuls.push_back({I_, C, k_, E_, false,
                       !unit_.AnyTrainable({TensorRole::kExpertDown, TensorRole::kExpertDownT})});
  AddLoraWork(unit_, lora_base_[0], C, 2 * I_, &w, k_, E_);
  AddLoraWork(unit_, lora_base_[1], I_, C, &w, k_, E_);
  // Per token: the norm (read x2, write h2), the gather (k rows of C each way), SwiGLU (k
  // times 3I), the combine (k rows read, the residual read and written). Rebuild: the
  // norm, the gather and the SwiGLU again.
  const double per_token = 2 * C + 2 * k_ * C + 3 * k_ * I_ + k_ * C + 2 * C;
  w.elementwise_bytes += static_cast<double>(act_bytes) * n * per_token;
  w.rebuild_bytes += static_cast<double>(act_bytes) * n * (2 * C + 2 * k_ * C + 3 * k_ * I_);
  return w;
}

void MoeLayer::PostNorm(const MoeTensors& w, const MoeActs& a, int64_t n, StreamId s) const {
  const int64_t C = config_.hidden_size;
  backend_->RmsNorm(a.h2, a.rstd2, a.attn.x2, w.post_norm, n, C, config_.rms_norm_eps, s);
}

void MoeLayer::Activation(const MoeActs& a, int64_t rows, StreamId s) const {
  const MoeConfig& m = config_.moe;
  if (m.gpt_oss_experts) {
    backend_->ClampedSwiGlu(a.a, a.gu, rows, I_, m.swiglu_alpha, m.swiglu_limit, s);
  } else {
    backend_->SwiGlu(a.a, a.gu, rows, I_, s);
  }
}

void MoeLayer::ActivationBackward(const MoeActs& a, int64_t rows, StreamId s) const {
  const MoeConfig& m = config_.moe;
  if (m.gpt_oss_experts) {
    backend_->ClampedSwiGluBackward(a.dgu, a.da, a.gu, rows, I_, m.swiglu_alpha, m.swiglu_limit,
                                    s);
  } else {
    backend_->SwiGluBackward(a.dgu, a.da, a.gu, rows, I_, s);
  }
}

void MoeLayer::Forward(const LayerCall& call, const void* x, void* out) const {
  Backend& be = *backend_;
  const MoeTensors w = BindWeights(const_cast<void*>(call.weights));
  const MoeActs a = ActsOf(call);
  const DeviceBatch& b = *call.batch;
  const StreamId s = call.stream;
  const int64_t n = b.num_tokens, C = config_.hidden_size, R = n * k_;
  attention_.Forward(w.attn, x, a.attn, b, call.rope_inv_freq, s, call.kv);  // x2 = x + attn
  PostNorm(w, a, n, s);                                                     // h2 = norm(x2)
  be.Linear(a.logits, a.h2, w.router, w.router_bias, n, C, E_, false, s);   // logits = h2 Wr^T + b
  be.MoeRoute(a.probs, a.idx, a.w, a.logits, n, E_, k_, config_.moe.norm_topk_prob, s);
  if (call.first_forward && call.router_stats != nullptr) {
    be.MoeRouterStats(call.router_stats->counts, call.router_stats->prob_sum, a.probs, a.idx, n,
                      E_, k_, s);
  }
  be.MoeSort(a.offsets, a.slot_of, a.row_token, a.sort_scratch, a.idx, n, E_, k_, s);
  if (call.host_offsets != nullptr && call.first_forward) {
    be.ReadOffsets(call.host_offsets, a.offsets, E_, s);  // the experts' row counts, once
  }
  const ExpertOffsets offsets{a.offsets, call.host_offsets};
  be.Embedding(a.xe, a.row_token, a.h2, R, C, s);                          // xe = h2[rows]
  const int64_t r = unit_.lora_rank;
  const double scale = unit_.lora_scale;
  be.GroupedLinear(a.gu, a.xe, w.gate_up, w.gate_up_bias, offsets, E_, C, 2 * I_, in_major_,
                   s);                                                      // gu = xe Wgu^T + b
  if (w.lora_a[0] != nullptr) {  // gu += scale (xe A^T) B^T
    be.GroupedLoraForward(a.gu, a.lora_t, a.xe, w.lora_a[0], w.lora_b[0], offsets, E_, C,
                          2 * I_, r, scale, s);
  }
  Activation(a, R, s);                                                      // a = silu(g) * u
  be.GroupedLinear(a.ye, a.a, w.down, w.down_bias, offsets, E_, I_, C, in_major_,
                   s);                                                      // ye = a Wd^T + b
  if (w.lora_a[1] != nullptr) {  // ye += scale (a A^T) B^T
    be.GroupedLoraForward(a.ye, a.lora_t, a.a, w.lora_a[1], w.lora_b[1], offsets, E_, I_, C, r,
                          scale, s);
  }
  be.CopyOnDevice(out, a.attn.x2, n * C * DTypeSize(be.act_dtype()), s);
  be.MoeCombine(out, a.ye, a.slot_of, a.w, n, k_, C, s);                   // out = x2 + sum w ye
}

void MoeLayer::Rebuild(const LayerCall& call, const void* x) const {
  Backend& be = *backend_;
  const MoeTensors w = BindWeights(const_cast<void*>(call.weights));
  const MoeActs a = ActsOf(call);
  const int64_t n = call.batch->num_tokens, R = n * k_;
  // The same kernels on the same inputs as Forward: the same bits.
  attention_.Rebuild(w.attn, x, a.attn, n, call.stream);
  PostNorm(w, a, n, call.stream);
  be.Embedding(a.xe, a.row_token, a.h2, R, config_.hidden_size, call.stream);
  Activation(a, R, call.stream);
}

void MoeLayer::Backward(const LayerCall& call, const void* x, void* dres) const {
  Backend& be = *backend_;
  const MoeTensors w = BindWeights(const_cast<void*>(call.weights));
  const MoeTensors g = BindGrads(call.grads, call.grad_discard);
  const MoeActs a = ActsOf(call);
  const DeviceBatch& b = *call.batch;
  const StreamId s = call.stream;
  const int64_t n = b.num_tokens, C = config_.hidden_size, R = n * k_;
  void* dh2 = a.attn.dh;  // the attention half's dh is free until its own backward
  void* dye = a.dxe;
  const bool renorm = config_.moe.norm_topk_prob;
  const RouterStats* stats = call.router_stats;
  const bool aux = stats != nullptr && stats->aux_scale != 0;
  const ExpertOffsets offsets{a.offsets, call.host_offsets};
  // experts: dres = dL/dout
  be.MoeCombineBackward(dye, a.dw, dres, a.ye, a.slot_of, a.w, n, k_, C, s);
  const int64_t r = unit_.lora_rank;
  const double scale = unit_.lora_scale;
  be.GroupedLinearBackward(a.da, g.down, g.down_bias, dye, a.a, w.down, offsets, E_, I_, C,
                           in_major_, s);
  if (w.lora_a[1] != nullptr) {  // da += the adapter's share; dA, dB
    be.GroupedLoraBackward(a.da, g.lora_a[1], g.lora_b[1], a.lora_t, a.lora_dt, dye, a.a,
                           w.lora_a[1], w.lora_b[1], offsets, E_, I_, C, r, scale, s);
  }
  ActivationBackward(a, R, s);
  be.GroupedLinearBackward(a.dxe, g.gate_up, g.gate_up_bias, a.dgu, a.xe, w.gate_up, offsets,
                           E_, C, 2 * I_, in_major_, s);
  if (w.lora_a[0] != nullptr) {
    be.GroupedLoraBackward(a.dxe, g.lora_a[0], g.lora_b[0], a.lora_t, a.lora_dt, a.dgu, a.xe,
                           w.lora_a[0], w.lora_b[0], offsets, E_, C, 2 * I_, r, scale, s);
  }
  be.MoeGatherBackward(dh2, a.dxe, a.slot_of, n, k_, C, s);
  // router: dL/dw through the top-k and the softmax, plus the load-balancing term
  be.MoeRouteBackward(a.dlogits, a.probs, a.idx, a.w, a.dw, aux ? stats->counts : nullptr,
                      aux ? stats->aux_scale : 0.0, n, E_, k_, renorm, s);
  be.LinearBackward(dh2, true, g.router, g.router_bias, a.dlogits, a.h2, w.router, n, C, E_, s);
  be.RmsNormBackward(dres, g.post_norm, dh2, a.attn.x2, w.post_norm, a.rstd2, n, C, s);
  // attention half: dres = dL/dx2 -> dL/dx
  attention_.Backward(w.attn, g.attn, x, dres, a.attn, b, call.rope_inv_freq, s);
}

}  // namespace megatrain
