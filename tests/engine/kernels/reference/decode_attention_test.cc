// KvCacheWrite and DecodeAttention against the causal Attention they stand in for: sequences
// packed as documents through Attention give, in each sequence's last row, what decode gives
// from the caches that KvCacheWrite filled with the same tokens.
#include "engine/kernels/reference/decode_attention.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "engine/kernels/reference/attention.h"
#include "tests/engine/kernels/reference/test_util.h"

namespace megatrain::ref {
namespace {

// Sequences of the given lengths in the given cache slots, their tokens packed back to back.
struct Sequences {
  int64_t H = 0, KV = 0, D = 0, slots = 0, max_len = 0;
  std::vector<int64_t> lengths;                        // (B)
  std::vector<int32_t> slot;                           // (B)
  int64_t window = 0;                                  // 0: none
  Vec sinks;                                           // (H), or empty for none
  int64_t n = 0;                                       // tokens of all sequences
  std::vector<int32_t> doc_start, seq_slot, position;  // (n)
  Vec q, k, v;                                         // (n,H,D), (n,KV,D), (n,KV,D)

  int64_t B() const { return static_cast<int64_t>(lengths.size()); }
  int64_t CacheSize() const { return slots * max_len * KV * D; }
  // The packed index of sequence b's last token.
  int64_t Last(int64_t b) const { return First(b) + lengths[b] - 1; }
  int64_t First(int64_t b) const {
    int64_t t = 0;
    for (int64_t c = 0; c < b; ++c) t += lengths[c];
    return t;
  }
};

Sequences RandomSequences(const std::vector<int64_t>& lengths, const std::vector<int32_t>& slot,
                          int64_t slots, int64_t max_len, int64_t H, int64_t KV, int64_t D,
                          uint64_t seed, int64_t window = 0, bool with_sinks = false) {
  std::mt19937_64 rng(seed);
  Sequences s;
  s.H = H;
  s.KV = KV;
  s.D = D;
  s.slots = slots;
  s.max_len = max_len;
  s.lengths = lengths;
  s.slot = slot;
  s.window = window;
  for (size_t b = 0; b < lengths.size(); ++b) {
    for (int64_t t = 0; t < lengths[b]; ++t) {
      s.doc_start.push_back(static_cast<int32_t>(s.n));
      s.seq_slot.push_back(slot[b]);
      s.position.push_back(static_cast<int32_t>(t));
    }
    s.n += lengths[b];
  }
  s.q = testutil::RandomVec(rng, s.n * H * D, -1.5, 1.5);
  s.k = testutil::RandomVec(rng, s.n * KV * D, -1.5, 1.5);
  s.v = testutil::RandomVec(rng, s.n * KV * D);
  if (with_sinks) s.sinks = testutil::RandomVec(rng, H, -1.0, 2.0);
  return s;
}

template <typename T>
std::vector<T> Cast(const Vec& x) {
  return std::vector<T>(x.begin(), x.end());
}

// Attention over the packed sequences: o (n,H,D).
template <typename T>
std::vector<T> CausalAttention(const Sequences& s) {
  const auto q = Cast<T>(s.q), k = Cast<T>(s.k), v = Cast<T>(s.v), sinks = Cast<T>(s.sinks);
  std::vector<T> o(s.n * s.H * s.D), lse(s.n * s.H);
  Attention(o.data(), lse.data(), q.data(), k.data(), v.data(), s.doc_start.data(),
            s.sinks.empty() ? nullptr : sinks.data(), s.window, s.n, s.H, s.KV, s.D);
  return o;
}

// Rows `rows` of x (rows of `width`), back to back.
template <typename T>
std::vector<T> Rows(const std::vector<T>& x, const std::vector<int64_t>& rows, int64_t width) {
  std::vector<T> out;
  for (int64_t r : rows) out.insert(out.end(), x.begin() + r * width, x.begin() + (r + 1) * width);
  return out;
}

std::vector<int64_t> LastTokens(const Sequences& s) {
  std::vector<int64_t> last;
  for (int64_t b = 0; b < s.B(); ++b) last.push_back(s.Last(b));
  return last;
}

// Caches (filled with `fill` first) holding every token of the sequences: a prefill.
template <typename T>
void Prefill(const Sequences& s, std::vector<T>* k_cache, std::vector<T>* v_cache, T fill = T(0)) {
  const auto k = Cast<T>(s.k), v = Cast<T>(s.v);
  k_cache->assign(s.CacheSize(), fill);
  v_cache->assign(s.CacheSize(), fill);
  KvCacheWrite(k_cache->data(), v_cache->data(), k.data(), v.data(), s.seq_slot.data(),
               s.position.data(), s.n, s.KV, s.D, s.max_len);
}

// DecodeAttention of each sequence's last query over the caches: o (B,H,D).
template <typename T>
std::vector<T> Decode(const Sequences& s, const std::vector<T>& k_cache,
                      const std::vector<T>& v_cache) {
  const auto q = Rows(Cast<T>(s.q), LastTokens(s), s.H * s.D), sinks = Cast<T>(s.sinks);
  std::vector<int32_t> length(s.lengths.begin(), s.lengths.end());
  std::vector<T> o(s.B() * s.H * s.D);
  DecodeAttention(o.data(), q.data(), k_cache.data(), v_cache.data(), s.slot.data(), length.data(),
                  s.sinks.empty() ? nullptr : sinks.data(), s.window, s.B(), s.H, s.KV, s.D,
                  s.max_len);
  return o;
}

// Decode after prefill equals Attention's last row of every sequence (the same sums in the
// same order: only contraction differences could separate them).
void ExpectDecodeEqualsLastRows(const Sequences& s) {
  Vec k_cache, v_cache;
  Prefill(s, &k_cache, &v_cache);
  const Vec want = Rows(CausalAttention<double>(s), LastTokens(s), s.H * s.D);
  testutil::ExpectAllNear(Decode(s, k_cache, v_cache), want, 1e-13, 1e-14, "o");
}

// ---- KvCacheWrite ----

// Each token's k and v land at [slot, position], whatever the order of the tokens; every
// other element of the caches keeps its value.
TEST(KvCacheWriteTest, PlacesEachTokenAtItsSlotAndPositionAndNothingElse) {
  const int64_t slots = 4, max_len = 6, KV = 2, D = 3, row = KV * D;
  const std::vector<int32_t> slot = {2, 0, 2, 3, 0}, position = {0, 5, 4, 1, 0};
  const int64_t n = static_cast<int64_t>(slot.size());
  Vec k(n * row), v(n * row);
  for (int64_t e = 0; e < n * row; ++e) {
    k[e] = 100.0 + e;
    v[e] = -100.0 - e;
  }
  Vec k_cache(slots * max_len * row, 7.0), v_cache(slots * max_len * row, -7.0);
  KvCacheWrite(k_cache.data(), v_cache.data(), k.data(), v.data(), slot.data(), position.data(), n,
               KV, D, max_len);
  for (int64_t c = 0; c < slots; ++c) {
    for (int64_t t = 0; t < max_len; ++t) {
      int64_t token = -1;
      for (int64_t i = 0; i < n; ++i) {
        if (slot[i] == c && position[i] == t) token = i;
      }
      for (int64_t e = 0; e < row; ++e) {
        const int64_t at = (c * max_len + t) * row + e;
        EXPECT_EQ(k_cache[at], token < 0 ? 7.0 : k[token * row + e]) << c << "," << t;
        EXPECT_EQ(v_cache[at], token < 0 ? -7.0 : v[token * row + e]) << c << "," << t;
      }
    }
  }
}

// ---- DecodeAttention equals the last row of causal Attention ----

TEST(DecodeAttentionTest, EqualsLastRowOfAttentionMultiHeadGroupOfOne) {
  ExpectDecodeEqualsLastRows(RandomSequences({7}, {0}, 1, 9, 4, 4, 8, 100));
}

TEST(DecodeAttentionTest, EqualsLastRowOfAttentionGqaGroupOfFour) {
  ExpectDecodeEqualsLastRows(RandomSequences({11}, {1}, 2, 16, 8, 2, 8, 101));
}

TEST(DecodeAttentionTest, EqualsLastRowOfAttentionGqaGroupOfEight) {
  ExpectDecodeEqualsLastRows(RandomSequences({13}, {0}, 1, 13, 8, 1, 16, 102));
}

// One key: the output is that key's value in every head of its group.
TEST(DecodeAttentionTest, SequenceOfLengthOneReturnsItsOwnValue) {
  const Sequences s = RandomSequences({1}, {2}, 3, 4, 4, 2, 8, 103);
  Vec k_cache, v_cache;
  Prefill(s, &k_cache, &v_cache);
  const Vec o = Decode(s, k_cache, v_cache);
  for (int64_t h = 0; h < s.H; ++h) {
    for (int64_t d = 0; d < s.D; ++d) {
      EXPECT_NEAR(o[h * s.D + d], s.v[(h / 2) * s.D + d], 1e-15) << h << "," << d;
    }
  }
}

// Odd lengths, one of a single token, in slots out of order with a slot left empty; the
// cache is longer than every sequence.
TEST(DecodeAttentionTest, SeveralSequencesOfOddLengthsInScatteredSlots) {
  ExpectDecodeEqualsLastRows(RandomSequences({9, 1, 15, 5}, {3, 0, 4, 1}, 5, 21, 8, 2, 8, 104));
}

TEST(DecodeAttentionTest, SequencesFillingTheWholeCache) {
  ExpectDecodeEqualsLastRows(RandomSequences({12, 12}, {1, 0}, 2, 12, 4, 1, 8, 105));
}

// ---- window and sinks ----

TEST(DecodeAttentionTest, WindowShorterThanTheSequences) {
  ExpectDecodeEqualsLastRows(
      RandomSequences({9, 2, 14}, {0, 2, 1}, 3, 16, 8, 2, 8, 106, /*window=*/4));
}

TEST(DecodeAttentionTest, WindowOfOneSeesOnlyTheNewKey) {
  ExpectDecodeEqualsLastRows(RandomSequences({6, 5}, {1, 0}, 2, 8, 4, 1, 8, 107, 1));
}

TEST(DecodeAttentionTest, WindowLongerThanTheSequencesHidesNothing) {
  const Sequences s = RandomSequences({6, 9}, {0, 1}, 2, 12, 4, 2, 8, 108, /*window=*/100);
  Sequences none = s;
  none.window = 0;
  Vec k_cache, v_cache;
  Prefill(s, &k_cache, &v_cache);
  EXPECT_TRUE(testutil::BitIdentical(Decode(s, k_cache, v_cache), Decode(none, k_cache, v_cache)));
  ExpectDecodeEqualsLastRows(s);
}

TEST(DecodeAttentionTest, SinksSeveralSequences) {
  ExpectDecodeEqualsLastRows(
      RandomSequences({4, 7, 1}, {2, 0, 1}, 3, 8, 8, 2, 8, 109, 0, /*with_sinks=*/true));
}

// GPT-OSS's sliding layers: a window and sinks together, group of eight.
TEST(DecodeAttentionTest, WindowAndSinksGroupOfEight) {
  ExpectDecodeEqualsLastRows(
      RandomSequences({10, 1, 17}, {1, 2, 0}, 3, 20, 8, 1, 16, 110, /*window=*/5, true));
}

// A sink far above the scores takes nearly all the weight; the sums must not overflow.
TEST(DecodeAttentionTest, SinkFarAboveTheScores) {
  Sequences s = RandomSequences({5, 6}, {0, 1}, 2, 6, 2, 1, 8, 111, 3, true);
  s.sinks = {800.0, -800.0};
  ExpectDecodeEqualsLastRows(s);
}

// ---- decode as generation runs it ----

// Prefill a prompt per sequence, then decode one token per sequence per step (KvCacheWrite
// of the step's tokens, then DecodeAttention): step t's output is Attention's row t.
TEST(DecodeAttentionTest, StepByStepDecodeReproducesEveryRowOfAttention) {
  const std::vector<int64_t> lengths = {9, 9, 9};
  const std::vector<int32_t> slot = {2, 0, 1};
  const int64_t prompt = 3;
  const Sequences s = RandomSequences(lengths, slot, 3, 12, 8, 2, 8, 112, /*window=*/4, true);
  const Vec all = CausalAttention<double>(s);
  Vec k_cache(s.CacheSize(), 0.0), v_cache(s.CacheSize(), 0.0);
  std::vector<int64_t> prompt_tokens;
  for (int64_t i = 0; i < s.n; ++i) {
    if (s.position[i] < prompt) prompt_tokens.push_back(i);
  }
  const auto write = [&](const std::vector<int64_t>& tokens) {
    const Vec k = Rows(s.k, tokens, s.KV * s.D), v = Rows(s.v, tokens, s.KV * s.D);
    std::vector<int32_t> seq_slot, position;
    for (int64_t i : tokens) {
      seq_slot.push_back(s.seq_slot[i]);
      position.push_back(s.position[i]);
    }
    KvCacheWrite(k_cache.data(), v_cache.data(), k.data(), v.data(), seq_slot.data(),
                 position.data(), static_cast<int64_t>(tokens.size()), s.KV, s.D, s.max_len);
  };
  write(prompt_tokens);
  for (int64_t t = prompt; t < lengths[0]; ++t) {
    std::vector<int64_t> step;  // token t of each sequence
    for (int64_t b = 0; b < s.B(); ++b) step.push_back(s.First(b) + t);
    write(step);
    const Vec q = Rows(s.q, step, s.H * s.D);
    const std::vector<int32_t> length(s.B(), static_cast<int32_t>(t + 1));
    Vec o(s.B() * s.H * s.D);
    DecodeAttention(o.data(), q.data(), k_cache.data(), v_cache.data(), slot.data(), length.data(),
                    s.sinks.data(), s.window, s.B(), s.H, s.KV, s.D, s.max_len);
    testutil::ExpectAllNear(o, Rows(all, step, s.H * s.D), 1e-13, 1e-14,
                            "step " + std::to_string(t));
  }
}

// Cache rows past a sequence's length hold anything (here NaN): decode never reads them.
TEST(DecodeAttentionTest, CacheRowsPastTheLengthAreNeverRead) {
  const Sequences s = RandomSequences({5, 3}, {1, 0}, 2, 10, 4, 2, 8, 113, 0, true);
  Vec k_cache, v_cache;
  Prefill(s, &k_cache, &v_cache, std::numeric_limits<double>::quiet_NaN());
  const Vec want = Rows(CausalAttention<double>(s), LastTokens(s), s.H * s.D);
  testutil::ExpectAllNear(Decode(s, k_cache, v_cache), want, 1e-13, 1e-14, "o");
}

// ---- precision and threads ----

TEST(DecodeAttentionTest, FloatMatchesDouble) {
  const Sequences s = RandomSequences({40, 7, 13}, {0, 2, 1}, 3, 48, 8, 2, 32, 114, 9, true);
  Vec kd, vd;
  std::vector<float> kf, vf;
  Prefill(s, &kd, &vd);
  Prefill(s, &kf, &vf);
  testutil::ExpectAllNear(Decode(s, kf, vf), Decode(s, kd, vd), 1e-5, 1e-5, "o");
}

TEST(DecodeAttentionTest, BitIdenticalAcrossThreadCounts) {
  const Sequences s = RandomSequences({30, 1, 25, 14}, {3, 1, 0, 2}, 4, 32, 8, 2, 16, 115, 6, true);
  testutil::ExpectBitIdenticalAcrossThreadCounts([&] {
    std::vector<float> k_cache, v_cache;
    Prefill(s, &k_cache, &v_cache);
    return testutil::Concat({Decode(s, k_cache, v_cache), k_cache, v_cache});
  });
}

}  // namespace
}  // namespace megatrain::ref
