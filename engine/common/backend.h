// The backend seam: device memory, three streams, events, copies, and the ops that the
// layer templates call. The pipeline is written once against this interface; the CPU
// backend (threads standing in for streams) and the CUDA backend implement it.
//
// Element types are the backend's choice, per role, so one pipeline serves both:
//   weights in device slots   weight_dtype()  (CUDA: bf16; CPU: f32, or f64 for checks)
//   activations               act_dtype()     (CUDA: bf16; CPU: same as weights)
//   weight gradients          grad_dtype()    (CUDA: f32;  CPU: same as weights)
//   per-row statistics        stat_dtype()    (rstd, logsumexp, per-token loss)
// Ops take untyped device pointers and interpret each argument by its role; the
// comments give each argument's role and shape. Ints (tokens, positions) are int32.
//
// Streams are explicit: every call that enqueues work names its stream and returns at
// once. Inputs may be reused only after an event recorded behind the work has completed.
// Thread-compatible: one host thread drives a backend's streams.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "engine/common/dtype.h"
#include "engine/common/adamw_math.h"
#include "engine/common/preference_math.h"

namespace megatrain {

enum class StreamId { kCompute = 0, kH2D = 1, kD2H = 2 };
constexpr int kNumStreams = 3;

// What a backend runs on. The CPU backend's "device memory" is the box's shared RAM and
// its streams are threads: the planner and the trainer branch on this, never on name().
enum class BackendKind { kCpu, kCuda };

// The experts' row offsets (E+1) of rows sorted by expert (rows [o[e], o[e+1]) are expert
// e's), as MoeSort writes them on the device; `host`, when not null, holds the same values
// on the host (ReadOffsets), so a backend that launches a GEMM per expert need not read
// them back and wait.
struct ExpertOffsets {
  const int32_t* device = nullptr;
  const int32_t* host = nullptr;
};

class Backend {
 public:
  virtual ~Backend() = default;

  virtual std::string name() const = 0;  // "cpu", "cuda:0"
  virtual BackendKind kind() const = 0;
  virtual DType weight_dtype() const = 0;
  virtual DType act_dtype() const = 0;
  virtual DType grad_dtype() const = 0;
  virtual DType stat_dtype() const = 0;

  // ---- memory (setup time; never on the hot path) ----
  [[nodiscard]] virtual absl::StatusOr<void*> Alloc(size_t bytes) = 0;
  virtual void Free(void* ptr) = 0;
  // Page-locks a host range for async copies (CUDA: cudaHostRegister); no-op on CPU.
  [[nodiscard]] virtual absl::Status PinHostRange(void* ptr, size_t bytes) = 0;
  virtual void UnpinHostRange(void* ptr) = 0;

  // ---- events ----
  virtual void* CreateEvent() = 0;
  virtual void DestroyEvent(void* event) = 0;
  // Marks `event` complete once all work enqueued on `stream` so far is done.
  virtual void Record(void* event, StreamId stream) = 0;
  // Work enqueued on `stream` after this call starts after the latest Record of `event`.
  virtual void StreamWait(StreamId stream, void* event) = 0;
  // Blocks the calling host thread until the latest Record of `event` completed.
  virtual void EventSync(void* event) = 0;
  // Seconds between two completed events (for busy-time accounting).
  virtual double ElapsedSeconds(void* start, void* end) = 0;
  virtual void SyncAll() = 0;
  // Makes this backend's device the calling thread's current one (CUDA keeps one per
  // thread). Whoever drives a backend from a thread calls it first: with several devices
  // in one process (data parallelism) a thread's current device may be another's.
  virtual void BindThread() {}

  // Device memory held now and at most since creation, through Alloc (0 on the CPU).
  virtual int64_t device_bytes_in_use() const { return 0; }
  virtual int64_t device_bytes_peak() const { return 0; }
  // The most this backend may allocate: the job's cap, else the device memory free when
  // it was created. 0 on the CPU (its buffers are host memory).
  virtual int64_t device_memory_budget() const { return 0; }

  // ---- copies ----
  // slot (n) weight  <-  host bf16 (n). The host range stays in use until an event
  // recorded after this call on `stream` completes.
  virtual void UploadWeights(void* slot, const uint16_t* host_bf16, int64_t n, StreamId s) = 0;
  // slot (n) weight  <-  host f32 (n) rounded to bf16 (nearest even) on the device: the
  // bits UploadWeights gives from FloatToBf16 of the same values, with twice the bytes
  // crossing. For a store that keeps no bf16 copy (12 bytes a parameter). The host range
  // stays in use as with UploadWeights. A backend may round on a stream of its own (the
  // CUDA one does): work enqueued on `s` after this call, an event recorded there, sees
  // the rounded slot. REQUIRES: host_f32 16-byte aligned.
  virtual void UploadWeightsFromF32(void* slot, const float* host_f32, int64_t n,
                                    StreamId s) = 0;
  // Device bytes UploadWeightsFromF32 stages through (per stream that calls it).
  virtual int64_t f32_upload_staging_bytes() const { return 0; }
  // host f32 (n)  <-  grad (n)
  virtual void DownloadGrads(float* host, const void* grad, int64_t n, StreamId s) = 0;
  // Raw bytes, host <-> device and device <-> device.
  virtual void CopyToDevice(void* dst, const void* host, size_t bytes, StreamId s) = 0;
  virtual void CopyToHost(void* host, const void* src, size_t bytes, StreamId s) = 0;
  virtual void CopyOnDevice(void* dst, const void* src, size_t bytes, StreamId s) = 0;
  virtual void Zero(void* dst, size_t bytes, StreamId s) = 0;

  // ---- ops (kernels/reference/*.h documents the exact math of each) ----
  // out act (n,C) = table weight (V,C) [tokens (n)]
  virtual void Embedding(void* out, const int32_t* tokens, const void* table, int64_t n,
                         int64_t C, StreamId s) = 0;
  // dtable grad (V,C) += scatter(dout act (n,C)); order (n) is TokenOrder(tokens), the
  // order in which a token's rows are added (a backend may add in position order, the same)
  virtual void EmbeddingBackward(void* dtable, const void* dout, const int32_t* tokens,
                                 const int32_t* order, int64_t n, int64_t C, StreamId s) = 0;
  // out act (rows,C), rstd stat (rows) from in act, w weight (C)
  virtual void RmsNorm(void* out, void* rstd, const void* in, const void* w, int64_t rows,
                       int64_t C, double eps, StreamId s) = 0;
  // din act += ..., dw grad += ...
  virtual void RmsNormBackward(void* din, void* dw, const void* dout, const void* in,
                               const void* w, const void* rstd, int64_t rows, int64_t C,
                               StreamId s) = 0;
  // out act (N,OC) (= or +=) in act (N,IC) . W weight (OC,IC)^T + bias weight (OC)|null
  virtual void Linear(void* out, const void* in, const void* W, const void* bias, int64_t N,
                      int64_t IC, int64_t OC, bool accumulate, StreamId s) = 0;
  // din act (N,IC) (= or +=, null to skip); dW grad (OC,IC) += | null (a frozen weight);
  // dbias grad (OC) += | null
  virtual void LinearBackward(void* din, bool din_accumulate, void* dW, void* dbias,
                              const void* dout, const void* in, const void* W, int64_t N,
                              int64_t IC, int64_t OC, StreamId s) = 0;
  // LoRA beside a frozen projection (kernels/reference/lora.h): t act (N,r) = scale x act
  // (N,IC) A weight (r,IC)^T, written; y act (N,OC) += t B weight (OC,r)^T, y's rows ld_y
  // apart (a column slice of a fused output).
  virtual void LoraForward(void* y, int64_t ld_y, void* t, const void* x, const void* A,
                           const void* B, int64_t N, int64_t IC, int64_t OC, int64_t r,
                           double scale, StreamId s) = 0;
  // Its backward: t act (N,r) = scale x A^T again and dt act (N,r) = dy B (both scratch);
  // dB grad (OC,r) += dy^T t; dA grad (r,IC) += scale dt^T x; dx act (N,IC) += scale dt A.
  // dy act rows ld_dy apart.
  virtual void LoraBackward(void* dx, void* dA, void* dB, void* t, void* dt, const void* dy,
                            int64_t ld_dy, const void* x, const void* A, const void* B, int64_t N,
                            int64_t IC, int64_t OC, int64_t r, double scale, StreamId s) = 0;
  // q (n,H,D), k,v (n,KV,D) act; rstd_q (n*H), rstd_k (n*KV) stat; qkv act;
  // norm weights weight (D) | null; pos (n); inv_freq f32 (D/2), a device buffer;
  // rope_scale multiplies cos and sin (YaRN's attention factor, else 1).
  virtual void QkvPrepare(void* q, void* k, void* v, void* rstd_q, void* rstd_k,
                          const void* qkv, const void* q_norm_w, const void* k_norm_w,
                          const int32_t* pos, const float* inv_freq, float rope_scale,
                          int64_t n, int64_t H, int64_t KV, int64_t D, double eps,
                          StreamId s) = 0;
  // dqkv act written; dq_norm_w, dk_norm_w grad += | null
  virtual void QkvPrepareBackward(void* dqkv, void* dq_norm_w, void* dk_norm_w,
                                  const void* dq, const void* dk, const void* dv,
                                  const void* qkv, const void* q_norm_w, const void* k_norm_w,
                                  const void* rstd_q, const void* rstd_k, const int32_t* pos,
                                  const float* inv_freq, float rope_scale, int64_t n,
                                  int64_t H, int64_t KV, int64_t D, double eps,
                                  StreamId s) = 0;
  // o act (n,H,D), lse stat (n,H); causal within documents given by doc_start (n); sinks
  // weight (H) | null: one logit per head in each softmax sum (lse includes it); window > 0:
  // query i sees only keys i - j < window (0: none) (kernels/reference/attention.h)
  virtual void Attention(void* o, void* lse, const void* q, const void* k, const void* v,
                         const int32_t* doc_start, const void* sinks, int64_t window, int64_t n,
                         int64_t H, int64_t KV, int64_t D, StreamId s) = 0;
  // dq, dk, dv act written; dsinks grad (H) += | null (needs sinks)
  virtual void AttentionBackward(void* dq, void* dk, void* dv, void* dsinks, const void* dout,
                                 const void* q, const void* k, const void* v, const void* o,
                                 const void* lse, const int32_t* doc_start, const void* sinks,
                                 int64_t window, int64_t n, int64_t H, int64_t KV, int64_t D,
                                 StreamId s) = 0;
  // Generation (kernels/reference/decode_attention.h). A layer's KV cache is k_cache,
  // v_cache act (slots, max_len, KV, D) each, a slot's keys in position order.
  // k_cache, v_cache [seq_slot[i], position[i]] = k, v act (n,KV,D) [i]; seq_slot, position
  // int32 (n), 0 <= position < max_len; the rest of the caches is left as it was. Prefill
  // writes all prompt tokens of the sequences it packs, decode one token per sequence.
  // REQUIRES (CUDA): KV*D % 8 == 0, tensors 16-byte aligned.
  virtual void KvCacheWrite(void* k_cache, void* v_cache, const void* k, const void* v,
                            const int32_t* seq_slot, const int32_t* position, int64_t n,
                            int64_t KV, int64_t D, int64_t max_len, StreamId s) = 0;
  // o act (B,H,D) = attention of q act (B,H,D), row b the newest token of the sequence in
  // slot seq_slot[b] (int32 (B)), over the keys 0 .. length[b]-1 of its slot in the caches
  // (int32 (B), 1 <= length <= max_len: the new key, written by KvCacheWrite, included); sinks
  // and window as in Attention (window > 0: keys (length-1) - j < window). Equals Attention's
  // row for that token with the sequence as one document. Deterministic (the CUDA kernel's
  // split of long caches depends on the shape and the device only).
  // REQUIRES (CUDA): D 64 or 128; the compute stream (it shares the partials scratch).
  virtual void DecodeAttention(void* o, const void* q, const void* k_cache, const void* v_cache,
                               const int32_t* seq_slot, const int32_t* length, const void* sinks,
                               int64_t window, int64_t B, int64_t H, int64_t KV, int64_t D,
                               int64_t max_len, StreamId s) = 0;
  // out act (N,I) = silu(gate) * up, gu act (N,2I) rows [gate | up]
  virtual void SwiGlu(void* out, const void* gu, int64_t N, int64_t I, StreamId s) = 0;
  virtual void SwiGluBackward(void* dgu, const void* dout, const void* gu, int64_t N, int64_t I,
                              StreamId s) = 0;
  // GPT-OSS: out act (N,I) = (clamp(up, +-limit) + 1) * g * sigmoid(alpha * g), g =
  // min(gate, limit); gu act (N,2I) rows [gate | up]; dgu act written (clamped_swiglu.h)
  virtual void ClampedSwiGlu(void* out, const void* gu, int64_t N, int64_t I, double alpha,
                             double limit, StreamId s) = 0;
  virtual void ClampedSwiGluBackward(void* dgu, const void* dout, const void* gu, int64_t N,
                                     int64_t I, double alpha, double limit, StreamId s) = 0;
  // logits act (N,V) -> loss stat (N); dlogits act (may alias logits) = scale*(p - onehot),
  // each row's times row_scale stat (N) [row] when given (a coefficient per token, on the
  // device: DPO's per sequence, GRPO's advantages), else null
  virtual void CrossEntropy(void* dlogits, void* loss, const void* logits,
                            const int32_t* targets, int64_t N, int64_t V, double scale,
                            const void* row_scale, StreamId s) = 0;
  // DPO's coefficient per token for CrossEntropy's row_scale (kernels/reference/
  // preference.h): row_scale stat (N) from values stat (N), each token's -log p(target);
  // sequence int32 (N), each token's sequence in the micro-batch (2k: pair k's chosen, 2k+1
  // its rejected; -1: none); info f64 (S, kPrefFields) per sequence. All device buffers.
  // Deterministic. REQUIRES: S even, S <= kMaxPreferenceSequences.
  virtual void PreferenceRowScale(void* row_scale, const void* values, const int32_t* sequence,
                                  const double* info, int64_t N, int64_t S, PreferenceLoss kind,
                                  double beta, double label_smoothing, StreamId s) = 0;
  // AdamW on n elements of device buffers (common/adamw_math.h): master, m, v f32 (n)
  // updated in place from grad f32 (n) times grad_scale (the clip coefficient); bf16_out
  // (n) the new master's bf16 bits, or null. The same bits as the host optimizer's
  // AdamWUpdate with the step's scalars (MakeAdamWScalars). REQUIRES: the buffers do not
  // overlap.
  virtual void AdamW(void* master, void* m, void* v, void* bf16_out, const void* grad,
                     int64_t n, const AdamWScalars& scalars, float grad_scale, StreamId s) = 0;
  // Greedy decoding on the device (kernels/reference/greedy_pick.h): for each row b of
  // logits act (B,V), ids int32 (B) [b] = the lowest index of the row's maximum and
  // logprobs f32 (B) [b] = logits[b][id] - logsumexp(row), from the row's values as float
  // (CUDA: fp32 sums; CPU: double). A row holding a NaN or +inf, or only -inf, gives id -1
  // and logprob NaN (broken logits, for the caller to report); -inf entries are otherwise
  // masked tokens. ids and logprobs are device buffers; any stream. Deterministic: the same
  // bits run to run; the ids equal the CPU backend's on the same values (ties included), the
  // logprobs to about 1e-6. REQUIRES: 1 <= V < 2^31 - 8.
  virtual void GreedyPick(int32_t* ids, float* logprobs, const void* logits, int64_t B,
                          int64_t V, StreamId s) = 0;

  // ---- mixture of experts (kernels/reference/moe.h; R = n*k rows) ----
  // (The gather of token rows into expert order is Embedding(xe, row_token, h, R, C).)
  // probs stat (n,E), idx (n,k), w stat (n,k) from logits act (n,E)
  virtual void MoeRoute(void* probs, int32_t* idx, void* w, const void* logits, int64_t n,
                        int64_t E, int64_t k, bool renorm, StreamId s) = 0;
  // offsets (E+1), slot_of (R), row_token (R) from idx (n,k); scratch int32
  // (MoeSortScratchInts(R, E)), in use until the stream passes the call
  virtual void MoeSort(int32_t* offsets, int32_t* slot_of, int32_t* row_token, int32_t* scratch,
                       const int32_t* idx, int64_t n, int64_t E, int64_t k, StreamId s) = 0;
  // dh act (n,C) written = sum_j dxe act (R,C) [slot_of (t,j)]
  virtual void MoeGatherBackward(void* dh, const void* dxe, const int32_t* slot_of, int64_t n,
                                 int64_t k, int64_t C, StreamId s) = 0;
  // host int32 (E+1) <- offsets int32 (E+1): blocks until stream s has written them (the
  // one wait of a routing: ExpertOffsets::host then spares the grouped matmuls theirs)
  virtual void ReadOffsets(int32_t* host, const int32_t* offsets, int64_t E, StreamId s) = 0;
  // out act (R,OC) = in act (R,IC) . W_e^T + bias_e per expert's rows, W weight (E,OC,IC)
  // or, with w_in_major, (E,IC,OC) (out = in . W_e: GPT-OSS's experts as transformers keeps
  // them); bias weight (E,OC) | null
  virtual void GroupedLinear(void* out, const void* in, const void* W, const void* bias,
                             const ExpertOffsets& offsets, int64_t E, int64_t IC, int64_t OC,
                             bool w_in_major, StreamId s) = 0;
  // din act (R,IC) written; dW grad (E,OC,IC) or (E,IC,OC) +=, as W, | null (a frozen
  // weight); dbias grad (E,OC) += | null (column sums of each expert's rows of dout,
  // deterministic); experts without rows keep their gradients
  virtual void GroupedLinearBackward(void* din, void* dW, void* dbias, const void* dout,
                                     const void* in, const void* W, const ExpertOffsets& offsets,
                                     int64_t E, int64_t IC, int64_t OC, bool w_in_major,
                                     StreamId s) = 0;
  // LoRA beside each expert's frozen projection (LoraForward per expert over its rows, the
  // rows sorted by expert as for GroupedLinear): t act (R,r) = scale xe A_e^T, written;
  // y act (R,OC) += t B_e^T. A weight (E,r,IC), B weight (E,OC,r), whatever the base
  // weight's orientation.
  virtual void GroupedLoraForward(void* y, void* t, const void* x, const void* A, const void* B,
                                  const ExpertOffsets& offsets, int64_t E, int64_t IC,
                                  int64_t OC, int64_t r, double scale, StreamId s) = 0;
  // Its backward (LoraBackward per expert): t, dt act (R,r) scratch; dB grad (E,OC,r) +=;
  // dA grad (E,r,IC) +=; dx act (R,IC) +=. Experts without rows keep their gradients.
  virtual void GroupedLoraBackward(void* dx, void* dA, void* dB, void* t, void* dt,
                                   const void* dy, const void* x, const void* A, const void* B,
                                   const ExpertOffsets& offsets, int64_t E, int64_t IC,
                                   int64_t OC, int64_t r, double scale, StreamId s) = 0;
  // out act (n,C) += sum_j w stat (n,k) * ye act (R,C) [slot_of]
  virtual void MoeCombine(void* out, const void* ye, const int32_t* slot_of, const void* w,
                          int64_t n, int64_t k, int64_t C, StreamId s) = 0;
  // dye act (R,C) written; dw stat (n,k) written
  virtual void MoeCombineBackward(void* dye, void* dw, const void* dout, const void* ye,
                                  const int32_t* slot_of, const void* w, int64_t n, int64_t k,
                                  int64_t C, StreamId s) = 0;
  // dlogits act (n,E) written; counts (E) | null: the load-balancing term aux_scale*counts
  virtual void MoeRouteBackward(void* dlogits, const void* probs, const int32_t* idx,
                                const void* w, const void* dw, const int32_t* counts,
                                double aux_scale, int64_t n, int64_t E, int64_t k, bool renorm,
                                StreamId s) = 0;
  // counts (E) +=, prob_sum stat (E) += (deterministic)
  virtual void MoeRouterStats(int32_t* counts, void* prob_sum, const void* probs,
                              const int32_t* idx, int64_t n, int64_t E, int64_t k,
                              StreamId s) = 0;
};

// Owns one backend event.
class Event {
 public:
  Event() = default;
  explicit Event(Backend* backend) : backend_(backend), event_(backend->CreateEvent()) {}
  ~Event() { Reset(); }
  Event(Event&& o) noexcept : backend_(o.backend_), event_(o.event_) { o.event_ = nullptr; }
  Event& operator=(Event&& o) noexcept {
    if (this != &o) {
      Reset();
      backend_ = o.backend_;
      event_ = o.event_;
      o.event_ = nullptr;
    }
    return *this;
  }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  void* get() const { return event_; }

 private:
  void Reset() {
    if (event_ != nullptr) backend_->DestroyEvent(event_);
    event_ = nullptr;
  }
  Backend* backend_ = nullptr;
  void* event_ = nullptr;
};

// Owns one device allocation.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  [[nodiscard]] static absl::StatusOr<DeviceBuffer> Allocate(Backend* backend, size_t bytes) {
    DeviceBuffer b;
    if (bytes == 0) return b;
    absl::StatusOr<void*> p = backend->Alloc(bytes);
    if (!p.ok()) return p.status();
    b.backend_ = backend;
    b.ptr_ = *p;
    b.bytes_ = bytes;
    return b;
  }
  ~DeviceBuffer() { Reset(); }
  DeviceBuffer(DeviceBuffer&& o) noexcept : backend_(o.backend_), ptr_(o.ptr_), bytes_(o.bytes_) {
    o.ptr_ = nullptr;
  }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      Reset();
      backend_ = o.backend_;
      ptr_ = o.ptr_;
      bytes_ = o.bytes_;
      o.ptr_ = nullptr;
    }
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void* get() const { return ptr_; }
  size_t bytes() const { return bytes_; }

 private:
  void Reset() {
    if (ptr_ != nullptr) backend_->Free(ptr_);
    ptr_ = nullptr;
  }
  Backend* backend_ = nullptr;
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// Pointer `elements` elements of `dtype` past `base`.
inline void* Offset(void* base, int64_t elements, DType dtype) {
  return static_cast<char*>(base) + elements * DTypeSize(dtype);
}
inline const void* Offset(const void* base, int64_t elements, DType dtype) {
  return static_cast<const char*>(base) + elements * DTypeSize(dtype);
}

}  // namespace megatrain
