#include "engine/backend/factory.h"

#include <cstdlib>

#include "engine/backend/cpu_backend.h"
#include "engine/backend/devices.h"
#include "engine/common/status.h"
#ifdef MEGATRAIN_HAS_CUDA
#include "engine/backend/cuda_backend.h"
#endif

namespace megatrain {

absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(const BackendRequest& request) {
  if (request.kind == "cpu" || (request.kind == "auto" && !CudaAvailable())) {
    return CreateCpuBackend(CpuBackendOptions{});
  }
#ifdef MEGATRAIN_HAS_CUDA
  CudaBackendOptions o;
  o.device = CudaDeviceIndexOf(request.kind);
  if (o.device < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("backend '", request.kind, "': expected cuda:N with N a device index"));
  }
  o.device_memory_cap_bytes = request.device_memory_cap_bytes;
  return CreateCudaBackend(o);
#else
  return absl::FailedPreconditionError(
      "backend 'cuda' requested, but this build has no CUDA backend (nvcc was not found "
      "when it was configured)");
#endif
}

void SetCollectiveDefaults() {
  // NVLink SHARP (multicast) buys nothing for a reduce-scatter over a few GPUs, and some
  // shared machines forbid it; a value the user set is left alone.
  setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0);
}

absl::StatusOr<std::vector<std::unique_ptr<GradCollective>>> CreateGradCollectives(
    const std::vector<Backend*>& backends) {
  if (backends.empty()) return absl::InvalidArgumentError("an empty gradient group");
  if (backends[0]->kind() == BackendKind::kCpu) return CreateCpuCollectives(backends);
#ifdef MEGATRAIN_HAS_CUDA
  return CreateCudaCollectives(backends);
#else
  return absl::FailedPreconditionError("this build has no CUDA backend");
#endif
}

}  // namespace megatrain
