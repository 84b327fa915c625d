#include "engine/backend/factory.h"

#include "engine/backend/cpu_backend.h"
#ifdef MEGATRAIN_HAS_CUDA
#include "engine/backend/cuda_backend.h"
#endif

namespace megatrain {

bool CudaAvailable() {
#ifdef MEGATRAIN_HAS_CUDA
  return CudaDeviceCount() > 0;
#else
  return false;
#endif
}

absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(const BackendRequest& request) {
  if (request.kind == "cpu" || (request.kind == "auto" && !CudaAvailable())) {
    return CreateCpuBackend(CpuBackendOptions{});
  }
#ifdef MEGATRAIN_HAS_CUDA
  CudaBackendOptions o;
  o.device_memory_cap_bytes = request.device_memory_cap_bytes;
  return CreateCudaBackend(o);
#else
  return absl::FailedPreconditionError(
      "backend 'cuda' requested, but this build has no CUDA backend (nvcc was not found "
      "when it was configured)");
#endif
}

int BackendNumaNode(const BackendRequest& request) {
#ifdef MEGATRAIN_HAS_CUDA
  if (request.kind != "cpu" && CudaAvailable()) return CudaDeviceNumaNode(0);
#endif
  return -1;
}

std::vector<GpuInfo> ListGpus() {
  std::vector<GpuInfo> gpus;
#ifdef MEGATRAIN_HAS_CUDA
  for (int i = 0; i < CudaDeviceCount(); ++i) {
    absl::StatusOr<CudaDeviceInfo> d = DescribeCudaDevice(i);
    if (!d.ok()) continue;
    gpus.push_back(GpuInfo{i, d->name, d->memory_bytes, CudaDeviceNumaNode(i), d->pci_bus_id});
  }
#endif
  return gpus;
}

}  // namespace megatrain
