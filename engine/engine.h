// The engine's public API: all that server/ includes of the engine, with engine/common/*.h.
// Value types (the job spec, a plan's summary, a step's report, the machine's GPUs) and
// two abstract classes made by factories: a Planner, which sizes jobs for one kind of
// device, and a TrainingJob, which runs one. Their implementations (engine/job/) and
// everything they are built of stay behind this header; a build test compiles server/
// with an include path that reaches nothing else (tests/structure/isolation).
//
//   absl::StatusOr<JobSpec> spec = LoadJobSpec("job.yaml");
//   absl::StatusOr<std::unique_ptr<TrainingJob>> job = TrainingJob::Create(*spec, {});
//   while (!(*job)->done()) { absl::StatusOr<StepReport> r = (*job)->Step(); ... }
//
// The spec is parsed once, at the edge, into types: every choice is an enum here, and a
// name that is none of its values is InvalidArgument naming the field and the values it
// allows (ParseSpecName). Every spec, however it was made (YAML, the API's message, a
// test), passes the one validation stage, ValidateJobSpec, before anything uses it.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "engine/common/backend.h"  // kNumStreams

namespace megatrain {

// ---- The job spec ------------------------------------------------------------------

// data.format
enum class DataFormat { kText, kAlpaca, kShareGpt, kMessages, kTokens };
// data.tokenizer: auto (the model folder's tokenizer.json when it has one, else byte),
// byte (UTF-8 bytes, bos 256, eos 257), model (the model folder's), or a file: a
// tokenizer.json or the folder holding it (JobSpec::tokenizer_path).
enum class TokenizerSource { kAuto, kByte, kModel, kFile };
// data.chat_template: auto (the family of tokenizer_config.json's chat_template, else
// plain), plain ("User: ..\n\nAssistant: ..<eos>"), or a family.
enum class ChatTemplate {
  kAuto, kPlain, kLlama2, kLlama3, kQwen3, kGptOss, kQwen25, kMistralV1, kMistralV3,
  kMistralV3Tekken,
};
enum class Packing { kPack, kPad };  // data.packing
// data.truncation: split (a long document continues in the next row), truncate (each
// document whole in one row, cut at seq_len); auto: truncate for chat formats, else split.
enum class Truncation { kAuto, kSplit, kTruncate };
enum class OnBadLine { kFail, kSkip };  // data.on_bad_line
// train.gradient_reduce, with devices > 1: device reduce-scatters each gradient on the
// devices (NCCL; CPU backends: their threads); host drains whole gradients and adds them
// on the host; auto is device when it can be set up, else host.
enum class GradientReduce { kAuto, kDevice, kHost };
// train.activation_checkpoints: where the checkpointed layer inputs are kept.
enum class ActivationPlacement { kAuto, kDevice, kHost };
// train.schedule: Hugging Face's get_{constant,linear,cosine}_schedule_with_warmup.
enum class ScheduleType { kConstant, kLinear, kCosine };
// optimizer.state_dtype: AdamW's moments in fp32 (PyTorch's AdamW, bit for bit), bf16 or
// int8 (block-scaled), rounded stochastically; the master is fp32 always.
enum class MomentDType { kF32, kBF16, kInt8 };
// optimizer.bf16_copy: keep the bf16 weights that cross PCIe (2 B/param more), or stream
// the master; auto: the planner's choice. The same bf16 values reach the kernels either way.
enum class Bf16Copy { kAuto, kYes, kNo };
// optimizer.clip_store: where clipping's gradients wait for the global norm: fp32 (exact;
// every slab of the step held, 4 bytes a parameter), fp16 (halves under a power-of-two
// scale per block of 128, 2.03 bytes a parameter: engine/optim/held_gradients.h), or auto
// (fp32 unless the job then does not fit the host memory).
enum class ClipStore { kAuto, kFp32, kFp16 };

// The learning-rate schedule (optim/schedule.h computes it).
struct ScheduleOptions {
  ScheduleType type = ScheduleType::kConstant;
  double lr = 0.0;            // peak learning rate
  int64_t warmup_steps = 0;   // steps of linear warmup from 0 to lr
  int64_t total_steps = 0;    // linear / cosine reach their floor here (= steps)
  double min_lr_ratio = 0.0;  // floor of the decay, as a fraction of lr, in [0, 1]
};

// One training job: what docs/job-spec.md documents, field by field. Relative paths are
// resolved against the spec's folder when it is parsed: every path here is absolute or "".
// Completions of prompts by a model folder or a job's checkpoint (docs/generation.md).
// A job of kind generate or eval carries one (JobSpec::generate): its model_path and
// backend are then the job's.
struct GenerateSpec {
  std::string model_path;              // config.json and *.safetensors
  // Prompts: `prompts` (texts) first, then the JSONL file's lines: {"prompt": text},
  // {"messages": [{role, content}]} (with chat) or {"input_ids": [...]}; a line may carry an
  // "answer" (score).
  std::vector<std::string> prompts;
  std::string prompts_path;
  std::string output_path;             // completions as JSONL; "" = none
  // An output that already holds completions (of a run stopped part way) keeps them, and
  // only the prompts without one are completed; false: the output starts empty.
  bool resume_output = false;
  std::string tokenizer = "auto";      // auto | byte | model | a tokenizer.json (data.tokenizer's)
  bool chat = false;                   // render the model's chat template, generation prompt on
  // Sampling: temperature 0 is greedy; the same seed and options give the same tokens.
  double temperature = 0;
  int64_t top_k = 0;                   // 0: off
  double top_p = 1.0;                  // in (0, 1]
  uint64_t seed = 0;
  int64_t max_new_tokens = 256;
  std::vector<std::string> stop_strings;
  std::vector<int32_t> stop_ids;       // the tokenizer's eos too, unless ignore_eos
  bool ignore_eos = false;
  // Exact match against each line's "answer": the completion's last number, or the last
  // match of answer_pattern (its first group); numbers compare as numbers.
  bool score = false;
  std::string answer_pattern;
  std::string backend = "auto";        // auto | cpu | cuda | cuda:N
  int64_t max_sequences = 0;           // in flight at once; 0: as many as the device holds
};

// lora: LoRA adapters (Hu et al. 2021, arXiv 2106.09685) on the decoder layers'
// projections, named as PEFT's LoraConfig names them; engine/model/lora.h adds them to a
// model's layout. lora.init, how A is drawn (B starts at zero, so the adapted model starts
// as the base): PEFT's init_lora_weights True (kaiming-uniform with a = sqrt(5):
// U(-1/sqrt(in), 1/sqrt(in))) or "gaussian" (N(0, 1/r)).
enum class LoraInit { kDefault, kGaussian };

struct LoraConfig {
  int64_t rank = 0;     // 0: no adapters
  double alpha = 0;     // the scale's numerator
  bool rslora = false;  // scale alpha / sqrt(rank) (Kalajdzievski 2023), else alpha / rank
  // PEFT's module names (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj);
  // empty: all of them ("all-linear").
  std::vector<std::string> target_modules;
  LoraInit init = LoraInit::kDefault;
  double Scale() const;
};

// dpo.loss: DPO's sigmoid loss (with label smoothing: conservative DPO), IPO, or the hinge
// (SLiC), as TRL names them (engine/layers/preference_loss.h).
enum class DpoLoss { kSigmoid, kIpo, kHinge };
// dpo.truncation: a sequence over dpo.max_length keeps its first tokens or its last.
enum class DpoTruncation { kKeepStart, kKeepEnd };

// What a job does: train (the default), complete prompts (generate), or complete them and
// score exact match against each prompt's answer (eval).
enum class JobKind { kTrain, kGenerate, kEval };

struct JobSpec {
  std::string name = "job";
  JobKind kind = JobKind::kTrain;
  // Kinds generate and eval: the prompts and sampling (model_path and backend are the
  // spec's; score is set for eval). Such a spec has no data, eval, train or optimizer.
  GenerateSpec generate;
  // model: exactly one of model_path / an inline config.json.
  std::string model_path;         // Hugging Face folder
  std::string model_config_json;  // config.json text for random init
  uint64_t init_seed = 0;

  std::string data_path;
  DataFormat data_format = DataFormat::kText;
  std::string text_field = "text";
  TokenizerSource tokenizer = TokenizerSource::kAuto;
  std::string tokenizer_path;     // TokenizerSource::kFile only
  ChatTemplate chat_template = ChatTemplate::kAuto;
  std::string chat_date;          // gpt-oss "Current date"; "" = the day it tokenizes
  Packing packing = Packing::kPack;
  Truncation truncation = Truncation::kAuto;
  OnBadLine on_bad_line = OnBadLine::kFail;
  // Where the tokenized dataset is kept and reused; "" = <checkpoint.dir>/data-cache,
  // or the temporary folder when the job has no checkpoint.dir.
  std::string data_cache_dir;
  int64_t tokenize_threads = 0;   // 0 = one per core
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
  GradientReduce gradient_reduce = GradientReduce::kAuto;
  ScheduleOptions schedule;      // lr, type, warmup, total (= steps), min ratio
  double weight_decay = 0.0;
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
  double max_grad_norm = 1.0;    // <= 0 disables clipping
  int64_t activation_checkpoint_every = 0;  // K; 0 = the planner's choice
  ActivationPlacement activation_checkpoints = ActivationPlacement::kAuto;
  int64_t loss_chunk_tokens = 4096;
  // MoE: the load-balancing loss's weight; < 0: the model config's (0 unless
  // output_router_logits).
  double router_aux_loss_coef = -1;
  // train.freeze: patterns of the tensors that stay as they are (engine/model/freeze.h):
  // bf16 alone in host memory, no gradient, no optimizer state (docs/adapters.md).
  std::vector<std::string> freeze;
  // dpo: a preference job (direct preference optimization and its variants): data.path
  // holds {prompt, chosen, rejected} pairs (TRL's layout, engine/data/preference.h); the
  // reference's log-probabilities come from one forward-only pass with the starting
  // weights (or dpo.reference's), kept in checkpoint.dir (engine/job/preference_pass.h).
  // With eval.path, the eval set is pairs too, evaluated with the same metrics.
  struct Dpo {
    bool enabled = false;
    double beta = 0.1;              // the KL penalty's weight (IPO: its tau)
    DpoLoss loss = DpoLoss::kSigmoid;
    double label_smoothing = 0;     // sigmoid only, in [0, 0.5)
    double rpo_alpha = 0;           // the chosen completions' NLL beside (RPO; 0: none)
    bool reference_free = false;    // no reference: its log-probabilities are 0
    int64_t max_length = 0;         // each sequence's tokens at most; 0: data.seq_len
    DpoTruncation truncation = DpoTruncation::kKeepStart;
    // TRL's cuts before max_length's: the prompt keeps its last max_prompt_length tokens,
    // each completion its first max_completion_length (0: uncut).
    int64_t max_prompt_length = 0;
    int64_t max_completion_length = 0;
    // A model folder (a checkpoint of ours is one) whose weights are the reference, in
    // place of the starting weights; "" = the starting weights.
    std::string reference;
  } dpo;
  LoraConfig lora;  // lora: adapters (rank 0: none), model/lora.h
  // lora.adapter: a PEFT adapter folder the adapters start from ("": drawn from lora.init).
  std::string lora_adapter;
  MomentDType state_dtype = MomentDType::kF32;
  Bf16Copy bf16_copy = Bf16Copy::kAuto;
  ClipStore clip_store = ClipStore::kAuto;
  // optimizer.nvme_dir / nvme_layers: a local disk for the moments of layers that do not
  // fit in RAM, and how many (-1: as many as the host budget needs). "" = none.
  std::string nvme_dir;
  int64_t nvme_layers = -1;

  // eval: a held-out set evaluated while the job trains, forward only (no weight and no
  // position in the data changes). It is tokenized, templated, packed and loss-masked as
  // data is (data's tokenizer, text_field, chat template, packing, truncation), in its
  // own format, in file order; rows of data.seq_len.
  struct Eval {
    std::string path;               // JSONL; "" = no evaluation
    DataFormat format = DataFormat::kText;  // data.format where the spec gives none
    int64_t every_steps = 0;        // also before the first step and after the last; 0: only those
    int64_t max_rows = 0;           // sequences evaluated, the file's first; 0: all of them
  } eval;

  std::string checkpoint_dir;          // "" = no checkpoints
  int64_t checkpoint_every_steps = 0;  // 0 = only at the end
  int64_t keep_last = 3;
  int64_t max_shard_bytes = 5ll << 30;
  // Periodic checkpoints are written while training goes on; false: training waits while
  // each is written.
  bool checkpoint_background = true;

  // The device: auto, cpu, cuda or cuda:N (a device's name, checked by ValidateJobSpec).
  std::string backend = "auto";
  int64_t device_memory_cap_bytes = 0;  // 0: the device's free memory

  // Sequences per optimizer step, and tokens.
  int64_t rows_per_step() const;
  int64_t tokens_per_step_resolved() const { return rows_per_step() * seq_len; }
  // The settings a resume must agree with (model, data, batch shape), as a string.
  std::string Fingerprint() const;
};

// Each choice's name in a spec ("alpaca", "pad", "host", ...).
const char* SpecName(DataFormat value);
const char* SpecName(TokenizerSource value);  // "auto" | "byte" | "model" | "file"
const char* SpecName(ChatTemplate value);
const char* SpecName(Packing value);
const char* SpecName(Truncation value);
const char* SpecName(OnBadLine value);
const char* SpecName(GradientReduce value);
const char* SpecName(ActivationPlacement value);
const char* SpecName(ScheduleType value);
const char* SpecName(MomentDType value);
const char* SpecName(Bf16Copy value);
const char* SpecName(ClipStore value);  // "auto" | "fp32" | "fp16"
const char* SpecName(JobKind value);  // "train" | "generate" | "eval"
const char* SpecName(LoraInit value);  // "default" | "gaussian"
const char* SpecName(DpoLoss value);   // "sigmoid" | "ipo" | "hinge"
const char* SpecName(DpoTruncation value);  // "keep_start" | "keep_end"
// The value of E named `name`: InvalidArgument "<field> must be one of a, b, c; got 'x'"
// otherwise. Defined for every E that SpecName takes.
template <typename E>
[[nodiscard]] absl::StatusOr<E> ParseSpecName(absl::string_view field, absl::string_view name);

// What a spec's fields say, for a spec built field by field (the API's message): a path as
// given, resolved against the spec's folder when relative ("" stays ""); data.tokenizer's
// text (auto, byte, model, or a tokenizer.json or its folder, resolved likewise) into
// spec->tokenizer and spec->tokenizer_path (InvalidArgument for "").
std::string ResolveSpecPath(const std::string& base_dir, const std::string& path);
// A tokenizer field's text as the spec keeps it: a named source (auto, byte, model) as it
// is, else the tokenizer.json path resolved; "" stays "".
std::string ResolveTokenizerText(const std::string& base_dir, const std::string& text);
// Whether a tokenizer field's text names a source (auto, byte, model) rather than a file.
bool IsTokenizerName(const std::string& text);
[[nodiscard]] absl::Status SetSpecTokenizer(const std::string& text, const std::string& base_dir,
                                            JobSpec* spec);

// The one validation stage: ranges, the batch's shape, the name, the device, the model
// source, UTF-8 of every string. InvalidArgument naming the field and what it allows
// ("train.steps must be >= 1, got -3"). ParseJobSpec runs it; a spec built otherwise
// (the API's structured message, a test) must pass it before use.
[[nodiscard]] absl::Status ValidateJobSpec(const JobSpec& spec);

// Parses and validates a YAML job spec; relative paths resolve against `base_dir` (the
// spec file's folder). `source` names it in errors. Unknown fields are errors.
[[nodiscard]] absl::StatusOr<JobSpec> ParseJobSpec(const std::string& yaml_text,
                                                   const std::string& base_dir,
                                                   const std::string& source = "job spec");
[[nodiscard]] absl::StatusOr<JobSpec> LoadJobSpec(const std::string& path);
// The spec as a complete YAML document (every field, absolute paths): the canonical form
// the daemon stores and runs. ParseJobSpec(JobSpecToYaml(s), "") == s.
std::string JobSpecToYaml(const JobSpec& spec);

// The folders a job writes in (checkpoint.dir, data.cache_dir, optimizer.nvme_dir), where
// given: INVALID_ARGUMENT naming the field when one is there but is not a folder.
[[nodiscard]] absl::Status CheckJobFolders(const JobSpec& spec);
// Checks, before a job is queued, what its spec refers to: its folders, the model, the
// tokenizer and the dataset (readable, its first lines valid in the job's format, not
// empty). NOT_FOUND / INVALID_ARGUMENT naming the field. Reads files: call it as the
// job's user.
[[nodiscard]] absl::Status ValidateJobInputs(const JobSpec& spec);

// ---- Plans ------------------------------------------------------------------------

// How a job will run on a device, as the planner chose and predicts it.
struct PlanSummary {
  int64_t micro_batch_rows = 0;
  int64_t micro_batches = 0;
  int64_t checkpoint_every = 0;     // activation checkpoints: every K layers
  bool checkpoints_on_host = false;
  int64_t weight_slots = 0;
  int64_t kept_layers = 0;          // layers whose intermediates stay on the device
  int64_t mlp_tile_tokens = 0;
  int64_t eval_micro_batches = 0;   // through each layer at once in an evaluation; 0: none
  int64_t sequences = 0;            // generate / eval jobs: sequences decoded at once
  int64_t nvme_layers = 0;
  int64_t nvme_bytes = 0;
  int64_t devices = 1;
  int64_t tokens_per_step = 0;
  // The predicted step: seconds, what bounds it, and its parts.
  double step_seconds = 0;
  double tokens_per_second = 0;
  double model_tflops = 0;
  std::string bound;                // "GPU compute" | "PCIe" | "CPU optimizer" | ...
  double compute_seconds = 0;
  double pcie_seconds = 0;
  double optimizer_seconds = 0;
  double reduce_seconds = 0;
  int64_t h2d_bytes = 0;
  int64_t d2h_bytes = 0;
  int64_t device_bytes = 0;         // on each device
  int64_t host_bytes = 0;
  std::string text;                 // the plan in words, then the warnings
  // What a valid job will do that its owner may not mean, each naming the field and a fix.
  std::vector<std::string> warnings;
};

// Plans jobs for one kind of device of this machine, without running them, from the
// machine's profile (its PCIe, matmul, attention and CPU AdamW rates). Thread-safe.
class Planner {
 public:
  // device: "cpu" or "cuda:N". The profile is read from `profile_path` when it matches
  // this machine, else measured (seconds) and written there. host_budget_bytes: the host
  // memory a job may hold.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<Planner>> Create(
      const std::string& device, const std::string& profile_path, int64_t host_budget_bytes);
  // Plans with a given profile (profile_json(), as another Planner wrote it) and no
  // device: for "cpu" a CPU backend, for "cuda" a device of `device_budget_bytes` on a
  // node of `gpus` GPUs. Touches no GPU: submission checks plan this way.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<Planner>> CreateFromProfile(
      const std::string& device, const std::string& profile_json, int64_t device_budget_bytes,
      int64_t gpus, int64_t host_budget_bytes);
  virtual ~Planner() = default;

  // The plan of `spec`, keeping the split of a step of the checkpoint it resumes from (its
  // checkpoint.dir's newest, read here: call it as the job's user). ResourceExhausted
  // naming the memory that runs out; FailedPrecondition when checkpoint.dir holds another
  // job's checkpoints; InvalidArgument for more devices than the node has.
  [[nodiscard]] virtual absl::StatusOr<PlanSummary> Plan(const JobSpec& spec) = 0;

  virtual std::string profile_json() const = 0;  // the profile, for CreateFromProfile
  virtual double gemm_peak_tflops() const = 0;   // the profile's bf16 matmul peak
  virtual std::string note() const = 0;          // where the profile came from
  // The device memory a job finds on one device (before the planner's margins).
  virtual int64_t device_budget_bytes() = 0;
  virtual int64_t gpus() const = 0;              // GPUs on the node
};

// ---- Running a job ----------------------------------------------------------------

// A DPO job's metrics over a set of pairs, as TRL names them: rewards/chosen,
// rewards/rejected (beta times each completion's log-ratio to the reference, the mean over
// the pairs), rewards/accuracies (the share of pairs whose chosen reward is higher),
// rewards/margins, logps/chosen, logps/rejected.
struct PreferenceReport {
  double rewards_chosen = 0, rewards_rejected = 0, rewards_accuracies = 0;
  double rewards_margins = 0, logps_chosen = 0, logps_rejected = 0;
  int64_t pairs = 0;
};

// An evaluation of the spec's eval set (forward only), on the weights after `step` steps.
struct EvalReport {
  int64_t step = 0;          // steps trained (0: before the first)
  // mean -log p(target) over the set's targets; a DPO job's: its preference loss over the
  // set's pairs (RPO's included), with the pairs' metrics in `preference`
  double loss = 0;
  double perplexity = 0;     // exp(loss) (a DPO job's: 0)
  bool has_preference = false;
  PreferenceReport preference;
  int64_t targets = 0;       // tokens with a target
  int64_t tokens = 0;        // tokens evaluated, padding included
  double seconds = 0;
  double tokens_per_second = 0;
};

struct StepReport {
  int64_t step = 0;          // steps completed, this one included
  int64_t total_steps = 0;
  double loss = 0;           // the LM loss; a DPO job's: its preference loss (RPO's included)
  // A DPO job's step: its pairs' metrics.
  bool has_preference = false;
  using Preference = PreferenceReport;
  PreferenceReport preference;
  // MoE models: the load-balancing loss (unweighted) and its weight in the trained loss.
  bool has_aux_loss = false;
  double aux_loss = 0;
  double aux_loss_coef = 0;
  double lr = 0;
  double grad_norm = 0;
  int64_t tokens = 0;        // tokens in this step
  double seconds = 0;
  double tokens_per_second = 0;
  double model_tflops = 0;   // 6 * params * tokens (+ attention), per second, / 1e12
  int64_t device_bytes_peak = 0;  // device memory high-water mark (0 on the CPU backend)
  int64_t device_bytes_in_use = 0;
  // Busy seconds of this step per stream (CUDA event or thread timings), by StreamId, and
  // of the optimizer thread (AdamW of this step's gradients may finish in the next one).
  std::array<double, kNumStreams> stream_busy_seconds{};
  double optimizer_busy_seconds = 0;
  // AdamW's rate in the step: the parameters it updates each step over optimizer_busy_seconds
  // (0 when the optimizer was not busy), and that over the machine profile's rate alone (the
  // planner's adamw_in_step_fraction, as this step measured it: when it differs from the
  // profile's, `train_bench --calibrate` measures the box's).
  double optimizer_params_per_second = 0;
  double optimizer_in_step_fraction = 0;
  int64_t h2d_bytes = 0;     // PCIe traffic of the step
  int64_t d2h_bytes = 0;
  // The checkpoints completed during Step(), oldest first: the one of this step
  // (checkpoint.background: false, or the final one), or ones written while training went
  // on, of earlier steps (a background one may finish in the step that writes the next).
  std::vector<std::string> checkpoint_paths;
  // Seconds this step waited for checkpoints being written in the background: its
  // optimizer updates for a unit not yet written, and the step for the previous
  // checkpoint's fsync when the next one is due (ideally 0).
  double checkpoint_wait_seconds = 0;
  // A periodic checkpoint that could not be written (a full disk, say): training goes
  // on, the earlier checkpoints stand, and the next interval tries again. The final
  // checkpoint failing fails Step() instead.
  std::string checkpoint_error;
  std::vector<int64_t> failed_checkpoint_steps;  // the steps whose checkpoint failed
  // Evaluations run by Step(), in order: before the first step (step 0) and after this one
  // (eval.every_steps, and after the last step).
  std::vector<EvalReport> evals;
};

// Where a job runs, as the daemon places it, beside what its owner's spec says.
struct RunOptions {
  std::string device;          // "cpu" or "cuda:N" in place of spec.backend; "" = the spec's
  std::string checkpoint_dir;  // in place of spec.checkpoint_dir; "" = the spec's
  // The machine profile (Planner::profile_json) the job plans with; "" = the one the
  // engine finds for its device (so a spec plans alike run locally or by the daemon).
  std::string profile_json;
};

// The spec as it runs where `options` place it: their device and checkpoint folder where
// given (what TrainingJob::Create runs, and what the daemon checks its files against).
JobSpec PlacedSpec(const JobSpec& spec, const RunOptions& options);

// A started job, as its owner sees it in logs and status.
struct JobDescription {
  int64_t step = 0;               // steps done (of the checkpoint it resumed from)
  int64_t resumed_from_step = 0;  // 0: a fresh start
  double last_loss = 0;           // the resumed checkpoint's (NaN where it recorded none)
  bool done = false;              // it resumed from its final step
  std::string dataset_summary;    // what building (or reusing) the tokenized data found
  std::string eval_summary;       // the eval set likewise, and its micro-batches ("": none)
  std::string architecture;       // config.json's class name
  int64_t num_parameters = 0;
  std::string backend_name;
  int64_t tokens_per_step = 0;
  std::string plan_text;          // how it runs, in words
  // Host bytes page-locked for transfers, and pageable (fp32 master weights and moments).
  int64_t pinned_host_bytes = 0;
  int64_t pageable_host_bytes = 0;
};

// One job, end to end: the model in host memory, its data, the streamed steps, the
// optimizer and the checkpoints. Create() loads or initialises the model and tokenizes the
// data; when the checkpoint folder already holds a checkpoint of this job, it resumes from
// the newest. Then Step() until done(). Thread-compatible: one thread drives it.
class TrainingJob {
 public:
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<TrainingJob>> Create(
      const JobSpec& spec, const RunOptions& options);
  // Finishes a checkpoint being written in the background.
  virtual ~TrainingJob() = default;

  virtual JobDescription Describe() const = 0;
  // Runs one optimizer step; saves a checkpoint when the spec says so.
  [[nodiscard]] virtual absl::StatusOr<StepReport> Step() = 0;
  // Evaluates the eval set on the weights of the last completed step, changing nothing
  // (Step() runs the evaluations the spec asks for). FailedPrecondition without one.
  [[nodiscard]] virtual absl::StatusOr<EvalReport> Evaluate() = 0;
  virtual bool done() const = 0;
  virtual int64_t step() const = 0;  // steps completed
  // Writes a checkpoint of the state after the last completed step and prunes old ones;
  // training waits (a background checkpoint being written is finished first).
  [[nodiscard]] virtual absl::StatusOr<std::string> SaveCheckpoint() = 0;
  // The next Step() writes a checkpoint of its state in the background.
  virtual void CheckpointNextStep() = 0;
  // The last checkpoint written: seconds it took and bytes.
  virtual double last_checkpoint_seconds() const = 0;
  virtual int64_t last_checkpoint_bytes() const = 0;
};

// ---- Generation ---------------------------------------------------------------------


// One prompt's completion as Run() reports it.
struct CompletionReport {
  int64_t index = 0;                   // the prompt's
  std::string text;                    // cut before a stop string
  std::string finish_reason;           // "stop" | "length"
  std::string json;                    // its output line
};

struct GenerationSummary {
  int64_t prompts = 0;
  int64_t new_tokens = 0;              // generated, over all prompts
  int64_t correct = 0;                 // score only
  double accuracy = 0;                 // score only: correct / prompts
  double seconds = 0;                  // generating (after loading)
  double tokens_per_second = 0;
};

// One generation job: Create() loads the model (its bf16 weights alone), the tokenizer and
// the prompts and plans the device (resident or streamed weights, sequences in flight);
// Run() completes every prompt. Thread-compatible.
class GenerationJob {
 public:
  // InvalidArgument / NotFound naming the field or the prompt: options out of range, an
  // empty prompts file, a prompt past the model's positions, a folder without weights, a
  // line without an answer when scoring; ResourceExhausted when one sequence cannot fit.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<GenerationJob>> Create(
      const GenerateSpec& spec, const RunOptions& options);
  virtual ~GenerationJob() = default;
  // How it runs, in words: the prompts, the sequences at once, resident or streamed.
  virtual std::string Describe() const = 0;
  // Completes the next `max_prompts` prompts (<= 0: all) that have no completion yet,
  // writing each completion's JSON line to the output as it finishes (index, prompt,
  // completion, finish_reason, ids, logprobs; answer, extracted and correct when scoring),
  // and calling `on_completion` with it (may be null). Returns the totals so far (prompts
  // and correct count those an output resumed with). DataLoss when the output cannot be
  // written.
  [[nodiscard]] virtual absl::StatusOr<GenerationSummary> RunSome(
      int64_t max_prompts, const std::function<void(const CompletionReport&)>& on_completion) = 0;
  // RunSome() of every prompt left.
  [[nodiscard]] absl::StatusOr<GenerationSummary> Run(
      const std::function<void(const CompletionReport&)>& on_completion);
  virtual int64_t num_prompts() const = 0;
  virtual int64_t prompts_done() const = 0;  // with a completion in the output
  virtual int64_t sequences() const = 0;     // decoded at once
};

// A generate or eval job spec's GenerateSpec: its model, backend and score (eval), and the
// output in checkpoint.dir (completions.jsonl) where it names none.
GenerateSpec GenerateSpecOf(const JobSpec& spec);

// Complete checkpoints under `root`, oldest first (by step).
std::vector<std::string> ListCheckpoints(const std::string& root);

// ---- The machine ------------------------------------------------------------------

// True when this build has the CUDA backend and a CUDA device is visible.
bool CudaAvailable();

struct GpuInfo {
  int index = 0;
  std::string name;
  int64_t memory_bytes = 0;
  int numa_node = -1;
  std::string pci_bus_id;
};
// The CUDA devices this build can use (empty without CUDA).
std::vector<GpuInfo> ListGpus();

// NCCL's environment defaults (NCCL_NVLS_ENABLE=0 unless set). setenv races with any
// other thread's getenv: call it first thing in main(), before threads start.
void SetCollectiveDefaults();

}  // namespace megatrain
