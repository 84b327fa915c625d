#include "server/daemon_metrics.h"

#include <filesystem>
#include <fstream>
#include <iterator>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace megatrain::server {
namespace {

using T = MetricsRegistry::Type;

const char* kStreamNames[kNumStreams] = {"compute", "h2d", "d2h"};

// A DPO job's step metrics, TRL's names with '_' for '/' (StepReport::Preference's order).
constexpr const char* kPreferenceGauges[] = {"rewards_chosen",     "rewards_rejected",
                                             "rewards_accuracies", "rewards_margins",
                                             "logps_chosen",       "logps_rejected"};

// The gauges `prefix` + kPreferenceGauges of the job labelled `l`.
void SetPreferenceGauges(const std::string& prefix, const PreferenceReport& m,
                         const MetricLabels& l, MetricsRegistry* r) {
  const double values[] = {m.rewards_chosen,  m.rewards_rejected, m.rewards_accuracies,
                           m.rewards_margins, m.logps_chosen,     m.logps_rejected};
  for (size_t i = 0; i < std::size(values); ++i) {
    r->Set(absl::StrCat(prefix, kPreferenceGauges[i]), l, values[i]);
  }
}

std::string StateName(v1::JobState s) {
  std::string name = v1::JobState_Name(s);
  const std::string prefix = "JOB_STATE_";
  if (absl::StartsWith(name, prefix)) name = name.substr(prefix.size());
  for (char& c : name) c = static_cast<char>(std::tolower(c));
  return name;
}

}  // namespace

double KnownBf16PeakTflops(const std::string& device_name) {
  // Dense bf16 tensor-core peaks from the vendors' data sheets (SXM parts).
  struct Known {
    const char* name;
    double tflops;
  };
  static const Known kKnown[] = {{"H200", 989.4}, {"H100", 989.4}, {"H800", 989.4},
                                 {"GH200", 989.4}, {"A100", 312.0}, {"A800", 312.0},
                                 {"L40S", 362.05}, {"RTX 4090", 165.2}};
  for (const Known& k : kKnown) {
    if (absl::StrContains(device_name, k.name)) return k.tflops;
  }
  return 0;
}

DaemonMetrics::DaemonMetrics(MetricsRegistry* registry, JobStore* store,
                             const DaemonMetricsOptions& options)
    : registry_(registry), store_(store), options_(options) {
  MetricsRegistry& r = *registry_;
  r.Declare("megatrain_build_info", T::kGauge, "Always 1; labels say what this daemon runs on.");
  r.Set("megatrain_build_info", {{"gpu", options_.gpu}, {"device", options_.device_name}}, 1);
  r.Declare("megatrain_peak_tflops", T::kGauge,
            "The device's dense matmul peak that MFU is measured against, in TFLOP/s.");
  if (options_.peak_tflops > 0) r.Set("megatrain_peak_tflops", {{"gpu", options_.gpu}}, options_.peak_tflops);
  r.Declare("megatrain_jobs", T::kGauge, "Jobs in the database, by state.");
  r.Declare("megatrain_queue_depth", T::kGauge, "Jobs waiting for the device (queued).");
  r.Declare("megatrain_user_jobs", T::kGauge,
            "Jobs per user that are running or queued (state label).");
  r.Declare("megatrain_user_device_seconds", T::kGauge,
            "Recent device seconds per user, decaying with the fair-share half-life: the "
            "scheduler runs the user with the fewest first, within a priority.");
  r.Declare("megatrain_jobs_waiting", T::kGauge,
            "Queued jobs held back by their user's limits or by host memory (Job.waiting).");
  r.Declare("megatrain_preemptions_total", T::kCounter,
            "Jobs checkpointed and requeued for higher-priority work, by the preempted job's "
            "user.");
  r.Declare("megatrain_stream_busy_seconds_total", T::kCounter,
            "Seconds each stream was busy: compute, h2d and d2h from CUDA event (or thread) "
            "timings, optimizer from the CPU AdamW thread.");
  r.Declare("megatrain_optimizer_params_per_second", T::kGauge,
            "CPU AdamW's rate in the last step: the parameters it updates a step over its busy "
            "seconds.");
  r.Declare("megatrain_optimizer_in_step_fraction", T::kGauge,
            "CPU AdamW's rate in the last step over the machine profile's rate alone (the "
            "planner takes the profile's adamw_in_step_fraction).");
  r.Declare("megatrain_pcie_bytes_total", T::kCounter, "Bytes moved over PCIe, by direction.");
  r.Declare("megatrain_pcie_throughput_bytes_per_second", T::kGauge,
            "Bytes moved in the last step over the step's duration, by direction.");
  r.Declare("megatrain_pcie_transfer_rate_bytes_per_second", T::kGauge,
            "Bytes moved in the last step over the time its copy stream was busy.");
  r.Declare("megatrain_step_duration_seconds", T::kHistogram, "Duration of optimizer steps.",
            ExponentialBuckets(0.01, 2, 14));
  r.Declare("megatrain_steps_total", T::kCounter, "Optimizer steps completed.");
  r.Declare("megatrain_tokens_total", T::kCounter, "Tokens trained on.");
  r.Declare("megatrain_tokens_per_second", T::kGauge, "Tokens per second of the last step.");
  r.Declare("megatrain_model_tflops", T::kGauge,
            "Model TFLOP/s of the last step: (6 N + 6 L s d) tokens / time.");
  r.Declare("megatrain_mfu_ratio", T::kGauge,
            "Model FLOPs utilisation: model TFLOP/s over megatrain_peak_tflops.");
  r.Declare("megatrain_loss", T::kGauge, "Training loss of the last step (the LM loss).");
  r.Declare("megatrain_aux_loss", T::kGauge,
            "MoE models: the load-balancing loss of the last step (unweighted).");
  for (const char* name : kPreferenceGauges) {
    r.Declare(absl::StrCat("megatrain_dpo_", name), T::kGauge,
              absl::StrCat("DPO jobs: TRL's ", name, " of the last step (its pairs' mean)."));
    r.Declare(absl::StrCat("megatrain_eval_dpo_", name), T::kGauge,
              absl::StrCat("DPO jobs: TRL's ", name,
                           " of the last evaluation (the eval pairs' mean)."));
  }
  r.Declare("megatrain_eval_loss", T::kGauge,
            "Mean loss of the last evaluation of the job's eval set (forward only).");
  r.Declare("megatrain_eval_perplexity", T::kGauge, "exp(megatrain_eval_loss).");
  r.Declare("megatrain_eval_step", T::kGauge, "Steps trained when the last evaluation ran.");
  r.Declare("megatrain_grad_norm", T::kGauge, "Global gradient L2 norm of the last step, before clipping.");
  r.Declare("megatrain_learning_rate", T::kGauge, "Learning rate of the last step.");
  r.Declare("megatrain_prompts_done", T::kGauge,
            "Generate and eval jobs: prompts completed (those a resumed output held too).");
  r.Declare("megatrain_prompts_total", T::kGauge, "Generate and eval jobs: prompts in all.");
  r.Declare("megatrain_eval_accuracy", T::kGauge,
            "Eval jobs: exact-match accuracy over the prompts completed.");
  r.Declare("megatrain_job_step", T::kGauge, "Steps the job has completed.");
  r.Declare("megatrain_job_total_steps", T::kGauge, "Steps the job runs in all.");
  r.Declare("megatrain_host_store_bytes", T::kGauge,
            "Host memory held for the job: pinned (bf16 weights, gradient slabs) or pageable "
            "(fp32 master weights and AdamW moments).");
  r.Declare("megatrain_device_memory_used_bytes", T::kGauge, "Device memory the job holds.");
  r.Declare("megatrain_device_memory_peak_bytes", T::kGauge, "Device memory high-water mark.");
  r.Declare("megatrain_checkpoint_duration_seconds", T::kHistogram, "Time to write a checkpoint.",
            ExponentialBuckets(0.01, 2.5, 12));
  r.Declare("megatrain_checkpoint_bytes_total", T::kCounter, "Bytes written in checkpoints.");
  r.Declare("megatrain_checkpoint_wait_seconds_total", T::kCounter,
            "Training time spent waiting for checkpoints being written in the background.");
  AddProcessCollector(registry_);
  registry_->AddCollector([this](MetricsRegistry& reg) { CollectJobs(reg); });
}

void DaemonMetrics::CollectJobs(MetricsRegistry& r) {
  absl::StatusOr<std::map<v1::JobState, int64_t>> counts = store_->CountByState();
  if (!counts.ok()) return;
  r.Clear("megatrain_jobs");
  for (int s = v1::JOB_STATE_QUEUED; s <= v1::JOB_STATE_CANCELLED; ++s) {
    const auto state = static_cast<v1::JobState>(s);
    const auto it = counts->find(state);
    r.Set("megatrain_jobs", {{"state", StateName(state)}},
          it == counts->end() ? 0 : static_cast<double>(it->second));
  }
  const auto queued = counts->find(v1::JOB_STATE_QUEUED);
  r.Set("megatrain_queue_depth", {},
        queued == counts->end() ? 0 : static_cast<double>(queued->second));
  absl::StatusOr<std::vector<v1::Job>> active =
      store_->List({v1::JOB_STATE_RUNNING, v1::JOB_STATE_QUEUED}, "", 0, 1 << 20);
  if (!active.ok()) return;
  std::map<std::pair<std::string, std::string>, int> per_user;
  for (const v1::Job& job : *active) per_user[{job.owner(), StateName(job.state())}] += 1;
  r.Clear("megatrain_user_jobs");
  for (const auto& [key, n] : per_user) {
    r.Set("megatrain_user_jobs", {{"user", key.first}, {"state", key.second}}, n);
  }
  int waiting = 0;
  for (const v1::Job& job : *active) waiting += job.waiting().empty() ? 0 : 1;
  r.Set("megatrain_jobs_waiting", {}, waiting);
  absl::StatusOr<std::map<std::string, double>> usage =
      store_->Usage(options_.fair_share_half_life_hours * 3600);
  if (!usage.ok()) return;
  r.Clear("megatrain_user_device_seconds");
  for (const auto& [user, seconds] : *usage) {
    r.Set("megatrain_user_device_seconds", {{"user", user}}, seconds);
  }
}

void DaemonMetrics::Preempted(const v1::Job& job) {
  registry_->Add("megatrain_preemptions_total", {{"user", job.owner()}}, 1);
}

std::string DaemonMetrics::GpuLabel(const v1::Job& job) const {
  const std::string& d = job.device();
  if (d.rfind("cuda:", 0) == 0) return d.substr(5);
  return d.empty() ? options_.gpu : "cpu";
}

MetricLabels DaemonMetrics::JobLabels(const v1::Job& job) const {
  return {{"job", std::to_string(job.id())}, {"user", job.owner()}, {"gpu", GpuLabel(job)}};
}

void DaemonMetrics::JobStarted(const v1::Job& job, int64_t pinned_host_bytes,
                               int64_t pageable_host_bytes, int64_t step, int64_t total_steps) {
  MetricLabels l = JobLabels(job);
  MetricLabels pinned = l, pageable = l;
  pinned["kind"] = "pinned";
  pageable["kind"] = "pageable";
  registry_->Set("megatrain_host_store_bytes", pinned, static_cast<double>(pinned_host_bytes));
  registry_->Set("megatrain_host_store_bytes", pageable, static_cast<double>(pageable_host_bytes));
  registry_->Set("megatrain_job_step", l, static_cast<double>(step));
  registry_->Set("megatrain_job_total_steps", l, static_cast<double>(total_steps));
  for (const char* stream : {"compute", "h2d", "d2h", "optimizer"}) {
    MetricLabels s = l;
    s["stream"] = stream;
    registry_->Add("megatrain_stream_busy_seconds_total", s, 0);
  }
  for (const char* direction : {"h2d", "d2h"}) {
    MetricLabels d = l;
    d["direction"] = direction;
    registry_->Add("megatrain_pcie_bytes_total", d, 0);
  }
  registry_->Add("megatrain_checkpoint_bytes_total", l, 0);
  if (!options_.dcgm_job_mapping_dir.empty() && GpuLabel(job) != "cpu") {
    std::error_code ec;
    std::filesystem::create_directories(options_.dcgm_job_mapping_dir, ec);
    std::ofstream(std::filesystem::path(options_.dcgm_job_mapping_dir) / GpuLabel(job))
        << job.id() << "\n";
  }
}

void DaemonMetrics::StepDone(const v1::Job& job, const StepReport& report) {
  MetricsRegistry& r = *registry_;
  const MetricLabels l = JobLabels(job);
  for (int s = 0; s < kNumStreams; ++s) {
    MetricLabels sl = l;
    sl["stream"] = kStreamNames[s];
    r.Add("megatrain_stream_busy_seconds_total", sl, report.stream_busy_seconds[s]);
  }
  MetricLabels ol = l;
  ol["stream"] = "optimizer";
  r.Add("megatrain_stream_busy_seconds_total", ol, report.optimizer_busy_seconds);
  if (report.optimizer_params_per_second > 0) {
    r.Set("megatrain_optimizer_params_per_second", l, report.optimizer_params_per_second);
  }
  if (report.optimizer_in_step_fraction > 0) {
    r.Set("megatrain_optimizer_in_step_fraction", l, report.optimizer_in_step_fraction);
  }
  r.Add("megatrain_checkpoint_wait_seconds_total", l, report.checkpoint_wait_seconds);
  const struct {
    const char* direction;
    int64_t bytes;
    double busy;
  } dirs[] = {{"h2d", report.h2d_bytes, report.stream_busy_seconds[1]},
              {"d2h", report.d2h_bytes, report.stream_busy_seconds[2]}};
  for (const auto& d : dirs) {
    MetricLabels dl = l;
    dl["direction"] = d.direction;
    r.Add("megatrain_pcie_bytes_total", dl, static_cast<double>(d.bytes));
    if (report.seconds > 0) {
      r.Set("megatrain_pcie_throughput_bytes_per_second", dl, d.bytes / report.seconds);
    }
    if (d.busy > 0) r.Set("megatrain_pcie_transfer_rate_bytes_per_second", dl, d.bytes / d.busy);
  }
  r.Observe("megatrain_step_duration_seconds", l, report.seconds);
  r.Add("megatrain_steps_total", l, 1);
  r.Add("megatrain_tokens_total", l, static_cast<double>(report.tokens));
  r.Set("megatrain_tokens_per_second", l, report.tokens_per_second);
  r.Set("megatrain_model_tflops", l, report.model_tflops);
  if (options_.peak_tflops > 0) r.Set("megatrain_mfu_ratio", l, report.model_tflops / options_.peak_tflops);
  r.Set("megatrain_loss", l, report.loss);
  if (report.has_aux_loss) r.Set("megatrain_aux_loss", l, report.aux_loss);
  if (report.has_preference) SetPreferenceGauges("megatrain_dpo_", report.preference, l, &r);
  if (!report.evals.empty()) {
    const EvalReport& e = report.evals.back();
    if (e.has_preference) SetPreferenceGauges("megatrain_eval_dpo_", e.preference, l, &r);
    r.Set("megatrain_eval_loss", l, e.loss);
    r.Set("megatrain_eval_perplexity", l, e.perplexity);
    r.Set("megatrain_eval_step", l, static_cast<double>(e.step));
  }
  r.Set("megatrain_grad_norm", l, report.grad_norm);
  r.Set("megatrain_learning_rate", l, report.lr);
  r.Set("megatrain_job_step", l, static_cast<double>(report.step));
  r.Set("megatrain_device_memory_used_bytes", l, static_cast<double>(report.device_bytes_in_use));
  r.Set("megatrain_device_memory_peak_bytes", l, static_cast<double>(report.device_bytes_peak));
}

void DaemonMetrics::CheckpointWritten(const v1::Job& job, double seconds, int64_t bytes) {
  const MetricLabels l = JobLabels(job);
  registry_->Observe("megatrain_checkpoint_duration_seconds", l, seconds);
  registry_->Add("megatrain_checkpoint_bytes_total", l, static_cast<double>(bytes));
}

void DaemonMetrics::GenerationStepDone(const v1::Job& job, int64_t new_tokens) {
  MetricsRegistry& r = *registry_;
  const MetricLabels l = JobLabels(job);
  const v1::Progress& p = job.progress();
  r.Add("megatrain_steps_total", l, 1);
  r.Add("megatrain_tokens_total", l, static_cast<double>(new_tokens));
  r.Set("megatrain_tokens_per_second", l, p.tokens_per_second());
  r.Set("megatrain_prompts_done", l, static_cast<double>(p.prompts_done()));
  r.Set("megatrain_prompts_total", l, static_cast<double>(p.prompts_total()));
  if (job.kind() == "eval") r.Set("megatrain_eval_accuracy", l, p.accuracy());
}

void DaemonMetrics::JobStopped(const v1::Job& job) {
  registry_->RemoveSeries("job", std::to_string(job.id()));
  if (!options_.dcgm_job_mapping_dir.empty() && GpuLabel(job) != "cpu") {
    std::error_code ec;
    std::filesystem::remove(std::filesystem::path(options_.dcgm_job_mapping_dir) / GpuLabel(job), ec);
  }
}

}  // namespace megatrain::server
