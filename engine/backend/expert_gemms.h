// The experts' matmuls on the CUDA backend: one cuBLASLt matmul per expert over its rows,
// with the algorithm chosen once per shape bucket (the expert's row count rounded up to
// the next power of two up to 128, then to the next eighth of an octave) and kept, instead
// of cuBLAS choosing one in every call.
//
// Why: cublasGemmEx runs its heuristic on the host for a problem size it has not seen. An
// expert's row count changes every step as routing changes, so nearly every expert GEMM
// paid it, and the host fell behind the GPU: on the H200 a Qwen3-30B-A3B layer's forward
// (256 GEMMs) took 41-56 ms beside training against 23 ms with fixed routing
// (--no-optimizer), with 16 optimizer threads or one, about 70 us more a GEMM; with an
// algorithm per power-of-two bucket, 23.9 ms. Eighths of an octave above 128 rows keep
// the choice near the size it runs at (large experts, Mixtral's) at a bounded number of
// choices. The algorithm depends only on the bucket, so the bits of a step repeat.
//
// Thread-compatible; everything is enqueued on the stream given at construction, which
// must be the one the workspace belongs to.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <tuple>

namespace megatrain {

// One matmul per expert over its rows, in cuBLAS's column-major terms: C_e (m, n) =
// alpha op(A_e) op(B_e) + beta C_e, bf16 A and B, fp32 accumulation. The expert's row count
// is n, or k when rows_are_k (a weight gradient's sum over the rows). Operand i of expert e
// starts at base[i] + e * expert_bytes[i] + (its first row) * row_bytes[i].
struct ExpertGemm {
  cublasOperation_t ta = CUBLAS_OP_N, tb = CUBLAS_OP_N;
  int64_t m = 0, n = 0, k = 0;  // the place of the row count is ignored
  bool rows_are_k = false;
  int64_t lda = 0, ldb = 0, ldc = 0;
  const void* base[3] = {};  // A, B, C
  int64_t expert_bytes[3] = {};
  int64_t row_bytes[3] = {};
  cudaDataType_t c_type = CUDA_R_16BF;
  float alpha = 1;  // alpha and beta are no part of the algorithm's choice
  float beta = 0;
};

class ExpertGemms {
 public:
  ExpertGemms(cudaStream_t stream, void* workspace, size_t workspace_bytes);
  ~ExpertGemms();
  ExpertGemms(const ExpertGemms&) = delete;
  ExpertGemms& operator=(const ExpertGemms&) = delete;

  // The experts with rows (offsets rows (E+1), on the host) each get their matmul; the
  // others are skipped (their C stays as it was).
  void Run(const ExpertGemm& g, const int32_t* rows, int64_t E);

 private:
  // What an algorithm is chosen for: every field of the matmul but the row count, the
  // operands' alignment, and the row count it is chosen at (a bucket, or -rows for an exact
  // size when the bucket's algorithm does not take this one).
  using Key = std::tuple<int, int, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int, bool,
                         int64_t, int64_t, int64_t, int64_t>;
  struct Algo {
    bool found = false;
    cublasLtMatmulAlgo_t algo;
  };
  // The algorithm chosen at `rows` rows (its key: `key_rows`).
  const Algo& AlgoFor(const ExpertGemm& g, int64_t rows, int64_t key_rows, const int64_t align[3]);
  cublasStatus_t Matmul(const ExpertGemm& g, const Algo& algo, int64_t rows, void* const p[3]);
  // The layouts of A, B and C for `rows` rows.
  void Layouts(const ExpertGemm& g, int64_t rows, cublasLtMatrixLayout_t* a,
               cublasLtMatrixLayout_t* b, cublasLtMatrixLayout_t* c) const;

  cudaStream_t stream_;
  void* workspace_;
  size_t workspace_bytes_;
  cublasLtHandle_t lt_ = nullptr;
  cublasLtMatmulDesc_t op_[2][2] = {};  // [ta == T][tb == T]
  std::map<Key, Algo> algos_;
};

}  // namespace megatrain
