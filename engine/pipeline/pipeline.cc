#include "engine/pipeline/pipeline.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "engine/common/check.h"
#include "engine/common/status.h"
#include "engine/kernels/reference/rope.h"

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

}  // namespace

Pipeline::Pipeline(const ModelConfig& config, const ModelLayout& layout, HostStore* store,
                   GradSlabPool* slabs, Backend* backend, const PipelineOptions& options)
    : config_(config),
      layout_(&layout),
      store_(store),
      slabs_(slabs),
      backend_(backend),
      options_(options),
      decoder_(config, layout.units[layout.DecoderUnit(0)], backend),
      head_(config, layout, backend, options.loss_chunk_tokens),
      num_slots_(NumWeightSlots(config, options)),
      act_row_bytes_(config.hidden_size * DTypeSize(backend->act_dtype())) {}

int64_t Pipeline::NumWeightSlots(const ModelConfig& config, const PipelineOptions& options) {
  const int64_t least = std::max<int64_t>(2, options.checkpoint_every + 1);
  return std::max(least, std::min(options.weight_slots, config.num_layers));
}

int64_t Pipeline::DeviceBytesFor(const ModelConfig& config, const ModelLayout& layout,
                                 Backend* backend, const PipelineOptions& options) {
  Pipeline p(config, layout, nullptr, nullptr, backend, options);
  (void)p.Allocate(/*count_only=*/true);
  p.backend_ = nullptr;  // nothing to drain
  return p.device_bytes_;
}

Pipeline::~Pipeline() {
  if (backend_ == nullptr) return;
  backend_->BindThread();  // its buffers are freed on its device
  backend_->SyncAll();
  if (host_ckpt_.data() != nullptr) backend_->UnpinHostRange(host_ckpt_.data());
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
  if (slabs->slab_elements() < 1 || slabs->num_slabs() < 1) {
    return absl::InvalidArgumentError("pipeline: the gradient slab pool is empty");
  }
  std::unique_ptr<Pipeline> p(
      new Pipeline(config, store->layout(), store, slabs, backend, options));
  RETURN_IF_ERROR(p->Allocate());
  return p;
}

absl::Status Pipeline::Allocate(bool count_only) {
  Backend* be = backend_;
  const ModelLayout& layout = *layout_;
  const int64_t M = options_.micro_batches, n = options_.tokens_per_micro_batch;
  const int64_t L = config_.num_layers, K = options_.checkpoint_every;
  const int64_t wsize = DTypeSize(be->weight_dtype()), gsize = DTypeSize(be->grad_dtype());
  auto alloc = [&](DeviceBuffer* b, int64_t bytes, const char* what) -> absl::Status {
    if (count_only) {
      device_bytes_ += bytes;
      return absl::OkStatus();
    }
    absl::StatusOr<DeviceBuffer> r = DeviceBuffer::Allocate(be, bytes);
    if (!r.ok()) return Annotate(r.status(), absl::StrCat("allocating ", what));
    *b = std::move(*r);
    device_bytes_ += bytes;
    return absl::OkStatus();
  };
  const int64_t max_layer = layout.MaxDecoderElements();
  slots_.resize(num_slots_);
  for (int64_t s = 0; s < num_slots_; ++s) {
    RETURN_IF_ERROR(alloc(&slots_[s], max_layer * wsize, "a weight slot"));
    if (count_only) continue;
    slot_loaded_.emplace_back(be);
    slot_free_.emplace_back(be);
  }
  slot_layer_.assign(num_slots_, -1);
  fresh_from_ = config_.num_layers;
  const int64_t embed_n = layout.units[ModelLayout::EmbeddingUnit()].num_elements;
  const int64_t head_n = layout.units[layout.HeadUnit()].num_elements;
  RETURN_IF_ERROR(alloc(&embed_slot_, embed_n * wsize, "the embedding"));
  RETURN_IF_ERROR(alloc(&head_slot_, head_n * wsize, "the head"));
  // A reduce-scatter needs every rank's shard in the buffer: pad to whole shards.
  auto grad_elements = [&](int64_t n) {
    const GradCollective* c = options_.collective;
    return c == nullptr ? n : c->size() * GradShardElements(n, c->size());
  };
  RETURN_IF_ERROR(alloc(&embed_grad_, grad_elements(embed_n) * gsize, "the embedding gradient"));
  RETURN_IF_ERROR(alloc(&head_grad_, grad_elements(head_n) * gsize, "the head gradient"));
  for (int i = 0; i < 2; ++i) {
    RETURN_IF_ERROR(alloc(&layer_grad_[i], grad_elements(max_layer) * gsize,
                          "a layer gradient buffer"));
    if (count_only) continue;
    grad_ready_[i] = Event(be);
    grad_free_[i] = Event(be);
  }
  const int64_t mb_bytes = M * n * act_row_bytes_;
  const int64_t num_ckpt = (L + K - 1) / K + 1;
  if (options_.checkpoints_on_host) {
    for (int i = 0; i < 2 && count_only; ++i) {
      RETURN_IF_ERROR(alloc(&seg_in_[i], mb_bytes, "checkpoint staging"));
    }
  }
  if (options_.checkpoints_on_host && !count_only) {
    ASSIGN_OR_RETURN(host_ckpt_, HostArena::Map(num_ckpt * mb_bytes, "layer-input checkpoints"));
    RETURN_IF_ERROR(be->PinHostRange(host_ckpt_.data(), host_ckpt_.bytes()));
    for (int i = 0; i < 2; ++i) {
      RETURN_IF_ERROR(alloc(&seg_in_[i], mb_bytes, "checkpoint staging"));
      cur_saved_[i] = Event(be);
      seg_in_loaded_[i] = Event(be);
      seg_in_free_[i] = Event(be);
    }
  } else if (!options_.checkpoints_on_host) {
    ckpt_.resize(num_ckpt);
    for (DeviceBuffer& b : ckpt_) RETURN_IF_ERROR(alloc(&b, mb_bytes, "layer-input checkpoints"));
  }
  seg_.resize(K - 1);
  for (DeviceBuffer& b : seg_) RETURN_IF_ERROR(alloc(&b, mb_bytes, "recomputed layer inputs"));
  if (K > 1 || options_.checkpoints_on_host) {
    for (DeviceBuffer& b : cur_) RETURN_IF_ERROR(alloc(&b, mb_bytes, "forward activations"));
  }
  RETURN_IF_ERROR(alloc(&dres_, mb_bytes, "residual gradients"));
  RETURN_IF_ERROR(alloc(&scratch_out_, n * act_row_bytes_, "a scratch activation"));
  RETURN_IF_ERROR(alloc(&layer_ws_, decoder_.WorkspaceBytes(n), "the layer workspace"));
  if (!count_only) saved_ = decoder_.CarveWorkspace(layer_ws_.get(), n);
  const int64_t kept_bytes = decoder_.SavedBytes(n);
  kept_ws_.resize(options_.kept_layers);
  kept_.resize(options_.kept_layers);
  for (int64_t i = 0; i < options_.kept_layers; ++i) {
    RETURN_IF_ERROR(alloc(&kept_ws_[i], M * kept_bytes, "kept layer activations"));
    if (count_only) continue;
    for (int64_t m = 0; m < M; ++m) {
      kept_[i].push_back(decoder_.CarveSaved(static_cast<char*>(kept_ws_[i].get()) + m * kept_bytes,
                                             n, saved_));
    }
  }
  RETURN_IF_ERROR(alloc(&head_ws_, head_.WorkspaceBytes(n), "the loss workspace"));
  RETURN_IF_ERROR(alloc(&batch_ints_, M * kBatchArrays * n * sizeof(int32_t), "token arrays"));
  token_order_.resize(M * n);
  RETURN_IF_ERROR(alloc(&losses_, M * n * DTypeSize(be->stat_dtype()), "per-token losses"));
  host_losses_.resize(M * n * DTypeSize(be->stat_dtype()));
  const int64_t half = config_.head_dim / 2;
  RETURN_IF_ERROR(alloc(&inv_freq_, half * sizeof(float), "RoPE frequencies"));
  if (count_only) return absl::OkStatus();

  std::vector<float> inv_freq(half);
  const RopeScaling& rs = config_.rope_scaling;
  ref::RopeInvFreq(inv_freq.data(), config_.head_dim, config_.rope_theta,
                   rs.type == RopeScaling::Type::kLlama3, rs.factor, rs.low_freq_factor,
                   rs.high_freq_factor, rs.original_max_position_embeddings);
  be->CopyToDevice(inv_freq_.get(), inv_freq.data(), half * sizeof(float), StreamId::kH2D);
  be->SyncAll();

  embed_loaded_ = Event(be);
  head_loaded_ = Event(be);
  inputs_loaded_ = Event(be);
  losses_ready_ = Event(be);
  step_start_ = Event(be);
  step_end_ = Event(be);
  uploads_done_ = Event(be);
  for (size_t u = 0; u < layout.units.size(); ++u) unit_done_.emplace_back(be);
  for (int64_t i = 0; i < slabs_->num_slabs(); ++i) slab_ready_.emplace_back(be);
  return absl::OkStatus();
}

int Pipeline::SpanBegin(StreamId s, std::string label) {
  if (!options_.record_timeline) return -1;
  if (num_spans_ == static_cast<int>(spans_.size())) {
    spans_.push_back(Span{s, "", Event(backend_), Event(backend_)});
  }
  Span& span = spans_[num_spans_];
  span.stream = s;
  span.label = std::move(label);
  backend_->Record(span.begin.get(), s);
  return num_spans_++;
}

void Pipeline::SpanEnd(int span) {
  if (span < 0) return;
  backend_->Record(spans_[span].end.get(), spans_[span].stream);
}

void Pipeline::EnsureLoaded(int64_t layer) {
  const int64_t s = layer % num_slots_;
  if (slot_layer_[s] == layer) return;
  sink_->AwaitUnit(store_->layout().DecoderUnit(layer));  // its pending update is applied
  Upload(layer, "h2d w ");
}

void Pipeline::Upload(int64_t layer, const char* label) {
  const int64_t s = layer % num_slots_, unit = store_->layout().DecoderUnit(layer);
  backend_->StreamWait(StreamId::kH2D, slot_free_[s].get());  // the slot's last use is done
  const int span = SpanBegin(StreamId::kH2D, label + std::to_string(layer));
  h2d_bytes_ += 2 * store_->unit_elements(unit);
  backend_->UploadWeights(slots_[s].get(), store_->weights(unit), store_->unit_elements(unit),
                          StreamId::kH2D);
  SpanEnd(span);
  backend_->Record(slot_loaded_[s].get(), StreamId::kH2D);
  slot_layer_[s] = layer;
}

void Pipeline::UploadUpdated(int64_t lowest) {
  if (num_slots_ < config_.num_layers) return;  // slots are reused: none of its own
  while (fresh_from_ > std::max<int64_t>(lowest, 0)) {
    const int64_t layer = fresh_from_ - 1;
    // Updates land in backward order: at the first not yet applied, look again later.
    if (!sink_->UnitUpdated(store_->layout().DecoderUnit(layer))) return;
    Upload(layer, "h2d next w ");  // into its own slot, once its backward is done
    fresh_from_ = layer;
  }
}

void* Pipeline::UseSlot(int64_t layer) {
  const int64_t s = layer % num_slots_;
  MT_CHECK(slot_layer_[s] == layer);
  backend_->StreamWait(StreamId::kCompute, slot_loaded_[s].get());
  return slots_[s].get();
}

void Pipeline::ReleaseSlot(int64_t layer) {
  backend_->Record(slot_free_[layer % num_slots_].get(), StreamId::kCompute);
}

void* Pipeline::Act(std::vector<DeviceBuffer>& v, int64_t i, int64_t m) {
  return static_cast<char*>(v[i].get()) + m * options_.tokens_per_micro_batch * act_row_bytes_;
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

void* Pipeline::HostCheckpoint(int64_t layer) {
  const int64_t mb_bytes = options_.micro_batches * options_.tokens_per_micro_batch * act_row_bytes_;
  return host_ckpt_.data() + (layer / options_.checkpoint_every) * mb_bytes;
}

void* Pipeline::X(int64_t layer, int64_t m) {
  if (!options_.checkpoints_on_host && IsCheckpoint(layer)) return Checkpoint(layer, m);
  return static_cast<char*>(cur_[layer % 2].get()) +
         m * options_.tokens_per_micro_batch * act_row_bytes_;
}

void Pipeline::SaveCheckpointToHost(int64_t layer) {
  if (!options_.checkpoints_on_host || !IsCheckpoint(layer) || layer == config_.num_layers) return;
  Event& saved = cur_saved_[layer % 2];
  backend_->Record(saved.get(), StreamId::kCompute);  // x_layer is complete
  backend_->StreamWait(StreamId::kD2H, saved.get());
  const int span = SpanBegin(StreamId::kD2H, "d2h x " + std::to_string(layer));
  d2h_bytes_ += static_cast<int64_t>(cur_[layer % 2].bytes());
  backend_->CopyToHost(HostCheckpoint(layer), cur_[layer % 2].get(), cur_[layer % 2].bytes(),
                       StreamId::kD2H);
  SpanEnd(span);
  backend_->Record(saved.get(), StreamId::kD2H);  // cur_[layer % 2] may be overwritten
}

void Pipeline::LoadSegmentInput(int64_t c) {
  if (!options_.checkpoints_on_host || c < 0) return;
  const int i = (c / options_.checkpoint_every) % 2;
  if (seg_in_layer_[i] == c) return;
  backend_->StreamWait(StreamId::kH2D, seg_in_free_[i].get());
  const int span = SpanBegin(StreamId::kH2D, "h2d x " + std::to_string(c));
  h2d_bytes_ += static_cast<int64_t>(seg_in_[i].bytes());
  backend_->CopyToDevice(seg_in_[i].get(), HostCheckpoint(c), seg_in_[i].bytes(), StreamId::kH2D);
  SpanEnd(span);
  backend_->Record(seg_in_loaded_[i].get(), StreamId::kH2D);
  seg_in_layer_[i] = c;
}

void* Pipeline::SegmentInput(int64_t c, int64_t m) {
  if (!options_.checkpoints_on_host) return Checkpoint(c, m);
  const int i = (c / options_.checkpoint_every) % 2;
  return static_cast<char*>(seg_in_[i].get()) + m * options_.tokens_per_micro_batch * act_row_bytes_;
}

void Pipeline::DrainGradient(int64_t unit, void* device_grad, void* done_event,
                             void* free_event, GradSink* sink) {
  backend_->StreamWait(StreamId::kD2H, done_event);
  const int64_t n = store_->unit_elements(unit);
  const int64_t piece = slabs_->slab_elements();
  int64_t begin = 0, end = n;  // what this pipeline drains
  if (GradCollective* c = options_.collective; c != nullptr) {
    const int64_t shard = GradShardElements(n, c->size());
    // On the D2H stream, ahead of the copies; not a span: the stream's busy time stands
    // for PCIe, and this waits for the other devices.
    c->ReduceScatter(device_grad, shard, StreamId::kD2H);
    begin = std::min(n, c->rank() * shard);
    end = std::min(n, begin + shard);
  }
  const int span = SpanBegin(StreamId::kD2H, "d2h g " + std::to_string(unit));
  // A unit larger than a slab (the embedding, the lm_head) goes in slab-sized pieces, so
  // the host holds a few slabs of a layer's size whatever the vocabulary.
  for (int64_t offset = begin; offset < end; offset += piece) {
    const int64_t count = std::min(piece, end - offset);
    float* slab = slabs_->Acquire();  // returned by the sink once it has read the piece
    Event& ready = slab_ready_[slabs_->IndexOf(slab)];
    backend_->DownloadGrads(slab, Offset(device_grad, offset, backend_->grad_dtype()), count,
                            StreamId::kD2H);
    backend_->Record(ready.get(), StreamId::kD2H);
    sink->Submit(unit, slab, ready.get(), offset, count);
  }
  d2h_bytes_ += 4 * (end - begin);
  SpanEnd(span);
  if (free_event != nullptr) backend_->Record(free_event, StreamId::kD2H);
  backend_->Record(unit_done_[unit].get(), StreamId::kD2H);
}

absl::StatusOr<StepResult> Pipeline::Step(const std::vector<MicroBatch>& batches,
                                          GradSink* sink, int64_t step_targets) {
  Backend& be = *backend_;
  be.BindThread();
  const ModelLayout& layout = store_->layout();
  const int64_t M = options_.micro_batches, n = options_.tokens_per_micro_batch;
  const int64_t L = config_.num_layers, K = options_.checkpoint_every;
  if (static_cast<int64_t>(batches.size()) != M) {
    return absl::InvalidArgumentError(
        absl::StrCat("step got ", batches.size(), " micro-batches, the plan has ", M));
  }
  int64_t num_targets = 0;
  for (const MicroBatch& b : batches) {
    if (b.rows * b.seq_len != n || static_cast<int64_t>(b.tokens.size()) != n) {
      return absl::InvalidArgumentError(absl::StrCat(
          "micro-batch of ", b.tokens.size(), " tokens; the plan has ", n));
    }
    num_targets += b.num_targets();
  }
  const auto t0 = std::chrono::steady_clock::now();
  // The loss is a mean over the whole step's targets: over every replica's, in data
  // parallelism, so that the replicas' gradients add up to the step's.
  const int64_t denominator = step_targets > 0 ? step_targets : num_targets;
  const double scale = denominator > 0 ? 1.0 / denominator : 0.0;
  // The optimizer changed the weights: every slot is stale but those uploaded afresh in
  // the last step's backward.
  for (int64_t s = 0; s < num_slots_; ++s) {
    if (slot_layer_[s] < fresh_from_) slot_layer_[s] = -1;
  }
  fresh_from_ = L;
  num_spans_ = 0;
  h2d_bytes_ = d2h_bytes_ = 0;
  if (options_.record_timeline) {
    if (timeline_zero_.get() == nullptr) timeline_zero_ = Event(backend_);
    be.Record(timeline_zero_.get(), StreamId::kH2D);
  }

  // Inputs, embedding and head weights.
  std::vector<DeviceBatch> db(M);
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
    db[m] = DeviceBatch{n, base, base + n, base + 2 * n, base + 3 * n, base + 4 * n};
    h2d_bytes_ += kBatchArrays * 4 * n;
  }
  be.Record(inputs_loaded_.get(), StreamId::kH2D);
  const int64_t eu = ModelLayout::EmbeddingUnit(), hu = layout.HeadUnit();
  sink_ = sink;
  sink->AwaitUnit(eu);
  h2d_bytes_ += 2 * (store_->unit_elements(eu) + store_->unit_elements(hu));
  be.UploadWeights(embed_slot_.get(), store_->weights(eu), store_->unit_elements(eu),
                   StreamId::kH2D);
  be.Record(embed_loaded_.get(), StreamId::kH2D);
  EnsureLoaded(0);
  sink->AwaitUnit(hu);
  be.UploadWeights(head_slot_.get(), store_->weights(hu), store_->unit_elements(hu),
                   StreamId::kH2D);
  be.Record(head_loaded_.get(), StreamId::kH2D);

  // Forward: embedding, then layer by layer for all micro-batches.
  be.Record(step_start_.get(), StreamId::kCompute);
  be.StreamWait(StreamId::kCompute, inputs_loaded_.get());
  be.StreamWait(StreamId::kCompute, embed_loaded_.get());
  be.Zero(embed_grad_.get(), embed_grad_.bytes(), StreamId::kCompute);
  be.Zero(head_grad_.get(), head_grad_.bytes(), StreamId::kCompute);
  const void* embed_table =
      Offset(embed_slot_.get(), layout.units[eu].OffsetOf(TensorRole::kEmbedding),
             be.weight_dtype());
  seg_in_layer_[0] = seg_in_layer_[1] = -1;
  for (int64_t m = 0; m < M; ++m) {
    be.Embedding(X(0, m), db[m].tokens, embed_table, n, config_.hidden_size, StreamId::kCompute);
  }
  SaveCheckpointToHost(0);
  for (int64_t l = 0; l < L; ++l) {
    EnsureLoaded(l);
    if (l + 1 < L) EnsureLoaded(l + 1);  // prefetch
    DecoderTensors w = decoder_.BindWeights(UseSlot(l));
    if (options_.checkpoints_on_host) {
      be.StreamWait(StreamId::kCompute, cur_saved_[(l + 1) % 2].get());  // its D2H is done
    }
    const int span = SpanBegin(StreamId::kCompute, "fwd " + std::to_string(l));
    for (int64_t m = 0; m < M; ++m) {
      decoder_.Forward(w, X(l, m), X(l + 1, m), SavedFor(l, m), db[m],
                       static_cast<const float*>(inv_freq_.get()), StreamId::kCompute);
    }
    SpanEnd(span);
    ReleaseSlot(l);
    SaveCheckpointToHost(l + 1);
  }

  // Head: loss forward + backward, per micro-batch.
  be.StreamWait(StreamId::kCompute, head_loaded_.get());
  const HeadTensors hw = head_.BindWeights(head_slot_.get(), embed_slot_.get());
  const HeadTensors hg = head_.BindGrads(head_grad_.get(), embed_grad_.get());
  const int64_t stat = DTypeSize(be.stat_dtype());
  const int head_span = SpanBegin(StreamId::kCompute, "head");
  for (int64_t m = 0; m < M; ++m) {
    head_.ForwardBackward(hw, hg, X(L, m),
                          static_cast<char*>(dres_.get()) + m * n * act_row_bytes_,
                          static_cast<char*>(losses_.get()) + m * n * stat, head_ws_.get(),
                          db[m], scale, StreamId::kCompute);
  }
  SpanEnd(head_span);
  be.Record(losses_ready_.get(), StreamId::kCompute);
  be.StreamWait(StreamId::kD2H, losses_ready_.get());
  d2h_bytes_ += static_cast<int64_t>(host_losses_.size());
  be.CopyToHost(host_losses_.data(), losses_.get(), host_losses_.size(), StreamId::kD2H);
  // Complete here even when tied: the tied lm_head gradient lands in the embedding's.
  DrainGradient(hu, head_grad_.get(), losses_ready_.get(), nullptr, sink);

  // Backward, one checkpoint segment at a time from the top.
  int64_t grad_turn = 0;
  const float* inv_freq = static_cast<const float*>(inv_freq_.get());
  for (int64_t c = ((L - 1) / K) * K; c >= 0; c -= K) {
    const int64_t e = std::min(c + K, L);
    for (int64_t l = c; l < e; ++l) EnsureLoaded(l);
    LoadSegmentInput(c);
    if (c > 0) EnsureLoaded(c - 1);  // prefetch the top of the segment below
    LoadSegmentInput(c - K);          // and its checkpoint
    const int seg_slot = static_cast<int>((c / K) % 2);
    if (options_.checkpoints_on_host) {
      be.StreamWait(StreamId::kCompute, seg_in_loaded_[seg_slot].get());
    }
    auto input = [&](int64_t l, int64_t m) -> void* {
      return l == c ? SegmentInput(c, m) : Act(seg_, l - c - 1, m);
    };
    // Recompute the segment's inputs from its checkpoint.
    for (int64_t l = c; l + 1 < e; ++l) {
      DecoderTensors w = decoder_.BindWeights(UseSlot(l));
      const int span = SpanBegin(StreamId::kCompute, "recompute " + std::to_string(l));
      for (int64_t m = 0; m < M; ++m) {
        decoder_.Forward(w, input(l, m), input(l + 1, m), saved_, db[m], inv_freq,
                         StreamId::kCompute);
      }
      SpanEnd(span);
    }
    for (int64_t l = e - 1; l >= c; --l) {
      const int g = grad_turn++ % 2;
      DecoderTensors w = decoder_.BindWeights(UseSlot(l));
      DecoderTensors gw = decoder_.BindGrads(layer_grad_[g].get());
      be.StreamWait(StreamId::kCompute, grad_free_[g].get());
      be.Zero(layer_grad_[g].get(), layer_grad_[g].bytes(), StreamId::kCompute);
      const int span = SpanBegin(StreamId::kCompute, "bwd " + std::to_string(l));
      for (int64_t m = 0; m < M; ++m) {
        void* dres = static_cast<char*>(dres_.get()) + m * n * act_row_bytes_;
        if (!Kept(l)) {  // recompute its intermediates
          decoder_.Forward(w, input(l, m), scratch_out_.get(), saved_, db[m], inv_freq,
                           StreamId::kCompute);
        } else {  // rebuild the few it did not keep
          decoder_.Rebuild(w, input(l, m), SavedFor(l, m), db[m], StreamId::kCompute);
        }
        decoder_.Backward(w, gw, input(l, m), dres, SavedFor(l, m), db[m], inv_freq,
                          StreamId::kCompute);
      }
      SpanEnd(span);
      ReleaseSlot(l);
      be.Record(grad_ready_[g].get(), StreamId::kCompute);
      const int64_t unit = layout.DecoderUnit(l);
      DrainGradient(unit, layer_grad_[g].get(), grad_ready_[g].get(), grad_free_[g].get(),
                    sink);
      UploadUpdated(l);  // the layers above whose update the optimizer has already applied
    }
    if (options_.checkpoints_on_host) be.Record(seg_in_free_[seg_slot].get(), StreamId::kCompute);
  }
  // Embedding backward.
  for (int64_t m = 0; m < M; ++m) {
    be.EmbeddingBackward(embed_grad_.get(), static_cast<char*>(dres_.get()) + m * n * act_row_bytes_,
                         db[m].tokens, db[m].token_order, n, config_.hidden_size,
                         StreamId::kCompute);
  }
  be.Record(step_end_.get(), StreamId::kCompute);
  DrainGradient(eu, embed_grad_.get(), step_end_.get(), nullptr, sink);

  StepResult result;
  UploadUpdated(0);
  result.grad_norm = sink->Finish();
  UploadUpdated(0);
  // The D2H stream is in order: its last work (the embedding gradient) is after the loss
  // copy, and after every other stream's work of this step but the early uploads on H2D.
  be.EventSync(unit_done_[eu].get());
  if (options_.record_timeline && fresh_from_ < L) {  // their spans must be complete
    be.Record(uploads_done_.get(), StreamId::kH2D);
    be.EventSync(uploads_done_.get());
  }
  double loss_sum = 0;
  for (int64_t i = 0; i < M * n; ++i) loss_sum += ReadStat(&host_losses_[i * stat], be.stat_dtype());
  result.num_targets = num_targets;
  result.loss = num_targets > 0 ? loss_sum / num_targets : 0.0;
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  result.h2d_bytes = h2d_bytes_;
  result.d2h_bytes = d2h_bytes_;
  result.early_uploads = L - fresh_from_;
  for (int i = 0; i < num_spans_; ++i) {
    const Span& span = spans_[i];
    result.timeline.push_back(
        TimelineSpan{span.stream, span.label,
                     1e3 * be.ElapsedSeconds(timeline_zero_.get(), span.begin.get()),
                     1e3 * be.ElapsedSeconds(timeline_zero_.get(), span.end.get())});
  }
  return result;
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
