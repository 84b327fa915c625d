#include "engine/data/bpe_model.h"

#include <cstdio>
#include <functional>
#include <queue>

#include "absl/strings/str_cat.h"
#include "engine/data/bpe_text.h"

namespace megatrain {

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

void BpeModel::EncodeWord(absl::string_view word, std::vector<int32_t>* ids) const {
  if (word.empty()) return;
  if (ignore_merges_) {
    const int32_t id = TokenId(word);
    if (id >= 0) {
      ids->push_back(id);
      return;
    }
  }
  // Symbols as a doubly linked list over the code points of `word`.
  struct Symbol {
    int32_t id;
    uint32_t begin, size;
    int32_t prev, next;  // -1 at the ends
  };
  std::vector<Symbol> symbols;
  symbols.reserve(word.size());
  for (size_t i = 0; i < word.size();) {
    const size_t len =
        std::min<size_t>(Utf8SequenceLength(static_cast<unsigned char>(word[i])), word.size() - i);
    const int32_t index = static_cast<int32_t>(symbols.size());
    symbols.push_back({TokenId(word.substr(i, len)), static_cast<uint32_t>(i),
                       static_cast<uint32_t>(len), index - 1, index + 1});
    i += len;
  }
  symbols.back().next = -1;

  // Candidates ordered by (rank, left position); stale ones are skipped when popped.
  struct Candidate {
    int32_t rank, left, left_id, right_id;
    bool operator>(const Candidate& o) const {
      return rank != o.rank ? rank > o.rank : left > o.left;
    }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<Candidate>> queue;
  auto push_pair = [&](int32_t left) {
    if (left < 0) return;
    const int32_t right = symbols[left].next;
    if (right < 0 || symbols[left].id < 0 || symbols[right].id < 0) return;
    auto it = merges_.find(PairKey(symbols[left].id, symbols[right].id));
    if (it != merges_.end()) {
      queue.push({it->second.rank, left, symbols[left].id, symbols[right].id});
    }
  };
  for (int32_t i = 0; i + 1 < static_cast<int32_t>(symbols.size()); ++i) push_pair(i);
  while (!queue.empty()) {
    const Candidate top = queue.top();
    queue.pop();
    Symbol& left = symbols[top.left];
    // Stale: the left symbol was absorbed (size 0), or either side changed since.
    if (left.size == 0 || left.id != top.left_id || left.next < 0 ||
        symbols[left.next].id != top.right_id) {
      continue;
    }
    Symbol& right = symbols[left.next];
    left.id = merges_.find(PairKey(top.left_id, top.right_id))->second.merged_id;
    left.size += right.size;
    left.next = right.next;
    if (right.next >= 0) symbols[right.next].prev = top.left;
    right.size = 0;
    push_pair(left.prev);
    push_pair(top.left);
  }
  for (int32_t i = 0; i >= 0; i = symbols[i].next) {
    const Symbol& s = symbols[i];
    if (s.id >= 0) {
      ids->push_back(s.id);
    } else {
      AppendUnknown(word.substr(s.begin, s.size), ids);
    }
  }
}

}  // namespace megatrain
