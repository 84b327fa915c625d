// The job spec: everything one training job needs, parsed once at the edge from YAML.
// The local runner (megatrain-train) and the daemon take the same document.
//
//   name: demo
//   model:      {path: DIR} | {config: {...config.json fields...}} | {config_path: FILE}
//               init_seed: 0                      # random init only
//   data:       {path: FILE.jsonl, format: text|alpaca|sharegpt|messages|tokens,
//                text_field: text, tokenizer: auto|byte|model|PATH,
//                chat_template: auto|plain|llama2|llama3|qwen3|gptoss|qwen2.5|
//                mistral-v1|mistral-v3|mistral-v3-tekken, chat_date: "",
//                packing: pack|pad, truncation: auto|split|truncate,
//                on_bad_line: fail|skip, cache_dir: "", tokenize_threads: 0,
//                seq_len: 256, seed: 0}
//   train:      {steps, tokens_per_step, lr, schedule, warmup_steps,
//                min_lr_ratio, weight_decay, beta1, beta2, eps, max_grad_norm,
//                loss_chunk_tokens,
//                router_aux_loss_coef,  # MoE: the load-balancing loss's weight; left out:
//                                       # config.json's (0 unless output_router_logits)
//                # left out (0 / auto), the planner chooses these (engine/plan/planner.h):
//                micro_batch_rows, micro_batches, activation_checkpoint_every,
//                devices: 1   # data parallel: the step's micro-batches split over N devices
//                gradient_reduce: auto|device|host  # how N devices' gradients meet
//                activation_checkpoints: auto|device|host}
//   optimizer:  {state_dtype: fp32|bf16|int8,   # how AdamW's moments are kept (the master
//                                             # is fp32 always): 12, 8 or 6 B/param of state
//                bf16_copy: yes|no|auto,      # keep the bf16 weights that cross PCIe (2
//                                             # B/param more), or stream the master; auto:
//                                             # the planner's choice
//                nvme_dir: "",                # a local disk for the moments of layers
//                nvme_layers: -1}             # that do not fit in RAM: how many (-1: as
//                                             # many as the host budget needs)
//   checkpoint: {dir, every_steps, keep_last, max_shard_bytes, background}
//   backend:    auto | cpu | cuda
//   device_memory_cap_bytes: 0      # the most device memory the job may take; 0 = all free
//
// Every field is validated here: unknown fields, wrong types and out-of-range values are
// InvalidArgument naming the field ("train.steps must be a positive integer, got -3").
// Relative paths resolve against `base_dir` (the spec file's folder).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/model/config.h"
#include "engine/optim/schedule.h"
#include "engine/store/host_store.h"

namespace megatrain {

struct JobSpec {
  std::string name = "job";
  // model: exactly one of model_path / inline config.
  std::string model_path;        // Hugging Face folder
  std::string model_config_json; // config.json text for random init
  uint64_t init_seed = 0;

  std::string data_path;
  std::string data_format = "text";
  std::string text_field = "text";
  // "auto" (the model folder's tokenizer when it has a tokenizer.json, else byte), "byte"
  // (UTF-8 bytes, bos 256, eos 257), "model" (the model folder's tokenizer.json and
  // tokenizer_config.json), or a path to a tokenizer.json or the folder holding it.
  // data.format tokens uses none: its ids are checked against the model's vocab_size.
  std::string tokenizer = "auto";
  // Chat formats: "auto" (the family of tokenizer_config.json's chat_template, else
  // plain), "plain" ("User: ..\n\nAssistant: ..<eos>"), or a family name.
  std::string chat_template = "auto";
  std::string chat_date;              // gpt-oss "Current date"; "" = the day it tokenizes
  std::string packing = "pack";       // pack | pad
  // split: a long document continues in the next row; truncate: each document whole in
  // one row, cut at seq_len. auto: truncate for chat formats, split for text and tokens.
  std::string truncation = "auto";
  std::string on_bad_line = "fail";   // fail | skip
  // Where the tokenized dataset is kept and reused; "" = <checkpoint.dir>/data-cache,
  // or the temporary folder when the job has no checkpoint.dir.
  std::string data_cache_dir;
  int64_t tokenize_threads = 0;       // 0 = one per core
  int64_t seq_len = 256;
  uint64_t data_seed = 0;

  int64_t steps = 100;
  // The batch: tokens per optimizer step, a multiple of seq_len. 0: micro_batch_rows *
  // micro_batches * seq_len (each 1 when not given).
  int64_t tokens_per_step = 0;
  int64_t micro_batch_rows = 0;  // sequences per micro-batch; 0 = the planner's choice
  int64_t micro_batches = 0;     // micro-batches per step; 0 = rows per step / rows
  // Data parallelism: devices (cuda:i .. cuda:i+N-1 from the backend's, or N CPU backends)
  // each run an equal share of the step's micro-batches over the one host copy of the
  // state. The global batch, and so the checkpoints, do not depend on it.
  int64_t devices = 1;
  // With devices > 1: "device" reduce-scatters each gradient on the devices (NCCL; CPU
  // backends: their threads) so each drains 1/N; "host" drains whole gradients and adds
  // them on the host; "auto" is device when it can be set up, else host.
  std::string gradient_reduce = "auto";
  ScheduleOptions schedule;      // lr, type, warmup, total (= steps), min ratio
  double weight_decay = 0.0;
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
  double max_grad_norm = 1.0;    // <= 0 disables clipping
  int64_t activation_checkpoint_every = 0;  // K; 0 = the planner's choice
  std::string activation_checkpoints = "auto";  // where: auto | device | host
  int64_t loss_chunk_tokens = 4096;
  double router_aux_loss_coef = -1;  // < 0: the model config's (PipelineOptions)
  // optimizer.state_dtype: AdamW's moments in fp32 (PyTorch's AdamW, bit for bit), bf16 or
  // int8 (block-scaled), rounded stochastically (optim/adamw.h).
  MomentDType state_dtype = MomentDType::kF32;
  // optimizer.bf16_copy: "yes", "no", or "auto" (the planner: no, unless the step is
  // PCIe-bound enough that the copy pays). The same bf16 values reach the kernels either way.
  std::string bf16_copy = "auto";
  // optimizer.nvme_dir / nvme_layers: the NVMe tier (store/moment_disk.h). "" = none.
  std::string nvme_dir;
  int64_t nvme_layers = -1;

  std::string checkpoint_dir;    // "" = no checkpoints
  int64_t checkpoint_every_steps = 0;  // 0 = only at the end
  int64_t keep_last = 3;
  int64_t max_shard_bytes = 5ll << 30;
  // Periodic checkpoints are written while training goes on (background_checkpoint.h);
  // false: training waits while each is written.
  bool checkpoint_background = true;

  std::string backend = "auto";
  int64_t device_memory_cap_bytes = 0;  // 0: the device's free memory

  // Sequences per optimizer step, and tokens.
  int64_t rows_per_step() const;
  int64_t tokens_per_step_resolved() const { return rows_per_step() * seq_len; }
  // The settings a resume must agree with (model, data, batch shape), as a string.
  std::string Fingerprint() const;
};

// The spec fields in which two Fingerprint()s differ, as the spec names them, with both
// values where they are short: "data.seed (0 there, 1 here)". Empty when they agree or
// `there` cannot be read (a checkpoint written by another version).
std::vector<std::string> FingerprintDifferences(const std::string& there,
                                                const std::string& here);

// Parses a YAML job spec. `source` names it in errors.
[[nodiscard]] absl::StatusOr<JobSpec> ParseJobSpec(const std::string& yaml_text,
                                                   const std::string& base_dir,
                                                   const std::string& source = "job spec");
[[nodiscard]] absl::StatusOr<JobSpec> LoadJobSpec(const std::string& path);

// The spec as a complete YAML document (every field, absolute paths): what the daemon
// stores and runs. ParseJobSpec(JobSpecToYaml(s), "") == s.
std::string JobSpecToYaml(const JobSpec& spec);

// The model config the spec names (from the folder's config.json or the inline one).
[[nodiscard]] absl::StatusOr<ModelConfig> ResolveModelConfig(const JobSpec& spec);

}  // namespace megatrain
