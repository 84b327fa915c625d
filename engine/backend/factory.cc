#include "engine/backend/factory.h"

#include "engine/common/status.h"

#include <algorithm>
#include <cstdlib>
#include <thread>

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

void SetCollectiveDefaults() {
  // NVLink SHARP (multicast) buys nothing for a reduce-scatter over a few GPUs, and some
  // shared machines forbid it; a value the user set is left alone.
  setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0);
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

absl::StatusOr<double> MeasureReduceScatterGbps(
    const std::vector<Backend*>& backends,
    const std::vector<std::unique_ptr<GradCollective>>& group, int64_t bytes) {
  const int ranks = static_cast<int>(backends.size());
  if (ranks < 2 || group.size() != backends.size()) {
    return absl::InvalidArgumentError("a reduce-scatter needs a group of two or more");
  }
  const int64_t shard = GradShardElements(bytes / 4 / ranks * ranks, ranks);
  constexpr int kIterations = 4;
  // Every buffer first: a rank that failed after others entered the collective would
  // leave them waiting for it.
  std::vector<DeviceBuffer> bufs;
  for (Backend* be : backends) {
    be->BindThread();
    ASSIGN_OR_RETURN(DeviceBuffer b, DeviceBuffer::Allocate(be, 4 * shard * ranks));
    bufs.push_back(std::move(b));
  }
  std::vector<double> seconds(ranks, 0);
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] {
      Backend* be = backends[r];
      be->BindThread();
      const StreamId s = StreamId::kD2H;
      be->Zero(bufs[r].get(), bufs[r].bytes(), s);
      group[r]->ReduceScatter(bufs[r].get(), shard, s);  // warm-up (NCCL sets up channels)
      Event start(be), end(be);
      be->Record(start.get(), s);
      for (int i = 0; i < kIterations; ++i) group[r]->ReduceScatter(bufs[r].get(), shard, s);
      be->Record(end.get(), s);
      be->EventSync(end.get());
      seconds[r] = be->ElapsedSeconds(start.get(), end.get());
    });
  }
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < ranks; ++r) {
    backends[r]->BindThread();
    bufs[r] = DeviceBuffer();
  }
  const double worst = *std::max_element(seconds.begin(), seconds.end());
  if (!(worst > 0)) return absl::InternalError("the reduce-scatter timing came out empty");
  // What each device moves each way: (N-1)/N of the buffer.
  return 4.0 * shard * (ranks - 1) * kIterations / worst / 1e9;
}

}  // namespace megatrain
