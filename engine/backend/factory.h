// Picks the backend a job runs on: "cpu", "cuda" (device 0), "cuda:N", or "auto" (CUDA
// device 0 when this build has it and a device is present, else the CPU).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/common/backend.h"
#include "engine/common/collective.h"
#include "engine/common/device_name.h"  // CudaDeviceIndexOf

namespace megatrain {

struct BackendRequest {
  std::string kind = "auto";            // auto | cpu | cuda | cuda:N
  int64_t device_memory_cap_bytes = 0;  // CUDA: 0 = the device's free memory
};

// True when this build has the CUDA backend and a CUDA device is visible.
bool CudaAvailable();

[[nodiscard]] absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(const BackendRequest& request);

// The NUMA node nearest the device the backend uses, or -1 (CPU backend, unknown).
int BackendNumaNode(const BackendRequest& request);

// NCCL's environment defaults (NCCL_NVLS_ENABLE=0 unless set). setenv races with any
// other thread's getenv: call it first thing in main(), before threads start.
void SetCollectiveDefaults();

// A reduce-scatter group over the devices of a data-parallel job (common/collective.h),
// rank r = backends[r]: NCCL over CUDA devices, the streams' threads over CPU backends.
// Unavailable when the devices cannot reduce on the device (NCCL not loadable): the
// caller may add the gradients on the host instead (pipeline/grad_reducer.h).
[[nodiscard]] absl::StatusOr<std::vector<std::unique_ptr<GradCollective>>> CreateGradCollectives(
    const std::vector<Backend*>& backends);

// The rate of a reduce-scatter over `group` (of `backends`): GB/s each device moves to
// the others, (N-1)/N of a `bytes` buffer per call, timed over a few calls after a
// warm-up. The planner's peer rate (NVLink, or PCIe peer copies). Allocates `bytes` on
// every device for the while.
[[nodiscard]] absl::StatusOr<double> MeasureReduceScatterGbps(
    const std::vector<Backend*>& backends,
    const std::vector<std::unique_ptr<GradCollective>>& group, int64_t bytes = 256ll << 20);

struct GpuInfo {
  int index = 0;
  std::string name;
  int64_t memory_bytes = 0;
  int numa_node = -1;
  std::string pci_bus_id;
};
// The CUDA devices this build can use (empty without CUDA).
std::vector<GpuInfo> ListGpus();

// The dense matmul rate of `backend` in TFLOP/s, measured with its own Linear op on
// square operands (n = 8192 on a GPU, bf16 in, fp32 accumulate; n = 512 on the CPU, in
// its f32): the peak that MFU is reported against. Zeroed inputs; about a second.
[[nodiscard]] absl::StatusOr<double> MeasureGemmTflops(Backend* backend);

}  // namespace megatrain
