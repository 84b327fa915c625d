#include "engine/backend/planning_backend.h"

#include <utility>

#include "engine/backend/cpu_backend.h"
#include "engine/backend/cuda_backend.h"

namespace megatrain {

PlanningBackend::PlanningBackend(std::string name, int64_t device_budget_bytes)
    : ForwardingBackend(CreateCpuBackend(CpuBackendOptions{})),
      name_(std::move(name)),
      device_budget_bytes_(device_budget_bytes) {}

int64_t PlanningBackend::f32_upload_staging_bytes() const { return kCudaF32UploadStagingBytes; }

}  // namespace megatrain
