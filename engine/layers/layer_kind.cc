#include "engine/layers/layer_kind.h"

#include <algorithm>
#include <cmath>

#include "engine/kernels/reference/rope.h"
#include "engine/layers/decoder.h"
#include "engine/layers/moe_layer.h"

namespace megatrain {

int64_t LayerKinds::MaxWorkspaceBytes(int64_t n) const {
  int64_t bytes = 0;
  for (const std::unique_ptr<LayerKind>& kind : kinds) {
    bytes = std::max(bytes, kind->WorkspaceBytes(n));
  }
  return bytes;
}

int64_t LayerKinds::MaxSavedBytes(int64_t n) const {
  int64_t bytes = 0;
  for (const std::unique_ptr<LayerKind>& kind : kinds) bytes = std::max(bytes, kind->SavedBytes(n));
  return bytes;
}

LayerKinds MakeLayerKinds(const ModelConfig& config, const ModelLayout& layout, Backend* backend,
                          int64_t mlp_tile) {
  LayerKinds out;
  std::vector<const UnitLayout*> representatives;  // the first layer of each group
  for (int64_t l = 0; l < layout.num_layers; ++l) {
    const UnitLayout& unit = layout.units[layout.DecoderUnit(l)];
    int group = -1;
    for (size_t g = 0; g < representatives.size() && group < 0; ++g) {
      // One kind per structure and attention window (GPT-OSS alternates two windows).
      if (representatives[g]->SameStructure(unit) &&
          config.AttentionWindow(representatives[g]->layer) == config.AttentionWindow(l)) {
        group = static_cast<int>(g);
      }
    }
    if (group < 0) {
      group = static_cast<int>(out.kinds.size());
      representatives.push_back(&unit);
      if (unit.Find(TensorRole::kRouter) != nullptr) {
        out.kinds.push_back(std::make_unique<MoeLayer>(config, unit, backend));
      } else {
        out.kinds.push_back(std::make_unique<DecoderLayer>(config, unit, backend, mlp_tile));
      }
    }
    out.of_layer.push_back(group);
  }
  return out;
}

void* TensorAt(const UnitLayout& unit, void* base, TensorRole role, DType dtype) {
  const int64_t off = unit.OffsetOf(role);
  return off < 0 ? nullptr : Offset(base, off, dtype);
}

void AddLoraWork(const UnitLayout& unit, TensorRole base, int64_t in, int64_t out,
                 LayerWork* work, int64_t rows_per_token, int64_t groups) {
  if (unit.FindLora(base, TensorRole::kLoraA) == nullptr) return;
  work->matmuls.push_back({in, unit.lora_rank, rows_per_token, groups});
  work->matmuls.push_back({unit.lora_rank, out, rows_per_token, groups});
}

GradViews::GradViews(const UnitLayout& unit, void* grads, void* discard, DType dtype)
    : grads_(grads), discard_(discard), dtype_(dtype) {
  std::tie(begin_, end_) = unit.StateRange();
}

void* GradViews::At(int64_t offset, bool matrix) const {
  if (offset < 0) return nullptr;
  if (offset >= begin_ && offset < end_) return Offset(grads_, offset - begin_, dtype_);
  return matrix ? nullptr : discard_;
}

int64_t GradDiscardElements(const ModelLayout& layout) {
  int64_t most = 0;
  for (const UnitLayout& unit : layout.units) {
    int64_t qkv_bias = 0;  // one kernel writes the three biases' gradients together
    for (const TensorSlot& t : unit.tensors) {
      if (t.role == TensorRole::kQBias || t.role == TensorRole::kKBias ||
          t.role == TensorRole::kVBias) {
        qkv_bias += t.num_elements;
      } else if (t.shape.size() == 1 || t.role == TensorRole::kExpertGateUpBias ||
                 t.role == TensorRole::kExpertDownBias) {
        most = std::max(most, t.num_elements);
      }
    }
    most = std::max(most, qkv_bias);
  }
  return most;
}

void* UnlessFrozen(const UnitLayout& unit, void* grad, std::initializer_list<TensorRole> roles) {
  return unit.AnyTrainable(roles) ? grad : nullptr;
}

std::vector<float> RopeInvFreqs(const ModelConfig& config) {
  std::vector<float> inv_freq(config.head_dim / 2);
  const RopeScaling& rs = config.rope_scaling;
  if (rs.type == RopeScaling::Type::kYarn) {
    ref::RopeYarnInvFreq(inv_freq.data(), config.head_dim, config.rope_theta, rs.factor,
                         rs.beta_fast, rs.beta_slow, rs.original_max_position_embeddings,
                         rs.truncate);
    return inv_freq;
  }
  double theta = config.rope_theta;
  if (rs.type == RopeScaling::Type::kDynamic) {
    // transformers' _compute_dynamic_ntk_parameters, in Python's double arithmetic: the
    // base for seq_len = max(dynamic_seq_len, max_position_embeddings).
    const double max_pos = static_cast<double>(config.max_position_embeddings);
    const double seq = std::max(static_cast<double>(rs.dynamic_seq_len), max_pos);
    const double dim = static_cast<double>(config.head_dim);
    theta *= std::pow(rs.factor * seq / max_pos - (rs.factor - 1), dim / (dim - 2));
  }
  ref::RopeInvFreq(inv_freq.data(), config.head_dim, theta,
                   rs.type == RopeScaling::Type::kLlama3, rs.factor, rs.low_freq_factor,
                   rs.high_freq_factor, rs.original_max_position_embeddings);
  if (rs.type == RopeScaling::Type::kLinear) {  // inv_freq /= factor, in float32
    for (float& f : inv_freq) f /= static_cast<float>(rs.factor);
  }
  return inv_freq;
}

}  // namespace megatrain
