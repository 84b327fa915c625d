// SwiGLU activation: out = silu(gate) * up, on the fused gate|up projection output.
//
// gate and up come from one GEMM and share each row ([gate (I) | up (I)]), so the backward
// writes both halves of one gradient row and the fused projection's backward is one GEMM.
// Math is in double per element; sigmoid as 1 / (1 + exp(-x)) saturates to 0 or 1 without
// overflow trouble (exp(-x) = inf gives 0, never NaN).
#pragma once

#include <cmath>
#include <cstdint>

namespace megatrain::ref {

// gu (N, 2*I) rows [gate | up] -> out (N, I).
template <typename T>
void SwiGlu(T* out, const T* gu, int64_t N, int64_t I) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < N; ++r) {
    const T* gate = gu + r * 2 * I;
    const T* up = gate + I;
    T* y = out + r * I;
    for (int64_t c = 0; c < I; ++c) {
      const double x = gate[c];
      y[c] = static_cast<T>(x / (1.0 + std::exp(-x)) * up[c]);
    }
  }
}

// dgu (N, 2*I) written from dout (N, I) and the forward's gu (N, 2*I):
//   dgate = dout * up * sig(g) * (1 + g * (1 - sig(g))),  dup = dout * silu(g).
template <typename T>
void SwiGluBackward(T* dgu, const T* dout, const T* gu, int64_t N, int64_t I) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < N; ++r) {
    const T* gate = gu + r * 2 * I;
    const T* up = gate + I;
    const T* g = dout + r * I;
    T* dgate = dgu + r * 2 * I;
    T* dup = dgate + I;
    for (int64_t c = 0; c < I; ++c) {
      const double x = gate[c];
      const double sig = 1.0 / (1.0 + std::exp(-x));
      dgate[c] = static_cast<T>(g[c] * static_cast<double>(up[c]) * sig * (1.0 + x * (1.0 - sig)));
      dup[c] = static_cast<T>(g[c] * x * sig);
    }
  }
}

}  // namespace megatrain::ref
