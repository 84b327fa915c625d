// A backend for planning a CUDA box's jobs where that box is not: the CUDA backend's element
// types (bf16 weights and activations, fp32 gradients and statistics), its staging for fp32
// uploads, and a device budget given by the caller (a saved machine profile's, or a cap).
// What the planner asks of a backend; it is never meant to run a step: its ops go to a CPU
// backend underneath, with the CPU's types, so their results mean nothing.
// `train_bench --plan-only` plans with it on a machine without the profile's GPU.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "engine/backend/forwarding_backend.h"

namespace megatrain {

class PlanningBackend final : public ForwardingBackend {
 public:
  // name: the backend the plan is for ("cuda:0"); device_budget_bytes: what it may allocate.
  explicit PlanningBackend(std::string name = "cuda:planning", int64_t device_budget_bytes = 0);
  std::string name() const override { return name_; }
  BackendKind kind() const override { return BackendKind::kCuda; }
  DType weight_dtype() const override { return DType::kBF16; }
  DType act_dtype() const override { return DType::kBF16; }
  DType grad_dtype() const override { return DType::kF32; }
  DType stat_dtype() const override { return DType::kF32; }
  int64_t device_memory_budget() const override { return device_budget_bytes_; }
  int64_t f32_upload_staging_bytes() const override;

 private:
  std::string name_;
  int64_t device_budget_bytes_;
};

}  // namespace megatrain
