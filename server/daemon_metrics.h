// What megatraind exports to Prometheus: the box (jobs by state, queue, users, host and
// device memory, process figures) and each running job (streams, PCIe, throughput,
// optimisation figures, checkpoints). Names follow Prometheus conventions: base units in
// the name, counters end in _total. Labels: job (id), user, gpu ("0", or "cpu"),
// stream (compute | h2d | d2h | optimizer), direction (h2d | d2h), state. Series of a job
// are removed when it stops running, so cardinality stays bounded by the jobs running.
//
// Stream busy seconds come from CUDA event timings (threads' on the CPU backend) and the
// optimizer thread's own clock: measured, never estimated.
//
// With dcgm_job_mapping_dir set, the running job's id is written to <dir>/<gpu index>
// (DCGM exporter's HPC job mapping), so stock DCGM dashboards show our job ids too.
#pragma once

#include <string>

#include "engine/engine.h"
#include "megatrain/v1/jobs.pb.h"
#include "server/job_store.h"
#include "server/metrics.h"

namespace megatrain::server {

struct DaemonMetricsOptions {
  std::string gpu = "cpu";       // the gpu label: the CUDA device index, or "cpu"
  std::string device_name;       // for megatrain_gpu_info
  double peak_tflops = 0;        // the GEMM peak MFU is against; 0 = no MFU series
  std::string dcgm_job_mapping_dir;
  double fair_share_half_life_hours = 168;  // megatrain_user_device_seconds decays with it
};

class DaemonMetrics {
 public:
  DaemonMetrics(MetricsRegistry* registry, JobStore* store, const DaemonMetricsOptions& options);

  // A job began running: host memory it holds, where it starts, how far it goes.
  void JobStarted(const v1::Job& job, int64_t pinned_host_bytes, int64_t pageable_host_bytes,
                  int64_t step, int64_t total_steps);
  void StepDone(const v1::Job& job, const StepReport& report);
  // A generate or eval job's step (its progress already in `job`): the new tokens it made,
  // its rate, prompts done of all, and an eval's accuracy.
  void GenerationStepDone(const v1::Job& job, int64_t new_tokens);
  void CheckpointWritten(const v1::Job& job, double seconds, int64_t bytes);
  void JobStopped(const v1::Job& job);
  // The job was checkpointed and requeued for higher-priority work.
  void Preempted(const v1::Job& job);

  MetricsRegistry* registry() { return registry_; }

 private:
  MetricLabels JobLabels(const v1::Job& job) const;
  // The gpu label of a job: its device's index ("cuda:1" -> "1"), "cpu", or options.gpu
  // for a job with no device recorded.
  std::string GpuLabel(const v1::Job& job) const;
  void CollectJobs(MetricsRegistry& r);

  MetricsRegistry* registry_;
  JobStore* store_;
  DaemonMetricsOptions options_;
};

// The bf16 dense tensor peak of a known GPU name in TFLOP/s, 0 when unknown.
double KnownBf16PeakTflops(const std::string& device_name);

}  // namespace megatrain::server
