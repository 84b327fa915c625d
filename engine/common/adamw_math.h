// One AdamW step of one element, as torch.optim.AdamW's single-tensor path computes it
// (amsgrad=False, maximize=False), and the step's scalars: the backends' AdamW
// (common/backend.h), for the host and for CUDA device code (no library beyond <cmath>).
// The host optimizer's vectorised loop (optim/adamw.cc) computes the same operations in the
// same order, with the scalars as plain values (3% faster there than through this
// function): tests/engine/optim/adamw_test.cc holds the two to the same bits.
//
// Every element op rounds to fp32 in PyTorch's order, with no fused multiply-add: the host
// compiles it with -ffp-contract=off, CUDA with IEEE intrinsics (no flush of subnormals),
// so the two give the same bits.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "engine/common/host_device.h"

namespace megatrain {

// A step's scalars, computed in double as torch/optim/adam.py does; each became a float
// where it meets an fp32 tensor.
struct AdamWScalars {
  float decay = 1;             // 1 - lr * weight_decay
  float lerp_w = 0;            // 1 - beta1 (torch.lerp's weight)
  float one_minus_lerp_w = 1;  // 1 - lerp_w, in fp32 as torch.lerp computes it
  float beta2 = 0, one_minus_beta2 = 1;
  float bc2_sqrt = 1;          // sqrt(1 - beta2^step)
  float eps = 0;
  float neg_step_size = 0;     // -lr / (1 - beta1^step)
  bool lerp_small = true;      // torch.lerp's branch for |weight| < 0.5
};

inline AdamWScalars MakeAdamWScalars(int64_t step, double lr, double weight_decay,
                                     double beta1, double beta2, double eps) {
  const double bias_correction1 = 1.0 - std::pow(beta1, static_cast<double>(step));
  const double bias_correction2 = 1.0 - std::pow(beta2, static_cast<double>(step));
  const double step_size = lr / bias_correction1;
  AdamWScalars s;
  s.decay = static_cast<float>(1.0 - lr * weight_decay);
  s.lerp_w = static_cast<float>(1.0 - beta1);
  s.one_minus_lerp_w = 1.0f - s.lerp_w;
  s.beta2 = static_cast<float>(beta2);
  s.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  s.bc2_sqrt = static_cast<float>(std::sqrt(bias_correction2));
  s.eps = static_cast<float>(eps);
  s.neg_step_size = static_cast<float>(-step_size);
  s.lerp_small = std::fabs(s.lerp_w) < 0.5f;
  return s;
}

#if defined(__CUDA_ARCH__)
MT_HOST_DEVICE inline float AdamWAdd(float a, float b) { return __fadd_rn(a, b); }
MT_HOST_DEVICE inline float AdamWSub(float a, float b) { return __fsub_rn(a, b); }
MT_HOST_DEVICE inline float AdamWMul(float a, float b) { return __fmul_rn(a, b); }
MT_HOST_DEVICE inline float AdamWDiv(float a, float b) { return __fdiv_rn(a, b); }
MT_HOST_DEVICE inline float AdamWSqrt(float a) { return __fsqrt_rn(a); }
#else
inline float AdamWAdd(float a, float b) { return a + b; }
inline float AdamWSub(float a, float b) { return a - b; }
inline float AdamWMul(float a, float b) { return a * b; }
inline float AdamWDiv(float a, float b) { return a / b; }
inline float AdamWSqrt(float a) { return std::sqrt(a); }
#endif

// One element: g = grad * grad_scale; p = p * decay; m = lerp(m, g, 1 - beta1);
// v = v * beta2 + (1 - beta2) * g * g; p = p + (-step_size * m) / (sqrt(v) / bc2_sqrt + eps).
template <bool kLerpSmall>
MT_HOST_DEVICE inline void AdamWElement(const AdamWScalars s, float grad, float grad_scale,
                                        float* p, float* m, float* v) {
  const float g = AdamWMul(grad, grad_scale);
  const float decayed = AdamWMul(*p, s.decay);
  const float mi = *m;
  const float m_new = kLerpSmall ? AdamWAdd(mi, AdamWMul(s.lerp_w, AdamWSub(g, mi)))
                                 : AdamWSub(g, AdamWMul(AdamWSub(g, mi), s.one_minus_lerp_w));
  const float v_new = AdamWAdd(AdamWMul(*v, s.beta2), AdamWMul(AdamWMul(s.one_minus_beta2, g), g));
  const float denom = AdamWAdd(AdamWDiv(AdamWSqrt(v_new), s.bc2_sqrt), s.eps);
  const float p_new = AdamWAdd(decayed, AdamWDiv(AdamWMul(s.neg_step_size, m_new), denom));
  *m = m_new;
  *v = v_new;
  *p = p_new;
}

// fp32 to bf16 bits, rounded to nearest even (a NaN stays a quiet NaN), without a branch.
MT_HOST_DEVICE inline uint16_t AdamWRoundToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (bits >> 16) | 0x40u;
  return static_cast<uint16_t>((bits & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

}  // namespace megatrain
