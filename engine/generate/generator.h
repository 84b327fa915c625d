// The generation engine's device side: prefill and decode over a model in the host store,
// with a KV cache on the device.
//
//   prefill  prompts packed as documents of one batch -> embedding -> every layer (its keys
//            and values written to each prompt's cache slot) -> the last position of each
//            prompt -> final norm -> lm_head -> logits (count, V)
//   decode   one new token per sequence -> every layer (its key and value appended to its
//            slot; attention over the slot's cache) -> final norm -> lm_head -> logits
//
// The layers run the training forward's kinds and kernels (layers/layer_kind.h): a prefill
// computes what a training forward computes on the same tokens. Weights stream through
// weight slots as in training (transfer/weight_slots.h): with a slot per layer every layer
// stays on the device after its first upload; with fewer, each pass uploads every layer
// once, and the sequences decoded together share that crossing. MoE layers route on the
// device as in training.
//
// All device memory is allocated by Create(); Prefill() and Decode() allocate none on the
// device. Thread-compatible: one thread drives a Generator. The host store must not change
// while it runs (Refresh() after it does: a training job's new weights).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/common/backend.h"
#include "engine/generate/sampling.h"
#include "engine/layers/head.h"
#include "engine/layers/layer_kind.h"
#include "engine/model/config.h"
#include "engine/store/host_store.h"
#include "engine/transfer/timeline.h"
#include "engine/transfer/weight_slots.h"

namespace megatrain {

struct GeneratorOptions {
  int64_t max_sequences = 8;      // KV cache slots: sequences in flight at once
  int64_t max_len = 2048;         // tokens a sequence holds, prompt and new (the cache's length)
  int64_t prefill_tokens = 2048;  // tokens one prefill pass takes (prompts packed together)
  // Device slots for the decoder layers' weights: >= num_layers keeps every layer resident
  // after its first upload; fewer (at least 2) streams them through each pass.
  int64_t weight_slots = 0;
};

// The device bytes a Generator with `options` allocates for `layout` on `backend` (the
// planner's figure; Create() allocates exactly this).
int64_t GeneratorDeviceBytes(const ModelConfig& config, const ModelLayout& layout, Backend* backend,
                             const GeneratorOptions& options);

// The generation `budget_bytes` of device memory holds for sequences of up to `max_len`
// tokens, prompts of up to `prefill_tokens` at once: every layer resident when the weights
// and one sequence fit, else streamed through two slots; then as many sequences, at most
// `wanted`, as the memory left holds (with streamed weights, each crossing of a layer serves
// all of them). ResourceExhausted with the numbers when not even one sequence fits.
[[nodiscard]] absl::StatusOr<GeneratorOptions> PlanGenerator(const ModelConfig& config,
                                                             const ModelLayout& layout,
                                                             Backend* backend,
                                                             int64_t budget_bytes,
                                                             int64_t wanted, int64_t max_len,
                                                             int64_t prefill_tokens);

class Generator {
 public:
  // `store` and `backend` outlive the Generator. InvalidArgument for options out of range
  // (named), ResourceExhausted when the device memory does not hold them.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<Generator>> Create(
      const ModelConfig& config, HostStore* store, Backend* backend,
      const GeneratorOptions& options);
  ~Generator();

  // What a pass returns for each of its sequences' newest position: the logits, f32
  // (count, V), to sample from on the host; or the greedy pick (the argmax, lowest id on
  // ties, and its log-probability), made on the device, so only 8 bytes a sequence cross.
  struct Output {
    std::vector<float>* logits = nullptr;
    std::vector<SampledToken>* greedy = nullptr;  // id -1: the row's logits hold a NaN
  };

  // Prefills prompts[i] into cache slot slots[i] (forgetting what the slot held); `out`
  // gets each prompt's last position.
  // InvalidArgument: an empty prompt, a slot out of range or given twice, a prompt longer
  // than max_len, or prompts over prefill_tokens in all.
  [[nodiscard]] absl::Status Prefill(const std::vector<std::vector<int32_t>>& prompts,
                                     const std::vector<int32_t>& slots, const Output& out);
  // Appends tokens[i] to the sequence in slot slots[i]; `out` gets that new position.
  // InvalidArgument for a slot never prefilled or given twice, or more than max_sequences
  // tokens; OutOfRange for a sequence already max_len long.
  [[nodiscard]] absl::Status Decode(const std::vector<int32_t>& tokens,
                                    const std::vector<int32_t>& slots, const Output& out);
  // The same, with the logits alone.
  [[nodiscard]] absl::Status Prefill(const std::vector<std::vector<int32_t>>& prompts,
                                     const std::vector<int32_t>& slots,
                                     std::vector<float>* logits) {
    return Prefill(prompts, slots, Output{logits, nullptr});
  }
  [[nodiscard]] absl::Status Decode(const std::vector<int32_t>& tokens,
                                    const std::vector<int32_t>& slots,
                                    std::vector<float>* logits) {
    return Decode(tokens, slots, Output{logits, nullptr});
  }

  // The host store's weights changed (a training step): upload them afresh.
  void Refresh();

  // Tokens held by the sequence in `slot` (0: empty).
  int64_t length(int32_t slot) const { return lengths_[slot]; }
  const GeneratorOptions& options() const { return options_; }
  int64_t vocab_size() const { return config_.vocab_size; }
  int64_t device_bytes() const { return device_bytes_; }
  // Host -> device bytes of the passes so far (weights and token arrays).
  int64_t h2d_bytes() const { return h2d_bytes_; }

 private:
  Generator(const ModelConfig& config, HostStore* store, Backend* backend,
            const GeneratorOptions& options);
  [[nodiscard]] absl::Status Allocate();
  // Writes the pass's int32 arrays (n tokens) to the device and binds batch_ to them.
  void UploadBatch(const std::vector<int32_t>& tokens, const std::vector<int32_t>& doc_start,
                   const std::vector<int32_t>& positions, const std::vector<int32_t>& seq_slot,
                   const std::vector<int32_t>& kv_length);
  // Embedding and every layer over batch_; returns the buffer holding the last layer's output.
  void* Layers();
  // Final norm and lm_head over `rows` of the final activations `x` (null: its first
  // `count` rows); then `out`: the logits to the host as f32 (count, V), or the greedy picks.
  void Head(const void* x, const std::vector<int32_t>* rows, int64_t count, const Output& out);
  // The logits of the last Head() to the host, as f32 (count, V).
  void LogitsToHost(int64_t count, std::vector<float>* logits);
  // The greedy picks of the last Head()'s logits, made on the device.
  void PicksToHost(int64_t count, std::vector<SampledToken>* picks);

  ModelConfig config_;
  const ModelLayout* layout_;
  HostStore* store_;
  Backend* backend_;
  GeneratorOptions options_;
  int64_t max_tokens_;  // a pass's most tokens: max(prefill_tokens, max_sequences)
  LayerKinds kinds_;
  LossHead head_;  // its weights' binding (final norm, lm_head or the tied embedding)
  SpanRecorder spans_;
  WeightSlots slots_;
  int64_t device_bytes_ = 0;
  int64_t h2d_bytes_ = 0;

  DeviceBuffer embed_slot_, head_slot_;
  DeviceBuffer x_[2];       // max_tokens x (C) act, ping-pong through the layers
  DeviceBuffer workspace_;  // the kinds' largest, for max_tokens
  DeviceBuffer ints_;       // 6 x max_tokens int32: the batch's arrays, the rows to gather
  DeviceBuffer inv_freq_;   // (D/2) f32
  DeviceBuffer kv_;         // per layer: k then v, each (max_sequences, max_len, KV, D) act
  DeviceBuffer head_in_;    // max_sequences x (C) act: gathered rows, then normed
  DeviceBuffer head_rstd_;  // max_sequences stat
  DeviceBuffer logits_;     // max_sequences x (V) act
  DeviceBuffer picks_;  // max_sequences int32 ids, then max_sequences f32 log-probabilities
  std::vector<KvCacheLayer> kv_layers_;
  DeviceBatch batch_;
  Event uploaded_, done_;
  std::vector<int64_t> lengths_;   // per slot
  std::vector<char> host_logits_;  // max_sequences x V act
  std::vector<char> host_picks_;   // picks_'s bytes
};

}  // namespace megatrain
