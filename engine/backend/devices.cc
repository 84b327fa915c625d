#include "engine/backend/devices.h"

#include "engine/common/device_name.h"
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

int BackendNumaNode(const BackendRequest& request) {
#ifdef MEGATRAIN_HAS_CUDA
  if (request.kind != "cpu" && CudaAvailable() && CudaDeviceIndexOf(request.kind) >= 0) {
    return CudaDeviceNumaNode(CudaDeviceIndexOf(request.kind));
  }
#endif
  return -1;
}

}  // namespace megatrain
