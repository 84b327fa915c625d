#include "engine/layers/decoder.h"

#include <algorithm>
#include <cmath>
#include <initializer_list>

#include "engine/model/lora.h"

namespace megatrain {

DecoderLayer::DecoderLayer(const ModelConfig& config, const UnitLayout& unit, Backend* backend,
                           int64_t mlp_tile)
    : config_(config),
      unit_(unit),
      backend_(backend),
      attention_(config, unit, backend, config.AttentionWindow(unit.layer)),
      mlp_tile_(mlp_tile) {}

DecoderTensors DecoderLayer::Bind(void* base, DType dtype) const {
  DecoderTensors t;
  t.attn = BindAttention(unit_, base, dtype);
  t.post_norm = Offset(base, unit_.OffsetOf(TensorRole::kPostNorm), dtype);
  t.gate_up = Offset(base, unit_.OffsetOfFused({TensorRole::kGate, TensorRole::kUp}), dtype);
  t.down = Offset(base, unit_.OffsetOf(TensorRole::kDown), dtype);
  for (int i = 0; i < 3; ++i) {
    const TensorRole role = LoraTargetRole(4 + i);  // gate_proj, up_proj, down_proj
    const TensorSlot* a = unit_.FindLora(role, TensorRole::kLoraA);
    if (a == nullptr) continue;
    t.lora_a[i] = Offset(base, a->offset, dtype);
    t.lora_b[i] = Offset(base, unit_.FindLora(role, TensorRole::kLoraB)->offset, dtype);
  }
  return t;
}

DecoderTensors DecoderLayer::BindWeights(void* slot) const {
  return Bind(slot, backend_->weight_dtype());
}

DecoderTensors DecoderLayer::BindGrads(void* grads, void* discard) const {
  const GradViews g(unit_, grads, discard, backend_->grad_dtype());
  DecoderTensors t;
  t.attn = BindAttentionGrads(unit_, g);
  t.post_norm = g.Vector(unit_.OffsetOf(TensorRole::kPostNorm));
  t.gate_up = UnlessFrozen(unit_, g.Matrix(unit_.OffsetOfFused({TensorRole::kGate, TensorRole::kUp})),
                           {TensorRole::kGate, TensorRole::kUp});
  t.down = UnlessFrozen(unit_, g.Matrix(unit_.OffsetOf(TensorRole::kDown)), {TensorRole::kDown});
  for (int i = 0; i < 3; ++i) {
    const TensorRole role = LoraTargetRole(4 + i);  // gate_proj, up_proj, down_proj
    const TensorSlot* a = unit_.FindLora(role, TensorRole::kLoraA);
    if (a == nullptr) continue;
    t.lora_a[i] = g.Matrix(a->offset);
    t.lora_b[i] = g.Matrix(unit_.FindLora(role, TensorRole::kLoraB)->offset);
  }
  return t;
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
  attention_.UseScratch(scratch.attn, &w.attn);
  w.h2 = scratch.h2;
  if (Tile(n) < n) w.gu = scratch.gu;  // a tile's, recomputed in Backward
  w.a = scratch.a;
  w.dgu = scratch.dgu;
  w.da = scratch.da;
  return w;
}

DecoderSaved DecoderLayer::CarveWorkspace(void* base, int64_t n, int64_t* bytes,
                                          int64_t* saved_bytes) const {
  const int64_t act = DTypeSize(backend_->act_dtype());
  const int64_t stat = DTypeSize(backend_->stat_dtype());
  const int64_t C = config_.hidden_size, I = config_.intermediate_size;
  const int64_t t = Tile(n);  // the MLP half's rows at a time
  Carver c(base);
  DecoderSaved w;
  // Saved: what Backward cannot rebuild cheaply; h2 and a are rebuilt from x2 and gu
  // (tiled: gu too, tile by tile).
  attention_.CarveSaved(c, n, &w.attn);
  w.rstd2 = c.Take(n * stat);
  if (t == n) w.gu = c.Take(n * 2 * I * act);
  if (saved_bytes != nullptr) *saved_bytes = c.used();  // the scratch follows
  attention_.CarveScratch(c, n, &w.attn);
  if (t < n) w.gu = c.Take(t * 2 * I * act);
  w.h2 = c.Take(t * C * act);
  w.a = c.Take(t * I * act);
  w.dgu = c.Take(t * 2 * I * act);
  w.da = c.Take(t * I * act);
  if (bytes != nullptr) *bytes = c.used();
  return w;
}

DecoderSaved DecoderLayer::SavedOf(const LayerCall& call) const {
  const int64_t n = call.batch->num_tokens;
  const DecoderSaved scratch = CarveWorkspace(call.workspace, n);
  return call.saved == nullptr ? scratch : CarveSaved(call.saved, n, scratch);
}

LayerWork DecoderLayer::Work(int64_t n, int64_t seq_len, int64_t act_bytes) const {
  const int64_t C = config_.hidden_size, I = config_.intermediate_size;
  LayerWork w;
  attention_.AddWork(unit_, n, seq_len, act_bytes, &w);
  // Tiled: GEMMs of a tile's rows each, and gate|up again in every backward (kept or not).
  const int64_t tiles = (n + Tile(n) - 1) / Tile(n);
  w.matmuls.push_back({C, 2 * I, 1, tiles, /*rebuilt=*/tiles > 1,
                       !unit_.AnyTrainable({TensorRole::kGate, TensorRole::kUp})});
  w.matmuls.push_back({I, C, 1, tiles, false, !unit_.AnyTrainable({TensorRole::kDown})});
  AddLoraWork(unit_, TensorRole::kGate, C, I, &w);
  AddLoraWork(unit_, TensorRole::kUp, C, I, &w);
  AddLoraWork(unit_, TensorRole::kDown, I, C, &w);
  // Per token: the norm reads x2 and writes h2, SwiGLU reads gate and up and writes a, the
  // residual reads and writes C. Rebuild: the norm and the SwiGLU again.
  w.elementwise_bytes += static_cast<double>(act_bytes) * n * (4 * C + 3 * I);
  w.rebuild_bytes += static_cast<double>(act_bytes) * n * (2 * C + 3 * I);
  return w;
}

void DecoderLayer::Forward(const LayerCall& call, const void* x, void* out) const {
  Forward(BindWeights(const_cast<void*>(call.weights)), x, out, SavedOf(call), *call.batch,
          call.rope_inv_freq, call.stream, call.output_unused, call.kv);
}

void DecoderLayer::Rebuild(const LayerCall& call, const void* x) const {
  Rebuild(BindWeights(const_cast<void*>(call.weights)), x, SavedOf(call), *call.batch,
          call.stream);
}

void DecoderLayer::Backward(const LayerCall& call, const void* x, void* dres) const {
  Backward(BindWeights(const_cast<void*>(call.weights)), BindGrads(call.grads, call.grad_discard), x, dres,
           SavedOf(call), *call.batch, call.rope_inv_freq, call.stream);
}

void DecoderLayer::Forward(const DecoderTensors& w, const void* x, void* out,
                           const DecoderSaved& ws, const DeviceBatch& b, const float* inv_freq,
                           StreamId s, bool output_unused, const KvCacheLayer* kv) const {
  const int64_t n = b.num_tokens, t = Tile(n);
  attention_.Forward(w.attn, x, ws.attn, b, inv_freq, s, kv);               // x2 = x + attn
  if (output_unused && t < n) return;  // Backward recomputes the MLP half tile by tile
  for (int64_t r0 = 0; r0 < n; r0 += t) MlpForward(w, ws, out, r0, std::min(t, n - r0), s);
}

void DecoderLayer::MlpIntermediates(const DecoderTensors& w, const DecoderSaved& ws, int64_t r0,
                                    int64_t rows, StreamId s) const {
  Backend& be = *backend_;
  const int64_t C = config_.hidden_size, I = config_.intermediate_size;
  const void* x2 = Offset(ws.attn.x2, r0 * C, be.act_dtype());
  void* rstd2 = Offset(ws.rstd2, r0, be.stat_dtype());
  be.RmsNorm(ws.h2, rstd2, x2, w.post_norm, rows, C, config_.rms_norm_eps, s);  // h2 = norm(x2)
  be.Linear(ws.gu, ws.h2, w.gate_up, nullptr, rows, C, 2 * I, false, s);  // gu = h2 [Wg;Wu]^T
  for (int i = 0; i < 2; ++i) {  // gu[:, gate|up] += scale (h2 A^T) B^T
    if (w.lora_a[i] == nullptr) continue;
    be.LoraForward(Offset(ws.gu, i * I, be.act_dtype()), 2 * I, ws.attn.lora_t, ws.h2,
                   w.lora_a[i], w.lora_b[i], rows, C, I, unit_.lora_rank, unit_.lora_scale, s);
  }
  be.SwiGlu(ws.a, ws.gu, rows, I, s);                                     // a = silu(g) * u
}

void DecoderLayer::MlpForward(const DecoderTensors& w, const DecoderSaved& ws, void* out,
                              int64_t r0, int64_t rows, StreamId s) const {
  Backend& be = *backend_;
  const int64_t C = config_.hidden_size, I = config_.intermediate_size;
  const DType act = be.act_dtype();
  void* out_rows = Offset(out, r0 * C, act);
  MlpIntermediates(w, ws, r0, rows, s);
  be.CopyOnDevice(out_rows, Offset(ws.attn.x2, r0 * C, act), rows * C * DTypeSize(act), s);
  be.Linear(out_rows, ws.a, w.down, nullptr, rows, I, C, true, s);        // out = x2 + a Wd^T
  if (w.lora_a[2] != nullptr) {  // out += scale (a A^T) B^T
    be.LoraForward(out_rows, C, ws.attn.lora_t, ws.a, w.lora_a[2], w.lora_b[2], rows, I, C,
                   unit_.lora_rank, unit_.lora_scale, s);
  }
}

void DecoderLayer::Rebuild(const DecoderTensors& w, const void* x, const DecoderSaved& ws,
                           const DeviceBatch& b, StreamId s) const {
  Backend& be = *backend_;
  const int64_t n = b.num_tokens, C = config_.hidden_size, I = config_.intermediate_size;
  // The same kernels on the same inputs as Forward: the same bits (rstd is rewritten as is).
  attention_.Rebuild(w.attn, x, ws.attn, n, s);
  if (Tile(n) < n) return;  // Backward rebuilds the MLP half tile by tile
  be.RmsNorm(ws.h2, ws.rstd2, ws.attn.x2, w.post_norm, n, C, config_.rms_norm_eps, s);
  be.SwiGlu(ws.a, ws.gu, n, I, s);
}

void DecoderLayer::Backward(const DecoderTensors& w, const DecoderTensors& g, const void* x,
                            void* dres, const DecoderSaved& ws, const DeviceBatch& b,
                            const float* inv_freq, StreamId s) const {
  const int64_t n = b.num_tokens, t = Tile(n);
  // MLP half: dres = dL/dout -> dL/dx2, tile by tile (tiled: its intermediates recomputed
  // first, exactly as Forward made them).
  for (int64_t r0 = 0; r0 < n; r0 += t) {
    const int64_t rows = std::min(t, n - r0);
    if (t < n) MlpIntermediates(w, ws, r0, rows, s);
    MlpBackward(w, g, ws, dres, r0, rows, s);
  }
  // attention half: dres = dL/dx2 -> dL/dx
  attention_.Backward(w.attn, g.attn, x, dres, ws.attn, b, inv_freq, s);
}

void DecoderLayer::MlpBackward(const DecoderTensors& w, const DecoderTensors& g,
                               const DecoderSaved& ws, void* dres, int64_t r0, int64_t rows,
                               StreamId s) const {
  Backend& be = *backend_;
  const int64_t C = config_.hidden_size, I = config_.intermediate_size;
  const DType act = be.act_dtype();
  void* dres_rows = Offset(dres, r0 * C, act);
  void* dh2 = Offset(ws.attn.dh, r0 * C, act);  // the attention half's dh: free until its own
  const void* x2 = Offset(ws.attn.x2, r0 * C, act);
  const void* rstd2 = Offset(ws.rstd2, r0, be.stat_dtype());
  const int64_t r = unit_.lora_rank;
  const double scale = unit_.lora_scale;
  be.LinearBackward(ws.da, false, g.down, nullptr, dres_rows, ws.a, w.down, rows, I, C, s);
  if (w.lora_a[2] != nullptr) {  // da += the adapter's share; dA, dB
    be.LoraBackward(ws.da, g.lora_a[2], g.lora_b[2], ws.attn.lora_t, ws.attn.lora_dt, dres_rows,
                    C, ws.a, w.lora_a[2], w.lora_b[2], rows, I, C, r, scale, s);
  }
  be.SwiGluBackward(ws.dgu, ws.da, ws.gu, rows, I, s);
  be.LinearBackward(dh2, false, g.gate_up, nullptr, ws.dgu, ws.h2, w.gate_up, rows, C, 2 * I, s);
  for (int i = 0; i < 2; ++i) {  // dh2 += the adapters' share; dA, dB
    if (w.lora_a[i] == nullptr) continue;
    be.LoraBackward(dh2, g.lora_a[i], g.lora_b[i], ws.attn.lora_t, ws.attn.lora_dt,
                    Offset(ws.dgu, i * I, act), 2 * I, ws.h2, w.lora_a[i], w.lora_b[i], rows, C,
                    I, r, scale, s);
  }
  be.RmsNormBackward(dres_rows, g.post_norm, dh2, x2, w.post_norm, rstd2, rows, C, s);
}

}  // namespace megatrain
