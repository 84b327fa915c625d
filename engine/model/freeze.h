// The tensors a job's train.freeze names, marked frozen in its layout (TensorSlot::trainable).
//
// A pattern is a dot-separated path matched against each tensor's Hugging Face name, as a
// run of its dot-separated components anywhere in the name:
//   lm_head                   lm_head.weight
//   embed_tokens              model.embed_tokens.weight ("embeddings" says the same)
//   layers.0-15               every tensor of layers 0 to 15 ("A-B": a number in [A, B])
//   layers.*.self_attn        every layer's attention ("*": any one component)
//   mlp.experts               the experts of every MoE layer (any family)
//   router                    the router of every MoE layer (Qwen3-MoE's mlp.gate,
//                             Mixtral's block_sparse_moe.gate, GPT-OSS's mlp.router)
//   model.norm                the final norm
#pragma once

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "engine/model/layout.h"

namespace megatrain {

// Whether `pattern` names the tensor `slot` (as above).
bool FreezePatternMatches(absl::string_view pattern, const TensorSlot& slot);

// Marks every tensor a pattern names frozen. InvalidArgument naming train.freeze[i] and
// the pattern when one names no tensor of the model (or is malformed), or when together
// they leave nothing to train.
[[nodiscard]] absl::Status FreezeTensors(const std::vector<std::string>& patterns,
                                         ModelLayout* layout);

}  // namespace megatrain
