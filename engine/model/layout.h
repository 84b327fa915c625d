// The tensor layout of a model in units: what the host store holds per unit, what
// crosses to the device in one transfer, and how a layer template finds its weights.
//
// Unit 0 is the embedding, units 1..L the decoder layers, unit L+1 the head (final norm,
// and lm_head when untied; a tied lm_head reads the embedding unit). Within a unit,
// tensors are packed at element offsets; q/k/v are adjacent (one fused QKV matrix of
// ((H+2*KV)*D, C)), and so are gate/up ((2*I, C)), so each is one GEMM. An MoE layer has
// a router (E, C) where the MLP was, then every expert's [gate; up] back to back (one
// (E, 2I, C) tensor) and every expert's down (one (E, C, I)), so each is one grouped GEMM.
// GPT-OSS keeps transformers' own expert tensors as they are: gate_up_proj (E, C, 2I) with
// gate and up interleaved by column, down_proj (E, I, C), each with a bias; the grouped
// GEMMs read them input-major, so checkpoints need no reordering.
// Groups start on 64-element boundaries. The same layout serves weights (bf16, f32, f64)
// and gradients.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "engine/model/config.h"

namespace megatrain {

enum class TensorRole {
  kEmbedding,   // (V, C)
  kInputNorm,   // (C)
  kQ, kK, kV,   // (H*D, C), (KV*D, C), (KV*D, C), adjacent
  kQBias, kKBias, kVBias,  // (H*D), (KV*D), (KV*D), adjacent
  kQNorm, kKNorm,          // (D)
  kOProj,       // (C, H*D)
  kPostNorm,    // (C)
  kGate, kUp,   // (I, C), (I, C), adjacent
  kDown,        // (C, I)
  kFinalNorm,   // (C)
  kLmHead,      // (V, C)
  kRouter,      // (E, C): an MoE layer's gate
  kExpertGate, kExpertUp,  // (I, C) each, per expert: [gate_e; up_e] back to back, e in order
  kExpertDown,  // (C, I) per expert, e in order
  kOBias,       // (C)
  kSinks,       // (H): GPT-OSS's per-head logit in the attention softmax
  kRouterBias,  // (E)
  kExpertGateUpT,     // (E, C, 2I): GPT-OSS gate_up_proj, column 2j gate j, 2j+1 up j
  kExpertGateUpBias,  // (E, 2I), interleaved the same way
  kExpertDownT,       // (E, I, C): GPT-OSS down_proj
  kExpertDownBias,    // (E, C)
  kLoraA,             // (r, in): a LoRA adapter's down-projection of the tensor base_role
  kLoraB,             // (out, r): its up-projection (lora.h)
};

struct TensorSlot {
  TensorRole role;
  std::string name;             // Hugging Face name, e.g. "model.layers.3.mlp.up_proj.weight"
  std::vector<int64_t> shape;
  int64_t offset = 0;           // elements from the unit's start
  int64_t num_elements = 0;
  bool weight_decay = false;    // matrices decay; norms and biases do not (HF Trainer rule)
  int64_t expert = -1;          // an expert's tensor: its index
  TensorRole base_role = TensorRole::kEmbedding;  // kLoraA, kLoraB: the projection adapted
  // False: frozen (ModelLayout::SetTrainable). The tensor keeps its values exactly: the
  // optimizer never updates it, its gradient counts in no norm, and a matrix's gradient is
  // never computed (a kind binds no gradient view for it). A frozen tensor outside its
  // unit's StateRange() is kept as bf16 alone: no master, no moments, no download.
  bool trainable = true;
};

// A tensor of `shape` (its element count their product) at `offset` of its unit.
TensorSlot MakeSlot(TensorRole role, std::string name, std::vector<int64_t> shape,
                    int64_t offset, bool weight_decay);

enum class UnitKind { kEmbedding, kDecoder, kHead };

struct UnitLayout {
  UnitKind kind;
  int64_t layer = -1;           // decoder index, -1 otherwise
  std::string name;             // "embedding", "layer.3", "head"
  std::vector<TensorSlot> tensors;
  int64_t num_elements = 0;     // including alignment padding
  // LoRA adapters (lora.h): their rank and scale (alpha / r, or alpha / sqrt(r)); 0 without.
  int64_t lora_rank = 0;
  double lora_scale = 0;

  // The slot with `role` (an expert's: expert 0's), or nullptr.
  const TensorSlot* Find(TensorRole role) const;
  // The LoRA adapter of the projection `base` (kLoraA or kLoraB), or nullptr.
  const TensorSlot* FindLora(TensorRole base, TensorRole which) const;
  int64_t OffsetOf(TensorRole role) const;  // -1 when absent
  // The offset of the fused tensor made of `roles`, stored back to back in this order
  // (q, k, v as one (QKV, C) matrix; gate, up as one (2I, C)): the first's, -1 when it is
  // absent. REQUIRES (checked): each present role starts where the one before it ends.
  int64_t OffsetOfFused(std::initializer_list<TensorRole> roles) const;
  // Same tensors (roles, shapes, trainable or frozen) in the same places: one layer
  // template serves both.
  bool SameStructure(const UnitLayout& other) const;
  // True when every tensor is trainable (the optimizer's one-pass case).
  bool AllTrainable() const;
  // True when some tensor of one of `roles` is trainable (false when there is none).
  bool AnyTrainable(std::initializer_list<TensorRole> roles) const;
  // The elements [begin, end) that have optimizer state (fp32 master, moments) and a
  // gradient on the device and drained to the host: from the first trainable tensor's
  // start to the last one's end, widened to whole gradient groups (a fused q|k|v or
  // gate|up whose one part trains, every expert of a grouped GEMM: one kernel writes their
  // gradients); the whole unit when every tensor is trainable, {0, 0} when none is. The
  // tensors between them are all inside (frozen ones too, kept but never updated); the
  // others are frozen and bf16 alone.
  std::pair<int64_t, int64_t> StateRange() const;
  int64_t StateElements() const {  // its length
    const auto [begin, end] = StateRange();
    return end - begin;
  }
  // The tensor lies inside StateRange().
  bool HasState(const TensorSlot& t) const;
};

struct ModelLayout {
  std::vector<UnitLayout> units;
  int64_t num_layers = 0;

  static int64_t EmbeddingUnit() { return 0; }
  int64_t DecoderUnit(int64_t layer) const { return 1 + layer; }
  int64_t HeadUnit() const { return num_layers + 1; }
  int64_t MaxDecoderElements() const;
  int64_t TotalElements() const;
  // Marks every tensor named `name` (its Hugging Face name, e.g.
  // "model.layers.3.mlp.up_proj.weight") trainable or frozen (TensorSlot::trainable).
  // NotFound when no tensor has that name. Before a store is made from the layout: the
  // store keeps its own copy, which the optimizer reads.
  [[nodiscard]] absl::Status SetTrainable(const std::string& name, bool trainable);
};

ModelLayout BuildLayout(const ModelConfig& config);

}  // namespace megatrain
