// Picks the backend a job runs on: "cpu", "cuda" (device 0), or "auto" (CUDA when this
// build has it and a device is present, else the CPU).
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "engine/common/backend.h"

namespace megatrain {

struct BackendRequest {
  std::string kind = "auto";            // auto | cpu | cuda
  int64_t device_memory_cap_bytes = 0;  // CUDA: 0 = the device's free memory
};

// True when this build has the CUDA backend and a CUDA device is visible.
bool CudaAvailable();

[[nodiscard]] absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(const BackendRequest& request);

// The NUMA node nearest the device the backend uses, or -1 (CPU backend, unknown).
int BackendNumaNode(const BackendRequest& request);

}  // namespace megatrain
