// Makes backends and collectives: the backend a job runs on ("cpu", "cuda" (device 0),
// "cuda:N", or "auto": CUDA device 0 when this build has it and a device is present, else
// the CPU), and the reduce-scatter group of a data-parallel job's devices. Listing the
// devices is devices.h; measuring rates, plan/rates.h.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/common/backend.h"
#include "engine/common/collective.h"
#include "engine/common/device_name.h"  // CudaDeviceIndexOf
#include "engine/engine.h"              // SetCollectiveDefaults

namespace megatrain {

struct BackendRequest {
  std::string kind = "auto";            // auto | cpu | cuda | cuda:N
  int64_t device_memory_cap_bytes = 0;  // CUDA: 0 = the device's free memory
};

[[nodiscard]] absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(const BackendRequest& request);

// SetCollectiveDefaults (NCCL's environment defaults, first thing in main): engine.h.

// A reduce-scatter group over the devices of a data-parallel job (common/collective.h),
// rank r = backends[r]: NCCL over CUDA devices, the streams' threads over CPU backends.
// Unavailable when the devices cannot reduce on the device (NCCL not loadable): the
// caller may add the gradients on the host instead (pipeline/grad_reducer.h).
[[nodiscard]] absl::StatusOr<std::vector<std::unique_ptr<GradCollective>>> CreateGradCollectives(
    const std::vector<Backend*>& backends);

}  // namespace megatrain
