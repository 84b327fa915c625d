#include "engine/plan/step_memory.h"

#include <algorithm>
#include <memory>

#include "engine/layers/objective.h"

namespace megatrain {

int64_t StepMemory::TotalBytes() const {
  return weight_slots * weight_slot + embedding_slot + head_slot + embedding_grad + head_grad +
         kLayerGradBuffers * layer_grad + grad_discard + 2 * checkpoint_staging +
         activation_buffers() * activations +
         scratch_output + layer_workspace + kept_layers * kept_layer + head_workspace +
         token_arrays + losses + preference_arrays + rope_frequencies + router_stats;
}

int64_t NumWeightSlots(const ModelConfig& config, const PipelineOptions& options) {
  const int64_t least = std::max<int64_t>(2, options.checkpoint_every + 1);
  return std::max(least, std::min(options.weight_slots, config.num_layers));
}

namespace {

void SizeActivationBuffers(const ModelConfig& config, const PipelineOptions& options,
                           StepMemory* m) {
  const int64_t L = config.num_layers, K = options.checkpoint_every;
  m->device_checkpoints = options.checkpoints_on_host ? 0 : (L + K - 1) / K + 1;
  m->recomputed_inputs = K - 1;
  m->forward_buffers = K > 1 || options.checkpoints_on_host ? 2 : 0;
}

}  // namespace

int64_t EvalCapacity(const ModelConfig& config, const PipelineOptions& options) {
  StepMemory m;
  SizeActivationBuffers(config, options, &m);
  return m.activation_buffers() / 2 * options.micro_batches;
}

StepMemory SizeStepMemory(const ModelConfig& config, const ModelLayout& layout, Backend* backend,
                          const PipelineOptions& options, const LayerKinds& kinds,
                          const LossHead& head) {
  const int64_t M = options.micro_batches, n = options.tokens_per_micro_batch;
  const int64_t wsize = DTypeSize(backend->weight_dtype());
  const int64_t gsize = DTypeSize(backend->grad_dtype());
  const int64_t stat = DTypeSize(backend->stat_dtype());
  const int64_t act_row = config.hidden_size * DTypeSize(backend->act_dtype());
  // A gradient the group reduce-scatters holds every rank's whole shard of its state range
  // from the range's start (gradient_drain.cc): at most the unit and 256 elements a rank.
  auto padded = [&](int64_t elements) {
    if (options.collective == nullptr) return elements;
    const int ranks = options.collective->size();
    return std::max(ranks * GradShardElements(elements, ranks), elements + ranks * 256);
  };
  const int64_t layer_n = layout.MaxDecoderElements();
  const int64_t embed_n = layout.units[ModelLayout::EmbeddingUnit()].num_elements;
  const int64_t head_n = layout.units[layout.HeadUnit()].num_elements;
  int64_t layer_state = 0;
  for (const UnitLayout& u : layout.units) {
    if (u.kind == UnitKind::kDecoder) layer_state = std::max(layer_state, u.StateElements());
  }
  StepMemory m;
  m.weight_slots = NumWeightSlots(config, options);
  m.weight_slot = layer_n * wsize;
  m.embedding_slot = embed_n * wsize;
  m.head_slot = head_n * wsize;
  m.embedding_grad = padded(layout.units[ModelLayout::EmbeddingUnit()].StateElements()) * gsize;
  m.head_grad = padded(layout.units[layout.HeadUnit()].StateElements()) * gsize;
  m.layer_grad = padded(layer_state) * gsize;
  m.grad_discard = GradDiscardElements(layout) * gsize;
  m.activations = M * n * act_row;
  // Checkpoints: on the device, the input of every K-th layer and the last layer's output;
  // in host memory, two staging buffers on the device.
  SizeActivationBuffers(config, options, &m);
  m.checkpoint_staging = options.checkpoints_on_host ? m.activations : 0;
  m.scratch_output = n * act_row;
  m.layer_workspace = kinds.MaxWorkspaceBytes(n);
  m.kept_layers = options.kept_layers;
  m.kept_layer = M * kinds.MaxSavedBytes(n);
  m.head_workspace = head.WorkspaceBytes(n);
  const int64_t batches = std::max(M, options.eval_micro_batches);
  m.token_arrays = batches * StepMemory::kBatchArrays * n * static_cast<int64_t>(sizeof(int32_t));
  m.losses = batches * n * stat;
  if (options.objective.kind == ObjectiveKind::kPreference) {
    m.preference_arrays =
        M * (n * static_cast<int64_t>(sizeof(int32_t)) +
             kMaxPreferenceSequences * kPrefFields * static_cast<int64_t>(sizeof(double)));
  }
  m.rope_frequencies = config.head_dim / 2 * static_cast<int64_t>(sizeof(float));
  const int64_t E = config.moe.num_experts;
  if (E > 0) {
    m.router_counts = (E * 4 + 63) / 64 * 64;
    m.router_stats = m.router_counts + E * stat;
  }
  return m;
}

int64_t StepDeviceBytes(const ModelConfig& config, const ModelLayout& layout, Backend* backend,
                        const PipelineOptions& options) {
  const LayerKinds kinds = MakeLayerKinds(config, layout, backend, options.mlp_tile_tokens);
  const LossHead head(config, layout, backend, options.loss_chunk_tokens,
                      MakeObjective(options.objective, backend));
  return SizeStepMemory(config, layout, backend, options, kinds, head).TotalBytes();
}

int64_t MinDeviceBytesPerToken(const ModelConfig& config, const Backend& backend) {
  // The buffers of M x n rows: the layer-input checkpoints (at least two: the first
  // layer's and the last's) or, on the host, the two staging buffers; the residual
  // gradient; the token arrays; the per-token losses.
  const int64_t act_row = config.hidden_size * DTypeSize(backend.act_dtype());
  return 3 * act_row + StepMemory::kBatchArrays * static_cast<int64_t>(sizeof(int32_t)) +
         DTypeSize(backend.stat_dtype());
}

}  // namespace megatrain
