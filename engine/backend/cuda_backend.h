// The CUDA backend: three CUDA streams (compute, H2D, D2H) ordered by events only;
// kernels from kernels/cuda/, matmuls through cuBLAS in bf16 with fp32 accumulation.
// Weights and activations are bf16 on the device, weight gradients and statistics fp32.
//
// Device memory is taken only through Alloc(), at setup, and never beyond the job's cap:
// an allocation that would exceed it is ResourceExhausted with the numbers. The peak is
// reported. Host ranges the pipeline streams from are page-locked with PinHostRange().
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/common/backend.h"
#include "engine/common/collective.h"

namespace megatrain {

// UploadWeightsFromF32 stages fp32 through this many device bytes per stream that calls it
// (Backend::f32_upload_staging_bytes), in two halves.
inline constexpr int64_t kCudaF32UploadStagingBytes = int64_t{1} << 30;  // 1 GiB

struct CudaBackendOptions {
  int device = 0;
  int64_t device_memory_cap_bytes = 0;  // 0: whatever the device has free
};

// Number of CUDA devices (0 when the driver or a device is missing).
int CudaDeviceCount();

[[nodiscard]] absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(
    const CudaBackendOptions& options);

struct CudaDeviceInfo {
  std::string name;
  int64_t memory_bytes = 0;
  std::string pci_bus_id;
};
[[nodiscard]] absl::StatusOr<CudaDeviceInfo> DescribeCudaDevice(int device);

// The NUMA node nearest the device (from its PCI address), or -1 when unknown.
int CudaDeviceNumaNode(int device);

// A reduce-scatter group over CUDA backends through NCCL (engine/backend/nccl.h), rank r =
// backends[r]. Unavailable when NCCL cannot be loaded; InvalidArgument for a backend that
// is not CUDA or a device given twice.
[[nodiscard]] absl::StatusOr<std::vector<std::unique_ptr<GradCollective>>> CreateCudaCollectives(
    const std::vector<Backend*>& backends);

}  // namespace megatrain
