// The CPU backend: the pipeline's three streams are three host threads, each draining a
// FIFO of closures; events are generation counters. Ops run the reference kernels
// (kernels/reference/), which use every core through OpenMP and OpenBLAS.
//
// It is the numerical reference of the GPU backend and what the daemon runs on machines
// without a GPU. Precision kF64 runs every role in double: finite-difference gradient
// checks use it. In kF32, weights arrive as bf16 from the host store and widen to f32.
#pragma once

#include <memory>

#include "engine/common/backend.h"

namespace megatrain {

struct CpuBackendOptions {
  enum class Precision { kF32, kF64 };
  Precision precision = Precision::kF32;
};

std::unique_ptr<Backend> CreateCpuBackend(const CpuBackendOptions& options);

}  // namespace megatrain
