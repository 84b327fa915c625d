#include "engine/data/bpe_model.h"

#include <algorithm>
#include <cstdio>
#include <functional>
#include <queue>

#include "absl/strings/str_cat.h"
#include "engine/data/bpe_text.h"

namespace megatrain {
namespace {

constexpr uint32_t kNotOneCodePoint = 0xFFFFFFFF;

// The code point that `symbol` is the shortest UTF-8 form of, or kNotOneCodePoint. One to
// one, so a token and a symbol with equal bytes find each other by code point.
uint32_t DecodeCodePoint(absl::string_view symbol) {
  if (symbol.empty()) return kNotOneCodePoint;
  const auto* s = reinterpret_cast<const unsigned char*>(symbol.data());
  const size_t size = symbol.size();
  if (size == 1) return s[0] < 0x80 ? s[0] : kNotOneCodePoint;
  if (size != static_cast<size_t>(Utf8SequenceLength(s[0])) || s[0] < 0xC0) {
    return kNotOneCodePoint;
  }
  uint32_t code_point = s[0] & (0x7F >> size);
  for (size_t i = 1; i < size; ++i) {
    if ((s[i] & 0xC0) != 0x80) return kNotOneCodePoint;
    code_point = (code_point << 6) | (s[i] & 0x3F);
  }
  static constexpr uint32_t kMinForSize[] = {0, 0, 0x80, 0x800, 0x10000};
  if (code_point < kMinForSize[size] || code_point > 0x10FFFF) return kNotOneCodePoint;
  return code_point;
}

}  // namespace

absl::StatusOr<BpeModel> BpeModel::Create(BpeModelOptions options) {
  BpeModel model;
  model.vocab_ = std::move(options.vocab);
  model.byte_fallback_ = options.byte_fallback;
  model.ignore_merges_ = options.ignore_merges;
  model.unk_id_ = options.unk_id;
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof(name), "<0x%02X>", b);
    model.byte_ids_[b] = model.TokenId(name);
  }
  model.code_point_ids_.assign(kDirectCodePoints, -1);
  for (const auto& [token, id] : model.vocab_) {
    const uint32_t code_point = DecodeCodePoint(token);
    if (code_point == kNotOneCodePoint) continue;
    if (code_point < kDirectCodePoints) {
      model.code_point_ids_[code_point] = id;
    } else {
      model.other_code_point_ids_[code_point] = id;
    }
  }
  model.merges_.reserve(options.merges.size());
  for (size_t rank = 0; rank < options.merges.size(); ++rank) {
    const auto& [left, right] = options.merges[rank];
    const int32_t left_id = model.TokenId(left);
    const int32_t right_id = model.TokenId(right);
    const int32_t merged_id = model.TokenId(absl::StrCat(left, right));
    if (left_id < 0 || right_id < 0 || merged_id < 0) {
      return absl::InvalidArgumentError(absl::StrCat("merge ", rank, " ('", left, "' '", right,
                                                     "') uses or makes a token that is not in "
                                                     "the vocab"));
    }
    // A pair listed twice keeps its first (lowest) rank, as a rank map built in order would.
    model.merges_.try_emplace(PairKey(left_id, right_id),
                              Merge{static_cast<int32_t>(rank), merged_id});
  }
  return model;
}

int32_t BpeModel::TokenId(absl::string_view token) const {
  auto it = vocab_.find(token);
  return it == vocab_.end() ? -1 : it->second;
}

int32_t BpeModel::SymbolId(absl::string_view symbol) const {
  const uint32_t code_point = DecodeCodePoint(symbol);
  if (code_point == kNotOneCodePoint) return TokenId(symbol);
  if (code_point < kDirectCodePoints) return code_point_ids_[code_point];
  auto it = other_code_point_ids_.find(code_point);
  return it == other_code_point_ids_.end() ? -1 : it->second;
}

BpeModel::Merge BpeModel::FindMerge(int32_t left, int32_t right) const {
  if (left < 0 || right < 0) return {kNoMerge, -1};
  auto it = merges_.find(PairKey(left, right));
  return it == merges_.end() ? Merge{kNoMerge, -1} : it->second;
}

void BpeModel::AppendUnknown(absl::string_view symbol, std::vector<int32_t>* ids) const {
  if (byte_fallback_) {
    bool all_known = true;
    for (char c : symbol) all_known = all_known && byte_ids_[static_cast<unsigned char>(c)] >= 0;
    if (all_known) {
      for (char c : symbol) ids->push_back(byte_ids_[static_cast<unsigned char>(c)]);
      return;
    }
  }
  if (unk_id_ >= 0) ids->push_back(unk_id_);
}

void BpeModel::AppendSymbol(const Symbol& symbol, absl::string_view word,
                            std::vector<int32_t>* ids) const {
  if (symbol.id >= 0) {
    ids->push_back(symbol.id);
  } else {
    AppendUnknown(word.substr(symbol.begin, symbol.size), ids);
  }
}

void BpeModel::EncodeWord(absl::string_view word, std::vector<int32_t>* ids) const {
  if (word.empty()) return;
  if (ignore_merges_) {
    const int32_t id = TokenId(word);
    if (id >= 0) {
      ids->push_back(id);
      return;
    }
  }
  Symbol short_word[kMaxShortWordSymbols];
  int num_symbols = 0;
  std::vector<Symbol> long_word;  // all the symbols, once there are too many for short_word
  for (size_t i = 0; i < word.size();) {
    const size_t len =
        std::min<size_t>(Utf8SequenceLength(static_cast<unsigned char>(word[i])), word.size() - i);
    const Symbol symbol{SymbolId(word.substr(i, len)), static_cast<uint32_t>(i),
                        static_cast<uint32_t>(len)};
    if (num_symbols < kMaxShortWordSymbols) {
      short_word[num_symbols++] = symbol;
    } else {
      if (long_word.empty()) long_word.assign(short_word, short_word + num_symbols);
      long_word.push_back(symbol);
    }
    i += len;
  }
  if (!long_word.empty()) {
    MergeLongWord(std::move(long_word), word, ids);
    return;
  }
  if (num_symbols == 1) {
    AppendSymbol(short_word[0], word, ids);
    return;
  }
  MergeShortWord(short_word, num_symbols, word, ids);
}

void BpeModel::MergeShortWord(Symbol* symbols, int n, absl::string_view word,
                              std::vector<int32_t>* ids) const {
  // merges[i]: the merge of symbols i and i + 1. Each step takes the lowest rank, the
  // leftmost on a tie, and closes the gap by shifting the tail (n is small).
  Merge merges[kMaxShortWordSymbols];
  for (int i = 0; i + 1 < n; ++i) merges[i] = FindMerge(symbols[i].id, symbols[i + 1].id);
  while (n > 1) {
    int best = 0;
    for (int i = 1; i + 1 < n; ++i) {
      if (merges[i].rank < merges[best].rank) best = i;
    }
    if (merges[best].rank == kNoMerge) break;
    symbols[best].id = merges[best].merged_id;
    symbols[best].size += symbols[best + 1].size;
    for (int i = best + 1; i + 1 < n; ++i) symbols[i] = symbols[i + 1];
    for (int i = best + 1; i + 2 < n; ++i) merges[i] = merges[i + 1];
    --n;
    if (best > 0) merges[best - 1] = FindMerge(symbols[best - 1].id, symbols[best].id);
    if (best + 1 < n) merges[best] = FindMerge(symbols[best].id, symbols[best + 1].id);
  }
  for (int i = 0; i < n; ++i) AppendSymbol(symbols[i], word, ids);
}

void BpeModel::MergeLongWord(std::vector<Symbol> symbols, absl::string_view word,
                             std::vector<int32_t>* ids) const {
  // The symbols as a doubly linked list (prev / next index, -1 at the ends), each node
  // with its links for locality.
  struct Node {
    Symbol symbol;
    int32_t prev, next;
  };
  const int32_t n = static_cast<int32_t>(symbols.size());
  std::vector<Node> nodes(n);
  for (int32_t i = 0; i < n; ++i) nodes[i] = {symbols[i], i - 1, i + 1 < n ? i + 1 : -1};
  // Candidates ordered by (rank, left position); stale ones are skipped when popped.
  struct Candidate {
    int32_t rank, left, left_id, right_id;
    bool operator>(const Candidate& o) const {
      return rank != o.rank ? rank > o.rank : left > o.left;
    }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<Candidate>> queue;
  auto push_pair = [&](int32_t left) {
    if (left < 0 || nodes[left].next < 0) return;
    const int32_t left_id = nodes[left].symbol.id, right_id = nodes[nodes[left].next].symbol.id;
    const Merge merge = FindMerge(left_id, right_id);
    if (merge.rank != kNoMerge) queue.push({merge.rank, left, left_id, right_id});
  };
  for (int32_t i = 0; i + 1 < n; ++i) push_pair(i);
  while (!queue.empty()) {
    const Candidate top = queue.top();
    queue.pop();
    Node& left = nodes[top.left];
    // Stale: the left symbol was absorbed (size 0), or either side changed since.
    if (left.symbol.size == 0 || left.symbol.id != top.left_id || left.next < 0 ||
        nodes[left.next].symbol.id != top.right_id) {
      continue;
    }
    Node& right = nodes[left.next];
    left.symbol.id = FindMerge(top.left_id, top.right_id).merged_id;
    left.symbol.size += right.symbol.size;
    left.next = right.next;
    if (right.next >= 0) nodes[right.next].prev = top.left;
    right.symbol.size = 0;
    push_pair(left.prev);
    push_pair(top.left);
  }
  for (int32_t i = 0; i >= 0; i = nodes[i].next) AppendSymbol(nodes[i].symbol, word, ids);
}

}  // namespace megatrain
