// The mixture-of-experts ops on the CUDA backend against the CPU backend (the reference):
// the sort and the router's choices and counts exactly, the rest within bf16 tolerances,
// and the sums that must not depend on timing the same bits on every run.
//
// Router logits are multiples of 1/16: probabilities of different logits differ by 6% or
// more, so both backends pick the same experts, and equal logits (there are many) test the
// lower-index-first rule.
#include <algorithm>
#include <array>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "engine/kernels/reference/moe.h"
#include "gtest/gtest.h"
#include "tests/gpu/gpu_util.h"

namespace megatrain::testing {
namespace {

constexpr StreamId kS = StreamId::kCompute;

// One tensor on both backends, in the dtype each uses for its role.
struct Pair {
  Backend* cpu;
  Backend* gpu;
  DType ct, gt;
  size_t n;
  DeviceBuffer c, g;
  Pair(Backend* cb, Backend* gb, DType ctype, DType gtype, const std::vector<float>& v)
      : cpu(cb),
        gpu(gb),
        ct(ctype),
        gt(gtype),
        n(v.size()),
        c(Upload(cb, ctype, v)),
        g(Upload(gb, gtype, v)) {}
  void* P(bool on_cpu) const { return on_cpu ? c.get() : g.get(); }
  std::vector<float> Cpu() const { return Download(cpu, ct, c, n); }
  std::vector<float> Gpu() const { return Download(gpu, gt, g, n); }
  double Err() const { return RelErr(Gpu(), Cpu()); }
};

std::vector<int32_t> DownloadInts(Backend* be, const DeviceBuffer& b, size_t n) {
  std::vector<int32_t> v(n);
  be->SyncAll();
  if (n > 0) be->CopyToHost(v.data(), b.get(), n * sizeof(int32_t), kS);
  be->SyncAll();
  return v;
}

// int32 tensor on both backends (at least one element, so that empty ones copy nothing).
struct IntPair {
  Backend* cpu;
  Backend* gpu;
  size_t n;
  DeviceBuffer c, g;
  IntPair(Backend* cb, Backend* gb, std::vector<int32_t> v)
      : cpu(cb), gpu(gb), n(v.size()), c(UploadInts(cb, Padded(v))), g(UploadInts(gb, Padded(v))) {}
  int32_t* P(bool on_cpu) const { return static_cast<int32_t*>(on_cpu ? c.get() : g.get()); }
  std::vector<int32_t> Cpu() const { return DownloadInts(cpu, c, n); }
  std::vector<int32_t> Gpu() const { return DownloadInts(gpu, g, n); }
  static std::vector<int32_t> Padded(std::vector<int32_t> v) {
    if (v.empty()) v.push_back(0);
    return v;
  }
};

// Logits (n, E): multiples of 1/16 in [-2.5, 2.5], exact in bf16.
std::vector<float> RouterLogits(int64_t n, int64_t E, uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::uniform_int_distribution<int> m(-40, 40);
  std::vector<float> v(n * E);
  for (float& x : v) x = static_cast<float>(m(gen)) / 16.0f;
  return v;
}

// idx (n, k): k distinct experts per token, unevenly spread, never one of `empty`.
std::vector<int32_t> RandomChoices(int64_t n, int64_t E, int64_t k,
                                   const std::vector<int64_t>& empty, uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::vector<double> weight(E);
  for (int64_t e = 0; e < E; ++e) weight[e] = 1.0 + (E - e) % 7 * (e % 3);
  for (int64_t e : empty) weight[e] = 0.0;
  std::discrete_distribution<int32_t> pick(weight.begin(), weight.end());
  std::vector<int32_t> idx(n * k);
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t j = 0; j < k; ++j) {
      int32_t e;
      do {
        e = pick(gen);
      } while (std::find(&idx[t * k], &idx[t * k + j], e) != &idx[t * k + j]);
      idx[t * k + j] = e;
    }
  }
  return idx;
}

// w (n, k): positive, summing to 1 per token.
std::vector<float> RandomWeights(int64_t n, int64_t k, uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::uniform_real_distribution<float> u(0.05f, 1.0f);
  std::vector<float> w(n * k);
  for (int64_t t = 0; t < n; ++t) {
    float sum = 0;
    for (int64_t j = 0; j < k; ++j) sum += w[t * k + j] = u(gen);
    for (int64_t j = 0; j < k; ++j) w[t * k + j] /= sum;
  }
  return w;
}

// The reference permutation of idx (n, k), computed on the host.
struct Permutation {
  std::vector<int32_t> offsets, slot_of, row_token;
};
Permutation SortOnHost(const std::vector<int32_t>& idx, int64_t n, int64_t E, int64_t k) {
  Permutation p{std::vector<int32_t>(E + 1), std::vector<int32_t>(n * k),
                std::vector<int32_t>(n * k)};
  ref::MoeSort(p.offsets.data(), p.slot_of.data(), p.row_token.data(), idx.data(), n, E, k);
  return p;
}

class MoeKernels : public GpuTest {
 protected:
  Pair Act(const std::vector<float>& v) { return Make(v, &Backend::act_dtype); }
  Pair Weight(const std::vector<float>& v) { return Make(v, &Backend::weight_dtype); }
  Pair Grad(const std::vector<float>& v) { return Make(v, &Backend::grad_dtype); }
  Pair Stat(const std::vector<float>& v) { return Make(v, &Backend::stat_dtype); }
  IntPair Int(const std::vector<int32_t>& v) { return IntPair(cpu_.get(), gpu_.get(), v); }

  // The two ways the grouped matmuls learn the experts' row counts: read back from the
  // device in each call, or the caller's host copy (the pipeline's).
  struct ExpertMode {
    const char* name;
    bool host_offsets;
  };
  static constexpr ExpertMode kExpertModes[] = {{"offsets read back", false},
                                                {"host offsets", true}};
  static ExpertOffsets OffsetsFor(const ExpertMode& mode, const IntPair& offsets,
                                  const std::vector<int32_t>& host, bool on_cpu) {
    return ExpertOffsets{offsets.P(on_cpu), !on_cpu && mode.host_offsets ? host.data() : nullptr};
  }

 private:
  Pair Make(const std::vector<float>& v, DType (Backend::*role)() const) {
    return Pair(cpu_.get(), gpu_.get(), (cpu_.get()->*role)(), (gpu_.get()->*role)(), v);
  }
};

// ---- router ----

struct RouteShape {
  int64_t n, E, k;
  bool renorm, aux;
};

class MoeRouteKernels : public MoeKernels, public ::testing::WithParamInterface<RouteShape> {};

// Top-k with ties, then the backward from each backend's own routing (the same choices).
TEST_P(MoeRouteKernels, RouteAndBackwardMatchTheReference) {
  const RouteShape a = GetParam();
  Pair logits = Act(RouterLogits(a.n, a.E, 1)), probs = Stat(std::vector<float>(a.n * a.E)),
       w = Stat(std::vector<float>(a.n * a.k)), dw = Stat(RandomBf16(a.n * a.k, 2)),
       dlogits = Act(std::vector<float>(a.n * a.E));
  IntPair idx = Int(std::vector<int32_t>(a.n * a.k, -1));
  std::vector<int32_t> count_values(a.E);
  for (int64_t e = 0; e < a.E; ++e) count_values[e] = static_cast<int32_t>((e * 37) % 101);
  IntPair counts = Int(count_values);
  Both([&](Backend* b, bool c) {
    b->MoeRoute(probs.P(c), idx.P(c), w.P(c), logits.P(c), a.n, a.E, a.k, a.renorm, kS);
    b->MoeRouteBackward(dlogits.P(c), probs.P(c), idx.P(c), w.P(c), dw.P(c),
                        a.aux ? counts.P(c) : nullptr, 1e-3, a.n, a.E, a.k, a.renorm, kS);
  });
  EXPECT_EQ(idx.Gpu(), idx.Cpu());
  EXPECT_LT(probs.Err(), 1e-5);
  EXPECT_LT(w.Err(), 1e-5);
  EXPECT_LT(dlogits.Err(), 1e-2);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, MoeRouteKernels,
    ::testing::Values(RouteShape{77, 8, 2, true, true}, RouteShape{1000, 128, 8, true, false},
                      RouteShape{33, 256, 1, false, true}, RouteShape{300, 60, 4, false, false},
                      RouteShape{5, 128, 8, false, true}, RouteShape{130, 64, 8, true, true}),
    [](const ::testing::TestParamInfo<RouteShape>& info) {
      const RouteShape& a = info.param;
      return "n" + std::to_string(a.n) + "_E" + std::to_string(a.E) + "_k" + std::to_string(a.k) +
             (a.renorm ? "_renorm" : "") + (a.aux ? "_aux" : "");
    });

// Counts exactly, probability sums within fp32 rounding; both added to what was there.
TEST_F(MoeKernels, RouterStatsAddCountsAndProbabilitySums) {
  for (const auto& [n, E, k] :
       {std::array<int64_t, 3>{77, 8, 2}, std::array<int64_t, 3>{5000, 128, 8},
        std::array<int64_t, 3>{100003, 64, 4}}) {
    std::vector<float> logits = RouterLogits(n, E, 3), p(n * E), w(n * k);
    std::vector<int32_t> idx(n * k);
    ref::MoeRoute<float, float>(p.data(), idx.data(), w.data(), logits.data(), n, E, k, true);
    Pair probs = Stat(p), prob_sum = Stat(RandomBf16(E, 4, 1.0f, 10.0f));
    IntPair choices = Int(idx), counts = Int(std::vector<int32_t>(E, 5));
    Both([&](Backend* b, bool c) {
      b->MoeRouterStats(counts.P(c), prob_sum.P(c), probs.P(c), choices.P(c), n, E, k, kS);
    });
    EXPECT_EQ(counts.Gpu(), counts.Cpu()) << n;
    EXPECT_LT(prob_sum.Err(), 2e-5) << n;
  }
}

// ---- sort ----

struct SortShape {
  int64_t n, E, k, empty;  // empty: an expert that no token chooses
};

class MoeSortKernels : public MoeKernels, public ::testing::WithParamInterface<SortShape> {};

// Offsets, slots and row tokens equal the reference's stable counting sort: across tile
// boundaries, with an expert of no rows, and with one expert taking most entries.
TEST_P(MoeSortKernels, SortIsTheReferencePermutation) {
  const SortShape a = GetParam();
  const int64_t R = a.n * a.k;
  const std::vector<int32_t> choices = RandomChoices(
      a.n, a.E, a.k, a.empty >= 0 ? std::vector<int64_t>{a.empty} : std::vector<int64_t>{}, 5);
  IntPair idx = Int(choices), offsets = Int(std::vector<int32_t>(a.E + 1, -7)),
          slot_of = Int(std::vector<int32_t>(R, -7)), row_token = Int(std::vector<int32_t>(R, -7)),
          scratch = Int(std::vector<int32_t>(MoeSortScratchInts(R, a.E), -7));
  Both([&](Backend* b, bool c) {
    b->MoeSort(offsets.P(c), slot_of.P(c), row_token.P(c), scratch.P(c), idx.P(c), a.n, a.E, a.k,
               kS);
  });
  const std::vector<int32_t> off = offsets.Gpu();
  EXPECT_EQ(off, offsets.Cpu());
  EXPECT_EQ(slot_of.Gpu(), slot_of.Cpu());
  EXPECT_EQ(row_token.Gpu(), row_token.Cpu());
  EXPECT_EQ(off[a.E], R);
  if (a.empty >= 0) {
    EXPECT_EQ(off[a.empty], off[a.empty + 1]);
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, MoeSortKernels,
                         ::testing::Values(SortShape{1000, 8, 2, 3}, SortShape{3001, 128, 8, 0},
                                           SortShape{37, 128, 1, 127}, SortShape{5000, 8, 1, -1},
                                           SortShape{2048, 16, 2, 15},
                                           SortShape{70001, 256, 8, 100}),
                         [](const ::testing::TestParamInfo<SortShape>& info) {
                           const SortShape& a = info.param;
                           return "n" + std::to_string(a.n) + "_E" + std::to_string(a.E) + "_k" +
                                  std::to_string(a.k);
                         });

TEST_F(MoeKernels, SortOfNoTokensWritesZeroOffsets) {
  const int64_t E = 8, k = 2;
  IntPair idx = Int({}), offsets = Int(std::vector<int32_t>(E + 1, -7)), slot_of = Int({}),
          row_token = Int({}), scratch = Int({});
  Both([&](Backend* b, bool c) {
    b->MoeSort(offsets.P(c), slot_of.P(c), row_token.P(c), scratch.P(c), idx.P(c), 0, E, k, kS);
  });
  EXPECT_EQ(offsets.Gpu(), std::vector<int32_t>(E + 1, 0));
  EXPECT_EQ(offsets.Cpu(), std::vector<int32_t>(E + 1, 0));
}

// ---- gather and combine ----

struct PermuteShape {
  int64_t n, E, k, C;
};

class MoePermuteKernels : public MoeKernels, public ::testing::WithParamInterface<PermuteShape> {};

// Gather (a copy: exact), its backward, the combine into a non-zero output and its backward,
// over the reference's permutation of random choices (expert 1 gets no rows).
TEST_P(MoePermuteKernels, GatherAndCombineForwardAndBackward) {
  const PermuteShape a = GetParam();
  const int64_t R = a.n * a.k;
  const Permutation perm = SortOnHost(RandomChoices(a.n, a.E, a.k, {1}, 6), a.n, a.E, a.k);
  IntPair slot_of = Int(perm.slot_of), row_token = Int(perm.row_token);
  Pair h = Act(RandomBf16(a.n * a.C, 7)), xe = Act(std::vector<float>(R * a.C)),
       dxe = Act(RandomBf16(R * a.C, 8)), dh = Act(RandomBf16(a.n * a.C, 9)),
       ye = Act(RandomBf16(R * a.C, 10)), w = Stat(RandomWeights(a.n, a.k, 11)),
       out = Act(RandomBf16(a.n * a.C, 12)), dout = Act(RandomBf16(a.n * a.C, 13)),
       dye = Act(RandomBf16(R * a.C, 14)), dw = Stat(RandomBf16(a.n * a.k, 15));
  Both([&](Backend* b, bool c) {
    b->Embedding(xe.P(c), row_token.P(c), h.P(c), R, a.C, kS);  // the gather
    b->MoeGatherBackward(dh.P(c), dxe.P(c), slot_of.P(c), a.n, a.k, a.C, kS);
    b->MoeCombine(out.P(c), ye.P(c), slot_of.P(c), w.P(c), a.n, a.k, a.C, kS);
    b->MoeCombineBackward(dye.P(c), dw.P(c), dout.P(c), ye.P(c), slot_of.P(c), w.P(c), a.n, a.k,
                          a.C, kS);
  });
  EXPECT_EQ(xe.Err(), 0.0);
  EXPECT_LT(dh.Err(), 1e-2);
  EXPECT_LT(out.Err(), 1e-2);
  EXPECT_LT(dye.Err(), 1e-2);
  EXPECT_LT(dw.Err(), 1e-4);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, MoePermuteKernels,
    ::testing::Values(PermuteShape{300, 8, 2, 64}, PermuteShape{129, 128, 8, 2048},
                      PermuteShape{77, 8, 1, 100}, PermuteShape{1000, 128, 8, 64},
                      PermuteShape{61, 16, 4, 5120}, PermuteShape{45, 8, 3, 13}),
    [](const ::testing::TestParamInfo<PermuteShape>& info) {
      const PermuteShape& a = info.param;
      return "n" + std::to_string(a.n) + "_E" + std::to_string(a.E) + "_k" + std::to_string(a.k) +
             "_C" + std::to_string(a.C);
    });

// ---- grouped linear ----

// Per-expert matmuls over the sorted rows; the first expert and one in the middle get no
// rows (their weight gradients stay as they were, bit for bit).
TEST_F(MoeKernels, GroupedLinearForwardAndBackwardSkipExpertsWithoutRows) {
  for (const ExpertMode& mode : kExpertModes)
  for (const auto& [n, E, k, IC, OC] :
       {std::array<int64_t, 5>{300, 8, 2, 64, 96}, std::array<int64_t, 5>{211, 16, 4, 128, 256},
        std::array<int64_t, 5>{40, 8, 1, 2048, 64}}) {
    const int64_t R = n * k, mid = E / 2;
    const std::vector<int32_t> choices = RandomChoices(n, E, k, {0, mid}, 16);
    const Permutation perm = SortOnHost(choices, n, E, k);
    ASSERT_EQ(perm.offsets[1], 0);
    ASSERT_EQ(perm.offsets[mid], perm.offsets[mid + 1]);
    SCOPED_TRACE(mode.name);
    IntPair offsets = Int(perm.offsets);
    const std::vector<float> dW0 = RandomBf16(E * OC * IC, 17);
    Pair in = Act(RandomBf16(R * IC, 18)), W = Weight(RandomBf16(E * OC * IC, 19, 0.1f)),
         out = Act(RandomBf16(R * OC, 20)), dout = Act(RandomBf16(R * OC, 21)),
         din = Act(RandomBf16(R * IC, 22)), dW = Grad(dW0);
    Both([&](Backend* b, bool c) {
      const ExpertOffsets o = OffsetsFor(mode, offsets, perm.offsets, c);
      b->GroupedLinear(out.P(c), in.P(c), W.P(c), nullptr, o, E, IC, OC, false, kS);
      b->GroupedLinearBackward(din.P(c), dW.P(c), nullptr, dout.P(c), in.P(c), W.P(c), o, E, IC,
                               OC, false, kS);
    });
    EXPECT_LT(out.Err(), 8e-3) << E;
    EXPECT_LT(din.Err(), 8e-3) << E;
    EXPECT_LT(dW.Err(), 1e-4) << E;
    const std::vector<float> got = dW.Gpu();
    for (int64_t e : {int64_t{0}, mid}) {
      EXPECT_TRUE(std::equal(got.begin() + e * OC * IC, got.begin() + (e + 1) * OC * IC,
                             dW0.begin() + e * OC * IC))
          << "expert " << e << " of " << E << " has no rows";
    }
  }
}

// The experts' matmuls choose an algorithm per bucket of row counts (powers of two up to
// 128, then eighths of an octave) and run it at the expert's own count: counts at, just
// below and just above buckets' edges, from 1 row to 5000, each expert against the
// reference, both weight orders.
TEST_F(MoeKernels, GroupedLinearMatchesTheReferenceAtEveryRowCountBucket) {
  const std::vector<int32_t> counts = {1,   15,   16,   17,   100,  129,  144,  145,
                                       1000, 1023, 1025, 2048, 3000, 4095, 4097, 5000};
  const int64_t E = static_cast<int64_t>(counts.size()), IC = 136, OC = 200;
  std::vector<int32_t> off(E + 1, 0);
  for (int64_t e = 0; e < E; ++e) off[e + 1] = off[e] + counts[e];
  const int64_t R = off[E];
  for (bool in_major : {false, true}) {
    SCOPED_TRACE(in_major ? "input-major weights" : "output-major weights");
    IntPair offsets = Int(off);
    const std::vector<float> dW0 = RandomBf16(E * OC * IC, 51);
    Pair in = Act(RandomBf16(R * IC, 52)), W = Weight(RandomBf16(E * OC * IC, 53, 0.1f)),
         out = Act(RandomBf16(R * OC, 54)), dout = Act(RandomBf16(R * OC, 55)),
         din = Act(RandomBf16(R * IC, 56)), dW = Grad(dW0);
    Both([&](Backend* b, bool c) {
      const ExpertOffsets o{offsets.P(c), c ? nullptr : off.data()};
      b->GroupedLinear(out.P(c), in.P(c), W.P(c), nullptr, o, E, IC, OC, in_major, kS);
      b->GroupedLinearBackward(din.P(c), dW.P(c), nullptr, dout.P(c), in.P(c), W.P(c), o, E, IC,
                               OC, in_major, kS);
    });
    const std::vector<float> got[3] = {out.Gpu(), din.Gpu(), dW.Gpu()},
                             want[3] = {out.Cpu(), din.Cpu(), dW.Cpu()};
    const int64_t width[3] = {OC, IC, OC * IC};
    for (int64_t e = 0; e < E; ++e) {
      for (int t = 0; t < 3; ++t) {  // out and din: the expert's rows; dW: its matrix
        const int64_t first = t == 2 ? e : off[e], n = t == 2 ? 1 : counts[e];
        const std::vector<float> g(got[t].begin() + first * width[t],
                                   got[t].begin() + (first + n) * width[t]),
            w(want[t].begin() + first * width[t], want[t].begin() + (first + n) * width[t]);
        EXPECT_LT(RelErr(g, w), t == 2 ? 1e-4 : 8e-3) << "tensor " << t << ", " << counts[e]
                                                      << " rows";
      }
    }
  }
}

struct BiasShape {
  int64_t n, E, k, IC, OC;
  bool last_empty;  // the last expert gets no rows too (else it ends the rows)
};

// Per-expert biases (GPT-OSS's experts) on the vector path (OC % 8 == 0) and the scalar
// one: each expert's bias on its rows, its gradient the column sums of its rows; experts
// without rows (the first, one in the middle, maybe the last) keep their gradients' bits.
// Both weight orders: (E, OC, IC), and GPT-OSS's input-major (E, IC, OC); and frozen experts
// (no weight gradient).
TEST_F(MoeKernels, GroupedLinearWithBiasAddsAndSumsEachExpertsRows) {
  for (const ExpertMode& mode : kExpertModes)
  for (bool in_major : {false, true})
  for (const BiasShape& a :
       {BiasShape{300, 8, 2, 64, 96, false}, BiasShape{211, 16, 4, 128, 256, true},
        BiasShape{97, 8, 3, 40, 90, false}, BiasShape{50, 6, 1, 24, 36, true}}) {
    SCOPED_TRACE(mode.name);
    SCOPED_TRACE(in_major ? "input-major weights" : "output-major weights");
    const int64_t E = a.E, IC = a.IC, OC = a.OC, R = a.n * a.k, mid = E / 2;
    std::vector<int64_t> empty = {0, mid};
    if (a.last_empty) empty.push_back(E - 1);
    const Permutation perm = SortOnHost(RandomChoices(a.n, E, a.k, empty, 30), a.n, E, a.k);
    ASSERT_EQ(perm.offsets[E - 1] == perm.offsets[E], a.last_empty);
    IntPair offsets = Int(perm.offsets);
    const std::vector<float> dW0 = RandomBf16(E * OC * IC, 31), db0 = RandomBf16(E * OC, 32);
    Pair in = Act(RandomBf16(R * IC, 33)), W = Weight(RandomBf16(E * OC * IC, 34, 0.1f)),
         bias = Weight(RandomBf16(E * OC, 35)), out = Act(RandomBf16(R * OC, 36)),
         dout = Act(RandomBf16(R * OC, 37)), din = Act(RandomBf16(R * IC, 38)), dW = Grad(dW0),
         dbias = Grad(db0);
    Both([&](Backend* b, bool c) {
      const ExpertOffsets o = OffsetsFor(mode, offsets, perm.offsets, c);
      b->GroupedLinear(out.P(c), in.P(c), W.P(c), bias.P(c), o, E, IC, OC, in_major, kS);
      b->GroupedLinearBackward(din.P(c), dW.P(c), dbias.P(c), dout.P(c), in.P(c), W.P(c), o, E,
                               IC, OC, in_major, kS);
    });
    EXPECT_LT(out.Err(), 8e-3) << OC;
    EXPECT_LT(din.Err(), 8e-3) << OC;
    EXPECT_LT(dW.Err(), 1e-4) << OC;
    EXPECT_LT(dbias.Err(), 1e-4) << OC;
    // Frozen experts (a null dW): the input and bias gradients all the same.
    Pair din2 = Act(RandomBf16(R * IC, 38)), dbias2 = Grad(db0);
    Both([&](Backend* b, bool c) {
      const ExpertOffsets o = OffsetsFor(mode, offsets, perm.offsets, c);
      b->GroupedLinearBackward(din2.P(c), nullptr, dbias2.P(c), dout.P(c), in.P(c), W.P(c), o, E,
                               IC, OC, in_major, kS);
    });
    EXPECT_LT(din2.Err(), 8e-3) << OC << ", frozen";
    EXPECT_LT(dbias2.Err(), 1e-4) << OC << ", frozen";
    const std::vector<float> got = dbias.Gpu();
    for (int64_t e : empty) {
      EXPECT_TRUE(std::equal(got.begin() + e * OC, got.begin() + (e + 1) * OC,
                             db0.begin() + e * OC))
          << "expert " << e << " of " << E << " has no rows";
    }
  }
}

// LoRA beside the experts' projections, rank 8: cuBLASLt per expert against the CPU
// reference over uneven experts (one row, many, none); the expert without rows keeps its
// dA and dB bits.
TEST_F(MoeKernels, GroupedLoraForwardAndBackwardMatchTheReferenceOnEachExpertsRows) {
  const int64_t E = 5, IC = 96, OC = 160, r = 8, empty = 1;
  const double scale = 2.0;
  const std::vector<int32_t> off = {0, 37, 37, 42, 162, 163};
  const int64_t R = off[E];
  for (const ExpertMode& mode : kExpertModes) {
    SCOPED_TRACE(mode.name);
    IntPair offsets = Int(off);
    const std::vector<float> dA0 = RandomBf16(E * r * IC, 71), dB0 = RandomBf16(E * OC * r, 72);
    Pair x = Act(RandomBf16(R * IC, 73)), A = Weight(RandomBf16(E * r * IC, 74, 0.1f)),
         B = Weight(RandomBf16(E * OC * r, 75, 0.1f)), y = Act(RandomBf16(R * OC, 76)),
         t = Act(std::vector<float>(R * r)), dt = Act(std::vector<float>(R * r)),
         dy = Act(RandomBf16(R * OC, 77)), dx = Act(RandomBf16(R * IC, 78)), dA = Grad(dA0),
         dB = Grad(dB0);
    Both([&](Backend* b, bool c) {
      const ExpertOffsets o = OffsetsFor(mode, offsets, off, c);
      b->GroupedLoraForward(y.P(c), t.P(c), x.P(c), A.P(c), B.P(c), o, E, IC, OC, r, scale, kS);
      b->GroupedLoraBackward(dx.P(c), dA.P(c), dB.P(c), t.P(c), dt.P(c), dy.P(c), x.P(c), A.P(c),
                             B.P(c), o, E, IC, OC, r, scale, kS);
    });
    EXPECT_LT(y.Err(), 8e-3);
    EXPECT_LT(t.Err(), 8e-3);
    EXPECT_LT(dt.Err(), 8e-3);
    EXPECT_LT(dx.Err(), 8e-3);
    EXPECT_LT(dA.Err(), 8e-3);
    EXPECT_LT(dB.Err(), 8e-3);
    const std::vector<float> got_dA = dA.Gpu(), got_dB = dB.Gpu();
    EXPECT_TRUE(std::equal(got_dA.begin() + empty * r * IC, got_dA.begin() + (empty + 1) * r * IC,
                           dA0.begin() + empty * r * IC))
        << "dA of the expert without rows";
    EXPECT_TRUE(std::equal(got_dB.begin() + empty * OC * r, got_dB.begin() + (empty + 1) * OC * r,
                           dB0.begin() + empty * OC * r))
        << "dB of the expert without rows";
  }
}

// ---- determinism ----

// The experts' matmuls and biases over many rows and blocks (GPT-OSS-120B's 128 experts,
// top-4), with the offsets read back and given: three runs give the same forward, input
// gradient, weight gradient and bias gradient bits.
TEST_F(MoeKernels, GroupedLinearAndBiasAreTheSameBitsOnEveryRun) {
  const int64_t n = 20000, E = 128, k = 4, R = n * k, IC = 64, OC = 576;
  const Permutation perm = SortOnHost(RandomChoices(n, E, k, {5}, 39), n, E, k);
  for (const ExpertMode& mode : kExpertModes) {
    SCOPED_TRACE(mode.name);
    Backend* g = gpu_.get();
    DeviceBuffer offsets = UploadInts(g, perm.offsets),
                 in = Upload(g, DType::kBF16, RandomBf16(R * IC, 40)),
                 W = Upload(g, DType::kBF16, RandomBf16(E * OC * IC, 41, 0.1f)),
                 bias = Upload(g, DType::kBF16, RandomBf16(E * OC, 42)),
                 dout = Upload(g, DType::kBF16, RandomBf16(R * OC, 43));
    const ExpertOffsets o{static_cast<const int32_t*>(offsets.get()),
                          mode.host_offsets ? perm.offsets.data() : nullptr};
    std::vector<std::vector<float>> runs[4];  // out, din, dW, dbias
    for (int run = 0; run < 3; ++run) {
      DeviceBuffer out = Upload(g, DType::kBF16, std::vector<float>(R * OC)),
                   din = Upload(g, DType::kBF16, std::vector<float>(R * IC)),
                   dW = Upload(g, DType::kF32, RandomBf16(E * OC * IC, 45)),
                   dbias = Upload(g, DType::kF32, RandomBf16(E * OC, 44));
      g->GroupedLinear(out.get(), in.get(), W.get(), bias.get(), o, E, IC, OC, false, kS);
      g->GroupedLinearBackward(din.get(), dW.get(), dbias.get(), dout.get(), in.get(), W.get(), o,
                               E, IC, OC, false, kS);
      runs[0].push_back(Download(g, DType::kBF16, out, R * OC));
      runs[1].push_back(Download(g, DType::kBF16, din, R * IC));
      runs[2].push_back(Download(g, DType::kF32, dW, E * OC * IC));
      runs[3].push_back(Download(g, DType::kF32, dbias, E * OC));
    }
    const char* names[4] = {"out", "din", "dW", "dbias"};
    for (int t = 0; t < 4; ++t) {
      for (int run = 1; run < 3; ++run) {
        EXPECT_TRUE(runs[t][run] == runs[t][0]) << names[t] << ", run " << run;
      }
    }
  }
}

// The sort, the router statistics and the combine's backward over many tiles and blocks:
// three runs give the same bits.
TEST_F(MoeKernels, SortStatsAndCombineBackwardAreTheSameBitsOnEveryRun) {
  Backend* g = gpu_.get();
  const int64_t n = 20000, E = 128, k = 8, R = n * k;
  std::vector<float> logits = RouterLogits(n, E, 23), p(n * E), wv(n * k);
  std::vector<int32_t> choices(R);
  ref::MoeRoute<float, float>(p.data(), choices.data(), wv.data(), logits.data(), n, E, k, true);
  DeviceBuffer idx = UploadInts(g, choices), probs = Upload(g, DType::kF32, p),
               scratch = UploadInts(g, std::vector<int32_t>(MoeSortScratchInts(R, E)));
  const int64_t cn = 2053, ck = 8, C = 1024, cR = cn * ck;
  const Permutation perm = SortOnHost(RandomChoices(cn, E, ck, {}, 24), cn, E, ck);
  DeviceBuffer slot_of = UploadInts(g, perm.slot_of),
               w = Upload(g, DType::kF32, RandomWeights(cn, ck, 25)),
               dout = Upload(g, DType::kBF16, RandomBf16(cn * C, 26)),
               ye = Upload(g, DType::kBF16, RandomBf16(cR * C, 27));
  std::vector<std::vector<int32_t>> sorts, counts;
  std::vector<std::vector<float>> sums, dws, dyes;
  for (int run = 0; run < 3; ++run) {
    DeviceBuffer offsets = UploadInts(g, std::vector<int32_t>(E + 1)),
                 slots = UploadInts(g, std::vector<int32_t>(R)),
                 rows = UploadInts(g, std::vector<int32_t>(R)),
                 cnt = UploadInts(g, std::vector<int32_t>(E)),
                 sum = Upload(g, DType::kF32, std::vector<float>(E)),
                 dw = Upload(g, DType::kF32, std::vector<float>(cn * ck)),
                 dye = Upload(g, DType::kBF16, std::vector<float>(cR * C));
    auto I = [](DeviceBuffer& b) { return static_cast<int32_t*>(b.get()); };
    g->MoeSort(I(offsets), I(slots), I(rows), I(scratch), I(idx), n, E, k, kS);
    g->MoeRouterStats(I(cnt), sum.get(), probs.get(), I(idx), n, E, k, kS);
    g->MoeCombineBackward(dye.get(), dw.get(), dout.get(), ye.get(), I(slot_of), w.get(), cn, ck, C,
                          kS);
    std::vector<int32_t> sort = DownloadInts(g, offsets, E + 1), s = DownloadInts(g, slots, R),
                         r = DownloadInts(g, rows, R);
    sort.insert(sort.end(), s.begin(), s.end());
    sort.insert(sort.end(), r.begin(), r.end());
    sorts.push_back(sort);
    counts.push_back(DownloadInts(g, cnt, E));
    sums.push_back(Download(g, DType::kF32, sum, E));
    dws.push_back(Download(g, DType::kF32, dw, cn * ck));
    dyes.push_back(Download(g, DType::kBF16, dye, cR * C));
  }
  for (int run = 1; run < 3; ++run) {
    EXPECT_TRUE(sorts[run] == sorts[0]) << "sort, run " << run;
    EXPECT_TRUE(counts[run] == counts[0]) << "counts, run " << run;
    EXPECT_TRUE(sums[run] == sums[0]) << "probability sums, run " << run;
    EXPECT_TRUE(dws[run] == dws[0]) << "dw, run " << run;
    EXPECT_TRUE(dyes[run] == dyes[0]) << "dye, run " << run;
  }
}

}  // namespace
}  // namespace megatrain::testing
