// Tokenizer: the seam between text and token ids.
//
// The byte tokenizer is the first implementation; Hugging Face BPE tokenizers come later
// behind the same interface, so the data pipeline depends only on this header.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace megatrain {

// Implementations are immutable after construction and safe to use from many threads.
class Tokenizer {
 public:
  virtual ~Tokenizer();

  // The ids of `text` (UTF-8), without bos / eos. An error (InvalidArgument) is the
  // tokenizer's own failing on this text, named in the message: a user's tokenizer.json
  // whose regex backtracks catastrophically on it, say.
  [[nodiscard]] virtual absl::StatusOr<std::vector<int32_t>> Encode(
      absl::string_view text) const = 0;
  // Every id Encode returns, and bos / eos, is in [0, vocab_size()).
  virtual int64_t vocab_size() const = 0;
  // Beginning- and end-of-sequence ids, or -1 when the tokenizer has none.
  virtual int32_t bos_id() const = 0;
  virtual int32_t eos_id() const = 0;
  // A short name for logs and checkpoints ("byte").
  virtual std::string name() const = 0;
};

// Tokenizes each text as [bos] + Encode(text) + [eos], leaving out bos / eos when the
// tokenizer has none. Documents of any length are kept, in order.
// InvalidArgument when `texts` is empty, every document tokenizes to no tokens, or the
// tokenizer fails on one (naming the document's index).
[[nodiscard]] absl::StatusOr<std::vector<std::vector<int32_t>>> TokenizeDocuments(
    const std::vector<std::string>& texts, const Tokenizer& tokenizer);

}  // namespace megatrain
