// NCCL reduce-scatter over every visible GPU (one GPU: a group of one), through the same
// check as the CPU group. Skips without a GPU, and says so when NCCL cannot be loaded.
#include "engine/backend/devices.h"
#include "engine/backend/factory.h"
#include "engine/plan/rates.h"
#include "engine/backend/nccl.h"
#include "tests/engine/backend/reduce_scatter_check.h"

namespace megatrain {
namespace {

TEST(NcclCollective, ReduceScattersOverEveryGpu) {
  const std::vector<GpuInfo> gpus = ListGpus();
  if (gpus.empty()) GTEST_SKIP() << "no CUDA device";
  SetCollectiveDefaults();
  absl::StatusOr<std::string> version = NcclVersion();
  if (!version.ok()) GTEST_SKIP() << version.status();
  std::printf("%s, %zu GPU(s)\n", version->c_str(), gpus.size());
  std::vector<std::unique_ptr<Backend>> owned;
  std::vector<Backend*> backends;
  for (const GpuInfo& g : gpus) {
    absl::StatusOr<std::unique_ptr<Backend>> b =
        CreateBackend(BackendRequest{"cuda:" + std::to_string(g.index), 0});
    ASSERT_TRUE(b.ok()) << b.status();
    owned.push_back(*std::move(b));
    backends.push_back(owned.back().get());
  }
  absl::StatusOr<std::vector<std::unique_ptr<GradCollective>>> group =
      CreateGradCollectives(backends);
  ASSERT_TRUE(group.ok()) << group.status();
  testing::CheckReduceScatter(backends, *group);
  if (backends.size() > 1) {
    absl::StatusOr<double> gbps = MeasureReduceScatterGbps(backends, *group);
    ASSERT_TRUE(gbps.ok()) << gbps.status();
    std::printf("reduce-scatter over %zu GPUs: %.0f GB/s per device\n", backends.size(), *gbps);
    EXPECT_GT(*gbps, 1.0);
  }
}

}  // namespace
}  // namespace megatrain
