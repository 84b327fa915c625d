// The sampling stage of generation: the next token of each sequence from its logits, on
// the host.
//
// Greedy decoding takes the argmax. Otherwise the logits are divided by the temperature,
// cut to the top_k largest, then to the nucleus (the smallest set of most probable tokens
// whose probability reaches top_p), and one token is drawn from what is left. The draw's
// uniform number comes from a counter-based generator keyed by (seed, sequence index,
// step) (philox.h), never from a stateful one: the same request gives the same tokens
// whatever else shares its batch and however many threads sample it.
//
// Example:
//   SamplingOptions options;
//   options.temperature = 0.7;
//   options.top_p = 0.9;
//   options.seed = 42;
//   RETURN_IF_ERROR(ValidateSamplingOptions(options, vocab_size));
//   Sampler sampler(options, vocab_size);
//   // logits: (B, V); keys[b] = {sequence b of the request, tokens it has generated}
//   RETURN_IF_ERROR(sampler.Sample(logits, keys, absl::MakeSpan(tokens)));
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"

namespace megatrain {

// How one request's tokens are chosen and when its generation ends.
struct SamplingOptions {
  double temperature = 0;                 // 0 = greedy (argmax; top_k and top_p are then unused)
  int64_t top_k = 0;                      // keep the k most probable tokens; 0 = all
  double top_p = 1.0;                     // nucleus mass in (0, 1]; 1 = no nucleus cut
  uint64_t seed = 0;                      // keys the draws; same seed and options -> same tokens
  int64_t max_new_tokens = 256;           // generated tokens at most, stop tokens included
  std::vector<std::string> stop_strings;  // generation ends when the text holds one
  std::vector<int32_t> stop_ids;          // generation ends after one of these tokens
};

// InvalidArgument naming the field ("sampling.top_p must be in (0, 1]; got 1.5") when
// temperature is negative or not finite, top_k is negative, top_p is outside (0, 1],
// max_new_tokens < 1, a stop id is outside [0, vocab_size), or a stop string is empty.
// A top_k above vocab_size is accepted and means all tokens. REQUIRES: vocab_size >= 1.
[[nodiscard]] absl::Status ValidateSamplingOptions(const SamplingOptions& options,
                                                   int64_t vocab_size);

// Which draw a row of logits gets: the generator's counter.
struct SampleKey {
  int64_t sequence_index = 0;  // the sequence's index in its request (0 .. n-1), >= 0
  int64_t step = 0;            // tokens this sequence has generated before this one, >= 0
};

struct SampledToken {
  int32_t id = 0;
  // log softmax(logits)[id] of the unscaled logits, in double: the model's own
  // log-probability of the token, whatever the temperature, top_k and top_p (what
  // policy-gradient training such as GRPO needs).
  double logprob = 0;
};

// Samples with one request's options. Holds no state between calls: Sample() is const
// and may be called from several threads at once. Rows are sampled in parallel on the
// OpenMP thread pool; each row's result depends on its logits and key only.
class Sampler {
 public:
  // REQUIRES: ValidateSamplingOptions(options, vocab_size).ok(). The stop conditions are
  // not used here (see StopMatcher).
  Sampler(const SamplingOptions& options, int64_t vocab_size);

  // logits: (B, V) fp32, row-major, V = vocab_size; row b is sequence keys[b]'s logits.
  // Writes out[b] for every row. A logit may be -inf (a masked token); InvalidArgument
  // naming the row and token when one is NaN or +inf, or when a row is all -inf (the
  // model's output is broken; nothing sensible can be sampled). out is unspecified then.
  // Allocates scratch of 16 * V bytes per thread per call unless greedy.
  // REQUIRES: logits.size() == keys.size() * V, out.size() == keys.size().
  [[nodiscard]] absl::Status Sample(absl::Span<const float> logits,
                                    absl::Span<const SampleKey> keys,
                                    absl::Span<SampledToken> out) const;

  int64_t vocab_size() const { return vocab_size_; }

 private:
  struct Scratch;
  [[nodiscard]] absl::Status SampleRow(const float* logits, SampleKey key, Scratch* scratch,
                                       SampledToken* out) const;
  int32_t Draw(const float* logits, float max_logit, double uniform, Scratch* scratch) const;

  double temperature_;
  int64_t top_k_;  // 0 when it keeps every token
  double top_p_;
  uint64_t seed_;
  int64_t vocab_size_;
};

}  // namespace megatrain
