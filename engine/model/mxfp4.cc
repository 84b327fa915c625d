#include "engine/model/mxfp4.h"

#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "engine/common/dtype.h"
#include "engine/common/status.h"

namespace megatrain {
namespace {

// The e2m1 values of the 16 codes (sign in bit 3).
constexpr float kFp4Values[16] = {+0.0f, +0.5f, +1.0f, +1.5f, +2.0f, +3.0f, +4.0f, +6.0f,
                                  -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

// bf16(value * 2^exponent) as torch.ldexp on a bf16 tensor computes it: the exact scaled
// value in fp32 (overflowing to inf past the fp32 range, never NaN: 0 stays 0), rounded to
// nearest even. Checked against transformers for all 256 scales (mxfp4_test).
float ScaledBf16(float value, int exponent) {
  return Bf16ToFloat(FloatToBf16(std::ldexp(value, exponent)));
}

}  // namespace

void DequantizeMxfp4(const uint8_t* blocks, const uint8_t* scales, int64_t E, int64_t R,
                     int64_t G, float* out) {
  const int64_t K = G * 32;
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t r = 0; r < R; ++r) {
      const uint8_t* row = blocks + (e * R + r) * G * 16;
      const uint8_t* row_scales = scales + (e * R + r) * G;
      float* dst = out + e * K * R + r;  // column r of expert e's (K, R)
      for (int64_t g = 0; g < G; ++g) {
        const int exponent = static_cast<int>(row_scales[g]) - 127;
        for (int64_t b = 0; b < 16; ++b) {
          const uint8_t byte = row[g * 16 + b];
          const int64_t k = g * 32 + 2 * b;
          dst[k * R] = ScaledBf16(kFp4Values[byte & 0x0f], exponent);
          dst[(k + 1) * R] = ScaledBf16(kFp4Values[byte >> 4], exponent);
        }
      }
    }
  }
}

bool HasMxfp4(const ModelTensorReader& reader, const std::string& name) {
  return reader.Has(name + "_blocks");
}

absl::Status CheckMxfp4(const ModelTensorReader& reader, const std::string& name,
                        const std::vector<int64_t>& shape) {
  if (shape.size() != 3 || shape[1] % 32 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor '", name, "' of shape ", ShapeToString(shape),
                     " cannot be MXFP4: its second dimension must be a multiple of 32"));
  }
  const int64_t E = shape[0], K = shape[1], R = shape[2], G = K / 32;
  const DType u8 = DType::kU8;
  RETURN_IF_ERROR(reader.CheckTensor(name + "_blocks", {E, R, G, 16}, &u8));
  return reader.CheckTensor(name + "_scales", {E, R, G}, &u8);
}

absl::Status ReadMxfp4AsFloat(const ModelTensorReader& reader, const std::string& name,
                              const std::vector<int64_t>& shape, float* out) {
  RETURN_IF_ERROR(CheckMxfp4(reader, name, shape));
  const int64_t E = shape[0], K = shape[1], R = shape[2], G = K / 32;
  std::vector<uint8_t> blocks(static_cast<size_t>(E * R * G * 16));
  std::vector<uint8_t> scales(static_cast<size_t>(E * R * G));
  RETURN_IF_ERROR(reader.ReadRaw(name + "_blocks", {E, R, G, 16}, DType::kU8, blocks.data()));
  RETURN_IF_ERROR(reader.ReadRaw(name + "_scales", {E, R, G}, DType::kU8, scales.data()));
  DequantizeMxfp4(blocks.data(), scales.data(), E, R, G, out);
  return absl::OkStatus();
}

}  // namespace megatrain
