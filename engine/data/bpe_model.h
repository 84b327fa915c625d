// The BPE model of a Hugging Face tokenizer: a vocab, ranked merges, and the merge loop
// that turns one pre-token ("word") into ids.
//
// Merges are applied lowest rank first; among equal ranks (the same pair at several
// places) the leftmost first. A short word (most pre-tokens) is merged in place in arrays
// on the stack, scanning for the best pair; a long one uses a heap over candidate pairs
// with lazy invalidation, O(n log n), which matters for SentencePiece-style tokenizers
// (Llama 2) where a whole line can be one word. Neither allocates per word beyond the
// heap of a long word.
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
  [[nodiscard]] static absl::StatusOr<BpeModel> Create(BpeModelOptions options);

  // Appends the ids of `word` (UTF-8; one symbol per code point before merging).
  void EncodeWord(absl::string_view word, std::vector<int32_t>* ids) const;

  // The id of `token`, or -1.
  int32_t TokenId(absl::string_view token) const;
  const absl::flat_hash_map<std::string, int32_t>& vocab() const { return vocab_; }

 private:
  BpeModel() = default;

  // A symbol of a word: one code point at first, then what merges made of it.
  struct Symbol {
    int32_t id;  // -1: not in the vocab
    uint32_t begin, size;
  };
  struct Merge {
    int32_t rank;
    int32_t merged_id;
  };
  static constexpr int32_t kNoMerge = INT32_MAX;  // rank of a pair that does not merge
  static constexpr int kMaxShortWordSymbols = 64;

  static uint64_t PairKey(int32_t left, int32_t right) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) |
           static_cast<uint32_t>(right);
  }
  // The merge of two symbol ids, or rank kNoMerge.
  Merge FindMerge(int32_t left, int32_t right) const;
  // The id of the one code point `symbol` (a UTF-8 sequence), or -1.
  int32_t SymbolId(absl::string_view symbol) const;
  // REQUIRES: 1 < symbols.size() <= kMaxShortWordSymbols.
  void MergeShortWord(Symbol* symbols, int num_symbols, absl::string_view word,
                      std::vector<int32_t>* ids) const;
  void MergeLongWord(std::vector<Symbol> symbols, absl::string_view word,
                     std::vector<int32_t>* ids) const;
  void AppendSymbol(const Symbol& symbol, absl::string_view word, std::vector<int32_t>* ids) const;
  void AppendUnknown(absl::string_view symbol, std::vector<int32_t>* ids) const;

  absl::flat_hash_map<std::string, int32_t> vocab_;
  absl::flat_hash_map<uint64_t, Merge> merges_;  // PairKey(left id, right id) -> merge
  // Single-code-point tokens: below kDirectCodePoints by table ([cp] -> id or -1), the
  // others by map. The byte alphabet (< U+0144) and most Latin scripts use the table.
  static constexpr uint32_t kDirectCodePoints = 0x800;
  std::vector<int32_t> code_point_ids_;
  absl::flat_hash_map<uint32_t, int32_t> other_code_point_ids_;
  int32_t byte_ids_[256];  // id of "<0xXX>", or -1
  bool byte_fallback_ = false;
  bool ignore_merges_ = false;
  int32_t unk_id_ = -1;
};

}  // namespace megatrain
