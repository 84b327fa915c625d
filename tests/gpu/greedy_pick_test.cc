// Greedy pick on the CUDA backend against the CPU backend over the same bf16-exact logits:
// the same ids exactly (ties in bf16 are common at V = 200K, and the lowest index must win
// on the device too), log-probabilities within 1e-3, and the same bits from a second run.
// Shapes with V % 8 != 0 start their rows unaligned, which the kernel's head and tail cover.
// The big shapes also print the kernel's time (not checked: a test is no benchmark).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/gpu/gpu_util.h"

namespace megatrain::testing {
namespace {

struct PickShape {
  int64_t B, V;
};

void PrintTo(const PickShape& a, std::ostream* os) { *os << "B" << a.B << "_V" << a.V; }

struct Picks {
  std::vector<int32_t> ids;     // (B)
  std::vector<float> logprobs;  // (B)
};

std::vector<int32_t> DownloadInts(Backend* be, const DeviceBuffer& b, size_t n) {
  std::vector<int32_t> v(n);
  be->SyncAll();
  be->CopyToHost(v.data(), b.get(), n * sizeof(int32_t), StreamId::kCompute);
  be->SyncAll();
  return v;
}

// Bit-for-bit equal floats (NaN included).
bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

class GreedyPickKernels : public GpuTest, public ::testing::WithParamInterface<PickShape> {
 protected:
  // GreedyPick on backend b over logits (B, V), after a first call, `runs` times into the same
  // outputs; the last run's results. With timed, prints the mean time of the runs.
  static Picks Run(Backend* b, const std::vector<float>& logits, int64_t B, int64_t V, int runs = 1,
                   bool timed = false) {
    DeviceBuffer x = Upload(b, b->act_dtype(), logits);                           // (B, V)
    DeviceBuffer ids = UploadInts(b, std::vector<int32_t>(B, 7));                 // (B)
    DeviceBuffer logprobs = Upload(b, DType::kF32, std::vector<float>(B, 7.0f));  // (B)
    Event start(b), end(b);
    b->GreedyPick(static_cast<int32_t*>(ids.get()), static_cast<float*>(logprobs.get()), x.get(), B,
                  V, StreamId::kCompute);  // warm-up
    b->Record(start.get(), StreamId::kCompute);
    for (int r = 0; r < runs; ++r) {
      b->GreedyPick(static_cast<int32_t*>(ids.get()), static_cast<float*>(logprobs.get()), x.get(),
                    B, V, StreamId::kCompute);
    }
    b->Record(end.get(), StreamId::kCompute);
    b->SyncAll();
    if (timed) {
      const double us = b->ElapsedSeconds(start.get(), end.get()) / runs * 1e6;
      std::printf(
          "GreedyPick B=%lld V=%lld on %s: %.2f us a call launched back to back (host "
          "launch rate included), %.0f GB/s of logits\n",
          static_cast<long long>(B), static_cast<long long>(V), b->name().c_str(), us,
          static_cast<double>(B * V * 2) / (us * 1e3));
    }
    return {DownloadInts(b, ids, B), Download(b, DType::kF32, logprobs, B)};
  }
};

// Random logits (scale 3: the top of a 200K row has bf16 neighbours that tie), with ties
// planted: odd rows copy their maximum to a random index, every third row puts a new
// maximum at its first and last logit (the head and the tail on an unaligned row).
std::vector<float> LogitsWithTies(int64_t B, int64_t V, uint64_t seed) {
  std::vector<float> x = RandomBf16(B * V, seed, 3.0f);
  std::mt19937_64 rng(seed + 1);
  for (int64_t b = 0; b < B && V > 1; ++b) {
    float* row = x.data() + b * V;
    float max_logit = row[0];
    for (int64_t c = 1; c < V; ++c) max_logit = std::max(max_logit, row[c]);
    if (b % 2 == 1) row[rng() % V] = max_logit;
    if (b % 3 == 2) row[0] = row[V - 1] = Bf16ToFloat(FloatToBf16(max_logit + 1.0f));
  }
  return x;
}

// Rows whose two largest logits are equal (what makes the lowest-index rule matter).
int64_t RowsWithTiedMaxima(const std::vector<float>& x, int64_t B, int64_t V) {
  int64_t tied = 0;
  for (int64_t b = 0; b < B; ++b) {
    const float* row = x.data() + b * V;
    float max_logit = -std::numeric_limits<float>::infinity();
    int count = 0;
    for (int64_t c = 0; c < V; ++c) {
      if (row[c] > max_logit) {
        max_logit = row[c];
        count = 1;
      } else if (row[c] == max_logit) {
        ++count;
      }
    }
    tied += count > 1;
  }
  return tied;
}

TEST_P(GreedyPickKernels, MatchesTheCpuAndRepeatsBitForBit) {
  const PickShape a = GetParam();
  const std::vector<float> logits = LogitsWithTies(a.B, a.V, 100 + a.V);
  const bool big = a.B * a.V >= (int64_t{1} << 20);
  const Picks want = Run(cpu_.get(), logits, a.B, a.V);
  const Picks got = Run(gpu_.get(), logits, a.B, a.V, big ? 20 : 1, big);
  const Picks again = Run(gpu_.get(), logits, a.B, a.V);
  std::printf("B=%lld V=%lld: %lld of the rows have tied maxima\n", static_cast<long long>(a.B),
              static_cast<long long>(a.V),
              static_cast<long long>(RowsWithTiedMaxima(logits, a.B, a.V)));
  EXPECT_EQ(got.ids, want.ids);
  for (int64_t b = 0; b < a.B; ++b) {
    EXPECT_GE(got.ids[b], 0) << "row " << b;
    EXPECT_NEAR(got.logprobs[b], want.logprobs[b], 1e-3) << "row " << b;
  }
  EXPECT_EQ(again.ids, got.ids);
  EXPECT_TRUE(SameBits(again.logprobs, got.logprobs)) << "two runs gave different bits";
}

INSTANTIATE_TEST_SUITE_P(Shapes, GreedyPickKernels,
                         ::testing::Values(PickShape{1, 7}, PickShape{3, 4096},
                                           PickShape{5, 4099},  // rows at 5 offsets mod 8
                                           PickShape{64, 152064}, PickShape{64, 201088}),
                         [](const ::testing::TestParamInfo<PickShape>& info) {
                           return "B" + std::to_string(info.param.B) + "_V" +
                                  std::to_string(info.param.V);
                         });

// NaN and +inf wherever they sit (the unaligned head, the vector body, the tail) give -1, as
// does a row of -inf only; -inf entries beside finite ones are masked tokens.
TEST_F(GreedyPickKernels, BrokenRowsGiveMinusOneAsOnTheCpu) {
  constexpr int64_t B = 8, V = 1029;  // row b starts 2 * 1029 * b bytes in: unaligned
  constexpr float kInf = std::numeric_limits<float>::infinity();
  std::vector<float> x = RandomBf16(B * V, 110, 2.0f);
  x[0 * V + 1] = std::nanf("");      // row 0 starts aligned: its first vector
  x[1 * V + 1] = std::nanf("");      // row 1's head (it starts 10 bytes past a boundary)
  x[2 * V + 517] = std::nanf("");    // the body
  x[3 * V + V - 1] = std::nanf("");  // the tail
  x[4 * V + 600] = kInf;             // +inf in the body
  for (int64_t c = 0; c < V; ++c) x[5 * V + c] = -kInf;  // only -inf
  for (int64_t c = 0; c < V; ++c) {                      // masked but for three tokens
    if (c != 2 && c != 300 && c != V - 2) x[6 * V + c] = -kInf;
  }
  // row 7: ordinary
  const Picks want = Run(cpu_.get(), x, B, V);
  const Picks got = Run(gpu_.get(), x, B, V);
  EXPECT_EQ(want.ids, (std::vector<int32_t>{-1, -1, -1, -1, -1, -1, want.ids[6], want.ids[7]}));
  EXPECT_EQ(got.ids, want.ids);
  for (int64_t b = 0; b < B; ++b) {
    if (b < 6) {
      EXPECT_TRUE(std::isnan(got.logprobs[b])) << "row " << b;
    } else {
      EXPECT_NEAR(got.logprobs[b], want.logprobs[b], 1e-3) << "row " << b;
    }
  }
}

}  // namespace
}  // namespace megatrain::testing
