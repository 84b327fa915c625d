// Merging a LoRA adapter into its base: the model transformers loads without peft.
//
// Each adapted projection becomes W + scale B A (scale alpha / r, or alpha / sqrt(r) with
// rsLoRA, as the adapter's config says); every other tensor is the base's. The result is
// a Hugging Face model folder in bf16 (config.json and the tokenizer files copied from the
// base), written a tensor at a time (memory: the largest tensor, not the model) into
// "<out>.tmp" and renamed into place when complete.
#pragma once

#include <string>

#include "absl/status/status.h"

namespace megatrain {

// base: a model folder (config.json, safetensors); adapter: a PEFT LoRA adapter folder
// (a LoRA job's checkpoint is one); out: a folder that does not exist or is empty. Errors
// name the folder and what is wrong: an adapter for another model (a tensor it lacks or
// holds, a shape), a target the family cannot take, an out folder in use.
[[nodiscard]] absl::Status MergeLoraAdapter(const std::string& base, const std::string& adapter,
                                            const std::string& out);

}  // namespace megatrain
