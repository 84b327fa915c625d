// Seeded normal values for the optimizer tests: parameters, gradients and moments drawn
// the same way in every test, so that a seed names one vector.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

namespace megatrain {

// n draws of N(0, stddev^2) from std::mt19937(seed).
inline std::vector<float> Normal(int64_t n, uint32_t seed, float stddev = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, stddev);
  std::vector<float> x(n);
  for (float& e : x) e = dist(rng);
  return x;
}

}  // namespace megatrain
