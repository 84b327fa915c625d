// The MoE sort's device scratch (MoeSort in common/backend.h), shared by the layer that
// carves it, the CUDA kernel that uses it and the CPU reference (which needs none): one
// int32 per tile of kMoeSortTile choices and expert. Plain C++, nvcc includes it too.
#pragma once

#include <cstdint>

namespace megatrain {

constexpr int64_t kMoeSortTile = 1024;
inline int64_t MoeSortScratchInts(int64_t rows, int64_t E) {
  return (rows + kMoeSortTile - 1) / kMoeSortTile * E;
}

}  // namespace megatrain
