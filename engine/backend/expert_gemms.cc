#include "engine/backend/expert_gemms.h"

#include <algorithm>

#include "engine/backend/expert_buckets.h"
#include "engine/common/check.h"
#include "engine/common/cuda_check.h"

namespace megatrain {
namespace {

// The largest power of two up to 256 that divides v (v == 0: 256).
int64_t AlignmentOf(int64_t v) {
  int64_t a = 256;
  while (a > 1 && v % a != 0) a /= 2;
  return a;
}

uint64_t U64(int64_t v) { return static_cast<uint64_t>(v); }

}  // namespace

ExpertGemms::ExpertGemms(cudaStream_t stream, void* workspace, size_t workspace_bytes)
    : stream_(stream), workspace_(workspace), workspace_bytes_(workspace_bytes) {
  MT_CUBLAS_CHECK(cublasLtCreate(&lt_));
  for (int ta = 0; ta < 2; ++ta) {
    for (int tb = 0; tb < 2; ++tb) {
      cublasLtMatmulDesc_t& op = op_[ta][tb];
      MT_CUBLAS_CHECK(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
      const cublasOperation_t a = ta ? CUBLAS_OP_T : CUBLAS_OP_N,
                              b = tb ? CUBLAS_OP_T : CUBLAS_OP_N;
      MT_CUBLAS_CHECK(
          cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &a, sizeof(a)));
      MT_CUBLAS_CHECK(
          cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &b, sizeof(b)));
    }
  }
}

ExpertGemms::~ExpertGemms() {
  for (auto& row : op_) {
    for (cublasLtMatmulDesc_t op : row) {
      if (op != nullptr) cublasLtMatmulDescDestroy(op);
    }
  }
  if (lt_ != nullptr) cublasLtDestroy(lt_);
}

void ExpertGemms::Layouts(const ExpertGemm& g, int64_t rows, cublasLtMatrixLayout_t* a,
                          cublasLtMatrixLayout_t* b, cublasLtMatrixLayout_t* c) const {
  const int64_t n = g.rows_are_k ? g.n : rows, k = g.rows_are_k ? rows : g.k;
  // Stored shapes (column-major): A is m x k, or k x m when transposed; B likewise.
  const bool at = g.ta == CUBLAS_OP_T, bt = g.tb == CUBLAS_OP_T;
  MT_CUBLAS_CHECK(
      cublasLtMatrixLayoutCreate(a, CUDA_R_16BF, U64(at ? k : g.m), U64(at ? g.m : k), g.lda));
  MT_CUBLAS_CHECK(
      cublasLtMatrixLayoutCreate(b, CUDA_R_16BF, U64(bt ? n : k), U64(bt ? k : n), g.ldb));
  MT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(c, g.c_type, U64(g.m), U64(n), g.ldc));
}

const ExpertGemms::Algo& ExpertGemms::AlgoFor(const ExpertGemm& g, int64_t rows, int64_t key_rows,
                                              const int64_t align[3]) {
  const Key key =
      std::make_tuple(g.ta, g.tb, g.m, g.rows_are_k ? g.n : 0, g.rows_are_k ? 0 : g.k, g.lda, g.ldb,
                      g.ldc, g.c_type, g.rows_are_k, align[0], align[1], align[2], key_rows);
  auto it = algos_.find(key);
  if (it != algos_.end()) return it->second;
  cublasLtMatrixLayout_t a, b, c;
  Layouts(g, rows, &a, &b, &c);
  cublasLtMatmulPreference_t pref;
  MT_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  const uint64_t ws = workspace_bytes_;
  MT_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
  const uint32_t align_a = static_cast<uint32_t>(align[0]),
                 align_b = static_cast<uint32_t>(align[1]),
                 align_c = static_cast<uint32_t>(align[2]);
  MT_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_a, sizeof(align_a)));
  MT_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_b, sizeof(align_b)));
  MT_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_c, sizeof(align_c)));
  MT_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_c, sizeof(align_c)));
  cublasLtMatmulHeuristicResult_t result = {};
  int found = 0;
  const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(
      lt_, op_[g.ta == CUBLAS_OP_T][g.tb == CUBLAS_OP_T], a, b, c, c, pref, 1, &result, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  cublasLtMatrixLayoutDestroy(a);
  cublasLtMatrixLayoutDestroy(b);
  cublasLtMatrixLayoutDestroy(c);
  Algo& algo = algos_[key];
  algo.found = status == CUBLAS_STATUS_SUCCESS && found > 0;
  if (algo.found) algo.algo = result.algo;
  return algo;
}

void ExpertGemms::Run(const ExpertGemm& g, const int32_t* rows, int64_t E) {
  int64_t align[3];
  for (int i = 0; i < 3; ++i) {
    const int64_t base = static_cast<int64_t>(reinterpret_cast<uintptr_t>(g.base[i]));
    align[i] =
        std::min({AlignmentOf(base), AlignmentOf(g.expert_bytes[i]), AlignmentOf(g.row_bytes[i])});
  }
  for (int64_t e = 0; e < E; ++e) {
    const int64_t count = rows[e + 1] - rows[e];
    if (count == 0) continue;
    void* p[3];
    for (int i = 0; i < 3; ++i) {
      p[i] = static_cast<char*>(const_cast<void*>(g.base[i])) + e * g.expert_bytes[i] +
             rows[e] * g.row_bytes[i];
    }
    const int64_t bucket = ExpertRowBucket(count);
    const Algo& algo = AlgoFor(g, bucket, bucket, align);
    cublasStatus_t status = algo.found ? Matmul(g, algo, count, p) : CUBLAS_STATUS_NOT_SUPPORTED;
    if (status != CUBLAS_STATUS_SUCCESS) {  // rare: the bucket's algorithm refuses this size
      const Algo& exact = AlgoFor(g, count, -count, align);
      MT_CHECK_MSG(exact.found, "cuBLASLt has no algorithm for an expert GEMM (m %lld, rows %lld)",
                   static_cast<long long>(g.m), static_cast<long long>(count));
      status = Matmul(g, exact, count, p);
    }
    MT_CUBLAS_CHECK(status);
  }
}

cublasStatus_t ExpertGemms::Matmul(const ExpertGemm& g, const Algo& algo, int64_t rows,
                                   void* const p[3]) {
  cublasLtMatrixLayout_t a, b, c;
  Layouts(g, rows, &a, &b, &c);
  const cublasStatus_t status =
      cublasLtMatmul(lt_, op_[g.ta == CUBLAS_OP_T][g.tb == CUBLAS_OP_T], &g.alpha, p[0], a, p[1], b,
                     &g.beta, p[2], c, p[2], c, &algo.algo, workspace_, workspace_bytes_, stream_);
  cublasLtMatrixLayoutDestroy(a);
  cublasLtMatrixLayoutDestroy(b);
  cublasLtMatrixLayoutDestroy(c);
  return status;
}

}  // namespace megatrain
