// The planner: how a job runs on this machine, and how fast it will go.
//
// Given the model, the batch (sequences per step and their length), the device and host
// memory the job may take, and the machine's measured rates (MachineProfile), it chooses
//   - the micro-batch: sequences per micro-batch (all micro-batches of a step pass through
//     a layer while it is resident, so a larger one only buys matmul efficiency and costs
//     workspace);
//   - K, the activation checkpoint interval, and where the checkpoints live: on the
//     device (no PCIe) or in pinned host memory (device memory flat in depth, each
//     checkpoint crosses PCIe once each way);
//   - the number of weight slots: with one per layer, backward finds every layer still
//     on the device and only the forward upload crosses PCIe;
//   - how many layers keep their intermediates from forward to backward, in the device
//     memory left over, instead of recomputing them (a forward pass fewer each);
// and predicts the step from a cost model of the pipeline (pipeline.h): every layer's
// kernels (matmuls and attention at the profile's rates for these shapes, elementwise
// work at device bandwidth), its transfers each way, and the CPU AdamW of all parameters,
// overlapped the way the pipeline overlaps them. The plan names the binding resource.
//
// Every candidate is sized with StepDeviceBytes (step_memory.h), the same arithmetic the
// pipeline allocates by, so a plan that fits is a pipeline that allocates.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/common/backend.h"
#include "engine/engine.h"
#include "engine/model/config.h"
#include "engine/model/lora.h"
#include "engine/plan/machine_profile.h"
#include "engine/plan/step_memory.h"  // PipelineOptions

namespace megatrain {

// What a job may plan for out of the device memory a backend may allocate (`budget`,
// a cap included): less room for the library workspaces (cuBLAS, the CUDA context's own)
// that do not go through the backend.
int64_t PlannableDeviceBytes(int64_t budget);

struct PlanRequest {
  ModelConfig config;
  // train.freeze (freeze.h): those tensors are bf16 alone, with no state, gradient or
  // download. REQUIRES: valid patterns (a job's inputs are checked before it is planned).
  std::vector<std::string> freeze;
  LoraConfig lora;  // lora: adapters beside a frozen base (rank 0: none), model/lora.h
  int64_t seq_len = 0;
  int64_t rows_per_step = 0;        // sequences per optimizer step
  bool clipping = true;             // global-norm clipping (max_grad_norm > 0)
  // Where its gradients wait for the norm (optimizer.clip_store): auto takes fp32 unless no
  // plan then fits the host budget.
  ClipStore clip_store = ClipStore::kAuto;
  double router_aux_loss_coef = -1;  // MoE: train.router_aux_loss_coef; < 0: the config's
  int64_t loss_chunk_tokens = 4096;
  // Fixed by the user; 0 = the planner chooses.
  int64_t micro_batch_rows = 0;
  int64_t checkpoint_every = 0;
  ActivationPlacement checkpoints = ActivationPlacement::kAuto;
  int64_t kept_layers = -1;          // -1 = the planner chooses
  int64_t weight_slots = -1;         // -1 = the planner chooses
  // Dense layers' MLP tile (PipelineOptions::mlp_tile_tokens): -1 = the planner chooses
  // (a tile only when no plan over whole micro-batches fits), 0 = never.
  int64_t mlp_tile_tokens = -1;
  // Memory the job may take. device: what the backend may allocate (the job's cap, else
  // the free device memory; on the CPU backend, its buffers are host memory).
  int64_t device_budget_bytes = 0;
  int64_t host_budget_bytes = 0;
  // Data parallelism: devices of the budget above each take rows_per_step / devices of
  // the step's sequences, over the one host copy of the state. Their gradients are
  // reduce-scattered device to device (each drains 1/devices over its own PCIe link) or,
  // without reduce_on_devices, each drains all of it and the host adds.
  int64_t devices = 1;
  bool reduce_on_devices = true;
  // How AdamW's moments are kept (optimizer.state_dtype): the store's bytes per parameter
  // and the optimizer's rate follow.
  MomentDType moments = MomentDType::kF32;
  // optimizer.bf16_copy: yes keeps the bf16 copy that crosses PCIe (2 bytes a parameter
  // of host memory), no streams the fp32 master and rounds it on the device (twice the
  // upload bytes), auto drops the copy unless the step is then 5% slower (PCIe-bound).
  Bf16Copy bf16_copy = Bf16Copy::kAuto;
  // The NVMe tier: with a folder, the moments of the top decoder layers go to disk when
  // the host budget needs it (nvme_layers -1: as many as it needs; N: exactly N).
  std::string nvme_dir;
  int64_t nvme_layers = -1;
  // Device-to-device rate of that reduce-scatter (GB/s per device; NVLink, or PCIe peer
  // copies); 0: the PCIe rate (no NVLink assumed).
  double peer_gbps = 0;
  // Evaluation (the spec's eval section): sequences a forward-only pass evaluates; -1: as
  // many as the step's activation buffers hold (the set's size is not known yet); 0: none.
  int64_t eval_rows = 0;
};

// Predicted seconds and bytes of one steady-state step.
struct StepPrediction {
  double seconds = 0;
  double compute_seconds = 0;    // kernels on the compute stream
  double forward_seconds = 0;    // of which forward (embedding and layers, first pass)
  double head_seconds = 0;       // lm_head + loss, forward and backward
  double h2d_seconds = 0, d2h_seconds = 0;
  double pcie_seconds = 0;       // the PCIe floor: each way alone and both at once
  double optimizer_seconds = 0;  // CPU AdamW (and the clipping norm) of every parameter
  double disk_seconds = 0;       // the NVMe tier: its layers' moments read and written
  double reduce_seconds = 0;     // data parallelism: the reduce-scatter, on the D2H stream
  double peer_gbps = 0;          // at this device-to-device rate (the request's, or PCIe's)
  int64_t h2d_bytes = 0, d2h_bytes = 0;  // per device
  double model_flops = 0;        // 6 N T + 6 L s d T
  double hardware_flops = 0;     // what the kernels execute, recomputation included
  // Clipping: how long the next forward waits for the updates that run after the norm (0
  // when they keep ahead of it).
  double clip_wait_seconds = 0;
  std::string bound;             // "GPU compute" | "PCIe" | "CPU optimizer" | ...
};

struct Plan {
  // The choices (micro_batches: each device's share of the step).
  int64_t micro_batch_rows = 0;
  int64_t micro_batches = 0;
  int64_t devices = 1;
  int64_t checkpoint_every = 1;
  bool checkpoints_on_host = false;
  int64_t weight_slots = 2;
  int64_t kept_layers = 0;       // top layers whose intermediates are kept, not recomputed
  int64_t loss_chunk_tokens = 4096;
  int64_t mlp_tile_tokens = 0;   // dense layers' MLP over tiles of this many tokens (0: not)
  bool bf16_copy = true;         // the store keeps the bf16 weights (else the master streams)
  // Clipping's waiting gradients in 16 bits (HostOptimizerOptions::compact_held): the slabs
  // cycle as without clipping, and host_held_bytes hold the step's gradients.
  bool compact_held = false;
  int64_t nvme_layers = 0;       // top decoder layers whose moments are on disk
  int64_t host_disk_buffer_bytes = 0;  // the RAM those layers' moments cycle through
  int64_t disk_bytes = 0;        // the scratch file
  // Micro-batches an evaluation pass takes through each layer at once (0: no evaluation):
  // PipelineOptions::eval_micro_batches.
  int64_t eval_micro_batches = 0;
  // What they cost.
  StepPrediction step;
  int64_t device_bytes = 0;      // allocated by the pipeline, on each device
  int64_t host_bytes = 0;        // store + gradient slabs + host checkpoints (+ CPU buffers)
  int64_t host_store_bytes = 0, host_slab_bytes = 0, host_checkpoint_bytes = 0;
  int64_t host_held_bytes = 0;   // compact_held: the 16-bit gradients and the fp32 piece read

  int64_t num_parameters = 0;
  // The best plan's step with the other bf16_copy choice (0: not considered).
  double other_copy_step_seconds = 0;
  int candidates = 0;            // plans considered
  int fitting = 0;               // of which fit in memory
};

// The plan with the shortest predicted step that fits both budgets. FailedPrecondition
// names the memory that runs out (with the smallest plan's figures and what to change)
// when none fits; InvalidArgument for a request that makes no sense.
// The pipeline's options that carry out `plan` for sequences of `seq_len`: the one place a
// plan's choices become a pipeline's (the planner sizes each candidate with them, and the
// job and the benchmarks build their pipelines with them). What is not the plan's (the
// timeline, the collective, the aux-loss weight) keeps PipelineOptions' defaults.
PipelineOptions PipelineOptionsOf(const Plan& plan, int64_t seq_len);

[[nodiscard]] absl::StatusOr<Plan> MakePlan(const PlanRequest& request,
                                            const MachineProfile& profile, Backend* backend);

// The prediction for one fixed set of choices (plan fields micro_batch_rows ..
// loss_chunk_tokens, devices); fills the rest of `plan`.
void PredictPlan(const PlanRequest& request, const MachineProfile& profile, Backend* backend,
                 Plan* plan);

// The plan in words, for `megatrain plan` and the job log.
std::string DescribePlan(const Plan& plan, const PlanRequest& request,
                         const MachineProfile& profile);

}  // namespace megatrain
