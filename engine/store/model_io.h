// Filling the host store: from a Hugging Face model folder, or by random initialisation.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "engine/model/config.h"
#include "engine/model/lora.h"
#include "engine/model/safetensors.h"
#include "engine/store/host_store.h"

namespace megatrain {

// Reads every tensor the layout names straight into the units' fp32 master (bf16, f16 or
// f32 on disk; GPT-OSS's experts also as MXFP4 `_blocks` / `_scales`, dequantized), zeroes
// m and v and every LoRA adapter, and derives the bf16 weights. A missing tensor or a shape that disagrees with
// config.json is an error naming the tensor and the file. lm_head.weight is ignored when
// the config ties embeddings.
[[nodiscard]] absl::Status LoadWeights(const ModelTensorReader& reader, HostStore* store);

// LoadWeights' errors from the safetensors headers alone (no data is read): what a job's
// submission checks, so a folder that does not match its config.json is refused at once.
[[nodiscard]] absl::Status CheckModelTensors(const ModelTensorReader& reader,
                                             const ModelLayout& layout);

// Random init as transformers does for these models: matrices and embeddings
// N(0, initializer_range), norms 1, biases 0. Deterministic in `seed` and independent of
// thread count (every tensor has its own generator seeded from seed and its name).
void RandomInitWeights(const ModelConfig& config, uint64_t seed, HostStore* store);

// Draws every LoRA adapter's A (lora.h: LoraInit) into the store, deterministic in `seed`
// (a generator per tensor, seeded from seed and its name); B is left as it is (zero after
// LoadWeights or RandomInitWeights, which zero every adapter).
void InitLoraAdapters(LoraInit init, uint64_t seed, HostStore* store);


// Sets the store's LoRA adapters from a PEFT adapter folder (adapter_config.json and
// adapter_model.safetensors, PEFT's names: a checkpoint of a LoRA job is one too). Errors
// name the folder and what disagrees: its r or targets and `lora`'s, a tensor the layout
// adapts that the folder lacks (or with another shape), a tensor of the folder the layout
// does not adapt.
[[nodiscard]] absl::Status LoadLoraAdapter(const std::string& folder, const LoraConfig& lora,
                                           HostStore* store);

}  // namespace megatrain
