// A checkpoint written while training goes on, when it goes wrong: a write error midway,
// or the job ending first, releases the optimizer's held updates (training goes on) and
// leaves no half checkpoint behind. (Equality with a stopped checkpoint: trainer_test and
// host_optimizer_test.)
#include "engine/job/background_checkpoint.h"

#include <filesystem>
#include <random>
#include <thread>

#include "gtest/gtest.h"
#include "engine/store/model_io.h"
#include "tests/engine/pipeline/tiny_model.h"

namespace megatrain::testing {
namespace {
namespace fs = std::filesystem;

// A store, two gradient slabs and an optimizer without clipping, as a job has.
class Rig {
 public:
  Rig() {
    config_ = TinyConfig(Variant::kQwen2UntiedBias);
    backend_ = CreateCpuBackend(CpuBackendOptions{});
    store_ = std::move(*HostStore::Create(BuildLayout(config_)));
    RandomInitWeights(config_, 3, store_.get());
    pool_ = std::move(*GradSlabPool::Create(2, kPiece));
    HostOptimizerOptions o;
    o.hyper = AdamWHyper{0.9, 0.95, 1e-8};
    optimizer_ = std::make_unique<HostOptimizer>(store_.get(), pool_.get(), backend_.get(), o);
    for (int i = 0; i < 2; ++i) events_.emplace_back(backend_.get());
  }

  // One step of seeded gradients, in backward order.
  void Step(int64_t step) {
    optimizer_->BeginStep(1e-2, step);
    for (int64_t u = store_->num_units() - 1; u >= 0; --u) {
      for (int64_t offset = 0; offset < store_->unit_elements(u); offset += kPiece) {
        const int64_t count = std::min<int64_t>(kPiece, store_->unit_elements(u) - offset);
        float* slab = pool_->Acquire();
        for (int64_t i = 0; i < count; ++i) slab[i] = normal_(gen_);
        Event& ready = events_[pool_->IndexOf(slab)];
        backend_->Record(ready.get(), StreamId::kD2H);
        optimizer_->Submit(u, slab, ready.get(), offset, count);
      }
    }
    optimizer_->Finish();
  }

  std::unique_ptr<BackgroundCheckpoint> Start(const std::string& root, int64_t step,
                                              std::function<absl::Status(int64_t)> fault) {
    TrainerState state;
    state.step = step;
    absl::StatusOr<std::unique_ptr<CheckpointWriter>> writer =
        CheckpointWriter::Begin(root, config_, store_->layout(), step, CheckpointOptions{});
    EXPECT_TRUE(writer.ok()) << writer.status();
    std::unique_ptr<BackgroundCheckpoint> b = BackgroundCheckpoint::Start(
        std::move(*writer), optimizer_.get(), store_.get(), 2, nullptr, std::move(fault));
    b->SetState(state);
    return b;
  }

  HostOptimizer& optimizer() { return *optimizer_; }
  int64_t num_units() const { return store_->num_units(); }

 private:
  static constexpr int64_t kPiece = 64;
  ModelConfig config_;
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<HostStore> store_;
  std::unique_ptr<GradSlabPool> pool_;
  std::unique_ptr<HostOptimizer> optimizer_;
  std::vector<Event> events_;
  std::mt19937_64 gen_{5};
  std::normal_distribution<float> normal_{0.0f, 1.0f};
};

std::string FreshDir(const std::string& name) {
  const fs::path p = fs::path(::testing::TempDir()) / ("megatrain_background_" + name);
  fs::remove_all(p);
  return p.string();
}

std::vector<std::string> Entries(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.push_back(e.path().filename());
  return out;
}

TEST(BackgroundCheckpoint, WriteErrorMidwayFailsItReleasesTheUpdatesAndLeavesNothing) {
  Rig rig;
  const std::string root = FreshDir("error");
  rig.Step(1);
  std::unique_ptr<BackgroundCheckpoint> b = rig.Start(root, 1, [](int64_t unit) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    return unit == 2 ? absl::ResourceExhaustedError("No space left on device (injected)")
                     : absl::OkStatus();
  });
  for (int64_t step = 2; step <= 4; ++step) rig.Step(step);  // must not hang on unit 2
  rig.optimizer().Drain();
  absl::StatusOr<std::string> result = b->Wait();
  ASSERT_FALSE(result.ok());
  EXPECT_NE(result.status().message().find("injected"), std::string::npos) << result.status();
  b.reset();
  EXPECT_TRUE(Entries(root).empty()) << "left behind: " << Entries(root)[0];
  EXPECT_TRUE(ListCheckpoints(root).empty());
}

TEST(BackgroundCheckpoint, AbandonedWhileUpdatesWaitForItReleasesThem) {
  Rig rig;
  const std::string root = FreshDir("abandon");
  rig.Step(1);
  std::unique_ptr<BackgroundCheckpoint> b = rig.Start(root, 1, [](int64_t) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));  // a very slow disk
    return absl::OkStatus();
  });
  std::thread training([&] {
    for (int64_t step = 2; step <= 3; ++step) rig.Step(step);
    rig.optimizer().Drain();
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_FALSE(b->done());
  b.reset();  // the job is cancelled mid-checkpoint
  training.join();
  EXPECT_GT(rig.optimizer().capture_wait_seconds(), 0.0) << "updates never waited: no overlap";
  EXPECT_TRUE(Entries(root).empty()) << "left behind: " << Entries(root)[0];
}

TEST(BackgroundCheckpoint, CompletesWhileStepsRunAndIsListed) {
  Rig rig;
  const std::string root = FreshDir("ok");
  rig.Step(1);
  std::unique_ptr<BackgroundCheckpoint> b = rig.Start(root, 1, nullptr);
  for (int64_t step = 2; step <= 3; ++step) rig.Step(step);
  absl::StatusOr<std::string> result = b->Wait();
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(fs::path(*result).filename(), "checkpoint-1");
  EXPECT_EQ(ListCheckpoints(root), std::vector<std::string>{*result});
  EXPECT_GT(b->bytes(), 0u);
  b.reset();
  rig.optimizer().Drain();
}

}  // namespace
}  // namespace megatrain::testing
