// CUDA backend: host-side orchestration. Kernels live in kernels/cuda/*.cu; this file
// only sees their plain-C++ launchers.
#include "engine/backend/cuda_backend.h"
#include "engine/backend/expert_gemms.h"
#include "engine/backend/nccl.h"
#include "engine/backend/pci_numa.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <unordered_map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "engine/common/check.h"
#include "engine/common/cuda_check.h"
#include "engine/common/units.h"
#include "engine/kernels/cuda/ops.h"

namespace megatrain {
namespace {

using cuda::bf16;

class CudaBackend final : public Backend {
 public:
  ~CudaBackend() override {
    cudaSetDevice(device_);
    cudaDeviceSynchronize();
    expert_gemms_.reset();
    if (cublas_ != nullptr) cublasDestroy(cublas_);
    if (workspace_ != nullptr) cudaFree(workspace_);
    if (partials_ != nullptr) cudaFree(partials_);
    if (dq_sums_ != nullptr) cudaFree(dq_sums_);
    if (host_offsets_ != nullptr) cudaFreeHost(host_offsets_);
    for (F32Staging& st : staging_) {
      for (int b = 0; b < 2; ++b) {
        if (st.half[b] != nullptr) cudaFree(st.half[b]);
        if (st.copied[b] != nullptr) cudaEventDestroy(st.copied[b]);
        if (st.rounded[b] != nullptr) cudaEventDestroy(st.rounded[b]);
      }
    }
    if (round_stream_ != nullptr) cudaStreamDestroy(round_stream_);
    for (cudaStream_t s : streams_) {
      if (s != nullptr) cudaStreamDestroy(s);
    }
  }

  absl::Status Init(const CudaBackendOptions& o) {
    device_ = o.device;
    cudaError_t e = cudaSetDevice(device_);
    if (e != cudaSuccess) {
      return absl::FailedPreconditionError(
          absl::StrCat("cannot use CUDA device ", device_, ": ", cudaGetErrorString(e)));
    }
    cudaDeviceProp prop;
    MT_CUDA_CHECK(cudaGetDeviceProperties(&prop, device_));
    name_ = absl::StrCat("cuda:", device_, " (", prop.name, ")");
    size_t free_bytes = 0, total_bytes = 0;
    MT_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    cap_ = o.device_memory_cap_bytes > 0 ? o.device_memory_cap_bytes
                                         : static_cast<int64_t>(free_bytes);
    for (cudaStream_t& s : streams_) MT_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    int least_priority = 0, greatest_priority = 0;
    MT_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least_priority, &greatest_priority));
    MT_CUDA_CHECK(cudaStreamCreateWithPriority(&round_stream_, cudaStreamNonBlocking,
                                               greatest_priority));
    MT_CUBLAS_CHECK(cublasCreate(&cublas_));
    MT_CUBLAS_CHECK(cublasSetStream(cublas_, Stream(StreamId::kCompute)));
    constexpr size_t kWorkspace = 32ull << 20;
    MT_CUDA_CHECK(cudaMalloc(&workspace_, kWorkspace));
    MT_CUBLAS_CHECK(cublasSetWorkspace(cublas_, workspace_, kWorkspace));
    expert_gemms_ = std::make_unique<ExpertGemms>(Stream(StreamId::kCompute), workspace_,
                                                  kWorkspace);
    MT_CUBLAS_CHECK(cublasSetMathMode(cublas_, CUBLAS_DEFAULT_MATH));
    MT_CUDA_CHECK(cudaMalloc(&partials_, cuda::kPartialFloats * sizeof(float)));
    MT_CUDA_CHECK(cudaMallocHost(&host_offsets_, (kMaxExperts + 1) * sizeof(int32_t)));
    return absl::OkStatus();
  }

  std::string name() const override { return name_; }
  BackendKind kind() const override { return BackendKind::kCuda; }
  int device() const { return device_; }
  cudaStream_t native_stream(StreamId s) const { return Stream(s); }
  DType weight_dtype() const override { return DType::kBF16; }
  DType act_dtype() const override { return DType::kBF16; }
  DType grad_dtype() const override { return DType::kF32; }
  DType stat_dtype() const override { return DType::kF32; }

  absl::StatusOr<void*> Alloc(size_t bytes) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (in_use_ + static_cast<int64_t>(bytes) > cap_) {
      return absl::ResourceExhaustedError(absl::StrFormat(
          "device memory: %.2f GiB more would exceed the job's cap of %.2f GiB (%.2f GiB in "
          "use); lower tokens per micro-batch or raise the cap",
          GiB(bytes), GiB(cap_), GiB(in_use_)));
    }
    void* p = nullptr;
    cudaError_t e = cudaMalloc(&p, bytes);
    if (e != cudaSuccess) {
      cudaGetLastError();
      size_t free_bytes = 0, total_bytes = 0;
      cudaMemGetInfo(&free_bytes, &total_bytes);
      return absl::ResourceExhaustedError(absl::StrFormat(
          "cudaMalloc of %.2f GiB failed (%s); %.2f of %.2f GiB free on %s", GiB(bytes),
          cudaGetErrorString(e), GiB(free_bytes), GiB(total_bytes), name_));
    }
    sizes_[p] = bytes;
    in_use_ += bytes;
    peak_ = std::max(peak_, in_use_);
    return p;
  }
  void Free(void* ptr) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = sizes_.find(ptr);
    if (it != sizes_.end()) {
      in_use_ -= it->second;
      sizes_.erase(it);
    }
    MT_CUDA_CHECK(cudaFree(ptr));
  }
  int64_t device_bytes_in_use() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return in_use_;
  }
  int64_t device_memory_budget() const override { return cap_; }
  int64_t device_bytes_peak() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return peak_;
  }

  void BindThread() override { cudaSetDevice(device_); }

  absl::Status PinHostRange(void* ptr, size_t bytes) override {
    if (bytes == 0) return absl::OkStatus();
    // Portable: pinned for every device's context, so that the other devices of a
    // data-parallel job stream from the same pages.
    cudaError_t e = cudaHostRegister(ptr, bytes, cudaHostRegisterPortable);
    if (e != cudaSuccess) {
      cudaGetLastError();
      return absl::ResourceExhaustedError(absl::StrFormat(
          "cannot pin %.2f GiB of host memory for transfers (%s): raise the locked-memory "
          "limit (ulimit -l unlimited; LimitMEMLOCK=infinity under systemd) or free memory",
          GiB(bytes), cudaGetErrorString(e)));
    }
    return absl::OkStatus();
  }
  void UnpinHostRange(void* ptr) override { cudaHostUnregister(ptr); }

  // Blocking sync: a host thread waiting on an event sleeps instead of spinning, so the
  // CPU AdamW (all cores, statically shared) does not lose a core to a waiting thread.
  void* CreateEvent() override {
    cudaEvent_t e;
    MT_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventBlockingSync));
    return e;
  }
  void DestroyEvent(void* event) override { cudaEventDestroy(static_cast<cudaEvent_t>(event)); }
  void Record(void* event, StreamId s) override {
    MT_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(event), Stream(s)));
  }
  void StreamWait(StreamId s, void* event) override {
    MT_CUDA_CHECK(cudaStreamWaitEvent(Stream(s), static_cast<cudaEvent_t>(event), 0));
  }
  void EventSync(void* event) override {
    MT_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(event)));
  }
  double ElapsedSeconds(void* start, void* end) override {
    float ms = 0;
    MT_CUDA_CHECK(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(start),
                                       static_cast<cudaEvent_t>(end)));
    return ms / 1e3;
  }
  void SyncAll() override {
    for (cudaStream_t s : streams_) MT_CUDA_CHECK(cudaStreamSynchronize(s));
  }

  void UploadWeights(void* slot, const uint16_t* host_bf16, int64_t n, StreamId s) override {
    MT_CUDA_CHECK(cudaMemcpyAsync(slot, host_bf16, n * 2, cudaMemcpyHostToDevice, Stream(s)));
  }
  // Through the two halves of a staging buffer of the stream's, chunk by chunk: the copies
  // on `s`, each chunk's rounding (reads 512 MiB, writes 256: ~0.2 ms against the chunk's
  // ~10 ms over PCIe) on a stream of the greatest priority, so that the next chunk's copy
  // goes on while a rounding waits for SMs, which it does only until the compute kernel
  // running ends. (With one 32 MiB buffer and both on `s`, every 0.6 ms chunk waited for a
  // gap between the compute stream's kernels, up to 26 ms apart in a micro-batch of 64K
  // tokens: a Qwen2.5-7B layer's fp32 came up at 16 GB/s beside compute, against 55 alone
  // on an H200.) `s` waits for the last rounding, so what follows the
  // upload on it sees the bf16 weights.
  void UploadWeightsFromF32(void* slot, const float* host_f32, int64_t n, StreamId s) override {
    F32Staging& st = staging_[static_cast<int>(s)];
    if (st.half[0] == nullptr) {
      for (int b = 0; b < 2; ++b) {
        MT_CUDA_CHECK(cudaMalloc(&st.half[b], kStagingHalfElements * sizeof(float)));
        MT_CUDA_CHECK(cudaEventCreateWithFlags(&st.copied[b], cudaEventDisableTiming));
        MT_CUDA_CHECK(cudaEventCreateWithFlags(&st.rounded[b], cudaEventDisableTiming));
      }
      std::lock_guard<std::mutex> lock(mu_);
      in_use_ += kCudaF32UploadStagingBytes;
      peak_ = std::max(peak_, in_use_);
    }
    int b = st.next;
    for (int64_t off = 0; off < n; off += kStagingHalfElements, b ^= 1) {
      const int64_t count = std::min(kStagingHalfElements, n - off);
      if (st.used[b]) MT_CUDA_CHECK(cudaStreamWaitEvent(Stream(s), st.rounded[b], 0));
      MT_CUDA_CHECK(cudaMemcpyAsync(st.half[b], host_f32 + off, count * sizeof(float),
                                    cudaMemcpyHostToDevice, Stream(s)));
      MT_CUDA_CHECK(cudaEventRecord(st.copied[b], Stream(s)));
      MT_CUDA_CHECK(cudaStreamWaitEvent(round_stream_, st.copied[b], 0));
      cuda::RoundToBf16(Bf16(slot) + off, st.half[b], count, round_stream_);
      MT_CUDA_CHECK(cudaEventRecord(st.rounded[b], round_stream_));
      st.used[b] = true;
      st.last = b;
    }
    st.next = b;
    if (n > 0) MT_CUDA_CHECK(cudaStreamWaitEvent(Stream(s), st.rounded[st.last], 0));
  }
  int64_t f32_upload_staging_bytes() const override { return kCudaF32UploadStagingBytes; }
  void DownloadGrads(float* host, const void* grad, int64_t n, StreamId s) override {
    MT_CUDA_CHECK(cudaMemcpyAsync(host, grad, n * 4, cudaMemcpyDeviceToHost, Stream(s)));
  }
  void CopyToDevice(void* dst, const void* host, size_t bytes, StreamId s) override {
    MT_CUDA_CHECK(cudaMemcpyAsync(dst, host, bytes, cudaMemcpyHostToDevice, Stream(s)));
  }
  void CopyToHost(void* host, const void* src, size_t bytes, StreamId s) override {
    MT_CUDA_CHECK(cudaMemcpyAsync(host, src, bytes, cudaMemcpyDeviceToHost, Stream(s)));
  }
  void CopyOnDevice(void* dst, const void* src, size_t bytes, StreamId s) override {
    MT_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, Stream(s)));
  }
  void Zero(void* dst, size_t bytes, StreamId s) override {
    MT_CUDA_CHECK(cudaMemsetAsync(dst, 0, bytes, Stream(s)));
  }

  void Embedding(void* out, const int32_t* tokens, const void* table, int64_t n, int64_t C,
                 StreamId s) override {
    cuda::Embedding(Bf16(out), tokens, Bf16(table), n, C, Stream(s));
  }
  void EmbeddingBackward(void* dtable, const void* dout, const int32_t* tokens,
                         const int32_t* order, int64_t n, int64_t C, StreamId s) override {
    cuda::EmbeddingBackward(F32(dtable), Bf16(dout), tokens, order, n, C, Stream(s));
  }
  void RmsNorm(void* out, void* rstd, const void* in, const void* w, int64_t rows, int64_t C,
               double eps, StreamId s) override {
    cuda::RmsNorm(Bf16(out), F32(rstd), Bf16(in), Bf16(w), rows, C, static_cast<float>(eps), Stream(s));
  }
  void RmsNormBackward(void* din, void* dw, const void* dout, const void* in, const void* w,
                       const void* rstd, int64_t rows, int64_t C, StreamId s) override {
    CheckComputeStream(s);  // the partials scratch is the compute stream's
    cuda::RmsNormBackward(Bf16(din), F32(dw), Bf16(dout), Bf16(in), Bf16(w), F32(rstd), rows, C, partials_,
                          cuda::kPartialFloats, Stream(s));
  }
  // Row-major out (N,OC) = in (N,IC) W^T: column-major out^T = W^T' in^T, i.e.
  // gemm(m=OC, n=N, k=IC, A=W (op T, lda=IC), B=in (op N, ldb=IC)).
  void Linear(void* out, const void* in, const void* W, const void* bias, int64_t N,
              int64_t IC, int64_t OC, bool accumulate, StreamId s) override {
    CheckComputeStream(s);
    Gemm(out, in, W, N, IC, OC, accumulate);
    if (bias != nullptr) cuda::AddBias(Bf16(out), Bf16(bias), N, OC, Stream(s));
  }
  void LinearBackward(void* din, bool din_accumulate, void* dW, void* dbias, const void* dout,
                      const void* in, const void* W, int64_t N, int64_t IC, int64_t OC,
                      StreamId s) override {
    CheckComputeStream(s);
    GemmBackward(din, din_accumulate, dW, dout, in, W, N, IC, OC);
    if (dbias != nullptr) cuda::BiasGrad(F32(dbias), Bf16(dout), N, OC, Stream(s));
  }
  // Row-major products as column-major transposes, as Gemm does (kernels/reference/lora.h
  // gives the math); the scale rides on the alphas.
  void LoraForward(void* y, int64_t ld_y, void* t, const void* x, const void* A, const void* B,
                   int64_t N, int64_t IC, int64_t OC, int64_t r, double scale,
                   StreamId s) override {
    CheckComputeStream(s);
    const float alpha = static_cast<float>(scale), one = 1.0f, zero = 0.0f;
    // t^T (r,N) = scale A (r,IC) . x^T (IC,N)
    GemmEx(CUBLAS_OP_T, CUBLAS_OP_N, r, N, IC, alpha, A, IC, x, IC, zero, t,
           CUDA_R_16BF, r);
    // y^T (OC,N) += B (OC,r) . t^T (r,N), y^T's columns ld_y apart
    GemmEx(CUBLAS_OP_T, CUBLAS_OP_N, OC, N, r, one, B, r, t, r, one, y, CUDA_R_16BF,
           ld_y);
  }
  void LoraBackward(void* dx, void* dA, void* dB, void* t, void* dt, const void* dy,
                    int64_t ld_dy, const void* x, const void* A, const void* B, int64_t N,
                    int64_t IC, int64_t OC, int64_t r, double scale, StreamId s) override {
    CheckComputeStream(s);
    const float alpha = static_cast<float>(scale), one = 1.0f, zero = 0.0f;
    // t^T (r,N) = scale A (r,IC) . x^T (IC,N), as LoraForward made it
    GemmEx(CUBLAS_OP_T, CUBLAS_OP_N, r, N, IC, alpha, A, IC, x, IC, zero, t, CUDA_R_16BF, r);
    // dt^T (r,N) = B^T (r,OC) . dy^T (OC,N)
    GemmEx(CUBLAS_OP_N, CUBLAS_OP_N, r, N, OC, one, B, r, dy, ld_dy, zero, dt,
           CUDA_R_16BF, r);
    // dB^T (r,OC) += t^T (r,N) . dy (N,OC), fp32
    GemmEx(CUBLAS_OP_N, CUBLAS_OP_T, r, OC, N, one, t, r, dy, ld_dy, one, dB,
           CUDA_R_32F, r);
    // dA^T (IC,r) += scale x^T (IC,N) . dt (N,r), fp32
    GemmEx(CUBLAS_OP_N, CUBLAS_OP_T, IC, r, N, alpha, x, IC, dt, r, one, dA,
           CUDA_R_32F, IC);
    // dx^T (IC,N) += scale A^T (IC,r) . dt^T (r,N)
    GemmEx(CUBLAS_OP_N, CUBLAS_OP_N, IC, N, r, alpha, A, IC, dt, r, one, dx,
           CUDA_R_16BF, IC);
  }
  void QkvPrepare(void* q, void* k, void* v, void* rstd_q, void* rstd_k, const void* qkv,
                  const void* q_norm_w, const void* k_norm_w, const int32_t* pos,
                  const float* inv_freq, float rope_scale, int64_t n, int64_t H, int64_t KV,
                  int64_t D, double eps, StreamId s) override {
    cuda::QkvPrepare(Bf16(q), Bf16(k), Bf16(v), F32(rstd_q), F32(rstd_k), Bf16(qkv), Bf16(q_norm_w), Bf16(k_norm_w),
                     pos, inv_freq, rope_scale, n, H, KV, D, static_cast<float>(eps), Stream(s));
  }
  void QkvPrepareBackward(void* dqkv, void* dq_norm_w, void* dk_norm_w, const void* dq,
                          const void* dk, const void* dv, const void* qkv, const void* q_norm_w,
                          const void* k_norm_w, const void* rstd_q, const void* rstd_k,
                          const int32_t* pos, const float* inv_freq, float rope_scale,
                          int64_t n, int64_t H, int64_t KV, int64_t D, double eps,
                          StreamId s) override {
    CheckComputeStream(s);  // the partials scratch is the compute stream's
    cuda::QkvPrepareBackward(Bf16(dqkv), F32(dq_norm_w), F32(dk_norm_w), Bf16(dq), Bf16(dk), Bf16(dv), Bf16(qkv),
                             Bf16(q_norm_w), Bf16(k_norm_w), F32(rstd_q), F32(rstd_k), pos, inv_freq, rope_scale, n,
                             H, KV, D, partials_, cuda::kPartialFloats, Stream(s));
  }
  void Attention(void* o, void* lse, const void* q, const void* k, const void* v,
                 const int32_t* doc_start, const void* sinks, int64_t window, int64_t n, int64_t H,
                 int64_t KV, int64_t D, StreamId s) override {
    cuda::Attention(Bf16(o), F32(lse), Bf16(q), Bf16(k), Bf16(v), doc_start, Bf16(sinks), window, n,
                    H, KV, D, Stream(s));
  }
  void AttentionBackward(void* dq, void* dk, void* dv, void* dsinks, const void* dout,
                         const void* q, const void* k, const void* v, const void* o,
                         const void* lse, const int32_t* doc_start, const void* sinks,
                         int64_t window, int64_t n, int64_t H, int64_t KV, int64_t D,
                         StreamId s) override {
    if (dsinks != nullptr) CheckComputeStream(s);  // the partials scratch is the compute stream's
    float* dq_sums = nullptr;
    if (cuda::HopperFusedBackwardRequested() && cuda::HopperAttentionApplies(D)) {
      CheckComputeStream(s);  // so is dq_sums_
      dq_sums = DqSums();
    }
    cuda::AttentionBackward(Bf16(dq), Bf16(dk), Bf16(dv), F32(dsinks), Bf16(dout), Bf16(q), Bf16(k),
                            Bf16(v), Bf16(o), F32(lse), doc_start, Bf16(sinks), window, n, H, KV, D,
                            partials_, cuda::kPartialFloats, Stream(s), dq_sums,
                            dq_sums != nullptr ? kDqSumFloats : 0);
  }
  void KvCacheWrite(void* k_cache, void* v_cache, const void* k, const void* v,
                    const int32_t* seq_slot, const int32_t* position, int64_t n, int64_t KV,
                    int64_t D, int64_t max_len, StreamId s) override {
    cuda::KvCacheWrite(Bf16(k_cache), Bf16(v_cache), Bf16(k), Bf16(v), seq_slot, position, n, KV,
                       D, max_len, Stream(s));
  }
  void DecodeAttention(void* o, const void* q, const void* k_cache, const void* v_cache,
                       const int32_t* seq_slot, const int32_t* length, const void* sinks,
                       int64_t window, int64_t B, int64_t H, int64_t KV, int64_t D,
                       int64_t max_len, StreamId s) override {
    CheckComputeStream(s);  // the partials scratch (split caches) is the compute stream's
    cuda::DecodeAttention(Bf16(o), Bf16(q), Bf16(k_cache), Bf16(v_cache), seq_slot, length,
                          Bf16(sinks), window, B, H, KV, D, max_len, partials_,
                          cuda::kPartialFloats, Stream(s));
  }
  void SwiGlu(void* out, const void* gu, int64_t N, int64_t I, StreamId s) override {
    cuda::SwiGlu(Bf16(out), Bf16(gu), N, I, Stream(s));
  }
  void SwiGluBackward(void* dgu, const void* dout, const void* gu, int64_t N, int64_t I,
                      StreamId s) override {
    cuda::SwiGluBackward(Bf16(dgu), Bf16(dout), Bf16(gu), N, I, Stream(s));
  }
  void ClampedSwiGlu(void* out, const void* gu, int64_t N, int64_t I, double alpha, double limit,
                     StreamId s) override {
    cuda::ClampedSwiGlu(Bf16(out), Bf16(gu), N, I, static_cast<float>(alpha),
                        static_cast<float>(limit), Stream(s));
  }
  void ClampedSwiGluBackward(void* dgu, const void* dout, const void* gu, int64_t N, int64_t I,
                             double alpha, double limit, StreamId s) override {
    cuda::ClampedSwiGluBackward(Bf16(dgu), Bf16(dout), Bf16(gu), N, I, static_cast<float>(alpha),
                                static_cast<float>(limit), Stream(s));
  }
  void CrossEntropy(void* dlogits, void* loss, const void* logits, const int32_t* targets,
                    int64_t N, int64_t V, double scale, const void* row_scale,
                    StreamId s) override {
    cuda::CrossEntropy(Bf16(dlogits), F32(loss), Bf16(logits), targets, N, V,
                       static_cast<float>(scale), F32(row_scale), Stream(s));
  }
  void PreferenceRowScale(void* row_scale, const void* values, const int32_t* sequence,
                          const double* info, int64_t N, int64_t S, PreferenceLoss kind,
                          double beta, double label_smoothing, StreamId s) override {
    MT_CHECK(S % 2 == 0 && S <= kMaxPreferenceSequences);
    cuda::PreferenceRowScale(F32(row_scale), F32(values), sequence, info, N, S, kind, beta,
                             label_smoothing, Stream(s));
  }
  void AdamW(void* master, void* m, void* v, void* bf16_out, const void* grad, int64_t n,
             const AdamWScalars& scalars, float grad_scale, StreamId s) override {
    cuda::AdamW(F32(master), F32(m), F32(v), static_cast<uint16_t*>(bf16_out), F32(grad), n,
                scalars, grad_scale, Stream(s));
  }
  void GreedyPick(int32_t* ids, float* logprobs, const void* logits, int64_t B, int64_t V,
                  StreamId s) override {
    cuda::GreedyPick(ids, logprobs, Bf16(logits), B, V, Stream(s));
  }

  void MoeRoute(void* probs, int32_t* idx, void* w, const void* logits, int64_t n, int64_t E,
                int64_t k, bool renorm, StreamId s) override {
    cuda::MoeRoute(F32(probs), idx, F32(w), Bf16(logits), n, E, k, renorm, Stream(s));
  }
  void MoeSort(int32_t* offsets, int32_t* slot_of, int32_t* row_token, int32_t* scratch,
               const int32_t* idx, int64_t n, int64_t E, int64_t k, StreamId s) override {
    cuda::MoeSort(offsets, slot_of, row_token, scratch, idx, n, E, k, Stream(s));
  }
  void MoeGatherBackward(void* dh, const void* dxe, const int32_t* slot_of, int64_t n, int64_t k,
                         int64_t C, StreamId s) override {
    cuda::MoeGatherBackward(Bf16(dh), Bf16(dxe), slot_of, n, k, C, Stream(s));
  }
  void ReadOffsets(int32_t* host, const int32_t* offsets, int64_t E, StreamId s) override {
    std::memcpy(host, HostOffsets(offsets, E, s), (E + 1) * sizeof(int32_t));
  }
  // One cuBLASLt matmul per expert that has rows (ExpertGemms: an algorithm per shape
  // bucket): the host needs the experts' row counts, from offsets.host or else read back (a
  // wait for the stream). (cuBLAS 13.0's grouped batched GEMM answers NOT_SUPPORTED for
  // these bf16 matmuls on the H200.) Experts without rows are skipped: their gradient stays
  // as it was. The biases are one launch over all the rows (device offsets), after the
  // GEMMs, as Linear's.
  void GroupedLinear(void* out, const void* in, const void* W, const void* bias,
                     const ExpertOffsets& offsets, int64_t E, int64_t IC, int64_t OC,
                     bool w_in_major, StreamId s) override {
    CheckComputeStream(s);
    const int32_t* rows = RowsOf(offsets, E);
    // out^T (OC, rows) = op(W_e) (OC, IC) . in^T (IC, rows)
    expert_gemms_->Run(RowsThroughWeight(W, w_in_major ? CUBLAS_OP_N : CUBLAS_OP_T,
                                         w_in_major ? OC : IC, in, IC, out, OC),
                       rows, E);
    if (bias != nullptr) {
      cuda::AddGroupedBias(Bf16(out), Bf16(bias), offsets.device, E, rows[E], OC, Stream(s));
    }
  }
  void GroupedLinearBackward(void* din, void* dW, void* dbias, const void* dout, const void* in,
                             const void* W, const ExpertOffsets& offsets, int64_t E, int64_t IC,
                             int64_t OC, bool w_in_major, StreamId s) override {
    CheckComputeStream(s);
    const int32_t* rows = RowsOf(offsets, E);
    // din^T (IC, rows) = op(W_e) (IC, OC) . dout^T (OC, rows)
    expert_gemms_->Run(RowsThroughWeight(W, w_in_major ? CUBLAS_OP_T : CUBLAS_OP_N,
                                         w_in_major ? OC : IC, dout, OC, din, IC),
                       rows, E);
    if (dW == nullptr) {  // a frozen weight: no gradient
      if (dbias != nullptr) {
        cuda::GroupedBiasGrad(F32(dbias), Bf16(dout), offsets.device, E, OC, Stream(s));
      }
      return;
    }
    // dW_e f32 += in_e^T dout_e, as W is laid out
    expert_gemms_->Run(w_in_major ? SumOverRows(dout, OC, in, IC, dW, 1)   // dW^T (OC, IC)
                                  : SumOverRows(in, IC, dout, OC, dW, 1),  // dW^T (IC, OC)
                       rows, E);
    if (dbias != nullptr) {
      cuda::GroupedBiasGrad(F32(dbias), Bf16(dout), offsets.device, E, OC, Stream(s));
    }
  }
  // LoraForward's and LoraBackward's GEMMs per expert with rows, as GroupedLinear's
  // (ExpertGemms); the scale rides on the alphas.
  void GroupedLoraForward(void* y, void* t, const void* x, const void* A, const void* B,
                          const ExpertOffsets& offsets, int64_t E, int64_t IC, int64_t OC,
                          int64_t r, double scale, StreamId s) override {
    CheckComputeStream(s);
    const int32_t* rows = RowsOf(offsets, E);
    expert_gemms_->Run(LoraDown(A, x, t, IC, r, scale), rows, E);
    // y^T (OC, rows) += B_e (OC, r) . t^T (r, rows)
    expert_gemms_->Run(Scaled(RowsThroughWeight(B, CUBLAS_OP_T, r, t, r, y, OC), 1, 1), rows, E);
  }
  void GroupedLoraBackward(void* dx, void* dA, void* dB, void* t, void* dt, const void* dy,
                           const void* x, const void* A, const void* B,
                           const ExpertOffsets& offsets, int64_t E, int64_t IC, int64_t OC,
                           int64_t r, double scale, StreamId s) override {
    CheckComputeStream(s);
    const int32_t* rows = RowsOf(offsets, E);
    expert_gemms_->Run(LoraDown(A, x, t, IC, r, scale), rows, E);  // as the forward made it
    // dt^T (r, rows) = B_e^T (r, OC) . dy^T (OC, rows)
    expert_gemms_->Run(RowsThroughWeight(B, CUBLAS_OP_N, r, dy, OC, dt, r), rows, E);
    // dB_e^T (r, OC) += t^T (r, rows) . dy (rows, OC), fp32
    expert_gemms_->Run(SumOverRows(t, r, dy, OC, dB, 1), rows, E);
    // dA_e^T (IC, r) += scale x^T (IC, rows) . dt (rows, r), fp32
    expert_gemms_->Run(SumOverRows(x, IC, dt, r, dA, scale), rows, E);
    // dx^T (IC, rows) += scale A_e^T (IC, r) . dt^T (r, rows)
    expert_gemms_->Run(Scaled(RowsThroughWeight(A, CUBLAS_OP_N, IC, dt, r, dx, IC), scale, 1), rows,
                       E);
  }
  void MoeCombine(void* out, const void* ye, const int32_t* slot_of, const void* w, int64_t n,
                  int64_t k, int64_t C, StreamId s) override {
    cuda::MoeCombine(Bf16(out), Bf16(ye), slot_of, F32(w), n, k, C, Stream(s));
  }
  void MoeCombineBackward(void* dye, void* dw, const void* dout, const void* ye,
                          const int32_t* slot_of, const void* w, int64_t n, int64_t k, int64_t C,
                          StreamId s) override {
    cuda::MoeCombineBackward(Bf16(dye), F32(dw), Bf16(dout), Bf16(ye), slot_of, F32(w), n, k, C,
                             Stream(s));
  }
  void MoeRouteBackward(void* dlogits, const void* probs, const int32_t* idx, const void* w,
                        const void* dw, const int32_t* counts, double aux_scale, int64_t n,
                        int64_t E, int64_t k, bool renorm, StreamId s) override {
    cuda::MoeRouteBackward(Bf16(dlogits), F32(probs), idx, F32(w), F32(dw), counts,
                           static_cast<float>(aux_scale), n, E, k, renorm, Stream(s));
  }
  void MoeRouterStats(int32_t* counts, void* prob_sum, const void* probs, const int32_t* idx,
                      int64_t n, int64_t E, int64_t k, StreamId s) override {
    CheckComputeStream(s);  // the partials scratch is the compute stream's
    cuda::MoeRouterStats(counts, F32(prob_sum), F32(probs), idx, n, E, k, partials_,
                         cuda::kPartialFloats, Stream(s));
  }

 private:
  // out (N,OC) (= or +=) in (N,IC) W (OC,IC)^T, bf16 in and out, fp32 accumulation.
  void Gemm(void* out, const void* in, const void* W, int64_t N, int64_t IC, int64_t OC,
            bool accumulate) {
    const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
    MT_CUBLAS_CHECK(cublasGemmEx(cublas_, CUBLAS_OP_T, CUBLAS_OP_N, CublasDim(OC), CublasDim(N),
                                 CublasDim(IC), &alpha, W, CUDA_R_16BF, CublasDim(IC), in,
                                 CUDA_R_16BF, CublasDim(IC), &beta, out, CUDA_R_16BF,
                                 CublasDim(OC), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  }
  // Column-major C (m,n; ldc) = alpha op(A) (m,k; lda) . op(B) (k,n; ldb) + beta C, A and B
  // bf16, C of c_type; fp32 accumulation.
  void GemmEx(cublasOperation_t ta, cublasOperation_t tb, int64_t m, int64_t n, int64_t k,
              float alpha, const void* A, int64_t lda, const void* B, int64_t ldb, float beta,
              void* C, cudaDataType c_type, int64_t ldc) {
    MT_CUBLAS_CHECK(cublasGemmEx(cublas_, ta, tb, CublasDim(m), CublasDim(n), CublasDim(k), &alpha,
                                 A, CUDA_R_16BF, CublasDim(lda), B, CUDA_R_16BF, CublasDim(ldb),
                                 &beta, C, c_type, CublasDim(ldc), CUBLAS_COMPUTE_32F,
                                 CUBLAS_GEMM_DEFAULT));
  }
  // din (N,IC) (= or +=, null to skip) = dout (N,OC) W; dW f32 (OC,IC) += dout^T in.
  void GemmBackward(void* din, bool din_accumulate, void* dW, const void* dout, const void* in,
                    const void* W, int64_t N, int64_t IC, int64_t OC) {
    const float one = 1.0f, zero = 0.0f;
    if (din != nullptr) {
      // din^T (IC,N) = W^T (IC,OC) dout^T (OC,N)
      MT_CUBLAS_CHECK(cublasGemmEx(cublas_, CUBLAS_OP_N, CUBLAS_OP_N, CublasDim(IC), CublasDim(N),
                                   CublasDim(OC), &one, W, CUDA_R_16BF, CublasDim(IC), dout,
                                   CUDA_R_16BF, CublasDim(OC), din_accumulate ? &one : &zero, din,
                                   CUDA_R_16BF, CublasDim(IC), CUBLAS_COMPUTE_32F,
                                   CUBLAS_GEMM_DEFAULT));
    }
    if (dW == nullptr) return;  // a frozen weight: no gradient
    // dW^T (IC,OC) += in^T (IC,N) dout (N,OC), in fp32.
    MT_CUBLAS_CHECK(cublasGemmEx(cublas_, CUBLAS_OP_N, CUBLAS_OP_T, CublasDim(IC), CublasDim(OC),
                                 CublasDim(N), &one, in, CUDA_R_16BF, CublasDim(IC), dout,
                                 CUDA_R_16BF, CublasDim(OC), &one, dW, CUDA_R_32F, CublasDim(IC),
                                 CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  }
  static constexpr int64_t kBf16 = 2, kF32 = 4;
  // The expert's rows through its weight: C (m, rows) = op(W_e) (m, k) . B^T (k, rows), bf16,
  // B (rows, k) and C (rows, m) row-major over the sorted rows, W (E, ...) lda-major.
  static ExpertGemm RowsThroughWeight(const void* W, cublasOperation_t ta, int64_t lda,
                                      const void* B, int64_t k, void* C, int64_t m) {
    ExpertGemm g;
    g.ta = ta, g.tb = CUBLAS_OP_N;
    g.m = m, g.k = k, g.rows_are_k = false;
    g.lda = lda, g.ldb = k, g.ldc = m;
    const void* base[3] = {W, B, C};
    const int64_t expert_bytes[3] = {m * k * kBf16, 0, 0}, row_bytes[3] = {0, k * kBf16, m * kBf16};
    SetOperands(&g, base, expert_bytes, row_bytes);
    g.c_type = CUDA_R_16BF, g.beta = 0;
    return g;
  }
  // A weight gradient, a sum over the expert's rows: C_e^T (m, n) f32 += alpha a^T (m, rows)
  // . b (rows, n), a (rows, m) and b (rows, n) bf16 row-major over the sorted rows, C (E, n, m).
  static ExpertGemm SumOverRows(const void* a, int64_t m, const void* b, int64_t n, void* C,
                                double alpha) {
    ExpertGemm g;
    g.ta = CUBLAS_OP_N, g.tb = CUBLAS_OP_T;
    g.m = m, g.n = n, g.rows_are_k = true;
    g.lda = m, g.ldb = n, g.ldc = m;
    const void* base[3] = {a, b, C};
    const int64_t expert_bytes[3] = {0, 0, m * n * kF32}, row_bytes[3] = {m * kBf16, n * kBf16, 0};
    SetOperands(&g, base, expert_bytes, row_bytes);
    g.c_type = CUDA_R_32F, g.alpha = static_cast<float>(alpha), g.beta = 1;
    return g;
  }
  // An expert LoRA's down-projection: t^T (r, rows) = scale A_e (r, IC) . x^T (IC, rows).
  static ExpertGemm LoraDown(const void* A, const void* x, void* t, int64_t IC, int64_t r,
                             double scale) {
    return Scaled(RowsThroughWeight(A, CUBLAS_OP_T, IC, x, IC, t, r), scale, 0);
  }
  // g with C_e = alpha (its product) + beta C_e.
  static ExpertGemm Scaled(ExpertGemm g, double alpha, float beta) {
    g.alpha = static_cast<float>(alpha), g.beta = beta;
    return g;
  }
  static void SetOperands(ExpertGemm* g, const void* const base[3], const int64_t expert_bytes[3],
                          const int64_t row_bytes[3]) {
    for (int i = 0; i < 3; ++i) {
      g->base[i] = base[i];
      g->expert_bytes[i] = expert_bytes[i];
      g->row_bytes[i] = row_bytes[i];
    }
  }

  // The experts' row offsets on the host: the caller's copy, or read back (a wait).
  const int32_t* RowsOf(const ExpertOffsets& offsets, int64_t E) {
    if (offsets.host != nullptr) return offsets.host;
    return HostOffsets(offsets.device, E, StreamId::kCompute);
  }
  // The (E+1) device offsets, read back once stream s has reached this point.
  const int32_t* HostOffsets(const int32_t* offsets, int64_t E, StreamId stream) {
    MT_CHECK_MSG(E + 1 <= kMaxExperts + 1, "cuda backend: %lld experts, at most %lld",
                 static_cast<long long>(E), static_cast<long long>(kMaxExperts));
    cudaStream_t s = Stream(stream);
    MT_CUDA_CHECK(cudaMemcpyAsync(host_offsets_, offsets, (E + 1) * sizeof(int32_t),
                                  cudaMemcpyDeviceToHost, s));
    MT_CUDA_CHECK(cudaStreamSynchronize(s));
    return host_offsets_;
  }
  static constexpr int64_t kMaxExperts = 1024;
  static constexpr int64_t kStagingHalfElements =
      kCudaF32UploadStagingBytes / 2 / static_cast<int64_t>(sizeof(float));

  cudaStream_t Stream(StreamId s) const { return streams_[static_cast<int>(s)]; }
  static bf16* Bf16(void* p) { return static_cast<bf16*>(p); }
  static const bf16* Bf16(const void* p) { return static_cast<const bf16*>(p); }
  static float* F32(void* p) { return static_cast<float*>(p); }
  static const float* F32(const void* p) { return static_cast<const float*>(p); }
  static int CublasDim(int64_t v) {
    MT_CHECK_MSG(v <= INT32_MAX, "cuda backend: GEMM dimension %lld exceeds int",
                 static_cast<long long>(v));
    return static_cast<int>(v);
  }
  // cuBLAS is bound to the compute stream.
  void CheckComputeStream(StreamId s) const {
    MT_CHECK_MSG(s == StreamId::kCompute, "cuda backend: GEMMs run on the compute stream only");
  }

  int device_ = 0;
  std::string name_;
  cudaStream_t streams_[kNumStreams] = {};
  cublasHandle_t cublas_ = nullptr;
  std::unique_ptr<ExpertGemms> expert_gemms_;  // the experts' matmuls, on the compute stream
  void* workspace_ = nullptr;
  int32_t* host_offsets_ = nullptr;  // pinned (kMaxExperts + 1): GroupedLinear's row counts

  // The fused Hopper attention backward's fp32 dq (cuda::HopperAttentionBackwardFused), made
  // at its first use where the job's device memory cap leaves room (not planned: the fused
  // backward is opt-in, MEGATRAIN_ATTENTION_BACKWARD=fused); without it the two passes run.
  static constexpr int64_t kDqSumFloats = int64_t{1} << 28;  // 1 GiB
  float* DqSums() {
    if (!dq_sums_tried_) {
      dq_sums_tried_ = true;
      absl::StatusOr<void*> p = Alloc(kDqSumFloats * sizeof(float));
      if (p.ok()) dq_sums_ = static_cast<float*>(*p);
    }
    return dq_sums_;
  }
  float* dq_sums_ = nullptr;
  bool dq_sums_tried_ = false;

  float* partials_ = nullptr;  // kPartialFloats: the deterministic weight gradients' scratch
  // UploadWeightsFromF32's, per stream that calls it, made at first use: two halves, the
  // events of each half's last copy and rounding, which half is next and which was last.
  struct F32Staging {
    float* half[2] = {};
    cudaEvent_t copied[2] = {}, rounded[2] = {};
    bool used[2] = {};
    int next = 0, last = 0;
  };
  F32Staging staging_[kNumStreams];
  cudaStream_t round_stream_ = nullptr;  // the roundings', of the device's greatest priority
  mutable std::mutex mu_;
  std::unordered_map<void*, size_t> sizes_;
  int64_t cap_ = 0;
  int64_t in_use_ = 0;
  int64_t peak_ = 0;
};

}  // namespace

int CudaDeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(const CudaBackendOptions& options) {
  if (options.device >= CudaDeviceCount()) {
    return absl::FailedPreconditionError(
        absl::StrCat("no CUDA device ", options.device, " (", CudaDeviceCount(), " found)"));
  }
  auto backend = std::make_unique<CudaBackend>();
  absl::Status s = backend->Init(options);
  if (!s.ok()) return s;
  return std::unique_ptr<Backend>(std::move(backend));
}

absl::StatusOr<CudaDeviceInfo> DescribeCudaDevice(int device) {
  cudaDeviceProp prop;
  cudaError_t e = cudaGetDeviceProperties(&prop, device);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return absl::UnavailableError(absl::StrCat("CUDA device ", device, ": ", cudaGetErrorString(e)));
  }
  char bus[32] = {};
  cudaDeviceGetPCIBusId(bus, sizeof(bus), device);
  return CudaDeviceInfo{prop.name, static_cast<int64_t>(prop.totalGlobalMem), bus};
}

int CudaDeviceNumaNode(int device) {
  char bus[32] = {};
  if (cudaDeviceGetPCIBusId(bus, sizeof(bus), device) != cudaSuccess) return -1;
  absl::StatusOr<int> node = NumaNodeOfPciDevice(bus);
  return node.ok() ? *node : -1;
}

absl::StatusOr<std::vector<std::unique_ptr<GradCollective>>> CreateCudaCollectives(
    const std::vector<Backend*>& backends) {
  std::vector<NcclRank> ranks;
  for (Backend* b : backends) {
    auto* cuda = dynamic_cast<CudaBackend*>(b);
    if (cuda == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("a CUDA gradient group cannot include ", b->name()));
    }
    for (const NcclRank& r : ranks) {
      if (r.device == cuda->device()) {
        return absl::InvalidArgumentError(
            absl::StrCat("cuda:", r.device, " appears twice in a gradient group"));
      }
    }
    NcclRank r;
    r.device = cuda->device();
    for (int s = 0; s < kNumStreams; ++s) r.streams[s] = cuda->native_stream(static_cast<StreamId>(s));
    ranks.push_back(r);
  }
  return CreateNcclCollectives(ranks);
}

}  // namespace megatrain
