// LoRA adapters (Hu et al. 2021, arXiv 2106.09685) in a model's layout.
//
// Each adapted projection W (out, in) of a decoder layer gets A (r, in) and B (out, r),
// stored at the end of its layer's unit and named as PEFT names its modules'
// ("model.layers.3.self_attn.q_proj.lora_A.weight", without PEFT's "base_model.model."
// prefix, which only the adapter files carry). Every other tensor of the model is frozen,
// as PEFT freezes the base: the units' state ranges (layout.h) are their adapters alone,
// so a LoRA job holds the base as bf16 and trains, downloads and updates only A and B.
// The layer kinds add scale * (x A^T) B^T to each adapted projection's output. An MoE
// layer's experts take one adapter per expert over each of their two projections
// (kLoraExpertTargets), in PEFT's files as its ParamWrapper saves them.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/engine.h"  // LoraConfig, LoraInit
#include "engine/model/config.h"
#include "engine/model/layout.h"
#include "engine/model/safetensors.h"

namespace megatrain {

// The projections an adapter can target, in layout order, and the base role of each.
constexpr const char* kLoraTargets[] = {"q_proj", "k_proj", "v_proj", "o_proj",
                                        "gate_proj", "up_proj", "down_proj"};
TensorRole LoraTargetRole(int target);  // index into kLoraTargets

// The experts' projections of an MoE layer an adapter can target: one adapter per expert
// over its fused [gate; up] (GPT-OSS: its interleaved gate_up) and one over its down, as
// PEFT adapts transformers' 3-D expert parameters (target_parameters "mlp.experts.<name>",
// lora.ParamWrapper). Expert e's A is (r, in) and B (out, r); the layout holds them as
// A (E, r, in) and B (E, out, r), each expert's back to back, for the grouped matmuls.
constexpr const char* kLoraExpertTargets[] = {"experts.gate_up_proj", "experts.down_proj"};
// The base role an expert target adapts in `unit` (its gate|up or down tensor's role, as
// the unit lays the experts out), or kEmbedding when the unit has no experts.
TensorRole LoraExpertRole(const UnitLayout& unit, int target);  // index into kLoraExpertTargets

// "lora.init" names: "default" ("true" too, as PEFT writes it), "gaussian".
[[nodiscard]] bool ParseLoraInit(const std::string& name, LoraInit* out);
const char* LoraInitName(LoraInit init);

// Adds the adapters of `lora` (rank > 0) to every decoder layer of `layout` and freezes
// every other tensor. InvalidArgument naming lora.target_modules[i] when a name is not a
// projection (kLoraTargets, kLoraExpertTargets or all-linear), names an MLP projection of a
// model whose MLPs are experts, or the experts of a model without; and naming lora.rank
// when it exceeds a projection's smaller side. "all-linear" is every kLoraTargets
// projection the layers have (as PEFT's: not the experts).
[[nodiscard]] absl::Status AddLoraAdapters(const LoraConfig& lora, const ModelConfig& config,
                                           ModelLayout* layout);

// A training job's layout: BuildLayout, the adapters of `lora` (when rank > 0), then
// `freeze` (FreezeTensors). The errors of either, naming its field; and InvalidArgument
// naming train.freeze[i] when a pattern freezes an adapter.
[[nodiscard]] absl::StatusOr<ModelLayout> TrainingLayout(const ModelConfig& config,
                                                         const LoraConfig& lora,
                                                         const std::vector<std::string>& freeze);

// The prefix PEFT gives module names in adapter files ("base_model.model." + the model's
// own name).
constexpr char kPeftPrefix[] = "base_model.model.";

// The layout has LoRA adapters.
bool HasLora(const ModelLayout& layout);

// adapter_config.json as PEFT writes it for `layout`'s adapters (their targets as laid out:
// an MoE model's attention alone), so that peft.PeftModel.from_pretrained loads the
// folder; base_model: the base's folder ("" when drawn from a config).
std::string PeftAdapterConfigJson(const ModelLayout& layout, const LoraConfig& lora,
                                  const std::string& base_model);

// A PEFT adapter folder's adapter_config.json: its rank, alpha, rsLoRA and targets
// ("all-linear" and a single string as PEFT allows; target_parameters naming experts'
// gate_up_proj or down_proj become kLoraExpertTargets). NotFound without the file;
// InvalidArgument naming the file and the key when it is not a LoRA adapter's.
[[nodiscard]] absl::StatusOr<LoraConfig> ReadPeftAdapterConfig(const std::string& folder);

// InvalidArgument "<what> <folder> holds <name>, which ..." when the adapter folder read by
// `adapter` holds a tensor that is not one of `layout`'s adapters (under PEFT's names).
[[nodiscard]] absl::Status CheckAdapterHoldsOnlyLayouts(const ModelLayout& layout,
                                                       const ModelTensorReader& adapter,
                                                       const std::string& what,
                                                       const std::string& folder);

// The tensor is a LoRA adapter's (kLoraA or kLoraB).
inline bool IsLora(const TensorSlot& t) {
  return t.role == TensorRole::kLoraA || t.role == TensorRole::kLoraB;
}

// An adapter's rank and input width (A (r, in) or (E, r, in)).
int64_t LoraRank(const TensorSlot& t);
// The number of experts of an experts' adapter, 0 for a projection's.
inline int64_t LoraExperts(const TensorSlot& t) {
  return IsLora(t) && t.shape.size() == 3 ? t.shape[0] : 0;
}

// An adapter's tensor in PEFT's file: a projection's as laid out; an experts' as
// ParamWrapper holds it: A (E*r, in), expert e's rows e*r.. (the layout's order), and
// B (out, r*E), expert e's rank-j column at j*E + e (the layout's B transposed).
std::vector<int64_t> PeftShape(const TensorSlot& t);
// The layout's element (from the tensor's start) at element `f` of PEFT's file.
int64_t LoraLayoutIndex(const TensorSlot& t, int64_t f);
// The tensor's `values` (t.num_elements, the layout's order) in PEFT's order, and back.
std::vector<float> LoraToPeftOrder(const TensorSlot& t, const float* values);
void LoraFromPeftOrder(const TensorSlot& t, const float* file, float* values);

}  // namespace megatrain
