// The CPU backend's reduce-scatter group (simulated devices for data parallelism in CI).
#include "engine/backend/cpu_backend.h"
#include "engine/backend/factory.h"
#include "engine/plan/rates.h"
#include "tests/engine/backend/reduce_scatter_check.h"

namespace megatrain {
namespace {

TEST(CpuCollective, ReduceScattersOverTwoAndThreeDevices) {
  for (const int ranks : {1, 2, 3}) {
    std::vector<std::unique_ptr<Backend>> owned;
    std::vector<Backend*> backends;
    for (int r = 0; r < ranks; ++r) {
      owned.push_back(CreateCpuBackend(CpuBackendOptions{}));
      backends.push_back(owned.back().get());
    }
    absl::StatusOr<std::vector<std::unique_ptr<GradCollective>>> group =
        CreateGradCollectives(backends);
    ASSERT_TRUE(group.ok()) << group.status();
    EXPECT_EQ((*group)[0]->description(), "host threads");
    testing::CheckReduceScatter(backends, *group);
  }
}

TEST(CpuCollective, ItsRateIsMeasurable) {
  std::vector<std::unique_ptr<Backend>> owned;
  std::vector<Backend*> backends;
  for (int r = 0; r < 2; ++r) {
    owned.push_back(CreateCpuBackend(CpuBackendOptions{}));
    backends.push_back(owned.back().get());
  }
  absl::StatusOr<std::vector<std::unique_ptr<GradCollective>>> group =
      CreateGradCollectives(backends);
  ASSERT_TRUE(group.ok()) << group.status();
  absl::StatusOr<double> gbps = MeasureReduceScatterGbps(backends, *group, 4 << 20);
  ASSERT_TRUE(gbps.ok()) << gbps.status();
  EXPECT_GT(*gbps, 0);
  EXPECT_FALSE(MeasureReduceScatterGbps({backends[0]}, *group).ok());  // not a group
}

TEST(CpuCollective, RefusesBackendsOfDifferentPrecision) {
  std::unique_ptr<Backend> f32 = CreateCpuBackend(CpuBackendOptions{});
  CpuBackendOptions o;
  o.precision = CpuBackendOptions::Precision::kF64;
  std::unique_ptr<Backend> f64 = CreateCpuBackend(o);
  absl::StatusOr<std::vector<std::unique_ptr<GradCollective>>> group =
      CreateGradCollectives({f32.get(), f64.get()});
  ASSERT_FALSE(group.ok());
  EXPECT_NE(group.status().message().find("one precision"), absl::string_view::npos)
      << group.status();
}

TEST(GradShardElements, CoversTheGradientInWholePieces) {
  // ceil(n / ranks), up to 256s (whole blocks of int8 moments).
  EXPECT_EQ(GradShardElements(1000, 3), 512);
  EXPECT_EQ(GradShardElements(512, 2), 256);
  EXPECT_EQ(GradShardElements(1, 4), 256);
  EXPECT_EQ(GradShardElements(1000, 1), 1024);
  EXPECT_EQ(GradShardElements(1025, 1), 1280);
}

}  // namespace
}  // namespace megatrain
