// Fuzzes the safetensors reader: Open() validates the header and the ranges; reading every
// tensor the validation accepted must stay inside the file.
#include <cstdint>
#include <vector>

#include "engine/model/safetensors.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = megatrain::fuzz::WriteInput(data, size, "model.safetensors");
  absl::StatusOr<megatrain::SafetensorsFile> file = megatrain::SafetensorsFile::Open(path);
  if (!file.ok()) return 0;
  for (const megatrain::TensorInfo& t : file->tensors()) {
    if (t.num_bytes > (1 << 20)) continue;
    std::vector<uint8_t> raw(t.num_bytes);
    (void)file->ReadRaw(t, raw.data());
    if (t.dtype == megatrain::DType::kBF16 || t.dtype == megatrain::DType::kF32 ||
        t.dtype == megatrain::DType::kF16) {
      std::vector<float> values(t.num_elements());
      (void)file->ReadAsFloat(t, values.data());
    }
  }
  return 0;
}
