// Fuzzes config.json parsing, and the layout built from whatever it accepts.
#include <cstdint>

#include "engine/model/config.h"
#include "engine/model/layout.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  absl::StatusOr<megatrain::ModelConfig> config = megatrain::ParseModelConfig(
      absl::string_view(reinterpret_cast<const char*>(data), size), "config.json");
  if (!config.ok()) return 0;
  const megatrain::ModelLayout layout = megatrain::BuildLayout(*config);
  (void)layout;
  (void)megatrain::NumParameters(*config);
  return 0;
}
