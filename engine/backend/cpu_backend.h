// The CPU backend: the pipeline's three streams are three host threads, each draining a
// FIFO of closures; events are generation counters. Ops run the reference kernels
// (kernels/reference/), which use every core through OpenMP and OpenBLAS.
//
// It is the numerical reference of the GPU backend and what the daemon runs on machines
// without a GPU. Precision kF64 runs every role in double: finite-difference gradient
// checks use it. In kF32, weights arrive as bf16 from the host store and widen to f32.
#pragma once

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/common/backend.h"
#include "engine/common/collective.h"

namespace megatrain {

struct CpuBackendOptions {
  enum class Precision { kF32, kF64 };
  Precision precision = Precision::kF32;
};

std::unique_ptr<Backend> CreateCpuBackend(const CpuBackendOptions& options);

// A reduce-scatter group over CPU backends (simulated devices), rank r = backends[r]:
// the ranks' D2H stream threads meet and each adds its shard in rank order.
// REQUIRES: every backend is a CPU backend of one precision (else InvalidArgument).
[[nodiscard]] absl::StatusOr<std::vector<std::unique_ptr<GradCollective>>> CreateCpuCollectives(
    const std::vector<Backend*>& backends);

}  // namespace megatrain
