// CPU backend. Each op becomes a closure on its stream's thread; the closure calls the
// reference kernel for the backend's element type T. Weights arrive as bf16 and widen.
#include "engine/backend/cpu_backend.h"

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/backend/cpu_stream.h"
#include "engine/common/check.h"
#include "engine/kernels/reference/adamw.h"
#include "engine/kernels/reference/attention.h"
#include "engine/kernels/reference/clamped_swiglu.h"
#include "engine/kernels/reference/cross_entropy.h"
#include "engine/kernels/reference/decode_attention.h"
#include "engine/kernels/reference/embedding.h"
#include "engine/kernels/reference/greedy_pick.h"
#include "engine/kernels/reference/linear.h"
#include "engine/kernels/reference/lora.h"
#include "engine/kernels/reference/moe.h"
#include "engine/kernels/reference/preference.h"
#include "engine/kernels/reference/qkv_prepare.h"
#include "engine/kernels/reference/rmsnorm.h"
#include "engine/kernels/reference/swiglu.h"

namespace megatrain {
namespace {

double NowSeconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

template <typename T>
constexpr DType kDTypeOf = std::is_same<T, double>::value ? DType::kF64 : DType::kF32;

template <typename T>
class CpuBackend final : public Backend {
 public:
  std::string name() const override { return "cpu"; }
  BackendKind kind() const override { return BackendKind::kCpu; }
  DType weight_dtype() const override { return kDTypeOf<T>; }
  DType act_dtype() const override { return kDTypeOf<T>; }
  DType grad_dtype() const override { return kDTypeOf<T>; }
  DType stat_dtype() const override { return kDTypeOf<T>; }

  absl::StatusOr<void*> Alloc(size_t bytes) override {
    size_t rounded = (bytes + 63) / 64 * 64;
    void* p = std::aligned_alloc(64, rounded);
    if (p == nullptr) {
      return absl::ResourceExhaustedError(
          absl::StrCat("cpu backend: cannot allocate ", bytes, " bytes"));
    }
    std::memset(p, 0, rounded);
    return p;
  }
  void Free(void* ptr) override { std::free(ptr); }
  absl::Status PinHostRange(void*, size_t) override { return absl::OkStatus(); }
  void UnpinHostRange(void*) override {}

  void* CreateEvent() override { return new CpuEvent; }
  void DestroyEvent(void* event) override { delete static_cast<CpuEvent*>(event); }
  void Record(void* event, StreamId s) override {
    CpuEvent* ev = static_cast<CpuEvent*>(event);
    uint64_t generation;
    {
      std::lock_guard<std::mutex> lock(ev->mu);
      generation = ++ev->recorded;
    }
    On(s, [ev, generation] {
      // Notify under the lock: a waiter that sees the completion may destroy the event at
      // once, so the stream must be done with it before the lock is released.
      std::lock_guard<std::mutex> lock(ev->mu);
      if (generation > ev->completed) ev->completed = generation;
      ev->completed_at_s = NowSeconds();
      ev->cv.notify_all();
    });
  }
  void StreamWait(StreamId s, void* event) override {
    CpuEvent* ev = static_cast<CpuEvent*>(event);
    uint64_t target = Recorded(ev);
    On(s, [ev, target] { ev->WaitFor(target); });
  }
  void EventSync(void* event) override {
    CpuEvent* ev = static_cast<CpuEvent*>(event);
    ev->WaitFor(Recorded(ev));
  }
  double ElapsedSeconds(void* start, void* end) override {
    return static_cast<CpuEvent*>(end)->completed_at_s -
           static_cast<CpuEvent*>(start)->completed_at_s;
  }
  void SyncAll() override {
    for (CpuStream& s : streams_) s.Drain();
  }

  void UploadWeights(void* slot, const uint16_t* host_bf16, int64_t n, StreamId s) override {
    On(s, [=] {
      T* out = static_cast<T*>(slot);
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < n; ++i) out[i] = static_cast<T>(Bf16ToFloat(host_bf16[i]));
    });
  }
  void UploadWeightsFromF32(void* slot, const float* host_f32, int64_t n, StreamId s) override {
    On(s, [=] {
      T* out = static_cast<T*>(slot);
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < n; ++i) out[i] = static_cast<T>(Bf16ToFloat(FloatToBf16(host_f32[i])));
    });
  }
  void DownloadGrads(float* host, const void* grad, int64_t n, StreamId s) override {
    On(s, [=] {
      const T* in = static_cast<const T*>(grad);
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < n; ++i) host[i] = static_cast<float>(in[i]);
    });
  }
  void CopyToDevice(void* dst, const void* host, size_t bytes, StreamId s) override {
    On(s, [=] { std::memcpy(dst, host, bytes); });
  }
  void CopyToHost(void* host, const void* src, size_t bytes, StreamId s) override {
    On(s, [=] { std::memcpy(host, src, bytes); });
  }
  void CopyOnDevice(void* dst, const void* src, size_t bytes, StreamId s) override {
    On(s, [=] { std::memmove(dst, src, bytes); });
  }
  void Zero(void* dst, size_t bytes, StreamId s) override {
    On(s, [=] { std::memset(dst, 0, bytes); });
  }

  void Embedding(void* out, const int32_t* tokens, const void* table, int64_t n, int64_t C,
                 StreamId s) override {
    On(s, [=] { ref::Embedding<T>(P(out), tokens, P(table), n, C); });
  }
  void EmbeddingBackward(void* dtable, const void* dout, const int32_t* tokens,
                         const int32_t* /*order: the reference adds in position order*/,
                         int64_t n, int64_t C, StreamId s) override {
    On(s, [=] { ref::EmbeddingBackward<T>(P(dtable), P(dout), tokens, n, C); });
  }
  void RmsNorm(void* out, void* rstd, const void* in, const void* w, int64_t rows, int64_t C,
               double eps, StreamId s) override {
    On(s, [=] { ref::RmsNorm<T>(P(out), P(rstd), P(in), P(w), rows, C, eps); });
  }
  void RmsNormBackward(void* din, void* dw, const void* dout, const void* in, const void* w,
                       const void* rstd, int64_t rows, int64_t C, StreamId s) override {
    On(s, [=] {
      ref::RmsNormBackward<T>(P(din), P(dw), P(dout), P(in), P(w), P(rstd), rows, C);
    });
  }
  void Linear(void* out, const void* in, const void* W, const void* bias, int64_t N,
              int64_t IC, int64_t OC, bool accumulate, StreamId s) override {
    On(s, [=] { ref::Linear<T>(P(out), P(in), P(W), P(bias), N, IC, OC, accumulate); });
  }
  void LinearBackward(void* din, bool din_accumulate, void* dW, void* dbias, const void* dout,
                      const void* in, const void* W, int64_t N, int64_t IC, int64_t OC,
                      StreamId s) override {
    On(s, [=] {
      ref::LinearBackward<T>(P(din), din_accumulate, P(dW), P(dbias), P(dout), P(in), P(W), N,
                             IC, OC);
    });
  }
  void LoraForward(void* y, int64_t ld_y, void* t, const void* x, const void* A, const void* B,
                   int64_t N, int64_t IC, int64_t OC, int64_t r, double scale,
                   StreamId s) override {
    On(s, [=] { ref::LoraForward<T>(P(y), ld_y, P(t), P(x), P(A), P(B), N, IC, OC, r, scale); });
  }
  void LoraBackward(void* dx, void* dA, void* dB, void* t, void* dt, const void* dy,
                    int64_t ld_dy, const void* x, const void* A, const void* B, int64_t N,
                    int64_t IC, int64_t OC, int64_t r, double scale, StreamId s) override {
    On(s, [=] {
      ref::LoraBackward<T>(P(dx), P(dA), P(dB), P(t), P(dt), P(dy), ld_dy, P(x), P(A), P(B), N,
                           IC, OC, r, scale);
    });
  }
  void QkvPrepare(void* q, void* k, void* v, void* rstd_q, void* rstd_k, const void* qkv,
                  const void* q_norm_w, const void* k_norm_w, const int32_t* pos,
                  const float* inv_freq, float rope_scale, int64_t n, int64_t H, int64_t KV,
                  int64_t D, double eps, StreamId s) override {
    On(s, [=] {
      ref::QkvPrepare<T>(P(q), P(k), P(v), P(rstd_q), P(rstd_k), P(qkv), P(q_norm_w),
                         P(k_norm_w), pos, inv_freq, rope_scale, n, H, KV, D, eps);
    });
  }
  void QkvPrepareBackward(void* dqkv, void* dq_norm_w, void* dk_norm_w, const void* dq,
                          const void* dk, const void* dv, const void* qkv, const void* q_norm_w,
                          const void* k_norm_w, const void* rstd_q, const void* rstd_k,
                          const int32_t* pos, const float* inv_freq, float rope_scale,
                          int64_t n, int64_t H, int64_t KV, int64_t D, double eps,
                          StreamId s) override {
    On(s, [=] {
      ref::QkvPrepareBackward<T>(P(dqkv), P(dq_norm_w), P(dk_norm_w), P(dq), P(dk), P(dv),
                                 P(qkv), P(q_norm_w), P(k_norm_w), P(rstd_q), P(rstd_k), pos,
                                 inv_freq, rope_scale, n, H, KV, D, eps);
    });
  }
  void Attention(void* o, void* lse, const void* q, const void* k, const void* v,
                 const int32_t* doc_start, const void* sinks, int64_t window, int64_t n, int64_t H,
                 int64_t KV, int64_t D, StreamId s) override {
    On(s, [=] {
      ref::Attention<T>(P(o), P(lse), P(q), P(k), P(v), doc_start, P(sinks), window, n, H, KV, D);
    });
  }
  void AttentionBackward(void* dq, void* dk, void* dv, void* dsinks, const void* dout,
                         const void* q, const void* k, const void* v, const void* o,
                         const void* lse, const int32_t* doc_start, const void* sinks,
                         int64_t window, int64_t n, int64_t H, int64_t KV, int64_t D,
                         StreamId s) override {
    On(s, [=] {
      ref::AttentionBackward<T>(P(dq), P(dk), P(dv), P(dsinks), P(dout), P(q), P(k), P(v), P(o),
                                P(lse), doc_start, P(sinks), window, n, H, KV, D);
    });
  }
  void KvCacheWrite(void* k_cache, void* v_cache, const void* k, const void* v,
                    const int32_t* seq_slot, const int32_t* position, int64_t n, int64_t KV,
                    int64_t D, int64_t max_len, StreamId s) override {
    On(s, [=] {
      ref::KvCacheWrite<T>(P(k_cache), P(v_cache), P(k), P(v), seq_slot, position, n, KV, D,
                           max_len);
    });
  }
  void DecodeAttention(void* o, const void* q, const void* k_cache, const void* v_cache,
                       const int32_t* seq_slot, const int32_t* length, const void* sinks,
                       int64_t window, int64_t B, int64_t H, int64_t KV, int64_t D,
                       int64_t max_len, StreamId s) override {
    On(s, [=] {
      ref::DecodeAttention<T>(P(o), P(q), P(k_cache), P(v_cache), seq_slot, length, P(sinks),
                              window, B, H, KV, D, max_len);
    });
  }
  void SwiGlu(void* out, const void* gu, int64_t N, int64_t I, StreamId s) override {
    On(s, [=] { ref::SwiGlu<T>(P(out), P(gu), N, I); });
  }
  void SwiGluBackward(void* dgu, const void* dout, const void* gu, int64_t N, int64_t I,
                      StreamId s) override {
    On(s, [=] { ref::SwiGluBackward<T>(P(dgu), P(dout), P(gu), N, I); });
  }
  void ClampedSwiGlu(void* out, const void* gu, int64_t N, int64_t I, double alpha, double limit,
                     StreamId s) override {
    On(s, [=] { ref::ClampedSwiGlu<T>(P(out), P(gu), N, I, alpha, limit); });
  }
  void ClampedSwiGluBackward(void* dgu, const void* dout, const void* gu, int64_t N, int64_t I,
                             double alpha, double limit, StreamId s) override {
    On(s, [=] { ref::ClampedSwiGluBackward<T>(P(dgu), P(dout), P(gu), N, I, alpha, limit); });
  }
  void CrossEntropy(void* dlogits, void* loss, const void* logits, const int32_t* targets,
                    int64_t N, int64_t V, double scale, const void* row_scale,
                    StreamId s) override {
    On(s, [=] {
      ref::CrossEntropy<T>(P(dlogits), P(loss), P(logits), targets, N, V, scale, P(row_scale));
    });
  }
  void PreferenceRowScale(void* row_scale, const void* values, const int32_t* sequence,
                          const double* info, int64_t N, int64_t S, PreferenceLoss kind,
                          double beta, double label_smoothing, StreamId s) override {
    MT_CHECK(S <= kMaxPreferenceSequences);
    On(s, [=] {
      ref::PreferenceRowScale<T>(P(row_scale), P(values), sequence, info, N, S, kind, beta,
                                 label_smoothing);
    });
  }
  void GreedyPick(int32_t* ids, float* logprobs, const void* logits, int64_t B, int64_t V,
                  StreamId s) override {
    On(s, [=] { ref::GreedyPick<T>(ids, logprobs, P(logits), B, V); });
  }
  void AdamW(void* master, void* m, void* v, void* bf16_out, const void* grad, int64_t n,
             const AdamWScalars& scalars, float grad_scale, StreamId s) override {
    On(s, [=] {
      ref::AdamW(static_cast<float*>(master), static_cast<float*>(m), static_cast<float*>(v),
                 static_cast<uint16_t*>(bf16_out), static_cast<const float*>(grad), n, scalars,
                 grad_scale);
    });
  }

  void MoeRoute(void* probs, int32_t* idx, void* w, const void* logits, int64_t n, int64_t E,
                int64_t k, bool renorm, StreamId s) override {
    On(s, [=] { ref::MoeRoute<T, T>(P(probs), idx, P(w), P(logits), n, E, k, renorm); });
  }
  void MoeSort(int32_t* offsets, int32_t* slot_of, int32_t* row_token, int32_t* /*scratch*/,
               const int32_t* idx, int64_t n, int64_t E, int64_t k, StreamId s) override {
    On(s, [=] { ref::MoeSort(offsets, slot_of, row_token, idx, n, E, k); });
  }
  void MoeGatherBackward(void* dh, const void* dxe, const int32_t* slot_of, int64_t n, int64_t k,
                         int64_t C, StreamId s) override {
    On(s, [=] { ref::MoeGatherBackward<T>(P(dh), P(dxe), slot_of, n, k, C); });
  }
  void ReadOffsets(int32_t* host, const int32_t* offsets, int64_t E, StreamId s) override {
    streams_[static_cast<int>(s)].Drain();
    std::memcpy(host, offsets, (E + 1) * sizeof(int32_t));
  }
  void GroupedLinear(void* out, const void* in, const void* W, const void* bias,
                     const ExpertOffsets& expert_offsets, int64_t E, int64_t IC, int64_t OC,
                     bool w_in_major, StreamId s) override {
    const int32_t* offsets = expert_offsets.device;  // host memory: the host copy adds nothing
    On(s, [=] {
      ref::GroupedLinear<T>(P(out), P(in), P(W), P(bias), offsets, E, IC, OC, w_in_major);
    });
  }
  void GroupedLinearBackward(void* din, void* dW, void* dbias, const void* dout, const void* in,
                             const void* W, const ExpertOffsets& expert_offsets, int64_t E,
                             int64_t IC, int64_t OC, bool w_in_major, StreamId s) override {
    const int32_t* offsets = expert_offsets.device;
    On(s, [=] {
      ref::GroupedLinearBackward<T>(P(din), P(dW), P(dbias), P(dout), P(in), P(W), offsets, E, IC,
                                    OC, w_in_major);
    });
  }
  void GroupedLoraForward(void* y, void* t, const void* x, const void* A, const void* B,
                          const ExpertOffsets& expert_offsets, int64_t E, int64_t IC, int64_t OC,
                          int64_t r, double scale, StreamId s) override {
    const int32_t* offsets = expert_offsets.device;
    On(s, [=] {
      ref::GroupedLoraForward<T>(P(y), P(t), P(x), P(A), P(B), offsets, E, IC, OC, r, scale);
    });
  }
  void GroupedLoraBackward(void* dx, void* dA, void* dB, void* t, void* dt, const void* dy,
                           const void* x, const void* A, const void* B,
                           const ExpertOffsets& expert_offsets, int64_t E, int64_t IC, int64_t OC,
                           int64_t r, double scale, StreamId s) override {
    const int32_t* offsets = expert_offsets.device;
    On(s, [=] {
      ref::GroupedLoraBackward<T>(P(dx), P(dA), P(dB), P(t), P(dt), P(dy), P(x), P(A), P(B),
                                  offsets, E, IC, OC, r, scale);
    });
  }
  void MoeCombine(void* out, const void* ye, const int32_t* slot_of, const void* w, int64_t n,
                  int64_t k, int64_t C, StreamId s) override {
    On(s, [=] { ref::MoeCombine<T, T>(P(out), P(ye), slot_of, P(w), n, k, C); });
  }
  void MoeCombineBackward(void* dye, void* dw, const void* dout, const void* ye,
                          const int32_t* slot_of, const void* w, int64_t n, int64_t k, int64_t C,
                          StreamId s) override {
    On(s, [=] {
      ref::MoeCombineBackward<T, T>(P(dye), P(dw), P(dout), P(ye), slot_of, P(w), n, k, C);
    });
  }
  void MoeRouteBackward(void* dlogits, const void* probs, const int32_t* idx, const void* w,
                        const void* dw, const int32_t* counts, double aux_scale, int64_t n,
                        int64_t E, int64_t k, bool renorm, StreamId s) override {
    On(s, [=] {
      ref::MoeRouteBackward<T, T>(P(dlogits), P(probs), idx, P(w), P(dw), counts, aux_scale, n,
                                  E, k, renorm);
    });
  }
  void MoeRouterStats(int32_t* counts, void* prob_sum, const void* probs, const int32_t* idx,
                      int64_t n, int64_t E, int64_t k, StreamId s) override {
    On(s, [=] { ref::MoeRouterStats<T>(counts, P(prob_sum), P(probs), idx, n, E, k); });
  }

 private:
  static T* P(void* p) { return static_cast<T*>(p); }
  static const T* P(const void* p) { return static_cast<const T*>(p); }
  static uint64_t Recorded(CpuEvent* ev) {
    std::lock_guard<std::mutex> lock(ev->mu);
    return ev->recorded;
  }

 public:
  void On(StreamId s, std::function<void()> work) {
    streams_[static_cast<int>(s)].Enqueue(std::move(work));
  }

 private:
  CpuStream streams_[kNumStreams];
};

// What the ranks of a CPU group share: the buffers of the collective in progress and a
// reusable barrier (a generation count).
class HostGroup {
 public:
  explicit HostGroup(int size) : size_(size), bufs_(size, nullptr) {}
  int size() const { return size_; }

  // Run on rank r's stream thread: every rank's buf is published, each rank adds its own
  // shard over all ranks (in rank order, so the sum does not depend on timing), and no
  // rank leaves before all are done reading the others' buffers.
  template <typename T>
  void ReduceScatter(int r, T* buf, int64_t shard) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      bufs_[r] = buf;
    }
    Barrier();
    const int64_t off = r * shard;
    std::vector<const T*> in(size_);
    for (int q = 0; q < size_; ++q) in[q] = static_cast<const T*>(bufs_[q]) + off;
    T* out = buf + off;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < shard; ++i) {
      T sum = in[0][i];
      for (int q = 1; q < size_; ++q) sum += in[q][i];
      out[i] = sum;
    }
    Barrier();
  }

 private:
  void Barrier() {
    std::unique_lock<std::mutex> lock(mu_);
    const uint64_t generation = generation_;
    if (++arrived_ == size_) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
    } else {
      cv_.wait(lock, [&] { return generation_ != generation; });
    }
  }

  const int size_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<void*> bufs_;
  int arrived_ = 0;
  uint64_t generation_ = 0;
};

template <typename T>
class CpuCollective final : public GradCollective {
 public:
  CpuCollective(CpuBackend<T>* backend, std::shared_ptr<HostGroup> group, int rank)
      : backend_(backend), group_(std::move(group)), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return group_->size(); }
  void ReduceScatter(void* buf, int64_t shard, StreamId stream) override {
    HostGroup* group = group_.get();
    const int r = rank_;
    backend_->On(stream, [group, r, buf, shard] {
      group->ReduceScatter<T>(r, static_cast<T*>(buf), shard);
    });
  }
  std::string description() const override { return "host threads"; }

 private:
  CpuBackend<T>* backend_;
  std::shared_ptr<HostGroup> group_;  // shared by the ranks
  const int rank_;
};

template <typename T>
absl::StatusOr<std::vector<std::unique_ptr<GradCollective>>> MakeCpuCollectives(
    const std::vector<Backend*>& backends) {
  std::vector<CpuBackend<T>*> cpus;
  for (Backend* b : backends) {
    auto* cpu = dynamic_cast<CpuBackend<T>*>(b);
    if (cpu == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("a CPU gradient group cannot include ", b->name(),
                       " (every device must be a CPU backend of one precision)"));
    }
    cpus.push_back(cpu);
  }
  auto group = std::make_shared<HostGroup>(static_cast<int>(cpus.size()));
  std::vector<std::unique_ptr<GradCollective>> out;
  for (size_t r = 0; r < cpus.size(); ++r) {
    out.push_back(std::make_unique<CpuCollective<T>>(cpus[r], group, static_cast<int>(r)));
  }
  return out;
}

}  // namespace

absl::StatusOr<std::vector<std::unique_ptr<GradCollective>>> CreateCpuCollectives(
    const std::vector<Backend*>& backends) {
  if (backends.empty()) return absl::InvalidArgumentError("an empty gradient group");
  if (backends[0]->grad_dtype() == DType::kF64) return MakeCpuCollectives<double>(backends);
  return MakeCpuCollectives<float>(backends);
}

std::unique_ptr<Backend> CreateCpuBackend(const CpuBackendOptions& options) {
  if (options.precision == CpuBackendOptions::Precision::kF64) {
    return std::make_unique<CpuBackend<double>>();
  }
  return std::make_unique<CpuBackend<float>>();
}

}  // namespace megatrain
