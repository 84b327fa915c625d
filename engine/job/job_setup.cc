#include "engine/job/job_setup.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "engine/backend/devices.h"
#include "engine/backend/factory.h"
#include "engine/common/check.h"
#include "engine/common/status.h"
#include "engine/data/preference_set.h"
#include "engine/data/tokenizer.h"
#include "engine/job/eval_set.h"
#include "engine/job/inputs.h"
#include "engine/job/preference_pass.h"
#include "engine/model/freeze.h"
#include "engine/model/lora.h"
#include "engine/model/layout.h"
#include "engine/store/model_io.h"

namespace megatrain {

JobParts::~JobParts() {
  pipeline.reset();  // drains the streams
  if (replicas != nullptr) replicas->ReleasePipelines();
  optimizer.reset();
  replicas.reset();
  for (void* p : pinned) backend->UnpinHostRange(p);
}

PlanRequest JobPlanRequest(const JobSpec& spec, const ModelConfig& config,
                           int64_t device_budget_bytes, int64_t host_budget_bytes) {
  PlanRequest r;
  r.config = config;
  r.seq_len = spec.seq_len;
  r.rows_per_step = spec.rows_per_step();
  r.clipping = spec.max_grad_norm > 0;
  r.clip_store = spec.clip_store;
  r.router_aux_loss_coef = spec.router_aux_loss_coef;
  r.loss_chunk_tokens = spec.loss_chunk_tokens;
  r.micro_batch_rows = spec.micro_batch_rows > 0
                           ? spec.micro_batch_rows
                           : (spec.micro_batches > 0 ? r.rows_per_step / spec.micro_batches : 0);
  r.checkpoint_every = spec.activation_checkpoint_every;
  r.checkpoints = spec.activation_checkpoints;
  r.device_budget_bytes = device_budget_bytes;
  r.host_budget_bytes = host_budget_bytes;
  r.devices = std::max<int64_t>(1, spec.devices);
  r.reduce_on_devices = spec.gradient_reduce != GradientReduce::kHost;
  r.moments = spec.state_dtype;
  r.bf16_copy = spec.bf16_copy;
  r.nvme_dir = spec.nvme_dir;
  r.nvme_layers = spec.nvme_dir.empty() ? 0 : spec.nvme_layers;
  r.eval_rows = spec.eval.path.empty() ? 0 : (spec.eval.max_rows > 0 ? spec.eval.max_rows : -1);
  // A DPO job's reference pass and its eval pairs (max_rows counts pairs, not rows): as many
  // micro-batches at once as fit.
  if (spec.dpo.enabled && (!spec.dpo.reference_free || !spec.eval.path.empty())) {
    r.eval_rows = -1;
  }
  r.freeze = spec.freeze;
  r.lora = spec.lora;
  return r;
}

namespace {
// `saved`: the fingerprint of the checkpoint's job.
absl::Status AnotherJobsCheckpoints(const JobSpec& spec, const std::string& saved) {
  const std::vector<std::string> differ = FingerprintDifferences(saved, spec.Fingerprint());
  return absl::FailedPreconditionError(absl::StrCat(
      "checkpoint.dir ", spec.checkpoint_dir, " holds checkpoints of a different job (",
      differ.empty() ? "model, data or batch shape differ"
                     : absl::StrCat("it differs in ", absl::StrJoin(differ, ", ")),
      "); use a fresh checkpoint.dir"));
}
}  // namespace

absl::StatusOr<std::optional<TrainerState>> ResumeState(const JobSpec& spec,
                                                        std::string* newest) {
  if (newest != nullptr) newest->clear();
  if (spec.checkpoint_dir.empty()) return std::nullopt;
  const std::vector<std::string> existing = ListCheckpoints(spec.checkpoint_dir);
  if (existing.empty()) return std::nullopt;
  if (newest != nullptr) *newest = existing.back();
  absl::StatusOr<TrainerState> saved = ReadTrainerState(existing.back());
  if (!saved.ok()) return Annotate(saved.status(), absl::StrCat("resuming from ", existing.back()));
  if (saved->spec_fingerprint != spec.Fingerprint()) {
    return AnotherJobsCheckpoints(spec, saved->spec_fingerprint);
  }
  return std::optional<TrainerState>(*std::move(saved));
}

absl::StatusOr<std::string> DescribeFrozen(const JobSpec& spec, const ModelConfig& config) {
  if (spec.freeze.empty() && spec.lora.rank == 0) return std::string();
  ASSIGN_OR_RETURN(const ModelLayout layout, TrainingLayout(config, spec.lora, spec.freeze));
  std::string out;
  if (spec.lora.rank > 0) {
    int64_t adapters = 0;
    for (const UnitLayout& unit : layout.units) {
      for (const TensorSlot& t : unit.tensors) adapters += IsLora(t) ? t.num_elements : 0;
    }
    out = absl::StrFormat(
        "lora       rank %d, alpha %g (scale %.4g%s): %.2fM adapter parameters trained, %.3f%% "
        "of the model's\n",
        spec.lora.rank, spec.lora.alpha, spec.lora.Scale(), spec.lora.rslora ? ", rsLoRA" : "",
        adapters / 1e6, 100.0 * adapters / static_cast<double>(layout.TotalElements()));
  }
  int64_t tensors = 0, elements = 0, with_state = 0;
  for (const UnitLayout& unit : layout.units) {
    for (const TensorSlot& t : unit.tensors) {
      if (t.trainable || IsLora(t)) continue;
      ++tensors;
      elements += t.num_elements;
      if (unit.HasState(t)) with_state += t.num_elements;
    }
  }
  std::string between;
  if (with_state > 0) {
    between = absl::StrFormat(" (%.2fM between trainable tensors of a layer keep an unused fp32 "
                              "state)", with_state / 1e6);
  }
  return out + absl::StrFormat(
                   "frozen     %d tensors, %.2fM of %.2fM parameters (%s): bf16 alone, never "
                   "updated, no gradient%s\n",
                   tensors, elements / 1e6, layout.TotalElements() / 1e6,
                   spec.lora.rank > 0 ? "the base of the adapters" : "train.freeze", between);
}

absl::StatusOr<Plan> PlanKeepingSplit(const JobSpec& spec,
                                      const std::optional<TrainerState>& resume,
                                      const MachineProfile& profile, Backend* backend,
                                      PlanRequest* request, std::string* note) {
  note->clear();
  PlanRequest as_saved = *request;
  std::vector<std::string> kept_choices;
  if (resume.has_value() && resume->micro_batch_rows > 0 && spec.micro_batch_rows == 0 &&
      spec.micro_batches == 0) {
    as_saved.micro_batch_rows = resume->micro_batch_rows;
    as_saved.mlp_tile_tokens = resume->mlp_tile_tokens;
    kept_choices.push_back(absl::StrCat(
        "micro-batches of ", resume->micro_batch_rows, " sequences",
        resume->mlp_tile_tokens > 0
            ? absl::StrCat(", MLP tiles of ", resume->mlp_tile_tokens, " tokens")
            : ""));
  }
  if (resume.has_value() && !resume->clip_store.empty() && request->clipping &&
      spec.clip_store == ClipStore::kAuto) {
    as_saved.clip_store = resume->clip_store == "fp16" ? ClipStore::kFp16 : ClipStore::kFp32;
    kept_choices.push_back(absl::StrCat("clipping's gradients in ", resume->clip_store));
  }
  if (!kept_choices.empty()) {
    const std::string choices = absl::StrJoin(kept_choices, ", ");
    absl::StatusOr<Plan> kept = MakePlan(as_saved, profile, backend);
    if (kept.ok()) {
      *request = as_saved;
      *note = absl::StrCat("resume     ", choices, ", as the checkpoint's steps ran: the steps "
                           "repeat an uninterrupted run's bits\n");
      return kept;
    }
    *note = absl::StrCat("resume     the checkpoint's ", choices, " do not fit here (",
                         kept.status().message(), "): planned anew, so the steps from here "
                         "differ in their last bits from an uninterrupted run's\n");
  }
  return MakePlan(*request, profile, backend);
}

namespace {

// A DPO job's pairs (data.path, TRL's layout; JobPreferenceSetOptions).
absl::Status SetUpPairs(const JobSpec& spec, const Tokenizer& tokenizer, JobParts* p) {
  ASSIGN_OR_RETURN(const PreferenceSetOptions o,
                   JobPreferenceSetOptions(spec, p->tokenizer_dir, p->config.vocab_size));
  ASSIGN_OR_RETURN(PreferenceSet set, LoadPreferenceSet(o, tokenizer));
  p->dataset_stats = set.stats;
  p->pairs = set.pairs;
  p->pairs_fingerprint = set.fingerprint;
  p->pair_pad_id = JobPackOptions(spec, tokenizer, p->config.vocab_size).pad_id;
  p->pair_stream =
      std::make_unique<PairStream>(set.pairs, spec.seq_len, spec.data_seed, p->pair_pad_id);
  if (spec.eval.path.empty()) return absl::OkStatus();
  PreferenceSetOptions e = o;  // cut and templated as data's; its first max_rows pairs
  e.path = spec.eval.path;
  e.field = "eval.path";
  e.max_lines = spec.eval.max_rows;
  ASSIGN_OR_RETURN(PreferenceSet eval, LoadPreferenceSet(e, tokenizer));
  p->eval_stats = eval.stats;
  p->eval_pairs = eval.pairs;
  p->eval_pairs_fingerprint = eval.fingerprint;
  return absl::OkStatus();
}

absl::Status SetUpData(const JobSpec& spec, JobParts* p) {
  ASSIGN_OR_RETURN(std::unique_ptr<Tokenizer> tokenizer, LoadJobTokenizer(spec, &p->tokenizer_dir));
  const int64_t vocab = p->config.vocab_size;
  // Pre-tokenized ids are checked against the model's vocabulary, not the tokenizer's (a
  // DPO job's data are text: ValidateJobSpec).
  if (spec.data_format != DataFormat::kTokens && vocab < tokenizer->vocab_size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "data.tokenizer: the ", tokenizer->name(), " tokenizer has ", tokenizer->vocab_size(),
        " ids; the model's vocab_size is ", vocab));
  }
  if (spec.dpo.enabled) return SetUpPairs(spec, *tokenizer, p);
  ASSIGN_OR_RETURN(DatasetOptions data, JobDatasetOptions(spec, p->tokenizer_dir, vocab));
  ASSIGN_OR_RETURN(std::shared_ptr<const TokenDocs> docs,
                   OpenOrBuildTokenStore(data, *tokenizer, JobDataCacheDir(spec),
                                         &p->dataset_stats));
  p->packer = std::make_unique<Packer>(std::move(docs), spec.seq_len, spec.data_seed,
                                       JobPackOptions(spec, *tokenizer, vocab));
  if (!spec.eval.path.empty()) {
    ASSIGN_OR_RETURN(p->eval_docs, LoadEvalDocs(spec, *tokenizer, p->tokenizer_dir, vocab,
                                                &p->eval_stats));
    p->eval_pack = JobPackOptions(EvalDataSpec(spec), *tokenizer, vocab);
  }
  return absl::OkStatus();
}

// A DPO job's pairs each fit a micro-batch of `rows` rows: with one row, a pair's two
// sequences share it.
absl::Status CheckPairsFit(const JobSpec& spec, const std::vector<SequencePair>& pairs,
                           int64_t rows) {
  if (rows >= 2) return absl::OkStatus();  // each sequence is at most data.seq_len
  for (size_t k = 0; k < pairs.size(); ++k) {
    const size_t tokens = pairs[k].first.ids.size() + pairs[k].second.ids.size();
    if (static_cast<int64_t>(tokens) > spec.seq_len) {
      return absl::InvalidArgumentError(absl::StrCat(
          "dpo: pair ", k + 1, " of ", spec.data_path, " is ", tokens, " tokens, more than one row "
          "of data.seq_len (", spec.seq_len, ") holds, and the plan has one row a micro-batch: "
          "set train.micro_batch_rows to 2 or more, or dpo.max_length to at most ",
          spec.seq_len / 2));
    }
  }
  return absl::OkStatus();
}

// The plan: micro-batch, checkpoints, weight slots (engine/plan/planner.h), for this
// device's share of the step when there are several. resume: the trainer state of the
// checkpoint the job resumes from (ResumeState), whose split of a step the plan keeps when
// it still fits.
absl::Status SetUpPlan(const JobSpec& spec, const std::optional<TrainerState>& resume,
                       JobParts* p) {
  ASSIGN_OR_RETURN(const std::string frozen, DescribeFrozen(spec, p->config));  // checks it
  const int64_t device = PlannableDeviceBytes(p->backend->device_memory_budget());
  PlanRequest request = JobPlanRequest(spec, p->config, device, p->profile.host_memory_bytes);
  p->replicas->PlanReduction(&request);
  std::string resume_note;
  ASSIGN_OR_RETURN(p->plan, PlanKeepingSplit(spec, resume, p->profile, p->backend.get(),
                                             &request, &resume_note));
  p->plan_text = DescribePlan(p->plan, request, p->profile) + resume_note + frozen +
                 p->replicas->DescribeReduction();
  return p->pairs != nullptr ? CheckPairsFit(spec, *p->pairs, p->plan.micro_batch_rows)
                             : absl::OkStatus();
}

// Whether clipping holds every piece of a step in its slab (else the slabs cycle: without
// clipping, or with its gradients held in 16 bits).
bool HoldsSlabs(const JobSpec& spec, const Plan& plan) {
  return spec.max_grad_norm > 0 && !plan.compact_held;
}

// The host store, and the gradient slabs of the first device; what crosses PCIe (the
// bf16 weights and the slabs) is page-locked once, here.
absl::Status SetUpStore(const JobSpec& spec, JobParts* p) {
  // One GPU: the store on its node. GPUs on several nodes: interleaved across theirs, and
  // the optimizer's threads on all of them.
  const std::vector<BackendRequest>& requests = p->replicas->requests();
  std::vector<int> device_nodes;
  for (const BackendRequest& request : requests) device_nodes.push_back(BackendNumaNode(request));
  const std::vector<int> store_nodes = StoreNodes(device_nodes);
  // The optimizer's threads on the store's node; with the store over several, on all.
  p->optimizer_numa_node = store_nodes.size() > 1 ? -1 : BackendNumaNode(requests[0]);
  if (store_nodes.size() > 1) {
    absl::StrAppend(&p->plan_text, "numa       host store interleaved over NUMA nodes ",
                    absl::StrJoin(store_nodes, ", "), " (the GPUs' own)\n");
  }
  StoreOptions store_options;
  store_options.moments = spec.state_dtype;
  store_options.bf16_copy = p->plan.bf16_copy;
  store_options.nvme_dir = spec.nvme_dir;
  ASSIGN_OR_RETURN(const ModelLayout layout, TrainingLayout(p->config, spec.lora, spec.freeze));
  for (int64_t l = p->config.num_layers - p->plan.nvme_layers; l < p->config.num_layers; ++l) {
    if (layout.units[layout.DecoderUnit(l)].StateElements() > 0) {  // it has moments
      store_options.disk_units.push_back(layout.DecoderUnit(l));
    }
  }
  ASSIGN_OR_RETURN(p->store, HostStore::Create(layout, store_nodes, store_options));
  ASSIGN_OR_RETURN(p->slabs,
                   p->replicas->MakeSlabs(p->store->layout(), HoldsSlabs(spec, p->plan), 0));
  RETURN_IF_ERROR(p->backend->PinHostRange(p->store->transfer_base(), p->store->transfer_bytes()));
  p->pinned.push_back(p->store->transfer_base());
  RETURN_IF_ERROR(p->backend->PinHostRange(p->slabs->base(), p->slabs->bytes()));
  p->pinned.push_back(p->slabs->base());
  return absl::OkStatus();
}

// A pipeline per device as the plan says, the host optimizer, and with several devices
// the reducer through which their gradients reach it.
absl::Status SetUpPipelines(const JobSpec& spec, JobParts* p) {
  const Plan& plan = p->plan;
  PipelineOptions pipeline_options = PipelineOptionsOf(plan, spec.seq_len);
  pipeline_options.record_timeline = true;  // per-stream busy time for the metrics
  pipeline_options.router_aux_loss_coef = spec.router_aux_loss_coef;
  if (spec.dpo.enabled) {
    const PreferenceOptions dpo = PreferenceOptionsOf(spec.dpo);
    ObjectiveOptions& o = pipeline_options.objective;
    o.kind = ObjectiveKind::kPreference;
    o.preference_loss = dpo.loss;
    o.beta = dpo.beta;
    o.label_smoothing = dpo.label_smoothing;
  }
  pipeline_options.collective = p->replicas->collective(0);
  ASSIGN_OR_RETURN(p->pipeline, Pipeline::Create(p->config, p->store.get(), p->slabs.get(),
                                                 p->backend.get(), pipeline_options));
  HostOptimizerOptions optimizer_options;
  optimizer_options.hyper.beta1 = spec.beta1;
  optimizer_options.hyper.beta2 = spec.beta2;
  optimizer_options.hyper.eps = spec.eps;
  optimizer_options.weight_decay = spec.weight_decay;
  optimizer_options.max_grad_norm = spec.max_grad_norm;
  optimizer_options.compact_held = plan.compact_held;
  optimizer_options.numa_node = p->optimizer_numa_node;
  p->optimizer = std::make_unique<HostOptimizer>(p->store.get(), p->slabs.get(),
                                                 p->backend.get(), optimizer_options);
  return p->replicas->Build(p->config, p->store.get(), p->optimizer.get(), p->slabs.get(),
                            pipeline_options, HoldsSlabs(spec, plan));
}

// The model's weights: the model folder's, else random (model.init_seed).
absl::Status LoadBase(const JobSpec& spec, const ModelConfig& config, HostStore* store) {
  if (spec.model_path.empty()) {
    RandomInitWeights(config, spec.init_seed, store);
    return absl::OkStatus();
  }
  ASSIGN_OR_RETURN(ModelTensorReader reader, ModelTensorReader::OpenFolder(spec.model_path));
  return LoadWeights(reader, store);
}

// The weights `Restore` starts from (the checkpoint `newest`'s state in *saved).
absl::Status LoadWeightsFrom(const JobSpec& spec, const std::string& newest, JobParts* p,
                             TrainerState* saved) {
  // A LoRA job's checkpoints hold its adapters alone: the base is the model's, always.
  const bool adapters = HasLora(p->store->layout());
  if (newest.empty() || adapters) RETURN_IF_ERROR(LoadBase(spec, p->config, p->store.get()));
  if (!newest.empty()) {
    return Annotate(LoadCheckpoint(newest, p->store.get(), saved),
                    absl::StrCat("resuming from ", newest));
  }
  if (adapters && !spec.lora_adapter.empty()) {
    return LoadLoraAdapter(spec.lora_adapter, spec.lora, p->store.get());
  }
  if (adapters) InitLoraAdapters(spec.lora.init, spec.init_seed, p->store.get());
  return absl::OkStatus();
}

// The weights and the trainer state: from checkpoint.dir's newest checkpoint (`newest`),
// which must be this job's, else the model folder's, else random (model.init_seed); a
// LoRA job's adapters from lora.adapter, else drawn (model.init_seed).
absl::Status Restore(const JobSpec& spec, const std::string& newest, JobParts* p) {
  TrainerState& state = p->state;
  state.data_seed = spec.data_seed;
  state.init_seed = spec.init_seed;
  state.spec_fingerprint = spec.Fingerprint();
  TrainerState saved;
  RETURN_IF_ERROR(LoadWeightsFrom(spec, newest, p, &saved));
  p->restored_from = newest;
  if (!newest.empty()) {
    if (saved.spec_fingerprint != state.spec_fingerprint) {
      return AnotherJobsCheckpoints(spec, saved.spec_fingerprint);
    }
    RETURN_IF_ERROR(Annotate(p->packer != nullptr ? p->packer->Seek(saved.data)
                                                  : p->pair_stream->Seek(saved.data),
                             "resuming the data position"));
    state = saved;
    p->resumed_from_step = saved.step;
    p->last_saved_step = saved.step;
  }
  state.micro_batch_rows = p->plan.micro_batch_rows;  // what this run's checkpoints record
  state.mlp_tile_tokens = p->plan.mlp_tile_tokens;
  state.clip_store = spec.max_grad_norm <= 0 ? "" : p->plan.compact_held ? "fp16" : "fp32";
  p->optimizer->Restored(state.step);
  return absl::OkStatus();
}

}  // namespace

absl::Status LoadStartWeights(const JobSpec& spec, JobParts* p) {
  TrainerState saved;
  return LoadWeightsFrom(spec, p->restored_from, p, &saved);
}

absl::Status LoadReferenceWeights(const JobSpec& spec, JobParts* p) {
  MT_CHECK(!spec.dpo.reference.empty());
  ASSIGN_OR_RETURN(ModelTensorReader reader, ModelTensorReader::OpenFolder(spec.dpo.reference));
  // LoadWeights leaves every adapter zero: the reference is the model alone.
  return Annotate(LoadWeights(reader, p->store.get()), "dpo.reference");
}

absl::StatusOr<std::unique_ptr<JobParts>> SetUpJob(const JobSpec& spec,
                                                   const MachineProfile* profile) {
  auto p = std::make_unique<JobParts>();
  RETURN_IF_ERROR(CheckJobFolders(spec));
  ASSIGN_OR_RETURN(p->config, ResolveModelConfig(spec));
  p->num_parameters = NumParameters(p->config);
  RETURN_IF_ERROR(SetUpData(spec, p.get()));
  const BackendRequest first{spec.backend, spec.device_memory_cap_bytes};
  ASSIGN_OR_RETURN(p->backend, CreateBackend(first));
  if (profile != nullptr) {
    p->profile = *profile;
  } else {
    ASSIGN_OR_RETURN(p->profile, LoadMachineProfile(p->backend.get()));
  }
  ASSIGN_OR_RETURN(p->replicas, Replicas::Create(spec, p->backend.get(), first));
  // Another job's checkpoints are refused here, before the host store is made.
  std::string newest;
  ASSIGN_OR_RETURN(const std::optional<TrainerState> resume, ResumeState(spec, &newest));
  RETURN_IF_ERROR(SetUpPlan(spec, resume, p.get()));
  RETURN_IF_ERROR(SetUpStore(spec, p.get()));
  RETURN_IF_ERROR(SetUpPipelines(spec, p.get()));
  RETURN_IF_ERROR(Restore(spec, newest, p.get()));
  return p;
}

}  // namespace megatrain
