// Preference micro-batches for the pipeline tests: two pairs packed by PackPairs.
#pragma once

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "engine/common/check.h"
#include "engine/data/pair_packer.h"

namespace megatrain::testing {

// Two pairs of sequences (prompt tokens first; ids shifted by `shift`, mod vocab) in one
// micro-batch of 2 rows of 12; AttachSequences is the caller's.
inline PairBatch TwoPackedPairs(int64_t vocab, int32_t shift) {
  auto seq = [vocab, shift](std::vector<int32_t> ids, int prompt) {
    for (int32_t& id : ids) id = (id + shift) % static_cast<int32_t>(vocab);
    PreferenceSequence s{ids, std::vector<uint8_t>(ids.size(), 1)};
    std::fill(s.completion.begin(), s.completion.begin() + prompt, 0);
    return s;
  };
  const std::vector<std::pair<PreferenceSequence, PreferenceSequence>> pairs = {
      {seq({3, 7, 1, 12, 5}, 2), seq({3, 7, 9, 4}, 2)},
      {seq({5, 2, 2, 8, 14}, 1), seq({5, 11, 4, 6, 6, 2}, 1)}};
  PairBatch b;
  MT_CHECK(PackPairs(pairs, 0, 2, 12, 0, &b) == 2);
  return b;
}

// The chosen completions' tokens with a loss in b.
inline int64_t ChosenTokens(const PairBatch& b) {
  int64_t n = 0;
  for (int64_t k = 0; k < b.pairs(); ++k) n += b.completion_tokens[2 * k];
  return n;
}

}  // namespace megatrain::testing
