// Fuzzes the YAML job spec parser. What it accepts must survive JobSpecToYaml and parse
// again to the same spec (the daemon stores and reruns specs that way).
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "engine/job/spec.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string yaml(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<megatrain::JobSpec> spec = megatrain::ParseJobSpec(yaml, "/fuzz", "fuzz");
  if (!spec.ok()) return 0;
  absl::StatusOr<megatrain::JobSpec> again =
      megatrain::ParseJobSpec(megatrain::JobSpecToYaml(*spec), "", "round trip");
  if (!again.ok() || again->Fingerprint() != spec->Fingerprint() ||
      again->steps != spec->steps || again->schedule.lr != spec->schedule.lr) {
    // A spec that does not survive its own YAML.
    std::fprintf(stderr, "round trip failed: %s\nfirst: %s\nagain: %s\n",
                 again.status().ToString().c_str(), spec->Fingerprint().c_str(),
                 again.ok() ? again->Fingerprint().c_str() : "-");
    std::abort();
  }
  return 0;
}
