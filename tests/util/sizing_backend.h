// A backend with the CUDA backend's element types (bf16 weights and activations, f32
// gradients) that runs on the CPU backend: for sizing device plans on a machine without a
// GPU. Every call but the types forwards to a CPU backend.
#pragma once

#include <string>

#include "engine/backend/cpu_backend.h"
#include "tests/util/forwarding_backend.h"

namespace megatrain::testing {

class SizingBackend final : public ForwardingBackend {
 public:
  SizingBackend() : ForwardingBackend(CreateCpuBackend(CpuBackendOptions{})) {}
  std::string name() const override { return "cuda:sizing"; }
  BackendKind kind() const override { return BackendKind::kCuda; }
  DType weight_dtype() const override { return DType::kBF16; }
  DType act_dtype() const override { return DType::kBF16; }
  DType grad_dtype() const override { return DType::kF32; }
  DType stat_dtype() const override { return DType::kF32; }
};

}  // namespace megatrain::testing
