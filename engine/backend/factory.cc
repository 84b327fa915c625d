#include "engine/backend/factory.h"

#include "engine/common/status.h"

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

int BackendNumaNode(const BackendRequest& request) {
#ifdef MEGATRAIN_HAS_CUDA
  if (request.kind != "cpu" && CudaAvailable() && CudaDeviceIndexOf(request.kind) >= 0) {
    return CudaDeviceNumaNode(CudaDeviceIndexOf(request.kind));
  }
#endif
  return -1;
}

absl::StatusOr<std::vector<std::unique_ptr<GradCollective>>> CreateGradCollectives(
    const std::vector<Backend*>& backends) {
  if (backends.empty()) return absl::InvalidArgumentError("an empty gradient group");
  if (backends[0]->name() == "cpu") return CreateCpuCollectives(backends);
#ifdef MEGATRAIN_HAS_CUDA
  return CreateCudaCollectives(backends);
#else
  return absl::FailedPreconditionError("this build has no CUDA backend");
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

absl::StatusOr<double> MeasureGemmTflops(Backend* backend) {
  const bool cpu = backend->name() == "cpu";
  const int64_t n = cpu ? 512 : 8192;
  const int iterations = cpu ? 4 : 30;
  const size_t act = static_cast<size_t>(n * n) * DTypeSize(backend->act_dtype());
  const size_t weight = static_cast<size_t>(n * n) * DTypeSize(backend->weight_dtype());
  ASSIGN_OR_RETURN(DeviceBuffer a, DeviceBuffer::Allocate(backend, act));
  ASSIGN_OR_RETURN(DeviceBuffer w, DeviceBuffer::Allocate(backend, weight));
  ASSIGN_OR_RETURN(DeviceBuffer out, DeviceBuffer::Allocate(backend, act));
  const StreamId s = StreamId::kCompute;
  backend->Zero(a.get(), act, s);
  backend->Zero(w.get(), weight, s);
  backend->Linear(out.get(), a.get(), w.get(), nullptr, n, n, n, false, s);  // warm-up
  void* start = backend->CreateEvent();
  void* end = backend->CreateEvent();
  backend->Record(start, s);
  for (int i = 0; i < iterations; ++i) {
    backend->Linear(out.get(), a.get(), w.get(), nullptr, n, n, n, false, s);
  }
  backend->Record(end, s);
  backend->EventSync(end);
  const double seconds = backend->ElapsedSeconds(start, end);
  backend->DestroyEvent(start);
  backend->DestroyEvent(end);
  if (!(seconds > 0)) return absl::InternalError("the GEMM timing came out empty");
  return 2.0 * n * n * n * iterations / seconds / 1e12;
}

}  // namespace megatrain
