// Every CUDA op against the CPU backend on fresh random inputs, within bf16 tolerances.
// Inputs are bf16-exact, so the two differ only by the GPU's bf16 intermediate rounding.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>

#include "engine/common/engine_settings.h"
#include "engine/layers/batch.h"
#include "gtest/gtest.h"
#include "tests/engine/optim/backend_adamw_check.h"
#include "tests/gpu/gpu_util.h"
#if MEGATRAIN_TEST_CUDA_OPS
#include "engine/kernels/cuda/ops.h"
#endif

namespace megatrain::testing {
namespace {

// Runs `op` on both backends over the same inputs and compares the named outputs.
struct Pair {
  Backend* cpu;
  Backend* gpu;
  DeviceBuffer c, g;
  DType ct, gt;
  size_t n;
  Pair(Backend* cb, Backend* gb, DType ctype, DType gtype, const std::vector<float>& v)
      : cpu(cb), gpu(gb), c(Upload(cb, ctype, v)), g(Upload(gb, gtype, v)), ct(ctype), gt(gtype),
        n(v.size()) {}
  double Err() const { return RelErr(Download(gpu, gt, g, n), Download(cpu, ct, c, n)); }
};

class Kernels : public GpuTest {
 protected:
  Pair Act(const std::vector<float>& v) { return Pair(cpu_.get(), gpu_.get(), cpu_->act_dtype(), gpu_->act_dtype(), v); }
  Pair Weight(const std::vector<float>& v) { return Pair(cpu_.get(), gpu_.get(), cpu_->weight_dtype(), gpu_->weight_dtype(), v); }
  Pair Grad(const std::vector<float>& v) { return Pair(cpu_.get(), gpu_.get(), cpu_->grad_dtype(), gpu_->grad_dtype(), v); }
  Pair Stat(size_t n) { return Pair(cpu_.get(), gpu_.get(), cpu_->stat_dtype(), gpu_->stat_dtype(), std::vector<float>(n, 0.0f)); }
  struct Ints {
    DeviceBuffer c, g;
  };
  Ints Int(const std::vector<int32_t>& v) { return Ints{UploadInts(cpu_.get(), v), UploadInts(gpu_.get(), v)}; }

  // Attention's outputs o, lse, dq, dk, dv, dsinks over (n, H, KV, D) tokens and heads;
  // dsinks starts at dsinks0 (the backward adds to it).
  using AttentionOutputs = std::array<Pair, 6>;
  AttentionOutputs NewAttentionOutputs(int64_t n, int64_t H, int64_t KV, int64_t D,
                                       const std::vector<float>& dsinks0) {
    return AttentionOutputs{Act(std::vector<float>(n * H * D)),  Stat(n * H),
                            Act(std::vector<float>(n * H * D)),  Act(std::vector<float>(n * KV * D)),
                            Act(std::vector<float>(n * KV * D)), Grad(dsinks0)};
  }
  // Attention forward and backward on one backend (c: the CPU's buffers) into `out`;
  // sinks null: none.
  static void RunAttention(AttentionOutputs& out, Backend* b, bool c, Pair& q, Pair& k, Pair& v,
                           Pair& dout, Pair* sinks, const Ints& docs, int64_t window, int64_t n,
                           int64_t H, int64_t KV, int64_t D) {
    auto P = [&](Pair& x) { return c ? x.c.get() : x.g.get(); };
    const int32_t* ds = static_cast<const int32_t*>(c ? docs.c.get() : docs.g.get());
    const void* sk = sinks != nullptr ? P(*sinks) : nullptr;
    void* dsk = sinks != nullptr ? P(out[5]) : nullptr;
    b->Attention(P(out[0]), P(out[1]), P(q), P(k), P(v), ds, sk, window, n, H, KV, D,
                 StreamId::kCompute);
    b->AttentionBackward(P(out[2]), P(out[3]), P(out[4]), dsk, P(dout), P(q), P(k), P(v),
                         P(out[0]), P(out[1]), ds, sk, window, n, H, KV, D, StreamId::kCompute);
  }
};

static std::vector<int32_t> DocStarts(int64_t n, std::vector<int64_t> starts) {
  std::vector<int32_t> d(n);
  int64_t cur = 0;
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t s : starts) if (i >= s) cur = s;
    d[i] = static_cast<int32_t>(cur);
  }
  return d;
}

// The backward adds each token's rows in TokenOrder, in position order: the reference's
// sums, bit for bit. Long runs of one token cross the 32-position end search and the
// 4-row loads.
// The fp32 master's upload (a store without a bf16 copy): rounded on the device to the bits
// FloatToBf16 gives on the host, through the staging buffer's two halves (the first upload
// spans three chunks, the third reusing the first half once its rounding is done, the last
// partial and not a multiple of 8; the second starts in the other half), with copies
// queued on the compute stream beside them (the roundings run on a stream of their own; the
// copies take about a millisecond, so they overlap the first chunks only).
TEST_F(Kernels, UploadWeightsFromF32RoundsAsTheHostDoes) {
  const int64_t half = gpu_->f32_upload_staging_bytes() / 2 / 4;
  ASSERT_GT(half, 0);
  for (const int64_t n : {2 * half + 12345, half / 2 + 7}) {
    std::vector<float> master(n);
    for (int64_t i = 0; i < n; ++i) {  // values of every size, most of them not bf16
      const uint32_t h = static_cast<uint32_t>(i) * 2654435761u;
      master[i] = (static_cast<float>(h >> 8) / 16777216.0f - 0.5f) * 0.04f *
                  static_cast<float>(1 + (h & 7));
    }
    std::vector<uint16_t> bits(n);
    for (int64_t i = 0; i < n; ++i) bits[i] = FloatToBf16(master[i]);
    absl::StatusOr<DeviceBuffer> a = DeviceBuffer::Allocate(gpu_.get(), n * 2);
    absl::StatusOr<DeviceBuffer> b = DeviceBuffer::Allocate(gpu_.get(), n * 2);
    absl::StatusOr<DeviceBuffer> c = DeviceBuffer::Allocate(gpu_.get(), n * 2);
    absl::StatusOr<DeviceBuffer> busy = DeviceBuffer::Allocate(gpu_.get(), 256 << 20);
    ASSERT_TRUE(a.ok() && b.ok() && c.ok() && busy.ok());
    ASSERT_TRUE(gpu_->PinHostRange(master.data(), n * 4).ok());
    for (int i = 0; i < 8; ++i) {  // the compute stream's copies, beside the upload
      gpu_->CopyOnDevice(busy->get(), static_cast<char*>(busy->get()) + (128 << 20), 128 << 20,
                         StreamId::kCompute);
    }
    gpu_->UploadWeightsFromF32(a->get(), master.data(), n, StreamId::kH2D);
    // What follows on the stream sees the rounded weights: a copy of them, in stream order.
    gpu_->CopyOnDevice(c->get(), a->get(), n * 2, StreamId::kH2D);
    gpu_->UploadWeights(b->get(), bits.data(), n, StreamId::kH2D);
    gpu_->SyncAll();
    gpu_->UnpinHostRange(master.data());
    const auto expected = Download(gpu_.get(), DType::kBF16, *b, n);
    EXPECT_TRUE(Download(gpu_.get(), DType::kBF16, *a, n) == expected) << n << " elements";
    EXPECT_TRUE(Download(gpu_.get(), DType::kBF16, *c, n) == expected) << n << " elements";
  }
}

TEST_F(Kernels, EmbeddingForwardAndBackward) {
  for (const auto& [n, C, V] : {std::array<int64_t, 3>{300, 136, 50},
                                std::array<int64_t, 3>{5000, 64, 3},
                                std::array<int64_t, 3>{777, 90, 1000}}) {
    std::vector<int32_t> tok(n), order(n);
    for (int64_t i = 0; i < n; ++i) tok[i] = static_cast<int32_t>((i * 7919) % V);
    TokenOrder(tok.data(), n, order.data());
    Ints t = Int(tok), o = Int(order);
    Pair table = Weight(RandomBf16(V * C, 1)), out = Act(std::vector<float>(n * C)),
         dout = Act(RandomBf16(n * C, 2)), dtable = Grad(RandomBf16(V * C, 3));
    Both([&](Backend* b, bool c) {
      auto I = [c](Ints& x) { return static_cast<int32_t*>(c ? x.c.get() : x.g.get()); };
      b->Embedding(c ? out.c.get() : out.g.get(), I(t), c ? table.c.get() : table.g.get(), n, C,
                   StreamId::kCompute);
      b->EmbeddingBackward(c ? dtable.c.get() : dtable.g.get(), c ? dout.c.get() : dout.g.get(),
                           I(t), I(o), n, C, StreamId::kCompute);
    });
    EXPECT_EQ(out.Err(), 0.0) << n;
    EXPECT_EQ(dtable.Err(), 0.0) << n;
  }
}

// The weight gradients that sum over every row (bias, RMSNorm, QK-norm) add in a fixed
// order, without atomics: three runs over many rows give the same bits (a grid of many
// blocks, the QK-norm's 1024 among them). The bias's is also checked against the CPU.
TEST_F(Kernels, RowSummedWeightGradientsAreTheSameBitsOnEveryRun) {
  const int64_t N = 20000, IC = 8, OC = 4608, C = 3584, H = 16, KV = 4, D = 128;
  const int64_t QKV = (H + 2 * KV) * D;
  Backend* g = gpu_.get();
  const StreamId s = StreamId::kCompute;
  Pair x = Act(RandomBf16(N * IC, 40)), W = Weight(RandomBf16(OC * IC, 41, 0.1f)),
       dout = Act(RandomBf16(N * OC, 42)), din = Act(std::vector<float>(N * IC));
  DeviceBuffer nx = Upload(g, DType::kBF16, RandomBf16(N * C, 44)),
               nw = Upload(g, DType::kBF16, RandomBf16(C, 45, 0.2f, 1.0f)),
               ndout = Upload(g, DType::kBF16, RandomBf16(N * C, 46)),
               nout = Upload(g, DType::kBF16, std::vector<float>(N * C)),
               ndin = Upload(g, DType::kBF16, std::vector<float>(N * C)),
               nrstd = Upload(g, DType::kF32, std::vector<float>(N));
  std::vector<int32_t> pos(N);
  for (int64_t i = 0; i < N; ++i) pos[i] = static_cast<int32_t>(i % 4096);
  std::vector<float> inv_freq(D / 2);
  for (int64_t j = 0; j < D / 2; ++j) inv_freq[j] = std::pow(10000.0f, -2.0f * j / D);
  DeviceBuffer qkv = Upload(g, DType::kBF16, RandomBf16(N * QKV, 47)),
               qn = Upload(g, DType::kBF16, RandomBf16(D, 48, 0.2f, 1.0f)),
               kn = Upload(g, DType::kBF16, RandomBf16(D, 49, 0.2f, 1.0f)),
               q = Upload(g, DType::kBF16, std::vector<float>(N * H * D)),
               k = Upload(g, DType::kBF16, std::vector<float>(N * KV * D)),
               v = Upload(g, DType::kBF16, std::vector<float>(N * KV * D)),
               rq = Upload(g, DType::kF32, std::vector<float>(N * H)),
               rk = Upload(g, DType::kF32, std::vector<float>(N * KV)),
               dq = Upload(g, DType::kBF16, RandomBf16(N * H * D, 50)),
               dk = Upload(g, DType::kBF16, RandomBf16(N * KV * D, 51)),
               dv = Upload(g, DType::kBF16, RandomBf16(N * KV * D, 52)),
               dqkv = Upload(g, DType::kBF16, std::vector<float>(N * QKV)),
               f = Upload(g, DType::kF32, inv_freq);
  DeviceBuffer ps = UploadInts(g, pos);
  const int32_t* p = static_cast<int32_t*>(ps.get());
  g->RmsNorm(nout.get(), nrstd.get(), nx.get(), nw.get(), N, C, 1e-5, s);
  g->QkvPrepare(q.get(), k.get(), v.get(), rq.get(), rk.get(), qkv.get(), qn.get(), kn.get(), p,
                static_cast<float*>(f.get()), 1.0f, N, H, KV, D, 1e-6, s);
  std::vector<std::vector<float>> bias, norm, qnorm, knorm;
  for (int run = 0; run < 3; ++run) {
    Pair dW = Grad(std::vector<float>(OC * IC)), db = Grad(RandomBf16(OC, 43));
    Both([&](Backend* b, bool c) {
      auto P = [c](Pair& p) { return c ? p.c.get() : p.g.get(); };
      b->LinearBackward(P(din), false, P(dW), P(db), P(dout), P(x), P(W), N, IC, OC, s);
    });
    EXPECT_LT(db.Err(), 1e-4);
    bias.push_back(Download(g, DType::kF32, db.g, OC));
    DeviceBuffer dw = Upload(g, DType::kF32, RandomBf16(C, 53)),
                 dqn = Upload(g, DType::kF32, std::vector<float>(D)),
                 dkn = Upload(g, DType::kF32, std::vector<float>(D));
    g->RmsNormBackward(ndin.get(), dw.get(), ndout.get(), nx.get(), nw.get(), nrstd.get(), N, C,
                       s);
    g->QkvPrepareBackward(dqkv.get(), dqn.get(), dkn.get(), dq.get(), dk.get(), dv.get(),
                          qkv.get(), qn.get(), kn.get(), rq.get(), rk.get(), p,
                          static_cast<float*>(f.get()), 1.0f, N, H, KV, D, 1e-6, s);
    g->SyncAll();
    norm.push_back(Download(g, DType::kF32, dw, C));
    qnorm.push_back(Download(g, DType::kF32, dqn, D));
    knorm.push_back(Download(g, DType::kF32, dkn, D));
  }
  for (int run = 1; run < 3; ++run) {
    EXPECT_TRUE(bias[run] == bias[0]) << "bias, run " << run;
    EXPECT_TRUE(norm[run] == norm[0]) << "RMSNorm weight, run " << run;
    EXPECT_TRUE(qnorm[run] == qnorm[0]) << "q norm weight, run " << run;
    EXPECT_TRUE(knorm[run] == knorm[0]) << "k norm weight, run " << run;
  }
}

TEST_F(Kernels, RmsNormForwardAndBackward) {
  for (int64_t C : {96, 4096, 1000}) {
    const int64_t rows = 77;
    Pair x = Act(RandomBf16(rows * C, 4)), w = Weight(RandomBf16(C, 5, 0.2f, 1.0f));
    Pair out = Act(std::vector<float>(rows * C)), rstd = Stat(rows);
    Pair dout = Act(RandomBf16(rows * C, 6)), din = Act(RandomBf16(rows * C, 7)),
         dw = Grad(RandomBf16(C, 8));
    Both([&](Backend* b, bool c) {
      auto P = [c](Pair& p) { return c ? p.c.get() : p.g.get(); };
      b->RmsNorm(P(out), P(rstd), P(x), P(w), rows, C, 1e-5, StreamId::kCompute);
      b->RmsNormBackward(P(din), P(dw), P(dout), P(x), P(w), P(rstd), rows, C, StreamId::kCompute);
    });
    EXPECT_LT(out.Err(), 8e-3) << C;
    EXPECT_LT(rstd.Err(), 1e-5) << C;
    EXPECT_LT(din.Err(), 1e-2) << C;
    EXPECT_LT(dw.Err(), 1e-2) << C;
  }
}

TEST_F(Kernels, LinearForwardAndBackwardWithBias) {
  const int64_t N = 130, IC = 96, OC = 200;
  Pair x = Act(RandomBf16(N * IC, 9)), W = Weight(RandomBf16(OC * IC, 10, 0.1f)),
       bias = Weight(RandomBf16(OC, 11)), out = Act(RandomBf16(N * OC, 12)),
       dout = Act(RandomBf16(N * OC, 13)), din = Act(RandomBf16(N * IC, 14)),
       dW = Grad(RandomBf16(OC * IC, 15)), db = Grad(RandomBf16(OC, 16));
  Both([&](Backend* b, bool c) {
    auto P = [c](Pair& p) { return c ? p.c.get() : p.g.get(); };
    b->Linear(P(out), P(x), P(W), P(bias), N, IC, OC, /*accumulate=*/true, StreamId::kCompute);
    b->LinearBackward(P(din), /*din_accumulate=*/true, P(dW), P(db), P(dout), P(x), P(W), N, IC,
                      OC, StreamId::kCompute);
  });
  EXPECT_LT(out.Err(), 8e-3);
  EXPECT_LT(din.Err(), 8e-3);
  EXPECT_LT(dW.Err(), 1e-4);
  EXPECT_LT(db.Err(), 1e-4);
}

// A frozen weight (null dW): din and dbias as with one, nothing else written.
TEST_F(Kernels, LinearBackwardOfAFrozenWeightComputesNoWeightGradient) {
  const int64_t N = 130, IC = 96, OC = 200;
  Pair x = Act(RandomBf16(N * IC, 9)), W = Weight(RandomBf16(OC * IC, 10, 0.1f)),
       dout = Act(RandomBf16(N * OC, 13)), din = Act(RandomBf16(N * IC, 14)),
       db = Grad(RandomBf16(OC, 16));
  Both([&](Backend* b, bool c) {
    auto P = [c](Pair& p) { return c ? p.c.get() : p.g.get(); };
    b->LinearBackward(P(din), /*din_accumulate=*/false, nullptr, P(db), P(dout), P(x), P(W), N,
                      IC, OC, StreamId::kCompute);
  });
  EXPECT_LT(din.Err(), 8e-3);
  EXPECT_LT(db.Err(), 1e-4);
}

// LoRA beside a projection: the q slice of a fused q|k|v output (rows ld apart) and a whole
// output, rank 16, rsLoRA-sized scale: cuBLAS against the CPU reference.
TEST_F(Kernels, LoraForwardAndBackwardOnAColumnSliceAndAWholeOutput) {
  const int64_t N = 130, IC = 96, OC = 200, r = 16;
  for (const int64_t ld : {OC, OC + 72}) {
    const double scale = 32.0 / 4.0;
    Pair x = Act(RandomBf16(N * IC, 61)), A = Weight(RandomBf16(r * IC, 62, 0.1f)),
         B = Weight(RandomBf16(OC * r, 63, 0.1f)), y = Act(RandomBf16(N * ld, 64)),
         t = Act(std::vector<float>(N * r)), dy = Act(RandomBf16(N * ld, 65)),
         dx = Act(RandomBf16(N * IC, 66)), dt = Act(std::vector<float>(N * r)),
         dA = Grad(RandomBf16(r * IC, 67)), dB = Grad(RandomBf16(OC * r, 68));
    Both([&](Backend* b, bool c) {
      auto P = [c](Pair& p) { return c ? p.c.get() : p.g.get(); };
      b->LoraForward(P(y), ld, P(t), P(x), P(A), P(B), N, IC, OC, r, scale, StreamId::kCompute);
      b->LoraBackward(P(dx), P(dA), P(dB), P(t), P(dt), P(dy), ld, P(x), P(A), P(B), N, IC, OC, r,
                      scale, StreamId::kCompute);
    });
    EXPECT_LT(y.Err(), 8e-3) << ld;
    EXPECT_LT(t.Err(), 8e-3) << ld;
    EXPECT_LT(dx.Err(), 8e-3) << ld;
    EXPECT_LT(dA.Err(), 8e-3) << ld;
    EXPECT_LT(dB.Err(), 8e-3) << ld;
  }
}

TEST_F(Kernels, SwiGluForwardAndBackward) {
  const int64_t N = 65, I = 328;
  Pair gu = Act(RandomBf16(N * 2 * I, 17, 2.0f)), out = Act(std::vector<float>(N * I)),
       dout = Act(RandomBf16(N * I, 18)), dgu = Act(std::vector<float>(N * 2 * I));
  Both([&](Backend* b, bool c) {
    auto P = [c](Pair& p) { return c ? p.c.get() : p.g.get(); };
    b->SwiGlu(P(out), P(gu), N, I, StreamId::kCompute);
    b->SwiGluBackward(P(dgu), P(dout), P(gu), N, I, StreamId::kCompute);
  });
  EXPECT_LT(out.Err(), 8e-3);
  EXPECT_LT(dgu.Err(), 8e-3);
}

// GPT-OSS's activation on the vector path (I % 8 == 0) and the scalar one, with the limits
// and their bf16 neighbours (7 +- 1/32) planted among inputs that often pass them: the
// gradient is exactly zero past a limit and flows at it, as on the CPU; a second run on the
// device gives the same bits.
TEST_F(Kernels, ClampedSwiGluForwardAndBackwardAtAndBeyondTheLimits) {
  constexpr double kAlpha = 1.702, kLimit = 7.0;
  const float edges[] = {7.0f, 7.03125f, 6.96875f, -7.0f, -7.03125f, -6.96875f};
  for (const auto& shape : {std::array<int64_t, 2>{65, 328}, std::array<int64_t, 2>{33, 45}}) {
    const int64_t N = shape[0], I = shape[1];
    std::vector<float> x = RandomBf16(N * 2 * I, 54, 5.0f);
    for (int64_t i = 0; i < N * 2 * I; i += 7) x[i] = edges[(i / 7) % 6];
    Pair gu = Act(x), out = Act(std::vector<float>(N * I)), dout = Act(RandomBf16(N * I, 55)),
         dgu = Act(std::vector<float>(N * 2 * I));
    Both([&](Backend* b, bool c) {
      auto P = [c](Pair& p) { return c ? p.c.get() : p.g.get(); };
      b->ClampedSwiGlu(P(out), P(gu), N, I, kAlpha, kLimit, StreamId::kCompute);
      b->ClampedSwiGluBackward(P(dgu), P(dout), P(gu), N, I, kAlpha, kLimit, StreamId::kCompute);
    });
    EXPECT_LT(out.Err(), 8e-3) << I;
    EXPECT_LT(dgu.Err(), 8e-3) << I;
    const std::vector<float> got = Download(gpu_.get(), dgu.gt, dgu.g, dgu.n),
                             want = Download(cpu_.get(), dgu.ct, dgu.c, dgu.n);
    for (int64_t i = 0; i < N * 2 * I; i += 7) {
      const bool is_up = i % 2 == 1;  // interleaved: gate j at 2j, up j at 2j + 1
      const bool blocked = x[i] > kLimit || (is_up && x[i] < -kLimit);
      EXPECT_EQ(got[i] == 0.0f, blocked || want[i] == 0.0f) << "input " << x[i] << " at " << i;
    }
    Pair out2 = Act(std::vector<float>(N * I)), dgu2 = Act(std::vector<float>(N * 2 * I));
    Backend* g = gpu_.get();
    g->ClampedSwiGlu(out2.g.get(), gu.g.get(), N, I, kAlpha, kLimit, StreamId::kCompute);
    g->ClampedSwiGluBackward(dgu2.g.get(), dout.g.get(), gu.g.get(), N, I, kAlpha, kLimit,
                             StreamId::kCompute);
    EXPECT_TRUE(Download(g, out2.gt, out2.g, out2.n) == Download(g, out.gt, out.g, out.n)) << I;
    EXPECT_TRUE(Download(g, dgu2.gt, dgu2.g, dgu2.n) == got) << I;
  }
}

TEST_F(Kernels, CrossEntropyInPlaceWithIgnoredRows) {
  const int64_t N = 37, V = 5003;
  std::vector<int32_t> targets(N);
  for (int64_t i = 0; i < N; ++i) targets[i] = i % 5 == 0 ? -100 : static_cast<int32_t>((i * 131) % V);
  Ints t = Int(targets);
  Pair logits = Act(RandomBf16(N * V, 19, 3.0f)), loss = Stat(N);
  Both([&](Backend* b, bool c) {
    auto P = [c](Pair& p) { return c ? p.c.get() : p.g.get(); };
    b->CrossEntropy(P(logits), P(loss), P(logits), static_cast<int32_t*>(c ? t.c.get() : t.g.get()),
                    N, V, 1.0 / 30, nullptr, StreamId::kCompute);
  });
  EXPECT_LT(loss.Err(), 1e-4);
  EXPECT_LT(logits.Err(), 1e-2);  // now dlogits
}

// A coefficient per row (DPO's per sequence, GRPO's advantages), of either sign, scales
// each row's gradient; the loss is the same as without.
TEST_F(Kernels, CrossEntropyScalesEachRowsGradientByItsCoefficient) {
  const int64_t N = 37, V = 5003;
  std::vector<int32_t> targets(N);
  std::vector<float> coef(N);
  for (int64_t i = 0; i < N; ++i) {
    targets[i] = i % 5 == 0 ? -100 : static_cast<int32_t>((i * 131) % V);
    coef[i] = static_cast<float>((i % 7) - 3) * 0.25f;  // 0 on some rows
  }
  Ints t = Int(targets);
  Pair logits = Act(RandomBf16(N * V, 19, 3.0f)), loss = Stat(N);
  Pair scales(cpu_.get(), gpu_.get(), cpu_->stat_dtype(), gpu_->stat_dtype(), coef);
  Both([&](Backend* b, bool c) {
    auto P = [c](Pair& p) { return c ? p.c.get() : p.g.get(); };
    b->CrossEntropy(P(logits), P(loss), P(logits), static_cast<int32_t*>(c ? t.c.get() : t.g.get()),
                    N, V, 1.0 / 30, P(scales), StreamId::kCompute);
  });
  EXPECT_LT(loss.Err(), 1e-4);
  EXPECT_LT(logits.Err(), 1e-2);  // now dlogits
}

// DPO's per-token coefficients: each sequence's sum over its (scattered) tokens, its
// pair's loss terms, every loss kind; the CUDA kernel against the reference.
TEST_F(Kernels, PreferenceRowScaleMatchesTheReferenceForEveryLoss) {
  const int64_t N = 3001, S = 6;  // three pairs, sequences interleaved with padding
  std::vector<int32_t> sequence(N);
  std::vector<float> values(N);
  for (int64_t i = 0; i < N; ++i) {
    sequence[i] = i % 11 == 0 ? -1 : static_cast<int32_t>((i * 7 / 13) % S);
    values[i] = 0.5f + static_cast<float>((i * 37) % 101) / 40.0f;  // -log p > 0
  }
  std::vector<double> info(S * kPrefFields);
  for (int64_t s = 0; s < S; ++s) {
    double* f = &info[s * kPrefFields];
    f[kPrefRefLogp] = -1200.0 - 30.0 * s;
    f[kPrefTokens] = static_cast<double>(std::count(sequence.begin(), sequence.end(), s));
    f[kPrefPairWeight] = 1.0 / 3;
    f[kPrefNllWeight] = s % 2 == 0 ? 0.25 / 1500 : 0.0;
  }
  Ints seq = Int(sequence);
  DeviceBuffer ic = UploadDoubles(cpu_.get(), info), ig = UploadDoubles(gpu_.get(), info);
  Pair v(cpu_.get(), gpu_.get(), cpu_->stat_dtype(), gpu_->stat_dtype(), values);
  for (const PreferenceLoss kind :
       {PreferenceLoss::kSigmoid, PreferenceLoss::kIpo, PreferenceLoss::kHinge}) {
    Pair scale = Stat(N);
    Both([&](Backend* b, bool c) {
      auto P = [c](Pair& p) { return c ? p.c.get() : p.g.get(); };
      b->PreferenceRowScale(P(scale), P(v), static_cast<int32_t*>(c ? seq.c.get() : seq.g.get()),
                            static_cast<const double*>(c ? ic.get() : ig.get()), N, S, kind, 0.1,
                            kind == PreferenceLoss::kSigmoid ? 0.1 : 0.0, StreamId::kCompute);
    });
    EXPECT_LT(scale.Err(), 1e-6) << static_cast<int>(kind);
  }
}

// The CUDA AdamW (its own IEEE-rounded build) is the host optimizer's, bit for bit: what a
// device-side update of the first layers under clipping must be.
TEST_F(Kernels, AdamWIsTheHostOptimizersBits) {
  testing::ExpectBackendAdamWIsTheHostOptimizers(gpu_.get());
}

struct AttnShape {
  int64_t n, H, KV, D;
  bool qk_norm;
};

class AttentionKernels : public Kernels, public ::testing::WithParamInterface<AttnShape> {};

TEST_P(AttentionKernels, QkvPrepareAndAttentionForwardAndBackward) {
  const AttnShape a = GetParam();
  const int64_t QKV = (a.H + 2 * a.KV) * a.D;
  const std::vector<int32_t> docs = DocStarts(a.n, {0, a.n / 3, a.n / 3 + 1, (2 * a.n) / 3});
  std::vector<int32_t> pos(a.n);
  for (int64_t i = 0; i < a.n; ++i) pos[i] = static_cast<int32_t>(i - docs[i]);
  Ints d = Int(docs), p = Int(pos);
  std::vector<float> inv_freq(a.D / 2);
  for (int64_t j = 0; j < a.D / 2; ++j) inv_freq[j] = std::pow(10000.0f, -2.0f * j / a.D);
  DeviceBuffer fc = Upload(cpu_.get(), DType::kF32, inv_freq), fg = Upload(gpu_.get(), DType::kF32, inv_freq);
  Pair qkv = Act(RandomBf16(a.n * QKV, 20)), qn = Weight(RandomBf16(a.D, 21, 0.2f, 1.0f)),
       kn = Weight(RandomBf16(a.D, 22, 0.2f, 1.0f));
  Pair q = Act(std::vector<float>(a.n * a.H * a.D)), k = Act(std::vector<float>(a.n * a.KV * a.D)),
       v = Act(std::vector<float>(a.n * a.KV * a.D)), rq = Stat(a.n * a.H), rk = Stat(a.n * a.KV);
  Pair o = Act(std::vector<float>(a.n * a.H * a.D)), lse = Stat(a.n * a.H);
  Pair dout = Act(RandomBf16(a.n * a.H * a.D, 23)), dq = Act(std::vector<float>(a.n * a.H * a.D)),
       dk = Act(std::vector<float>(a.n * a.KV * a.D)), dv = Act(std::vector<float>(a.n * a.KV * a.D));
  Pair dqkv = Act(std::vector<float>(a.n * QKV)), dqn = Grad(std::vector<float>(a.D)),
       dkn = Grad(std::vector<float>(a.D));
  Both([&](Backend* b, bool c) {
    auto P = [&](Pair& x) { return c ? x.c.get() : x.g.get(); };
    auto NP = [&](Pair& x) -> void* { return a.qk_norm ? P(x) : nullptr; };
    const int32_t* ds = static_cast<int32_t*>(c ? d.c.get() : d.g.get());
    const int32_t* ps = static_cast<int32_t*>(c ? p.c.get() : p.g.get());
    const float* f = static_cast<float*>(c ? fc.get() : fg.get());
    b->QkvPrepare(P(q), P(k), P(v), P(rq), P(rk), P(qkv), NP(qn), NP(kn), ps, f, 1.0f, a.n, a.H, a.KV,
                  a.D, 1e-6, StreamId::kCompute);
    b->Attention(P(o), P(lse), P(q), P(k), P(v), ds, nullptr, 0, a.n, a.H, a.KV, a.D,
                 StreamId::kCompute);
    b->AttentionBackward(P(dq), P(dk), P(dv), nullptr, P(dout), P(q), P(k), P(v), P(o), P(lse), ds,
                         nullptr, 0, a.n, a.H, a.KV, a.D, StreamId::kCompute);
    b->QkvPrepareBackward(P(dqkv), NP(dqn), NP(dkn), P(dq), P(dk), P(dv), P(qkv), NP(qn), NP(kn),
                          P(rq), P(rk), ps, f, 1.0f, a.n, a.H, a.KV, a.D, 1e-6, StreamId::kCompute);
  });
  EXPECT_LT(q.Err(), 8e-3);
  EXPECT_LT(k.Err(), 8e-3);
  EXPECT_LT(v.Err(), 1e-6);
  EXPECT_LT(o.Err(), 1.5e-2);
  EXPECT_LT(lse.Err(), 1e-3);
  EXPECT_LT(dq.Err(), 3e-2);
  EXPECT_LT(dk.Err(), 3e-2);
  EXPECT_LT(dv.Err(), 3e-2);
  EXPECT_LT(dqkv.Err(), 3e-2);
  if (a.qk_norm) {
    EXPECT_LT(dqn.Err(), 3e-2);
    EXPECT_LT(dkn.Err(), 3e-2);
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, AttentionKernels,
                         ::testing::Values(AttnShape{67, 4, 2, 32, false},
                                           AttnShape{300, 8, 8, 64, true},
                                           AttnShape{1030, 8, 2, 128, false},
                                           AttnShape{129, 16, 4, 128, true},
                                           AttnShape{96, 2, 1, 256, false}),
                         [](const ::testing::TestParamInfo<AttnShape>& info) {
                           const AttnShape& a = info.param;
                           return "n" + std::to_string(a.n) + "_H" + std::to_string(a.H) + "_KV" +
                                  std::to_string(a.KV) + "_D" + std::to_string(a.D) +
                                  (a.qk_norm ? "_qknorm" : "");
                         });

// GPT-OSS attention: a sliding window (0: none) and per-head sinks (or none).
struct SinkWindowShape {
  int64_t n, H, KV, D, window;
  bool sinks;
};

class SinkWindowAttention : public Kernels,
                            public ::testing::WithParamInterface<SinkWindowShape> {};

// Forward and backward against the CPU, over three packed documents (one of a single token)
// whose starts are not tile-aligned; dsinks starts nonzero, as the backward adds to it. A
// second run on the device gives the same bits in every output.
TEST_P(SinkWindowAttention, ForwardAndBackwardMatchTheCpuAndRepeatBitForBit) {
  const SinkWindowShape a = GetParam();
  const std::vector<int32_t> docs = DocStarts(a.n, {0, (2 * a.n) / 5 - 11, (2 * a.n) / 5 - 10});
  Ints d = Int(docs);
  const std::vector<float> dsinks0 = RandomBf16(a.H, 36, 0.1f);
  Pair q = Act(RandomBf16(a.n * a.H * a.D, 30)), k = Act(RandomBf16(a.n * a.KV * a.D, 31)),
       v = Act(RandomBf16(a.n * a.KV * a.D, 32)), dout = Act(RandomBf16(a.n * a.H * a.D, 33)),
       sinks = Weight(RandomBf16(a.H, 34, 1.0f, 0.5f));
  auto run = [&](AttentionOutputs& out, Backend* b, bool c) {
    RunAttention(out, b, c, q, k, v, dout, a.sinks ? &sinks : nullptr, d, a.window, a.n, a.H,
                 a.KV, a.D);
  };
  AttentionOutputs first = NewAttentionOutputs(a.n, a.H, a.KV, a.D, dsinks0),
                   second = NewAttentionOutputs(a.n, a.H, a.KV, a.D, dsinks0);
  Both([&](Backend* b, bool c) { run(first, b, c); });
  run(second, gpu_.get(), false);
  gpu_->SyncAll();
  const char* names[] = {"o", "lse", "dq", "dk", "dv", "dsinks"};
  const double tolerances[] = {1.5e-2, 1e-3, 3e-2, 3e-2, 3e-2, 3e-2};
  for (int t = 0; t < 6; ++t) {
    if (t == 5 && !a.sinks) continue;
    EXPECT_LT(first[t].Err(), tolerances[t]) << names[t];
    EXPECT_TRUE(Download(gpu_.get(), first[t].gt, first[t].g, first[t].n) ==
                Download(gpu_.get(), second[t].gt, second[t].g, second[t].n))
        << names[t] << " differs between two runs";
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, SinkWindowAttention,
                         ::testing::Values(SinkWindowShape{1000, 8, 2, 64, 128, true},
                                           SinkWindowShape{1000, 8, 2, 64, 37, true},
                                           SinkWindowShape{1000, 8, 2, 128, 128, true},
                                           SinkWindowShape{1000, 8, 2, 128, 37, true},
                                           SinkWindowShape{1000, 8, 2, 64, 0, true},
                                           SinkWindowShape{1000, 8, 2, 128, 37, false},
                                           SinkWindowShape{300, 4, 2, 256, 100, true},
                                           SinkWindowShape{67, 4, 1, 32, 5, true}),
                         [](const ::testing::TestParamInfo<SinkWindowShape>& info) {
                           const SinkWindowShape& a = info.param;
                           return "n" + std::to_string(a.n) + "_H" + std::to_string(a.H) + "_KV" +
                                  std::to_string(a.KV) + "_D" + std::to_string(a.D) + "_window" +
                                  std::to_string(a.window) + (a.sinks ? "_sinks" : "");
                         });

#if MEGATRAIN_TEST_CUDA_OPS
// The Hopper attention kernels (attention_hopper.cu) against the CPU and against the mma
// kernels they replace on sm_90, over five packed documents of odd lengths (one of a single
// token), GQA ratios 1, 4 and 8, head_dim 64 and 128, with and without window and sinks;
// and the same bits on three runs.
using HopperShape = SinkWindowShape;

class HopperAttention : public Kernels, public ::testing::WithParamInterface<HopperShape> {
 protected:
  // Each kernel choice in turn, as main would set it; the process's settings after.
  void Choose(bool hopper, int fused_backward_kv_heads) {
    EngineSettings s = saved_;
    s.attention.hopper = hopper;
    s.attention.fused_backward_kv_heads = fused_backward_kv_heads;
    SetEngineSettings(s);
  }
  void TearDown() override { SetEngineSettings(saved_); }

  const EngineSettings saved_ = GetEngineSettings();
};

TEST_P(HopperAttention, MatchesTheCpuAndTheMmaKernelsAndRepeatsBitForBit) {
  const HopperShape a = GetParam();
  Choose(/*hopper=*/true, /*fused_backward_kv_heads=*/-1);
  if (!cuda::HopperAttentionApplies(a.D)) GTEST_SKIP() << "not an sm_90 device";
  const std::vector<int32_t> docs =
      DocStarts(a.n, {0, a.n / 7, a.n / 3 + 1, a.n / 3 + 2, (2 * a.n) / 3 - 5});
  Ints d = Int(docs);
  Pair q = Act(RandomBf16(a.n * a.H * a.D, 40)), k = Act(RandomBf16(a.n * a.KV * a.D, 41)),
       v = Act(RandomBf16(a.n * a.KV * a.D, 42)), dout = Act(RandomBf16(a.n * a.H * a.D, 43)),
       sinks = Weight(RandomBf16(a.H, 44, 1.0f, 0.5f));
  constexpr int kOutputs = 6;  // o, lse, dq, dk, dv, dsinks
  auto outputs = [&] {
    return NewAttentionOutputs(a.n, a.H, a.KV, a.D, std::vector<float>(a.H));
  };
  auto run = [&](AttentionOutputs& out, Backend* b, bool c) {
    RunAttention(out, b, c, q, k, v, dout, a.sinks ? &sinks : nullptr, d, a.window, a.n, a.H,
                 a.KV, a.D);
  };
  AttentionOutputs hopper = outputs(), again = outputs(), third = outputs(), mma = outputs();
  Both([&](Backend* b, bool c) { run(hopper, b, c); });
  run(again, gpu_.get(), false);
  run(third, gpu_.get(), false);
  // The fused backward (one pass, dq summed in a fixed order across blocks): three runs, and
  // one in launches of a kv head each.
  AttentionOutputs fused = outputs(), fused_again = outputs(), fused_third = outputs(),
                   fused_by_head = outputs();
  Choose(true, 0);
  Both([&](Backend* b, bool c) { run(fused, b, c); });
  run(fused_again, gpu_.get(), false);
  run(fused_third, gpu_.get(), false);
  Choose(true, 1);  // a kv head a launch
  run(fused_by_head, gpu_.get(), false);
  Choose(/*hopper=*/false, -1);
  run(mma, gpu_.get(), false);
  gpu_->SyncAll();
  const char* names[] = {"o", "lse", "dq", "dk", "dv", "dsinks"};
  const double tolerances[] = {1.5e-2, 1e-3, 1e-2, 1e-2, 1e-2, 1e-2};
  for (int t = 0; t < kOutputs; ++t) {
    if (t == 5 && !a.sinks) continue;
    auto get = [&](AttentionOutputs& out) {
      return Download(gpu_.get(), out[t].gt, out[t].g, out[t].n);
    };
    const std::vector<float> got = get(hopper), got_fused = get(fused), want_mma = get(mma);
    EXPECT_LT(hopper[t].Err(), tolerances[t]) << names[t] << " against the CPU";
    EXPECT_LT(RelErr(got, want_mma), tolerances[t]) << names[t] << " against the mma kernels";
    EXPECT_TRUE(got == get(again) && got == get(third)) << names[t] << " differs between three runs";
    EXPECT_LT(fused[t].Err(), tolerances[t]) << names[t] << " (fused) against the CPU";
    EXPECT_LT(RelErr(got_fused, want_mma), tolerances[t])
        << names[t] << " (fused) against the mma kernels";
    EXPECT_TRUE(got_fused == get(fused_again) && got_fused == get(fused_third))
        << names[t] << " (fused) differs between three runs";
    EXPECT_TRUE(got_fused == get(fused_by_head))
        << names[t] << " (fused) differs between one launch and a launch per kv head";
    // dk and dv come from the same wgmmas in the same order as the two-pass kernels'.
    if (t != 2) {
      EXPECT_TRUE(got_fused == got) << names[t] << " (fused) differs from two passes";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, HopperAttention,
                         ::testing::Values(HopperShape{1000, 8, 8, 64, 0, false},
                                           HopperShape{1531, 16, 4, 128, 0, false},
                                           HopperShape{777, 16, 2, 128, 0, false},
                                           HopperShape{1000, 8, 1, 64, 128, true},
                                           HopperShape{1000, 8, 2, 128, 37, true},
                                           HopperShape{300, 4, 4, 64, 0, true},
                                           HopperShape{4099, 8, 1, 128, 0, false}),
                         [](const ::testing::TestParamInfo<HopperShape>& info) {
                           const HopperShape& a = info.param;
                           return "n" + std::to_string(a.n) + "_H" + std::to_string(a.H) + "_KV" +
                                  std::to_string(a.KV) + "_D" + std::to_string(a.D) + "_w" +
                                  std::to_string(a.window) + (a.sinks ? "_sinks" : "");
                         });
#endif  // MEGATRAIN_TEST_CUDA_OPS

}  // namespace
}  // namespace megatrain::testing
