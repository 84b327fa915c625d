// A step's report (engine.h's StepReport) from what its run measured: rates (tokens/s,
// model TFLOP/s), device memory, the streams' and the optimizer's busy time and AdamW's
// rate in the step, PCIe bytes, and the seconds it waited for checkpoints.
//
// The optimizer's counters run from its creation: the reporter keeps what it saw at the
// last report, so that each report holds its own step's share. The checkpoint fields are
// JobCheckpoints' (the Trainer adds them).
//
// Thread-compatible: the thread that drives the job calls it.
#pragma once

#include <cstdint>

#include "engine/common/backend.h"
#include "engine/engine.h"
#include "engine/model/config.h"
#include "engine/optim/host_optimizer.h"
#include "engine/pipeline/pipeline.h"
#include "engine/plan/machine_profile.h"
#include "engine/plan/planner.h"

namespace megatrain {

class StepReporter {
 public:
  // `profile`: what the plan was made with (AdamW's rate alone). `backend` (the first
  // device's) and `optimizer` outlive the reporter.
  StepReporter(const JobSpec& spec, const ModelConfig& config, const Plan& plan,
               const MachineProfile& profile, int64_t updated_parameters,
               const Backend* backend, const HostOptimizer* optimizer);

  // Step `step`'s report from its `result` (every device's, added up): `lr` its learning
  // rate, `checkpoint_wait_seconds` what it waited for the previous checkpoint before it
  // ran (JobCheckpoints::BeforeStep). The checkpoints' own fields are left empty.
  StepReport Report(const StepResult& result, int64_t step, double lr,
                    double checkpoint_wait_seconds);

 private:
  int64_t total_steps_;
  int64_t tokens_per_step_;
  bool is_moe_;
  double flops_per_token_;  // 6 N for the matmuls, plus causal attention
  MomentDType moments_;
  bool bf16_copy_;
  MachineProfile profile_;
  int64_t updated_parameters_;  // every unit, each step
  const Backend* backend_;
  const HostOptimizer* optimizer_;
  double optimizer_busy_seen_ = 0;  // the optimizer's counters at the last report
  double capture_wait_seen_ = 0;
};

}  // namespace megatrain
