#include "engine/optim/held_gradients.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "engine/common/check.h"

namespace megatrain {

namespace {

constexpr float kLevels = 32767.0f;

int64_t Blocks(int64_t n) { return (n + kHeldBlock - 1) / kHeldBlock; }

}  // namespace

void EncodeHeld(const float* x, int64_t n, int16_t* q, float* scales) {
  const int64_t blocks = Blocks(n);
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t begin = b * kHeldBlock, end = std::min(n, begin + kHeldBlock);
    float largest = 0.0f;
    bool nan = false;
    for (int64_t i = begin; i < end; ++i) {
      largest = std::max(largest, std::fabs(x[i]));
      nan |= std::isnan(x[i]);
    }
    if (nan) largest = std::numeric_limits<float>::quiet_NaN();
    scales[b] = largest;
    if (!std::isfinite(largest) || largest == 0.0f) {  // decoded from the scale alone
      std::fill(q + begin, q + end, int16_t{0});
      continue;
    }
    const float to_level = kLevels / largest;
    for (int64_t i = begin; i < end; ++i) {
      q[i] = static_cast<int16_t>(std::nearbyint(x[i] * to_level));
    }
  }
}

void DecodeHeld(const int16_t* q, const float* scales, int64_t n, float* x) {
  const int64_t blocks = Blocks(n);
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t begin = b * kHeldBlock, end = std::min(n, begin + kHeldBlock);
    const float largest = scales[b];
    const float step = std::isfinite(largest) ? largest / kLevels
                                              : std::numeric_limits<float>::quiet_NaN();
    for (int64_t i = begin; i < end; ++i) x[i] = static_cast<float>(q[i]) * step;
  }
}

HeldGradients::HeldGradients(std::vector<int64_t> state_elements)
    : state_elements_(std::move(state_elements)), units_(state_elements_.size()) {}

void HeldGradients::Store(int64_t unit, int64_t offset, int64_t count, const float* grad) {
  MT_CHECK(unit >= 0 && unit < static_cast<int64_t>(units_.size()));
  MT_CHECK(offset >= 0 && count >= 0 && offset + count <= state_elements_[unit]);
  Unit& u = units_[unit];
  if (u.values == nullptr) u.values.reset(new int16_t[state_elements_[unit]]);  // first touch here
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
