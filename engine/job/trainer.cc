#include "engine/job/trainer.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <optional>
#include <thread>
#include <filesystem>
#include <fstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "engine/backend/devices.h"
#include "engine/backend/factory.h"
#include "engine/plan/rates.h"
#include "engine/common/status.h"
#include "engine/data/jsonl.h"
#include "engine/data/tokenizer.h"
#include "engine/model/safetensors.h"
#include "engine/plan/machine_profile.h"
#include "engine/optim/schedule.h"
#include "engine/store/model_io.h"

namespace megatrain {

Trainer::~Trainer() {
  background_.reset();  // an unfinished background checkpoint is abandoned
  // Updates still running read the pipelines' events: let them finish first (unless a
  // step failed half-way: its held gradients are never applied).
  if (optimizer_ != nullptr && !step_failed_) optimizer_->Drain();
  pipeline_.reset();  // drains the streams
  for (Replica& r : replicas_) r.pipeline.reset();
  reducer_.reset();
  collectives_.clear();
  optimizer_.reset();
  for (Replica& r : replicas_) {
    if (r.slabs != nullptr) r.backend->UnpinHostRange(r.slabs->base());
  }
  replicas_.clear();
  for (void* p : pinned_) backend_->UnpinHostRange(p);
}

absl::StatusOr<std::unique_ptr<Trainer>> Trainer::Create(const JobSpec& spec,
                                                         const MachineProfile* profile) {
  std::unique_ptr<Trainer> t(new Trainer);
  RETURN_IF_ERROR(t->Init(spec, profile));
  return t;
}

PlanRequest JobPlanRequest(const JobSpec& spec, const ModelConfig& config,
                           int64_t device_budget_bytes, int64_t host_budget_bytes) {
  PlanRequest r;
  r.config = config;
  r.seq_len = spec.seq_len;
  r.rows_per_step = spec.rows_per_step();
  r.clipping = spec.max_grad_norm > 0;
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

absl::StatusOr<Plan> PlanKeepingSplit(const JobSpec& spec,
                                      const std::optional<TrainerState>& resume,
                                      const MachineProfile& profile, Backend* backend,
                                      PlanRequest* request, std::string* note) {
  note->clear();
  if (resume.has_value() && resume->micro_batch_rows > 0 && spec.micro_batch_rows == 0 &&
      spec.micro_batches == 0) {
    PlanRequest as_saved = *request;
    as_saved.micro_batch_rows = resume->micro_batch_rows;
    as_saved.mlp_tile_tokens = resume->mlp_tile_tokens;
    const std::string split = absl::StrCat(
        "micro-batches of ", resume->micro_batch_rows, " sequences",
        resume->mlp_tile_tokens > 0
            ? absl::StrCat(", MLP tiles of ", resume->mlp_tile_tokens, " tokens")
            : "");
    absl::StatusOr<Plan> kept = MakePlan(as_saved, profile, backend);
    if (kept.ok()) {
      *request = as_saved;
      *note = absl::StrCat("resume     ", split, ", as the checkpoint's steps ran: the steps "
                           "repeat an uninterrupted run's bits\n");
      return kept;
    }
    *note = absl::StrCat("resume     the checkpoint's ", split, " do not fit here (",
                         kept.status().message(), "): planned anew, so the steps from here "
                         "differ in their last bits from an uninterrupted run's\n");
  }
  return MakePlan(*request, profile, backend);
}

// Setup, in stages: the data first (a broken dataset fails before minutes of model
// loading), then the devices, the plan, the host store, the pipelines and the optimizer,
// and last the weights (a checkpoint resumed, the model folder's, or random).
absl::Status Trainer::Init(const JobSpec& spec, const MachineProfile* given_profile) {
  spec_ = spec;
  RETURN_IF_ERROR(CheckJobFolders(spec));
  ASSIGN_OR_RETURN(config_, ResolveModelConfig(spec));
  num_params_ = NumParameters(config_);
  RETURN_IF_ERROR(InitData(spec));
  DeviceSet devices;
  devices.requests = {BackendRequest{spec.backend, spec.device_memory_cap_bytes}};
  ASSIGN_OR_RETURN(backend_, CreateBackend(devices.requests[0]));
  devices.backends = {backend_.get()};
  MachineProfile profile;
  if (given_profile != nullptr) {
    profile = *given_profile;
  } else {
    ASSIGN_OR_RETURN(profile, LoadMachineProfile(backend_.get()));
  }
  RETURN_IF_ERROR(InitReplicas(spec, &devices));
  // Another job's checkpoints are refused here, before the host store is made.
  std::string newest;
  ASSIGN_OR_RETURN(const std::optional<TrainerState> resume, ResumeState(spec, &newest));
  RETURN_IF_ERROR(InitPlan(spec, profile, devices, resume));
  RETURN_IF_ERROR(InitStore(spec, devices));
  RETURN_IF_ERROR(InitPipelines(spec, devices));
  return Restore(spec, newest);
}

absl::Status Trainer::InitData(const JobSpec& spec) {
  ASSIGN_OR_RETURN(std::unique_ptr<Tokenizer> tokenizer, LoadJobTokenizer(spec, &tokenizer_dir_));
  // Pre-tokenized ids are checked against the model's vocabulary, not the tokenizer's.
  if (spec.data_format != DataFormat::kTokens && config_.vocab_size < tokenizer->vocab_size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "data.tokenizer: the ", tokenizer->name(), " tokenizer has ", tokenizer->vocab_size(),
        " ids; the model's vocab_size is ", config_.vocab_size));
  }
  ASSIGN_OR_RETURN(DatasetOptions data,
                   JobDatasetOptions(spec, tokenizer_dir_, config_.vocab_size));
  ASSIGN_OR_RETURN(std::shared_ptr<const TokenDocs> docs,
                   OpenOrBuildTokenStore(data, *tokenizer, JobDataCacheDir(spec), &dataset_stats_));
  packer_ = std::make_unique<Packer>(std::move(docs), spec.seq_len, spec.data_seed,
                                     JobPackOptions(spec, *tokenizer, config_.vocab_size));
  return absl::OkStatus();
}

// Data parallelism: the other devices (cuda:i+1 .. with i this one's, or more CPU
// backends), then how their gradients meet: reduce-scattered on the devices (NCCL, or
// the CPU streams' threads), else added on the host.
absl::Status Trainer::InitReplicas(const JobSpec& spec, DeviceSet* devices) {
  const int64_t count = std::max<int64_t>(1, spec.devices);
  if (count == 1) return absl::OkStatus();
  const bool cpu = backend_->kind() == BackendKind::kCpu;
  const int first = cpu ? 0 : CudaDeviceIndexOf(devices->requests[0].kind);
  for (int64_t d = 1; d < count; ++d) {
    Replica replica;
    const BackendRequest request{cpu ? "cpu" : absl::StrCat("cuda:", first + d),
                                 spec.device_memory_cap_bytes};
    absl::StatusOr<std::unique_ptr<Backend>> backend = CreateBackend(request);
    if (!backend.ok()) {
      return Annotate(backend.status(),
                      absl::StrCat("train.devices: device ", d, " (", request.kind, ")"));
    }
    replica.backend = *std::move(backend);
    devices->backends.push_back(replica.backend.get());
    devices->requests.push_back(request);
    replicas_.push_back(std::move(replica));
  }
  backend_->BindThread();  // creating the others made theirs current here
  if (spec.gradient_reduce != GradientReduce::kHost) {
    absl::StatusOr<std::vector<std::unique_ptr<GradCollective>>> group =
        CreateGradCollectives(devices->backends);
    if (group.ok()) {
      collectives_ = *std::move(group);
    } else if (spec.gradient_reduce == GradientReduce::kDevice) {
      return Annotate(group.status(), "train.gradient_reduce: device");
    } else {
      reduce_note_ = absl::StrCat(" (", group.status().message(), ")");
    }
    backend_->BindThread();
  }
  return absl::OkStatus();
}

// The plan: micro-batch, checkpoints, weight slots (engine/plan/planner.h), for this
// device's share of the step when there are several.
absl::Status Trainer::InitPlan(const JobSpec& spec, const MachineProfile& profile,
                               const DeviceSet& devices,
                               const std::optional<TrainerState>& resume) {
  const int64_t device = PlannableDeviceBytes(backend_->device_memory_budget());
  const int64_t host = profile.host_memory_bytes;
  PlanRequest request = JobPlanRequest(spec, config_, device, host);
  request.reduce_on_devices = !collectives_.empty();
  if (!collectives_.empty() && backend_->kind() != BackendKind::kCpu) {
    // NVLink or PCIe between the GPUs: measured here, once per job (a few ms).
    absl::StatusOr<double> peer = MeasureReduceScatterGbps(devices.backends, collectives_);
    backend_->BindThread();
    if (peer.ok()) request.peer_gbps = *peer;
  }
  std::string resume_note;
  ASSIGN_OR_RETURN(plan_, PlanKeepingSplit(spec, resume, profile, backend_.get(), &request,
                                           &resume_note));
  profile_ = profile;
  plan_text_ = DescribePlan(plan_, request, profile) + resume_note;
  if (!collectives_.empty()) {
    absl::StrAppend(&plan_text_, "reduce     ", collectives_[0]->description(), "\n");
  } else if (!reduce_note_.empty()) {
    absl::StrAppend(&plan_text_, "reduce     on the host", reduce_note_, "\n");
  }
  return absl::OkStatus();
}

// The host store, and the gradient slabs of the first device; what crosses PCIe (the
// bf16 weights and the slabs) is page-locked once, here.
absl::Status Trainer::InitStore(const JobSpec& spec, const DeviceSet& devices) {
  // One GPU: the store on its node. GPUs on several nodes: interleaved across theirs, and
  // the optimizer's threads on all of them.
  std::vector<int> device_nodes;
  for (const BackendRequest& request : devices.requests) {
    device_nodes.push_back(BackendNumaNode(request));
  }
  const std::vector<int> store_nodes = StoreNodes(device_nodes);
  // The optimizer's threads on the store's node; with the store over several, on all.
  optimizer_numa_node_ = store_nodes.size() > 1 ? -1 : BackendNumaNode(devices.requests[0]);
  if (store_nodes.size() > 1) {
    absl::StrAppend(&plan_text_, "numa       host store interleaved over NUMA nodes ",
                    absl::StrJoin(store_nodes, ", "), " (the GPUs' own)\n");
  }
  StoreOptions store_options;
  store_options.moments = spec.state_dtype;
  store_options.bf16_copy = plan_.bf16_copy;
  store_options.nvme_dir = spec.nvme_dir;
  const ModelLayout layout = BuildLayout(config_);
  for (int64_t l = config_.num_layers - plan_.nvme_layers; l < config_.num_layers; ++l) {
    store_options.disk_units.push_back(layout.DecoderUnit(l));
  }
  ASSIGN_OR_RETURN(store_, HostStore::Create(layout, store_nodes, store_options));
  ASSIGN_OR_RETURN(slabs_, MakeSlabs(spec, devices, 0));
  RETURN_IF_ERROR(backend_->PinHostRange(store_->transfer_base(), store_->transfer_bytes()));
  pinned_.push_back(store_->transfer_base());
  RETURN_IF_ERROR(backend_->PinHostRange(slabs_->base(), slabs_->bytes()));
  pinned_.push_back(slabs_->base());
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<GradSlabPool>> Trainer::MakeSlabs(const JobSpec& spec,
                                                                 const DeviceSet& devices,
                                                                 int device) const {
  // Sharded, every device drains 1/N of each unit into slabs of 1/N of a layer. Added on
  // the host, the first device's pool is the optimizer's (all of a clipped step's
  // gradient) and each other device cycles a few of a layer's size.
  const ModelLayout& layout = store_->layout();
  const bool clipping = spec.max_grad_norm > 0;
  const int node = BackendNumaNode(devices.requests[device]);
  if (!collectives_.empty()) {
    const int ranks = static_cast<int>(devices.backends.size());
    return GradSlabPool::Create(GradShardSlabsNeeded(layout, clipping, ranks),
                                GradShardSlabElements(layout, ranks), node);
  }
  return GradSlabPool::Create(GradSlabsNeeded(layout, device == 0 && clipping),
                              GradSlabElements(layout), node);
}

// A pipeline per device as the plan says, the host optimizer, and with several devices
// the reducer through which their gradients reach it.
absl::Status Trainer::InitPipelines(const JobSpec& spec, const DeviceSet& devices) {
  const bool sharded = !collectives_.empty();
  PipelineOptions pipeline_options;
  pipeline_options.micro_batches = plan_.micro_batches;
  pipeline_options.tokens_per_micro_batch = plan_.micro_batch_rows * spec.seq_len;
  pipeline_options.checkpoint_every = plan_.checkpoint_every;
  pipeline_options.loss_chunk_tokens = plan_.loss_chunk_tokens;
  pipeline_options.checkpoints_on_host = plan_.checkpoints_on_host;
  pipeline_options.weight_slots = plan_.weight_slots;
  pipeline_options.kept_layers = plan_.kept_layers;
  pipeline_options.mlp_tile_tokens = plan_.mlp_tile_tokens;
  pipeline_options.record_timeline = true;  // per-stream busy time for the metrics
  pipeline_options.router_aux_loss_coef = spec.router_aux_loss_coef;
  if (sharded) pipeline_options.collective = collectives_[0].get();
  ASSIGN_OR_RETURN(pipeline_, Pipeline::Create(config_, store_.get(), slabs_.get(),
                                               backend_.get(), pipeline_options));
  HostOptimizerOptions optimizer_options;
  optimizer_options.hyper.beta1 = spec.beta1;
  optimizer_options.hyper.beta2 = spec.beta2;
  optimizer_options.hyper.eps = spec.eps;
  optimizer_options.weight_decay = spec.weight_decay;
  optimizer_options.max_grad_norm = spec.max_grad_norm;
  optimizer_options.numa_node = optimizer_numa_node_;
  optimizer_ = std::make_unique<HostOptimizer>(store_.get(), slabs_.get(), backend_.get(),
                                               optimizer_options);
  batches_.resize(plan_.micro_batches);
  if (replicas_.empty()) return absl::OkStatus();
  std::vector<GradSlabPool*> pools = {slabs_.get()};
  for (size_t d = 1; d < devices.backends.size(); ++d) {
    Replica& replica = replicas_[d - 1];
    ASSIGN_OR_RETURN(replica.slabs, MakeSlabs(spec, devices, static_cast<int>(d)));
    RETURN_IF_ERROR(replica.backend->PinHostRange(replica.slabs->base(), replica.slabs->bytes()));
    PipelineOptions replica_options = pipeline_options;
    if (sharded) replica_options.collective = collectives_[d].get();
    ASSIGN_OR_RETURN(replica.pipeline, Pipeline::Create(config_, store_.get(), replica.slabs.get(),
                                                        replica.backend.get(), replica_options));
    replica.batches.resize(plan_.micro_batches);
    pools.push_back(replica.slabs.get());
    if (sharded) optimizer_->AddSlabPool(replica.slabs.get());
  }
  reducer_ = std::make_unique<GradReducer>(
      optimizer_.get(), devices.backends, pools,
      sharded ? GradReducer::Mode::kSharded : GradReducer::Mode::kHostSum);
  backend_->BindThread();
  return absl::OkStatus();
}

// The weights and the trainer state: from checkpoint.dir's newest checkpoint (`newest`),
// which must be this job's, else the model folder's, else random (model.init_seed).
absl::Status Trainer::Restore(const JobSpec& spec, const std::string& newest) {
  state_.data_seed = spec.data_seed;
  state_.init_seed = spec.init_seed;
  state_.spec_fingerprint = spec.Fingerprint();
  if (!newest.empty()) {
    TrainerState saved;
    RETURN_IF_ERROR(Annotate(LoadCheckpoint(newest, store_.get(), &saved),
                             absl::StrCat("resuming from ", newest)));
    if (saved.spec_fingerprint != state_.spec_fingerprint) {
      return AnotherJobsCheckpoints(spec, saved.spec_fingerprint);
    }
    RETURN_IF_ERROR(Annotate(packer_->Seek(saved.data), "resuming the data position"));
    state_ = saved;
    resumed_from_ = saved.step;
    last_saved_step_ = saved.step;
  } else if (!spec.model_path.empty()) {
    ASSIGN_OR_RETURN(ModelTensorReader reader, ModelTensorReader::OpenFolder(spec.model_path));
    RETURN_IF_ERROR(LoadWeights(reader, store_.get()));
  } else {
    RandomInitWeights(config_, spec.init_seed, store_.get());
  }
  state_.micro_batch_rows = plan_.micro_batch_rows;  // what this run's checkpoints record
  state_.mlp_tile_tokens = plan_.mlp_tile_tokens;
  optimizer_->Restored(state_.step);
  return absl::OkStatus();
}

namespace {
void AppendError(std::string* errors, const std::string& error) {
  if (!errors->empty()) errors->append("; ");
  errors->append(error);
}
}  // namespace

absl::StatusOr<StepReport> Trainer::Step() {
  if (done()) return absl::FailedPreconditionError("the job has already run all its steps");
  StepReport report;
  double previous_checkpoint_wait = 0;
  const int64_t step = state_.step + 1;
  const bool periodic = !spec_.checkpoint_dir.empty() && spec_.checkpoint_every_steps > 0 &&
                        step % spec_.checkpoint_every_steps == 0;
  const bool asked = std::exchange(checkpoint_next_step_, false) && !spec_.checkpoint_dir.empty();
  if ((asked || (periodic && spec_.checkpoint_background)) && step < spec_.steps) {
    // Begun before the step, so its backward hands the top layers to the writers. One at
    // a time: waiting here for the last one's fsync counts as waiting for a checkpoint.
    const auto t0 = std::chrono::steady_clock::now();
    CollectBackground(/*wait=*/true, &report);
    previous_checkpoint_wait =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    absl::Status started = StartBackground(step);
    if (!started.ok()) {
      AppendError(&report.checkpoint_error, CheckpointFailure(step, started));
      report.failed_checkpoint_steps.push_back(step);
    }
  }
  // In data order: the first device's share, then the next's (as one device would).
  for (MicroBatch& b : batches_) packer_->Next(plan_.micro_batch_rows, &b);
  for (Replica& r : replicas_) {
    for (MicroBatch& b : r.batches) packer_->Next(plan_.micro_batch_rows, &b);
  }
  // An NVMe tier's I/O error in the last step's updates (they run on into this one).
  if (absl::Status s = optimizer_->status(); !s.ok()) {
    step_failed_ = true;
    return s;
  }
  const double lr = LearningRate(spec_.schedule, state_.step);
  optimizer_->BeginStep(lr, step);
  absl::StatusOr<StepResult> result =
      replicas_.empty() ? pipeline_->Step(batches_, optimizer_.get()) : StepReplicas();
  if (!result.ok()) {
    step_failed_ = true;
    if (background_ != nullptr && background_->step() == step) background_.reset();  // never
    return result.status();                                                         // finished
  }
  const StepResult& r = *result;
  state_.step = step;
  state_.data = packer_->position();
  state_.last_loss = r.loss;
  if (background_ != nullptr && background_->step() == step) background_->SetState(state_);

  report.step = state_.step;
  report.total_steps = spec_.steps;
  report.loss = r.loss;
  report.has_aux_loss = config_.is_moe();
  report.aux_loss = r.aux_loss;
  report.aux_loss_coef = r.aux_loss_coef;
  report.lr = lr;
  report.grad_norm = r.grad_norm;
  report.tokens = spec_.tokens_per_step_resolved();
  report.seconds = r.seconds;
  report.tokens_per_second = r.seconds > 0 ? report.tokens / r.seconds : 0;
  // 6 N per token for the matmuls, plus causal attention: 6 * L * seq * H*D per token
  // (forward 2 * 2 * L * H*D * seq/2, times 3 for backward).
  const double attn = 6.0 * config_.num_layers * spec_.seq_len * config_.num_heads * config_.head_dim;
  report.model_tflops =
      (6.0 * MatmulParameters(config_) + attn) * report.tokens_per_second / 1e12;
  report.device_bytes_peak = backend_->device_bytes_peak();
  report.device_bytes_in_use = backend_->device_bytes_in_use();
  report.stream_busy_seconds = StreamBusySeconds(r.timeline);
  const double optimizer_busy = optimizer_->busy_seconds();
  report.optimizer_busy_seconds = optimizer_busy - optimizer_busy_seen_;
  optimizer_busy_seen_ = optimizer_busy;
  if (report.optimizer_busy_seconds > 0) {
    const int64_t updated = store_->layout().TotalElements();  // every unit, each step
    report.optimizer_params_per_second = updated / report.optimizer_busy_seconds;
    report.optimizer_in_step_fraction = profile_.AdamWInStepFraction(
        updated, report.optimizer_busy_seconds, spec_.state_dtype, plan_.bf16_copy);
  }
  report.h2d_bytes = r.h2d_bytes;
  report.d2h_bytes = r.d2h_bytes;
  const double capture_wait = optimizer_->capture_wait_seconds();
  report.checkpoint_wait_seconds = capture_wait - capture_wait_seen_ + previous_checkpoint_wait;
  capture_wait_seen_ = capture_wait;

  CollectBackground(/*wait=*/false, &report);
  const bool stopped = periodic && (!spec_.checkpoint_background || done());
  if (stopped || (done() && !spec_.checkpoint_dir.empty())) {
    CollectBackground(/*wait=*/true, &report);
    absl::StatusOr<std::string> saved = SaveCheckpoint();
    if (!saved.ok() && done()) {
      return Annotate(saved.status(), absl::StrCat("the final checkpoint (step ", state_.step, ")"));
    }
    if (saved.ok()) {
      report.checkpoint_paths.push_back(*saved);
    } else {
      AppendError(&report.checkpoint_error, CheckpointFailure(state_.step, saved.status()));
      report.failed_checkpoint_steps.push_back(state_.step);
    }
  }
  return report;
}

absl::StatusOr<StepResult> Trainer::StepReplicas() {
  int64_t targets = 0;
  for (const MicroBatch& b : batches_) targets += b.num_targets();
  for (const Replica& r : replicas_) {
    for (const MicroBatch& b : r.batches) targets += b.num_targets();
  }
  std::vector<absl::StatusOr<StepResult>> results(replicas_.size(),
                                                  absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  for (size_t i = 0; i < replicas_.size(); ++i) {
    threads.emplace_back([this, i, targets, &results] {
      results[i] = replicas_[i].pipeline->Step(replicas_[i].batches,
                                               reducer_->replica(static_cast<int>(i) + 1), targets);
    });
  }
  absl::StatusOr<StepResult> first = pipeline_->Step(batches_, reducer_->replica(0), targets);
  for (std::thread& t : threads) t.join();
  if (!first.ok()) return first.status();
  StepResult total = *std::move(first);
  double loss_sum = total.loss * total.num_targets;
  for (absl::StatusOr<StepResult>& r : results) {
    if (!r.ok()) return r.status();
    loss_sum += r->loss * r->num_targets;
    total.aux_loss += r->aux_loss;  // averaged below: each replica's over its own tokens
    total.num_targets += r->num_targets;
    total.seconds = std::max(total.seconds, r->seconds);
    total.h2d_bytes += r->h2d_bytes;
    total.d2h_bytes += r->d2h_bytes;
  }
  total.loss = total.num_targets > 0 ? loss_sum / total.num_targets : 0.0;
  total.aux_loss /= static_cast<double>(results.size() + 1);
  return total;
}

std::string Trainer::CheckpointFailure(int64_t step, const absl::Status& status) const {
  return absl::StrCat(
      "checkpoint of step ", step, " failed: ", status.message(), "; training goes on",
      last_saved_step_ >= 0 ? absl::StrCat(", the last checkpoint is step ", last_saved_step_)
                            : std::string(", there is no checkpoint yet"));
}

CheckpointOptions Trainer::checkpoint_options() const {
  CheckpointOptions options;
  options.max_shard_bytes = static_cast<uint64_t>(spec_.max_shard_bytes);
  options.tokenizer_dir = tokenizer_dir_;
  options.moments = store_->moment_dtype();
  return options;
}

absl::Status Trainer::StartBackgroundCheckpoint() {
  if (spec_.checkpoint_dir.empty()) {
    return absl::FailedPreconditionError("the job has no checkpoint.dir");
  }
  RETURN_IF_ERROR(FinishBackgroundCheckpoint().status());
  RETURN_IF_ERROR(StartBackground(state_.step));
  background_->SetState(state_);
  return absl::OkStatus();
}

absl::Status Trainer::StartBackground(int64_t step) {
  ASSIGN_OR_RETURN(std::unique_ptr<CheckpointWriter> writer,
                   CheckpointWriter::Begin(spec_.checkpoint_dir, config_, store_->layout(),
                                           step, checkpoint_options()));
  // Every core (up to 16): each unit must be written within about one step (before its
  // next update), and the page cache takes the bytes faster the more threads copy them.
  // On a 16-core H200 box writing Qwen2.5-1.5B's 21.6 GB at 64K tokens a step, 16 writers
  // cost the steps 0.04 s in all against 4 writers' 0.49, although the optimizer's OpenMP
  // team shares the cores.
  const int threads = checkpoint_writer_threads_ > 0
                          ? checkpoint_writer_threads_
                          : static_cast<int>(std::clamp<long>(sysconf(_SC_NPROCESSORS_ONLN), 1, 16));
  background_ = BackgroundCheckpoint::Start(
      std::move(writer), optimizer_.get(), store_.get(), threads,
      [dir = spec_.checkpoint_dir, keep = spec_.keep_last] { return PruneCheckpoints(dir, keep); });
  return absl::OkStatus();
}

void Trainer::CollectBackground(bool wait, StepReport* report) {
  if (background_ == nullptr || (!wait && !background_->done())) return;
  absl::StatusOr<std::string> saved = background_->Wait();
  if (saved.ok()) {
    last_saved_step_ = background_->step();
    last_checkpoint_seconds_ = background_->seconds();
    last_checkpoint_capture_seconds_ = background_->capture_seconds();
    last_checkpoint_unit_times_ = background_->unit_times();
    last_checkpoint_bytes_ = static_cast<int64_t>(background_->bytes());
    report->checkpoint_paths.push_back(*saved);
  } else {
    AppendError(&report->checkpoint_error, CheckpointFailure(background_->step(), saved.status()));
    report->failed_checkpoint_steps.push_back(background_->step());
  }
  background_.reset();
}

absl::StatusOr<std::string> Trainer::SaveCheckpointTo(const std::string& root) {
  optimizer_->Drain();  // the last step's updates are in the store
  RETURN_IF_ERROR(optimizer_->status());  // never a checkpoint of state the tier lost
  return megatrain::SaveCheckpoint(root, config_, *store_, state_, checkpoint_options());
}

absl::StatusOr<std::string> Trainer::FinishBackgroundCheckpoint() {
  if (background_ == nullptr) return std::string();
  if (!background_->has_state()) {  // of a step that did not finish
    background_.reset();
    return std::string();
  }
  StepReport report;
  CollectBackground(/*wait=*/true, &report);
  if (!report.checkpoint_error.empty()) return absl::InternalError(report.checkpoint_error);
  return report.checkpoint_paths.empty() ? std::string() : report.checkpoint_paths.back();
}

int64_t Trainer::pinned_host_bytes() const {
  return static_cast<int64_t>(store_->transfer_bytes() + slabs_->bytes());
}

int64_t Trainer::pageable_host_bytes() const {
  return static_cast<int64_t>(store_->state_bytes());
}

absl::StatusOr<std::string> Trainer::SaveCheckpoint() {
  if (spec_.checkpoint_dir.empty()) {
    return absl::FailedPreconditionError("the job has no checkpoint.dir");
  }
  const int64_t background_step = background_ != nullptr ? background_->step() : -1;
  absl::StatusOr<std::string> background = FinishBackgroundCheckpoint();
  if (background_step == state_.step && background.ok()) return background;  // this step's
  const auto started = std::chrono::steady_clock::now();
  optimizer_->Drain();  // the last step's updates are in the store
  RETURN_IF_ERROR(optimizer_->status());  // never a checkpoint of state the tier lost
  ASSIGN_OR_RETURN(std::string path, megatrain::SaveCheckpoint(spec_.checkpoint_dir, config_,
                                                               *store_, state_,
                                                               checkpoint_options()));
  last_saved_step_ = state_.step;
  RETURN_IF_ERROR(PruneCheckpoints(spec_.checkpoint_dir, spec_.keep_last));
  last_checkpoint_seconds_ =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  last_checkpoint_bytes_ = 0;
  std::error_code ec;
  // increment(ec), not a range-for: a folder that fails to read mid-walk is an error
  // code, never an exception.
  for (auto it = std::filesystem::recursive_directory_iterator(path, ec);
       !ec && it != std::filesystem::recursive_directory_iterator(); it.increment(ec)) {
    std::error_code size_ec;
    if (it->is_regular_file(size_ec)) {
      const uintmax_t size = it->file_size(size_ec);
      if (!size_ec) last_checkpoint_bytes_ += static_cast<int64_t>(size);
    }
  }
  return path;
}

}  // namespace megatrain
