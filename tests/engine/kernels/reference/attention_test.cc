#include "engine/kernels/reference/attention.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "tests/engine/kernels/reference/test_util.h"

namespace megatrain::ref {
namespace {

using testutil::Vec;
using testutil::VecF;

struct Problem {
  int64_t n, H, KV, D;
  std::vector<int32_t> doc_start;  // (n)
  Vec q, k, v;                     // (n,H,D), (n,KV,D), (n,KV,D)
};

// doc_start for documents of the given lengths, packed back to back.
std::vector<int32_t> PackedDocs(const std::vector<int64_t>& lengths) {
  std::vector<int32_t> doc_start;
  int32_t start = 0;
  for (int64_t len : lengths) {
    for (int64_t t = 0; t < len; ++t) doc_start.push_back(start);
    start += static_cast<int32_t>(len);
  }
  return doc_start;
}

Problem RandomProblem(const std::vector<int64_t>& doc_lengths, int64_t H, int64_t KV, int64_t D,
                      uint64_t seed) {
  std::mt19937_64 rng(seed);
  Problem p{0, H, KV, D, PackedDocs(doc_lengths), {}, {}, {}};
  p.n = static_cast<int64_t>(p.doc_start.size());
  p.q = testutil::RandomVec(rng, p.n * H * D, -1.5, 1.5);
  p.k = testutil::RandomVec(rng, p.n * KV * D, -1.5, 1.5);
  p.v = testutil::RandomVec(rng, p.n * KV * D);
  return p;
}

// Full masked softmax(scale q k^T) v, one (query, head) at a time, with an explicit mask.
Vec NaiveAttention(const Problem& p, Vec* lse = nullptr) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(p.D));
  Vec o(p.n * p.H * p.D, 0.0);
  for (int64_t i = 0; i < p.n; ++i) {
    for (int64_t h = 0; h < p.H; ++h) {
      const int64_t g = h / (p.H / p.KV);
      Vec score(p.n, -INFINITY);
      double max_score = -INFINITY;
      for (int64_t j = 0; j < p.n; ++j) {
        const bool visible = j <= i && p.doc_start[j] == p.doc_start[i];
        if (!visible) continue;
        double dot = 0.0;
        for (int64_t d = 0; d < p.D; ++d) {
          dot += p.q[(i * p.H + h) * p.D + d] * p.k[(j * p.KV + g) * p.D + d];
        }
        score[j] = scale * dot;
        max_score = std::max(max_score, score[j]);
      }
      double sum = 0.0;
      for (int64_t j = 0; j < p.n; ++j) sum += std::exp(score[j] - max_score);
      for (int64_t j = 0; j < p.n; ++j) {
        const double prob = std::exp(score[j] - max_score) / sum;
        for (int64_t d = 0; d < p.D; ++d) {
          o[(i * p.H + h) * p.D + d] += prob * p.v[(j * p.KV + g) * p.D + d];
        }
      }
      if (lse != nullptr) (*lse)[i * p.H + h] = max_score + std::log(sum);
    }
  }
  return o;
}

template <typename T>
struct Outputs {
  std::vector<T> o, lse, dq, dk, dv;
};

// Forward and backward of the kernel on p cast to T, upstream gradient g (n,H,D).
template <typename T>
Outputs<T> RunKernel(const Problem& p, const Vec& g) {
  const auto cast = [](const Vec& x) { return std::vector<T>(x.begin(), x.end()); };
  const auto q = cast(p.q), k = cast(p.k), v = cast(p.v), dout = cast(g);
  Outputs<T> r{std::vector<T>(p.n * p.H * p.D), std::vector<T>(p.n * p.H),
               std::vector<T>(p.n * p.H * p.D), std::vector<T>(p.n * p.KV * p.D),
               std::vector<T>(p.n * p.KV * p.D)};
  Attention(r.o.data(), r.lse.data(), q.data(), k.data(), v.data(), p.doc_start.data(), p.n, p.H,
            p.KV, p.D);
  AttentionBackward(r.dq.data(), r.dk.data(), r.dv.data(), dout.data(), q.data(), k.data(),
                    v.data(), r.o.data(), r.lse.data(), p.doc_start.data(), p.n, p.H, p.KV, p.D);
  return r;
}

void ExpectForwardMatchesNaive(const Problem& p) {
  Vec lse(p.n * p.H);
  const Vec o = NaiveAttention(p, &lse);
  const auto r = RunKernel<double>(p, Vec(p.n * p.H * p.D, 0.0));
  testutil::ExpectAllNear(r.o, o, 1e-13, 1e-14, "o");
  testutil::ExpectAllNear(r.lse, lse, 1e-13, 1e-14, "lse");
}

void ExpectBackwardMatchesFiniteDifferences(Problem p, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const Vec g = testutil::RandomVec(rng, p.n * p.H * p.D);
  const auto r = RunKernel<double>(p, g);
  auto loss = [&] { return testutil::WeightedSum(NaiveAttention(p), g); };
  testutil::ExpectGradientMatches(&p.q, r.dq, loss, "dq");
  testutil::ExpectGradientMatches(&p.k, r.dk, loss, "dk");
  testutil::ExpectGradientMatches(&p.v, r.dv, loss, "dv");
}

TEST(AttentionTest, ForwardMatchesNaiveGqaFourHeadsTwoKvHeadsThreeDocuments) {
  ExpectForwardMatchesNaive(RandomProblem({4, 3, 5}, 4, 2, 8, 40));
}

TEST(AttentionTest, ForwardMatchesNaiveEqualHeadsThreeDocuments) {
  ExpectForwardMatchesNaive(RandomProblem({4, 3, 5}, 2, 2, 8, 41));
}

TEST(AttentionTest, ForwardMatchesNaiveMultiQuerySingleDocument) {
  ExpectForwardMatchesNaive(RandomProblem({9}, 4, 1, 8, 42));
}

TEST(AttentionTest, SingleTokenDocumentReturnsItsOwnValue) {
  const Problem p = RandomProblem({3, 1, 2}, 2, 1, 4, 43);
  const auto r = RunKernel<double>(p, Vec(p.n * p.H * p.D, 0.0));
  for (int64_t h = 0; h < p.H; ++h) {
    for (int64_t d = 0; d < p.D; ++d) {
      EXPECT_NEAR(r.o[(3 * p.H + h) * p.D + d], p.v[3 * p.D + d], 1e-15);
    }
  }
}

TEST(AttentionTest, BackwardMatchesFiniteDifferencesGqaFourHeadsTwoKvHeadsThreeDocuments) {
  ExpectBackwardMatchesFiniteDifferences(RandomProblem({4, 3, 5}, 4, 2, 8, 44), 45);
}

TEST(AttentionTest, BackwardMatchesFiniteDifferencesEqualHeadsThreeDocuments) {
  ExpectBackwardMatchesFiniteDifferences(RandomProblem({4, 3, 5}, 2, 2, 8, 46), 47);
}

// Changing q, k and v of a token in the middle document leaves every output of the first
// and last documents bit-identical; an upstream gradient confined to the outer documents
// gives exactly zero gradient to the middle one.
TEST(AttentionTest, PackedDocumentsDoNotLeakIntoEachOther) {
  Problem p = RandomProblem({4, 3, 5}, 4, 2, 8, 48);
  const auto before = RunKernel<double>(p, Vec(p.n * p.H * p.D, 0.0));
  const int64_t changed = 5;  // second token of the middle document [4, 7)
  for (int64_t e = 0; e < p.H * p.D; ++e) p.q[changed * p.H * p.D + e] += 0.7;
  for (int64_t e = 0; e < p.KV * p.D; ++e) {
    p.k[changed * p.KV * p.D + e] -= 0.9;
    p.v[changed * p.KV * p.D + e] += 1.3;
  }
  std::mt19937_64 rng(49);
  Vec g = testutil::RandomVec(rng, p.n * p.H * p.D);
  for (int64_t e = 4 * p.H * p.D; e < 7 * p.H * p.D; ++e) g[e] = 0.0;
  const auto after = RunKernel<double>(p, g);

  const int64_t row = p.H * p.D;
  for (int64_t i : {0, 1, 2, 3, 7, 8, 9, 10, 11}) {
    for (int64_t e = 0; e < row; ++e) {
      ASSERT_EQ(before.o[i * row + e], after.o[i * row + e]) << "token " << i;
    }
  }
  EXPECT_NE(before.o[6 * row], after.o[6 * row]);  // later token of the same document moves
  for (int64_t i = 4; i < 7; ++i) {
    for (int64_t e = 0; e < row; ++e) EXPECT_EQ(after.dq[i * row + e], 0.0) << i;
    for (int64_t e = 0; e < p.KV * p.D; ++e) {
      EXPECT_EQ(after.dk[i * p.KV * p.D + e], 0.0) << i;
      EXPECT_EQ(after.dv[i * p.KV * p.D + e], 0.0) << i;
    }
  }
}

TEST(AttentionTest, FloatMatchesDouble) {
  const Problem p = RandomProblem({20, 7, 13}, 4, 2, 32, 50);
  std::mt19937_64 rng(51);
  const Vec g = testutil::RandomVec(rng, p.n * p.H * p.D);
  const auto want = RunKernel<double>(p, g);
  const auto got = RunKernel<float>(p, g);
  testutil::ExpectAllNear(got.o, want.o, 1e-5, 1e-5, "o");
  testutil::ExpectAllNear(got.lse, want.lse, 1e-6, 1e-6, "lse");
  testutil::ExpectAllNear(got.dq, want.dq, 1e-4, 1e-5, "dq");
  testutil::ExpectAllNear(got.dk, want.dk, 1e-4, 1e-5, "dk");
  testutil::ExpectAllNear(got.dv, want.dv, 1e-4, 1e-5, "dv");
}

TEST(AttentionTest, ForwardAndBackwardAreBitIdenticalAcrossThreadCounts) {
  const Problem p = RandomProblem({30, 1, 25, 14}, 4, 2, 16, 52);
  std::mt19937_64 rng(53);
  const Vec g = testutil::RandomVec(rng, p.n * p.H * p.D);
  std::vector<VecF> results;
  for (int threads : {1, 2, 3}) {
    Outputs<float> r;
    testutil::WithThreads(threads, [&] { r = RunKernel<float>(p, g); });
    results.push_back(testutil::Concat({r.o, r.lse, r.dq, r.dk, r.dv}));
  }
  EXPECT_TRUE(testutil::BitIdentical(results[0], results[1]));
  EXPECT_TRUE(testutil::BitIdentical(results[0], results[2]));
}

}  // namespace
}  // namespace megatrain::ref
