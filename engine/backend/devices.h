// The devices of this machine: whether CUDA is usable, the GPUs it has (name, memory,
// NUMA node, PCI bus), and the NUMA node nearest a backend's device. Listing only: the
// backends are made by factory.h.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/backend/factory.h"  // BackendRequest
#include "engine/engine.h"           // CudaAvailable, GpuInfo, ListGpus

namespace megatrain {

// The NUMA node nearest the device the backend uses, or -1 (CPU backend, unknown).
int BackendNumaNode(const BackendRequest& request);

}  // namespace megatrain
