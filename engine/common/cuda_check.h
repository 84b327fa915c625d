// The one abort path for CUDA, cuBLAS and NCCL calls that fail where only a bug (or a
// dying device) can make them fail: a launch with bad shapes, an async error surfacing on
// the hot path. It prints file:line, the call and the library's words, and aborts: a
// sticky CUDA error poisons the context, and the supervisor restarts from the last
// checkpoint. Errors a user can cause at setup (no device, out of memory) are Status.
//
// Plain C++ over <cuda_runtime.h>: .cu files include it (nvcc sees no absl).
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

namespace megatrain {

[[noreturn]] inline void CudaCallFailed(const char* file, int line, const char* call,
                                        const char* what) {
  std::fprintf(stderr, "%s:%d: %s: %s\n", file, line, call, what);
  std::abort();
}

}  // namespace megatrain

// A CUDA runtime call that must succeed.
#define MT_CUDA_CHECK(expr)                                                          \
  do {                                                                               \
    const cudaError_t mt_cuda_error_ = (expr);                                       \
    if (mt_cuda_error_ != cudaSuccess) {                                             \
      ::megatrain::CudaCallFailed(__FILE__, __LINE__, #expr,                         \
                                  cudaGetErrorString(mt_cuda_error_));               \
    }                                                                                \
  } while (0)

// After a kernel launch: launch errors are bugs (bad shapes reached a launcher).
#define MT_CUDA_LAUNCH_CHECK() MT_CUDA_CHECK(cudaGetLastError())

// A cuBLAS / cuBLASLt call that must succeed (CUBLAS_STATUS_SUCCESS is 0).
#define MT_CUBLAS_CHECK(expr)                                                        \
  do {                                                                               \
    const int mt_cublas_status_ = static_cast<int>(expr);                            \
    if (mt_cublas_status_ != 0) {                                                    \
      char mt_cublas_what_[32];                                                      \
      std::snprintf(mt_cublas_what_, sizeof(mt_cublas_what_), "cuBLAS status %d",    \
                    mt_cublas_status_);                                              \
      ::megatrain::CudaCallFailed(__FILE__, __LINE__, #expr, mt_cublas_what_);       \
    }                                                                                \
  } while (0)

// An NCCL call through `api` (backend/nccl.h's dlopen'd table) that must succeed.
#define MT_NCCL_CHECK(api, expr)                                                     \
  do {                                                                               \
    const auto mt_nccl_result_ = (expr);                                             \
    if (mt_nccl_result_ != 0) {                                                      \
      ::megatrain::CudaCallFailed(__FILE__, __LINE__, #expr,                         \
                                  (api)->error_string(mt_nccl_result_));             \
    }                                                                                \
  } while (0)
