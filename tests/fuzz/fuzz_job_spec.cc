// Fuzzes the YAML job spec parser. What it accepts must survive JobSpecToYaml and parse
// again to the same spec (the daemon stores and reruns specs that way).
#include <cstdint>
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
    std::abort();  // a spec that does not survive its own YAML
  }
  return 0;
}
