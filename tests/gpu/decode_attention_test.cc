// Generation's KV cache write and decode attention on the CUDA backend against the CPU
// backend: prompts written by one KvCacheWrite (prefill), each sequence's newest token by a
// second (a decode step), then DecodeAttention over the caches. The caches start as NaN, so a
// read of a row no token wrote shows. Long caches with one sequence take the split (flash-
// decoding) path; a second run must give the same bits.
#include <cmath>
#include <limits>
#include <ostream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/gpu/gpu_util.h"

namespace megatrain::testing {
namespace {

struct DecodeShape {
  std::string name;
  std::vector<int64_t> lengths;  // (B) keys of each sequence, its newest included
  std::vector<int32_t> slots;    // (B) its cache slot
  int64_t num_slots, max_len, H, KV, D, window;
  bool sinks;
};

void PrintTo(const DecodeShape& a, std::ostream* os) { *os << a.name; }

// One backend's tensors of a decode problem.
struct DecodeBuffers {
  DeviceBuffer k_cache, v_cache, o, o_again;
};

class DecodeAttentionKernels : public GpuTest, public ::testing::WithParamInterface<DecodeShape> {
 protected:
  // The packed prompt tokens (all but each sequence's last) and the step's tokens (the last).
  struct Tokens {
    std::vector<int32_t> slot, position;  // (n)
    std::vector<float> k, v;              // (n, KV, D)
  };
  static void Split(const DecodeShape& a, const std::vector<float>& k, const std::vector<float>& v,
                    Tokens* prompt, Tokens* step) {
    const int64_t row = a.KV * a.D;
    int64_t token = 0;
    for (size_t b = 0; b < a.lengths.size(); ++b) {
      for (int64_t t = 0; t < a.lengths[b]; ++t, ++token) {
        Tokens* to = t + 1 < a.lengths[b] ? prompt : step;
        to->slot.push_back(a.slots[b]);
        to->position.push_back(static_cast<int32_t>(t));
        to->k.insert(to->k.end(), k.begin() + token * row, k.begin() + (token + 1) * row);
        to->v.insert(to->v.end(), v.begin() + token * row, v.begin() + (token + 1) * row);
      }
    }
  }

  // Prefill, decode step's write, then DecodeAttention twice (o, o_again) on backend b.
  static DecodeBuffers Run(Backend* b, const DecodeShape& a, const Tokens& prompt,
                           const Tokens& step, const std::vector<float>& q,
                           const std::vector<float>& sinks) {
    const int64_t B = static_cast<int64_t>(a.lengths.size());
    const size_t cache = a.num_slots * a.max_len * a.KV * a.D;
    const std::vector<float> nan(cache, std::numeric_limits<float>::quiet_NaN());
    DecodeBuffers r{Upload(b, b->act_dtype(), nan), Upload(b, b->act_dtype(), nan),
                    Upload(b, b->act_dtype(), std::vector<float>(B * a.H * a.D)),
                    Upload(b, b->act_dtype(), std::vector<float>(B * a.H * a.D))};
    for (const Tokens* t : {&prompt, &step}) {
      const int64_t n = static_cast<int64_t>(t->slot.size());
      if (n == 0) continue;
      DeviceBuffer k = Upload(b, b->act_dtype(), t->k), v = Upload(b, b->act_dtype(), t->v);
      DeviceBuffer slot = UploadInts(b, t->slot), pos = UploadInts(b, t->position);
      b->KvCacheWrite(r.k_cache.get(), r.v_cache.get(), k.get(), v.get(),
                      static_cast<const int32_t*>(slot.get()),
                      static_cast<const int32_t*>(pos.get()), n, a.KV, a.D, a.max_len,
                      StreamId::kCompute);
      b->SyncAll();  // before k, v, slot and pos are freed
    }
    std::vector<int32_t> length(a.lengths.begin(), a.lengths.end());
    DeviceBuffer qb = Upload(b, b->act_dtype(), q), sb = Upload(b, b->weight_dtype(), sinks);
    DeviceBuffer slot = UploadInts(b, a.slots), len = UploadInts(b, length);
    for (DeviceBuffer* o : {&r.o, &r.o_again}) {
      b->DecodeAttention(o->get(), qb.get(), r.k_cache.get(), r.v_cache.get(),
                         static_cast<const int32_t*>(slot.get()),
                         static_cast<const int32_t*>(len.get()), a.sinks ? sb.get() : nullptr,
                         a.window, B, a.H, a.KV, a.D, a.max_len, StreamId::kCompute);
    }
    b->SyncAll();
    return r;
  }
};

// Equal elements, NaN matching NaN (the rows no token wrote).
int64_t Mismatches(const std::vector<float>& a, const std::vector<float>& b) {
  int64_t bad = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!(a[i] == b[i] || (std::isnan(a[i]) && std::isnan(b[i])))) ++bad;
  }
  return bad;
}

// The caches hold the same bits on both backends (a copy: inputs are bf16-exact); o matches
// the CPU within bf16 rounding (P is rounded to bf16 for the tensor cores); a second run on
// the device gives the same bits.
TEST_P(DecodeAttentionKernels, MatchesTheCpuAndRepeatsBitForBit) {
  const DecodeShape a = GetParam();
  int64_t n = 0;
  for (int64_t len : a.lengths) n += len;
  const int64_t B = static_cast<int64_t>(a.lengths.size());
  const std::vector<float> k = RandomBf16(n * a.KV * a.D, 90, 1.5f),
                           v = RandomBf16(n * a.KV * a.D, 91),
                           q = RandomBf16(B * a.H * a.D, 92, 1.5f),
                           sinks = RandomBf16(a.H, 93, 1.0f, 0.5f);
  Tokens prompt, step;
  Split(a, k, v, &prompt, &step);
  const DecodeBuffers c = Run(cpu_.get(), a, prompt, step, q, sinks);
  const DecodeBuffers g = Run(gpu_.get(), a, prompt, step, q, sinks);
  const size_t cache = a.num_slots * a.max_len * a.KV * a.D, out = B * a.H * a.D;
  EXPECT_EQ(Mismatches(Download(gpu_.get(), gpu_->act_dtype(), g.k_cache, cache),
                       Download(cpu_.get(), cpu_->act_dtype(), c.k_cache, cache)),
            0);
  EXPECT_EQ(Mismatches(Download(gpu_.get(), gpu_->act_dtype(), g.v_cache, cache),
                       Download(cpu_.get(), cpu_->act_dtype(), c.v_cache, cache)),
            0);
  const std::vector<float> want = Download(cpu_.get(), cpu_->act_dtype(), c.o, out);
  const std::vector<float> got = Download(gpu_.get(), gpu_->act_dtype(), g.o, out);
  for (float x : got) ASSERT_TRUE(std::isfinite(x)) << "a NaN row of the cache was read";
  EXPECT_LT(RelErr(got, want), 1e-2);
  // Per sequence too: a short one beside a long one must not hide in the norm.
  const int64_t row = a.H * a.D;
  for (int64_t b = 0; b < B; ++b) {
    const std::vector<float> gb(got.begin() + b * row, got.begin() + (b + 1) * row),
        wb(want.begin() + b * row, want.begin() + (b + 1) * row);
    EXPECT_LT(RelErr(gb, wb), 1.5e-2) << "sequence " << b << " of length " << a.lengths[b];
  }
  EXPECT_TRUE(got == Download(gpu_.get(), gpu_->act_dtype(), g.o_again, out))
      << "two runs gave different bits";
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, DecodeAttentionKernels,
    ::testing::Values(
        // Lengths 1, odd, a whole tile and a tile plus one, in scattered slots.
        DecodeShape{
            "gqa4_d128", {1, 37, 64, 65, 200}, {2, 0, 4, 1, 5}, 6, 256, 8, 2, 128, 0, false},
        DecodeShape{"mha_d64", {3, 129, 1}, {1, 2, 0}, 3, 192, 8, 8, 64, 0, false},
        DecodeShape{"gqa8_d128_sinks", {300, 2}, {0, 1}, 2, 300, 64, 8, 128, 0, true},
        // GPT-OSS: head_dim 64, groups of 8, sinks, sliding layers of 128 and full ones.
        DecodeShape{
            "gptoss_window128", {5000, 129, 1, 700}, {3, 0, 1, 2}, 4, 8192, 64, 8, 64, 128, true},
        DecodeShape{"gptoss_full", {3001, 17}, {1, 0}, 2, 4096, 64, 8, 64, 0, true},
        DecodeShape{
            "window_longer_than_sequences", {40, 90}, {0, 1}, 2, 128, 16, 4, 64, 100, false},
        // Qwen2.5-7B's group of 7; a group of 16 (one full mma tile); 20 (two head tiles).
        DecodeShape{"gqa7_d128", {1000, 333, 2}, {2, 1, 0}, 3, 1024, 28, 4, 128, 0, false},
        DecodeShape{"gqa16_d128", {777, 5}, {0, 1}, 2, 1024, 32, 2, 128, 0, true},
        DecodeShape{"gqa20_d64", {450, 63}, {1, 0}, 2, 512, 40, 2, 64, 0, true},
        // Many sequences: enough blocks without a split.
        DecodeShape{
            "batch64_gqa4_d128",
            {1,  7,  300, 64, 65, 2,  111, 250, 9,  33, 199, 1,  128, 129, 17,  40,
             3,  5,  280, 77, 64, 31, 150, 222, 8,  90, 12,  61, 70,  4,   300, 1,
             2,  3,  4,   5,  6,  7,  8,   9,   10, 11, 12,  13, 14,  15,  16,  17,
             18, 19, 20,  21, 22, 23, 24,  25,  26, 27, 28,  29, 30,  31,  32,  33},
            {63, 62, 61, 60, 59, 58, 57, 56, 55, 54, 53, 52, 51, 50, 49, 48, 47, 46, 45, 44, 43, 42,
             41, 40, 39, 38, 37, 36, 35, 34, 33, 32, 31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20,
             19, 18, 17, 16, 15, 14, 13, 12, 11, 10, 9,  8,  7,  6,  5,  4,  3,  2,  1,  0},
            64,
            300,
            32,
            8,
            128,
            0,
            false},
        // Long caches, one sequence: the keys split over blocks, then merged.
        DecodeShape{"long_32k_d128", {32768}, {0}, 1, 32768, 64, 8, 128, 0, false},
        DecodeShape{"long_odd_d128_sinks", {31999}, {0}, 1, 32768, 32, 8, 128, 0, true},
        DecodeShape{"long_32k_d64_sinks", {32768}, {0}, 1, 32768, 64, 8, 64, 0, true},
        DecodeShape{"long_and_short", {20000, 1000}, {1, 0}, 2, 32768, 32, 8, 128, 0, false}),
    [](const ::testing::TestParamInfo<DecodeShape>& info) { return info.param.name; });

// A prompt through the CUDA backend's causal Attention and the same tokens' keys through
// KvCacheWrite: decode of each sequence's last query over the cache gives Attention's row
// for it, within bf16 rounding (generation's prefill and decode agree).
class DecodeAttentionGpu : public GpuTest {};

TEST_F(DecodeAttentionGpu, DecodeEqualsCudaAttentionLastRowsAfterPrefill) {
  const std::vector<int64_t> lengths = {129, 1, 77, 300};
  const std::vector<int32_t> slots = {1, 3, 0, 2};
  const int64_t H = 16, KV = 4, D = 128, max_len = 320, window = 100;
  for (const bool sinks : {false, true}) {
    int64_t n = 0;
    std::vector<int32_t> doc_start, seq_slot, position, last;
    for (size_t b = 0; b < lengths.size(); ++b) {
      for (int64_t t = 0; t < lengths[b]; ++t) {
        doc_start.push_back(static_cast<int32_t>(n));
        seq_slot.push_back(slots[b]);
        position.push_back(static_cast<int32_t>(t));
      }
      n += lengths[b];
      last.push_back(static_cast<int32_t>(n - 1));
    }
    Backend* g = gpu_.get();
    const std::vector<float> qv = RandomBf16(n * H * D, 94, 1.5f);
    DeviceBuffer q = Upload(g, g->act_dtype(), qv),
                 k = Upload(g, g->act_dtype(), RandomBf16(n * KV * D, 95, 1.5f)),
                 v = Upload(g, g->act_dtype(), RandomBf16(n * KV * D, 96)),
                 sk = Upload(g, g->weight_dtype(), RandomBf16(H, 97, 1.0f, 0.5f)),
                 o = Upload(g, g->act_dtype(), std::vector<float>(n * H * D)),
                 lse = Upload(g, g->stat_dtype(), std::vector<float>(n * H)),
                 kc = Upload(g, g->act_dtype(), std::vector<float>(4 * max_len * KV * D)),
                 vc = Upload(g, g->act_dtype(), std::vector<float>(4 * max_len * KV * D)),
                 ds = UploadInts(g, doc_start), ss = UploadInts(g, seq_slot),
                 ps = UploadInts(g, position);
    std::vector<float> q_last;
    for (int32_t i : last) {
      q_last.insert(q_last.end(), qv.begin() + i * H * D, qv.begin() + (i + 1) * H * D);
    }
    std::vector<int32_t> length(lengths.begin(), lengths.end());
    const int64_t B = static_cast<int64_t>(lengths.size());
    DeviceBuffer ql = Upload(g, g->act_dtype(), q_last),
                 od = Upload(g, g->act_dtype(), std::vector<float>(B * H * D)),
                 sl = UploadInts(g, slots), len = UploadInts(g, length);
    const void* sinks_ptr = sinks ? sk.get() : nullptr;
    g->Attention(o.get(), lse.get(), q.get(), k.get(), v.get(),
                 static_cast<const int32_t*>(ds.get()), sinks_ptr, window, n, H, KV, D,
                 StreamId::kCompute);
    g->KvCacheWrite(kc.get(), vc.get(), k.get(), v.get(), static_cast<const int32_t*>(ss.get()),
                    static_cast<const int32_t*>(ps.get()), n, KV, D, max_len, StreamId::kCompute);
    g->DecodeAttention(od.get(), ql.get(), kc.get(), vc.get(),
                       static_cast<const int32_t*>(sl.get()),
                       static_cast<const int32_t*>(len.get()), sinks_ptr, window, B, H, KV, D,
                       max_len, StreamId::kCompute);
    const std::vector<float> all = Download(g, g->act_dtype(), o, n * H * D);
    std::vector<float> want;
    for (int32_t i : last) {
      want.insert(want.end(), all.begin() + i * H * D, all.begin() + (i + 1) * H * D);
    }
    EXPECT_LT(RelErr(Download(g, g->act_dtype(), od, B * H * D), want), 1e-2) << "sinks " << sinks;
  }
}

}  // namespace
}  // namespace megatrain::testing
