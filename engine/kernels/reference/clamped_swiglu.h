// GPT-OSS's clamped SwiGLU: out = (clamp(up, -limit, limit) + 1) * glu(min(gate, limit)),
// glu(g) = g * sigmoid(alpha * g), on the fused gate|up projection output (GPT-OSS: alpha =
// 1.702, limit = 7).
//
// The rows keep transformers' interleaving (the experts' gate_up_proj is stored as
// transformers has it): column 2j of a row is gate j, column 2j + 1 is up j. The backward
// is torch's clamp gradient: it passes where the input lies inside the clamp range,
// boundaries included (gate <= limit; -limit <= up <= limit), and is zero elsewhere. NaN inputs propagate in the forward (no std::min) and get zero gradient.
// Math is in double per element; sigmoid as 1 / (1 + exp(-x)) saturates without NaN.
#pragma once

#include <cmath>
#include <cstdint>

namespace megatrain::ref {

// gu (N, 2*I) rows [gate_0, up_0, gate_1, up_1, ...] -> out (N, I).
template <typename T>
void ClampedSwiGlu(T* out, const T* gu, int64_t N, int64_t I, double alpha, double limit) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < N; ++r) {
    const T* row = gu + r * 2 * I;
    T* y = out + r * I;
    for (int64_t c = 0; c < I; ++c) {
      const double x = row[2 * c], v = row[2 * c + 1];
      const double g = x > limit ? limit : x;
      const double u = v > limit ? limit : (v < -limit ? -limit : v);
      y[c] = static_cast<T>((u + 1.0) * g / (1.0 + std::exp(-alpha * g)));
    }
  }
}

// dgu (N, 2*I) written (interleaved like gu) from dout (N, I) and the forward's gu; with g, u the
// clamped gate and up and sig = sigmoid(alpha * g):
//   dgate = dout * (u + 1) * sig * (1 + alpha * g * (1 - sig))   where gate <= limit, else 0
//   dup   = dout * g * sig                       where -limit <= up <= limit, else 0.
template <typename T>
void ClampedSwiGluBackward(T* dgu, const T* dout, const T* gu, int64_t N, int64_t I, double alpha,
                           double limit) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < N; ++r) {
    const T* row = gu + r * 2 * I;
    const T* dy = dout + r * I;
    T* drow = dgu + r * 2 * I;
    for (int64_t c = 0; c < I; ++c) {
      const double x = row[2 * c], v = row[2 * c + 1], d = dy[c];
      const double g = x > limit ? limit : x;
      const double u = v > limit ? limit : (v < -limit ? -limit : v);
      const double sig = 1.0 / (1.0 + std::exp(-alpha * g));
      const bool gate_passes = x <= limit, up_passes = v >= -limit && v <= limit;
      drow[2 * c] =
          static_cast<T>(gate_passes ? d * (u + 1.0) * sig * (1.0 + alpha * g * (1.0 - sig)) : 0.0);
      drow[2 * c + 1] = static_cast<T>(up_passes ? d * g * sig : 0.0);
    }
  }
}

}  // namespace megatrain::ref
