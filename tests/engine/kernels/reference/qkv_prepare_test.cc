#include "engine/kernels/reference/qkv_prepare.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "engine/kernels/reference/rope.h"
#include "tests/engine/kernels/reference/test_util.h"

namespace megatrain::ref {
namespace {

constexpr double kEps = 1e-6;

struct Shape {
  int64_t n, H, KV, D;
  int64_t Width() const { return (H + 2 * KV) * D; }
};

struct Heads {
  Vec q, k, v;         // (n,H,D), (n,KV,D), (n,KV,D)
  Vec rstd_q, rstd_k;  // (n*H), (n*KV)
};

// One head, step by step: optional RMSNorm with weights w (D), then rotate_half RoPE.
Vec NaiveHead(const double* x, const Vec* w, int32_t pos, const std::vector<float>& inv_freq,
              int64_t D, double* rstd) {
  Vec xn(x, x + D);
  if (w != nullptr) {
    double mean_sq = 0.0;
    for (int64_t d = 0; d < D; ++d) mean_sq += x[d] * x[d] / D;
    *rstd = 1.0 / std::sqrt(mean_sq + kEps);
    for (int64_t d = 0; d < D; ++d) xn[d] = x[d] * *rstd * (*w)[d];
  }
  Vec y(D);
  const int64_t half = D / 2;
  for (int64_t j = 0; j < half; ++j) {
    const float angle = static_cast<float>(pos) * inv_freq[j];
    const double c = std::cos(static_cast<double>(angle));
    const double s = std::sin(static_cast<double>(angle));
    y[j] = xn[j] * c - xn[j + half] * s;
    y[j + half] = xn[j + half] * c + xn[j] * s;
  }
  return y;
}

Heads NaiveQkvPrepare(const Vec& qkv, const Vec* q_norm_w, const Vec* k_norm_w,
                      const std::vector<int32_t>& pos, const std::vector<float>& inv_freq,
                      const Shape& s) {
  Heads out{Vec(s.n * s.H * s.D), Vec(s.n * s.KV * s.D), Vec(s.n * s.KV * s.D), Vec(s.n * s.H),
            Vec(s.n * s.KV)};
  for (int64_t i = 0; i < s.n; ++i) {
    const double* row = qkv.data() + i * s.Width();
    for (int64_t h = 0; h < s.H; ++h) {
      const Vec y =
          NaiveHead(row + h * s.D, q_norm_w, pos[i], inv_freq, s.D, &out.rstd_q[i * s.H + h]);
      std::copy(y.begin(), y.end(), out.q.begin() + (i * s.H + h) * s.D);
    }
    for (int64_t g = 0; g < s.KV; ++g) {
      const Vec y = NaiveHead(row + (s.H + g) * s.D, k_norm_w, pos[i], inv_freq, s.D,
                              &out.rstd_k[i * s.KV + g]);
      std::copy(y.begin(), y.end(), out.k.begin() + (i * s.KV + g) * s.D);
    }
    for (int64_t e = 0; e < s.KV * s.D; ++e) {
      out.v[i * s.KV * s.D + e] = row[(s.H + s.KV) * s.D + e];
    }
  }
  return out;
}

std::vector<float> InvFreq(int64_t D) {
  std::vector<float> inv_freq(D / 2);
  RopeInvFreq(inv_freq.data(), D, 10000.0, false, 1.0, 1.0, 4.0, 8192);
  return inv_freq;
}

std::vector<int32_t> Positions(int64_t n) {
  std::vector<int32_t> pos(n);
  for (int64_t i = 0; i < n; ++i) pos[i] = static_cast<int32_t>(i % 3 == 2 ? 3000 + 17 * i : i);
  return pos;
}

void ExpectForwardMatchesNaive(const Shape& s, bool qk_norm, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const Vec qkv = testutil::RandomVec(rng, s.n * s.Width(), -2.0, 2.0);
  const Vec qw = testutil::RandomVec(rng, s.D, 0.5, 1.5),
            kw = testutil::RandomVec(rng, s.D, 0.5, 1.5);
  const auto pos = Positions(s.n);
  const auto inv_freq = InvFreq(s.D);
  Heads got{Vec(s.n * s.H * s.D), Vec(s.n * s.KV * s.D), Vec(s.n * s.KV * s.D), Vec(s.n * s.H),
            Vec(s.n * s.KV)};
  QkvPrepare(got.q.data(), got.k.data(), got.v.data(), got.rstd_q.data(), got.rstd_k.data(),
             qkv.data(), qk_norm ? qw.data() : nullptr, qk_norm ? kw.data() : nullptr, pos.data(),
             inv_freq.data(), 1.0f, s.n, s.H, s.KV, s.D, kEps);
  const Heads want =
      NaiveQkvPrepare(qkv, qk_norm ? &qw : nullptr, qk_norm ? &kw : nullptr, pos, inv_freq, s);
  testutil::ExpectAllNear(got.q, want.q, 1e-13, 1e-14, "q");
  testutil::ExpectAllNear(got.k, want.k, 1e-13, 1e-14, "k");
  EXPECT_EQ(got.v, want.v);
  if (qk_norm) {
    testutil::ExpectAllNear(got.rstd_q, want.rstd_q, 1e-14, 0, "rstd_q");
    testutil::ExpectAllNear(got.rstd_k, want.rstd_k, 1e-14, 0, "rstd_k");
  }
}

TEST(QkvPrepareTest, PositionZeroWithoutQkNormIsAPlainSplit) {
  const Shape s{1, 2, 1, 4};
  std::mt19937_64 rng(33);
  const Vec qkv = testutil::RandomVec(rng, s.Width());
  const auto inv_freq = InvFreq(s.D);
  const int32_t pos = 0;
  Vec q(s.H * s.D), k(s.KV * s.D), v(s.KV * s.D);
  QkvPrepare<double>(q.data(), k.data(), v.data(), nullptr, nullptr, qkv.data(), nullptr, nullptr,
                     &pos, inv_freq.data(), 1.0f, 1, s.H, s.KV, s.D, kEps);
  EXPECT_EQ(Vec(qkv.begin(), qkv.begin() + 8), q);
  EXPECT_EQ(Vec(qkv.begin() + 8, qkv.begin() + 12), k);
  EXPECT_EQ(Vec(qkv.begin() + 12, qkv.end()), v);
}

// YaRN's attention factor scales cos and sin: without QK-norm the rotated heads, and the
// gradient through them, scale by it; v is a copy either way.
TEST(QkvPrepareTest, RopeScaleScalesRotatedHeadsAndTheirGradient) {
  const Shape s{6, 4, 2, 8};
  std::mt19937_64 rng(34);
  const Vec qkv = testutil::RandomVec(rng, s.n * s.Width(), -2.0, 2.0);
  const Vec dq = testutil::RandomVec(rng, s.n * s.H * s.D);
  const Vec dk = testutil::RandomVec(rng, s.n * s.KV * s.D);
  const Vec dv = testutil::RandomVec(rng, s.n * s.KV * s.D);
  const auto pos = Positions(s.n);
  const auto inv_freq = InvFreq(s.D);
  const float scale = 1.3465735902799727f;  // 0.1 ln(32) + 1, GPT-OSS's
  auto run = [&](float rope_scale, Vec* q, Vec* k, Vec* v, Vec* dqkv) {
    q->assign(s.n * s.H * s.D, 0);
    k->assign(s.n * s.KV * s.D, 0);
    v->assign(s.n * s.KV * s.D, 0);
    dqkv->assign(s.n * s.Width(), 0);
    QkvPrepare<double>(q->data(), k->data(), v->data(), nullptr, nullptr, qkv.data(), nullptr,
                       nullptr, pos.data(), inv_freq.data(), rope_scale, s.n, s.H, s.KV, s.D,
                       kEps);
    QkvPrepareBackward<double>(dqkv->data(), nullptr, nullptr, dq.data(), dk.data(), dv.data(),
                       qkv.data(), nullptr, nullptr, nullptr, nullptr, pos.data(),
                       inv_freq.data(), rope_scale, s.n, s.H, s.KV, s.D, kEps);
  };
  Vec q1, k1, v1, d1, qs, ks, vs, ds;
  run(1.0f, &q1, &k1, &v1, &d1);
  run(scale, &qs, &ks, &vs, &ds);
  auto scaled = [&](Vec x) {
    for (double& e : x) e *= scale;
    return x;
  };
  testutil::ExpectAllNear(qs, scaled(q1), 1e-13, 1e-14, "q");
  testutil::ExpectAllNear(ks, scaled(k1), 1e-13, 1e-14, "k");
  EXPECT_EQ(vs, v1);
  for (int64_t i = 0; i < s.n; ++i) {  // the q and k columns scale, v's pass through
    for (int64_t c = 0; c < s.Width(); ++c) {
      const double want = d1[i * s.Width() + c] * (c < (s.H + s.KV) * s.D ? scale : 1.0);
      EXPECT_NEAR(ds[i * s.Width() + c], want, 1e-12) << "row " << i << " column " << c;
    }
  }
}

void ExpectBackwardMatchesFiniteDifferences(const Shape& s, bool qk_norm, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Vec qkv = testutil::RandomVec(rng, s.n * s.Width(), -2.0, 2.0);
  Vec qw = testutil::RandomVec(rng, s.D, 0.5, 1.5), kw = testutil::RandomVec(rng, s.D, 0.5, 1.5);
  const Vec gq = testutil::RandomVec(rng, s.n * s.H * s.D);
  const Vec gk = testutil::RandomVec(rng, s.n * s.KV * s.D);
  const Vec gv = testutil::RandomVec(rng, s.n * s.KV * s.D);
  const auto pos = Positions(s.n);
  const auto inv_freq = InvFreq(s.D);
  const double* qw_ptr = qk_norm ? qw.data() : nullptr;
  const double* kw_ptr = qk_norm ? kw.data() : nullptr;

  Vec q(s.n * s.H * s.D), k(s.n * s.KV * s.D), v(s.n * s.KV * s.D);
  Vec rstd_q(s.n * s.H), rstd_k(s.n * s.KV);
  QkvPrepare(q.data(), k.data(), v.data(), rstd_q.data(), rstd_k.data(), qkv.data(), qw_ptr, kw_ptr,
             pos.data(), inv_freq.data(), 1.0f, s.n, s.H, s.KV, s.D, kEps);
  Vec dqkv(s.n * s.Width(), 7.0), dqw(s.D, 0.0), dkw(s.D, 0.0);
  QkvPrepareBackward(dqkv.data(), qk_norm ? dqw.data() : nullptr, qk_norm ? dkw.data() : nullptr,
                     gq.data(), gk.data(), gv.data(), qkv.data(), qw_ptr, kw_ptr, rstd_q.data(),
                     rstd_k.data(), pos.data(), inv_freq.data(), 1.0f, s.n, s.H, s.KV, s.D, kEps);

  auto loss = [&] {
    const Heads out =
        NaiveQkvPrepare(qkv, qk_norm ? &qw : nullptr, qk_norm ? &kw : nullptr, pos, inv_freq, s);
    return testutil::WeightedSum(out.q, gq) + testutil::WeightedSum(out.k, gk) +
           testutil::WeightedSum(out.v, gv);
  };
  testutil::ExpectGradientMatches(&qkv, dqkv, loss, "dqkv");
  if (qk_norm) {
    testutil::ExpectGradientMatches(&qw, dqw, loss, "dq_norm_w");
    testutil::ExpectGradientMatches(&kw, dkw, loss, "dk_norm_w");
  }
}

// Each case's forward against the naive one and backward against finite differences.
struct Case {
  const char* name;
  Shape shape;
  bool qk_norm;
  uint64_t forward_seed, backward_seed;
};

class QkvPrepareCaseTest : public ::testing::TestWithParam<Case> {};

TEST_P(QkvPrepareCaseTest, ForwardMatchesNaive) {
  ExpectForwardMatchesNaive(GetParam().shape, GetParam().qk_norm, GetParam().forward_seed);
}

TEST_P(QkvPrepareCaseTest, BackwardMatchesFiniteDifferences) {
  ExpectBackwardMatchesFiniteDifferences(GetParam().shape, GetParam().qk_norm,
                                         GetParam().backward_seed);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, QkvPrepareCaseTest,
    ::testing::Values(Case{"GqaWithQkNorm", {5, 4, 2, 8}, true, 30, 34},
                      Case{"GqaWithoutQkNorm", {5, 4, 2, 8}, false, 31, 35},
                      Case{"EqualHeadsWithQkNorm", {4, 2, 2, 6}, true, 32, 36}),
    [](const ::testing::TestParamInfo<Case>& info) { return std::string(info.param.name); });

TEST(QkvPrepareTest, BackwardAccumulatesIntoNormWeightGradients) {
  const Shape s{3, 2, 1, 4};
  std::mt19937_64 rng(37);
  const Vec qkv = testutil::RandomVec(rng, s.n * s.Width());
  const Vec qw = testutil::RandomVec(rng, s.D), kw = testutil::RandomVec(rng, s.D);
  const Vec gq = testutil::RandomVec(rng, s.n * s.H * s.D);
  const Vec gk = testutil::RandomVec(rng, s.n * s.KV * s.D);
  const Vec gv = testutil::RandomVec(rng, s.n * s.KV * s.D);
  const auto pos = Positions(s.n);
  const auto inv_freq = InvFreq(s.D);
  Vec q(s.n * s.H * s.D), k(s.n * s.KV * s.D), v(s.n * s.KV * s.D);
  Vec rstd_q(s.n * s.H), rstd_k(s.n * s.KV);
  QkvPrepare(q.data(), k.data(), v.data(), rstd_q.data(), rstd_k.data(), qkv.data(), qw.data(),
             kw.data(), pos.data(), inv_freq.data(), 1.0f, s.n, s.H, s.KV, s.D, kEps);
  auto backward = [&](Vec* dqw, Vec* dkw) {
    Vec dqkv(s.n * s.Width());
    QkvPrepareBackward(dqkv.data(), dqw->data(), dkw->data(), gq.data(), gk.data(), gv.data(),
                       qkv.data(), qw.data(), kw.data(), rstd_q.data(), rstd_k.data(), pos.data(),
                       inv_freq.data(), 1.0f, s.n, s.H, s.KV, s.D, kEps);
  };
  Vec dqw0(s.D, 0.0), dkw0(s.D, 0.0);
  backward(&dqw0, &dkw0);
  const Vec dqw_init = testutil::RandomVec(rng, s.D), dkw_init = testutil::RandomVec(rng, s.D);
  Vec dqw = dqw_init, dkw = dkw_init;
  backward(&dqw, &dkw);
  for (int64_t d = 0; d < s.D; ++d) {
    EXPECT_NEAR(dqw[d], dqw0[d] + dqw_init[d], 1e-14) << d;
    EXPECT_NEAR(dkw[d], dkw0[d] + dkw_init[d], 1e-14) << d;
  }
}

TEST(QkvPrepareTest, FloatMatchesDoubleWithQkNorm) {
  const Shape s{9, 4, 2, 32};
  std::mt19937_64 rng(38);
  const Vec qkv = testutil::RandomVec(rng, s.n * s.Width(), -2.0, 2.0);
  const Vec qw = testutil::RandomVec(rng, s.D, 0.5, 1.5),
            kw = testutil::RandomVec(rng, s.D, 0.5, 1.5);
  const Vec gq = testutil::RandomVec(rng, s.n * s.H * s.D);
  const Vec gk = testutil::RandomVec(rng, s.n * s.KV * s.D);
  const Vec gv = testutil::RandomVec(rng, s.n * s.KV * s.D);
  const auto pos = Positions(s.n);
  const auto inv_freq = InvFreq(s.D);

  auto run = [&](auto zero) {
    using T = decltype(zero);
    const auto cast = [](const Vec& x) { return std::vector<T>(x.begin(), x.end()); };
    const auto qkv_t = cast(qkv), qw_t = cast(qw), kw_t = cast(kw);
    const auto gq_t = cast(gq), gk_t = cast(gk), gv_t = cast(gv);
    std::vector<T> q(s.n * s.H * s.D), k(s.n * s.KV * s.D), v(s.n * s.KV * s.D);
    std::vector<T> rstd_q(s.n * s.H), rstd_k(s.n * s.KV);
    std::vector<T> dqkv(s.n * s.Width()), dqw(s.D, T(0)), dkw(s.D, T(0));
    QkvPrepare(q.data(), k.data(), v.data(), rstd_q.data(), rstd_k.data(), qkv_t.data(),
               qw_t.data(), kw_t.data(), pos.data(), inv_freq.data(), 1.0f, s.n, s.H, s.KV, s.D, kEps);
    QkvPrepareBackward(dqkv.data(), dqw.data(), dkw.data(), gq_t.data(), gk_t.data(), gv_t.data(),
                       qkv_t.data(), qw_t.data(), kw_t.data(), rstd_q.data(), rstd_k.data(),
                       pos.data(), inv_freq.data(), 1.0f, s.n, s.H, s.KV, s.D, kEps);
    return std::vector<std::vector<T>>{q, k, v, rstd_q, rstd_k, dqkv, dqw, dkw};
  };
  const auto want = run(0.0);
  const auto got = run(0.0f);
  const char* names[] = {"q", "k", "v", "rstd_q", "rstd_k", "dqkv", "dq_norm_w", "dk_norm_w"};
  for (size_t t = 0; t < want.size(); ++t) {
    testutil::ExpectAllNear(got[t], want[t], 1e-5, 1e-5, names[t]);
  }
}

TEST(QkvPrepareTest, ForwardAndBackwardAreBitIdenticalAcrossThreadCounts) {
  const Shape s{150, 4, 2, 16};  // more tokens than norm-gradient partials
  std::mt19937_64 rng(39);
  const VecF qkv = testutil::ToFloat(testutil::RandomVec(rng, s.n * s.Width()));
  const VecF qw = testutil::ToFloat(testutil::RandomVec(rng, s.D));
  const VecF kw = testutil::ToFloat(testutil::RandomVec(rng, s.D));
  const VecF gq = testutil::ToFloat(testutil::RandomVec(rng, s.n * s.H * s.D));
  const VecF gk = testutil::ToFloat(testutil::RandomVec(rng, s.n * s.KV * s.D));
  const VecF gv = testutil::ToFloat(testutil::RandomVec(rng, s.n * s.KV * s.D));
  const auto pos = Positions(s.n);
  const auto inv_freq = InvFreq(s.D);
  testutil::ExpectBitIdenticalAcrossThreadCounts([&] {
    VecF q(s.n * s.H * s.D), k(s.n * s.KV * s.D), v(s.n * s.KV * s.D);
    VecF rstd_q(s.n * s.H), rstd_k(s.n * s.KV);
    VecF dqkv(s.n * s.Width()), dqw(s.D, 0.5f), dkw(s.D, 0.5f);
    QkvPrepare(q.data(), k.data(), v.data(), rstd_q.data(), rstd_k.data(), qkv.data(), qw.data(),
               kw.data(), pos.data(), inv_freq.data(), 1.0f, s.n, s.H, s.KV, s.D, kEps);
    QkvPrepareBackward(dqkv.data(), dqw.data(), dkw.data(), gq.data(), gk.data(), gv.data(),
                       qkv.data(), qw.data(), kw.data(), rstd_q.data(), rstd_k.data(), pos.data(),
                       inv_freq.data(), 1.0f, s.n, s.H, s.KV, s.D, kEps);
    return testutil::Concat({q, k, v, rstd_q, rstd_k, dqkv, dqw, dkw});
  });
}

}  // namespace
}  // namespace megatrain::ref
