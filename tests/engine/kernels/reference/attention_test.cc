#include "engine/kernels/reference/attention.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "tests/engine/kernels/reference/test_util.h"

namespace megatrain::ref {
namespace {

struct Problem {
  int64_t n, H, KV, D;
  std::vector<int32_t> doc_start;  // (n)
  Vec q, k, v;                     // (n,H,D), (n,KV,D), (n,KV,D)
  int64_t window = 0;              // 0: none
  Vec sinks;                       // (H), or empty for none
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

// Sinks drawn from [-1, 2]: about as large as the scaled scores, so they take a real share.
Problem RandomProblem(const std::vector<int64_t>& doc_lengths, int64_t H, int64_t KV, int64_t D,
                      uint64_t seed, int64_t window = 0, bool with_sinks = false) {
  std::mt19937_64 rng(seed);
  Problem p{0, H, KV, D, PackedDocs(doc_lengths), {}, {}, {}, window, {}};
  p.n = static_cast<int64_t>(p.doc_start.size());
  p.q = testutil::RandomVec(rng, p.n * H * D, -1.5, 1.5);
  p.k = testutil::RandomVec(rng, p.n * KV * D, -1.5, 1.5);
  p.v = testutil::RandomVec(rng, p.n * KV * D);
  if (with_sinks) p.sinks = testutil::RandomVec(rng, H, -1.0, 2.0);
  return p;
}

// Full masked softmax(scale q k^T) v, one (query, head) at a time: every key j gets a score,
// an explicit mask (same document, j <= i, i - j < window) sets the hidden ones to -inf, and
// the sink, when there is one, is an extra column with no value.
Vec NaiveAttention(const Problem& p, Vec* lse = nullptr) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(p.D));
  Vec o(p.n * p.H * p.D, 0.0);
  for (int64_t i = 0; i < p.n; ++i) {
    for (int64_t h = 0; h < p.H; ++h) {
      const int64_t g = h / (p.H / p.KV);
      Vec score(p.n + 1, -INFINITY);  // keys, then the sink column
      for (int64_t j = 0; j < p.n; ++j) {
        const bool visible =
            j <= i && p.doc_start[j] == p.doc_start[i] && (p.window == 0 || i - j < p.window);
        if (!visible) continue;
        double dot = 0.0;
        for (int64_t d = 0; d < p.D; ++d) {
          dot += p.q[(i * p.H + h) * p.D + d] * p.k[(j * p.KV + g) * p.D + d];
        }
        score[j] = scale * dot;
      }
      if (!p.sinks.empty()) score[p.n] = p.sinks[h];
      const double max_score = *std::max_element(score.begin(), score.end());
      double sum = 0.0;
      for (double s : score) sum += std::exp(s - max_score);
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
  std::vector<T> o, lse, dq, dk, dv, dsinks;  // dsinks empty without sinks

  std::vector<T> All() const { return testutil::Concat({o, lse, dq, dk, dv, dsinks}); }
};

// Forward and backward of the kernel on p cast to T, upstream gradient g (n,H,D); dsinks
// starts at dsinks0 (H) (zeros if empty), as the backward adds to it.
template <typename T>
Outputs<T> RunKernel(const Problem& p, const Vec& g, const Vec& dsinks0 = {}) {
  const auto cast = [](const Vec& x) { return std::vector<T>(x.begin(), x.end()); };
  const auto q = cast(p.q), k = cast(p.k), v = cast(p.v), dout = cast(g), sinks = cast(p.sinks);
  Outputs<T> r{std::vector<T>(p.n * p.H * p.D),  std::vector<T>(p.n * p.H),
               std::vector<T>(p.n * p.H * p.D),  std::vector<T>(p.n * p.KV * p.D),
               std::vector<T>(p.n * p.KV * p.D), {}};
  const T* sink_ptr = p.sinks.empty() ? nullptr : sinks.data();
  if (!p.sinks.empty()) r.dsinks = dsinks0.empty() ? std::vector<T>(p.H) : cast(dsinks0);
  Attention(r.o.data(), r.lse.data(), q.data(), k.data(), v.data(), p.doc_start.data(), sink_ptr,
            p.window, p.n, p.H, p.KV, p.D);
  AttentionBackward(r.dq.data(), r.dk.data(), r.dv.data(), sink_ptr ? r.dsinks.data() : nullptr,
                    dout.data(), q.data(), k.data(), v.data(), r.o.data(), r.lse.data(),
                    p.doc_start.data(), sink_ptr, p.window, p.n, p.H, p.KV, p.D);
  return r;
}

void ExpectForwardMatchesNaive(const Problem& p) {
  Vec lse(p.n * p.H);
  const Vec o = NaiveAttention(p, &lse);
  const auto r = RunKernel<double>(p, Vec(p.n * p.H * p.D, 0.0));
  testutil::ExpectAllNear(r.o, o, 1e-13, 1e-14, "o");
  testutil::ExpectAllNear(r.lse, lse, 1e-13, 1e-14, "lse");
}

// The float kernel against the double one, with upstream gradient from seed.
void ExpectFloatMatchesDouble(const Problem& p, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const Vec g = testutil::RandomVec(rng, p.n * p.H * p.D);
  const auto want = RunKernel<double>(p, g);
  const auto got = RunKernel<float>(p, g);
  testutil::ExpectAllNear(got.o, want.o, 1e-5, 1e-5, "o");
  testutil::ExpectAllNear(got.lse, want.lse, 1e-6, 1e-6, "lse");
  testutil::ExpectAllNear(got.dq, want.dq, 1e-4, 1e-5, "dq");
  testutil::ExpectAllNear(got.dk, want.dk, 1e-4, 1e-5, "dk");
  testutil::ExpectAllNear(got.dv, want.dv, 1e-4, 1e-5, "dv");
  if (!p.sinks.empty()) testutil::ExpectAllNear(got.dsinks, want.dsinks, 1e-5, 1e-6, "dsinks");
}

// Every output of the float kernel, with upstream gradient from seed, at 1, 2 and 3 threads.
void ExpectBitIdenticalAcrossThreadCounts(const Problem& p, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const Vec g = testutil::RandomVec(rng, p.n * p.H * p.D);
  testutil::ExpectBitIdenticalAcrossThreadCounts([&] { return RunKernel<float>(p, g).All(); });
}

void ExpectBackwardMatchesFiniteDifferences(Problem p, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const Vec g = testutil::RandomVec(rng, p.n * p.H * p.D);
  const auto r = RunKernel<double>(p, g);
  auto loss = [&] { return testutil::WeightedSum(NaiveAttention(p), g); };
  testutil::ExpectGradientMatches(&p.q, r.dq, loss, "dq");
  testutil::ExpectGradientMatches(&p.k, r.dk, loss, "dk");
  testutil::ExpectGradientMatches(&p.v, r.dv, loss, "dv");
  if (!p.sinks.empty()) testutil::ExpectGradientMatches(&p.sinks, r.dsinks, loss, "dsinks");
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
  ExpectFloatMatchesDouble(RandomProblem({20, 7, 13}, 4, 2, 32, 50), 51);
}

TEST(AttentionTest, ForwardAndBackwardAreBitIdenticalAcrossThreadCounts) {
  ExpectBitIdenticalAcrossThreadCounts(RandomProblem({30, 1, 25, 14}, 4, 2, 16, 52), 53);
}

// ---- sliding window and sinks ----

TEST(AttentionTest, ForwardMatchesNaiveWindowShorterThanDocuments) {
  ExpectForwardMatchesNaive(RandomProblem({9, 2, 7}, 4, 2, 8, 60, /*window=*/3));
}

TEST(AttentionTest, ForwardMatchesNaiveWindowOfOneSeesOnlyItself) {
  ExpectForwardMatchesNaive(RandomProblem({6, 5}, 2, 1, 8, 61, /*window=*/1));
}

TEST(AttentionTest, ForwardMatchesNaiveSinksThreeDocuments) {
  ExpectForwardMatchesNaive(RandomProblem({4, 3, 5}, 4, 2, 8, 62, 0, /*with_sinks=*/true));
}

TEST(AttentionTest, ForwardMatchesNaiveWindowAndSinksThreeDocuments) {
  ExpectForwardMatchesNaive(RandomProblem({10, 1, 8}, 4, 2, 8, 63, /*window=*/4, true));
}

// A large sink dominates the denominator; the max-shifted sums must not overflow.
TEST(AttentionTest, ForwardMatchesNaiveSinkFarAboveTheScores) {
  Problem p = RandomProblem({5, 6}, 2, 1, 8, 64, 3, true);
  p.sinks = {800.0, -800.0};
  ExpectForwardMatchesNaive(p);
}

// Perturbing key/value token j changes query i (same document) exactly when i - j < window.
TEST(AttentionTest, WindowHidesExactlyTheKeysAtWindowDistanceOrMore) {
  const int64_t window = 3, changed = 2;
  Problem p = RandomProblem({12}, 2, 1, 8, 65, window);
  const auto before = RunKernel<double>(p, Vec(p.n * p.H * p.D, 0.0));
  for (int64_t e = 0; e < p.KV * p.D; ++e) {
    p.k[changed * p.KV * p.D + e] += 0.8;
    p.v[changed * p.KV * p.D + e] -= 1.1;
  }
  const auto after = RunKernel<double>(p, Vec(p.n * p.H * p.D, 0.0));
  const int64_t row = p.H * p.D;
  for (int64_t i = 0; i < p.n; ++i) {
    const bool sees = i >= changed && i - changed < window;
    bool same = true;
    for (int64_t e = 0; e < row; ++e) same = same && before.o[i * row + e] == after.o[i * row + e];
    EXPECT_EQ(same, !sees) << "query " << i;
  }
}

// lse gains the sink's term, and o shrinks by the share the sink takes:
//   lse' = log(exp(lse) + exp(sink)),  o' = o exp(lse - lse').
TEST(AttentionTest, SinkAddsToLseAndScalesOutputByTheKeysShare) {
  const Problem with = RandomProblem({6, 4}, 4, 2, 8, 66, /*window=*/3, /*with_sinks=*/true);
  Problem without = with;
  without.sinks.clear();
  const Vec zeros(with.n * with.H * with.D, 0.0);
  const auto a = RunKernel<double>(without, zeros), b = RunKernel<double>(with, zeros);
  for (int64_t i = 0; i < with.n; ++i) {
    for (int64_t h = 0; h < with.H; ++h) {
      const int64_t r = i * with.H + h;
      const double lse = std::log(std::exp(a.lse[r]) + std::exp(with.sinks[h]));
      EXPECT_NEAR(b.lse[r], lse, 1e-14) << r;
      for (int64_t d = 0; d < with.D; ++d) {
        EXPECT_NEAR(b.o[r * with.D + d], a.o[r * with.D + d] * std::exp(a.lse[r] - lse), 1e-14);
      }
    }
  }
}

TEST(AttentionTest, BackwardMatchesFiniteDifferencesWindowThreeDocuments) {
  ExpectBackwardMatchesFiniteDifferences(RandomProblem({7, 2, 6}, 4, 2, 8, 67, /*window=*/3), 68);
}

TEST(AttentionTest, BackwardMatchesFiniteDifferencesSinksThreeDocuments) {
  ExpectBackwardMatchesFiniteDifferences(RandomProblem({4, 3, 5}, 4, 2, 8, 69, 0, true), 70);
}

TEST(AttentionTest, BackwardMatchesFiniteDifferencesWindowAndSinksFourDocuments) {
  ExpectBackwardMatchesFiniteDifferences(RandomProblem({6, 1, 5, 4}, 4, 2, 8, 71, 2, true), 72);
}

TEST(AttentionTest, BackwardMatchesFiniteDifferencesWindowAndSinksMultiQuery) {
  ExpectBackwardMatchesFiniteDifferences(RandomProblem({11}, 3, 1, 4, 73, 5, true), 74);
}

// dsinks is added to, as weight gradients are accumulated over micro-batches.
TEST(AttentionTest, SinkGradientIsAddedToWhatIsThere) {
  const Problem p = RandomProblem({5, 7}, 4, 2, 8, 75, 4, true);
  std::mt19937_64 rng(76);
  const Vec g = testutil::RandomVec(rng, p.n * p.H * p.D);
  const Vec start = {0.5, -1.0, 2.0, 0.25};
  const auto fresh = RunKernel<double>(p, g), added = RunKernel<double>(p, g, start);
  for (int64_t h = 0; h < p.H; ++h) EXPECT_EQ(added.dsinks[h], start[h] + fresh.dsinks[h]) << h;
}

// The unlimited path is today's: a window no shorter than the batch, or a sink of -inf (no
// weight), gives the same bits as window 0 and no sinks, in every output.
TEST(AttentionTest, NoWindowAndNoSinkAreTheSameBitsAsWideWindowAndMinusInfinitySink) {
  const Problem base = RandomProblem({30, 1, 25, 14}, 4, 2, 16, 77);
  std::mt19937_64 rng(78);
  const Vec g = testutil::RandomVec(rng, base.n * base.H * base.D);
  const VecF all = RunKernel<float>(base, g).All();
  for (int64_t window : {base.n, base.n + 100}) {
    Problem p = base;
    p.window = window;
    EXPECT_TRUE(testutil::BitIdentical(all, RunKernel<float>(p, g).All())) << window;
  }
  Problem p = base;
  p.sinks = Vec(p.H, -INFINITY);
  const auto got = RunKernel<float>(p, g);  // base has no dsinks: those must be zero
  EXPECT_TRUE(
      testutil::BitIdentical(all, testutil::Concat({got.o, got.lse, got.dq, got.dk, got.dv})));
  for (float d : got.dsinks) EXPECT_EQ(d, 0.0f);
}

TEST(AttentionTest, FloatMatchesDoubleWindowAndSinks) {
  ExpectFloatMatchesDouble(RandomProblem({40, 7, 13}, 4, 2, 32, 79, 9, true), 80);
}

TEST(AttentionTest, WindowAndSinksAreBitIdenticalAcrossThreadCounts) {
  ExpectBitIdenticalAcrossThreadCounts(RandomProblem({30, 1, 25, 14}, 4, 2, 16, 81, 6, true), 82);
}

}  // namespace
}  // namespace megatrain::ref
