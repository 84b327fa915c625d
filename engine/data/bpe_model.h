// The BPE model of a Hugging Face tokenizer: a vocab, ranked merges, and the merge loop
// that turns one pre-token ("word") into ids.
//
// Merges are applied lowest rank first; among equal ranks (the same pair at several
// places) the leftmost first. A heap over candidate pairs with lazy invalidation keeps a
// word of n symbols at O(n log n), which matters for SentencePiece-style tokenizers
// (Llama 2) where a whole line is one word.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace megatrain {

struct BpeModelOptions {
  // token string -> id.
  absl::flat_hash_map<std::string, int32_t> vocab;
  // (left, right) in rank order: merges[0] is applied first.
  std::vector<std::pair<std::string, std::string>> merges;
  // A symbol outside the vocab becomes its UTF-8 bytes as "<0xXX>" tokens.
  bool byte_fallback = false;
  // A word that is itself in the vocab maps to that id without merging.
  bool ignore_merges = false;
  // Id emitted for a symbol with no id (and no byte fallback), or -1 to drop it.
  int32_t unk_id = -1;
};

// Immutable after Create(); safe to use from many threads.
class BpeModel {
 public:
  // InvalidArgument when a merge names a token, or makes one, that is not in the vocab.
  static absl::StatusOr<BpeModel> Create(BpeModelOptions options);

  // Appends the ids of `word` (UTF-8; one symbol per code point before merging).
  void EncodeWord(absl::string_view word, std::vector<int32_t>* ids) const;

  // The id of `token`, or -1.
  int32_t TokenId(absl::string_view token) const;
  const absl::flat_hash_map<std::string, int32_t>& vocab() const { return vocab_; }

 private:
  BpeModel() = default;

  static uint64_t PairKey(int32_t left, int32_t right) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) |
           static_cast<uint32_t>(right);
  }
  void AppendUnknown(absl::string_view symbol, std::vector<int32_t>* ids) const;

  absl::flat_hash_map<std::string, int32_t> vocab_;
  struct Merge {
    int32_t rank;
    int32_t merged_id;
  };
  absl::flat_hash_map<uint64_t, Merge> merges_;  // PairKey(left id, right id) -> merge
  int32_t byte_ids_[256];                        // id of "<0xXX>", or -1
  bool byte_fallback_ = false;
  bool ignore_merges_ = false;
  int32_t unk_id_ = -1;
};

}  // namespace megatrain
