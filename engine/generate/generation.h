// Completions of many prompts: the generation engine's loop over a Generator (the device
// side), the Sampler and each sequence's stop conditions and text.
//
// Up to max_sequences sequences are in flight. Free slots take the next prompts (prefilled
// together, as many as a pass takes), then every sequence in flight decodes one token per
// step: with streamed weights, each crossing of a layer serves all of them. A finished
// sequence's slot takes the next prompt at once (continuous batching). Prompt i's draws are
// keyed by (seed, its key, step), so its tokens do not depend on which others share its
// steps beyond the logits' own rounding.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/data/tokenizer.h"
#include "engine/generate/generator.h"
#include "engine/generate/sampling.h"

namespace megatrain {

enum class FinishReason {
  kStop,    // a stop id or stop string
  kLength,  // max_new_tokens, or the generator's max_len
};
const char* FinishReasonName(FinishReason reason);  // "stop" | "length"

struct Completion {
  std::vector<int32_t> ids;       // the new tokens, a stop id included
  std::vector<double> logprobs;   // each one's log-probability under the model
  std::string text;               // decoded, cut before a stop string ("" without a tokenizer)
  FinishReason finish = FinishReason::kLength;
};

// Called as each prompt's completion is done: its index and the completion.
using CompletionCallback = std::function<void(int64_t, const Completion&)>;

// Completes every prompt with `options`. `tokenizer` decodes the text and finds stop
// strings (null: ids only, and stop strings are refused). Prompt i's draws are keyed by
// sample_keys[i] (empty: by i), so a prompt completed in a later call with its own key
// gets the tokens it would have got in one call with all. InvalidArgument for options
// out of range (named), an empty prompt, or a prompt the generator cannot hold with one
// new token (naming the prompt, its length and the limit).
[[nodiscard]] absl::StatusOr<std::vector<Completion>> Generate(
    Generator* generator, const Tokenizer* tokenizer,
    const std::vector<std::vector<int32_t>>& prompts, const SamplingOptions& options,
    const CompletionCallback& on_done = nullptr, const std::vector<int64_t>& sample_keys = {});

}  // namespace megatrain
