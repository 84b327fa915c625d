// Table-mode views of jobs and the node (client/views.h).
#include "client/views.h"

#include "gtest/gtest.h"

namespace megatrain::client {
namespace {

constexpr int64_t kNowMs = 1764415805000;  // 2025-11-29 11:30:05 UTC

v1::Job RunningJob() {
  v1::Job job;
  job.set_id(12);
  job.set_name("demo");
  job.set_owner("alice");
  job.set_state(v1::JOB_STATE_RUNNING);
  job.set_device("cuda:0");
  job.set_created_unix_ms(kNowMs - 5 * 60'000);
  job.set_started_unix_ms(kNowMs - 4 * 60'000);
  v1::Progress* p = job.mutable_progress();
  p->set_step(120);
  p->set_total_steps(200);
  p->set_loss(2.34123);
  p->set_tokens_per_second(1234);
  p->set_eta_seconds(83);
  return job;
}

TEST(FormatJobTable, OneRowPerJobWithDashesForTheUnknown) {
  v1::Job queued;
  queued.set_id(13);
  queued.set_owner("bob");
  queued.set_state(v1::JOB_STATE_QUEUED);
  queued.set_created_unix_ms(kNowMs - 3000);
  EXPECT_EQ(FormatJobTable({RunningJob(), queued}, kNowMs),
            "ID  NAME  OWNER  STATE       STEP    LOSS  TOK/S  AGE\n"
            "12  demo  alice  running  120/200  2.3412   1.2k   5m\n"
            "13  -     bob    queued         -       -      -   3s\n");
}

TEST(FormatJobStatus, KeyValuesThenTheSpecIndented) {
  v1::Job job = RunningJob();
  job.set_spec_yaml("name: demo\ntrain:\n  steps: 200\n");
  const std::string text = FormatJobStatus(job, kNowMs, absl::UTCTimeZone());
  EXPECT_NE(text.find("state:            running\n"), std::string::npos) << text;
  EXPECT_NE(text.find("progress:         step 120/200  loss 2.3412  1.2k tok/s  ETA 0:01:23\n"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("created:          2025-11-29 11:25:05 (5m ago)\n"), std::string::npos)
      << text;
  EXPECT_NE(text.find("finished:         -\n"), std::string::npos) << text;
  EXPECT_NE(text.find("error:            -\n"), std::string::npos) << text;
  EXPECT_NE(text.find("\n  name: demo\n  train:\n    steps: 200\n"), std::string::npos) << text;
}

TEST(FormatJobStatus, SaysWhyAQueuedJobWaitsAndHowOftenItWasPreempted) {
  v1::Job job = RunningJob();
  EXPECT_EQ(FormatJobStatus(job, kNowMs, absl::UTCTimeZone()).find("waiting:"), std::string::npos);
  job.set_state(v1::JOB_STATE_QUEUED);
  job.set_waiting("alice has 1 running jobs, the most allowed");
  job.set_preemptions(2);
  const std::string text = FormatJobStatus(job, kNowMs, absl::UTCTimeZone());
  EXPECT_NE(text.find("state:            queued\nwaiting:          alice has 1 running jobs, the "
                      "most allowed\n"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("preempted:        2 time(s), resumed each time\n"), std::string::npos)
      << text;
}

TEST(FormatJobState, RunningNamesItsDeviceAndNeverTheError) {
  EXPECT_EQ(FormatJobState(RunningJob()), "job 12 (demo): running on cuda:0");
  v1::Job failed = RunningJob();
  failed.set_state(v1::JOB_STATE_FAILED);
  failed.set_error("out of memory");
  EXPECT_EQ(FormatJobState(failed), "job 12 (demo): failed");
}

TEST(FormatSubmitted, NamesIdNameAndState) {
  v1::Job job;
  job.set_id(12);
  job.set_name("demo");
  job.set_state(v1::JOB_STATE_QUEUED);
  EXPECT_EQ(FormatSubmitted(job), "submitted job 12 (demo), queued");
  job.clear_name();
  job.set_state(v1::JOB_STATE_HELD);
  EXPECT_EQ(FormatSubmitted(job), "submitted job 12, held");
}

TEST(FormatNode, MemoryGpusAndNumaNodes) {
  v1::Node node;
  node.set_hostname("h200-01");
  node.set_backend("cuda");
  node.set_version("0.1.0");
  (*node.mutable_versions())["protobuf"] = "3.21.12";
  (*node.mutable_versions())["grpc"] = "1.51.1";
  node.set_cpu_count(16);
  node.set_host_memory_total_bytes(int64_t{512} << 30);
  node.set_host_memory_reserved_bytes(int64_t{96} << 30);
  node.set_host_memory_free_bytes(int64_t{400} << 30);
  v1::Gpu* gpu = node.add_gpus();
  gpu->set_index(0);
  gpu->set_name("NVIDIA H200");
  gpu->set_memory_bytes(int64_t{140} << 30);
  gpu->set_numa_node(-1);
  gpu->set_pcie_link("Gen5 x16");
  gpu->set_pci_bus_id("0000:1a:00.0");
  gpu->set_running_job(12);
  v1::Gpu* idle = node.add_gpus();
  *idle = *gpu;
  idle->set_index(1);
  idle->set_pci_bus_id("0000:2a:00.0");
  idle->set_running_job(0);
  v1::NumaNode* numa = node.add_numa_nodes();
  numa->set_id(0);
  numa->set_memory_total_bytes(int64_t{256} << 30);
  numa->set_memory_free_bytes(int64_t{200} << 30);
  for (int cpu : {0, 1, 2, 3, 8}) numa->add_cpus(cpu);
  EXPECT_EQ(FormatNode(node),
            "hostname:     h200-01\n"
            "backend:      cuda\n"
            "version:      0.1.0 (grpc 1.51.1, protobuf 3.21.12)\n"
            "cpus:         16\n"
            "host memory:  512.0 GiB total, 96.0 GiB reserved by jobs, 400.0 GiB free\n"
            "\n"
            "GPU  NAME            MEMORY  NUMA  PCIE LINK  PCI BUS ID    JOB\n"
            "  0  NVIDIA H200  140.0 GiB     -  Gen5 x16   0000:1a:00.0   12\n"
            "  1  NVIDIA H200  140.0 GiB     -  Gen5 x16   0000:2a:00.0    -\n"
            "\n"
            "NUMA     MEMORY       FREE  CPUS\n"
            "   0  256.0 GiB  200.0 GiB  0-3,8\n");
}

TEST(FormatNode, ShowsTheJobsStateOnNvmeWhenThereIsSome) {
  v1::Node node;
  node.set_hostname("h200-01");
  node.set_host_memory_total_bytes(int64_t{512} << 30);
  node.set_nvme_reserved_bytes(int64_t{300} << 30);
  EXPECT_NE(FormatNode(node).find("nvme:         300.0 GiB of jobs' optimizer state on disk\n"),
            std::string::npos)
      << FormatNode(node);
}

TEST(FormatNode, NoGpus) {
  v1::Node node;
  node.set_backend("cpu");
  EXPECT_NE(FormatNode(node).find("\nGPUs: none\n"), std::string::npos);
}

}  // namespace
}  // namespace megatrain::client
