#include "engine/backend/pci_numa.h"

#include <hwloc.h>

#include <mutex>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace megatrain {
namespace {

// The process's topology with PCI devices kept, loaded on first use and never freed.
absl::StatusOr<hwloc_topology_t> Topology() {
  static std::once_flag once;
  static hwloc_topology_t topology = nullptr;
  static int error = 0;
  std::call_once(once, [] {
    hwloc_topology_t t;
    if (hwloc_topology_init(&t) != 0) {
      error = 1;
      return;
    }
    hwloc_topology_set_io_types_filter(t, HWLOC_TYPE_FILTER_KEEP_IMPORTANT);
    if (hwloc_topology_load(t) != 0) {
      hwloc_topology_destroy(t);
      error = 2;
      return;
    }
    topology = t;
  });
  if (topology == nullptr) {
    return absl::UnavailableError(
        absl::StrCat("hwloc could not ", error == 1 ? "initialise" : "load", " the topology"));
  }
  return topology;
}

}  // namespace

absl::StatusOr<int> NumaNodeOfPciDevice(absl::string_view bus_id) {
  absl::StatusOr<hwloc_topology_t> topology = Topology();
  if (!topology.ok()) return topology.status();
  const std::string id = absl::AsciiStrToLower(bus_id);
  hwloc_obj_t device = hwloc_get_pcidev_by_busidstring(*topology, id.c_str());
  if (device == nullptr) {
    return absl::NotFoundError(absl::StrCat("hwloc lists no PCI device ", id));
  }
  hwloc_obj_t ancestor = hwloc_get_non_io_ancestor_obj(*topology, device);
  if (ancestor == nullptr || ancestor->nodeset == nullptr ||
      hwloc_bitmap_iszero(ancestor->nodeset)) {
    return -1;
  }
  return hwloc_bitmap_first(ancestor->nodeset);
}

}  // namespace megatrain
