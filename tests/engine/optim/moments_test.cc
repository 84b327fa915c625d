// AdamW over bf16 and int8 moments (AdamWUpdateQuantized): the same master update as the
// fp32 path where the moments agree, unbiased rounding, the same bits for any thread count,
// padding left alone, and an optimiser that still converges.
#include <omp.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "engine/common/dtype.h"
#include "engine/optim/adamw.h"
#include "gtest/gtest.h"
#include "tests/engine/optim/normal_values.h"

namespace megatrain {
namespace {

// One unit's moments in a given dtype, in plain vectors.
struct Moments {
  MomentDType dtype;
  std::vector<char> m, v;
  std::vector<float> m_scales, v_scales;
  Moments(MomentDType t, int64_t n) : dtype(t) {
    const int64_t size = t == MomentDType::kBF16 ? 2 : 1;
    m.assign(n * size, 0);
    v.assign(n * size, 0);
    const int64_t blocks = (n + kMomentBlock - 1) / kMomentBlock;
    m_scales.assign(blocks, 0.0f);
    v_scales.assign(blocks, 0.0f);
  }
  UnitMoments View() {
    UnitMoments u{dtype, m.data(), v.data(), nullptr, nullptr};
    if (dtype == MomentDType::kInt8) {
      u.m_scales = m_scales.data();
      u.v_scales = v_scales.data();
    }
    return u;
  }
};

const AdamWHyper kHyper{};
const std::vector<ElementRange> Whole(int64_t n) { return {ElementRange{0, n, true}}; }

class QuantizedMoments : public ::testing::TestWithParam<MomentDType> {};

// From zero moments the first step's m and v are exact in fp32 before they are stored, so
// the master and its bf16 copy are the fp32 path's bit for bit; the stored moments decode
// to within the dtype's rounding of the fp32 ones.
TEST_P(QuantizedMoments, FirstStepUpdatesTheMasterExactlyAsFp32) {
  const int64_t n = 5 * kMomentBlock + 77;  // a partial last block
  const std::vector<float> grad = Normal(n, 1, 0.01f), p0 = Normal(n, 2, 1.0f);
  std::vector<float> p_ref = p0, m_ref(n, 0.0f), v_ref(n, 0.0f), p = p0;
  std::vector<uint16_t> w_ref(n), w(n);
  AdamWUpdate(p_ref.data(), m_ref.data(), v_ref.data(), w_ref.data(), grad.data(), n, 1, 1e-3,
              0.1, 1.0f, kHyper);
  Moments mo(GetParam(), n);
  AdamWUpdateQuantized(p.data(), mo.View(), w.data(), grad.data(), 0, n, n, Whole(n), 1, 1e-3,
                       0.1, 1.0f, kHyper, MomentRoundingKey(3, 1));
  EXPECT_EQ(p, p_ref);
  EXPECT_EQ(w, w_ref);
  std::vector<float> m(n), v(n);
  DecodeMoments(mo.View(), 0, n, m.data(), v.data());
  const bool bf16 = GetParam() == MomentDType::kBF16;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t b = i / kMomentBlock;
    // bf16: one ulp (2^-7 relative). int8: one code step at the block's top (2/127 and 4/255
    // of the block's largest value), finer below.
    const float m_tol = bf16 ? std::fabs(m_ref[i]) / 128 : 2.0f / 127 * mo.m_scales[b];
    const float v_tol = bf16 ? v_ref[i] / 128 : 4.0f / 255 * mo.v_scales[b];
    ASSERT_LE(std::fabs(m[i] - m_ref[i]), m_tol * 1.0001f) << i;
    ASSERT_LE(std::fabs(v[i] - v_ref[i]), v_tol * 1.0001f) << i;
    ASSERT_TRUE(v_ref[i] == 0.0f || v[i] > 0.0f) << "a nonzero v stored as 0 at " << i;
  }
}

// Stochastic rounding is unbiased: the same moments at every block (one pattern repeated),
// each element rounded with its own random bits, average to the fp32 values.
TEST_P(QuantizedMoments, RoundingIsUnbiased) {
  const int64_t blocks = 400, n = blocks * kMomentBlock;
  std::vector<float> pattern = Normal(kMomentBlock, 5, 0.01f), grad(n), p(n, 0.0f);
  for (int64_t i = 0; i < n; ++i) grad[i] = pattern[i % kMomentBlock];
  std::vector<float> p_ref(kMomentBlock, 0.0f), m_ref(kMomentBlock, 0.0f), v_ref(kMomentBlock, 0.0f);
  AdamWUpdate(p_ref.data(), m_ref.data(), v_ref.data(), nullptr, pattern.data(), kMomentBlock, 1,
              1e-3, 0.0, 1.0f, kHyper);
  Moments mo(GetParam(), n);
  AdamWUpdateQuantized(p.data(), mo.View(), nullptr, grad.data(), 0, n, n, Whole(n), 1, 1e-3, 0.0,
                       1.0f, kHyper, MomentRoundingKey(0, 1));
  std::vector<float> m(n), v(n);
  DecodeMoments(mo.View(), 0, n, m.data(), v.data());
  // Per position: the error of the mean over the blocks against the error of one sample.
  // Unbiased rounding leaves ~1/sqrt(blocks) of it; rounding to nearest (or any fixed
  // rule) leaves all of it, the same error at every block.
  double m_mean_err = 0, v_mean_err = 0, m_one_err = 0, v_one_err = 0;
  for (int64_t j = 0; j < kMomentBlock; ++j) {
    double m_mean = 0, v_mean = 0;
    for (int64_t b = 0; b < blocks; ++b) {
      const double dm = m[b * kMomentBlock + j] - m_ref[j], dv = v[b * kMomentBlock + j] - v_ref[j];
      m_mean += dm / blocks;
      v_mean += dv / blocks;
      m_one_err += dm * dm / blocks;
      v_one_err += dv * dv / blocks;
    }
    m_mean_err += m_mean * m_mean;
    v_mean_err += v_mean * v_mean;
  }
  EXPECT_LT(std::sqrt(m_mean_err / m_one_err), 0.2);
  EXPECT_LT(std::sqrt(v_mean_err / v_one_err), 0.2);
}

// Several steps on a unit split into two pieces at a block boundary, with a padding gap
// between two tensors: the same bits on one thread and on all of them and on a second run;
// the gap's master and moments are untouched.
TEST_P(QuantizedMoments, SameBitsForAnyThreadCountAndPaddingLeftAlone) {
  const int64_t n = 12 * kMomentBlock + 100;
  const std::vector<std::pair<int64_t, int64_t>> pieces = {{0, 7 * kMomentBlock},
                                                           {7 * kMomentBlock, n}};
  const std::vector<ElementRange> tensors = {{0, 1000, true}, {1064, n, false}};
  auto run = [&](int threads) {
    const int saved = omp_get_max_threads();
    omp_set_num_threads(threads);
    std::vector<float> p = Normal(n, 9, 1.0f);
    std::vector<uint16_t> w(n, 0);
    Moments mo(GetParam(), n);
    for (int64_t step = 1; step <= 5; ++step) {
      const std::vector<float> g = Normal(n, 100 + step, 0.01f);
      for (const auto& [b, e] : pieces) {
        AdamWUpdateQuantized(p.data(), mo.View(), w.data(), g.data() + b, b, e, n, tensors, step,
                             1e-3, 0.1, 1.0f, kHyper, MomentRoundingKey(1, step));
      }
    }
    omp_set_num_threads(saved);
    return std::make_tuple(p, w, mo.m, mo.v, mo.m_scales, mo.v_scales);
  };
  const auto one = run(1), all = run(omp_get_max_threads()), again = run(omp_get_max_threads());
  EXPECT_TRUE(one == all);
  EXPECT_TRUE(all == again);
  const std::vector<float> p0 = Normal(n, 9, 1.0f);
  const std::vector<char>& m = std::get<2>(all);
  const int64_t size = GetParam() == MomentDType::kBF16 ? 2 : 1;
  for (int64_t i = 1000; i < 1064; ++i) {
    EXPECT_EQ(std::get<0>(all)[i], p0[i]) << "padding master moved at " << i;
    EXPECT_EQ(std::get<1>(all)[i], 0) << "padding bf16 written at " << i;
    for (int64_t b = 0; b < size; ++b) EXPECT_EQ(m[i * size + b], 0) << i;
  }
}

// A noisy quadratic, 0.5 * sum a_i x_i^2 over curvatures spanning four decades: 400 steps
// with each dtype end within 10% of fp32's loss, far below the start; and once the gradient
// stops, v decays (rounding to nearest would hold bf16's v where it was).
TEST_P(QuantizedMoments, ConvergesLikeFp32AndVDecays) {
  const int64_t n = 16 * kMomentBlock;
  std::vector<float> a(n);
  for (int64_t i = 0; i < n; ++i) a[i] = std::pow(10.0f, -2.0f + 4.0f * (i % 97) / 96.0f);
  auto loss = [&](const std::vector<float>& x) {
    double l = 0;
    for (int64_t i = 0; i < n; ++i) l += 0.5 * a[i] * x[i] * x[i];
    return l;
  };
  const std::vector<float> x0 = Normal(n, 21, 1.0f);
  std::vector<float> x_ref = x0, m_ref(n, 0.0f), v_ref(n, 0.0f), x = x0;
  Moments mo(GetParam(), n);
  std::mt19937 rng(7);
  std::normal_distribution<float> noise(0.0f, 0.05f);
  for (int64_t step = 1; step <= 400; ++step) {
    std::vector<float> g_ref(n), g(n);
    for (int64_t i = 0; i < n; ++i) {
      const float e = noise(rng);
      g_ref[i] = a[i] * x_ref[i] + e;
      g[i] = a[i] * x[i] + e;
    }
    AdamWUpdate(x_ref.data(), m_ref.data(), v_ref.data(), nullptr, g_ref.data(), n, step, 1e-2,
                0.0, 1.0f, kHyper);
    AdamWUpdateQuantized(x.data(), mo.View(), nullptr, g.data(), 0, n, n, Whole(n), step, 1e-2,
                         0.0, 1.0f, kHyper, MomentRoundingKey(0, step));
  }
  EXPECT_LT(loss(x_ref), 0.05 * loss(x0));
  EXPECT_NEAR(loss(x), loss(x_ref), 0.1 * loss(x_ref));
  // 2000 steps of zero gradient take v down by 0.999^2000 = 0.135: a stuck v stays at 1.
  std::vector<float> v_before(n), m_tmp(n), zero(n, 0.0f);
  DecodeMoments(mo.View(), 0, n, m_tmp.data(), v_before.data());
  for (int64_t step = 401; step <= 2400; ++step) {
    AdamWUpdateQuantized(x.data(), mo.View(), nullptr, zero.data(), 0, n, n, Whole(n), step, 0.0,
                         0.0, 1.0f, kHyper, MomentRoundingKey(0, step));
  }
  std::vector<float> v_after(n);
  DecodeMoments(mo.View(), 0, n, m_tmp.data(), v_after.data());
  double before = 0, after = 0;
  for (int64_t i = 0; i < n; ++i) {
    before += v_before[i];
    after += v_after[i];
  }
  EXPECT_NEAR(after / before, std::pow(0.999, 2000), 0.02);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, QuantizedMoments,
                         ::testing::Values(MomentDType::kBF16, MomentDType::kInt8),
                         [](const ::testing::TestParamInfo<MomentDType>& info) {
                           return std::string(MomentDTypeName(info.param));
                         });

TEST(MomentDTypes, NamesRoundTripAndSizes) {
  for (MomentDType t : {MomentDType::kF32, MomentDType::kBF16, MomentDType::kInt8}) {
    MomentDType back;
    ASSERT_TRUE(ParseMomentDType(MomentDTypeName(t), &back));
    EXPECT_EQ(back, t);
  }
  MomentDType unused;
  EXPECT_FALSE(ParseMomentDType("fp16", &unused));
  EXPECT_EQ(MomentBytesPerParameter(MomentDType::kF32), 8.0);
  EXPECT_EQ(MomentBytesPerParameter(MomentDType::kBF16), 4.0);
  EXPECT_NEAR(MomentBytesPerParameter(MomentDType::kInt8), 2.03125, 1e-12);
}

}  // namespace
}  // namespace megatrain
