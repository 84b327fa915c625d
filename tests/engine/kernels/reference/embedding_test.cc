#include "engine/kernels/reference/embedding.h"

#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "engine/layers/batch.h"
#include "tests/engine/kernels/reference/test_util.h"

namespace megatrain::ref {
namespace {

constexpr int64_t kVocab = 7;
constexpr int64_t kC = 5;

constexpr int64_t kN = 6;  // tokens

std::vector<int32_t> Tokens() { return {3, 0, 3, 6, 1, 3}; }  // (kN), repeats token 3

Vec NaiveEmbedding(const std::vector<int32_t>& tokens, const Vec& table) {
  Vec out(tokens.size() * kC);
  for (size_t i = 0; i < tokens.size(); ++i) {
    for (int64_t c = 0; c < kC; ++c) out[i * kC + c] = table[tokens[i] * kC + c];
  }
  return out;
}

// The op's rows of table (kVocab, kC) for Tokens(): out (kN, kC).
template <typename T>
std::vector<T> Forward(const std::vector<T>& table) {
  const auto tokens = Tokens();
  std::vector<T> out(kN * kC);
  Embedding(out.data(), tokens.data(), table.data(), kN, kC);
  return out;
}

// dtable (kVocab, kC) after the op's backward of g (kN, kC) over Tokens() adds to it.
template <typename T>
std::vector<T> AddBackward(std::vector<T> dtable, const std::vector<T>& g) {
  const auto tokens = Tokens();
  EmbeddingBackward(dtable.data(), g.data(), tokens.data(), kN, kC);
  return dtable;
}

TEST(EmbeddingTest, ForwardCopiesTheTokensTableRows) {
  std::mt19937_64 rng(1);
  const Vec table = testutil::RandomVec(rng, kVocab * kC);
  EXPECT_EQ(Forward(table), NaiveEmbedding(Tokens(), table));
}

TEST(EmbeddingTest, BackwardMatchesFiniteDifferencesWithRepeatedTokens) {
  std::mt19937_64 rng(2);
  Vec table = testutil::RandomVec(rng, kVocab * kC);
  const Vec g = testutil::RandomVec(rng, kN * kC);
  const Vec dtable = AddBackward(Vec(kVocab * kC, 0.0), g);
  testutil::ExpectGradientMatches(
      &table, dtable, [&] { return testutil::WeightedSum(NaiveEmbedding(Tokens(), table), g); },
      "dtable");
}

TEST(EmbeddingTest, BackwardAccumulatesIntoExistingGradient) {
  std::mt19937_64 rng(3);
  const auto tokens = Tokens();
  const Vec g = testutil::RandomVec(rng, kN * kC);
  const Vec initial = testutil::RandomVec(rng, kVocab * kC);
  Vec expected = initial;
  for (int64_t i = 0; i < kN; ++i) {
    for (int64_t c = 0; c < kC; ++c) expected[tokens[i] * kC + c] += g[i * kC + c];
  }
  testutil::ExpectAllNear(AddBackward(initial, g), expected, 1e-15, 1e-15, "dtable");
}

TEST(EmbeddingTest, FloatMatchesDouble) {
  std::mt19937_64 rng(4);
  const Vec table = testutil::RandomVec(rng, kVocab * kC);
  const Vec g = testutil::RandomVec(rng, kN * kC);
  const Vec dtable = AddBackward(Vec(kVocab * kC, 0.0), g);
  const VecF table_f = testutil::ToFloat(table), g_f = testutil::ToFloat(g);
  testutil::ExpectAllNear(Forward(table_f), NaiveEmbedding(Tokens(), table), 1e-7, 0, "out");
  testutil::ExpectAllNear(AddBackward(VecF(kVocab * kC, 0.0f), g_f), dtable, 1e-6, 1e-6, "dtable");
}

TEST(EmbeddingTest, BackwardIsBitIdenticalAcrossThreadCounts) {
  std::mt19937_64 rng(5);
  const int64_t n = 300, vocab = 11, C = 200;  // many repeats, several column blocks
  std::vector<int32_t> tokens(n);
  for (auto& t : tokens) t = static_cast<int32_t>(rng() % vocab);
  const auto g = testutil::ToFloat(testutil::RandomVec(rng, n * C));
  testutil::ExpectBitIdenticalAcrossThreadCounts([&] {
    VecF dtable(vocab * C, 0.5f);
    EmbeddingBackward(dtable.data(), g.data(), tokens.data(), n, C);
    return dtable;
  });
}

// TokenOrder (layers/batch.h) is what the CUDA backward walks: every position once, sorted
// by token and then position. Adding each token's rows in that order onto dtable gives the
// reference's bits, which is what makes the GPU's sum equal to it.
TEST(EmbeddingTest, TokenOrderRunsGiveTheReferencesBits) {
  std::mt19937_64 rng(6);
  const int64_t n = 1000, vocab = 13, C = 70;
  std::vector<int32_t> tokens(n), order(n);
  for (auto& t : tokens) t = static_cast<int32_t>(rng() % vocab);
  TokenOrder(tokens.data(), n, order.data());
  std::vector<bool> seen(n, false);
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_TRUE(order[i] >= 0 && order[i] < n && !seen[order[i]]) << i;
    seen[order[i]] = true;
    if (i > 0) {
      const int32_t a = order[i - 1], b = order[i];
      EXPECT_TRUE(tokens[a] < tokens[b] || (tokens[a] == tokens[b] && a < b)) << i;
    }
  }
  const auto g = testutil::ToFloat(testutil::RandomVec(rng, n * C));
  VecF expected(vocab * C, 0.25f), runs(vocab * C, 0.25f);
  EmbeddingBackward(expected.data(), g.data(), tokens.data(), n, C);
  for (int64_t i = 0; i < n; ++i) {  // the CUDA kernel's loop, one token's run at a time
    const int64_t p = order[i];
    for (int64_t c = 0; c < C; ++c) runs[tokens[p] * C + c] += g[p * C + c];
  }
  EXPECT_TRUE(testutil::BitIdentical(expected, runs));
}

}  // namespace
}  // namespace megatrain::ref
