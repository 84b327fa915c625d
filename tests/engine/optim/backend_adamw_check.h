// The check a backend's AdamW (Backend::AdamW) must pass, for the CPU backend's unit test
// and the CUDA backend's GPU test: over a few steps of random gradients (subnormal, zero
// and large values among them), with torch.lerp's two branches (beta1 0.9 and 0.2), weight
// decay and a clip coefficient, its master, moments and bf16 weights are the host
// optimizer's (AdamWUpdate) bit for bit.
#pragma once

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/common/adamw_math.h"
#include "engine/common/backend.h"
#include "engine/optim/adamw.h"
#include "gtest/gtest.h"

namespace megatrain::testing {

inline void ExpectBackendAdamWIsTheHostOptimizers(Backend* be) {
  const int64_t n = 100003;
  for (const double beta1 : {0.9, 0.2}) {
    const AdamWHyper hyper{beta1, 0.999, 1e-8};
    std::mt19937_64 gen(7);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> master(n), m(n, 0.0f), v(n, 0.0f);
    for (float& x : master) x = normal(gen);
    // The device's copies, and the host's.
    auto alloc = [&](size_t bytes) {
      absl::StatusOr<DeviceBuffer> b = DeviceBuffer::Allocate(be, bytes);
      EXPECT_TRUE(b.ok()) << b.status();
      return std::move(*b);
    };
    DeviceBuffer dp = alloc(4 * n), dm = alloc(4 * n), dv = alloc(4 * n), dg = alloc(4 * n);
    DeviceBuffer db = alloc(2 * n);
    be->CopyToDevice(dp.get(), master.data(), 4 * n, StreamId::kCompute);
    be->CopyToDevice(dm.get(), m.data(), 4 * n, StreamId::kCompute);
    be->CopyToDevice(dv.get(), v.data(), 4 * n, StreamId::kCompute);
    be->SyncAll();  // the copies read the host arrays the host's update then changes
    std::vector<uint16_t> bf16(n);
    for (int64_t step = 1; step <= 4; ++step) {
      std::vector<float> g(n);
      for (int64_t i = 0; i < n; ++i) {
        g[i] = i % 97 == 0 ? 0.0f
               : i % 89 == 0 ? 3e-39f * normal(gen)  // subnormal
               : i % 83 == 0 ? 1e4f * normal(gen)
                             : 1e-3f * normal(gen);
      }
      const double lr = 1e-3, wd = 0.1;
      const float scale = 0.37f;
      be->CopyToDevice(dg.get(), g.data(), 4 * n, StreamId::kCompute);
      be->AdamW(dp.get(), dm.get(), dv.get(), db.get(), dg.get(), n,
                MakeAdamWScalars(step, lr, wd, hyper.beta1, hyper.beta2, hyper.eps), scale,
                StreamId::kCompute);
      be->SyncAll();  // g's copy is done before g goes
      AdamWUpdate(master.data(), m.data(), v.data(), bf16.data(), g.data(), n, step, lr, wd,
                  scale, hyper);
    }
    std::vector<float> got_p(n), got_m(n), got_v(n);
    std::vector<uint16_t> got_b(n);
    be->SyncAll();
    be->CopyToHost(got_p.data(), dp.get(), 4 * n, StreamId::kCompute);
    be->CopyToHost(got_m.data(), dm.get(), 4 * n, StreamId::kCompute);
    be->CopyToHost(got_v.data(), dv.get(), 4 * n, StreamId::kCompute);
    be->CopyToHost(got_b.data(), db.get(), 2 * n, StreamId::kCompute);
    be->SyncAll();
    int64_t differ = 0;
    for (int64_t i = 0; i < n; ++i) {
      differ += std::memcmp(&got_p[i], &master[i], 4) != 0 || std::memcmp(&got_m[i], &m[i], 4) != 0 ||
                std::memcmp(&got_v[i], &v[i], 4) != 0 || got_b[i] != bf16[i];
    }
    EXPECT_EQ(differ, 0) << "beta1 " << beta1 << ": elements whose bits differ";
  }
}

}  // namespace megatrain::testing
