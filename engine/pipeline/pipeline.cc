#include "engine/pipeline/pipeline.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "engine/common/check.h"
#include "engine/common/status.h"

namespace megatrain {
namespace {

double ReadStat(const char* p, DType dtype) {
  if (dtype == DType::kF64) {
    double d;
    std::memcpy(&d, p, 8);
    return d;
  }
  float f;
  std::memcpy(&f, p, 4);
  return f;
}

// A micro-batch of the plan's n tokens; InvalidArgument naming `what` otherwise.
absl::Status CheckShape(const MicroBatch& b, int64_t n, const char* what) {
  if (b.rows * b.seq_len == n && static_cast<int64_t>(b.tokens.size()) == n) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(
      absl::StrCat(what, " of ", b.tokens.size(), " tokens; the plan has ", n));
}

// A preference step's micro-batch: a sequence index per token, in [-1, S), and S even
// (pairs) within the device's room, each with its kPrefFields.
absl::Status CheckSequences(const MicroBatch& b, int64_t n) {
  const int64_t S = static_cast<int64_t>(b.sequence_info.size()) / kPrefFields;
  if (static_cast<int64_t>(b.sequence.size()) != n ||
      static_cast<int64_t>(b.sequence_info.size()) != S * kPrefFields || S % 2 != 0 ||
      S > kMaxPreferenceSequences) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a preference micro-batch needs ", n, " sequence indices and an even number (at most ",
        kMaxPreferenceSequences, ") of sequences of ", kPrefFields, " values; it has ",
        b.sequence.size(), " and ", b.sequence_info.size(), " values"));
  }
  for (int64_t i = 0; i < n; ++i) {
    if (b.sequence[i] < -1 || b.sequence[i] >= S) {
      return absl::InvalidArgumentError(absl::StrCat("token ", i, " of a preference micro-batch "
                                                     "names sequence ", b.sequence[i], " of ", S));
    }
  }
  return absl::OkStatus();
}

}  // namespace

Pipeline::Pipeline(const ModelConfig& config, const ModelLayout& layout, HostStore* store,
                   GradSlabPool* slabs, Backend* backend, const PipelineOptions& options)
    : config_(config),
      layout_(&layout),
      store_(store),
      slabs_(slabs),
      backend_(backend),
      options_(options),
      kinds_(MakeLayerKinds(config, layout, backend, options.mlp_tile_tokens)),
      head_(config, layout, backend, options.loss_chunk_tokens,
            MakeObjective(options.objective, backend)),
      act_row_bytes_(config.hidden_size * DTypeSize(backend->act_dtype())),
      spans_(backend, options.record_timeline),
      slots_(backend, store, layout, NumWeightSlots(config, options), &spans_),
      drain_(backend, store, slabs, options.collective, &spans_) {
  if (options.checkpoints_on_host) {
    const int64_t micro_batch_bytes = options.tokens_per_micro_batch * act_row_bytes_;
    host_checkpoints_ = std::make_unique<HostCheckpoints>(
        backend, options.checkpoint_every, config.num_layers,
        options.micro_batches * micro_batch_bytes, micro_batch_bytes, &spans_);
  }
}

Pipeline::~Pipeline() {
  if (backend_ == nullptr) return;
  backend_->BindThread();  // its buffers are freed on its device
  backend_->SyncAll();  // before the members (the host checkpoints' pinning) go
}

absl::StatusOr<std::unique_ptr<Pipeline>> Pipeline::Create(const ModelConfig& config,
                                                           HostStore* store,
                                                           GradSlabPool* slabs,
                                                           Backend* backend,
                                                           const PipelineOptions& options) {
  backend->BindThread();
  if (options.kept_layers < 0 || options.kept_layers > config.num_layers ||
      (options.kept_layers > 0 && options.checkpoint_every != 1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "pipeline: kept_layers (", options.kept_layers, ") must be in [0, num_layers], and 0 "
        "unless checkpoint_every is 1 (", options.checkpoint_every, ")"));
  }
  if (options.micro_batches < 1 || options.tokens_per_micro_batch < 1 ||
      options.checkpoint_every < 1 || options.loss_chunk_tokens < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "pipeline: micro_batches (", options.micro_batches, "), tokens_per_micro_batch (",
        options.tokens_per_micro_batch, "), checkpoint_every (", options.checkpoint_every,
        ") and loss_chunk_tokens (", options.loss_chunk_tokens, ") must all be >= 1"));
  }
  if (config.num_layers < 1) return absl::InvalidArgumentError("model has no layers");
  if (options.eval_micro_batches < 0 ||
      options.eval_micro_batches > EvalCapacity(config, options)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "pipeline: eval_micro_batches (", options.eval_micro_batches, ") must be in [0, ",
        EvalCapacity(config, options), "]"));
  }
  if (slabs->slab_elements() < 1 || slabs->num_slabs() < 1) {
    return absl::InvalidArgumentError("pipeline: the gradient slab pool is empty");
  }
  std::unique_ptr<Pipeline> p(
      new Pipeline(config, store->layout(), store, slabs, backend, options));
  RETURN_IF_ERROR(p->Allocate());
  return p;
}

absl::Status Pipeline::Allocate() {
  Backend* be = backend_;
  const StepMemory mem = SizeStepMemory(config_, *layout_, be, options_, kinds_, head_);
  const int64_t M = options_.micro_batches, n = options_.tokens_per_micro_batch;
  DeviceAllocator alloc(be);
  RETURN_IF_ERROR(slots_.Allocate(&alloc));
  RETURN_IF_ERROR(alloc.Allocate(&embed_slot_, mem.embedding_slot, "the embedding"));
  RETURN_IF_ERROR(alloc.Allocate(&head_slot_, mem.head_slot, "the head"));
  RETURN_IF_ERROR(alloc.Allocate(&embed_grad_, mem.embedding_grad, "the embedding gradient"));
  RETURN_IF_ERROR(alloc.Allocate(&head_grad_, mem.head_grad, "the head gradient"));
  RETURN_IF_ERROR(alloc.Allocate(&grad_discard_, mem.grad_discard, "frozen vectors' gradients"));
  for (int i = 0; i < kLayerGradBuffers; ++i) {
    RETURN_IF_ERROR(alloc.Allocate(&layer_grad_[i], mem.layer_grad, "a layer gradient buffer"));
    grad_ready_[i] = Event(be);
    grad_free_[i] = Event(be);
  }
  if (host_checkpoints_ != nullptr) RETURN_IF_ERROR(host_checkpoints_->Allocate(&alloc));
  ckpt_.resize(mem.device_checkpoints);
  for (DeviceBuffer& b : ckpt_) {
    RETURN_IF_ERROR(alloc.Allocate(&b, mem.activations, "layer-input checkpoints"));
  }
  seg_.resize(mem.recomputed_inputs);
  for (DeviceBuffer& b : seg_) {
    RETURN_IF_ERROR(alloc.Allocate(&b, mem.activations, "recomputed layer inputs"));
  }
  for (int64_t i = 0; i < mem.forward_buffers; ++i) {
    RETURN_IF_ERROR(alloc.Allocate(&cur_[i], mem.activations, "forward activations"));
  }
  RETURN_IF_ERROR(alloc.Allocate(&dres_, mem.activations, "residual gradients"));
  RETURN_IF_ERROR(alloc.Allocate(&scratch_out_, mem.scratch_output, "a scratch activation"));
  RETURN_IF_ERROR(alloc.Allocate(&layer_ws_, mem.layer_workspace, "the layer workspace"));
  kept_bytes_ = mem.kept_layer / M;  // a micro-batch's share
  kept_ws_.resize(mem.kept_layers);
  for (DeviceBuffer& b : kept_ws_) {
    RETURN_IF_ERROR(alloc.Allocate(&b, mem.kept_layer, "kept layer activations"));
  }
  RETURN_IF_ERROR(alloc.Allocate(&head_ws_, mem.head_workspace, "the loss workspace"));
  RETURN_IF_ERROR(alloc.Allocate(&batch_ints_, mem.token_arrays, "token arrays"));
  RETURN_IF_ERROR(alloc.Allocate(&losses_, mem.losses, "per-token losses"));
  RETURN_IF_ERROR(alloc.Allocate(&preference_buf_, mem.preference_arrays, "pair sequences"));
  RETURN_IF_ERROR(alloc.Allocate(&inv_freq_, mem.rope_frequencies, "RoPE frequencies"));
  const int64_t E = config_.moe.num_experts;
  if (E > 0) {
    RETURN_IF_ERROR(alloc.Allocate(&router_stats_buf_, mem.router_stats, "router statistics"));
    host_router_stats_.resize(mem.router_stats);
    char* stats = static_cast<char*>(router_stats_buf_.get());
    router_stats_.counts = reinterpret_cast<int32_t*>(stats);
    router_stats_.prob_sum = stats + mem.router_counts;  // aligned
    aux_coef_ = config_.moe.TrainedAuxLossCoef(options_.router_aux_loss_coef);
  }
  // What the planner counted is what was allocated: one arithmetic, StepMemory's.
  MT_CHECK(alloc.bytes() == mem.TotalBytes());
  device_bytes_ = alloc.bytes();
  token_order_.resize(M * n);
  const int64_t batches = std::max(M, options_.eval_micro_batches);
  batches_.resize(batches);
  host_losses_.resize(batches * n * DTypeSize(be->stat_dtype()));
  std::vector<const DeviceBuffer*> act_buffers;  // every M x (n, C) buffer of the step
  for (const DeviceBuffer& b : ckpt_) act_buffers.push_back(&b);
  for (const DeviceBuffer& b : seg_) act_buffers.push_back(&b);
  for (int64_t i = 0; i < mem.forward_buffers; ++i) act_buffers.push_back(&cur_[i]);
  act_buffers.push_back(&dres_);
  const size_t half = act_buffers.size() / 2;
  eval_sides_[0].assign(act_buffers.begin(), act_buffers.begin() + half);
  eval_sides_[1].assign(act_buffers.begin() + half, act_buffers.begin() + 2 * half);
  if (E > 0) host_offsets_.resize(config_.num_layers * M * (E + 1));

  const std::vector<float> inv_freq = RopeInvFreqs(config_);
  be->CopyToDevice(inv_freq_.get(), inv_freq.data(), mem.rope_frequencies, StreamId::kH2D);
  be->SyncAll();

  embed_loaded_ = Event(be);
  head_loaded_ = Event(be);
  inputs_loaded_ = Event(be);
  losses_ready_ = Event(be);
  step_start_ = Event(be);
  step_end_ = Event(be);
  uploads_done_ = Event(be);
  drain_.CreateEvents(static_cast<int64_t>(layout_->units.size()));
  return absl::OkStatus();
}

void* Pipeline::Act(std::vector<DeviceBuffer>& v, int64_t i, int64_t m) {
  return MicroBatchRow(v[i], m);
}

void* Pipeline::MicroBatchRow(const DeviceBuffer& b, int64_t m) const {
  return static_cast<char*>(b.get()) + m * options_.tokens_per_micro_batch * act_row_bytes_;
}

bool Pipeline::IsCheckpoint(int64_t layer) const {
  return layer % options_.checkpoint_every == 0 || layer == config_.num_layers;
}

void* Pipeline::Checkpoint(int64_t layer, int64_t m) {
  MT_CHECK(IsCheckpoint(layer) && !options_.checkpoints_on_host);
  const int64_t index = layer == config_.num_layers ? static_cast<int64_t>(ckpt_.size()) - 1
                                                    : layer / options_.checkpoint_every;
  return Act(ckpt_, index, m);
}

void* Pipeline::LayerInput(int64_t layer, int64_t m) {
  if (!options_.checkpoints_on_host && IsCheckpoint(layer)) return Checkpoint(layer, m);
  return MicroBatchRow(cur_[layer % 2], m);
}

void* Pipeline::SegmentInput(int64_t c, int64_t m) {
  if (!options_.checkpoints_on_host) return Checkpoint(c, m);
  return host_checkpoints_->Input(c, m);
}

LayerCall Pipeline::CallFor(int64_t layer, int64_t m, void* slot, bool kept, void* grads) {
  LayerCall call;
  call.weights = slot;
  call.grads = grads;
  call.grad_discard = grad_discard_.get();
  call.workspace = layer_ws_.get();
  if (kept && Kept(layer)) {
    const int64_t index = layer - (config_.num_layers - options_.kept_layers);
    call.saved = static_cast<char*>(kept_ws_[index].get()) + m * kept_bytes_;
  }
  call.batch = &batches_[m];
  call.rope_inv_freq = static_cast<const float*>(inv_freq_.get());
  call.stream = StreamId::kCompute;
  if (config_.is_moe()) {
    call.router_stats = &router_stats_;
    const int64_t E = config_.moe.num_experts;
    call.host_offsets = &host_offsets_[(layer * options_.micro_batches + m) * (E + 1)];
  }
  return call;
}

absl::StatusOr<StepResult> Pipeline::Step(const std::vector<MicroBatch>& batches,
                                          GradSink* sink, int64_t step_targets) {
  backend_->BindThread();
  ASSIGN_OR_RETURN(const int64_t num_targets, CheckBatches(batches));
  const auto start = std::chrono::steady_clock::now();
  // The loss is a mean over the whole step's targets: over every replica's, in data
  // parallelism, so that the replicas' gradients add up to the step's.
  const int64_t denominator = step_targets > 0 ? step_targets : num_targets;
  const double scale = denominator > 0 ? 1.0 / denominator : 0.0;
  BeginStep(sink);
  if (config_.is_moe()) {
    // aux = E * sum_e (counts_e / T) (prob_sum_e / T) over T = MoE layers x tokens rows:
    // dAux/dp = E counts_e / T^2. With data parallelism the replicas' gradients add: each
    // weighs its own share's by its share of the step's targets.
    const double T = static_cast<double>(config_.NumMoeLayers()) * options_.micro_batches *
                     options_.tokens_per_micro_batch;
    const double share = step_targets > 0 && num_targets > 0
                             ? static_cast<double>(num_targets) / step_targets : 1.0;
    router_stats_.aux_scale = aux_coef_ * config_.moe.num_experts / (T * T) * share;
  }
  UploadInputs(batches, sink);
  ForwardSweep();
  Head(scale, sink);
  BackwardSweep(sink);
  return FinishStep(sink, num_targets, start);
}

absl::StatusOr<int64_t> Pipeline::CheckBatches(const std::vector<MicroBatch>& batches) const {
  const int64_t M = options_.micro_batches, n = options_.tokens_per_micro_batch;
  if (static_cast<int64_t>(batches.size()) != M) {
    return absl::InvalidArgumentError(
        absl::StrCat("step got ", batches.size(), " micro-batches, the plan has ", M));
  }
  int64_t num_targets = 0;
  const bool pairs = options_.objective.kind == ObjectiveKind::kPreference;
  for (const MicroBatch& b : batches) {
    RETURN_IF_ERROR(CheckShape(b, n, "micro-batch"));
    if (pairs) RETURN_IF_ERROR(CheckSequences(b, n));
    num_targets += b.num_targets();
  }
  return num_targets;
}

void Pipeline::BeginStep(GradSink* sink) {
  slots_.BeginStep(sink);  // the optimizer changed the weights: the slots are stale
  drain_.BeginStep();
  if (host_checkpoints_ != nullptr) host_checkpoints_->BeginStep();
  h2d_bytes_ = d2h_bytes_ = 0;
  spans_.BeginStep();
}

void Pipeline::UploadInputs(const std::vector<MicroBatch>& batches, GradSink* sink) {
  Backend& be = *backend_;
  const int64_t M = options_.micro_batches, n = options_.tokens_per_micro_batch;
  int32_t* ints = static_cast<int32_t*>(batch_ints_.get());
  for (int64_t m = 0; m < M; ++m) {
    int32_t* base = ints + m * kBatchArrays * n;
    const MicroBatch& b = batches[m];
    int32_t* order = token_order_.data() + m * n;  // lives until the next step's copies
    TokenOrder(b.tokens.data(), n, order);
    be.CopyToDevice(base, b.tokens.data(), n * 4, StreamId::kH2D);
    be.CopyToDevice(base + n, b.targets.data(), n * 4, StreamId::kH2D);
    be.CopyToDevice(base + 2 * n, b.doc_start.data(), n * 4, StreamId::kH2D);
    be.CopyToDevice(base + 3 * n, b.positions.data(), n * 4, StreamId::kH2D);
    be.CopyToDevice(base + 4 * n, order, n * 4, StreamId::kH2D);
    batches_[m] = DeviceBatch{n, base, base + n, base + 2 * n, base + 3 * n, base + 4 * n};
    h2d_bytes_ += kBatchArrays * 4 * n;
    if (preference_buf_.bytes() > 0) UploadSequences(m, b);
  }
  be.Record(inputs_loaded_.get(), StreamId::kH2D);
  const int64_t embed_unit = ModelLayout::EmbeddingUnit();
  const int64_t head_unit = layout_->HeadUnit();
  sink->AwaitUnit(embed_unit);
  h2d_bytes_ += UploadEdgeUnit(embed_unit, embed_slot_.get(), &embed_uploaded_);
  be.Record(embed_loaded_.get(), StreamId::kH2D);
  slots_.EnsureLoaded(0);
  sink->AwaitUnit(head_unit);
  h2d_bytes_ += UploadEdgeUnit(head_unit, head_slot_.get(), &head_uploaded_);
  be.Record(head_loaded_.get(), StreamId::kH2D);
}

void Pipeline::UploadSequences(int64_t m, const MicroBatch& b) {
  Backend& be = *backend_;
  const int64_t n = options_.tokens_per_micro_batch;
  const int64_t info_bytes = kMaxPreferenceSequences * kPrefFields * int64_t{sizeof(double)};
  char* base = static_cast<char*>(preference_buf_.get()) + m * (info_bytes + n * 4);
  const int64_t bytes = static_cast<int64_t>(b.sequence_info.size() * sizeof(double));
  be.CopyToDevice(base, b.sequence_info.data(), bytes, StreamId::kH2D);  // 8-byte aligned
  be.CopyToDevice(base + info_bytes, b.sequence.data(), n * 4, StreamId::kH2D);
  batches_[m].sequence_info = reinterpret_cast<const double*>(base);
  batches_[m].sequence = reinterpret_cast<const int32_t*>(base + info_bytes);
  batches_[m].num_sequences = static_cast<int64_t>(b.sequence_info.size()) / kPrefFields;
  h2d_bytes_ += bytes + n * 4;
}

void Pipeline::WeightsReplaced() {
  slots_.Forget();
  embed_uploaded_ = head_uploaded_ = false;
}

int64_t Pipeline::UploadEdgeUnit(int64_t unit, void* slot, bool* loaded) {
  const bool state_only = *loaded;
  *loaded = true;
  if (state_only && store_->state_elements(unit) == 0) return 0;
  return UploadUnitWeights(backend_, *store_, unit, slot, StreamId::kH2D, state_only);
}

void Pipeline::ForwardSweep() {
  Backend& be = *backend_;
  const int64_t M = options_.micro_batches, n = options_.tokens_per_micro_batch;
  const int64_t L = config_.num_layers;
  be.Record(step_start_.get(), StreamId::kCompute);
  be.StreamWait(StreamId::kCompute, inputs_loaded_.get());
  be.StreamWait(StreamId::kCompute, embed_loaded_.get());
  for (DeviceBuffer* g : {&embed_grad_, &head_grad_}) {
    if (g->bytes() > 0) be.Zero(g->get(), g->bytes(), StreamId::kCompute);
  }
  if (config_.is_moe()) {
    be.Zero(router_stats_buf_.get(), router_stats_buf_.bytes(), StreamId::kCompute);
  }
  const UnitLayout& embedding = layout_->units[ModelLayout::EmbeddingUnit()];
  const void* embed_table = Offset(embed_slot_.get(), embedding.OffsetOf(TensorRole::kEmbedding),
                                   be.weight_dtype());
  for (int64_t m = 0; m < M; ++m) {
    be.Embedding(LayerInput(0, m), batches_[m].tokens, embed_table, n, config_.hidden_size,
                 StreamId::kCompute);
  }
  if (host_checkpoints_ != nullptr) host_checkpoints_->Save(0, cur_[0]);
  for (int64_t l = 0; l < L; ++l) {
    slots_.EnsureLoaded(l);
    if (l + 1 < L) slots_.EnsureLoaded(l + 1);  // prefetch
    void* slot = slots_.Use(l);
    if (host_checkpoints_ != nullptr) {  // the copy out of the buffer x_{l+1} goes to is done
      be.StreamWait(StreamId::kCompute, host_checkpoints_->saved_event((l + 1) % 2));
    }
    const LayerKind& kind = kinds_.ForLayer(l);
    const int span = spans_.Begin(StreamId::kCompute, "fwd " + std::to_string(l));
    for (int64_t m = 0; m < M; ++m) {
      LayerCall call = CallFor(l, m, slot, /*kept=*/true);
      call.first_forward = true;  // the step's one forward of this layer
      kind.Forward(call, LayerInput(l, m), LayerInput(l + 1, m));
    }
    spans_.End(span);
    slots_.Release(l);
    if (host_checkpoints_ != nullptr) host_checkpoints_->Save(l + 1, cur_[(l + 1) % 2]);
  }
}

void Pipeline::Head(double scale, GradSink* sink) {
  Backend& be = *backend_;
  const int64_t M = options_.micro_batches, n = options_.tokens_per_micro_batch;
  be.StreamWait(StreamId::kCompute, head_loaded_.get());
  const HeadTensors weights = head_.BindWeights(head_slot_.get(), embed_slot_.get());
  const HeadTensors grads =
      head_.BindGrads(head_grad_.get(), embed_grad_.get(), grad_discard_.get());
  const int64_t stat = DTypeSize(be.stat_dtype());
  const int span = spans_.Begin(StreamId::kCompute, "head");
  for (int64_t m = 0; m < M; ++m) {
    head_.ForwardBackward(weights, grads, LayerInput(config_.num_layers, m),
                          MicroBatchRow(dres_, m),
                          static_cast<char*>(losses_.get()) + m * n * stat, head_ws_.get(),
                          batches_[m], scale, StreamId::kCompute);
  }
  spans_.End(span);
  be.Record(losses_ready_.get(), StreamId::kCompute);
  be.StreamWait(StreamId::kD2H, losses_ready_.get());
  const int64_t loss_bytes = M * n * stat;
  d2h_bytes_ += loss_bytes;
  be.CopyToHost(host_losses_.data(), losses_.get(), loss_bytes, StreamId::kD2H);
  if (config_.is_moe()) {  // complete: every layer's forward came before the head
    d2h_bytes_ += static_cast<int64_t>(host_router_stats_.size());
    be.CopyToHost(host_router_stats_.data(), router_stats_buf_.get(), host_router_stats_.size(),
                  StreamId::kD2H);
  }
  // Complete here even when tied: the tied lm_head gradient lands in the embedding's.
  DeferDrain(layout_->HeadUnit(), head_grad_.get(), losses_ready_.get(), nullptr, sink);
}

void Pipeline::DeferDrain(int64_t unit, void* device_grad, void* done_event, void* free_event,
                          GradSink* sink) {
  FlushDrain(sink);
  pending_drain_ = PendingDrain{unit, device_grad, done_event, free_event};
}

void Pipeline::FlushDrain(GradSink* sink) {
  const PendingDrain p = pending_drain_;
  if (p.unit < 0) return;
  pending_drain_ = PendingDrain{};
  drain_.Drain(p.unit, p.device_grad, p.done_event, p.free_event, sink);
}

void Pipeline::BackwardSweep(GradSink* sink) {
  Backend& be = *backend_;
  const int64_t M = options_.micro_batches, n = options_.tokens_per_micro_batch;
  const int64_t L = config_.num_layers, K = options_.checkpoint_every;
  int64_t grad_turn = 0;
  for (int64_t c = ((L - 1) / K) * K; c >= 0; c -= K) {
    BackwardSegment(c, std::min(c + K, L), &grad_turn, sink);
  }
  // A frozen embedding's gradient is never computed (a tied lm_head's is frozen with it).
  const UnitLayout& embedding = layout_->units[ModelLayout::EmbeddingUnit()];
  for (int64_t m = 0; m < M && embedding.AnyTrainable({TensorRole::kEmbedding}); ++m) {
    be.EmbeddingBackward(embed_grad_.get(), MicroBatchRow(dres_, m), batches_[m].tokens,
                         batches_[m].token_order, n, config_.hidden_size, StreamId::kCompute);
  }
  be.Record(step_end_.get(), StreamId::kCompute);
  FlushDrain(sink);  // layer 0's
  drain_.Drain(ModelLayout::EmbeddingUnit(), embed_grad_.get(), step_end_.get(), nullptr, sink);
}

void Pipeline::BackwardSegment(int64_t c, int64_t e, int64_t* grad_turn, GradSink* sink) {
  Backend& be = *backend_;
  const int64_t M = options_.micro_batches, K = options_.checkpoint_every;
  for (int64_t l = c; l < e; ++l) slots_.EnsureLoaded(l);
  if (host_checkpoints_ != nullptr) host_checkpoints_->Load(c);
  if (c > 0) slots_.EnsureLoaded(c - 1);  // prefetch the top of the segment below
  if (host_checkpoints_ != nullptr) {
    host_checkpoints_->Load(c - K);  // and its checkpoint
    be.StreamWait(StreamId::kCompute, host_checkpoints_->loaded_event(c));
  }
  auto input = [&](int64_t l, int64_t m) -> void* {
    return l == c ? SegmentInput(c, m) : Act(seg_, l - c - 1, m);
  };
  // Recompute the segment's inputs from its checkpoint.
  for (int64_t l = c; l + 1 < e; ++l) {
    void* slot = slots_.Use(l);
    const LayerKind& kind = kinds_.ForLayer(l);
    const int span = spans_.Begin(StreamId::kCompute, "recompute " + std::to_string(l));
    for (int64_t m = 0; m < M; ++m) {
      kind.Forward(CallFor(l, m, slot, /*kept=*/false), input(l, m), input(l + 1, m));
    }
    spans_.End(span);
  }
  for (int64_t l = e - 1; l >= c; --l) {
    const int g = static_cast<int>((*grad_turn)++ % kLayerGradBuffers);
    void* slot = slots_.Use(l);
    be.StreamWait(StreamId::kCompute, grad_free_[g].get());
    if (layer_grad_[g].bytes() > 0) {
      be.Zero(layer_grad_[g].get(), layer_grad_[g].bytes(), StreamId::kCompute);
    }
    const LayerKind& kind = kinds_.ForLayer(l);
    const int span = spans_.Begin(StreamId::kCompute, "bwd " + std::to_string(l));
    for (int64_t m = 0; m < M; ++m) {
      const LayerCall call = CallFor(l, m, slot, /*kept=*/true, layer_grad_[g].get());
      if (!Kept(l)) {  // recompute its intermediates (its output is not needed)
        LayerCall recompute = call;
        recompute.output_unused = true;
        kind.Forward(recompute, input(l, m), scratch_out_.get());
      } else {  // rebuild the few it did not keep
        kind.Rebuild(call, input(l, m));
      }
      kind.Backward(call, input(l, m), MicroBatchRow(dres_, m));
    }
    spans_.End(span);
    slots_.Release(l);
    be.Record(grad_ready_[g].get(), StreamId::kCompute);
    DeferDrain(layout_->DecoderUnit(l), layer_grad_[g].get(), grad_ready_[g].get(),
               grad_free_[g].get(), sink);
    slots_.UploadUpdated(l + 1);  // the layers above whose update the optimizer has applied
  }
  if (host_checkpoints_ != nullptr) {
    be.Record(host_checkpoints_->free_event(c), StreamId::kCompute);
  }
}

StepResult Pipeline::FinishStep(GradSink* sink, int64_t num_targets,
                                std::chrono::steady_clock::time_point start) {
  Backend& be = *backend_;
  const int64_t M = options_.micro_batches, n = options_.tokens_per_micro_batch;
  StepResult result;
  slots_.UploadUpdated(0);
  result.grad_norm = sink->Finish();
  slots_.UploadUpdated(0);
  // The D2H stream is in order: its last work (the embedding gradient) is after the loss
  // copy, and after every other stream's work of this step but the early uploads on H2D.
  drain_.WaitFor(ModelLayout::EmbeddingUnit());
  if (spans_.enabled() && slots_.early_uploads() > 0) {  // their spans must be complete
    be.Record(uploads_done_.get(), StreamId::kH2D);
    be.EventSync(uploads_done_.get());
  }
  const int64_t stat = DTypeSize(be.stat_dtype());
  double loss_sum = 0;
  for (int64_t i = 0; i < M * n; ++i) {
    loss_sum += ReadStat(&host_losses_[i * stat], be.stat_dtype());
  }
  result.num_targets = num_targets;
  result.loss = num_targets > 0 ? loss_sum / num_targets : 0.0;
  if (options_.objective.kind == ObjectiveKind::kPreference) {
    result.token_values.resize(M * n);
    for (int64_t i = 0; i < M * n; ++i) {
      result.token_values[i] = ReadStat(&host_losses_[i * stat], be.stat_dtype());
    }
  }
  if (config_.is_moe()) {
    result.aux_loss = AuxLoss();
    result.aux_loss_coef = aux_coef_;
  }
  result.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const int64_t checkpoint_h2d = host_checkpoints_ ? host_checkpoints_->h2d_bytes() : 0;
  const int64_t checkpoint_d2h = host_checkpoints_ ? host_checkpoints_->d2h_bytes() : 0;
  result.h2d_bytes = h2d_bytes_ + slots_.h2d_bytes() + checkpoint_h2d;
  result.d2h_bytes = d2h_bytes_ + drain_.d2h_bytes() + checkpoint_d2h;
  result.early_uploads = slots_.early_uploads();
  result.timeline = spans_.Collect();
  return result;
}

absl::StatusOr<EvalResult> Pipeline::Evaluate(const std::vector<MicroBatch>& batches,
                                              std::vector<double>* token_values) {
  MT_CHECK(options_.eval_micro_batches > 0);
  backend_->BindThread();
  for (const MicroBatch& b : batches) {
    RETURN_IF_ERROR(CheckShape(b, options_.tokens_per_micro_batch, "evaluation micro-batch"));
  }
  const auto start = std::chrono::steady_clock::now();
  Backend& be = *backend_;
  EvalResult result;
  slots_.BeginForwardOnly();
  h2d_bytes_ = d2h_bytes_ = 0;
  h2d_bytes_ += UploadEdgeUnit(ModelLayout::EmbeddingUnit(), embed_slot_.get(), &embed_uploaded_);
  be.Record(embed_loaded_.get(), StreamId::kH2D);
  h2d_bytes_ += UploadEdgeUnit(layout_->HeadUnit(), head_slot_.get(), &head_uploaded_);
  be.Record(head_loaded_.get(), StreamId::kH2D);
  const int64_t G = options_.eval_micro_batches, n = options_.tokens_per_micro_batch;
  if (token_values != nullptr) token_values->assign(batches.size() * n, 0.0);
  for (int64_t first = 0; first < static_cast<int64_t>(batches.size()); first += G) {
    const int64_t count = std::min<int64_t>(G, static_cast<int64_t>(batches.size()) - first);
    UploadEvalInputs(batches, first, count);
    EvalPass(count, &result, token_values == nullptr ? nullptr : token_values->data() + first * n);
    for (int64_t g = 0; g < count; ++g) result.num_targets += batches[first + g].num_targets();
  }
  result.micro_batches = static_cast<int64_t>(batches.size());
  result.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  result.h2d_bytes = h2d_bytes_ + slots_.h2d_bytes();
  result.d2h_bytes = d2h_bytes_;
  return result;
}

void Pipeline::UploadEvalInputs(const std::vector<MicroBatch>& batches, int64_t first,
                                int64_t count) {
  Backend& be = *backend_;
  const int64_t n = options_.tokens_per_micro_batch;
  int32_t* ints = static_cast<int32_t*>(batch_ints_.get());
  for (int64_t g = 0; g < count; ++g) {
    int32_t* base = ints + g * kBatchArrays * n;
    const MicroBatch& b = batches[first + g];
    be.CopyToDevice(base, b.tokens.data(), n * 4, StreamId::kH2D);
    be.CopyToDevice(base + n, b.targets.data(), n * 4, StreamId::kH2D);
    be.CopyToDevice(base + 2 * n, b.doc_start.data(), n * 4, StreamId::kH2D);
    be.CopyToDevice(base + 3 * n, b.positions.data(), n * 4, StreamId::kH2D);
    // No backward: the embedding's TokenOrder is not needed.
    batches_[g] = DeviceBatch{n, base, base + n, base + 2 * n, base + 3 * n, nullptr};
    h2d_bytes_ += 4 * 4 * n;
  }
  be.Record(inputs_loaded_.get(), StreamId::kH2D);
}

void* Pipeline::EvalAct(int side, int64_t g) const {
  const int64_t M = options_.micro_batches;
  return MicroBatchRow(*eval_sides_[side][g / M], g % M);
}

void Pipeline::EvalPass(int64_t count, EvalResult* result, double* token_values) {
  Backend& be = *backend_;
  const int64_t n = options_.tokens_per_micro_batch, L = config_.num_layers;
  be.StreamWait(StreamId::kCompute, inputs_loaded_.get());
  be.StreamWait(StreamId::kCompute, embed_loaded_.get());
  const UnitLayout& embedding = layout_->units[ModelLayout::EmbeddingUnit()];
  const void* embed_table = Offset(embed_slot_.get(), embedding.OffsetOf(TensorRole::kEmbedding),
                                   be.weight_dtype());
  for (int64_t g = 0; g < count; ++g) {
    be.Embedding(EvalAct(0, g), batches_[g].tokens, embed_table, n, config_.hidden_size,
                 StreamId::kCompute);
  }
  for (int64_t l = 0; l < L; ++l) {
    slots_.EnsureLoaded(l);
    if (l + 1 < L) slots_.EnsureLoaded(l + 1);  // prefetch
    void* slot = slots_.Use(l);
    const LayerKind& kind = kinds_.ForLayer(l);
    for (int64_t g = 0; g < count; ++g) {
      LayerCall call = CallFor(l, 0, slot, /*kept=*/false);
      call.batch = &batches_[g];
      // MoE: the routing's row offsets come to the host once per layer and micro-batch (a
      // scratch the next step's forward overwrites); an evaluation keeps no router statistics.
      call.first_forward = true;
      call.router_stats = nullptr;
      kind.Forward(call, EvalAct(l % 2, g), EvalAct((l + 1) % 2, g));
    }
    slots_.Release(l);
  }
  be.StreamWait(StreamId::kCompute, head_loaded_.get());
  const HeadTensors weights = head_.BindWeights(head_slot_.get(), embed_slot_.get());
  const int64_t stat = DTypeSize(be.stat_dtype());
  for (int64_t g = 0; g < count; ++g) {
    head_.Forward(weights, EvalAct(L % 2, g), static_cast<char*>(losses_.get()) + g * n * stat,
                  head_ws_.get(), batches_[g], StreamId::kCompute);
  }
  be.Record(losses_ready_.get(), StreamId::kCompute);
  be.StreamWait(StreamId::kD2H, losses_ready_.get());
  const int64_t loss_bytes = count * n * stat;
  be.CopyToHost(host_losses_.data(), losses_.get(), loss_bytes, StreamId::kD2H);
  be.Record(step_end_.get(), StreamId::kD2H);
  be.EventSync(step_end_.get());  // the next pass reuses the token arrays and the losses
  d2h_bytes_ += loss_bytes;
  for (int64_t i = 0; i < count * n; ++i) {
    const double value = ReadStat(&host_losses_[i * stat], be.stat_dtype());
    result->loss_sum += value;
    if (token_values != nullptr) token_values[i] = value;
  }
  ++result->passes;
}

double Pipeline::AuxLoss() const {
  const int64_t E = config_.moe.num_experts;
  const DType stat = backend_->stat_dtype();
  const auto* counts = reinterpret_cast<const int32_t*>(host_router_stats_.data());
  const char* prob_sum = host_router_stats_.data() + (E * 4 + 63) / 64 * 64;
  const double T = static_cast<double>(config_.NumMoeLayers()) * options_.micro_batches *
                   options_.tokens_per_micro_batch;
  double sum = 0;
  for (int64_t e = 0; e < E; ++e) {
    sum += (counts[e] / T) * (ReadStat(prob_sum + e * DTypeSize(stat), stat) / T);
  }
  return sum * E;
}

double UnionLength(std::vector<std::pair<double, double>> intervals) {
  std::sort(intervals.begin(), intervals.end());
  double total = 0, open = 0, close = -1;
  bool any = false;
  for (const auto& [a, b] : intervals) {
    if (!any || a > close) {
      if (any) total += close - open;
      open = a;
      close = b;
      any = true;
    } else {
      close = std::max(close, b);
    }
  }
  if (any) total += close - open;
  return total;
}

std::array<double, kNumStreams> StreamBusySeconds(const std::vector<TimelineSpan>& timeline) {
  std::array<std::vector<std::pair<double, double>>, kNumStreams> spans;
  for (const TimelineSpan& t : timeline) {
    spans[static_cast<int>(t.stream)].emplace_back(t.start_ms, t.end_ms);
  }
  std::array<double, kNumStreams> busy{};
  for (int s = 0; s < kNumStreams; ++s) busy[s] = UnionLength(std::move(spans[s])) / 1e3;
  return busy;
}

}  // namespace megatrain
