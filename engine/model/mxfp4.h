// MXFP4 expert weights (GPT-OSS's released checkpoints), dequantized exactly as
// transformers' convert_moe_packed_tensors does, so a model loads bit-equal to
// from_pretrained(..., quantization_config=Mxfp4Config(dequantize=True)).
//
// A tensor W of transformers' shape (E, K, R) is stored as
//   W_blocks u8 (E, R, K/32, 16): two 4-bit codes per byte, the low nibble first
//   W_scales u8 (E, R, K/32):     one power-of-two exponent (biased by 127) per 32 codes
// and element (e, k, r) = bf16(e2m1(code) * 2^(scale - 127)), code the k-th nibble of
// row (e, r): dequantized row-major as (E, R, K), then transposed to (E, K, R).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "engine/model/safetensors.h"

namespace megatrain {

// out f32 (E, G*32, R) from blocks (E, R, G, 16) and scales (E, R, G); every value is a
// bf16 (the exact product rounded to nearest even; inf past the fp32 range).
void DequantizeMxfp4(const uint8_t* blocks, const uint8_t* scales, int64_t E, int64_t R,
                     int64_t G, float* out);

// Whether `reader` holds tensor `name` as MXFP4 (`name`_blocks).
bool HasMxfp4(const ModelTensorReader& reader, const std::string& name);

// Whether `name`_blocks and `name`_scales are there as `shape` (transformers' (E, K, R))
// implies: ReadMxfp4AsFloat's errors, from the headers alone.
[[nodiscard]] absl::Status CheckMxfp4(const ModelTensorReader& reader, const std::string& name,
                                      const std::vector<int64_t>& shape);

// Reads `name`_blocks and `name`_scales and dequantizes them into `out` (the product of
// `shape` floats). shape is transformers' (E, K, R); K must be a multiple of 32. Errors
// name the tensor: NotFound when either part is missing, InvalidArgument when a part is
// not U8 or its shape is not the one `shape` implies.
[[nodiscard]] absl::Status ReadMxfp4AsFloat(const ModelTensorReader& reader,
                                            const std::string& name,
                                            const std::vector<int64_t>& shape, float* out);

}  // namespace megatrain
