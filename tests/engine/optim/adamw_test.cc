#include "engine/optim/adamw.h"

#include <omp.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "engine/backend/cpu_backend.h"
#include "engine/common/dtype.h"
#include "engine/optim/clip.h"
#include "engine/optim/schedule.h"
#include "gtest/gtest.h"
#include "tests/engine/optim/backend_adamw_check.h"
#include "tests/engine/optim/normal_values.h"

namespace megatrain {
namespace {

struct State {
  std::vector<float> p, m, v;
  std::vector<uint16_t> bf16;
};

State MakeState(int64_t n, uint32_t seed) {
  State s;
  s.p = Normal(n, seed);
  s.m.assign(n, 0.0f);
  s.v.assign(n, 0.0f);
  s.bf16.assign(n, 0);
  return s;
}

// The closed form in double, no rounding to fp32 anywhere.
struct DoubleAdamW {
  std::vector<double> p, m, v;
  void Step(const std::vector<float>& grad, int64_t step, double lr, double wd, double scale,
            const AdamWHyper& h) {
    for (size_t i = 0; i < p.size(); ++i) {
      const double g = grad[i] * scale;
      p[i] *= 1.0 - lr * wd;
      m[i] = h.beta1 * m[i] + (1.0 - h.beta1) * g;
      v[i] = h.beta2 * v[i] + (1.0 - h.beta2) * g * g;
      const double m_hat = m[i] / (1.0 - std::pow(h.beta1, step));
      const double denom = std::sqrt(v[i]) / std::sqrt(1.0 - std::pow(h.beta2, step)) + h.eps;
      p[i] -= lr * m_hat / denom;
    }
  }
};

// The same operations as the documented contract, in fp32, one element at a time.
void FloatReferenceStep(State* s, const std::vector<float>& grad, int64_t step, double lr,
                        double wd, float scale, const AdamWHyper& h) {
  const float decay = static_cast<float>(1.0 - lr * wd);
  const float w = static_cast<float>(1.0 - h.beta1);
  const float beta2 = static_cast<float>(h.beta2);
  const float omb2 = static_cast<float>(1.0 - h.beta2);
  const float bc2 = static_cast<float>(std::sqrt(1.0 - std::pow(h.beta2, step)));
  const float neg_ss = static_cast<float>(-(lr / (1.0 - std::pow(h.beta1, step))));
  const float eps = static_cast<float>(h.eps);
  for (size_t i = 0; i < s->p.size(); ++i) {
    const float g = grad[i] * scale;
    s->p[i] = s->p[i] * decay;
    s->m[i] = s->m[i] + w * (g - s->m[i]);
    s->v[i] = s->v[i] * beta2 + omb2 * g * g;
    const float denom = std::sqrt(s->v[i]) / bc2 + eps;
    s->p[i] = s->p[i] + neg_ss * s->m[i] / denom;
  }
}

void Update(State* s, const std::vector<float>& grad, int64_t step, double lr, double wd,
            float scale, const AdamWHyper& h) {
  AdamWUpdate(s->p.data(), s->m.data(), s->v.data(), s->bf16.data(), grad.data(),
              static_cast<int64_t>(s->p.size()), step, lr, wd, scale, h);
}

TEST(AdamWTest, SixStepsWithClippingWarmupAndDecayMatchDoubleReference) {
  constexpr int64_t kN = 4096;
  const AdamWHyper hyper;
  const double wd = 0.1;
  const double max_norm = 1.0;
  const ScheduleOptions sched{ScheduleType::kCosine, 1e-2, 3, 10, 0.0};
  State s = MakeState(kN, 1);
  DoubleAdamW ref{{s.p.begin(), s.p.end()}, std::vector<double>(kN), std::vector<double>(kN)};
  bool clipped = false;
  for (int64_t step = 1; step <= 6; ++step) {
    const std::vector<float> grad = Normal(kN, 100 + step, 0.05f);
    const float scale = ClipCoefficient(std::sqrt(SumOfSquares(grad.data(), kN)), max_norm);
    clipped |= scale < 1.0f;
    // Indices 0..5: three warmup steps (the first at lr 0, as Hugging Face), then decay.
    const double lr = LearningRate(sched, step - 1);
    Update(&s, grad, step, lr, wd, scale, hyper);
    ref.Step(grad, step, lr, wd, scale, hyper);
  }
  ASSERT_TRUE(clipped) << "the gradients should be large enough to be clipped";
  for (int64_t i = 0; i < kN; ++i) {
    ASSERT_NEAR(s.p[i], ref.p[i], 2e-6 * std::abs(ref.p[i]) + 1e-7) << "element " << i;
    ASSERT_NEAR(s.m[i], ref.m[i], 1e-5 * std::abs(ref.m[i]) + 1e-9) << "element " << i;
    ASSERT_NEAR(s.v[i], ref.v[i], 1e-5 * std::abs(ref.v[i]) + 1e-12) << "element " << i;
  }
}

TEST(AdamWTest, MatchesFloatReferenceBitwise) {
  constexpr int64_t kN = 40000;  // several chunks plus a ragged tail
  const AdamWHyper hyper{0.9, 0.95, 1e-8};
  State s = MakeState(kN, 2);
  State ref = s;
  for (int64_t step = 1; step <= 5; ++step) {
    const std::vector<float> grad = Normal(kN, 200 + step, 1.0f);
    Update(&s, grad, step, 3e-4 * step, 0.01, 0.5f, hyper);
    FloatReferenceStep(&ref, grad, step, 3e-4 * step, 0.01, 0.5f, hyper);
  }
  EXPECT_EQ(0, std::memcmp(s.p.data(), ref.p.data(), kN * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(s.m.data(), ref.m.data(), kN * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(s.v.data(), ref.v.data(), kN * sizeof(float)));
}

TEST(AdamWTest, Bf16OutputIsRoundedMaster) {
  constexpr int64_t kN = 50000;
  State s = MakeState(kN, 3);
  const std::vector<float> grad = Normal(kN, 3, 1.0f);
  Update(&s, grad, 1, 1e-3, 0.1, 1.0f, AdamWHyper());
  for (int64_t i = 0; i < kN; ++i) ASSERT_EQ(s.bf16[i], FloatToBf16(s.p[i])) << i;
}

TEST(AdamWTest, Bf16OutputRoundsTiesToEvenAndKeepsNanAndInf) {
  const uint32_t bits[] = {0x3f808000u, 0x3f818000u, 0x7fc00001u, 0xff800000u,
                           0x7f800000u, 0x80000000u, 0x7f7fffffu};
  constexpr int64_t kN = sizeof(bits) / sizeof(bits[0]);
  State s = MakeState(kN, 8);
  for (int64_t i = 0; i < kN; ++i) std::memcpy(&s.p[i], &bits[i], 4);
  const std::vector<float> zero(kN, 0.0f);
  Update(&s, zero, 1, 0.0, 0.0, 1.0f, AdamWHyper());  // lr 0: the weights stay as they are
  for (int64_t i = 0; i < kN; ++i) {
    uint32_t after;
    std::memcpy(&after, &s.p[i], 4);
    EXPECT_EQ(after, bits[i]) << i;
    EXPECT_EQ(s.bf16[i], FloatToBf16(s.p[i])) << i;
  }
  EXPECT_EQ(s.bf16[0], 0x3f80);  // tie rounds down to even
  EXPECT_EQ(s.bf16[1], 0x3f82);  // tie rounds up to even
  EXPECT_EQ(s.bf16[6], 0x7f80);  // the largest float rounds to inf, as PyTorch
}

TEST(AdamWTest, NullBf16OutputSkipsTheCopy) {
  State a = MakeState(1000, 4);
  State b = a;
  const std::vector<float> grad = Normal(1000, 4, 1.0f);
  Update(&a, grad, 1, 1e-3, 0.1, 1.0f, AdamWHyper());
  AdamWUpdate(b.p.data(), b.m.data(), b.v.data(), nullptr, grad.data(), 1000, 1, 1e-3, 0.1, 1.0f,
              AdamWHyper());
  EXPECT_EQ(a.p, b.p);
}

TEST(AdamWTest, ResultsAreBitIdenticalWithOneAndTwoThreads) {
  constexpr int64_t kN = 100003;
  State one = MakeState(kN, 5);
  State two = one;
  const int saved = omp_get_max_threads();
  for (int64_t step = 1; step <= 3; ++step) {
    const std::vector<float> grad = Normal(kN, 500 + step, 1.0f);
    omp_set_num_threads(1);
    Update(&one, grad, step, 1e-3, 0.1, 0.7f, AdamWHyper());
    omp_set_num_threads(2);
    Update(&two, grad, step, 1e-3, 0.1, 0.7f, AdamWHyper());
  }
  omp_set_num_threads(saved);
  EXPECT_EQ(0, std::memcmp(one.p.data(), two.p.data(), kN * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(one.m.data(), two.m.data(), kN * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(one.v.data(), two.v.data(), kN * sizeof(float)));
  EXPECT_EQ(one.bf16, two.bf16);
}

TEST(AdamWTest, ZeroGradStepOnlyDecaysTheWeights) {
  constexpr int64_t kN = 1000;
  State s = MakeState(kN, 6);
  const std::vector<float> before = s.p;
  const std::vector<float> zero(kN, 0.0f);
  const double lr = 1e-2;
  const double wd = 0.1;
  Update(&s, zero, 1, lr, wd, 1.0f, AdamWHyper());
  const float decay = static_cast<float>(1.0 - lr * wd);
  for (int64_t i = 0; i < kN; ++i) {
    ASSERT_EQ(s.p[i], before[i] * decay) << i;
    ASSERT_EQ(s.m[i], 0.0f);
    ASSERT_EQ(s.v[i], 0.0f);
  }
}

TEST(AdamWTest, FirstStepMovesEachWeightByAboutLr) {
  // With zero moments, step 1 is p -= lr * g / (|g| + eps'): a step of lr against the sign.
  State s = MakeState(3, 7);
  s.p = {1.0f, 1.0f, 1.0f};
  const std::vector<float> grad = {0.5f, -2.0f, 1e-3f};
  Update(&s, grad, 1, 1e-2, 0.0, 1.0f, AdamWHyper());
  EXPECT_NEAR(s.p[0], 0.99f, 1e-6);
  EXPECT_NEAR(s.p[1], 1.01f, 1e-6);
  EXPECT_NEAR(s.p[2], 0.99f, 1e-6);
}

// Many small ranges (an MoE layer's experts) in one call: the bits and the sum of squares
// of a call per range, with and without weight decay, from a gradient that starts partway.
TEST(AdamWTest, RangesInOnePassGiveTheBitsOfACallPerRange) {
  constexpr int64_t kN = 200000, kFrom = 1234;  // the gradient holds elements [kFrom, kN)
  std::vector<ElementRange> ranges;
  for (int64_t b = kFrom + 7, i = 0; b + 5000 < kN; b += 5000 + 40 * (i % 5), ++i) {
    ranges.push_back(ElementRange{b, b + 3000 + 300 * (i % 7) + (i == 3 ? 40000 : 0), i % 3 != 0});
    if (i == 3) b += 40000;  // one range of several chunks
  }
  ranges.push_back(ElementRange{kN - 10, kN - 10, true});  // empty
  State one = MakeState(kN, 9);
  State all = one;
  for (int64_t step = 1; step <= 2; ++step) {
    const std::vector<float> grad = Normal(kN - kFrom, 900 + step, 1.0f);
    double expected = 0;
    for (const ElementRange& r : ranges) {
      double ss = 0;
      AdamWUpdate(one.p.data() + r.begin, one.m.data() + r.begin, one.v.data() + r.begin,
                  one.bf16.data() + r.begin, grad.data() + (r.begin - kFrom), r.end - r.begin,
                  step, 1e-3, r.decay ? 0.1 : 0.0, 0.5f, AdamWHyper(), &ss);
      expected += ss;
    }
    double got = -1;
    AdamWUpdateRanges(all.p.data(), all.m.data(), all.v.data(), all.bf16.data(), grad.data(),
                      kFrom, ranges, step, 1e-3, 0.1, 0.5f, AdamWHyper(), &got);
    EXPECT_EQ(got, expected);
  }
  EXPECT_EQ(0, std::memcmp(one.p.data(), all.p.data(), kN * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(one.m.data(), all.m.data(), kN * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(one.v.data(), all.v.data(), kN * sizeof(float)));
  EXPECT_EQ(one.bf16, all.bf16);
}

TEST(AdamWTest, EmptyTensorIsANoOp) {
  AdamWUpdate(nullptr, nullptr, nullptr, nullptr, nullptr, 0, 1, 1e-3, 0.1, 1.0f, AdamWHyper());
}

// The CPU backend's AdamW (Backend::AdamW, common/adamw_math.h element by element) is the
// host optimizer's vectorised AdamWUpdate, bit for bit: the formula written twice stays one.
TEST(AdamWTest, TheCpuBackendsAdamWIsTheHostOptimizersBits) {
  std::unique_ptr<Backend> be = CreateCpuBackend(CpuBackendOptions{});
  testing::ExpectBackendAdamWIsTheHostOptimizers(be.get());
}

}  // namespace
}  // namespace megatrain
