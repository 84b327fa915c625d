// What megatraind exports for a job, and what it cleans up when the job stops: its series
// and the DCGM job-mapping file.
#include "server/daemon_metrics.h"

#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <utility>

#include "gtest/gtest.h"
#include "tests/util/temp_dir.h"

namespace megatrain::server {
namespace {

// A job store in a fresh folder, and the registry the metrics export to.
class DaemonMetricsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<JobStore>> store = JobStore::Open(dir_.path() + "/db");
    ASSERT_TRUE(store.ok()) << store.status();
    store_ = std::move(*store);
  }

  // Inserts into the store, as *job, a job of `owner` in `state` (`waiting` when not empty).
  void Insert(const std::string& owner, v1::JobState state, v1::Job* job,
              const std::string& waiting = "") {
    job->set_owner(owner);
    job->set_state(state);
    if (!waiting.empty()) job->set_waiting(waiting);
    ASSERT_TRUE(store_->Insert(job).ok());
  }

  testing::TempDir dir_;
  std::unique_ptr<JobStore> store_;
  MetricsRegistry registry_;
};

TEST_F(DaemonMetricsTest, AJobsSeriesAndDcgmMappingLiveWhileItRuns) {
  v1::Job job;
  ASSERT_NO_FATAL_FAILURE(Insert("ada", v1::JOB_STATE_RUNNING, &job));
  DaemonMetricsOptions options;
  options.gpu = "0";
  options.peak_tflops = 100;
  options.dcgm_job_mapping_dir = dir_.path() + "/dcgm";
  DaemonMetrics metrics(&registry_, store_.get(), options);
  metrics.JobStarted(job, 1000, 5000, 0, 10);
  const std::string mapping = dir_.path() + "/dcgm/0";
  std::ifstream in(mapping);
  int64_t mapped = 0;
  in >> mapped;
  EXPECT_EQ(mapped, job.id()) << "DCGM's mapping file names the running job";

  StepReport r;
  r.step = 1;
  r.seconds = 2;
  r.tokens = 100;
  r.tokens_per_second = 50;
  r.model_tflops = 25;
  r.h2d_bytes = 4000;
  r.d2h_bytes = 6000;
  r.stream_busy_seconds = {1.5, 0.5, 0.25};
  r.optimizer_busy_seconds = 1;
  r.optimizer_params_per_second = 3e9;
  r.optimizer_in_step_fraction = 0.875;
  r.checkpoint_wait_seconds = 0.75;
  metrics.StepDone(job, r);
  metrics.CheckpointWritten(job, 0.5, 123);
  const std::string id = std::to_string(job.id());
  const std::string l = "gpu=\"0\",job=\"" + id + "\"";
  const std::string text = registry_.Serialize();
  for (const std::string& want : std::vector<std::string>{
       "megatrain_mfu_ratio{" + l + ",user=\"ada\"} 0.25",
        "megatrain_pcie_bytes_total{direction=\"d2h\"," + l + ",user=\"ada\"} 6000",
        "megatrain_pcie_throughput_bytes_per_second{direction=\"h2d\"," + l + ",user=\"ada\"} 2000",
        "megatrain_pcie_transfer_rate_bytes_per_second{direction=\"h2d\"," + l + ",user=\"ada\"} 8000",
        "megatrain_stream_busy_seconds_total{" + l + ",stream=\"compute\",user=\"ada\"} 1.5",
        "megatrain_stream_busy_seconds_total{" + l + ",stream=\"optimizer\",user=\"ada\"} 1",
        "megatrain_host_store_bytes{" + l + ",kind=\"pinned\",user=\"ada\"} 1000",
        "megatrain_checkpoint_bytes_total{" + l + ",user=\"ada\"} 123",
        "megatrain_checkpoint_wait_seconds_total{" + l + ",user=\"ada\"} 0.75",
        "megatrain_optimizer_params_per_second{" + l + ",user=\"ada\"} 3000000000",
        "megatrain_optimizer_in_step_fraction{" + l + ",user=\"ada\"} 0.875",
        "megatrain_jobs{state=\"running\"} 1", "megatrain_user_jobs{state=\"running\",user=\"ada\"} 1",
        "megatrain_peak_tflops{gpu=\"0\"} 100"}) {
    EXPECT_NE(text.find(want + "\n"), std::string::npos) << want << "\n" << text;
  }

  metrics.JobStopped(job);
  EXPECT_EQ(registry_.Serialize().find("job=\"" + id + "\""), std::string::npos);
  EXPECT_FALSE(std::filesystem::exists(mapping));
}

TEST_F(DaemonMetricsTest, AnEvalJobExportsItsPromptsTokensAndAccuracy) {
  v1::Job job;
  job.set_kind("eval");
  ASSERT_NO_FATAL_FAILURE(Insert("bo", v1::JOB_STATE_RUNNING, &job));
  DaemonMetricsOptions options;
  options.gpu = "0";
  DaemonMetrics metrics(&registry_, store_.get(), options);
  metrics.JobStarted(job, 1000, 0, 0, 0);
  v1::Progress* p = job.mutable_progress();
  p->set_prompts_done(8);
  p->set_prompts_total(20);
  p->set_tokens_per_second(400);
  p->set_accuracy(0.375);
  metrics.GenerationStepDone(job, 96);
  p->set_prompts_done(16);
  metrics.GenerationStepDone(job, 64);
  const std::string l = "gpu=\"0\",job=\"" + std::to_string(job.id()) + "\",user=\"bo\"";
  const std::string text = registry_.Serialize();
  for (const std::string& want : std::vector<std::string>{
           "megatrain_prompts_done{" + l + "} 16", "megatrain_prompts_total{" + l + "} 20",
           "megatrain_tokens_total{" + l + "} 160", "megatrain_tokens_per_second{" + l + "} 400",
           "megatrain_eval_accuracy{" + l + "} 0.375", "megatrain_steps_total{" + l + "} 2"}) {
    EXPECT_NE(text.find(want + "\n"), std::string::npos) << want << "\n" << text;
  }
}

TEST_F(DaemonMetricsTest, SharingSeriesFollowTheStore) {
  v1::Job waiting, queued;
  ASSERT_NO_FATAL_FAILURE(
      Insert("bob", v1::JOB_STATE_QUEUED, &waiting, "bob has 1 running jobs, the most allowed"));
  ASSERT_NO_FATAL_FAILURE(Insert("ada", v1::JOB_STATE_QUEUED, &queued));
  ASSERT_TRUE(store_->AddUsage("ada", 7200, 0).ok());  // two hours, no decay

  DaemonMetricsOptions options;
  options.fair_share_half_life_hours = 0;  // no decay (the store's rule for <= 0)
  DaemonMetrics metrics(&registry_, store_.get(), options);
  metrics.Preempted(queued);
  const std::string text = registry_.Serialize();
  for (const std::string want :
       {"megatrain_user_device_seconds{user=\"ada\"} 7200", "megatrain_jobs_waiting 1",
        "megatrain_preemptions_total{user=\"ada\"} 1", "megatrain_queue_depth 2"}) {
    EXPECT_NE(text.find(want + "\n"), std::string::npos) << want << "\n" << text;
  }
}

}  // namespace
}  // namespace megatrain::server
