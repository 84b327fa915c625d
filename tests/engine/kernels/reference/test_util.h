// Helpers shared by the reference-kernel tests: seeded random tensors, tolerance checks,
// a central finite-difference gradient check, a thread-count switch and the check that
// results do not depend on the thread count.
#pragma once

#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <random>
#include <string>
#include <vector>

namespace megatrain::ref {

// The tests' tensors: double for the checks against naive loops, float for what the GPU
// backend runs. Every reference test lives in megatrain::ref and uses both.
using Vec = std::vector<double>;
using VecF = std::vector<float>;

namespace testutil {

inline Vec RandomVec(std::mt19937_64& rng, int64_t size, double lo = -1.0, double hi = 1.0) {
  std::uniform_real_distribution<double> dist(lo, hi);
  Vec v(size);
  for (double& x : v) x = dist(rng);
  return v;
}

inline VecF ToFloat(const Vec& v) { return VecF(v.begin(), v.end()); }
inline Vec ToDouble(const VecF& v) { return Vec(v.begin(), v.end()); }

// sum(out * g): the scalar whose gradient the backward computes for upstream gradient g.
inline double WeightedSum(const Vec& out, const Vec& g) {
  double sum = 0.0;
  for (size_t i = 0; i < out.size(); ++i) sum += out[i] * g[i];
  return sum;
}

// Every |actual - expected| <= atol + rtol * |expected|; reports the first few misses.
inline void ExpectAllNear(const Vec& actual, const Vec& expected, double rtol, double atol,
                          const std::string& what) {
  ASSERT_EQ(actual.size(), expected.size()) << what;
  int misses = 0;
  for (size_t i = 0; i < actual.size(); ++i) {
    const double tol = atol + rtol * std::fabs(expected[i]);
    if (!(std::fabs(actual[i] - expected[i]) <= tol) && ++misses <= 5) {
      ADD_FAILURE() << what << "[" << i << "]: " << actual[i] << " vs expected " << expected[i];
    }
  }
  EXPECT_EQ(misses, 0) << what;
}

inline void ExpectAllNear(const VecF& actual, const Vec& expected, double rtol, double atol,
                          const std::string& what) {
  ExpectAllNear(ToDouble(actual), expected, rtol, atol, what);
}

// Checks analytic (same size as *x) against central differences of loss() w.r.t. each
// element of *x, which is perturbed in place and restored.
inline void ExpectGradientMatches(Vec* x, const Vec& analytic, const std::function<double()>& loss,
                                  const std::string& what, double eps = 1e-6, double rtol = 1e-6,
                                  double atol = 1e-8) {
  ASSERT_EQ(x->size(), analytic.size()) << what;
  Vec numeric(x->size());
  for (size_t i = 0; i < x->size(); ++i) {
    const double saved = (*x)[i];
    (*x)[i] = saved + eps;
    const double plus = loss();
    (*x)[i] = saved - eps;
    const double minus = loss();
    (*x)[i] = saved;
    numeric[i] = (plus - minus) / (2.0 * eps);
  }
  ExpectAllNear(analytic, numeric, rtol, atol, what + " (analytic vs finite difference)");
}

// Runs fn with the OpenMP thread count set to num_threads, then restores it.
inline void WithThreads(int num_threads, const std::function<void()>& fn) {
  const int saved = omp_get_max_threads();
  omp_set_num_threads(num_threads);
  fn();
  omp_set_num_threads(saved);
}

// All parts back to back, to compare every output of a run at once.
template <typename T>
std::vector<T> Concat(std::initializer_list<std::vector<T>> parts) {
  std::vector<T> all;
  for (const auto& part : parts) all.insert(all.end(), part.begin(), part.end());
  return all;
}

template <typename T>
bool BitIdentical(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

// Runs run() with 1, 2 and 3 OpenMP threads and expects the same bits from each: how the
// rows are split among threads must not change any sum. run() allocates its outputs and
// returns them back to back (Concat).
inline void ExpectBitIdenticalAcrossThreadCounts(const std::function<VecF()>& run) {
  std::vector<VecF> results;
  for (int threads : {1, 2, 3}) {
    WithThreads(threads, [&] { results.push_back(run()); });
  }
  EXPECT_TRUE(BitIdentical(results[0], results[1])) << "1 thread vs 2";
  EXPECT_TRUE(BitIdentical(results[0], results[2])) << "1 thread vs 3";
}

}  // namespace testutil
}  // namespace megatrain::ref
