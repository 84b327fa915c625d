// A backend with the CUDA backend's element types (bf16 weights and activations, f32
// gradients) that runs on the CPU backend: for sizing device plans on a machine without a
// GPU. Every call but the types forwards to a CPU backend.
#pragma once

#include <memory>
#include <string>

#include "engine/backend/cpu_backend.h"
#include "engine/common/backend.h"

namespace megatrain::testing {

class SizingBackend final : public Backend {
 public:
  SizingBackend() : cpu_(CreateCpuBackend(CpuBackendOptions{})) {}
  std::string name() const override { return "cuda:sizing"; }
  BackendKind kind() const override { return BackendKind::kCuda; }
  DType weight_dtype() const override { return DType::kBF16; }
  DType act_dtype() const override { return DType::kBF16; }
  DType grad_dtype() const override { return DType::kF32; }
  DType stat_dtype() const override { return DType::kF32; }
  // clang-format off
  absl::StatusOr<void*> Alloc(size_t bytes) override { return cpu_->Alloc(bytes); }
  void Free(void* ptr) override { cpu_->Free(ptr); }
  absl::Status PinHostRange(void* ptr, size_t bytes) override { return cpu_->PinHostRange(ptr, bytes); }
  void UnpinHostRange(void* ptr) override { cpu_->UnpinHostRange(ptr); }
  void* CreateEvent() override { return cpu_->CreateEvent(); }
  void DestroyEvent(void* event) override { cpu_->DestroyEvent(event); }
  void Record(void* event, StreamId stream) override { cpu_->Record(event, stream); }
  void StreamWait(StreamId stream, void* event) override { cpu_->StreamWait(stream, event); }
  void EventSync(void* event) override { cpu_->EventSync(event); }
  double ElapsedSeconds(void* start, void* end) override { return cpu_->ElapsedSeconds(start, end); }
  void SyncAll() override { cpu_->SyncAll(); }
  void UploadWeights(void* slot, const uint16_t* host_bf16, int64_t n, StreamId s) override { cpu_->UploadWeights(slot, host_bf16, n, s); }
  void UploadWeightsFromF32(void* slot, const float* host_f32, int64_t n, StreamId s) override { cpu_->UploadWeightsFromF32(slot, host_f32, n, s); }
  void DownloadGrads(float* host, const void* grad, int64_t n, StreamId s) override { cpu_->DownloadGrads(host, grad, n, s); }
  void CopyToDevice(void* dst, const void* host, size_t bytes, StreamId s) override { cpu_->CopyToDevice(dst, host, bytes, s); }
  void CopyToHost(void* host, const void* src, size_t bytes, StreamId s) override { cpu_->CopyToHost(host, src, bytes, s); }
  void CopyOnDevice(void* dst, const void* src, size_t bytes, StreamId s) override { cpu_->CopyOnDevice(dst, src, bytes, s); }
  void Zero(void* dst, size_t bytes, StreamId s) override { cpu_->Zero(dst, bytes, s); }
  void Embedding(void* out, const int32_t* tokens, const void* table, int64_t n, int64_t C, StreamId s) override { cpu_->Embedding(out, tokens, table, n, C, s); }
  void EmbeddingBackward(void* dtable, const void* dout, const int32_t* tokens, const int32_t* order, int64_t n, int64_t C, StreamId s) override { cpu_->EmbeddingBackward(dtable, dout, tokens, order, n, C, s); }
  void RmsNorm(void* out, void* rstd, const void* in, const void* w, int64_t rows, int64_t C, double eps, StreamId s) override { cpu_->RmsNorm(out, rstd, in, w, rows, C, eps, s); }
  void RmsNormBackward(void* din, void* dw, const void* dout, const void* in, const void* w, const void* rstd, int64_t rows, int64_t C, StreamId s) override { cpu_->RmsNormBackward(din, dw, dout, in, w, rstd, rows, C, s); }
  void Linear(void* out, const void* in, const void* W, const void* bias, int64_t N, int64_t IC, int64_t OC, bool accumulate, StreamId s) override { cpu_->Linear(out, in, W, bias, N, IC, OC, accumulate, s); }
  void LinearBackward(void* din, bool din_accumulate, void* dW, void* dbias, const void* dout, const void* in, const void* W, int64_t N, int64_t IC, int64_t OC, StreamId s) override { cpu_->LinearBackward(din, din_accumulate, dW, dbias, dout, in, W, N, IC, OC, s); }
  void QkvPrepare(void* q, void* k, void* v, void* rstd_q, void* rstd_k, const void* qkv, const void* q_norm_w, const void* k_norm_w, const int32_t* pos, const float* inv_freq, float rope_scale, int64_t n, int64_t H, int64_t KV, int64_t D, double eps, StreamId s) override { cpu_->QkvPrepare(q, k, v, rstd_q, rstd_k, qkv, q_norm_w, k_norm_w, pos, inv_freq, rope_scale, n, H, KV, D, eps, s); }
  void QkvPrepareBackward(void* dqkv, void* dq_norm_w, void* dk_norm_w, const void* dq, const void* dk, const void* dv, const void* qkv, const void* q_norm_w, const void* k_norm_w, const void* rstd_q, const void* rstd_k, const int32_t* pos, const float* inv_freq, float rope_scale, int64_t n, int64_t H, int64_t KV, int64_t D, double eps, StreamId s) override { cpu_->QkvPrepareBackward(dqkv, dq_norm_w, dk_norm_w, dq, dk, dv, qkv, q_norm_w, k_norm_w, rstd_q, rstd_k, pos, inv_freq, rope_scale, n, H, KV, D, eps, s); }
  void Attention(void* o, void* lse, const void* q, const void* k, const void* v, const int32_t* doc_start, const void* sinks, int64_t window, int64_t n, int64_t H, int64_t KV, int64_t D, StreamId s) override { cpu_->Attention(o, lse, q, k, v, doc_start, sinks, window, n, H, KV, D, s); }
  void AttentionBackward(void* dq, void* dk, void* dv, void* dsinks, const void* dout, const void* q, const void* k, const void* v, const void* o, const void* lse, const int32_t* doc_start, const void* sinks, int64_t window, int64_t n, int64_t H, int64_t KV, int64_t D, StreamId s) override { cpu_->AttentionBackward(dq, dk, dv, dsinks, dout, q, k, v, o, lse, doc_start, sinks, window, n, H, KV, D, s); }
  void SwiGlu(void* out, const void* gu, int64_t N, int64_t I, StreamId s) override { cpu_->SwiGlu(out, gu, N, I, s); }
  void SwiGluBackward(void* dgu, const void* dout, const void* gu, int64_t N, int64_t I, StreamId s) override { cpu_->SwiGluBackward(dgu, dout, gu, N, I, s); }
  void ClampedSwiGlu(void* out, const void* gu, int64_t N, int64_t I, double alpha, double limit, StreamId s) override { cpu_->ClampedSwiGlu(out, gu, N, I, alpha, limit, s); }
  void ClampedSwiGluBackward(void* dgu, const void* dout, const void* gu, int64_t N, int64_t I, double alpha, double limit, StreamId s) override { cpu_->ClampedSwiGluBackward(dgu, dout, gu, N, I, alpha, limit, s); }
  void CrossEntropy(void* dlogits, void* loss, const void* logits, const int32_t* targets, int64_t N, int64_t V, double scale, StreamId s) override { cpu_->CrossEntropy(dlogits, loss, logits, targets, N, V, scale, s); }
  void MoeRoute(void* probs, int32_t* idx, void* w, const void* logits, int64_t n, int64_t E, int64_t k, bool renorm, StreamId s) override { cpu_->MoeRoute(probs, idx, w, logits, n, E, k, renorm, s); }
  void MoeSort(int32_t* offsets, int32_t* slot_of, int32_t* row_token, int32_t* scratch, const int32_t* idx, int64_t n, int64_t E, int64_t k, StreamId s) override { cpu_->MoeSort(offsets, slot_of, row_token, scratch, idx, n, E, k, s); }
  void MoeGatherBackward(void* dh, const void* dxe, const int32_t* slot_of, int64_t n, int64_t k, int64_t C, StreamId s) override { cpu_->MoeGatherBackward(dh, dxe, slot_of, n, k, C, s); }
  void GroupedLinear(void* out, const void* in, const void* W, const void* bias, const int32_t* offsets, int64_t E, int64_t IC, int64_t OC, bool w_in_major, StreamId s) override { cpu_->GroupedLinear(out, in, W, bias, offsets, E, IC, OC, w_in_major, s); }
  void GroupedLinearBackward(void* din, void* dW, void* dbias, const void* dout, const void* in, const void* W, const int32_t* offsets, int64_t E, int64_t IC, int64_t OC, bool w_in_major, StreamId s) override { cpu_->GroupedLinearBackward(din, dW, dbias, dout, in, W, offsets, E, IC, OC, w_in_major, s); }
  void MoeCombine(void* out, const void* ye, const int32_t* slot_of, const void* w, int64_t n, int64_t k, int64_t C, StreamId s) override { cpu_->MoeCombine(out, ye, slot_of, w, n, k, C, s); }
  void MoeCombineBackward(void* dye, void* dw, const void* dout, const void* ye, const int32_t* slot_of, const void* w, int64_t n, int64_t k, int64_t C, StreamId s) override { cpu_->MoeCombineBackward(dye, dw, dout, ye, slot_of, w, n, k, C, s); }
  void MoeRouteBackward(void* dlogits, const void* probs, const int32_t* idx, const void* w, const void* dw, const int32_t* counts, double aux_scale, int64_t n, int64_t E, int64_t k, bool renorm, StreamId s) override { cpu_->MoeRouteBackward(dlogits, probs, idx, w, dw, counts, aux_scale, n, E, k, renorm, s); }
  void MoeRouterStats(int32_t* counts, void* prob_sum, const void* probs, const int32_t* idx, int64_t n, int64_t E, int64_t k, StreamId s) override { cpu_->MoeRouterStats(counts, prob_sum, probs, idx, n, E, k, s); }
  // clang-format on
 private:
  std::unique_ptr<Backend> cpu_;
};

}  // namespace megatrain::testing
