// The CPU backend's ops against the reference kernels they dispatch to, called directly.
#include "engine/backend/cpu_backend.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "engine/common/backend.h"
#include "engine/common/check.h"
#include "engine/kernels/reference/lora.h"

namespace megatrain {
namespace {

using VecF = std::vector<float>;

VecF RandomVec(std::mt19937_64& rng, int64_t n) {
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  VecF v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

// A float tensor in the backend's memory (the copy done: `v` may go at once).
DeviceBuffer Upload(Backend* b, const VecF& v) {
  absl::StatusOr<DeviceBuffer> buf = DeviceBuffer::Allocate(b, v.size() * sizeof(float));
  MT_CHECK(buf.ok());
  b->CopyToDevice(buf->get(), v.data(), v.size() * sizeof(float), StreamId::kCompute);
  b->SyncAll();
  return std::move(*buf);
}

VecF Download(Backend* b, const DeviceBuffer& buf, size_t n) {
  VecF v(n);
  b->SyncAll();
  b->CopyToHost(v.data(), buf.get(), n * sizeof(float), StreamId::kCompute);
  b->SyncAll();
  return v;
}

void ExpectAllNear(const VecF& got, const VecF& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int misses = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!(std::fabs(got[i] - want[i]) <= 1e-5f * (1.0f + std::fabs(want[i]))) && ++misses <= 5) {
      ADD_FAILURE() << what << "[" << i << "]: " << got[i] << " vs " << want[i];
    }
  }
  EXPECT_EQ(misses, 0) << what;
}

// Six experts over 11 sorted rows; the first, a middle one and the last get none.
// GroupedLoraForward and GroupedLoraBackward give what LoraForward and LoraBackward give on
// each expert's rows with its own A_e and B_e, and leave the gradients of experts without
// rows as they were, bit for bit.
TEST(CpuBackend, GroupedLoraMatchesTheDenseLoraOnEachExpertsRows) {
  constexpr int64_t E = 6, IC = 7, OC = 5, r = 3;
  constexpr double kScale = 0.75;
  const std::vector<int32_t> offsets = {0, 0, 3, 3, 9, 11, 11};
  const int64_t R = offsets[E];
  std::mt19937_64 rng(7);
  const VecF x = RandomVec(rng, R * IC), A = RandomVec(rng, E * r * IC),
             B = RandomVec(rng, E * OC * r), y0 = RandomVec(rng, R * OC),
             dy = RandomVec(rng, R * OC), dx0 = RandomVec(rng, R * IC),
             dA0 = RandomVec(rng, E * r * IC), dB0 = RandomVec(rng, E * OC * r);

  // The dense reference per expert, on slices of whole tensors.
  VecF y = y0, t(R * r), dx = dx0, dA = dA0, dB = dB0, bt(R * r), bdt(R * r);
  for (int64_t e = 0; e < E; ++e) {
    const int64_t r0 = offsets[e], rows = offsets[e + 1] - offsets[e];
    if (rows == 0) continue;
    const float *Ae = A.data() + e * r * IC, *Be = B.data() + e * OC * r;
    ref::LoraForward<float>(y.data() + r0 * OC, OC, t.data() + r0 * r, x.data() + r0 * IC, Ae, Be,
                            rows, IC, OC, r, kScale);
    ref::LoraBackward<float>(dx.data() + r0 * IC, dA.data() + e * r * IC, dB.data() + e * OC * r,
                             bt.data() + r0 * r, bdt.data() + r0 * r, dy.data() + r0 * OC, OC,
                             x.data() + r0 * IC, Ae, Be, rows, IC, OC, r, kScale);
  }

  std::unique_ptr<Backend> cpu = CreateCpuBackend(CpuBackendOptions{});
  DeviceBuffer gx = Upload(cpu.get(), x), gA = Upload(cpu.get(), A), gB = Upload(cpu.get(), B),
               gy = Upload(cpu.get(), y0), gt = Upload(cpu.get(), VecF(R * r)),
               gdt = Upload(cpu.get(), VecF(R * r)), gdy = Upload(cpu.get(), dy),
               gdx = Upload(cpu.get(), dx0), gdA = Upload(cpu.get(), dA0),
               gdB = Upload(cpu.get(), dB0);
  absl::StatusOr<DeviceBuffer> goff = DeviceBuffer::Allocate(cpu.get(), (E + 1) * sizeof(int32_t));
  ASSERT_TRUE(goff.ok()) << goff.status();
  cpu->CopyToDevice(goff->get(), offsets.data(), (E + 1) * sizeof(int32_t), StreamId::kCompute);
  const ExpertOffsets o{static_cast<const int32_t*>(goff->get()), nullptr};
  cpu->GroupedLoraForward(gy.get(), gt.get(), gx.get(), gA.get(), gB.get(), o, E, IC, OC, r, kScale,
                          StreamId::kCompute);
  ExpectAllNear(Download(cpu.get(), gy, R * OC), y, "y");
  ExpectAllNear(Download(cpu.get(), gt, R * r), t, "t");
  cpu->GroupedLoraBackward(gdx.get(), gdA.get(), gdB.get(), gt.get(), gdt.get(), gdy.get(),
                           gx.get(), gA.get(), gB.get(), o, E, IC, OC, r, kScale,
                           StreamId::kCompute);
  const VecF got_dA = Download(cpu.get(), gdA, E * r * IC),
             got_dB = Download(cpu.get(), gdB, E * OC * r);
  ExpectAllNear(Download(cpu.get(), gdx, R * IC), dx, "dx");
  ExpectAllNear(got_dA, dA, "dA");
  ExpectAllNear(got_dB, dB, "dB");
  for (const int64_t e : {0, 2, 5}) {
    ASSERT_EQ(offsets[e], offsets[e + 1]);
    EXPECT_TRUE(VecF(got_dA.begin() + e * r * IC, got_dA.begin() + (e + 1) * r * IC) ==
                VecF(dA0.begin() + e * r * IC, dA0.begin() + (e + 1) * r * IC))
        << "dA of expert " << e << ", which has no rows";
    EXPECT_TRUE(VecF(got_dB.begin() + e * OC * r, got_dB.begin() + (e + 1) * OC * r) ==
                VecF(dB0.begin() + e * OC * r, dB0.begin() + (e + 1) * OC * r))
        << "dB of expert " << e << ", which has no rows";
  }
}

}  // namespace
}  // namespace megatrain
