// The NUMA node nearest a PCI device, from the hwloc topology.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace megatrain {

// The OS index of the NUMA node closest to the PCI device `bus_id` ("0000:3b:00.0", any
// case): the first node of its nearest non-I/O ancestor in the hwloc topology. The
// topology is loaded once per process. NotFound when hwloc does not list the device;
// Unavailable when the topology cannot be loaded; -1 when the ancestor has no node.
[[nodiscard]] absl::StatusOr<int> NumaNodeOfPciDevice(absl::string_view bus_id);

}  // namespace megatrain
