#include "engine/optim/held_gradients.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "engine/common/check.h"
#include "engine/common/dtype.h"

namespace megatrain {

namespace {

int64_t Blocks(int64_t n) { return (n + kHeldBlock - 1) / kHeldBlock; }

// |f| < 2^15 (scaled so), finite: its fp16 bits, rounded to nearest even.
uint16_t ToHalf(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const int exponent = static_cast<int>((bits >> 23) & 0xffu) - 127;
  if (exponent < -14) {  // a subnormal half (or zero): a multiple of 2^-24, rounded
    const float units = std::nearbyint(std::ldexp(std::fabs(f), 24));
    return static_cast<uint16_t>(sign | static_cast<uint16_t>(units));  // 1024: the least normal
  }
  const uint32_t mantissa = bits & 0x7fffffu;
  uint32_t half = (static_cast<uint32_t>(exponent + 15) << 10) | (mantissa >> 13);
  const uint32_t rest = mantissa & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (half & 1u))) ++half;  // a carry raises the exponent
  return static_cast<uint16_t>(sign | half);
}

}  // namespace

void EncodeHeld(const float* x, int64_t n, uint16_t* q, float* scales) {
  const int64_t blocks = Blocks(n);
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t begin = b * kHeldBlock, end = std::min(n, begin + kHeldBlock);
    float largest = 0.0f;
    bool finite = true;
    for (int64_t i = begin; i < end; ++i) {
      largest = std::max(largest, std::fabs(x[i]));
      finite &= std::isfinite(x[i]);
    }
    if (!finite || largest == 0.0f) {  // decoded from the scale alone
      scales[b] = finite ? 0.0f : std::numeric_limits<float>::quiet_NaN();
      std::fill(q + begin, q + end, uint16_t{0});
      continue;
    }
    int exponent = 0;
    std::frexp(largest, &exponent);  // largest in [2^(e-1), 2^e)
    const float scale = std::ldexp(1.0f, 15 - exponent);  // to [2^14, 2^15)
    scales[b] = scale;
    for (int64_t i = begin; i < end; ++i) q[i] = ToHalf(x[i] * scale);
  }
}

void DecodeHeld(const uint16_t* q, const float* scales, int64_t n, float* x) {
  const int64_t blocks = Blocks(n);
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t begin = b * kHeldBlock, end = std::min(n, begin + kHeldBlock);
    const float scale = scales[b];
    if (!(scale > 0.0f)) {  // zero, or NaN (not finite)
      std::fill(x + begin, x + end, scale == 0.0f ? 0.0f : scale);
      continue;
    }
    const float unscale = 1.0f / scale;  // a power of two: exact
    for (int64_t i = begin; i < end; ++i) x[i] = F16ToFloat(q[i]) * unscale;
  }
}

HeldGradients::HeldGradients(std::vector<int64_t> state_elements)
    : state_elements_(std::move(state_elements)), units_(state_elements_.size()) {}

void HeldGradients::Store(int64_t unit, int64_t offset, int64_t count, const float* grad) {
  MT_CHECK(unit >= 0 && unit < static_cast<int64_t>(units_.size()));
  MT_CHECK(offset >= 0 && count >= 0 && offset + count <= state_elements_[unit]);
  Unit& u = units_[unit];
  if (u.values == nullptr) u.values.reset(new uint16_t[state_elements_[unit]]);  // touched here
  std::vector<float>& scales = u.scales[offset];
  scales.resize(Blocks(count));
  EncodeHeld(grad, count, u.values.get() + offset, scales.data());
}

void HeldGradients::Load(int64_t unit, int64_t offset, int64_t count, float* out) const {
  const Unit& u = units_[unit];
  const auto it = u.scales.find(offset);
  MT_CHECK_MSG(it != u.scales.end() && static_cast<int64_t>(it->second.size()) == Blocks(count),
               "unit %lld has no piece stored at %lld", static_cast<long long>(unit),
               static_cast<long long>(offset));
  DecodeHeld(u.values.get() + offset, it->second.data(), count, out);
}

}  // namespace megatrain
