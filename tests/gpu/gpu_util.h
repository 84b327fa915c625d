// Moving test tensors between the host (as float) and any backend, in the dtype the
// backend uses for the tensor's role. GPU tests skip where there is no CUDA device.
#pragma once

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "engine/backend/devices.h"
#include "engine/backend/factory.h"
#include "engine/common/backend.h"
#include "engine/common/check.h"
#include "engine/common/dtype.h"
#include "gtest/gtest.h"

namespace megatrain::testing {

inline DeviceBuffer Upload(Backend* be, DType t, const std::vector<float>& v) {
  absl::StatusOr<DeviceBuffer> b = DeviceBuffer::Allocate(be, v.size() * DTypeSize(t) + 16);
  MT_CHECK(b.ok());
  std::vector<char> raw(v.size() * DTypeSize(t));
  for (size_t i = 0; i < v.size(); ++i) {
    if (t == DType::kBF16) {
      const uint16_t h = FloatToBf16(v[i]);
      std::memcpy(&raw[2 * i], &h, 2);
    } else if (t == DType::kF32) {
      std::memcpy(&raw[4 * i], &v[i], 4);
    } else {
      const double d = v[i];
      std::memcpy(&raw[8 * i], &d, 8);
    }
  }
  be->CopyToDevice(b->get(), raw.data(), raw.size(), StreamId::kCompute);
  be->SyncAll();
  return std::move(*b);
}

inline DeviceBuffer UploadInts(Backend* be, const std::vector<int32_t>& v) {
  absl::StatusOr<DeviceBuffer> b = DeviceBuffer::Allocate(be, v.size() * 4 + 16);
  MT_CHECK(b.ok());
  be->CopyToDevice(b->get(), v.data(), v.size() * 4, StreamId::kCompute);
  be->SyncAll();
  return std::move(*b);
}

inline DeviceBuffer UploadDoubles(Backend* be, const std::vector<double>& v) {
  absl::StatusOr<DeviceBuffer> b = DeviceBuffer::Allocate(be, v.size() * 8 + 16);
  MT_CHECK(b.ok());
  be->CopyToDevice(b->get(), v.data(), v.size() * 8, StreamId::kCompute);
  be->SyncAll();
  return std::move(*b);
}

inline std::vector<float> Download(Backend* be, DType t, const DeviceBuffer& b, size_t n) {
  std::vector<char> raw(n * DTypeSize(t));
  be->SyncAll();
  be->CopyToHost(raw.data(), b.get(), raw.size(), StreamId::kCompute);
  be->SyncAll();
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) {
    if (t == DType::kBF16) {
      uint16_t h;
      std::memcpy(&h, &raw[2 * i], 2);
      v[i] = Bf16ToFloat(h);
    } else if (t == DType::kF32) {
      std::memcpy(&v[i], &raw[4 * i], 4);
    } else {
      double d;
      std::memcpy(&d, &raw[8 * i], 8);
      v[i] = static_cast<float>(d);
    }
  }
  return v;
}

// Values exactly representable in bf16, so both backends see the same inputs.
inline std::vector<float> RandomBf16(size_t n, uint64_t seed, float scale = 1.0f,
                                     float offset = 0.0f) {
  std::mt19937_64 gen(seed);
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = Bf16ToFloat(FloatToBf16(offset + normal(gen)));
  return v;
}

inline double RelErr(const std::vector<float>& got, const std::vector<float>& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    num += double(got[i] - want[i]) * (got[i] - want[i]);
    den += double(want[i]) * want[i];
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

class GpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!CudaAvailable()) GTEST_SKIP() << "no CUDA device (or no CUDA backend in this build)";
    cpu_ = std::move(*CreateBackend(BackendRequest{"cpu"}));
    absl::StatusOr<std::unique_ptr<Backend>> g = CreateBackend(BackendRequest{"cuda"});
    ASSERT_TRUE(g.ok()) << g.status();
    gpu_ = std::move(*g);
  }
  // fn(backend, on_cpu) on both backends, then both synced.
  template <typename Fn>
  void Both(Fn fn) {
    fn(cpu_.get(), true);
    fn(gpu_.get(), false);
    cpu_->SyncAll();
    gpu_->SyncAll();
  }
  std::unique_ptr<Backend> cpu_, gpu_;
};

}  // namespace megatrain::testing
