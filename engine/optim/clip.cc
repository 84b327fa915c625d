// Gradient norm. The chunking is a function of n alone (never of the thread count) so a
// resumed run on a different machine computes the same norm bit for bit.
#include "engine/optim/clip.h"

#include <algorithm>

#include "engine/common/check.h"

namespace megatrain {
namespace {

constexpr int64_t kMaxChunks = 256;     // bounds the stack array of partial sums
constexpr int64_t kMinChunk = 1 << 15;  // below this a chunk is not worth a thread

}  // namespace

double SumOfSquares(const float* g, int64_t n) {
  MT_CHECK(n >= 0);
  if (n == 0) return 0.0;
  MT_CHECK(g != nullptr);
  const int64_t num_chunks = std::min(kMaxChunks, (n + kMinChunk - 1) / kMinChunk);
  const int64_t chunk = (n + num_chunks - 1) / num_chunks;
  double partials[kMaxChunks];
#pragma omp parallel for schedule(static) if (num_chunks > 1)
  for (int64_t c = 0; c < num_chunks; ++c) {
    const int64_t begin = std::min(n, c * chunk);
    const int64_t end = std::min(n, begin + chunk);
    double sum = 0.0;
    // The simd reduction's lane order is fixed at compile time, so it is still
    // deterministic.
#pragma omp simd reduction(+ : sum)
    for (int64_t i = begin; i < end; ++i) {
      const double x = g[i];
      sum += x * x;
    }
    partials[c] = sum;
  }
  double total = 0.0;
  for (int64_t c = 0; c < num_chunks; ++c) total += partials[c];
  return total;
}

float ClipCoefficient(double total_norm, double max_norm) {
  if (max_norm <= 0.0) return 1.0f;
  const double coef = max_norm / (total_norm + 1e-6);
  // std::min(coef, 1.0) keeps a NaN coef, as torch.clamp does.
  return static_cast<float>(std::min(coef, 1.0));
}

}  // namespace megatrain
