#include "engine/backend/pci_numa.h"

#include <numa.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "gtest/gtest.h"

namespace megatrain {
namespace {

// hwloc's answer for every PCI device of this machine agrees with the kernel's own
// numa_node attribute (which says -1 on machines without NUMA; hwloc then names node 0).
TEST(PciNuma, AgreesWithSysfsForEveryPciDevice) {
  const std::filesystem::path root = "/sys/bus/pci/devices";
  if (!std::filesystem::exists(root)) GTEST_SKIP() << "no " << root;
  const int max_node = numa_available() >= 0 ? numa_max_node() : 0;
  int checked = 0;
  for (const auto& entry : std::filesystem::directory_iterator(root)) {
    const std::string bus = entry.path().filename().string();
    int sysfs_node = -1;
    std::ifstream(entry.path() / "numa_node") >> sysfs_node;
    absl::StatusOr<int> node = NumaNodeOfPciDevice(bus);
    // Bridges hwloc filters out are not asked about by the engine; GPUs are kept.
    if (absl::IsNotFound(node.status())) continue;
    ASSERT_TRUE(node.ok()) << bus << ": " << node.status();
    EXPECT_LE(*node, max_node) << bus;
    if (sysfs_node >= 0) {
      EXPECT_EQ(*node, sysfs_node) << bus;
    }
    ++checked;
  }
  if (checked == 0) GTEST_SKIP() << "hwloc lists no PCI device here";
}

TEST(PciNuma, UnknownDeviceIsNotFound) {
  absl::StatusOr<int> node = NumaNodeOfPciDevice("ffff:ff:1f.7");
  EXPECT_TRUE(absl::IsNotFound(node.status())) << node.status();
  EXPECT_NE(node.status().message().find("ffff:ff:1f.7"), std::string::npos);
}

}  // namespace
}  // namespace megatrain
