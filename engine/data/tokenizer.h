// Tokenizer: the seam between text and token ids, both ways.
//
// The byte tokenizer (byte_tokenizer.h) and Hugging Face tokenizer.json BPE tokenizers
// (hf_tokenizer.h) implement it, so the data pipeline and generation depend only on this
// header. Decode returns bytes, not repaired text: generation streams text id by id
// (text_stream.h), and a character cut between two ids must come out whole once its last
// byte arrives, which a U+FFFD put in its place would prevent.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

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
  // The UTF-8 bytes of the text `ids` stand for, through the tokenizer's decoder; special
  // and added tokens become their content. Ids come from a model, whose embedding table
  // is often larger than the vocabulary: an id outside [0, vocab_size()), or one that
  // stands for no text, adds nothing. The bytes are not repaired: when the ids cut a
  // character the text ends in an incomplete UTF-8 sequence, and bytes a model put in an
  // impossible order stay invalid UTF-8 (RepairUtf8 in bpe_text.h turns them into U+FFFD,
  // as the reference tokenizers do).
  //
  // Prefix-stable: Decode(a ++ b) starts with Decode(a). And local: once the last ids c of
  // `a` decode to some text, what b adds after a is what b adds after c. TextStream
  // relies on both; hf_tokenizer.h names the decoder chains that keep them.
  virtual std::string Decode(absl::Span<const int32_t> ids) const = 0;
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
