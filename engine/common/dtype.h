// Element types and the bf16 / f16 conversions the host side needs.
//
// bf16 rounding is round-to-nearest-even, as PyTorch's .to(torch.bfloat16), so weights we
// write are bit-identical to what a PyTorch reference produces from the same fp32 values.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace megatrain {

enum class DType { kBF16, kF16, kF32, kF64, kI32, kU8, kI8 };

inline int DTypeSize(DType t) {
  switch (t) {
    case DType::kU8:
    case DType::kI8: return 1;
    case DType::kBF16:
    case DType::kF16: return 2;
    case DType::kF32:
    case DType::kI32: return 4;
    case DType::kF64: return 8;
  }
  return 0;
}

inline const char* DTypeName(DType t) {
  switch (t) {
    case DType::kBF16: return "BF16";
    case DType::kF16: return "F16";
    case DType::kF32: return "F32";
    case DType::kF64: return "F64";
    case DType::kI32: return "I32";
    case DType::kU8: return "U8";
    case DType::kI8: return "I8";
  }
  return "?";
}

inline float Bf16ToFloat(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t FloatToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);  // quiet NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

inline float F16ToFloat(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1f;
  const uint32_t mant = h & 0x3ff;
  if (exp == 0) {  // zero or subnormal: mant * 2^-24
    float f = std::ldexp(static_cast<float>(mant), -24);
    return sign ? -f : f;
  }
  uint32_t bits;
  if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

}  // namespace megatrain
