// What megatraind exports for a job, and what it cleans up when the job stops: its series
// and the DCGM job-mapping file.
#include "server/daemon_metrics.h"

#include <filesystem>
#include <fstream>

#include "gtest/gtest.h"
#include "tests/util/temp_dir.h"

namespace megatrain::server {
namespace {

TEST(DaemonMetrics, AJobsSeriesAndDcgmMappingLiveWhileItRuns) {
  testing::TempDir dir;
  absl::StatusOr<std::unique_ptr<JobStore>> store = JobStore::Open(dir.path() + "/db");
  ASSERT_TRUE(store.ok()) << store.status();
  v1::Job job;
  job.set_owner("ada");
  job.set_state(v1::JOB_STATE_RUNNING);
  ASSERT_TRUE((*store)->Insert(&job).ok());

  MetricsRegistry registry;
  DaemonMetricsOptions options;
  options.gpu = "0";
  options.peak_tflops = 100;
  options.dcgm_job_mapping_dir = dir.path() + "/dcgm";
  DaemonMetrics metrics(&registry, store->get(), options);
  metrics.JobStarted(job, 1000, 5000, 0, 10);
  const std::string mapping = dir.path() + "/dcgm/0";
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
  const std::string text = registry.Serialize();
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
  EXPECT_EQ(registry.Serialize().find("job=\"" + id + "\""), std::string::npos);
  EXPECT_FALSE(std::filesystem::exists(mapping));
}

TEST(DaemonMetrics, SharingSeriesFollowTheStore) {
  testing::TempDir dir;
  absl::StatusOr<std::unique_ptr<JobStore>> store = JobStore::Open(dir.path() + "/db");
  ASSERT_TRUE(store.ok()) << store.status();
  v1::Job waiting;
  waiting.set_owner("bob");
  waiting.set_state(v1::JOB_STATE_QUEUED);
  waiting.set_waiting("bob has 1 running jobs, the most allowed");
  ASSERT_TRUE((*store)->Insert(&waiting).ok());
  v1::Job queued;
  queued.set_owner("ada");
  queued.set_state(v1::JOB_STATE_QUEUED);
  ASSERT_TRUE((*store)->Insert(&queued).ok());
  ASSERT_TRUE((*store)->AddUsage("ada", 7200, 0).ok());  // two hours, no decay

  MetricsRegistry registry;
  DaemonMetricsOptions options;
  options.fair_share_half_life_hours = 0;  // no decay (the store's rule for <= 0)
  DaemonMetrics metrics(&registry, store->get(), options);
  metrics.Preempted(queued);
  const std::string text = registry.Serialize();
  for (const std::string want :
       {"megatrain_user_device_seconds{user=\"ada\"} 7200", "megatrain_jobs_waiting 1",
        "megatrain_preemptions_total{user=\"ada\"} 1", "megatrain_queue_depth 2"}) {
    EXPECT_NE(text.find(want + "\n"), std::string::npos) << want << "\n" << text;
  }
}

}  // namespace
}  // namespace megatrain::server
