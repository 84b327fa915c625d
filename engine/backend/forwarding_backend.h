// A backend that forwards every call to another (its inner backend): the base of backends
// that change or watch a few calls (the planning backend, planning_backend.h; the tests'
// probes of the calls the pipeline makes). Override what differs; call the base for the rest.
#pragma once

#include <memory>
#include <string>
#include <utility>

#include "engine/common/backend.h"

namespace megatrain {

class ForwardingBackend : public Backend {
 public:
  explicit ForwardingBackend(std::unique_ptr<Backend> inner) : inner_(std::move(inner)) {}
  std::string name() const override { return inner_->name(); }
  BackendKind kind() const override { return inner_->kind(); }
  DType weight_dtype() const override { return inner_->weight_dtype(); }
  DType act_dtype() const override { return inner_->act_dtype(); }
  DType grad_dtype() const override { return inner_->grad_dtype(); }
  DType stat_dtype() const override { return inner_->stat_dtype(); }
  // clang-format off
  absl::StatusOr<void*> Alloc(size_t bytes) override { return inner_->Alloc(bytes); }
  void Free(void* ptr) override { inner_->Free(ptr); }
  absl::Status PinHostRange(void* ptr, size_t bytes) override { return inner_->PinHostRange(ptr, bytes); }
  void UnpinHostRange(void* ptr) override { inner_->UnpinHostRange(ptr); }
  void* CreateEvent() override { return inner_->CreateEvent(); }
  void DestroyEvent(void* event) override { inner_->DestroyEvent(event); }
  void Record(void* event, StreamId stream) override { inner_->Record(event, stream); }
  void StreamWait(StreamId stream, void* event) override { inner_->StreamWait(stream, event); }
  void EventSync(void* event) override { inner_->EventSync(event); }
  double ElapsedSeconds(void* start, void* end) override { return inner_->ElapsedSeconds(start, end); }
  void SyncAll() override { inner_->SyncAll(); }
  void UploadWeights(void* slot, const uint16_t* host_bf16, int64_t n, StreamId s) override { inner_->UploadWeights(slot, host_bf16, n, s); }
  void UploadWeightsFromF32(void* slot, const float* host_f32, int64_t n, StreamId s) override { inner_->UploadWeightsFromF32(slot, host_f32, n, s); }
  void DownloadGrads(float* host, const void* grad, int64_t n, StreamId s) override { inner_->DownloadGrads(host, grad, n, s); }
  void CopyToDevice(void* dst, const void* host, size_t bytes, StreamId s) override { inner_->CopyToDevice(dst, host, bytes, s); }
  void CopyToHost(void* host, const void* src, size_t bytes, StreamId s) override { inner_->CopyToHost(host, src, bytes, s); }
  void CopyOnDevice(void* dst, const void* src, size_t bytes, StreamId s) override { inner_->CopyOnDevice(dst, src, bytes, s); }
  void Zero(void* dst, size_t bytes, StreamId s) override { inner_->Zero(dst, bytes, s); }
  void Embedding(void* out, const int32_t* tokens, const void* table, int64_t n, int64_t C, StreamId s) override { inner_->Embedding(out, tokens, table, n, C, s); }
  void EmbeddingBackward(void* dtable, const void* dout, const int32_t* tokens, const int32_t* order, int64_t n, int64_t C, StreamId s) override { inner_->EmbeddingBackward(dtable, dout, tokens, order, n, C, s); }
  void RmsNorm(void* out, void* rstd, const void* in, const void* w, int64_t rows, int64_t C, double eps, StreamId s) override { inner_->RmsNorm(out, rstd, in, w, rows, C, eps, s); }
  void RmsNormBackward(void* din, void* dw, const void* dout, const void* in, const void* w, const void* rstd, int64_t rows, int64_t C, StreamId s) override { inner_->RmsNormBackward(din, dw, dout, in, w, rstd, rows, C, s); }
  void Linear(void* out, const void* in, const void* W, const void* bias, int64_t N, int64_t IC, int64_t OC, bool accumulate, StreamId s) override { inner_->Linear(out, in, W, bias, N, IC, OC, accumulate, s); }
  void LoraForward(void* y, int64_t ld_y, void* t, const void* x, const void* A, const void* B, int64_t N, int64_t IC, int64_t OC, int64_t r, double scale, StreamId s) override { inner_->LoraForward(y, ld_y, t, x, A, B, N, IC, OC, r, scale, s); }
  void LoraBackward(void* dx, void* dA, void* dB, void* t, void* dt, const void* dy, int64_t ld_dy, const void* x, const void* A, const void* B, int64_t N, int64_t IC, int64_t OC, int64_t r, double scale, StreamId s) override { inner_->LoraBackward(dx, dA, dB, t, dt, dy, ld_dy, x, A, B, N, IC, OC, r, scale, s); }
  void LinearBackward(void* din, bool din_accumulate, void* dW, void* dbias, const void* dout, const void* in, const void* W, int64_t N, int64_t IC, int64_t OC, StreamId s) override { inner_->LinearBackward(din, din_accumulate, dW, dbias, dout, in, W, N, IC, OC, s); }
  void QkvPrepare(void* q, void* k, void* v, void* rstd_q, void* rstd_k, const void* qkv, const void* q_norm_w, const void* k_norm_w, const int32_t* pos, const float* inv_freq, float rope_scale, int64_t n, int64_t H, int64_t KV, int64_t D, double eps, StreamId s) override { inner_->QkvPrepare(q, k, v, rstd_q, rstd_k, qkv, q_norm_w, k_norm_w, pos, inv_freq, rope_scale, n, H, KV, D, eps, s); }
  void QkvPrepareBackward(void* dqkv, void* dq_norm_w, void* dk_norm_w, const void* dq, const void* dk, const void* dv, const void* qkv, const void* q_norm_w, const void* k_norm_w, const void* rstd_q, const void* rstd_k, const int32_t* pos, const float* inv_freq, float rope_scale, int64_t n, int64_t H, int64_t KV, int64_t D, double eps, StreamId s) override { inner_->QkvPrepareBackward(dqkv, dq_norm_w, dk_norm_w, dq, dk, dv, qkv, q_norm_w, k_norm_w, rstd_q, rstd_k, pos, inv_freq, rope_scale, n, H, KV, D, eps, s); }
  void Attention(void* o, void* lse, const void* q, const void* k, const void* v, const int32_t* doc_start, const void* sinks, int64_t window, int64_t n, int64_t H, int64_t KV, int64_t D, StreamId s) override { inner_->Attention(o, lse, q, k, v, doc_start, sinks, window, n, H, KV, D, s); }
  void AttentionBackward(void* dq, void* dk, void* dv, void* dsinks, const void* dout, const void* q, const void* k, const void* v, const void* o, const void* lse, const int32_t* doc_start, const void* sinks, int64_t window, int64_t n, int64_t H, int64_t KV, int64_t D, StreamId s) override { inner_->AttentionBackward(dq, dk, dv, dsinks, dout, q, k, v, o, lse, doc_start, sinks, window, n, H, KV, D, s); }
  void KvCacheWrite(void* k_cache, void* v_cache, const void* k, const void* v, const int32_t* seq_slot, const int32_t* position, int64_t n, int64_t KV, int64_t D, int64_t max_len, StreamId s) override { inner_->KvCacheWrite(k_cache, v_cache, k, v, seq_slot, position, n, KV, D, max_len, s); }
  void DecodeAttention(void* o, const void* q, const void* k_cache, const void* v_cache, const int32_t* seq_slot, const int32_t* length, const void* sinks, int64_t window, int64_t B, int64_t H, int64_t KV, int64_t D, int64_t max_len, StreamId s) override { inner_->DecodeAttention(o, q, k_cache, v_cache, seq_slot, length, sinks, window, B, H, KV, D, max_len, s); }
  void SwiGlu(void* out, const void* gu, int64_t N, int64_t I, StreamId s) override { inner_->SwiGlu(out, gu, N, I, s); }
  void SwiGluBackward(void* dgu, const void* dout, const void* gu, int64_t N, int64_t I, StreamId s) override { inner_->SwiGluBackward(dgu, dout, gu, N, I, s); }
  void ClampedSwiGlu(void* out, const void* gu, int64_t N, int64_t I, double alpha, double limit, StreamId s) override { inner_->ClampedSwiGlu(out, gu, N, I, alpha, limit, s); }
  void ClampedSwiGluBackward(void* dgu, const void* dout, const void* gu, int64_t N, int64_t I, double alpha, double limit, StreamId s) override { inner_->ClampedSwiGluBackward(dgu, dout, gu, N, I, alpha, limit, s); }
  void CrossEntropy(void* dlogits, void* loss, const void* logits, const int32_t* targets, int64_t N, int64_t V, double scale, const void* row_scale, StreamId s) override { inner_->CrossEntropy(dlogits, loss, logits, targets, N, V, scale, row_scale, s); }
  void AdamW(void* master, void* m, void* v, void* bf16_out, const void* grad, int64_t n, const AdamWScalars& scalars, float grad_scale, StreamId s) override { inner_->AdamW(master, m, v, bf16_out, grad, n, scalars, grad_scale, s); }
  void PreferenceRowScale(void* row_scale, const void* values, const int32_t* sequence, const double* info, int64_t N, int64_t S, PreferenceLoss kind, double beta, double label_smoothing, StreamId s) override { inner_->PreferenceRowScale(row_scale, values, sequence, info, N, S, kind, beta, label_smoothing, s); }
  void GreedyPick(int32_t* ids, float* logprobs, const void* logits, int64_t B, int64_t V, StreamId s) override { inner_->GreedyPick(ids, logprobs, logits, B, V, s); }
  void MoeRoute(void* probs, int32_t* idx, void* w, const void* logits, int64_t n, int64_t E, int64_t k, bool renorm, StreamId s) override { inner_->MoeRoute(probs, idx, w, logits, n, E, k, renorm, s); }
  void MoeSort(int32_t* offsets, int32_t* slot_of, int32_t* row_token, int32_t* scratch, const int32_t* idx, int64_t n, int64_t E, int64_t k, StreamId s) override { inner_->MoeSort(offsets, slot_of, row_token, scratch, idx, n, E, k, s); }
  void MoeGatherBackward(void* dh, const void* dxe, const int32_t* slot_of, int64_t n, int64_t k, int64_t C, StreamId s) override { inner_->MoeGatherBackward(dh, dxe, slot_of, n, k, C, s); }
  void ReadOffsets(int32_t* host, const int32_t* offsets, int64_t E, StreamId s) override { inner_->ReadOffsets(host, offsets, E, s); }
  void GroupedLinear(void* out, const void* in, const void* W, const void* bias, const ExpertOffsets& offsets, int64_t E, int64_t IC, int64_t OC, bool w_in_major, StreamId s) override { inner_->GroupedLinear(out, in, W, bias, offsets, E, IC, OC, w_in_major, s); }
  void GroupedLinearBackward(void* din, void* dW, void* dbias, const void* dout, const void* in, const void* W, const ExpertOffsets& offsets, int64_t E, int64_t IC, int64_t OC, bool w_in_major, StreamId s) override { inner_->GroupedLinearBackward(din, dW, dbias, dout, in, W, offsets, E, IC, OC, w_in_major, s); }
  void GroupedLoraForward(void* y, void* t, const void* x, const void* A, const void* B, const ExpertOffsets& offsets, int64_t E, int64_t IC, int64_t OC, int64_t r, double scale, StreamId s) override { inner_->GroupedLoraForward(y, t, x, A, B, offsets, E, IC, OC, r, scale, s); }
  void GroupedLoraBackward(void* dx, void* dA, void* dB, void* t, void* dt, const void* dy, const void* x, const void* A, const void* B, const ExpertOffsets& offsets, int64_t E, int64_t IC, int64_t OC, int64_t r, double scale, StreamId s) override { inner_->GroupedLoraBackward(dx, dA, dB, t, dt, dy, x, A, B, offsets, E, IC, OC, r, scale, s); }
  void MoeCombine(void* out, const void* ye, const int32_t* slot_of, const void* w, int64_t n, int64_t k, int64_t C, StreamId s) override { inner_->MoeCombine(out, ye, slot_of, w, n, k, C, s); }
  void MoeCombineBackward(void* dye, void* dw, const void* dout, const void* ye, const int32_t* slot_of, const void* w, int64_t n, int64_t k, int64_t C, StreamId s) override { inner_->MoeCombineBackward(dye, dw, dout, ye, slot_of, w, n, k, C, s); }
  void MoeRouteBackward(void* dlogits, const void* probs, const int32_t* idx, const void* w, const void* dw, const int32_t* counts, double aux_scale, int64_t n, int64_t E, int64_t k, bool renorm, StreamId s) override { inner_->MoeRouteBackward(dlogits, probs, idx, w, dw, counts, aux_scale, n, E, k, renorm, s); }
  void MoeRouterStats(int32_t* counts, void* prob_sum, const void* probs, const int32_t* idx, int64_t n, int64_t E, int64_t k, StreamId s) override { inner_->MoeRouterStats(counts, prob_sum, probs, idx, n, E, k, s); }
  // clang-format on
 protected:
  Backend* inner() const { return inner_.get(); }

 private:
  std::unique_ptr<Backend> inner_;
};

}  // namespace megatrain
