#include "engine/generate/generator.h"

#include <algorithm>
#include <cstring>
#include <set>

#include "absl/strings/str_cat.h"
#include "engine/common/check.h"
#include "engine/common/status.h"
#include "engine/layers/objective.h"

namespace megatrain {
namespace {

constexpr int64_t kIntArrays = 6;  // tokens, doc_start, positions, seq_slot, kv_length, rows

// Each device buffer of a Generator, in bytes: what Create() allocates and the planner counts.
struct GeneratorMemory {
  int64_t weight_slots = 0, weight_slot = 0;
  int64_t embedding_slot = 0, head_slot = 0;
  int64_t activations = 0;  // each of two
  int64_t workspace = 0;
  int64_t ints = 0;
  int64_t rope_frequencies = 0;
  int64_t kv_layer = 0;  // one layer's k or v
  int64_t head_in = 0, head_rstd = 0, logits = 0, picks = 0;

  int64_t TotalBytes(int64_t num_layers) const {
    return weight_slots * weight_slot + embedding_slot + head_slot + 2 * activations + workspace +
           ints + rope_frequencies + 2 * num_layers * kv_layer + head_in + head_rstd + logits +
           picks;
  }
};

int64_t MaxTokens(const GeneratorOptions& o) { return std::max(o.prefill_tokens, o.max_sequences); }

int64_t NumSlots(const ModelConfig& config, const GeneratorOptions& o) {
  return std::clamp<int64_t>(o.weight_slots, 2, std::max<int64_t>(2, config.num_layers));
}

GeneratorMemory SizeGeneratorMemory(const ModelConfig& config, const ModelLayout& layout,
                                    Backend* backend, const GeneratorOptions& o,
                                    const LayerKinds& kinds) {
  const int64_t act = DTypeSize(backend->act_dtype()), wsize = DTypeSize(backend->weight_dtype());
  const int64_t T = MaxTokens(o), B = o.max_sequences, C = config.hidden_size;
  GeneratorMemory m;
  m.weight_slots = NumSlots(config, o);
  m.weight_slot = layout.MaxDecoderElements() * wsize;
  m.embedding_slot = layout.units[ModelLayout::EmbeddingUnit()].num_elements * wsize;
  m.head_slot = layout.units[layout.HeadUnit()].num_elements * wsize;
  m.activations = T * C * act;
  m.workspace = kinds.MaxWorkspaceBytes(T);
  m.ints = kIntArrays * T * static_cast<int64_t>(sizeof(int32_t));
  m.rope_frequencies = config.head_dim / 2 * static_cast<int64_t>(sizeof(float));
  m.kv_layer = B * o.max_len * config.num_kv_heads * config.head_dim * act;
  m.head_in = B * C * act;
  m.head_rstd = B * DTypeSize(backend->stat_dtype());
  m.logits = B * config.vocab_size * act;
  m.picks = B * static_cast<int64_t>(sizeof(int32_t) + sizeof(float));
  return m;
}

absl::Status CheckOptions(const GeneratorOptions& o) {
  if (o.max_sequences < 1 || o.max_len < 2 || o.prefill_tokens < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("generation: max_sequences (", o.max_sequences, ") and prefill_tokens (",
                     o.prefill_tokens, ") must be >= 1 and max_len (", o.max_len, ") >= 2"));
  }
  if (MaxTokens(o) * std::max<int64_t>(o.max_len, 1) > (int64_t{1} << 40)) {
    return absl::InvalidArgumentError("generation: max_sequences x max_len is too large");
  }
  return absl::OkStatus();
}

}  // namespace

int64_t GeneratorDeviceBytes(const ModelConfig& config, const ModelLayout& layout, Backend* backend,
                             const GeneratorOptions& options) {
  const LayerKinds kinds = MakeLayerKinds(config, layout, backend);
  return SizeGeneratorMemory(config, layout, backend, options, kinds).TotalBytes(config.num_layers);
}

absl::StatusOr<GeneratorOptions> PlanGenerator(const ModelConfig& config,
                                               const ModelLayout& layout, Backend* backend,
                                               int64_t budget_bytes, int64_t wanted,
                                               int64_t max_len, int64_t prefill_tokens) {
  GeneratorOptions o;
  o.max_len = max_len;
  o.prefill_tokens = prefill_tokens;
  RETURN_IF_ERROR(CheckOptions(o));
  const LayerKinds kinds = MakeLayerKinds(config, layout, backend);
  auto bytes = [&](const GeneratorOptions& g) {
    return SizeGeneratorMemory(config, layout, backend, g, kinds).TotalBytes(config.num_layers);
  };
  o.max_sequences = 1;
  o.weight_slots = config.num_layers;  // resident, if one sequence fits beside it
  if (bytes(o) > budget_bytes) o.weight_slots = 2;
  if (bytes(o) > budget_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "generation needs ", bytes(o) >> 20, " MiB of device memory for one sequence of ",
        max_len, " tokens with its weights streamed; the device has ", budget_bytes >> 20,
        " MiB: shorten the prompts or max_new_tokens"));
  }
  int64_t lo = 1, hi = std::max<int64_t>(1, wanted);  // the most sequences that fit
  while (lo < hi) {
    o.max_sequences = (lo + hi + 1) / 2;
    if (bytes(o) <= budget_bytes) {
      lo = o.max_sequences;
    } else {
      hi = o.max_sequences - 1;
    }
  }
  o.max_sequences = lo;
  return o;
}

Generator::Generator(const ModelConfig& config, HostStore* store, Backend* backend,
                     const GeneratorOptions& options)
    : config_(config),
      layout_(&store->layout()),
      store_(store),
      backend_(backend),
      options_(options),
      max_tokens_(MaxTokens(options)),
      kinds_(MakeLayerKinds(config, store->layout(), backend)),
      head_(config, store->layout(), backend, 1,
            MakeObjective(ObjectiveKind::kNextTokenCrossEntropy, backend)),
      spans_(backend, /*enabled=*/false),
      slots_(backend, store, store->layout(), NumSlots(config, options), &spans_),
      lengths_(options.max_sequences, 0) {}

Generator::~Generator() {
  if (backend_ == nullptr) return;
  backend_->BindThread();
  backend_->SyncAll();
}

absl::StatusOr<std::unique_ptr<Generator>> Generator::Create(const ModelConfig& config,
                                                             HostStore* store, Backend* backend,
                                                             const GeneratorOptions& options) {
  RETURN_IF_ERROR(CheckOptions(options));
  backend->BindThread();
  std::unique_ptr<Generator> g(new Generator(config, store, backend, options));
  RETURN_IF_ERROR(g->Allocate());
  return g;
}

absl::Status Generator::Allocate() {
  Backend* be = backend_;
  const GeneratorMemory m = SizeGeneratorMemory(config_, *layout_, be, options_, kinds_);
  DeviceAllocator alloc(be);
  RETURN_IF_ERROR(slots_.Allocate(&alloc));
  RETURN_IF_ERROR(alloc.Allocate(&embed_slot_, m.embedding_slot, "the embedding"));
  RETURN_IF_ERROR(alloc.Allocate(&head_slot_, m.head_slot, "the head"));
  for (DeviceBuffer& x : x_) RETURN_IF_ERROR(alloc.Allocate(&x, m.activations, "activations"));
  RETURN_IF_ERROR(alloc.Allocate(&workspace_, m.workspace, "the layer workspace"));
  RETURN_IF_ERROR(alloc.Allocate(&ints_, m.ints, "token arrays"));
  RETURN_IF_ERROR(alloc.Allocate(&inv_freq_, m.rope_frequencies, "RoPE frequencies"));
  RETURN_IF_ERROR(alloc.Allocate(&kv_, 2 * config_.num_layers * m.kv_layer, "the KV cache"));
  RETURN_IF_ERROR(alloc.Allocate(&head_in_, m.head_in, "the head's input"));
  RETURN_IF_ERROR(alloc.Allocate(&head_rstd_, m.head_rstd, "the head's norm"));
  RETURN_IF_ERROR(alloc.Allocate(&logits_, m.logits, "logits"));
  RETURN_IF_ERROR(alloc.Allocate(&picks_, m.picks, "greedy picks"));
  MT_CHECK(alloc.bytes() == m.TotalBytes(config_.num_layers));
  device_bytes_ = alloc.bytes();
  for (int64_t l = 0; l < config_.num_layers; ++l) {
    char* k = static_cast<char*>(kv_.get()) + 2 * l * m.kv_layer;
    kv_layers_.push_back(KvCacheLayer{k, k + m.kv_layer, options_.max_len});
  }
  host_logits_.resize(m.logits);
  host_picks_.resize(m.picks);
  const std::vector<float> inv_freq = RopeInvFreqs(config_);
  be->CopyToDevice(inv_freq_.get(), inv_freq.data(), m.rope_frequencies, StreamId::kH2D);
  uploaded_ = Event(be);
  done_ = Event(be);
  Refresh();
  return absl::OkStatus();
}

void Generator::Refresh() {
  Backend& be = *backend_;
  be.BindThread();
  be.SyncAll();     // no pass still reads the slots
  slots_.Forget();  // every slot stale: the weights changed
  h2d_bytes_ += UploadUnitWeights(&be, *store_, ModelLayout::EmbeddingUnit(), embed_slot_.get(),
                                  StreamId::kH2D);
  h2d_bytes_ +=
      UploadUnitWeights(&be, *store_, layout_->HeadUnit(), head_slot_.get(), StreamId::kH2D);
  be.SyncAll();
}

void Generator::UploadBatch(const std::vector<int32_t>& tokens,
                            const std::vector<int32_t>& doc_start,
                            const std::vector<int32_t>& positions,
                            const std::vector<int32_t>& seq_slot,
                            const std::vector<int32_t>& kv_length) {
  Backend& be = *backend_;
  const int64_t n = static_cast<int64_t>(tokens.size()), T = max_tokens_;
  int32_t* ints = static_cast<int32_t*>(ints_.get());
  be.CopyToDevice(ints, tokens.data(), n * 4, StreamId::kH2D);
  be.CopyToDevice(ints + T, doc_start.data(), n * 4, StreamId::kH2D);
  be.CopyToDevice(ints + 2 * T, positions.data(), n * 4, StreamId::kH2D);
  be.CopyToDevice(ints + 3 * T, seq_slot.data(), n * 4, StreamId::kH2D);
  if (!kv_length.empty()) be.CopyToDevice(ints + 4 * T, kv_length.data(), n * 4, StreamId::kH2D);
  h2d_bytes_ += (kv_length.empty() ? 4 : 5) * 4 * n;
  be.Record(uploaded_.get(), StreamId::kH2D);
  batch_ = DeviceBatch{};
  batch_.num_tokens = n;
  batch_.tokens = ints;
  batch_.doc_start = ints + T;
  batch_.positions = ints + 2 * T;
  batch_.seq_slot = ints + 3 * T;
  batch_.kv_length = kv_length.empty() ? nullptr : ints + 4 * T;
}

void* Generator::Layers() {
  Backend& be = *backend_;
  const int64_t n = batch_.num_tokens, L = config_.num_layers;
  be.StreamWait(StreamId::kCompute, uploaded_.get());
  const UnitLayout& embedding = layout_->units[ModelLayout::EmbeddingUnit()];
  const void* table =
      Offset(embed_slot_.get(), embedding.OffsetOf(TensorRole::kEmbedding), be.weight_dtype());
  be.Embedding(x_[0].get(), batch_.tokens, table, n, config_.hidden_size, StreamId::kCompute);
  slots_.BeginForwardOnly();
  for (int64_t l = 0; l < L; ++l) {
    slots_.EnsureLoaded(l);
    if (l + 1 < L) slots_.EnsureLoaded(l + 1);  // prefetch
    LayerCall call;
    call.weights = slots_.Use(l);
    call.workspace = workspace_.get();
    call.batch = &batch_;
    call.rope_inv_freq = static_cast<const float*>(inv_freq_.get());
    call.kv = &kv_layers_[l];
    kinds_.ForLayer(l).Forward(call, x_[l % 2].get(), x_[(l + 1) % 2].get());
    slots_.Release(l);
  }
  h2d_bytes_ += slots_.h2d_bytes();
  return x_[L % 2].get();
}

void Generator::Head(const void* x, const std::vector<int32_t>* rows, int64_t count,
                     const Output& out) {
  Backend& be = *backend_;
  const int64_t C = config_.hidden_size, V = config_.vocab_size;
  const HeadTensors w = head_.BindWeights(head_slot_.get(), embed_slot_.get());
  const void* in = x;
  if (rows != nullptr) {  // the rows' final activations, gathered as an embedding is
    int32_t* device_rows = static_cast<int32_t*>(ints_.get()) + 5 * max_tokens_;
    be.CopyToDevice(device_rows, rows->data(), count * 4, StreamId::kCompute);
    be.Embedding(head_in_.get(), device_rows, x, count, C, StreamId::kCompute);
    in = head_in_.get();
  }
  be.RmsNorm(head_in_.get(), head_rstd_.get(), in, w.final_norm, count, C, config_.rms_norm_eps,
             StreamId::kCompute);                                           // hf = norm(x)
  be.Linear(logits_.get(), head_in_.get(), w.lm_head, nullptr, count, C, V, false,
            StreamId::kCompute);                                            // logits = hf Wlm^T
  if (out.greedy != nullptr) PicksToHost(count, out.greedy);
  if (out.logits != nullptr) LogitsToHost(count, out.logits);
}

void Generator::LogitsToHost(int64_t count, std::vector<float>* logits) {
  Backend& be = *backend_;
  const int64_t V = config_.vocab_size, act = DTypeSize(be.act_dtype());
  be.Record(done_.get(), StreamId::kCompute);
  be.StreamWait(StreamId::kD2H, done_.get());
  be.CopyToHost(host_logits_.data(), logits_.get(), count * V * act, StreamId::kD2H);
  be.Record(done_.get(), StreamId::kD2H);
  be.EventSync(done_.get());
  logits->resize(count * V);
  float* dst = logits->data();
  const char* src = host_logits_.data();
  if (be.act_dtype() == DType::kBF16) {  // (B, V) of them each step: on every core
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < count * V; ++i) {
      uint16_t h;
      std::memcpy(&h, src + i * 2, 2);
      dst[i] = Bf16ToFloat(h);
    }
  } else if (be.act_dtype() == DType::kF64) {  // the CPU backend in double
    for (int64_t i = 0; i < count * V; ++i) {
      double d;
      std::memcpy(&d, src + i * 8, 8);
      dst[i] = static_cast<float>(d);
    }
  } else {
    MT_CHECK(be.act_dtype() == DType::kF32);
    std::memcpy(dst, src, count * V * act);
  }
}

void Generator::PicksToHost(int64_t count, std::vector<SampledToken>* picks) {
  Backend& be = *backend_;
  const int64_t B = options_.max_sequences;
  int32_t* ids = static_cast<int32_t*>(picks_.get());
  float* logprobs = reinterpret_cast<float*>(ids + B);
  be.GreedyPick(ids, logprobs, logits_.get(), count, config_.vocab_size, StreamId::kCompute);
  be.Record(done_.get(), StreamId::kCompute);
  be.StreamWait(StreamId::kD2H, done_.get());
  be.CopyToHost(host_picks_.data(), picks_.get(), host_picks_.size(), StreamId::kD2H);
  be.Record(done_.get(), StreamId::kD2H);
  be.EventSync(done_.get());
  picks->resize(count);
  for (int64_t i = 0; i < count; ++i) {
    float lp;
    std::memcpy(&(*picks)[i].id, &host_picks_[i * 4], 4);
    std::memcpy(&lp, &host_picks_[(B + i) * 4], 4);
    (*picks)[i].logprob = lp;
  }
}

absl::Status Generator::Prefill(const std::vector<std::vector<int32_t>>& prompts,
                                const std::vector<int32_t>& slots, const Output& out) {
  if (prompts.size() != slots.size() || prompts.empty() ||
      static_cast<int64_t>(prompts.size()) > options_.max_sequences) {
    return absl::InvalidArgumentError(absl::StrCat("prefill: ", prompts.size(), " prompts for ",
                                                   slots.size(), " slots (1 to ",
                                                   options_.max_sequences, ")"));
  }
  std::vector<int32_t> tokens, doc_start, positions, seq_slot, last_rows;
  std::set<int32_t> seen;
  for (size_t i = 0; i < prompts.size(); ++i) {
    const int64_t len = static_cast<int64_t>(prompts[i].size());
    if (slots[i] < 0 || slots[i] >= options_.max_sequences || !seen.insert(slots[i]).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("prefill: slot ", slots[i], " is out of range or given twice"));
    }
    if (len < 1 || len >= options_.max_len) {
      return absl::InvalidArgumentError(absl::StrCat(
          "prompt ", i, " has ", len, " tokens; a prompt holds 1 to ", options_.max_len - 1,
          " (generation max_len ", options_.max_len, ", the new tokens included)"));
    }
    const int32_t start = static_cast<int32_t>(tokens.size());
    for (int64_t j = 0; j < len; ++j) {
      const int32_t id = prompts[i][j];
      if (id < 0 || id >= config_.vocab_size) {
        return absl::InvalidArgumentError(absl::StrCat("prompt ", i, " holds token id ", id,
                                                       "; the model's vocab_size is ",
                                                       config_.vocab_size));
      }
      tokens.push_back(id);
      doc_start.push_back(start);
      positions.push_back(static_cast<int32_t>(j));
      seq_slot.push_back(slots[i]);
    }
    last_rows.push_back(static_cast<int32_t>(tokens.size() - 1));
  }
  if (static_cast<int64_t>(tokens.size()) > options_.prefill_tokens) {
    return absl::InvalidArgumentError(absl::StrCat("prefill: ", tokens.size(),
                                                   " prompt tokens; a pass takes at most ",
                                                   options_.prefill_tokens));
  }
  backend_->BindThread();
  UploadBatch(tokens, doc_start, positions, seq_slot, {});
  const void* x = Layers();
  for (size_t i = 0; i < prompts.size(); ++i) lengths_[slots[i]] = prompts[i].size();
  Head(x, &last_rows, static_cast<int64_t>(prompts.size()), out);
  return absl::OkStatus();
}

absl::Status Generator::Decode(const std::vector<int32_t>& tokens,
                               const std::vector<int32_t>& slots, const Output& out) {
  const int64_t B = static_cast<int64_t>(tokens.size());
  if (B != static_cast<int64_t>(slots.size()) || B < 1 || B > options_.max_sequences) {
    return absl::InvalidArgumentError(absl::StrCat("decode: ", B, " tokens for ", slots.size(),
                                                   " slots (1 to ", options_.max_sequences, ")"));
  }
  std::vector<int32_t> doc_start(B), positions(B), kv_length(B);
  std::set<int32_t> seen;
  for (int64_t i = 0; i < B; ++i) {
    const int32_t slot = slots[i];
    if (slot < 0 || slot >= options_.max_sequences || lengths_[slot] == 0 ||
        !seen.insert(slot).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("decode: slot ", slot, " is out of range, empty or given twice"));
    }
    if (lengths_[slot] >= options_.max_len) {
      return absl::OutOfRangeError(absl::StrCat("decode: the sequence in slot ", slot,
                                                " holds max_len (", options_.max_len, ") tokens"));
    }
    if (tokens[i] < 0 || tokens[i] >= config_.vocab_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("decode: token id ", tokens[i], " is outside the vocabulary"));
    }
    doc_start[i] = static_cast<int32_t>(i);
    positions[i] = static_cast<int32_t>(lengths_[slot]);
    kv_length[i] = static_cast<int32_t>(lengths_[slot] + 1);
  }
  backend_->BindThread();
  UploadBatch(tokens, doc_start, positions, slots, kv_length);
  const void* x = Layers();
  for (int64_t i = 0; i < B; ++i) ++lengths_[slots[i]];
  Head(x, nullptr, B, out);
  return absl::OkStatus();
}

}  // namespace megatrain
