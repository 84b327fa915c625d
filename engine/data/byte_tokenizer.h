// ByteTokenizer: one token per UTF-8 byte, plus bos and eos.
//
// Needs no vocabulary file, which makes it the tokenizer of tests and smoke runs: ids
// 0..255 are the bytes, 256 is bos, 257 is eos, vocab_size is 258.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "engine/data/tokenizer.h"

namespace megatrain {

class ByteTokenizer : public Tokenizer {
 public:
  static constexpr int32_t kBos = 256;
  static constexpr int32_t kEos = 257;
  static constexpr int64_t kVocabSize = 258;

  absl::StatusOr<std::vector<int32_t>> Encode(absl::string_view text) const override;
  int64_t vocab_size() const override { return kVocabSize; }
  int32_t bos_id() const override { return kBos; }
  int32_t eos_id() const override { return kEos; }
  std::string name() const override { return "byte"; }
  // The bytes of `ids`; bos, eos and ids outside [0, 256) stand for no text.
  std::string Decode(absl::Span<const int32_t> ids) const override;
};

}  // namespace megatrain
