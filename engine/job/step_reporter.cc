#include "engine/job/step_reporter.h"

namespace megatrain {

StepReporter::StepReporter(const JobSpec& spec, const ModelConfig& config, const Plan& plan,
                           const MachineProfile& profile, int64_t updated_parameters,
                           const Backend* backend, const HostOptimizer* optimizer)
    : total_steps_(spec.steps),
      tokens_per_step_(spec.tokens_per_step_resolved()),
      is_moe_(config.is_moe()),
      // Causal attention: 6 * L * seq * H*D per token (forward 2 * 2 * L * H*D * seq/2,
      // times 3 for backward).
      flops_per_token_(6.0 * MatmulParameters(config) +
                       6.0 * config.num_layers * spec.seq_len * config.num_heads *
                           config.head_dim),
      moments_(spec.state_dtype),
      bf16_copy_(plan.bf16_copy),
      profile_(profile),
      updated_parameters_(updated_parameters),
      backend_(backend),
      optimizer_(optimizer) {}

StepReport StepReporter::Report(const StepResult& r, int64_t step, double lr,
                                double checkpoint_wait_seconds) {
  StepReport report;
  report.step = step;
  report.total_steps = total_steps_;
  report.loss = r.loss;
  report.has_aux_loss = is_moe_;
  report.aux_loss = r.aux_loss;
  report.aux_loss_coef = r.aux_loss_coef;
  report.lr = lr;
  report.grad_norm = r.grad_norm;
  report.tokens = tokens_per_step_;
  report.seconds = r.seconds;
  report.tokens_per_second = r.seconds > 0 ? report.tokens / r.seconds : 0;
  report.model_tflops = flops_per_token_ * report.tokens_per_second / 1e12;
  report.device_bytes_peak = backend_->device_bytes_peak();
  report.device_bytes_in_use = backend_->device_bytes_in_use();
  report.stream_busy_seconds = StreamBusySeconds(r.timeline);
  const double optimizer_busy = optimizer_->busy_seconds();
  report.optimizer_busy_seconds = optimizer_busy - optimizer_busy_seen_;
  optimizer_busy_seen_ = optimizer_busy;
  if (report.optimizer_busy_seconds > 0) {
    report.optimizer_params_per_second = updated_parameters_ / report.optimizer_busy_seconds;
    report.optimizer_in_step_fraction = profile_.AdamWInStepFraction(
        updated_parameters_, report.optimizer_busy_seconds, moments_, bf16_copy_);
  }
  report.h2d_bytes = r.h2d_bytes;
  report.d2h_bytes = r.d2h_bytes;
  const double capture_wait = optimizer_->capture_wait_seconds();
  report.checkpoint_wait_seconds = capture_wait - capture_wait_seen_ + checkpoint_wait_seconds;
  capture_wait_seen_ = capture_wait;
  return report;
}

}  // namespace megatrain
