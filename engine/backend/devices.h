// The devices of this machine: whether CUDA is usable, the GPUs it has (name, memory,
// NUMA node, PCI bus), and the NUMA node nearest a backend's device. Listing only: the
// backends are made by factory.h.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/backend/factory.h"  // BackendRequest

namespace megatrain {

// True when this build has the CUDA backend and a CUDA device is visible.
bool CudaAvailable();

struct GpuInfo {
  int index = 0;
  std::string name;
  int64_t memory_bytes = 0;
  int numa_node = -1;
  std::string pci_bus_id;
};
// The CUDA devices this build can use (empty without CUDA).
std::vector<GpuInfo> ListGpus();

// The NUMA node nearest the device the backend uses, or -1 (CPU backend, unknown).
int BackendNumaNode(const BackendRequest& request);

}  // namespace megatrain
