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
//                clip_store: auto|fp32|fp16, # clipping's gradients waiting for the norm
//                bf16_copy: yes|no|auto,      # keep the bf16 weights that cross PCIe (2
//                                             # B/param more), or stream the master; auto:
//                                             # the planner's choice
//                nvme_dir: "",                # a local disk for the moments of layers
//                nvme_layers: -1}             # that do not fit in RAM: how many (-1: as
//                                             # many as the host budget needs)
//   lora:       {rank,                        # required with the section; kind train only
//                alpha: 2*rank, rslora: false,
//                target_modules: all-linear,  # or a list of q_proj .. down_proj
//                init: default|gaussian, dropout: 0,  # only 0: adapters train without it
//                adapter: ""}                 # a PEFT adapter folder to start from
//   dpo:        {beta: 0.1, loss: sigmoid|ipo|hinge,  # a preference job (kind train):
//                label_smoothing: 0, rpo_alpha: 0,     # data.path holds {prompt, chosen,
//                reference_free: false,                # rejected} pairs (docs/dpo.md)
//                max_length: 0,                        # a sequence's tokens; 0: seq_len
//                truncation: keep_start|keep_end,      # max_length's cut
//                max_prompt_length: 0,                 # the prompt's last tokens kept
//                max_completion_length: 0,             # a completion's first tokens kept
//                reference: ""}                        # a model folder as the reference
//   checkpoint: {dir, every_steps, keep_last, max_shard_bytes, background}
//   backend:    auto | cpu | cuda
//   device_memory_cap_bytes: 0      # the most device memory the job may take; 0 = all free
//
// JobSpec, its parser and its one validation stage are the engine's public API
// (engine.h); this header adds what only the engine needs of a spec. Unknown fields,
// wrong types and out-of-range values are InvalidArgument naming the field ("train.steps
// must be >= 1, got -3"). Relative paths resolve against the spec file's folder.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/engine.h"
#include "engine/model/config.h"
#include "engine/optim/schedule.h"
#include "engine/store/host_store.h"

namespace megatrain {

// The spec fields in which two Fingerprint()s differ, as the spec names them, with both
// values where they are short: "data.seed (0 there, 1 here)". Empty when they agree or
// `there` cannot be read (a checkpoint written by another version).
std::vector<std::string> FingerprintDifferences(const std::string& there,
                                                const std::string& here);

// data.tokenizer as the spec writes it: auto, byte, model, or the tokenizer file's path.
std::string TokenizerText(const JobSpec& spec);

// The model config the spec names (from the folder's config.json or the inline one).
[[nodiscard]] absl::StatusOr<ModelConfig> ResolveModelConfig(const JobSpec& spec);

}  // namespace megatrain
